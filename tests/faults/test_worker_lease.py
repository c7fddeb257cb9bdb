"""A worker serves one scheduler (the review's `worker_takeover.py` and `worker_squat.py`).

While a scheduler streams a request through a worker, a foreign client's Release of that
request, Warmup of the worker and an Execute that claims every KV block are all refused and
the request finishes untouched; a lease lapses when its holder stops calling (a restarted
scheduler takes its workers back) and is given up at once by a scheduler that shuts down. A
worker whose state diverged from the scheduler's (here: a squatter using a stolen session) is
detected by the block conflict it reports (ABORTED), warmed up again, and every request
finishes on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc
import pytest

from sluice.common.grpc_server import CHANNEL_OPTIONS
from sluice.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from sluice_bench.fault_harness import EchoWorker, prompt, sampling, stack
from worker_service.server import WorkerServerOptions

SESSION = "x-sluice-session"


def foreign(address: str) -> tuple[grpc.aio.Channel, worker_pb2_grpc.WorkerServiceStub]:
    channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    return channel, worker_pb2_grpc.WorkerServiceStub(channel)


def squat(blocks: Sequence[int] = range(64)) -> worker_pb2.ExecuteRequest:
    """The review's squatter: one new request that claims every KV block of the worker."""
    return worker_pb2.ExecuteRequest(
        step_id=1,
        new_requests=[
            worker_pb2.NewRequest(
                request_id="squatter",
                prompt_token_ids=[1000] * 16,
                sampling_params=common_pb2.SamplingParams(max_tokens=1, temperature=0),
                block_ids=list(blocks),
            )
        ],
        scheduled_ids=["squatter"],
        num_scheduled_tokens=[16],
        sample=[False],
    )


async def refused(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    return info.value


async def test_a_foreign_client_can_neither_release_nor_warm_up_nor_squat_a_leased_worker() -> None:
    worker = await EchoWorker.start(0, step_time_s=0.01)
    channel, stub = foreign(worker.address)
    try:
        async with stack([worker.address]) as s:
            victim = asyncio.ensure_future(
                s.generate(request_id="victim", token_ids=prompt(0), sampling_params=sampling(60))
            )
            while worker.engine.num_requests == 0:
                await asyncio.sleep(0.01)
            no_session = await refused(stub.Release(worker_pb2.ReleaseRequest(request_ids=["victim"])))
            guessed = await refused(
                stub.Release(worker_pb2.ReleaseRequest(request_ids=["victim"]), metadata=((SESSION, "guess"),))
            )
            warm = await refused(stub.Warmup(worker_pb2.WarmupRequest(num_gpu_blocks_override=512)))
            execute = stub.Execute()
            await execute.write(squat())
            squatted = await refused(execute.read())
            assert worker.engine.num_requests == 1, "the victim is still held, nothing was wiped or added"
            ending = await victim
            later = await asyncio.gather(
                *(s.generate(token_ids=prompt(i), sampling_params=sampling(8)) for i in range(4))
            )
            stats = await s.stats()
        assert no_session.code() == grpc.StatusCode.FAILED_PRECONDITION and SESSION in no_session.details()
        assert guessed.code() == grpc.StatusCode.PERMISSION_DENIED and SESSION in guessed.details()
        assert warm.code() == grpc.StatusCode.FAILED_PRECONDITION and "leased to scheduler" in warm.details()
        assert squatted.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert ending.ok and len(ending.tokens) == 60
        assert all(e.ok and len(e.tokens) == 8 for e in later)
        assert [(w.healthy, w.gpu_blocks_used) for w in stats.workers] == [(True, 0)]
    finally:
        await channel.close()
        await worker.stop()


async def test_a_scheduler_that_shuts_down_gives_its_lease_up() -> None:
    worker = await EchoWorker.start(0)
    channel, stub = foreign(worker.address)
    try:
        async with stack([worker.address]) as s:
            assert (await s.generate(token_ids=prompt(0), sampling_params=sampling(4))).ok
            refusal = await refused(stub.Warmup(worker_pb2.WarmupRequest(num_gpu_blocks_override=8)))
            assert refusal.code() == grpc.StatusCode.FAILED_PRECONDITION
        warm = await stub.Warmup(worker_pb2.WarmupRequest(num_gpu_blocks_override=8))
        assert warm.session_id, "taken at once, without waiting for the lease to lapse"
    finally:
        await channel.close()
        await worker.stop()


async def test_a_lease_whose_holder_went_silent_lapses_and_a_new_scheduler_takes_the_worker() -> None:
    worker = await EchoWorker.start(0, options=WorkerServerOptions(lease_ttl_s=0.6))
    channel, stub = foreign(worker.address)
    try:
        # A scheduler that died: it took the lease and never called again.
        await stub.Warmup(worker_pb2.WarmupRequest(num_gpu_blocks_override=8))
        async with stack([worker.address], connect_timeout_s=20.0) as s:
            ending = await s.generate(token_ids=prompt(0), sampling_params=sampling(6))
            loop = s.live.loops[0]
            await asyncio.sleep(1.0)  # longer than the lease: the scheduler's probes keep it
            again = await s.generate(token_ids=prompt(1), sampling_params=sampling(6))
            assert loop.probe_interval_s <= 0.6 / 4
            assert loop.num_resyncs == 0
        assert ending.ok and again.ok
    finally:
        await channel.close()
        await worker.stop()


async def test_a_worker_whose_state_diverged_is_warmed_up_again_and_every_request_finishes() -> None:
    worker = await EchoWorker.start(0, step_time_s=0.005)
    channel, stub = foreign(worker.address)
    try:
        async with stack([worker.address], num_gpu_blocks=64) as s:
            loop = s.live.loops[0]
            calls = [
                asyncio.ensure_future(s.generate(token_ids=prompt(i), sampling_params=sampling(40))) for i in range(3)
            ]
            while loop.num_steps < 3:
                await asyncio.sleep(0.005)
            # A squatter with a stolen session takes every block nobody holds yet.
            free = [b for b in range(64) if b not in worker.engine.gpu_owner]
            execute = stub.Execute(metadata=((SESSION, loop.remote.session),))
            await execute.write(squat(free))
            assert (await execute.read()).error.code == ""
            more = [
                asyncio.ensure_future(s.generate(token_ids=prompt(10 + i), sampling_params=sampling(40)))
                for i in range(3)
            ]
            endings = await asyncio.wait_for(asyncio.gather(*calls, *more), timeout=60)
            # NOTE: the worker hears of the last releases with the next step (one later with
            # overlap, whose planned-ahead step runs first), so poll for a few seconds.
            for _ in range(100):
                held = (await stub.Health(worker_pb2.HealthRequest())).num_requests
                if held == 0:
                    break
                await asyncio.sleep(0.05)
            stats = await s.stats()
        assert [e.code.name for e in endings] == ["OK"] * 6, [e.details for e in endings]
        assert all(len(e.tokens) == 40 for e in endings)
        assert loop.num_resyncs >= 1, "the conflict was detected and the worker warmed up again"
        assert held == 0 and "squatter" not in worker.engine.requests
        assert stats.workers[0].healthy
    finally:
        await channel.close()
        await worker.stop()
