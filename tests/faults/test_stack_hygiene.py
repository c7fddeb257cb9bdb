"""`sluice serve` as an outside tester runs it, over real processes: secrets stay out of every
command line and log, the workers refuse the client's key (they have a key of their own, made
for this run), the predictor is supervised like the workers (a SIGKILL is logged, it restarts,
and the scheduler's health says so), and a SIGKILL of `sluice serve` itself (as the OOM killer
ends it) leaves no child running; the OpenAI gateway child, killed, comes back on its HTTP port."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluice.v1 import worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "pw-4b1d7c9e-never-shown"
CLIENT_KEY = "client-key-5e2a"
PREDICTOR_HEALTH = "sluice.v1.PredictorService"
GATEWAY_HEALTH = "sluice.OpenAIGateway"


def _all_command_lines() -> str:
    lines = []
    for proc in psutil.process_iter(["cmdline"]):
        lines.append(" ".join(proc.info["cmdline"] or ()))
    return "\n".join(lines)


def _wait_for_line(path: Path, needle: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = path.read_text(errors="replace")
        if needle in text:
            return text
        time.sleep(0.1)
    raise AssertionError(f"{needle!r} not logged within {timeout_s} s:\n{path.read_text(errors='replace')[-3000:]}")


async def _health(address: str, service: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return reply.status


async def _worker_info_with(address: str, key: str) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            await worker_pb2_grpc.WorkerServiceStub(channel).Info(
                worker_pb2.InfoRequest(), timeout=5, metadata=(("authorization", f"Bearer {key}"),)
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_serve_keeps_secrets_supervises_the_predictor_and_dies_with_all_its_children(tmp_path: Path) -> None:
    log_path = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_") or k == "SLUICE_DATA_DIR"}
    env["SLUICE_REDIS_URL"] = f"redis://:{PASSWORD}@127.0.0.1:6379/0"  # as a deployment would pass it
    env["SLUICE_API_KEY"] = CLIENT_KEY
    cmd = [sys.executable, "-m", "services.cli", "serve", "--workers", "1", "--port", "0", "--load-format", "dummy"]
    cmd += ["--num-gpu-blocks", "64", "--restart-min-s", "0.2"]
    with log_path.open("w") as log:
        serve = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        text = _wait_for_line(log_path, "sluice scheduler listening on", 180)
        scheduler = text.split("sluice scheduler listening on ", 1)[1].split(" ", 1)[0]
        children = psutil.Process(serve.pid).children(recursive=True)
        assert len(children) == 2, [c.cmdline() for c in children]  # the worker and the predictor
        predictor = next(c for c in children if "predictor" in c.cmdline())
        worker = text.split("; workers ", 1)[1].split(")", 1)[0]

        command_lines = _all_command_lines()
        assert PASSWORD not in command_lines and CLIENT_KEY not in command_lines
        # the workers have a key of their own: the client's is refused, as is no key
        assert asyncio.run(_worker_info_with(worker, CLIENT_KEY)) == grpc.StatusCode.UNAUTHENTICATED
        assert asyncio.run(_health(scheduler, PREDICTOR_HEALTH)) == health_pb2.HealthCheckResponse.SERVING

        predictor.send_signal(signal.SIGKILL)
        text = _wait_for_line(log_path, "predictor restarted at", 120)
        assert "predictor (127.0.0.1:" in text and "exited with code -9" in text
        for _ in range(50):
            if asyncio.run(_health(scheduler, PREDICTOR_HEALTH)) == health_pb2.HealthCheckResponse.SERVING:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the predictor's health did not come back")

        children = psutil.Process(serve.pid).children(recursive=True)
        assert len(children) == 2
        assert PASSWORD not in _all_command_lines()
        serve.send_signal(signal.SIGKILL)  # no goodbye: what the OOM killer does
        serve.wait(10)
        _gone, alive = psutil.wait_procs(children, timeout=5)
        assert not alive, f"children left running after `sluice serve` was killed: {[p.pid for p in alive]}"
        # the predictor's log (its stderr tail was logged at its exit) shows the URL redacted
        assert PASSWORD not in log_path.read_text(errors="replace")
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait(10)


def _completion(base_url: str) -> dict | None:
    """A two-token completion from the gateway at `base_url`, or None when nothing answers there."""
    body = json.dumps({"model": "tiny-llama", "prompt": "Hello", "max_tokens": 2}).encode()
    request = urllib.request.Request(f"{base_url}/completions", body, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return json.loads(reply.read())
    except (urllib.error.URLError, ConnectionError):
        return None


def test_serve_restarts_a_killed_gateway_on_the_same_http_port(tmp_path: Path) -> None:
    log_path = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_") or k == "SLUICE_DATA_DIR"}
    cmd = [sys.executable, "-m", "services.cli", "serve", "--workers", "1", "--port", "0", "--load-format", "dummy"]
    cmd += ["--num-gpu-blocks", "64", "--no-start-predictor", "--http-port", "0", "--gateway-process"]
    cmd += ["--restart-min-s", "1"]
    with log_path.open("w") as log:
        serve = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        text = _wait_for_line(log_path, "OpenAI API at", 180)
        scheduler = text.split("sluice scheduler listening on ", 1)[1].split(" ", 1)[0]
        match = re.search(r"OpenAI API at (http://([\d.]+:\d+)/v1)", text)
        assert match, text
        base_url, http_address = match.groups()
        gateway = next(c for c in psutil.Process(serve.pid).children() if " gateway " in " ".join(c.cmdline()))
        assert _completion(base_url)["usage"]["completion_tokens"] == 2
        assert asyncio.run(_health(scheduler, GATEWAY_HEALTH)) == health_pb2.HealthCheckResponse.SERVING

        gateway.send_signal(signal.SIGKILL)
        text = _wait_for_line(log_path, "exited with code -9", 30)
        assert f"gateway ({http_address}) exited with code -9" in text
        # NOTE: it is restarted after 1 s: meanwhile the scheduler's health names it down
        assert asyncio.run(_health(scheduler, GATEWAY_HEALTH)) == health_pb2.HealthCheckResponse.NOT_SERVING
        text = _wait_for_line(log_path, "gateway restarted at", 60)
        assert f"gateway restarted at {http_address} " in text
        deadline = time.monotonic() + 30
        while (answer := _completion(base_url)) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert answer is not None, f"nothing answered at {base_url} within 30 s of the restart"
        assert answer["usage"]["completion_tokens"] == 2
        assert asyncio.run(_health(scheduler, GATEWAY_HEALTH)) == health_pb2.HealthCheckResponse.SERVING
        restarted = [c for c in psutil.Process(serve.pid).children() if " gateway " in " ".join(c.cmdline())]
        assert len(restarted) == 1 and restarted[0].pid != gateway.pid

        serve.send_signal(signal.SIGINT)
        assert serve.wait(60) == 0
        assert not restarted[0].is_running(), "the gateway stops with sluice serve"
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait(10)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--policy", "vllm:bogus=1"], "policy: 'vllm:bogus=1'"),
        (["--policy", "sarathi:budget=lots"], "policy: 'sarathi:budget=lots'"),
        (["--router", "nope"], "router: 'nope'"),
        (["--admission", "maybe"], "admission:"),
        (["--tls-cert", "missing.crt", "--tls-key", "missing.key"], "tls_cert:"),
    ],
)
def test_serve_refuses_a_bad_option_before_it_starts_any_child(flags: list[str], named: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_") or k == "SLUICE_DATA_DIR"}
    cmd = [sys.executable, "-m", "services.cli", "serve", "--port", "0", *flags]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "starting" not in done.stdout, "no worker was started"
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], done.stderr
