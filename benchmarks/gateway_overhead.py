"""What the OpenAI HTTP gateway adds to the gRPC path: TTFT and throughput through HTTP vs gRPC,
side by side in one run (interleaved rounds, the first backend alternating), and the gateway's
CPU per streamed token.

    echo worker process (`sluice worker --engine echo`: no model, every step returns at once)
      <- `sluice scheduler` process <- gRPC <- this process (SluiceClient, the gRPC bench)
                                    <- gRPC <- `sluice gateway` process <- HTTP <- this process
                                                                            (OpenAIBench, aiohttp)

Scenarios (each run as `sluice bench` runs them, by services/bench.run_requests, on both paths):
    sequential   one request at a time, 64 tokens: TTFT with nothing queued
    demo         the load of `sluice serve --demo` (40 requests of azure-conv over 8 s, prompts
                 x1/8 <= 256 tokens, outputs x1/4 <= 64): TTFT p50 / p99
    saturation   closed loop, --concurrency streams of --sat-tokens tokens: tokens/s, and the
                 gateway's CPU seconds (utime + stime from /proc) per streamed token

    python benchmarks/gateway_overhead.py --rounds 3 --json docs/results/openai_api.json

Targets (issue 24): HTTP adds <= 1 ms to TTFT p50 at the demo's load, costs <= 5% of the
throughput at saturation, and streams >= 1,000 tokens/s per core of the gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from live_common import ROOT, WorkerProcess, spawn_worker

from scheduler_service.core.slo import NO_SLO, SLOSpec
from services.bench import BenchRequest, run_requests, summarize, synthetic_prompt
from services.bench_openai import OpenAIBench
from sluice.common.client import SluiceClient

_LISTENING = re.compile(r"listening on ([\w.\-]+):(\d+)")
BACKENDS = ("grpc", "http")


def spawn_service(args: list[str], name: str, log_dir: Path, timeout_s: float = 60.0) -> tuple[subprocess.Popen, int]:
    """A `sluice` command as a process; its port from the "listening on" line of its stdout."""
    log = (log_dir / f"sluice-gateway-bench-{name}-{os.getpid()}.log").open("w")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "services.cli", *args]
    process = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    deadline = time.monotonic() + timeout_s
    assert process.stdout is not None
    for line in process.stdout:
        match = _LISTENING.search(line)
        if match:
            return process, int(match.group(2))
        if time.monotonic() > deadline:
            break
    process.kill()
    raise RuntimeError(f"{name} did not start ({' '.join(cmd)}); see {log.name}")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------- workloads


def demo_load(tag: str) -> list[BenchRequest]:
    from services.serve import DemoOptions, demo_requests

    opts = DemoOptions()
    slo = SLOSpec(ttft_s=opts.ttft_ms / 1e3, tbt_s=opts.tbt_ms / 1e3)
    return [
        BenchRequest(
            f"{tag}-demo-{i}", r.arrival_s, tuple(r.prompt_ids), len(r.prompt_ids), r.max_tokens, slo, ignore_eos=True
        )
        for i, r in enumerate(demo_requests(opts, "tiny-llama"))
    ]


def fixed_load(tag: str, n: int, prompt_tokens: int, max_tokens: int) -> list[BenchRequest]:
    return [
        BenchRequest(
            f"{tag}-{i}", None, synthetic_prompt(prompt_tokens, i), prompt_tokens, max_tokens, NO_SLO, ignore_eos=True
        )
        for i in range(n)
    ]


# ---------------------------------------------------------------- one round


async def one_round(
    clients: dict[str, Any], backend: str, scenario: str, tag: str, args: argparse.Namespace, gateway_pid: int
) -> dict[str, Any]:
    client = clients[backend]
    concurrency: int | None
    if scenario == "sequential":
        requests, concurrency = fixed_load(tag, args.seq_requests, 32, 64), 1
    elif scenario == "demo":
        requests, concurrency = demo_load(tag), None
    else:
        requests, concurrency = fixed_load(tag, args.sat_requests, 32, args.sat_tokens), args.concurrency
    cpu0 = cpu_seconds(gateway_pid)
    start = time.perf_counter()
    records = await run_requests(client, requests, concurrency=concurrency, progress=False)
    wall = time.perf_counter() - start
    gateway_cpu = cpu_seconds(gateway_pid) - cpu0
    metrics = summarize(records, policy="vllm", workload=scenario).metrics
    tokens = sum(len(r.token_times) for r in records)
    errors = sum(1 for r in records if r.error_code)
    return {
        "backend": backend,
        "scenario": scenario,
        "ttft_p50_ms": metrics["ttft_s"]["p50"] * 1e3,
        "ttft_p99_ms": metrics["ttft_s"]["p99"] * 1e3,
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "errors": errors,
        "gateway_cpu_s": gateway_cpu,
    }


async def measure(args: argparse.Namespace, scheduler_port: int, gateway_port: int, gateway_pid: int) -> list[dict]:
    from tqdm import tqdm

    rows = []
    async with (
        SluiceClient(f"127.0.0.1:{scheduler_port}") as grpc_client,
        OpenAIBench(f"http://127.0.0.1:{gateway_port}/v1") as http_client,
    ):
        await grpc_client.wait_ready()
        await http_client.describe()
        clients = {"grpc": grpc_client, "http": http_client}
        # warm-up: connections, the scheduler's and the gateway's first requests
        for backend in BACKENDS:
            await run_requests(
                clients[backend], fixed_load(f"warm-{backend}", 32, 32, 16), concurrency=8, progress=False
            )
        steps = [(s, r, i) for s in args.scenarios for r in range(args.rounds) for i in range(2)]
        for scenario, r, i in tqdm(steps, desc="gateway overhead", unit="round"):
            backend = BACKENDS[(r + i) % 2]  # alternate which path goes first in each round
            row = await one_round(clients, backend, scenario, f"{scenario}-{r}-{backend}", args, gateway_pid)
            row["round"] = r
            rows.append(row)
    return rows


# ---------------------------------------------------------------- report


def summary(rows: list[dict], scenarios: list[str]) -> dict[str, Any]:
    """Per scenario: the median over rounds of each path's values, and of the per-round
    differences (HTTP - gRPC for TTFT, HTTP / gRPC for throughput), with their range."""
    out: dict[str, Any] = {}
    for scenario in scenarios:
        by_round: dict[int, dict[str, dict]] = {}
        for row in rows:
            if row["scenario"] == scenario:
                by_round.setdefault(row["round"], {})[row["backend"]] = row
        pairs = [v for v in by_round.values() if len(v) == 2]
        d_p50 = [p["http"]["ttft_p50_ms"] - p["grpc"]["ttft_p50_ms"] for p in pairs]
        d_p99 = [p["http"]["ttft_p99_ms"] - p["grpc"]["ttft_p99_ms"] for p in pairs]
        ratio = [p["http"]["tokens_per_s"] / p["grpc"]["tokens_per_s"] for p in pairs]
        per_core = [p["http"]["tokens"] / p["http"]["gateway_cpu_s"] for p in pairs if p["http"]["gateway_cpu_s"] > 0]
        out[scenario] = {
            "rounds": len(pairs),
            "grpc_ttft_p50_ms": statistics.median(p["grpc"]["ttft_p50_ms"] for p in pairs),
            "http_ttft_p50_ms": statistics.median(p["http"]["ttft_p50_ms"] for p in pairs),
            "grpc_ttft_p99_ms": statistics.median(p["grpc"]["ttft_p99_ms"] for p in pairs),
            "http_ttft_p99_ms": statistics.median(p["http"]["ttft_p99_ms"] for p in pairs),
            "added_ttft_p50_ms": {"median": statistics.median(d_p50), "min": min(d_p50), "max": max(d_p50)},
            "added_ttft_p99_ms": {"median": statistics.median(d_p99), "min": min(d_p99), "max": max(d_p99)},
            "grpc_tokens_per_s": statistics.median(p["grpc"]["tokens_per_s"] for p in pairs),
            "http_tokens_per_s": statistics.median(p["http"]["tokens_per_s"] for p in pairs),
            "http_over_grpc_throughput": {"median": statistics.median(ratio), "min": min(ratio), "max": max(ratio)},
            "gateway_tokens_per_cpu_s": {
                "median": statistics.median(per_core) if per_core else None,
                "min": min(per_core) if per_core else None,
                "max": max(per_core) if per_core else None,
            },
            "errors": sum(p[b]["errors"] for p in pairs for b in BACKENDS),
        }
    return out


def print_table(result: dict[str, Any]) -> None:
    print(
        f"{'scenario':<11} {'TTFT p50 gRPC/HTTP ms':>22} {'added p50 ms (range)':>24} {'TTFT p99 gRPC/HTTP ms':>22} "
        f"{'tok/s gRPC/HTTP':>17} {'HTTP/gRPC (range)':>20} {'gateway tok/CPU-s':>18}"
    )
    for scenario, s in result.items():
        added = s["added_ttft_p50_ms"]
        ratio = s["http_over_grpc_throughput"]
        per_core = s["gateway_tokens_per_cpu_s"]["median"]
        print(
            f"{scenario:<11} {s['grpc_ttft_p50_ms']:>10.2f} / {s['http_ttft_p50_ms']:<9.2f} "
            f"{added['median']:>+8.2f} ({added['min']:+.2f}..{added['max']:+.2f})  "
            f"{s['grpc_ttft_p99_ms']:>10.2f} / {s['http_ttft_p99_ms']:<9.2f} "
            f"{s['grpc_tokens_per_s']:>8.0f}/{s['http_tokens_per_s']:<8.0f} "
            f"{ratio['median']:>7.3f} ({ratio['min']:.3f}..{ratio['max']:.3f}) "
            f"{per_core if per_core is None else round(per_core):>12}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--scenarios", nargs="+", default=["sequential", "demo", "saturation"])
    p.add_argument("--seq-requests", type=int, default=40)
    p.add_argument("--sat-requests", type=int, default=256)
    p.add_argument("--sat-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--json", help="write the rounds and the summary here")
    args = p.parse_args(argv)

    log_dir = Path(os.environ.get("TMPDIR", "/tmp"))
    worker: WorkerProcess = spawn_worker(engine="echo", log_dir=log_dir)
    processes: list[subprocess.Popen] = []
    try:
        scheduler, scheduler_port = spawn_service(
            ["scheduler", "--worker", worker.address, "--port", "0", "--num-gpu-blocks", "16384"], "scheduler", log_dir
        )
        processes.append(scheduler)
        gateway, gateway_port = spawn_service(
            ["gateway", "--scheduler", f"127.0.0.1:{scheduler_port}", "--port", "0"], "gateway", log_dir
        )
        processes.append(gateway)
        rows = asyncio.run(measure(args, scheduler_port, gateway_port, gateway.pid))
    finally:
        for process in reversed(processes):
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
        worker.stop()
    result = summary(rows, args.scenarios)
    print(f"echo worker, `sluice scheduler`, `sluice gateway` processes; {os.cpu_count()} cores, {args.rounds} rounds")
    print_table(result)
    if args.json:
        doc = {"config": vars(args), "cpus": os.cpu_count(), "summary": result, "rounds": rows}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
