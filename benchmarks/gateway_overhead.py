"""What the OpenAI HTTP API adds to the gRPC path: TTFT and throughput through HTTP vs gRPC, side
by side in one run (interleaved rounds, the order of the paths rotating), and the CPU per
streamed token of every process on each path.

    echo worker process (`sluice worker --engine echo`: no model, every step returns at once)
      <- `sluice scheduler --http-port` process <- gRPC <- this process          path "grpc"
                                                <- HTTP <- this process          path "http": served by
                                                                                 the scheduler's process
                                                <- gRPC <- `sluice gateway` <- HTTP <- this process
                                                                                 path "gateway"
    (clients: SluiceClient as `sluice bench` uses it; OpenAIBench on aiohttp as
    `sluice bench --backend openai`)

Scenarios (requests sent as `sluice bench` sends them, by scheduler_service/loadgen/load.run_requests):
    paired       one request at a time (16 tokens), over each path in turn, the order rotating
                 every request: the median of the per-request TTFT differences to gRPC
    demo         the load of `sluice serve --demo` (40 requests of azure-conv over 8 s, prompts
                 x1/8 <= 256 tokens, outputs x1/4 <= 64), its requests spread over the paths in
                 the same run: TTFT p50 / p99 of each path's share
    saturation   closed loop, --concurrency streams of --sat-tokens tokens, all over one path,
                 then the next (the first rotating by round): tokens/s, and the CPU seconds
                 (utime + stime from /proc) of every process on the path (this client, gateway,
                 scheduler, worker) per streamed token

    python benchmarks/gateway_overhead.py --rounds 3 --json docs/results/data/openai_api.json

Every scenario reports tokens per message: the scheduler sends in one message whatever tokens of
a stream are queued when it writes, and HTTP one SSE chunk per message.

Targets (issue 24): HTTP adds <= 1 ms to TTFT p50 at the demo's load, costs <= 5% of the
throughput at saturation, and streams >= 1,000 tokens/s per core of the gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import socket
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

PATHS = ("grpc", "http", "gateway")  # gRPC; HTTP served by the scheduler's process; HTTP via `sluice gateway`
HTTP_PATHS = ("http", "gateway")
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


def rotated(paths: list[str], k: int) -> list[str]:
    k %= len(paths)
    return paths[k:] + paths[:k]


class Mixed:
    """Sends each request over one path by its position (request i over order[i % n]), so every
    path runs in the same seconds, under the same load and the same noise."""

    def __init__(self, clients: dict[str, Any], order: list[str]) -> None:
        self.clients = clients
        self.order = order
        self.backend_of: dict[str, str] = {}

    async def send(self, record: RequestRecord, t0: float, timeout: float | None) -> None:
        backend = self.order[int(record.request.request_id.rsplit("-", 1)[1]) % len(self.order)]
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


def row_of(backend: str, scenario: str, records: list[RequestRecord], wall: float, front_cpu: float) -> dict:
    """`front_cpu`: CPU seconds of what serves HTTP on this path (the gateway process, or the
    scheduler's process for "http", where it is shared with the scheduler's own work)."""
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
        "front_cpu_s": front_cpu if backend in HTTP_PATHS else 0.0,
    }


def ttft_ms(record: RequestRecord) -> float:
    return (record.token_times[0] - record.sent_s) * 1e3


def front_pid(backend: str, pids: dict[str, int]) -> int:
    return pids["gateway"] if backend == "gateway" else pids["scheduler"]


async def paired_round(clients: dict[str, Any], tag: str, args: argparse.Namespace, pids: dict[str, int]) -> list[dict]:
    """One request at a time over each path in turn (the order rotates every request)."""
    paths = list(clients)
    records: dict[str, list[RequestRecord]] = {b: [] for b in paths}
    diffs: dict[str, list[float]] = {b: [] for b in paths}
    hops: dict[str, list[float]] = {b: [] for b in paths}
    cpu0 = {b: cpu_seconds(front_pid(b, pids)) for b in paths}
    start = time.perf_counter()
    for i, request in enumerate(fixed_load(tag, args.pairs, 32, 16)):
        one = {}
        for backend in rotated(paths, i):
            one[backend] = (await run_requests(clients[backend], [request], concurrency=1, progress=False))[0]
            records[backend].append(one[backend])
        for backend in paths:
            if backend in HTTP_PATHS and one[backend].token_times and one["grpc"].token_times:
                diffs[backend].append(ttft_ms(one[backend]) - ttft_ms(one["grpc"]))
                hops[backend].append(await http_round_trip_ms(clients[backend]))
    wall = time.perf_counter() - start
    rows = []
    for b in paths:
        row = row_of(b, "paired", records[b], wall, cpu_seconds(front_pid(b, pids)) - cpu0[b])
        row["paired_added_ttft_ms"] = diffs[b]
        row["http_round_trip_ms"] = hops[b]
        rows.append(row)
    return rows


async def http_round_trip_ms(client: OpenAIBench) -> float:
    """GET /v1/models: one HTTP exchange, no scheduler call (the model is asked once)."""
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
    clients: dict[str, Any], order: list[str], scenario: str, tag: str, args: argparse.Namespace, pids: dict[str, int]
) -> list[dict[str, Any]]:
    if scenario == "paired":
        return await paired_round(clients, tag, args, pids)
    if scenario == "demo":
        cpu0 = {b: cpu_seconds(front_pid(b, pids)) for b in order}
        start = time.perf_counter()
        mixed = Mixed(clients, order)
        records = await run_requests(mixed, demo_load(tag), progress=False)
        wall = time.perf_counter() - start
        by = {b: [r for r in records if mixed.backend_of[r.request.request_id] == b] for b in order}
        return [row_of(b, scenario, by[b], wall, cpu_seconds(front_pid(b, pids)) - cpu0[b]) for b in order]
    rows = []
    for backend in order:
        cpu0 = cpu_seconds(front_pid(backend, pids))
        every0 = cpu_now(pids)
        start = time.perf_counter()
        requests = fixed_load(f"{tag}-{backend}", args.sat_requests, 32, args.sat_tokens)
        records = await run_requests(clients[backend], requests, concurrency=args.concurrency, progress=False)
        wall = time.perf_counter() - start
        row = row_of(backend, scenario, records, wall, cpu_seconds(front_pid(backend, pids)) - cpu0)
        row["cpu_us_per_token"] = cpu_us_per_token(every0, cpu_now(pids), row["tokens"])
        rows.append(row)
    return rows


async def measure(args: argparse.Namespace, ports: dict[str, int], pids: dict[str, int]) -> list[dict]:
    from tqdm import tqdm

    rows = []
    async with contextlib.AsyncExitStack() as stack:
        clients: dict[str, Any] = {}
        for path in args.paths:
            if path == "grpc":
                clients[path] = await stack.enter_async_context(SluiceClient(f"127.0.0.1:{ports['grpc']}"))
                await clients[path].wait_ready()
            else:
                clients[path] = await stack.enter_async_context(OpenAIBench(f"http://127.0.0.1:{ports[path]}/v1"))
                await clients[path].describe()
        # warm-up: connections, the scheduler's and the HTTP servers' first requests
        for backend in args.paths:
            await run_requests(
                clients[backend], fixed_load(f"warm-{backend}", 32, 32, 16), concurrency=8, progress=False
            )
        steps = [(s, r) for s in args.scenarios for r in range(args.rounds)]
        for scenario, r in tqdm(steps, desc="HTTP overhead", unit="round"):
            order = rotated(list(args.paths), r)  # which path goes first (or takes request 0) rotates
            for row in await one_round(clients, order, scenario, f"{scenario}-{r}", args, pids):
                row["round"] = r
                rows.append(row)
    return rows


# ---------------------------------------------------------------- report


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def pooled_rate(rounds: list[dict[str, dict]], path: str) -> float:
    return sum(p[path]["tokens"] for p in rounds) / sum(p[path]["wall_s"] for p in rounds)


def summary(rows: list[dict], scenarios: list[str], paths: list[str]) -> dict[str, Any]:
    """Per scenario and HTTP path: the median over rounds of each path's values, and of the
    per-round differences to gRPC (path - gRPC for TTFT, path / gRPC for throughput), with their range."""
    out: dict[str, Any] = {}
    for scenario in scenarios:
        by_round: dict[int, dict[str, dict]] = {}
        for row in rows:
            if row["scenario"] == scenario:
                by_round.setdefault(row["round"], {})[row["backend"]] = row
        rounds = [v for v in by_round.values() if set(v) == set(paths)]
        per_path: dict[str, Any] = {}
        for b in paths:
            per_path[b] = {
                "ttft_p50_ms": statistics.median(p[b]["ttft_p50_ms"] for p in rounds),
                "ttft_p99_ms": statistics.median(p[b]["ttft_p99_ms"] for p in rounds),
                "tokens_per_s": statistics.median(p[b]["tokens_per_s"] for p in rounds),
                "tokens_per_message": statistics.median(p[b]["tokens_per_message"] for p in rounds),
            }
            if all("cpu_us_per_token" in p[b] for p in rounds):
                per_path[b]["cpu_us_per_token"] = {
                    name: statistics.median(p[b]["cpu_us_per_token"][name] for p in rounds) for name in CPU_NAMES
                }
            if b not in HTTP_PATHS:
                continue
            paired = [d for p in rounds for d in p[b].get("paired_added_ttft_ms", [])]
            hops = [d for p in rounds for d in p[b].get("http_round_trip_ms", [])]
            per_core = [p[b]["tokens"] / p[b]["front_cpu_s"] for p in rounds if p[b]["front_cpu_s"] > 0]
            per_path[b] |= {
                "paired_added_ttft_ms": {
                    "median": statistics.median(paired),
                    "p25": statistics.quantiles(paired, n=4)[0],
                    "p75": statistics.quantiles(paired, n=4)[2],
                    "pairs": len(paired),
                }
                if len(paired) > 1
                else None,
                "http_round_trip_ms": {"median": statistics.median(hops), "n": len(hops)} if hops else None,
                "added_ttft_p50_ms": _spread([p[b]["ttft_p50_ms"] - p["grpc"]["ttft_p50_ms"] for p in rounds]),
                "added_ttft_p99_ms": _spread([p[b]["ttft_p99_ms"] - p["grpc"]["ttft_p99_ms"] for p in rounds]),
                "over_grpc_throughput": _spread([p[b]["tokens_per_s"] / p["grpc"]["tokens_per_s"] for p in rounds]),
                # NOTE: every round's tokens over every round's seconds, per path: a load spike in one
                # path's seconds of one round weighs by its length, not as a whole round's ratio
                "over_grpc_throughput_pooled": pooled_rate(rounds, b) / pooled_rate(rounds, "grpc"),
                # NOTE: for "http" the front's CPU is the scheduler process's, its scheduling included
                "front_tokens_per_cpu_s": _spread(per_core) if per_core else None,
            }
        out[scenario] = {
            "rounds": len(rounds),
            "requests_per_path": sum(p["grpc"]["requests"] for p in rounds),
            "paths": per_path,
            "errors": sum(p[b]["errors"] for p in rounds for b in paths),
        }
    return out


PATH_NAMES = {"grpc": "gRPC", "http": "HTTP (in-process)", "gateway": "HTTP (gateway process)"}


def print_cpu(result: dict[str, Any]) -> None:
    for scenario, s in result.items():
        for b, path in s["paths"].items():
            cpu = path.get("cpu_us_per_token")
            if cpu:
                parts = ", ".join(f"{name} {cpu[name]:.1f}" for name in CPU_NAMES)
                print(f"{scenario}, {PATH_NAMES[b]}: CPU us per token: {parts}; sum {sum(cpu.values()):.1f}")


def print_paired(result: dict[str, Any]) -> None:
    for scenario, s in result.items():
        for b, path in s["paths"].items():
            paired = path.get("paired_added_ttft_ms")
            if paired:
                print(
                    f"{scenario}, {PATH_NAMES[b]} - gRPC TTFT of each request: median {paired['median']:+.2f} ms "
                    f"(quartiles {paired['p25']:+.2f} .. {paired['p75']:+.2f}), {paired['pairs']} pairs; "
                    f"one HTTP exchange alone (GET /v1/models): {path['http_round_trip_ms']['median']:.2f} ms"
                )


def results_table(result: dict[str, Any]) -> str:
    """One row per scenario and HTTP path; throughput columns for saturation only (the paired
    and demo rounds share their wall time)."""
    rows = []
    for scenario, s in result.items():
        grpc = s["paths"]["grpc"]
        saturation = scenario == "saturation"
        for b, path in s["paths"].items():
            if b not in HTTP_PATHS:
                continue
            added, ratio = path["added_ttft_p50_ms"], path["over_grpc_throughput"]
            per_core = path["front_tokens_per_cpu_s"]
            rows.append(
                {
                    "scenario": scenario,
                    "path": PATH_NAMES[b],
                    "TTFT p50 gRPC/path ms": f"{grpc['ttft_p50_ms']:.2f} / {path['ttft_p50_ms']:.2f}",
                    "path-gRPC p50 ms (range)": f"{added['median']:+.2f} ({added['min']:+.2f}..{added['max']:+.2f})",
                    "TTFT p99 gRPC/path ms": f"{grpc['ttft_p99_ms']:.2f} / {path['ttft_p99_ms']:.2f}",
                    "tok/s gRPC/path": f"{grpc['tokens_per_s']:.0f}/{path['tokens_per_s']:.0f}" if saturation else "-",
                    "path/gRPC (range; pooled)": (
                        f"{ratio['median']:.3f} ({ratio['min']:.3f}..{ratio['max']:.3f}; "
                        f"{path['over_grpc_throughput_pooled']:.3f})"
                        if saturation
                        else "-"
                    ),
                    "front tok/CPU-s": "-" if per_core is None else str(round(per_core["median"])),
                    "tok/msg gRPC/path": f"{grpc['tokens_per_message']:.2f}/{path['tokens_per_message']:.2f}",
                }
            )
    return format_table(rows, right=[k for k in rows[0] if k not in ("scenario", "path")] if rows else ())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    p = benchmark_parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--scenarios", nargs="+", default=["paired", "demo", "saturation"])
    p.add_argument(
        "--paths",
        type=lambda v: [x.strip() for x in v.split(",") if x.strip()],
        default=list(PATHS),
        help="comma-separated, from grpc,http,gateway (grpc always runs: it is the reference)",
    )
    p.add_argument("--pairs", type=int, default=60, help="paired: requests per path and round")
    p.add_argument("--sat-requests", type=int, default=256)
    p.add_argument("--sat-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--json", help="write the rounds and the summary here")
    args = p.parse_args(argv)
    unknown = set(args.paths) - set(PATHS)
    if unknown:
        p.error(f"--paths: unknown {', '.join(sorted(unknown))}; choose from {', '.join(PATHS)}")
    args.paths = ["grpc", *(b for b in PATHS if b in args.paths and b != "grpc")]

    log_dir = Path(tempfile.gettempdir())
    worker: WorkerProcess = spawn_worker(engine="echo", log_dir=log_dir)
    processes: list[subprocess.Popen] = []
    prepare_ms = None
    try:
        ports: dict[str, int] = {}
        command = ["scheduler", "--worker", worker.address, "--port", "0", "--num-gpu-blocks", "16384"]
        if "http" in args.paths:
            ports["http"] = free_port()
            command += ["--http-port", str(ports["http"])]
        scheduler, ports["grpc"] = spawn_service(command, log_dir / f"sluice-http-bench-scheduler-{os.getpid()}.log")
        processes.append(scheduler)
        pids = {"scheduler": scheduler.pid, "worker": worker.process.pid}
        if "gateway" in args.paths:
            gateway, ports["gateway"] = spawn_service(
                ["gateway", "--scheduler", f"127.0.0.1:{ports['grpc']}", "--port", "0"],
                log_dir / f"sluice-http-bench-gateway-{os.getpid()}.log",
            )
            processes.append(gateway)
            pids["gateway"] = gateway.pid
        rows = asyncio.run(measure(args, ports, pids))
        if "gateway" in args.paths:
            prepare_ms = gateway_prepare_ms(ports["gateway"])
    finally:
        for process in reversed(processes):
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
        worker.stop()
    result = summary(rows, args.scenarios, args.paths)
    print(
        f"echo worker, `sluice scheduler` (+ `sluice gateway`) processes; {os.cpu_count()} cores, {args.rounds} rounds"
    )
    print(results_table(result))
    print_paired(result)
    print_cpu(result)
    if prepare_ms is not None:
        print(
            f"the gateway process's own work before calling the scheduler (mean of all requests): {prepare_ms:.3f} ms"
        )
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
