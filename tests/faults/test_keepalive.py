"""Idle then serve (the review's `idle_outage.py`): after longer idle than every keepalive
setting, the first requests are served on the same worker sessions; idle workers are probed,
and a step stream that breaks is re-established before the worker counts as down.

Keepalive is shortened for the test (the client pings every 0.5 s) so that an idle period of
4 s spans eight pings. Before the fix the worker's server ran with gRPC's default minimum ping
interval (5 min: the option Sluice set had a name gRPC does not know) and answered the third
ping without data with GOAWAY "too_many_pings", which broke the scheduler's idle step streams.
"""

from __future__ import annotations

import asyncio

from sluice.common.grpc_server import Keepalive
from sluice.common.prom import ServingMetrics
from sluice_bench.fault_harness import EchoWorker, metric, prompt, sampling, stack
from worker_service.server import WorkerServerOptions

SHORT = Keepalive(min_ping_interval_s=0.25, server_time_s=0.5, timeout_s=2.0)
IDLE_S = 4.0


def test_both_ends_agree_on_keepalive_by_construction() -> None:
    for k in (SHORT, Keepalive()):
        server = dict(k.server_options())
        client = dict(k.channel_options())
        # NOTE: the option gRPC reads; a misspelt one is silently ignored.
        assert server["grpc.http2.min_ping_interval_without_data_ms"] * 2 <= client["grpc.keepalive_time_ms"]
        assert "grpc.http2.min_recv_ping_interval_without_data_ms" not in server
        assert server["grpc.keepalive_permit_without_calls"] == client["grpc.keepalive_permit_without_calls"] == 1


async def test_requests_after_an_idle_period_longer_than_keepalive_are_served_on_the_same_sessions() -> None:
    workers = [await EchoWorker.start(w, options=WorkerServerOptions(keepalive=SHORT)) for w in range(2)]
    serving = ServingMetrics("tiny-llama")
    try:
        # NOTE: probes every 60 s, so only keepalive pings cross the idle connections.
        async with stack([w.address for w in workers], keepalive=SHORT, serving=serving, probe_interval_s=60.0) as s:
            first = await s.generate(token_ids=prompt(0), sampling_params=sampling(4))
            assert first.ok
            await asyncio.sleep(IDLE_S)
            after = await asyncio.gather(
                *(s.generate(token_ids=prompt(i), sampling_params=sampling(8)) for i in range(4))
            )
            loops = s.live.loops.values()
            assert [e.code.name for e in after] == ["OK"] * 4
            assert all(len(e.tokens) == 8 for e in after)
            assert [loop.num_resyncs for loop in loops] == [0, 0], "no step stream was lost while idle"
            assert all(loop.connected for loop in loops)
            for w in ("0", "1"):
                assert metric(serving, "sluice_worker_up", worker_id=w) == 1
                assert metric(serving, "sluice_worker_reconnects_total", worker_id=w) == 0
    finally:
        for w in workers:
            await w.stop()


async def test_an_idle_worker_that_restarts_is_noticed_by_its_probe_before_a_request_needs_it() -> None:
    worker = await EchoWorker.start(0)
    port = worker.address.rsplit(":", 1)[1]
    try:
        async with stack([worker.address], probe_interval_s=0.2, reconnect_min_s=0.05) as s:
            assert (await s.generate(token_ids=prompt(0), sampling_params=sampling(4))).ok
            loop = s.live.loops[0]
            await worker.stop()
            worker = await EchoWorker.start(0, port=int(port))  # a new process would hold no lease either
            for _ in range(100):
                if loop.num_resyncs or loop.last_error:
                    break
                await asyncio.sleep(0.05)
            assert loop.last_error, "the probe noticed the lost session with no request in flight"
            for _ in range(100):
                if loop.connected and s.live.cluster.healthy[0]:
                    break
                await asyncio.sleep(0.05)
            again = await s.generate(token_ids=prompt(1), sampling_params=sampling(6))
            assert again.ok and len(again.tokens) == 6
    finally:
        await worker.stop()


async def test_a_broken_step_stream_is_reestablished_and_its_requests_finish_on_the_same_worker() -> None:
    worker = await EchoWorker.start(0, step_time_s=0.01)
    serving = ServingMetrics("tiny-llama")
    try:
        async with stack([worker.address], serving=serving) as s:
            calls = [
                asyncio.ensure_future(s.generate(token_ids=prompt(i), sampling_params=sampling(30))) for i in range(6)
            ]
            loop = s.live.loops[0]
            for _ in range(200):
                if loop.num_steps >= 5:
                    break
                await asyncio.sleep(0.01)
            assert loop.remote._call is not None
            loop.remote._call.cancel()  # the stream breaks under the scheduler, the worker stays up
            endings = await asyncio.wait_for(asyncio.gather(*calls), timeout=60)
            assert [e.code.name for e in endings] == ["OK"] * 6
            assert all(len(e.tokens) == 30 for e in endings), "recomputed, with no token lost or repeated"
            assert loop.num_resyncs == 1 and loop.connected
            assert metric(serving, "sluice_worker_up", worker_id="0") == 1, "never counted as down"
            assert metric(serving, "sluice_worker_reconnects_total", worker_id="0") == 1
            assert await s.wait_idle() == 0
    finally:
        await worker.stop()
