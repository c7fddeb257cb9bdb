"""Offline-class requests yield to online ones (scheduler_service/core/offline.py), over real
gRPC and echo-engine workers: under overload the online requests admitted meet their SLO
while every offline request is admitted and finishes OK; an online request sent behind a
large offline backlog is served ahead of it (with the offline queue off, the same request is
refused SLO_UNMEETABLE); the offline queue's own bound refuses with RESOURCE_EXHAUSTED,
RetryInfo and ErrorInfo OFFLINE_QUEUE_FULL, naming the offline queue, while online requests
are still admitted."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from sluice.common.prom import ServingMetrics
from sluice.v1 import common_pb2, generation_pb2
from sluice_bench.fault_harness import EchoWorker, Ending, Stack, metric, prompt, sampling, stack
from worker_service.echo_engine import EchoEngine
from worker_service.engine import EngineConfig

OFFLINE = common_pb2.SloSpec(slo_class=common_pb2.SLO_CLASS_OFFLINE)


async def _workers(n: int, step_s: float, token_s: float = 0.0) -> list[EchoWorker]:
    engine = lambda: EchoEngine(EngineConfig(model="tiny-llama"), step_time_s=step_s, token_time_s=token_s)  # noqa: E731
    return [await EchoWorker.start(w, engine=engine()) for w in range(n)]


async def _stop(workers: list[EchoWorker]) -> None:
    for w in workers:
        await w.stop()


async def _wait_for(predicate: object, timeout_s: float) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():  # type: ignore[operator]
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in time")


@pytest.mark.slow
async def test_under_overload_admitted_online_requests_meet_their_slo_and_all_offline_ones_finish_ok() -> None:
    # NOTE: 10 ms + 2 ms per token: the TBT SLO bounds a worker's batch near 30, about 30 requests/s
    # for the two; online requests come at about 3x that for 2 s, the offline ones all at once.
    workers = await _workers(2, 0.010, 0.002)
    slo = common_pb2.SloSpec(ttft_ms=1500, tbt_ms=250)
    try:
        async with stack([w.address for w in workers], num_gpu_blocks=512) as s:

            async def online(i: int) -> object:
                await asyncio.sleep(i * 0.02)
                return await s.generate(token_ids=prompt(i, 16), sampling_params=sampling(12), slo=slo)

            offline = [
                s.generate(token_ids=prompt(1000 + i, 16), sampling_params=sampling(12), slo=OFFLINE) for i in range(80)
            ]
            endings = await asyncio.gather(*offline, *(online(i) for i in range(100)))
            assert await s.wait_idle() == 0
    finally:
        await _stop(workers)
    off, on = endings[:80], endings[80:]
    assert [e.code for e in off] == [grpc.StatusCode.OK] * 80, {e.code for e in off}
    assert all(len(e.tokens) == 12 for e in off)
    admitted = [e for e in on if e.ok]
    refused = [e for e in on if not e.ok]
    assert {e.code for e in refused} <= {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert refused, "a 3x online overload is expected to be partly refused"
    assert len(admitted) >= 20
    attainment = sum(e.slo_met for e in admitted) / len(admitted)
    assert attainment >= 0.9, (attainment, len(admitted))


async def _backlog_then_online(s: Stack, backlog: int) -> tuple[Ending, int]:
    """`backlog` offline requests, then (once the worker runs some and its speed is measured)
    one online request: its ending, and how many offline requests had finished by then."""
    done: list[bool] = []

    async def offline(i: int) -> None:
        ending = await s.generate(token_ids=prompt(500 + i), sampling_params=sampling(32), slo=OFFLINE)
        done.append(ending.ok)

    tasks = [asyncio.ensure_future(offline(i)) for i in range(backlog)]
    sched, fit = s.live.cluster.schedulers[0], s.live.speeds[0]
    await _wait_for(lambda: len(sched.running) >= 4 and fit.num_samples >= fit.min_samples, 10)
    slo = common_pb2.SloSpec(ttft_ms=2000, tbt_ms=500)
    ending = await s.generate(token_ids=prompt(1), sampling_params=sampling(4), slo=slo)
    finished_before = len(done)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return ending, finished_before


async def test_an_online_request_behind_a_large_offline_backlog_is_served_first() -> None:
    workers = await _workers(1, 0.010)
    try:
        async with stack([w.address for w in workers], max_num_seqs=4) as s:
            ending, finished_before = await _backlog_then_online(s, 60)
            assert ending.ok and len(ending.tokens) == 4, ending
            # NOTE: the backlog is 15 waves of 4 seats, 32 steps each; the online request is
            # served within the first one or two
            assert finished_before <= 8, finished_before
            assert await s.wait_idle() == 0
        async with stack([w.address for w in workers], max_num_seqs=4, max_offline_waiting=0) as s:
            ending, _ = await _backlog_then_online(s, 60)
            # the behaviour before: queued behind the backlog, whose length admission refuses
            assert ending.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "TTFT" in ending.details, ending
    finally:
        await _stop(workers)


async def test_the_offline_queue_bound_refuses_naming_it_while_online_requests_are_admitted() -> None:
    workers = await _workers(1, 0.010)
    serving = ServingMetrics("tiny-llama")
    try:
        async with stack([w.address for w in workers], serving=serving, max_num_seqs=2, max_offline_waiting=3) as s:
            calls = []
            for i in range(8):
                calls.append(
                    s.stub.Generate(
                        generation_pb2.GenerateRequest(
                            token_ids=prompt(i), sampling_params=sampling(100), slo=OFFLINE, request_id=f"off-{i}"
                        )
                    )
                )
                await asyncio.sleep(0.05)  # NOTE: the worker takes the first ones into its 2 seats
            online = await s.generate(token_ids=prompt(99), sampling_params=sampling(4))
            endings = await asyncio.gather(*(s.collect(c) for c in calls))
            statuses = [await rpc_status.aio.from_call(c) for c in calls]
            assert await s.wait_idle() == 0
    finally:
        await _stop(workers)
    assert online.ok and len(online.tokens) == 4, online
    ok = [e for e in endings if e.ok]
    refused = [(e, st) for e, st in zip(endings, statuses, strict=True) if not e.ok]
    # 2 on the worker's seats, 3 in the offline queue: 100 steps each outlast the 8 sends
    assert len(ok) == 5 and all(len(e.tokens) == 100 for e in ok), [e.code for e in endings]
    assert len(refused) == 8 - len(ok)
    for ending, status in refused:
        assert ending.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "offline queue is full (3 requests" in ending.details, ending.details
        info, retry = error_details_pb2.ErrorInfo(), error_details_pb2.RetryInfo()
        kinds = {d.type_url.rsplit("/", 1)[-1]: d for d in status.details}
        kinds["google.rpc.ErrorInfo"].Unpack(info)
        assert info.reason == "OFFLINE_QUEUE_FULL"
        assert kinds["google.rpc.RetryInfo"].Unpack(retry)
    admitted = metric(serving, "sluice_admission_decisions_total", decision="admit", reason="offline_queue")
    full = metric(serving, "sluice_admission_decisions_total", decision="refuse", reason="offline_queue_full")
    assert (admitted, full) == (len(ok), len(refused))
