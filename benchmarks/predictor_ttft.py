"""What asking the length predictor costs live requests: TTFT at the demo's load with and without
the predictor, measured side by side in one run (target: at most 2% added to TTFT p50).

    2 tiny-llama CPU workers (as `sluice serve` starts them), kept for the whole run
    each round, three modes (four with --unlinked) in a rotating order (drift on the shared
    machine hits each alike):
        without     a fresh scheduler without --predictor
        uncached    a fresh scheduler with a freshly started predictor (no Redis, empty
                    in-process cache and history: every prompt is new to it, as live traffic is)
        cached      a fresh scheduler with that same predictor again: every prompt is a cache hit
        unlinked    (--unlinked; between `without` and `uncached` in the rotation) a fresh
                    scheduler without --predictor, while this process sends the predictor the
                    same prompts, each led by a token of the round, at their arrivals: the
                    predictor's work (and the RPCs) without the scheduler using an answer, which
                    separates the two costs
    each replays the demo's 40 requests of azure-conv (lengths scaled) against itself
    -> per mode: TTFT p50 and mean (median over rounds), answers applied in time, the
       predictor's CPU seconds; and the paired per-round ratio against `without`

The scheduler never waits for the predictor (scheduler_service/live/predictor_link.py): what this
measures is the rest, the predictor's CPU time on a machine the workers share (it runs at the
niceness `sluice serve` gives it), the extra RPCs on the scheduler's event loop, and re-filing
requests when answers come.

With --worker-cpus / --predictor-cpus (as `sluice serve` takes them) the predictor runs on cores
the workers do not use, as when it is its own container. The pinning holds for every mode,
`without` included (the workers are pinned for the whole run), so the comparison stays side by
side; --scheduler-cpus pins this process (the scheduler) once the workers run.

    python benchmarks/predictor_ttft.py [--rounds 4] [--requests 40] [--priorities idle,nice] [--json out.json]
        [--worker-cpus 0 --predictor-cpus 1 --scheduler-cpus 0]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from dataclasses import replace
from typing import Any

import numpy as np
from tqdm import tqdm

from services.affinity import pin_self
from services.serve import (
    DemoOptions,
    ServeConfig,
    WorkerProcess,
    demo_requests,
    run_demo,
    start_predictor,
    start_scheduler,
    start_workers,
    stop_workers,
)
from sluice.common.predictor_client import PredictorClient
from sluice_bench.options import benchmark_parser
from sluice_bench.report import format_table, write_json

MODES = ("without", "uncached", "cached")
# NOTE: `unlinked` (--unlinked) separates the predictor's own cost from the scheduler's use of its
# answers: the same Predict calls, from this process at each request's arrival, on prompts new to
# the predictor, but the scheduler never hears of them; it sits between `without` and `uncached`
# in the rotation (uncached must still run just before cached).
UNLINKED_MODES = ("without", "unlinked", "uncached", "cached")
SETTLE_S = 2.0


def cpu_seconds(process: WorkerProcess) -> float:
    """User + system CPU seconds the child has used so far (Linux's per-process accounting)."""
    with open(f"/proc/{process.proc.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def side_predictions(address: str, cfg: ServeConfig, demo: DemoOptions, salt: int) -> int:
    """`unlinked`: a Predict for each demo request at its arrival, its prompt led by a token of
    its own (`salt`), so every one is a cache miss as in `uncached`; the answers go nowhere.
    Returns how many were answered."""
    requests = demo_requests(demo, cfg.model)
    loop = asyncio.get_running_loop()
    start = loop.time()
    answered = 0
    async with PredictorClient(address) as client:

        async def one(i: int, r: Any) -> None:
            nonlocal answered
            await asyncio.sleep(max(0.0, start + r.arrival_s - loop.time()))
            pred = await client.predict(f"side-{salt}-{i}", [salt, *r.prompt_ids], cfg.model, r.max_tokens, 1.0)
            answered += pred is not None

        await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    return answered


async def one_run(
    cfg: ServeConfig, workers: list, demo: DemoOptions, predictor: WorkerProcess | None, side_salt: int | None = None
) -> dict:
    """One replay of the demo; with `side_salt` the predictor answers alongside but unlinked."""
    linked = predictor if side_salt is None else None
    run_cfg = replace(cfg, predictor=linked.address if linked else None, port=0)
    server = await start_scheduler(run_cfg, [w.address for w in workers])
    cpu0 = cpu_seconds(predictor) if predictor else 0.0
    # NOTE: this process's CPU (every thread): the scheduler, its gRPC channels and the demo's
    # clients; what the modes add here lands on the scheduler's cores, not the predictor's.
    own0 = time.process_time()
    try:
        side = None
        if predictor is not None and side_salt is not None:
            side = asyncio.ensure_future(side_predictions(predictor.address, cfg, demo, side_salt))
        await run_demo(server, run_cfg, demo)
        side_answered = await side if side is not None else 0
        summary = server.live.metrics.summary()
        ttfts = list(server.live.metrics.ttft)
        link = server.live.predictor
        applied = link.num_applied if link is not None else side_answered
        own_cpu = time.process_time() - own0
    finally:
        await server.stop(grace_s=1.0, drain_s=0.0)
    return {
        "p50": summary["ttft_s"]["p50"],
        "mean": summary["ttft_s"]["mean"],
        "applied": applied,
        "ttfts_s": ttfts,
        "predictor_cpu_s": (cpu_seconds(predictor) - cpu0) if predictor else 0.0,
        "scheduler_cpu_s": own_cpu,
    }


async def one_round(
    cfg: ServeConfig, workers: list, demo: DemoOptions, first: int, modes: tuple[str, ...] = MODES, salt: int = 1000
) -> dict[str, dict]:
    """The modes, starting at `first` (0 or 1) in `modes`, so `uncached` (which fills the
    predictor's cache) always runs just before `cached`."""
    predictor = await start_predictor(replace(cfg, redis_url=None))
    assert predictor is not None
    out: dict[str, dict] = {}
    try:
        # its first answer builds the inference sessions: one prompt no demo request carries, then
        # a pause, so that start-up work lands in neither the first mode nor `uncached`
        async with PredictorClient(predictor.address) as client:
            await client.predict("warm-up", "a warm-up prompt that no demo request carries", timeout_s=60.0)
        await asyncio.sleep(SETTLE_S)
        for mode in modes[first:] + modes[:first]:
            side_salt = salt if mode == "unlinked" else None
            out[mode] = await one_run(cfg, workers, demo, None if mode == "without" else predictor, side_salt)
    finally:
        await stop_workers([predictor])
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    cfg = pinned_config(args)
    demo = DemoOptions(num_requests=args.requests)
    load = [os.getloadavg()[0]]
    workers = await start_workers(cfg)
    pin_self(cfg.scheduler_cpu_set())
    rounds: list[dict[str, Any]] = []
    priorities = args.priorities.split(",")
    try:
        for i in tqdm(range(args.rounds), desc="rounds", unit="round"):
            # NOTE: with several priorities the rounds alternate between them, so each is measured
            # beside the other on the same workers, not in separate runs minutes apart.
            prio = priorities[i % len(priorities)]
            modes = await one_round(
                replace(cfg, predictor_idle=prio == "idle"),
                workers,
                demo,
                first=(i // len(priorities)) % 2,
                modes=UNLINKED_MODES if args.unlinked else MODES,
                salt=2000 + i,
            )
            rounds.append({"priority": prio, **modes})
    finally:
        await stop_workers(workers)
    load.append(os.getloadavg()[0])
    pinning = {name: getattr(cfg, name) for name in ("worker_cpus", "predictor_cpus", "scheduler_cpus")}
    return {"rounds": rounds, "load_average": load, "requests": args.requests, "time": time.time(), **pinning}


def pinned_config(args: argparse.Namespace) -> ServeConfig:
    """The launcher's settings with the run's CPU sets; ValueError naming the flag's setting for a
    list that does not parse or names CPUs this process may not use."""
    # NOTE: auto_pin off: without CPU lists this benchmark measures every process on every CPU
    cfg = ServeConfig(
        port=0,
        start_predictor=True,
        worker_cpus=args.worker_cpus,
        predictor_cpus=args.predictor_cpus,
        scheduler_cpus=args.scheduler_cpus,
        auto_pin=False,
    )
    cfg.worker_cpu_set()
    cfg.predictor_cpu_set()
    cfg.scheduler_cpu_set()
    return cfg


def report(res: dict[str, Any]) -> str:
    by_priority: dict[str, list[dict]] = {}
    for r in res["rounds"]:
        by_priority.setdefault(r.get("priority", "nice"), []).append(r)
    parts = [
        f"predictor priority: {prio} ({len(rounds)} rounds)\n\n" + report_rounds(rounds, res["requests"])
        for prio, rounds in by_priority.items()
    ]
    parts.append(f"load average (1 min) before / after: {res['load_average'][0]:.1f} / {res['load_average'][1]:.1f}")
    parts.append(
        f"CPUs: workers {res.get('worker_cpus') or 'any'}, predictor {res.get('predictor_cpus') or 'any'}, "
        f"scheduler {res.get('scheduler_cpus') or 'any'}"
    )
    return "\n\n".join(parts)


def modes_of(rounds: list[dict[str, Any]]) -> list[str]:
    return [m for m in UNLINKED_MODES if m in rounds[0]]


def report_rounds(rounds: list[dict[str, Any]], n: int) -> str:
    rows = []
    added = {}
    for mode in modes_of(rounds):
        p50 = statistics.median(r[mode]["p50"] for r in rounds)
        mean = statistics.median(r[mode]["mean"] for r in rounds)
        ratio = statistics.median(r[mode]["p50"] / r["without"]["p50"] for r in rounds)
        added[mode] = ratio - 1.0
        applied = statistics.median(r[mode]["applied"] for r in rounds)
        cpu = statistics.median(r[mode]["predictor_cpu_s"] for r in rounds)
        own = statistics.median(r[mode].get("scheduler_cpu_s", float("nan")) for r in rounds)
        rows.append(
            {
                "mode": mode,
                "TTFT p50 ms (median of rounds)": p50 * 1e3,
                "TTFT mean ms": mean * 1e3,
                "paired p50 ratio vs without (median)": ratio,
                "answers applied (unlinked: answered) per round": f"{applied:.0f} of {n}",
                "predictor CPU s per round": cpu,
                "scheduler process CPU s per round": own,
            }
        )
    formats = {"TTFT p50 ms (median of rounds)": "{:.1f}", "TTFT mean ms": "{:.1f}"}
    formats |= {"paired p50 ratio vs without (median)": "{:.3f}", "predictor CPU s per round": "{:.2f}"}
    formats |= {"scheduler process CPU s per round": "{:.2f}"}
    lines = [format_table(rows, formats=formats), "", pooled(rounds), ""]
    if "unlinked" in added:
        lines.append(f"\nTTFT p50 with the predictor busy but unlinked: {added['unlinked']:+.1%} (its work alone)")
    for mode in ("uncached", "cached"):
        verdict = "met" if added[mode] <= 0.02 else "missed"
        lines.append(f"\nTTFT p50 added by the predictor, {mode}: {added[mode]:+.1%} (target <= 2%: {verdict})")
    per_round = {m: [round(r[m]["p50"] * 1e3, 1) for r in rounds] for m in modes_of(rounds)}
    lines.append(f"per round TTFT p50 ms: {per_round}")
    return "\n".join(lines)


def pooled(rounds: list[dict[str, Any]], resamples: int = 2000) -> str:
    """Every request's TTFT of every round pooled per mode: the ratio of the pooled medians with a
    95% bootstrap interval (requests resampled within each round), i.e. how finely this run can
    resolve an added share of TTFT at all."""
    rng = np.random.default_rng(0)
    by_mode = {m: [np.asarray(r[m]["ttfts_s"]) for r in rounds] for m in modes_of(rounds)}

    def median_of(samples: list[np.ndarray]) -> float:
        return float(np.median(np.concatenate(samples)))

    rows = []
    base = median_of(by_mode["without"])
    for mode in by_mode:
        ratios = []
        for _ in range(resamples):
            mine = [rng.choice(x, x.size) for x in by_mode[mode]]
            ref = [rng.choice(x, x.size) for x in by_mode["without"]]
            ratios.append(median_of(mine) / median_of(ref))
        lo, hi = np.percentile(ratios, [2.5, 97.5])
        n = sum(x.size for x in by_mode[mode])
        p50 = median_of(by_mode[mode])
        rows.append(
            {
                "mode": mode,
                "requests": n,
                "pooled TTFT p50 ms": p50 * 1e3,
                "ratio vs without": p50 / base,
                "95% interval": f"[{lo:.3f}, {hi:.3f}]",
            }
        )
    return format_table(rows, formats={"pooled TTFT p50 ms": "{:.1f}", "ratio vs without": "{:.3f}"})


def main() -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--json")
    parser.add_argument(
        "--priorities",
        default="nice",
        help="the predictor's CPU priority, comma-separated to alternate rounds: nice (its niceness alone, the "
        "default of sluice serve) and/or idle (SCHED_IDLE as well, --predictor-idle)",
    )
    parser.add_argument(
        "--unlinked",
        action="store_true",
        help="a fourth mode: the predictor answers the same (uncached) prompts alongside, the scheduler unaware",
    )
    parser.add_argument("--worker-cpus", help="pin the workers to these CPUs (0,2-3), in every mode; default: not")
    parser.add_argument("--predictor-cpus", help="pin the predictor to these CPUs; default: not")
    parser.add_argument(
        "--scheduler-cpus", help="pin this process (the scheduler) to these CPUs once the workers run; default: not"
    )
    args = parser.parse_args()
    if not set(args.priorities.split(",")) <= {"idle", "nice"}:
        parser.error(f"--priorities: each must be idle or nice, got {args.priorities!r}")
    try:
        pinned_config(args)
    except ValueError as exc:
        parser.error(str(exc))
    res = asyncio.run(main_async(args))
    print(report(res))
    if args.json:
        write_json(res, args.json, indent=1, quiet=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
