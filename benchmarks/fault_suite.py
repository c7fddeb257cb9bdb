"""The live service under faults and attack, at full size: the figures of
docs/results/live_reliability.md. Every scenario runs real gRPC servers on loopback (in this
process, or `sluice worker --engine echo` processes that are SIGKILLed); the same scenario code
runs small in tests/faults/.

    python benchmarks/fault_suite.py [--idle-s 75] [--requests 300] [--cancellations 1000]
                                     [--fuzz-examples 500] [--capacity 64] [--prompt-mb 8]
                                     [--only SCENARIO] [--json OUT.json]

    idle then serve          workers idle past every keepalive setting (production values),
                             then requests: all served, no worker session lost
    8 MB prompt              tokenized (byte limit raised) while health probes and short requests
                             go on: the slowest probe and request meanwhile
    SIGKILL under load       one of two worker processes killed mid-run: requests lost
    all killed, one back     in-flight requests end UNAVAILABLE; one worker restarted and taken back
    random cancellations     client cancels and Aborts at every stage: KV blocks and requests left
    fuzzing                  every request message of the Generation and Worker APIs (hypothesis):
                             crashes, answers other than OK / INVALID_ARGUMENT
    10x overload burst       SLO attainment of admitted requests vs the base load, refusals, memory
    refusals                 unauthenticated calls and a foreign client's Warmup / Release
    10x overload, SLO admission   benchmarks/overload.py in one round: attainment and goodput of the
                             defaults against a hand sweep of max_num_seqs x max_waiting; 0.5x load
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # overload.py, beside this script

from tqdm import tqdm  # noqa: E402

from sluice_bench.fault_harness import (  # noqa: E402
    EchoWorker,
    fuzz_generation_api,
    fuzz_worker_api,
    scenario_all_killed_then_one_back,
    scenario_big_prompt,
    scenario_idle_then_serve,
    scenario_overload,
    scenario_random_cancellations,
    scenario_refusals,
    scenario_sigkill_under_load,
    stack,
)
from sluice_bench.options import benchmark_parser  # noqa: E402
from sluice_bench.report import write_json  # noqa: E402


async def fuzzing(examples: int, seed: int) -> dict[str, Any]:
    import torch

    from worker_service.engine import EngineConfig, LLMEngine
    from worker_service.server import build_server

    torch.set_num_threads(1)
    started = time.perf_counter()
    worker = await EchoWorker.start(0)
    try:
        async with stack([worker.address]) as s:
            generation = await fuzz_generation_api(s, examples, seed)
            left = await s.wait_idle()
        methods = ("Info", "Warmup", "Execute", "Release", "Health")
        echo, echo_unwell = await fuzz_worker_api(worker.address, examples, methods=methods, seed=seed)
    finally:
        await worker.stop()
    engine = LLMEngine(EngineConfig(model="tiny-llama", load_format="dummy", seed=0))
    server = build_server(engine, 0)
    await server.start(ready=False)
    try:
        torch_report, torch_unwell = await fuzz_worker_api(
            f"127.0.0.1:{server.port}", 2 * examples, methods=("Execute",), seed=seed
        )
    finally:
        await server.server.stop(None)
    reports = {"generation api": generation, "worker api (echo)": echo, "worker Execute (torch engine)": torch_report}
    return {
        "examples": {name: r.total for name, r in reports.items()},
        "answers": {name: {m: dict(c) for m, c in r.answers.items()} for name, r in reports.items()},
        "unexpected_answers": sum(len(r.unexpected) for r in reports.values()),
        "unexpected_first": [u for r in reports.values() for u in r.unexpected][:5],
        "crashes": int(bool(echo_unwell)) + int(bool(torch_unwell)),
        "scheduler_held_after": left,
        "seconds": round(time.perf_counter() - started, 1),
    }


def scenarios(args: argparse.Namespace) -> list[tuple[str, Callable[[], Awaitable[dict[str, Any]]]]]:
    return [
        ("idle then serve", lambda: scenario_idle_then_serve(args.idle_s)),
        ("8 MB prompt", lambda: scenario_big_prompt(args.prompt_mb)),
        ("SIGKILL under load", lambda: scenario_sigkill_under_load(args.requests, args.max_tokens)),
        ("all killed, one back", lambda: scenario_all_killed_then_one_back(args.requests // 6, 200)),
        ("random cancellations", lambda: scenario_random_cancellations(args.cancellations, concurrency=100)),
        ("fuzzing", lambda: fuzzing(args.fuzz_examples, args.seed)),
        ("10x overload burst", lambda: scenario_overload(args.capacity, factor=10, compare_unbounded=True)),
        ("refusals", lambda: scenario_refusals(args.refusals)),
        ("10x overload, SLO admission", lambda: slo_admission(args)),
    ]


async def slo_admission(args: argparse.Namespace) -> dict[str, Any]:
    """benchmarks/overload.py, one round: the defaults (SLO-aware admission) against --admission
    off and a small hand sweep of max_num_seqs x max_waiting, then half the load."""
    from overload import main_async

    options = argparse.Namespace(
        step_ms=10.0,
        token_ms=2.0,
        ttft_ms=1000.0,
        tbt_ms=200.0,
        overload=10.0,
        low_load=0.5,
        duration_s=args.overload_s,
        rounds=1,
        sweep_seqs=[8, 16, 24],
        sweep_waiting=[1, 4, 16],
        seed=args.seed,
        phases=["overload", "low"],
        offline_load=1.0,
    )
    figures = await main_async(options)
    over, low = figures["overload"], figures["low_load"]
    return {
        "capacity_req_s": figures["capacity_req_s"],
        "rate_req_s": over["rate_req_s"],
        "default_attainment_admitted": over["default_attainment"],
        "default_goodput_req_s": over["runs"]["default"]["goodput_req_s"],
        "best_sweep": over["best_sweep"],
        "best_sweep_goodput_req_s": over["runs"][over["best_sweep"]]["goodput_req_s"],
        "default_goodput_vs_best_sweep": over["default_goodput_vs_best_sweep"],
        "admission_off_attainment": over["runs"]["no-admit"]["attainment_admitted"],
        "half_load_refused_with_admission": low["admission_slo"]["refused"],
        "half_load_attainment_slo_vs_off": [
            low["admission_slo"]["attainment_admitted"],
            low["admission_off"]["attainment_admitted"],
        ],
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    chosen = [(name, fn) for name, fn in scenarios(args) if not args.only or name in args.only]
    for name, fn in tqdm(chosen, desc="fault suite", unit="scenario"):
        started = time.perf_counter()
        figures = await fn()
        figures.setdefault("seconds", round(time.perf_counter() - started, 1))
        results[name] = figures
        tqdm.write(f"{name}: {json.dumps(figures)}")
    return results


def main() -> int:
    p = benchmark_parser(__doc__)
    p.add_argument(
        "--idle-s", type=float, default=75.0, help="idle time with production keepalive (the outage came at ~60 s)"
    )
    p.add_argument("--prompt-mb", type=float, default=8.0, help="text prompt tokenized while health is probed")
    p.add_argument("--requests", type=int, default=300, help="requests in flight when a worker is SIGKILLed")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--cancellations", type=int, default=1000)
    p.add_argument("--fuzz-examples", type=int, default=500, help="examples per message type")
    p.add_argument("--capacity", type=int, default=64, help="requests of the base load (the burst is 10x)")
    p.add_argument("--refusals", type=int, default=100)
    p.add_argument("--overload-s", type=float, default=10.0, help="seconds of arrivals per SLO-admission run")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--only", action="append", help="run only this scenario (repeatable)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    results = asyncio.run(run(args))
    if args.json:
        write_json(results, args.json, indent=2, quiet=True)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
