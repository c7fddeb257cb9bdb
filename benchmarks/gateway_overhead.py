"""What the OpenAI HTTP gateway adds to the gRPC path: TTFT and throughput through HTTP vs gRPC,
side by side in one run (interleaved rounds, the first backend alternating), and the gateway's
CPU per streamed token.

    echo worker process (`sluice worker --engine echo`: no model, every step returns at once)
      <- `sluice scheduler` process <- gRPC <- this process (SluiceClient, the gRPC bench)
                                    <- gRPC <- `sluice gateway` process <- HTTP <- this process
                                                                            (OpenAIBench, aiohttp)

Scenarios (requests sent as `sluice bench` sends them, by scheduler_service/loadgen/load.run_requests):
    paired       one request at a time (16 tokens), alternately over each path, the order
                 flipping every pair: the median of the per-pair TTFT differences
    demo         the load of `sluice serve --demo` (40 requests of azure-conv over 8 s, prompts
                 x1/8 <= 256 tokens, outputs x1/4 <= 64), its requests alternately over gRPC and
                 HTTP in the same run: TTFT p50 / p99 of each path's half
    saturation   closed loop, --concurrency streams of --sat-tokens tokens, all over one path,
                 then all over the other (the first alternating by round): tokens/s, and the
                 gateway's CPU seconds (utime + stime from /proc) per streamed token; the CPU
                 of every process on the path per token (this client, gateway, scheduler,
                 worker): where the cores' time goes on each path

    python benchmarks/gateway_overhead.py --rounds 3 --json docs/results/data/openai_api.json

Every scenario reports tokens per message: the scheduler sends in one message whatever tokens of
a stream are queued when it writes, and the gateway one SSE chunk per message.

Targets (issue 24): HTTP adds <= 1 ms to TTFT p50 at the demo's load, costs <= 5% of the
throughput at saturation, and streams >= 1,000 tokens/s per core of the gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scheduler_service.core.slo import NO_SLO, SLOSpec
from scheduler_service.loadgen.load import run_requests, send_grpc
from scheduler_service.loadgen.measure import summarize
from scheduler_service.loadgen.openai_backend import OpenAIBench
from scheduler_service.loadgen.requests import BenchRequest, RequestRecord, synthetic_prompt
from sluice.common.client import SluiceClient
from sluice_bench.live import WorkerProcess, spawn_service, spawn_worker
from sluice_bench.options import benchmark_parser
from sluice_bench.report import format_table, write_json

BACKENDS = ("grpc", "http")
CPU_NAMES = ("client", "gateway", "scheduler", "worker")


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


class Mixed:
    """Sends each request over gRPC or HTTP by its position (`first` takes the even ones), so
    both paths run in the same seconds, under the same load and the same noise."""

    def __init__(self, clients: dict[str, Any], first: str) -> None:
        self.clients = clients
        self.order = (first, BACKENDS[1 - BACKENDS.index(first)])
        self.backend_of: dict[str, str] = {}

    async def send(self, record: RequestRecord, t0: float, timeout: float | None) -> None:
        backend = self.order[int(record.request.request_id.rsplit("-", 1)[1]) % 2]
        self.backend_of[record.request.request_id] = backend
        client = self.clients[backend]
        if isinstance(client, SluiceClient):
            await send_grpc(client, record, t0, timeout)
        else:
            await client.send(record, t0, timeout)


def cpu_now(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of this process (the client) and of each named process."""
    return {"client": time.process_time(), **{name: cpu_seconds(pid) for name, pid in pids.items()}}


def cpu_us_per_token(before: dict[str, float], after: dict[str, float], tokens: int) -> dict[str, float]:
    return {name: (after[name] - before[name]) / max(1, tokens) * 1e6 for name in before}


def row_of(backend: str, scenario: str, records: list[RequestRecord], wall: float, gateway_cpu: float) -> dict:
    metrics = summarize(records, policy="vllm", workload=scenario).metrics
    tokens = sum(len(r.token_times) for r in records)
    # the tokens of one message (gRPC) or one SSE chunk (HTTP) arrive at one time
    messages = sum(len(set(r.token_times)) for r in records)
    return {
        "backend": backend,
        "scenario": scenario,
        "requests": len(records),
        "ttft_p50_ms": metrics["ttft_s"]["p50"] * 1e3,
        "ttft_p99_ms": metrics["ttft_s"]["p99"] * 1e3,
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "tokens_per_message": tokens / max(1, messages),
        "errors": sum(1 for r in records if r.error_code),
        "gateway_cpu_s": gateway_cpu if backend == "http" else 0.0,
    }


def ttft_ms(record: RequestRecord) -> float:
    return (record.token_times[0] - record.sent_s) * 1e3


async def paired_round(clients: dict[str, Any], tag: str, args: argparse.Namespace, gateway_pid: int) -> list[dict]:
    """One request at a time, alternately over each path (the order flips every pair)."""
    records: dict[str, list[RequestRecord]] = {b: [] for b in BACKENDS}
    diffs: list[float] = []
    hops: list[float] = []
    cpu0 = cpu_seconds(gateway_pid)
    start = time.perf_counter()
    for i, request in enumerate(fixed_load(tag, args.pairs, 32, 16)):
        pair = {}
        for backend in BACKENDS if i % 2 == 0 else BACKENDS[::-1]:
            pair[backend] = (await run_requests(clients[backend], [request], concurrency=1, progress=False))[0]
            records[backend].append(pair[backend])
        if all(r.token_times for r in pair.values()):
            diffs.append(ttft_ms(pair["http"]) - ttft_ms(pair["grpc"]))
        hops.append(await http_round_trip_ms(clients["http"]))
    wall = time.perf_counter() - start
    cpu = cpu_seconds(gateway_pid) - cpu0
    rows = [row_of(b, "paired", records[b], wall, cpu) for b in BACKENDS]
    for row in rows:
        row["paired_added_ttft_ms"] = diffs
        row["http_round_trip_ms"] = hops
    return rows


async def http_round_trip_ms(client: OpenAIBench) -> float:
    """GET /v1/models: one HTTP exchange with the gateway, no scheduler call (its answer is cached)."""
    start = time.perf_counter()
    async with client.session.get(client.base_url + "/models") as resp:
        await resp.read()
    return (time.perf_counter() - start) * 1e3


def gateway_prepare_ms(port: int) -> float | None:
    """Mean of the gateway's sluice_gateway_request_prepare_seconds (its work before calling the scheduler)."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    total = re.search(r"^sluice_gateway_request_prepare_seconds_sum ([\d.e+-]+)$", text, re.M)
    count = re.search(r"^sluice_gateway_request_prepare_seconds_count ([\d.e+-]+)$", text, re.M)
    if not (total and count) or float(count.group(1)) == 0:
        return None
    return float(total.group(1)) / float(count.group(1)) * 1e3


async def one_round(
    clients: dict[str, Any], first: str, scenario: str, tag: str, args: argparse.Namespace, pids: dict[str, int]
) -> list[dict[str, Any]]:
    gateway_pid = pids["gateway"]
    if scenario == "paired":
        return await paired_round(clients, tag, args, gateway_pid)
    cpu0 = cpu_seconds(gateway_pid)
    start = time.perf_counter()
    if scenario == "demo":
        mixed = Mixed(clients, first)
        records = await run_requests(mixed, demo_load(tag), progress=False)
        wall, cpu = time.perf_counter() - start, cpu_seconds(gateway_pid) - cpu0
        by = {b: [r for r in records if mixed.backend_of[r.request.request_id] == b] for b in BACKENDS}
        return [row_of(b, scenario, by[b], wall, cpu) for b in BACKENDS]
    rows = []
    for backend in (first, BACKENDS[1 - BACKENDS.index(first)]):
        cpu0 = cpu_seconds(gateway_pid)
        every0 = cpu_now(pids)
        start = time.perf_counter()
        requests = fixed_load(f"{tag}-{backend}", args.sat_requests, 32, args.sat_tokens)
        records = await run_requests(clients[backend], requests, concurrency=args.concurrency, progress=False)
        wall, cpu = time.perf_counter() - start, cpu_seconds(gateway_pid) - cpu0
        row = row_of(backend, scenario, records, wall, cpu)
        row["cpu_us_per_token"] = cpu_us_per_token(every0, cpu_now(pids), row["tokens"])
        rows.append(row)
    return rows


async def measure(args: argparse.Namespace, scheduler_port: int, gateway_port: int, pids: dict[str, int]) -> list[dict]:
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
        steps = [(s, r) for s in args.scenarios for r in range(args.rounds)]
        for scenario, r in tqdm(steps, desc="gateway overhead", unit="round"):
            first = BACKENDS[r % 2]  # which path goes first (or takes the even requests) alternates
            for row in await one_round(clients, first, scenario, f"{scenario}-{r}", args, pids):
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
        paired = [d for p in pairs for d in p["http"].get("paired_added_ttft_ms", [])]
        hops = [d for p in pairs for d in p["http"].get("http_round_trip_ms", [])]
        out[scenario] = {
            "rounds": len(pairs),
            "requests_per_path": sum(p["http"]["requests"] for p in pairs),
            "paired_added_ttft_ms": {
                "median": statistics.median(paired),
                "p25": statistics.quantiles(paired, n=4)[0],
                "p75": statistics.quantiles(paired, n=4)[2],
                "pairs": len(paired),
            }
            if paired
            else None,
            "http_round_trip_ms": {"median": statistics.median(hops), "n": len(hops)} if hops else None,
            "grpc_ttft_p50_ms": statistics.median(p["grpc"]["ttft_p50_ms"] for p in pairs),
            "http_ttft_p50_ms": statistics.median(p["http"]["ttft_p50_ms"] for p in pairs),
            "grpc_ttft_p99_ms": statistics.median(p["grpc"]["ttft_p99_ms"] for p in pairs),
            "http_ttft_p99_ms": statistics.median(p["http"]["ttft_p99_ms"] for p in pairs),
            "added_ttft_p50_ms": {"median": statistics.median(d_p50), "min": min(d_p50), "max": max(d_p50)},
            "added_ttft_p99_ms": {"median": statistics.median(d_p99), "min": min(d_p99), "max": max(d_p99)},
            "grpc_tokens_per_s": statistics.median(p["grpc"]["tokens_per_s"] for p in pairs),
            "http_tokens_per_s": statistics.median(p["http"]["tokens_per_s"] for p in pairs),
            "http_over_grpc_throughput": {"median": statistics.median(ratio), "min": min(ratio), "max": max(ratio)},
            "tokens_per_message": {b: statistics.median(p[b]["tokens_per_message"] for p in pairs) for b in BACKENDS},
            "gateway_tokens_per_cpu_s": {
                "median": statistics.median(per_core) if per_core else None,
                "min": min(per_core) if per_core else None,
                "max": max(per_core) if per_core else None,
            },
            "errors": sum(p[b]["errors"] for p in pairs for b in BACKENDS),
        }
        if all("cpu_us_per_token" in p[b] for p in pairs for b in BACKENDS):
            out[scenario]["cpu_us_per_token"] = {
                b: {name: statistics.median(p[b]["cpu_us_per_token"][name] for p in pairs) for name in CPU_NAMES}
                for b in BACKENDS
            }
    return out


def print_cpu(result: dict[str, Any]) -> None:
    for scenario, s in result.items():
        cpu = s.get("cpu_us_per_token")
        if cpu:
            for b in BACKENDS:
                parts = ", ".join(f"{name} {cpu[b][name]:.1f}" for name in CPU_NAMES)
                print(f"{scenario}, {b}: CPU us per token: {parts}; sum {sum(cpu[b].values()):.1f}")


def print_paired(result: dict[str, Any]) -> None:
    for scenario, s in result.items():
        paired = s["paired_added_ttft_ms"]
        if paired:
            print(
                f"{scenario}: HTTP - gRPC TTFT of each pair: median {paired['median']:+.2f} ms "
                f"(quartiles {paired['p25']:+.2f} .. {paired['p75']:+.2f}), {paired['pairs']} pairs; "
                f"one HTTP exchange with the gateway alone (GET /v1/models): {s['http_round_trip_ms']['median']:.2f} ms"
            )


def results_table(result: dict[str, Any]) -> str:
    """Throughput columns for saturation only: the paired and demo rounds share their wall time."""
    rows = []
    for scenario, s in result.items():
        added, ratio = s["added_ttft_p50_ms"], s["http_over_grpc_throughput"]
        per_core = s["gateway_tokens_per_cpu_s"]["median"]
        saturation = scenario == "saturation"
        rows.append(
            {
                "scenario": scenario,
                "TTFT p50 gRPC/HTTP ms": f"{s['grpc_ttft_p50_ms']:.2f} / {s['http_ttft_p50_ms']:.2f}",
                "HTTP-gRPC p50 ms (range)": f"{added['median']:+.2f} ({added['min']:+.2f}..{added['max']:+.2f})",
                "TTFT p99 gRPC/HTTP ms": f"{s['grpc_ttft_p99_ms']:.2f} / {s['http_ttft_p99_ms']:.2f}",
                "tok/s gRPC/HTTP": (
                    f"{s['grpc_tokens_per_s']:.0f}/{s['http_tokens_per_s']:.0f}" if saturation else "-"
                ),
                "HTTP/gRPC (range)": (
                    f"{ratio['median']:.3f} ({ratio['min']:.3f}..{ratio['max']:.3f})" if saturation else "-"
                ),
                "gateway tok/CPU-s": "-" if per_core is None else str(round(per_core)),
                "tok/msg gRPC/HTTP": "{grpc:.2f}/{http:.2f}".format(**s["tokens_per_message"]),
            }
        )
    return format_table(rows, right=[k for k in rows[0] if k != "scenario"] if rows else ())


def main(argv: list[str] | None = None) -> int:
    p = benchmark_parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--scenarios", nargs="+", default=["paired", "demo", "saturation"])
    p.add_argument("--pairs", type=int, default=60, help="paired: requests per path and round")
    p.add_argument("--sat-requests", type=int, default=256)
    p.add_argument("--sat-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--json", help="write the rounds and the summary here")
    args = p.parse_args(argv)

    log_dir = Path(tempfile.gettempdir())
    worker: WorkerProcess = spawn_worker(engine="echo", log_dir=log_dir)
    processes: list[subprocess.Popen] = []
    try:
        scheduler, scheduler_port = spawn_service(
            ["scheduler", "--worker", worker.address, "--port", "0", "--num-gpu-blocks", "16384"],
            log_dir / f"sluice-gateway-bench-scheduler-{os.getpid()}.log",
        )
        processes.append(scheduler)
        gateway, gateway_port = spawn_service(
            ["gateway", "--scheduler", f"127.0.0.1:{scheduler_port}", "--port", "0"],
            log_dir / f"sluice-gateway-bench-gateway-{os.getpid()}.log",
        )
        processes.append(gateway)
        pids = {"gateway": gateway.pid, "scheduler": scheduler.pid, "worker": worker.process.pid}
        rows = asyncio.run(measure(args, scheduler_port, gateway_port, pids))
        prepare_ms = gateway_prepare_ms(gateway_port)
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
    print(results_table(result))
    print_paired(result)
    print_cpu(result)
    print(f"the gateway's own work before calling the scheduler (mean of all requests): {prepare_ms:.3f} ms")
    if args.json:
        doc = {
            "config": vars(args),
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
            "gateway_prepare_ms_mean": prepare_ms,
            "summary": result,
            "rounds": rows,
        }
        write_json(doc, args.json, indent=2, quiet=True)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
