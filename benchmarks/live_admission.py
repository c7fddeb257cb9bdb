"""Requests per second the scheduler alone can admit and stream, with workers that answer at once.

    K worker processes (`sluice worker --engine echo`: real gRPC workers that check every
        plan and return synthetic tokens without a model)
    the scheduler in this process (LiveScheduler + SchedulerServer, the `sluice serve` parts)
    the load in another process: `sluice bench --concurrency C` over the Azure conversation
        trace, outputs capped at `--max-tokens` (short requests: admission and stream
        set-up dominate, which is what this measures)
    -> finished requests/s and output tokens/s as the client saw them, TTFT and JCT, and
       the scheduler's own schedule() time per step

The three kinds of process share this machine's cores, so the figure is a floor for the
scheduler on a box of its own.

    python benchmarks/live_admission.py [--workers 1,2] [--concurrency 32,128] [--num-requests 600]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scheduler_service.live.config import LiveConfig
from scheduler_service.live.service import LiveScheduler
from scheduler_service.server import SchedulerServer
from sluice_bench.live import ROOT, spawn_worker
from sluice_bench.options import add_common_options, benchmark_parser
from sluice_bench.report import format_table, write_json


async def one_run(addresses: list[str], concurrency: int, args: argparse.Namespace, out: Path) -> dict:
    config = LiveConfig(
        policy=args.policy,
        num_gpu_blocks=args.num_gpu_blocks,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_waiting=max(1024, concurrency * 2),
    )
    live = LiveScheduler(addresses, config)
    server = await SchedulerServer.start(live, 0)
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "bench",
        "--target",
        f"127.0.0.1:{server.port}",
        "--trace",
        args.trace,
        "--num-requests",
        str(args.num_requests),
        "--concurrency",
        str(concurrency),
        "--max-tokens",
        str(args.max_tokens),
        "--prompt-source",
        "tokens",
        "--json",
        str(out),
        "--no-progress",
    ]
    try:
        start = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(*cmd, cwd=ROOT, stdout=asyncio.subprocess.PIPE)
        stdout, _ = await proc.communicate()
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"bench failed ({proc.returncode}): {stdout.decode()[-2000:]}")
        sched = live.metrics.summary()["sched_overhead_ms"]
    finally:
        await server.stop(grace_s=1.0, drain_s=0.0)
    run = json.loads(out.read_text())
    return {"run": run, "sched_overhead_ms": sched, "wall_s": wall}


COLUMNS = {  # column -> format
    "workers": "{}",
    "concurrency": "{}",
    "finished": "{}",
    "req/s": "{:.0f}",
    "output tok/s": "{:.0f}",
    "TTFT p50 ms": "{:.1f}",
    "TTFT p99 ms": "{:.1f}",
    "JCT p50 ms": "{:.1f}",
    "schedule() ms/step": "{:.3f}",
}


def table_row(workers: int, concurrency: int, r: dict) -> dict[str, Any]:
    m = r["run"]["metrics"]
    return {
        "workers": workers,
        "concurrency": concurrency,
        "finished": f"{m['num_finished']}/{m['num_requests']}",
        "req/s": m["throughput_req_s"],
        "output tok/s": m["throughput_tok_s"],
        "TTFT p50 ms": m["ttft_s"]["p50"] * 1e3,
        "TTFT p99 ms": m["ttft_s"]["p99"] * 1e3,
        "JCT p50 ms": m["jct_s"]["p50"] * 1e3,
        "schedule() ms/step": r["sched_overhead_ms"]["mean"],
    }


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for num_workers in [int(w) for w in args.workers.split(",")]:
            workers = [spawn_worker(engine="echo", worker_id=w) for w in range(num_workers)]
            try:
                addresses = [w.address for w in workers]
                for concurrency in [int(c) for c in args.concurrency.split(",")]:
                    out = Path(tmp) / f"bench-{num_workers}-{concurrency}.json"
                    result = await one_run(addresses, concurrency, args, out)
                    rows.append(table_row(num_workers, concurrency, result))
                    print(format_table(rows[-1:], list(COLUMNS), formats=COLUMNS).splitlines()[-1], flush=True)
            finally:
                for w in workers:
                    w.stop()
    return rows


def main() -> int:
    p = benchmark_parser(__doc__)
    p.add_argument("--workers", default="1,2", help="numbers of echo workers to try")
    p.add_argument("--concurrency", default="32,128", help="client streams in flight")
    p.add_argument("--num-requests", type=int, default=600)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--trace", default="azure-conv")
    p.add_argument("--policy", default="vllm")
    p.add_argument("--num-gpu-blocks", type=int, default=16384)
    p.add_argument("--markdown", help="also write the table here")
    add_common_options(p)
    args = p.parse_args()
    rows = asyncio.run(main_async(args))
    table = format_table(rows, list(COLUMNS), formats=COLUMNS)
    print(table, flush=True)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    if args.json:
        write_json(rows, args.json, quiet=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
