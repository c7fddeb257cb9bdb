"""Where the worker runs a step: short steps on the event loop (no thread hop), long ones on
the engine thread so health checks are still answered, and never two engine calls at once,
even when the caller of a thread call stops waiting."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from harness import LeasedStub

from sluice.common.grpc_server import CHANNEL_OPTIONS
from sluice.contract.plan import CachedRequestData, NewRequestData, StepPlan
from sluice.contract.plan_codec import PlanSender
from sluice.contract.sampling import SamplingParams
from sluice.v1 import worker_pb2, worker_pb2_grpc
from worker_service.echo_engine import EchoEngine
from worker_service.engine import EngineConfig
from worker_service.server import SERVICE_NAME, EngineRunner, build_server

GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def plans(count: int) -> list[StepPlan]:
    """One request: its 8-token prompt, then decodes."""
    new = NewRequestData("a", tuple(range(2000, 2008)), 8, GREEDY, (0, 1, 2, 3))
    first = StepPlan(1, 0, (new,), CachedRequestData(), {"a": 8}, frozenset({"a"}))
    decodes = [StepPlan(s, 0, (), CachedRequestData(), {"a": 1}, frozenset({"a"})) for s in range(2, count + 1)]
    return [first, *decodes]


async def serve_echo(step_time_s: float) -> AsyncIterator[tuple[grpc.aio.Channel, EngineRunner, LeasedStub]]:
    engine = EchoEngine(EngineConfig(model="tiny-llama"), step_time_s=step_time_s)
    runner = EngineRunner(engine)
    server = build_server(engine, 0, runner=runner)
    await server.start(ready=False)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=CHANNEL_OPTIONS) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        warm = await stub.Warmup(worker_pb2.WarmupRequest(num_gpu_blocks_override=16))
        yield channel, runner, LeasedStub(stub, warm.session_id)
    await server.server.stop(None)


@pytest.fixture
async def fast() -> AsyncIterator[tuple[grpc.aio.Channel, EngineRunner, LeasedStub]]:
    async for pair in serve_echo(0.0):
        yield pair


@pytest.fixture
async def slow() -> AsyncIterator[tuple[grpc.aio.Channel, EngineRunner, LeasedStub]]:
    async for pair in serve_echo(0.4):
        yield pair


async def run_steps(stub: LeasedStub, steps: list[StepPlan]) -> None:
    call = stub.Execute()
    sender = PlanSender()
    for plan in steps:
        await call.write(sender.encode(plan))
        result = sender.decode(await call.read(), plan)
        assert result.error is None, result.error
    await call.done_writing()


async def test_short_steps_run_on_the_event_loop_after_the_first(
    fast: tuple[grpc.aio.Channel, EngineRunner, LeasedStub],
) -> None:
    _, runner, stub = fast
    await run_steps(stub, plans(6))
    assert (runner.thread_steps, runner.inline_steps) == (1, 5), "only the step with no history used the thread"


async def test_a_long_step_runs_on_the_thread_and_health_is_answered_meanwhile(
    slow: tuple[grpc.aio.Channel, EngineRunner, LeasedStub],
) -> None:
    channel, runner, stub = slow
    prefill, decode = plans(2)
    call = stub.Execute()
    sender = PlanSender()
    await call.write(sender.encode(prefill))
    assert sender.decode(await call.read(), prefill).error is None  # history: 0.4 s for 8 tokens
    await call.write(sender.encode(decode))  # predicted 0.05 s per token: still over the inline bound
    answer = asyncio.ensure_future(call.read())
    probe = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
    probed = time.monotonic()
    assert probe.status == health_pb2.HealthCheckResponse.SERVING
    assert not answer.done(), "the probe waited for the step"
    assert sender.decode(await answer, decode).error is None
    # On the loop, the 0.4 s step would have held the probe back until the step was over.
    assert time.monotonic() - probed > 0.1
    assert (runner.thread_steps, runner.inline_steps) == (2, 0)


async def test_a_cancelled_thread_call_still_holds_the_engine_until_it_ends() -> None:
    runner = EngineRunner(EchoEngine(EngineConfig(model="tiny-llama")))
    events: list[str] = []
    started = threading.Event()

    def long_call() -> None:
        started.set()
        time.sleep(0.3)
        events.append("long call ended")

    task = asyncio.create_task(runner.call(long_call))
    await asyncio.to_thread(started.wait)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await runner.call_inline(events.append, "next call ran")
    assert events == ["long call ended", "next call ran"]
