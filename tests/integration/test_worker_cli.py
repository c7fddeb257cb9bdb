"""`sluice worker` as a process: it prints where it listens, takes its flags as Warmup
defaults, serves its Prometheus metrics with --metrics-port, and shuts down cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
import urllib.request

import grpc

from sluice.common.grpc_server import CHANNEL_OPTIONS
from sluice.v1 import worker_pb2, worker_pb2_grpc

START = "from services.worker import main; raise SystemExit(main())"


async def _listening_port(proc: asyncio.subprocess.Process) -> int:
    assert proc.stdout is not None
    while line := (await asyncio.wait_for(proc.stdout.readline(), timeout=60)).decode():
        if match := re.search(r"listening on 127\.0\.0\.1:(\d+)", line):
            return int(match.group(1))
    raise AssertionError("the worker exited without saying where it listens")


async def _metrics_port(proc: asyncio.subprocess.Process) -> int:
    assert proc.stdout is not None
    while line := (await asyncio.wait_for(proc.stdout.readline(), timeout=60)).decode():
        if match := re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", line):
            return int(match.group(1))
    raise AssertionError("the worker exited without saying where its metrics are")


async def test_sluice_worker_serves_with_its_flags_until_sigterm() -> None:
    flags = ["--host", "127.0.0.1", "--port", "0", "--num-gpu-blocks", "24", "--swap-space-gib", "0.001"]
    flags += ["--metrics-port", "0"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", START, *flags, "--worker-id", "5", stdout=asyncio.subprocess.PIPE, stderr=None
    )
    try:
        metrics_port = await _metrics_port(proc)
        port = await _listening_port(proc)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            info = await stub.Info(worker_pb2.InfoRequest(), timeout=10)
            warm = await stub.Warmup(worker_pb2.WarmupRequest(), timeout=30)
        assert info.worker_id == "5" and info.model == "tiny-llama"
        assert warm.num_gpu_blocks == 24, "--num-gpu-blocks is used when Warmup gives no override"
        assert warm.num_cpu_blocks == int(0.001 * 2**30) // warm.bytes_per_block
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
        assert 'sluice_worker_ready{model_name="tiny-llama",worker_id="5"} 1.0' in text
        assert "sluice_worker_step_errors_total" in text
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), timeout=20) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
