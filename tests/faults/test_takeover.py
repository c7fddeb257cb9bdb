"""Who gets a worker back, over real gRPC and real processes: a scheduler restarted under its
name takes its workers at once; one restarted under another name answers health while it
waits out the old lease, says so, and takes the worker the moment the lease lapses; a rival
scheduler gets one line naming the worker and the lease's time left (no traceback); and a
worker restarted under `sluice serve`'s private key cannot be squatted, 200 races in a row."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from scheduler_service.live.config import LiveConfig
from scheduler_service.live.service import LiveScheduler
from scheduler_service.server import SchedulerServer
from sluice.common.grpc_server import CHANNEL_OPTIONS
from sluice.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from sluice_bench.fault_harness import EchoWorker, prompt, sampling, spawn_worker_process, stack
from worker_service.server import WorkerServerOptions

ROOT = Path(__file__).resolve().parents[2]
HOLDER = "x-sluice-scheduler"


async def _warmup_as(address: str, holder: str, key: str | None = None) -> str:
    """A Warmup naming scheduler `holder` (a scheduler that takes the lease, then dies)."""
    metadata = [(HOLDER, holder)] + ([("authorization", f"Bearer {key}")] if key else [])
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        warm = await stub.Warmup(worker_pb2.WarmupRequest(num_gpu_blocks_override=8), metadata=metadata, timeout=10)
    return warm.session_id


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_a_scheduler_restarted_under_its_name_takes_its_workers_at_once() -> None:
    worker = await EchoWorker.start(0, options=WorkerServerOptions(lease_ttl_s=20.0))
    try:
        await _warmup_as(worker.address, "scheduler-a")  # it crashed holding a 20 s lease
        live = LiveScheduler([worker.address], LiveConfig(num_gpu_blocks=64))
        live.name = "scheduler-a"
        started = time.monotonic()
        server = await SchedulerServer.start(live)
        took = time.monotonic() - started
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = generation_pb2_grpc.GenerationServiceStub(channel)
                request = generation_pb2.GenerateRequest(token_ids=prompt(0), sampling_params=sampling(4))
                tokens = [t for m in [m async for m in stub.Generate(request)] for t in m.token_ids]
        finally:
            await server.stop(grace_s=0.5, drain_s=0.0)
        assert took < 3.0, f"waited {took:.1f} s for its own lease"
        assert len(tokens) == 4
    finally:
        await worker.stop()


async def test_a_restarted_scheduler_answers_health_says_what_it_waits_for_and_takes_the_worker_when_the_lease_lapses(
    caplog: pytest.LogCaptureFixture,
) -> None:
    worker = await EchoWorker.start(0, options=WorkerServerOptions(lease_ttl_s=3.0))
    try:
        await _warmup_as(worker.address, "old-pod:50051")  # its previous incarnation, elsewhere
        lapses_at = time.monotonic() + 3.0
        port = _free_port()
        live = LiveScheduler([worker.address], LiveConfig(num_gpu_blocks=64, connect_timeout_s=30.0))
        with caplog.at_level(logging.WARNING, logger="scheduler_service.live.remote"):
            starting = asyncio.ensure_future(SchedulerServer.start(live, port))
            await asyncio.sleep(0.8)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)
                alive = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                ready = await health.Check(
                    health_pb2.HealthCheckRequest(service="sluice.v1.GenerationService"), timeout=2
                )
                stub = generation_pb2_grpc.GenerationServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as waiting:
                    await stub.GetServerInfo(generation_pb2.GetServerInfoRequest(), timeout=2)
            server = await starting
        took_after_lapse = time.monotonic() - lapses_at
        await server.stop(grace_s=0.5, drain_s=0.0)
        assert alive.status == health_pb2.HealthCheckResponse.SERVING
        assert ready.status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert waiting.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"the lease of worker {worker.address} to lapse" in waiting.value.details()
        assert any("waiting for the lease of worker" in r.getMessage() for r in caplog.records)
        assert took_after_lapse < 1.0, f"took the worker {took_after_lapse:.2f} s after its lease lapsed"
    finally:
        await worker.stop()


@pytest.mark.slow
async def test_a_rival_scheduler_gets_one_line_naming_the_worker_and_the_time_left() -> None:
    worker = await EchoWorker.start(0)
    try:
        async with stack([worker.address], probe_interval_s=1.0):
            env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_") or k == "SLUICE_DATA_DIR"}
            cmd = [sys.executable, "-m", "services.cli", "scheduler", "--worker", worker.address, "--port", "0"]
            rival = await asyncio.to_thread(
                subprocess.run, cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
            )
        lines = [line for line in rival.stderr.splitlines() if line.strip()]
        assert rival.returncode == 1
        errors = [line for line in lines if line.startswith("error: ")]
        assert len(errors) == 1, rival.stderr
        assert f"worker {worker.address}" in errors[0] and "leased to scheduler" in errors[0]
        assert "lapses in" in errors[0] and "its holder renewed it" in errors[0]
        assert "Traceback" not in rival.stderr
    finally:
        await worker.stop()


@pytest.mark.slow
async def test_a_restarted_worker_with_the_private_key_cannot_be_squatted_in_200_races() -> None:
    worker_key, client_key = "private-worker-key-per-run", "the-client-key"
    extra = ("--lease-ttl-s", "20")
    env_key = {"SLUICE_API_KEY": worker_key}
    first = await spawn_worker_process(0, extra=extra, env=env_key)
    first.kill()  # SIGKILL, then started again on its port, as the supervisor does
    worker = await spawn_worker_process(0, port=first.port, extra=extra, env=env_key)
    try:
        async with grpc.aio.insecure_channel(worker.address, options=CHANNEL_OPTIONS) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            ours = (("authorization", f"Bearer {worker_key}"), (HOLDER, "serve-scheduler"))

            async def squat(key: str | None) -> bool:
                metadata = (("authorization", f"Bearer {key}"),) if key else ()
                try:
                    await stub.Warmup(worker_pb2.WarmupRequest(num_gpu_blocks_override=8), metadata=metadata)
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAUTHENTICATED, exc.details()
                    return False
                return True

            async def take() -> str:
                warm = await stub.Warmup(worker_pb2.WarmupRequest(num_gpu_blocks_override=8), metadata=ours)
                return warm.session_id

            takeovers = 0
            for i in range(200):
                # the lease is free (as right after a restart): squatters race the scheduler
                results = await asyncio.gather(squat(client_key), squat(None), take())
                takeovers += results[0] + results[1]
                assert results[2], f"round {i}: the scheduler did not get its worker"
                session = results[2]
                await stub.Release(
                    worker_pb2.ReleaseRequest(end_lease=True),
                    metadata=(*ours[:1], ("x-sluice-session", session)),
                )
        assert takeovers == 0
    finally:
        worker.stop()
