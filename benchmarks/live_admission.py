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

from scheduler_service.live.config import LiveConfig
from scheduler_service.live.service import LiveScheduler
from scheduler_service.server import SchedulerServer
from sluice_bench.live import ROOT, spawn_worker
from sluice_bench.options import benchmark_parser


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


def format_row(workers: int, concurrency: int, r: dict) -> str:
    m = r["run"]["metrics"]
    return (
        f"| {workers} | {concurrency} | {m['num_finished']}/{m['num_requests']} | {m['throughput_req_s']:.0f} "
        f"| {m['throughput_tok_s']:.0f} | {m['ttft_s']['p50'] * 1e3:.1f} | {m['ttft_s']['p99'] * 1e3:.1f} "
        f"| {m['jct_s']['p50'] * 1e3:.1f} | {r['sched_overhead_ms']['mean']:.3f} |"
    )


async def main_async(args: argparse.Namespace) -> list[str]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for num_workers in [int(w) for w in args.workers.split(",")]:
            workers = [spawn_worker(engine="echo", worker_id=w) for w in range(num_workers)]
            try:
                addresses = [w.address for w in workers]
                for concurrency in [int(c) for c in args.concurrency.split(",")]:
                    out = Path(tmp) / f"bench-{num_workers}-{concurrency}.json"
                    result = await one_run(addresses, concurrency, args, out)
                    rows.append(format_row(num_workers, concurrency, result))
                    print(rows[-1], flush=True)
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
    args = p.parse_args()
    head = (
        "| workers | concurrency | finished | req/s | output tok/s | TTFT p50 ms | TTFT p99 ms | JCT p50 ms "
        "| schedule() ms/step |\n|---|---|---|---|---|---|---|---|---|"
    )
    print(head, flush=True)
    rows = asyncio.run(main_async(args))
    if args.markdown:
        Path(args.markdown).write_text(head + "\n" + "\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
