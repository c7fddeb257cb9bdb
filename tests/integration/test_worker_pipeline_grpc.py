"""The worker's engine pipeline over real gRPC (echo engine with an emulated async device,
`--worker-pipeline on`): requests the step before finished are left out of the next step's
answer, whether that step was launched before or after the one it follows was collected; a
plan that fails voids the plan made after it; a request released while its step is in flight
is forgotten; nothing stays held."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from scheduler_service.live.remote import RemoteWorker, WarmupOptions
from sluice.contract.plan import CachedRequestData, NewRequestData, StepPlan
from sluice.contract.sampling import SamplingParams
from worker_service.echo_engine import EchoEngine
from worker_service.engine import EngineConfig, LLMEngine
from worker_service.server import EngineRunner, WorkerServerOptions, build_server

BLOCK = 4
PROMPT = 4
DEVICE_S = 0.5  # long enough that a plan sent on an answer arrives while the next step runs, even on a busy machine


def plan(step: int, scheduled: dict[str, int], follows: int = 0, new=(), release=()) -> StepPlan:
    return StepPlan(
        step_id=step,
        worker_id=0,
        new_requests=tuple(new),
        cached_requests=CachedRequestData(),
        num_scheduled_tokens=scheduled,
        sample_ids=frozenset(scheduled),
        release_ids=tuple(release),
        follows_step_id=follows,
    )


@pytest.fixture
async def worker() -> AsyncIterator[tuple[RemoteWorker, EchoEngine, EngineRunner]]:
    engine = EchoEngine(EngineConfig(model="tiny-llama", block_size=BLOCK), step_time_s=DEVICE_S, async_device=True)
    runner = EngineRunner(engine, "on", step_spans=False)
    server = build_server(engine, 0, runner=runner, options=WorkerServerOptions(pipeline="on"))
    await server.start(ready=False)
    remote = RemoteWorker(0, f"127.0.0.1:{server.port}", step_timeout_s=10.0)
    await remote.connect(WarmupOptions(num_gpu_blocks=64, swap_space_gib=0.0), 30.0)
    yield remote, engine, runner
    await remote.close()
    await server.server.stop(None)


def requests(engine: EchoEngine) -> list[NewRequestData]:
    """r_token: its second output token is one of its stop token ids; r_count: max_tokens=2;
    r_on: runs on. Each holds blocks for eight tokens."""
    second = engine._cycle[(PROMPT + 1) % len(engine._cycle)]  # the echo engine's token at that position
    sampling = {
        "r_token": SamplingParams(temperature=0.0, max_tokens=100, stop_token_ids=(second,)),
        "r_count": SamplingParams(temperature=0.0, max_tokens=2),
        "r_on": SamplingParams(temperature=0.0, max_tokens=100),
    }
    return [
        NewRequestData(rid, tuple(range(2000, 2000 + PROMPT)), PROMPT, sp, (2 * i, 2 * i + 1))
        for i, (rid, sp) in enumerate(sampling.items())
    ]


@pytest.mark.parametrize("ahead", [True, False], ids=["launched-ahead", "launched-after-collect"])
async def test_requests_the_step_before_finished_are_left_out_of_the_answer(worker, ahead: bool) -> None:
    remote, engine, runner = worker
    news = requests(engine)
    ids = [n.request_id for n in news]
    await remote.send(plan(1, dict.fromkeys(ids, PROMPT), new=news))
    await remote.send(plan(2, dict.fromkeys(ids, 1), follows=1))
    first = await remote.receive()
    assert set(first.sampled_token_ids) == set(ids)
    launched_ahead_before_3 = runner.launched_ahead  # step 2 was launched before step 1 was collected
    if ahead:  # as the overlapped scheduler sends: step 3 while step 2 runs
        await remote.send(plan(3, dict.fromkeys(ids, 1), follows=2))
        second = await remote.receive()
    else:
        second = await remote.receive()
        await remote.send(plan(3, dict.fromkeys(ids, 1), follows=2))
    assert set(second.sampled_token_ids) == set(ids)
    third = await remote.receive()
    assert third.error is None
    assert set(third.sampled_token_ids) == {"r_on"}, "finished by a stop token and by max_tokens: no token"
    entries = engine.book.entries
    assert entries["r_count"].num_computed_tokens == PROMPT + 1, "ended by count: left out before launch"
    step_3_ahead = runner.launched_ahead > launched_ahead_before_3
    if ahead and not step_3_ahead:
        # Plan 3 reached the worker only after step 2's emulated device time had passed (an
        # overloaded machine stalled this test for DEVICE_S): the case under test did not occur.
        pytest.skip("plan 3 arrived after step 2 was collected; the launched-ahead case did not happen")
    assert step_3_ahead == ahead
    # ended by its token: known only once step 2's tokens are back, so computed when launched ahead
    assert entries["r_token"].num_computed_tokens == PROMPT + (2 if ahead else 1)
    await remote.send(plan(4, {}, release=ids))
    assert (await remote.receive()).error is None
    assert engine.num_requests == 0, "nothing stays held"


async def test_a_failed_plan_voids_the_plan_made_after_it_and_the_stream_goes_on(worker) -> None:
    remote, engine, _ = worker
    news = requests(engine)[2:]
    await remote.send(plan(1, {"r_on": PROMPT}, new=news))
    await remote.send(plan(2, {"nope": 1}, follows=1))  # schedules a request the worker never had
    await remote.send(plan(3, {"r_on": 1}, follows=2))
    assert (await remote.receive()).error is None
    failed = await remote.receive()
    assert failed.error is not None and failed.error.code == "INVALID_ARGUMENT"
    void = await remote.receive()
    assert void.error is not None and void.error.code == "CANCELLED", "planned on a step that failed"
    assert engine.book.entries["r_on"].num_computed_tokens == PROMPT, "the void step ran nothing"
    await remote.send(plan(4, {"r_on": 1}))
    assert set((await remote.receive()).sampled_token_ids) == {"r_on"}
    await remote.send(plan(5, {}, release=["r_on"]))
    await remote.receive()
    assert engine.num_requests == 0


async def test_a_request_released_while_its_step_is_in_flight_is_forgotten(worker) -> None:
    remote, engine, runner = worker
    news = requests(engine)[1:]
    ids = [n.request_id for n in news]
    await remote.send(plan(1, dict.fromkeys(ids, PROMPT), new=news))
    await remote.send(plan(2, {"r_on": 1}, follows=1, release=["r_count"]))  # an abort, planned ahead
    assert set((await remote.receive()).sampled_token_ids) == set(ids), "the step in flight answers for both"
    assert set((await remote.receive()).sampled_token_ids) == {"r_on"}
    assert set(engine.book.entries) == {"r_on"}
    assert runner.launched_ahead > 0
    await remote.send(plan(3, {}, release=["r_on"]))
    await remote.receive()
    assert engine.num_requests == 0


async def test_a_stream_that_ends_with_steps_launched_collects_them() -> None:
    """The scheduler's stream breaks right after a step was launched ahead on a torch engine:
    once the stream is gone nothing is left uncollected and each request's tokens are back in
    its history (the leak check of the engine's pipeline)."""
    engine = LLMEngine(EngineConfig(model="tiny-llama", load_format="dummy", block_size=BLOCK))
    runner = EngineRunner(engine, "on", step_spans=False)
    server = build_server(engine, 0, runner=runner, options=WorkerServerOptions(pipeline="on"))
    await server.start(ready=False)
    remote = RemoteWorker(0, f"127.0.0.1:{server.port}", step_timeout_s=30.0)
    try:
        await remote.connect(WarmupOptions(num_gpu_blocks=64, swap_space_gib=0.0), 60.0)
        news = requests(EchoEngine(EngineConfig(model="tiny-llama", block_size=BLOCK)))[2:]
        await remote.send(plan(1, {"r_on": PROMPT}, new=news))
        await remote.send(plan(2, {"r_on": 1}, follows=1))
        await remote.receive()
        await remote.close()
        for _ in range(100):
            if not engine._uncollected:
                break
            await asyncio.sleep(0.05)
        assert not engine._uncollected
        state = engine.requests["r_on"]
        assert not state.pending and len(state.token_ids) == PROMPT + 2
    finally:
        await server.server.stop(None)
