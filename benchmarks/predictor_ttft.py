"""What asking the length predictor costs live requests: TTFT at the demo's load with and without
the predictor, measured side by side in one run (target: at most 2% added to TTFT p50).

    2 tiny-llama CPU workers + the predictor process (as `sluice serve` starts them)
    rounds, alternating: a fresh scheduler with --predictor, then one without; each replays
        the demo's 40 requests of azure-conv (lengths scaled) against itself
    -> TTFT p50 and mean of each mode (median over rounds), and how many answers came in time

The scheduler never waits for the predictor (scheduler_service/live/lengths.py): what this
measures is the rest, the predictor's CPU time on a machine the workers share, the extra RPCs
on the scheduler's event loop, and re-filing requests when answers come.

    python benchmarks/predictor_ttft.py [--rounds 4] [--requests 40]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from dataclasses import replace

from tqdm import tqdm

from services.serve import (
    DemoOptions,
    ServeConfig,
    run_demo,
    start_predictor,
    start_scheduler,
    start_workers,
    stop_workers,
)


async def one_round(cfg: ServeConfig, workers: list, demo: DemoOptions, predictor: str | None) -> dict:
    run_cfg = replace(cfg, predictor=predictor, port=0)
    server = await start_scheduler(run_cfg, [w.address for w in workers])
    try:
        await run_demo(server, run_cfg, demo)
        summary = server.live.metrics.summary()
        link = server.live.predictor
        applied = link.num_applied if link is not None else 0
    finally:
        await server.stop(grace_s=1.0, drain_s=0.0)
    return {"p50": summary["ttft_s"]["p50"], "mean": summary["ttft_s"]["mean"], "applied": applied}


async def main_async(args: argparse.Namespace) -> dict[str, list[dict]]:
    cfg = ServeConfig(port=0, start_predictor=True)
    demo = DemoOptions(num_requests=args.requests)
    workers = await start_workers(cfg)
    predictor = await start_predictor(cfg)
    assert predictor is not None
    results: dict[str, list[dict]] = {"with predictor": [], "without": []}
    try:
        for _ in tqdm(range(args.rounds), desc="rounds", unit="round"):
            results["with predictor"].append(await one_round(cfg, workers, demo, predictor.address))
            results["without"].append(await one_round(cfg, workers, demo, None))
    finally:
        await stop_workers([*workers, predictor])
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=40)
    args = parser.parse_args()
    results = asyncio.run(main_async(args))
    print("| mode | TTFT p50 ms (median of rounds) | TTFT mean ms | answers applied per round |")
    print("|---|---|---|---|")
    p50 = {}
    for mode, rounds in results.items():
        p50[mode] = statistics.median(r["p50"] for r in rounds)
        mean = statistics.median(r["mean"] for r in rounds)
        applied = statistics.median(r["applied"] for r in rounds)
        print(f"| {mode} | {p50[mode] * 1e3:.1f} | {mean * 1e3:.1f} | {applied:.0f} of {args.requests} |")
    added = p50["with predictor"] / p50["without"] - 1.0
    verdict = "met" if added <= 0.02 else "missed"
    print(f"\nTTFT p50 added by the predictor: {added:+.1%} (target <= 2%: {verdict})")
    print("per round:", {m: [round(r["p50"] * 1e3, 1) for r in rs] for m, rs in results.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
