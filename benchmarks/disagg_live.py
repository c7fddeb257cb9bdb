"""Disaggregated prefill and decode live: the scheduler driving KV transfers between worker
processes, against colocated serving on the same number of workers and the same requests
(the "Live: the scheduler driving transfers" part of docs/results/disaggregation.md comes from this script).

    python benchmarks/disagg_live.py --json disagg_live.json

Two configurations (`--repeats` runs of each, alternating), each run on fresh `sluice worker`
processes started as `sluice serve` starts them (services/serve.py: start_workers,
start_scheduler; one torch thread each, CPU):

    colocated       --workers 2                          (2 mixed workers)
    disaggregated   --prefill-workers 1 --decode-workers 1

The requests: a slice of the azure-conv trace, lengths scaled to the tiny model and its
arrivals compressed as `sluice serve --demo` does (DemoOptions), greedy with ignore_eos so
both runs generate the same number of tokens. Measured at the client: TTFT (send to first
token) and TBT (gaps between later tokens); at the scheduler: every transfer's seconds
(issue to answer, and the PullKv alone), bytes, and how many fell back to a recompute. The
token streams of the two runs must be identical (checked; the script exits non-zero if not).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import grpc

from services.serve import (
    DemoOptions,
    DemoRequest,
    ServeConfig,
    demo_requests,
    start_scheduler,
    start_workers,
    stop_workers,
)
from sluice.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from sluice_bench.options import benchmark_parser
from sluice_bench.report import format_table, write_json

ROOT = Path(__file__).resolve().parents[1]

SPLITS = {
    "colocated": {"workers": 2},
    "disaggregated": {"prefill_workers": 1, "decode_workers": 1},
}


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def one_request(
    stub: generation_pb2_grpc.GenerationServiceStub, i: int, r: DemoRequest, start: float
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, start + r.arrival_s - loop.time()))
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
    msg = generation_pb2.GenerateRequest(
        request_id=f"bench-{i}", token_ids=common_pb2.TokenIds(ids=r.prompt_ids), sampling_params=sampling
    )
    sent = time.perf_counter()
    tokens: list[int] = []
    times: list[float] = []
    async for m in stub.Generate(msg):
        now = time.perf_counter()
        for t in m.token_ids:
            tokens.append(t)
            times.append(now)
    return {
        "tokens": tokens,
        "ttft_s": times[0] - sent,
        "gaps_s": [b - a for a, b in itertools.pairwise(times)],
        "e2e_s": times[-1] - sent,
    }


async def run_split(name: str, requests: list[DemoRequest], args: argparse.Namespace) -> dict[str, Any]:
    cfg = ServeConfig(
        port=0,
        model=args.model,
        load_format="dummy",
        num_gpu_blocks=args.num_gpu_blocks,
        worker_threads=args.threads,
        start_predictor=False,
        overlap=False,  # NOTE: a disaggregated cluster steps one plan at a time; the same for both
        **SPLITS[name],
    )
    processes = await start_workers(cfg)
    try:
        server = await start_scheduler(cfg, [w.address for w in processes])
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = generation_pb2_grpc.GenerationServiceStub(channel)
                # one request first, not measured: the workers' first steps warm their caches
                await one_request(stub, -1, replace(requests[0], arrival_s=0.0), asyncio.get_running_loop().time())
                records_before = len(server.live.transfers.records)
                start = asyncio.get_running_loop().time()
                wall = time.perf_counter()
                results = await asyncio.gather(*(one_request(stub, i, r, start) for i, r in enumerate(requests)))
                wall = time.perf_counter() - wall
            live = server.live
            records = list(live.transfers.records)[records_before:]
            stats = live.cluster.transfers.summary() if hasattr(live.cluster, "transfers") else None
        finally:
            await server.stop(grace_s=1.0, drain_s=0.0)
    finally:
        await stop_workers(processes)
    ttft = [r["ttft_s"] for r in results]
    gaps = [g for r in results for g in r["gaps_s"]]
    # NOTE: disaggregated, the first gap (first token -> second) holds the handoff: the KV
    # transfer and the decode worker's admission; the later gaps are the decode pool's own.
    first_gaps = [r["gaps_s"][0] for r in results if r["gaps_s"]]
    later_gaps = [g for r in results for g in r["gaps_s"][1:]]
    out_tokens = sum(len(r["tokens"]) for r in results)
    return {
        "split": name,
        "tokens": [r["tokens"] for r in results],
        "wall_s": wall,
        "output_tokens": out_tokens,
        "throughput_tok_s": out_tokens / wall,
        "ttft_s_p50": pct(ttft, 0.5),
        "ttft_s_p90": pct(ttft, 0.9),
        "tbt_s_p50": pct(gaps, 0.5),
        "tbt_s_p90": pct(gaps, 0.9),
        "tbt_s_p99": pct(gaps, 0.99),
        "first_gap_s_p50": pct(first_gaps, 0.5),
        "first_gap_s_p90": pct(first_gaps, 0.9),
        "later_tbt_s_p50": pct(later_gaps, 0.5),
        "later_tbt_s_p90": pct(later_gaps, 0.9),
        "later_tbt_s_p99": pct(later_gaps, 0.99),
        "transfers": [asdict(t) for t in records],
        "transfer_stats": stats,
    }


def transfer_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    recs = [t for run in runs for t in run["transfers"]]
    ok = [t for t in recs if t["ok"]]
    return {
        "transfers": len(recs),
        "succeeded": len(ok),
        "recomputed": len(recs) - len(ok),
        "total_ms_p50": 1e3 * (pct([t["total_s"] for t in ok], 0.5) or 0.0),
        "total_ms_p90": 1e3 * (pct([t["total_s"] for t in ok], 0.9) or 0.0),
        "wait_ms_p50": 1e3 * (pct([t["wait_s"] for t in ok], 0.5) or 0.0),
        "offer_ms_p50": 1e3 * (pct([t["offer_s"] for t in ok], 0.5) or 0.0),
        "pull_ms_p50": 1e3 * (pct([t["pull_s"] for t in ok], 0.5) or 0.0),
        "kib_p50": (pct([t["nbytes"] for t in ok], 0.5) or 0) / 1024,
        "MBps_median": statistics.median([t["nbytes"] / t["pull_s"] / 1e6 for t in ok]) if ok else 0.0,
    }


def ms(run: dict[str, Any], *keys: str) -> str:
    return " / ".join(f"{run[k] * 1e3:.1f}" for k in keys)


def table(result: dict[str, Any]) -> str:
    runs = result["runs"]
    load = result["load_average"]
    lines = [
        f"{result['num_requests']} requests of azure-conv (scaled as `sluice serve --demo`), {result['model']} on CPU, "
        f"{result['threads']} torch thread per worker, {result['num_gpu_blocks']} KV blocks per worker; "
        f"{result['repeats']} runs of each, alternating; load average {load[0]:.1f} before, {load[1]:.1f} after; "
        f"tokens identical in every run: {'yes' if result['identical'] else 'NO'}",
        "",
    ]
    rows = []
    for run in [*runs, *result["medians"]]:
        rows.append(
            {
                "run": run["split"],
                "workers": "2 mixed" if run["split"].startswith("colocated") else "1 prefill + 1 decode",
                "wall s": run["wall_s"],
                "tok/s": run["throughput_tok_s"],
                "TTFT p50 / p90 ms": ms(run, "ttft_s_p50", "ttft_s_p90"),
                "TBT p50 / p90 / p99 ms": ms(run, "tbt_s_p50", "tbt_s_p90", "tbt_s_p99"),
                "first gap p50 / p90 ms": ms(run, "first_gap_s_p50", "first_gap_s_p90"),
                "later TBT p50 / p90 / p99 ms": ms(run, "later_tbt_s_p50", "later_tbt_s_p90", "later_tbt_s_p99"),
            }
        )
    lines += [format_table(rows, formats={"wall s": "{:.2f}", "tok/s": "{:.0f}"}), ""]
    s = result["transfer"]
    one = "{:.1f}"
    transfers = {
        "transfers": s["transfers"],
        "succeeded": s["succeeded"],
        "recomputed": s["recomputed"],
        "per request ms p50 / p90 (issue to answer)": f"{s['total_ms_p50']:.1f} / {s['total_ms_p90']:.1f}",
        "of which: waiting for the decode worker's releases p50": s["wait_ms_p50"],
        "OfferKv p50": s["offer_ms_p50"],
        "PullKv p50": s["pull_ms_p50"],
        "KiB p50": s["kib_p50"],
        "PullKv MB/s median": s["MBps_median"],
    }
    formats = {"of which: waiting for the decode worker's releases p50": one, "OfferKv p50": one, "PullKv p50": one}
    formats |= {"KiB p50": "{:.0f}", "PullKv MB/s median": "{:.0f}"}
    lines.append(format_table([transfers], formats=formats))
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    opts = DemoOptions(num_requests=args.requests, duration_s=args.duration_s, max_prompt=args.max_prompt)
    requests = demo_requests(opts, args.model)
    load_before = os.getloadavg()[0]
    runs = [await run_split(name, requests, args) for _ in range(args.repeats) for name in SPLITS]
    identical = all(run["tokens"] == runs[0]["tokens"] for run in runs)
    medians = []
    for name in SPLITS:
        mine = [run for run in runs if run["split"] == name]
        keys = [k for k, v in mine[0].items() if isinstance(v, float)]
        medians.append({"split": f"{name}, median", **{k: statistics.median(run[k] for run in mine) for k in keys}})
    return {
        "model": args.model,
        "num_requests": len(requests),
        "threads": args.threads,
        "num_gpu_blocks": args.num_gpu_blocks,
        "repeats": args.repeats,
        "load_average": (load_before, os.getloadavg()[0]),
        "identical": identical,
        "runs": runs,
        "medians": medians,
        "transfer": transfer_summary([run for run in runs if run["split"] == "disaggregated"]),
    }


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--model", default="tiny-llama", help="dummy-weight preset the workers serve")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--duration-s", type=float, default=8.0, help="the slice's arrivals are compressed into this")
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--num-gpu-blocks", type=int, default=512, help="KV blocks per worker")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each split, alternating")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    print(table(result))
    if args.json:
        write_json(result, args.json, indent=2, quiet=True)
    if not result["identical"]:
        raise SystemExit("the token streams of the two runs differ")


if __name__ == "__main__":
    main()
