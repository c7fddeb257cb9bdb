"""`sluice serve` supervises its workers: a worker process killed with SIGKILL is logged with
its exit code and the last lines of its stderr, started again on the same port, and taken back
by the scheduler; when that port has been taken meanwhile, the worker starts on a new one and
the scheduler is told the new address."""

from __future__ import annotations

import asyncio
import logging
import socket

import grpc
import pytest

from services.serve import ServeConfig, Supervisor, start_scheduler, start_workers
from sluice.v1 import common_pb2, generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.slow


async def _served(stub: generation_pb2_grpc.GenerationServiceStub, i: int) -> int:
    request = generation_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=list(range(3000 + i, 3020 + i))),
        sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
    )
    return sum([len(m.token_ids) async for m in stub.Generate(request, timeout=60)])


async def _until_healthy(stub: generation_pb2_grpc.GenerationServiceStub, timeout_s: float = 90.0) -> str:
    for _ in range(int(timeout_s / 0.1)):
        info = await stub.GetServerInfo(generation_pb2.GetServerInfoRequest())
        if info.workers[0].healthy:
            return info.workers[0].address
        await asyncio.sleep(0.1)
    raise AssertionError("the worker was not taken back")


async def _restarted(supervisor: Supervisor, count: int, timeout_s: float = 90.0) -> None:
    for _ in range(int(timeout_s / 0.1)):
        if supervisor.num_restarts >= count:
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the supervisor did not restart the worker")


async def _noticed(server: object, resyncs: int, timeout_s: float = 30.0) -> None:
    """Until the scheduler has noticed the loss (a new session, or the worker marked down)."""
    live = server.live  # type: ignore[attr-defined]
    for _ in range(int(timeout_s / 0.05)):
        if live.loops[0].num_resyncs > resyncs or not live.cluster.healthy[0]:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the scheduler did not notice the lost worker")


async def test_a_killed_worker_is_logged_restarted_and_taken_back_by_the_scheduler(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = ServeConfig(
        workers=1,
        port=0,
        num_gpu_blocks=64,
        worker_threads=1,
        restart_min_s=0.2,
        reconnect_max_s=0.5,
        probe_interval_s=0.2,
    )
    supervisor = Supervisor(cfg, await start_workers(cfg))
    server = await start_scheduler(cfg, [w.address for w in supervisor.workers])
    supervisor.on_address = server.live.readdress
    supervisor.start()
    first = supervisor.workers[0]
    blocker = socket.socket()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            assert await _served(stub, 0) == 6
            loop = server.live.loops[0]
            with caplog.at_level(logging.ERROR, logger="services.serve"):
                resyncs = loop.num_resyncs
                first.proc.kill()
                await _restarted(supervisor, 1)
                await _noticed(server, resyncs)
            same_port = await _until_healthy(stub)
            assert await _served(stub, 1) == 6

            # The port is taken while the worker is down: it comes back on another one.
            second = supervisor.workers[0]
            resyncs = loop.num_resyncs
            second.proc.kill()
            await second.proc.wait()
            # NOTE: SO_REUSEADDR: the killed worker's closed connections may hold the port in
            # TIME_WAIT; a listening socket with it still keeps the restarted worker off the port
            blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            blocker.bind(("127.0.0.1", second.port))
            blocker.listen()
            await _restarted(supervisor, 2)
            await _noticed(server, resyncs)
            moved = await _until_healthy(stub)
            assert await _served(stub, 2) == 6
    finally:
        await server.stop(grace_s=1.0, drain_s=0.0)
        await supervisor.stop()
        blocker.close()
    exits = [r.getMessage() for r in caplog.records if "exited with code" in r.getMessage()]
    assert exits and "exited with code -9" in exits[0]
    assert "warmed up" in exits[0], "the tail of the worker's stderr is in the log"
    assert same_port == first.address
    assert moved != same_port
    assert supervisor.workers[0].proc.returncode is not None, "stopped at the end"
