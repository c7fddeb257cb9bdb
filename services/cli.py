"""The `sluice` command: simulate, capacity, profile, worker, serve, scheduler.

    sluice simulate --trace sharegpt --policy vllm --policy sarathi --model llama-2-7b \
        --hardware a100-80g --rate 2 --num-requests 1000 --json out.json --plot out.png
    sluice capacity --trace arxiv --policy sarathi --model mistral-7b --hardware a100-80g \
        --slo-profile sarathi-strict --slo-rule sarathi
    sluice profile --model tiny-llama --out profile.json
    sluice worker --model tiny-llama --port 50061
    sluice serve --workers 2 --policy sarathi --demo
    sluice scheduler --worker 127.0.0.1:50061 --worker 127.0.0.1:50062 --port 50051
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any


def _workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--trace", required=True, help="a shared trace name, a synthetic workload name, or a file path")
    g.add_argument("--num-requests", type=int, default=1000, help="requests taken from the trace (default 1000)")
    g.add_argument(
        "--rate", type=float, help="arrivals/s: rescales trace timestamps, or Poisson for length-only traces"
    )
    g.add_argument("--arrival", default="auto", choices=["auto", "trace", "poisson", "gamma"])
    g.add_argument("--cv", type=float, default=1.0, help="coefficient of variation of gamma arrivals")
    g.add_argument("--slo-profile", default="none", help="none, accelgen, econoserve, sarathi-strict, sarathi-relaxed")
    g.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("system")
    s.add_argument("--policy", action="append", help="policy[:key=value,...]; repeat to compare (default vllm)")
    s.add_argument("--model", default="llama-2-7b", help="model preset, e.g. llama-2-7b, mistral-7b, yi-34b@tp2")
    s.add_argument("--hardware", default="a100-80g", help="a100-80g, h100-80g, h200, a40, v100-32g")
    s.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    s.add_argument("--cost-model", default="analytic", help="analytic, profile (measured operators), fitted")
    s.add_argument("--profile", help="a `sluice profile` JSON for --cost-model fitted")
    s.add_argument("--kv-gb", type=float, help="KV cache size per worker in GiB (default: memory minus weights)")
    s.add_argument("--workers", type=int, default=1)
    s.add_argument("--router", default="round_robin")
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--max-num-seqs", type=int, default=256)
    s.add_argument("--max-num-batched-tokens", type=int)
    s.add_argument("--max-model-len", type=int, help="override the model's context length")
    s.add_argument("--max-tokens", type=int, help="cap of every request's max_tokens")
    s.add_argument("--length-source", default="max_tokens", help="max_tokens, oracle, noisy_oracle")
    s.add_argument("--length-error", type=float, default=0.2, help="relative error of noisy_oracle")
    s.add_argument("--int8-swap", action="store_true", help="int8-compress swapped KV (halves swap bytes)")
    s.add_argument("--no-progress", action="store_true")


def _setup(args: argparse.Namespace) -> tuple[Any, Any]:
    from scheduler_service.costmodel.factory import build_cost_model
    from scheduler_service.sim.workloads import load_trace

    cost_model = build_cost_model(args.cost_model, args.model, args.hardware, args.tp, args.profile)
    workload = load_trace(args.trace, num_requests=args.num_requests, seed=args.seed)
    return cost_model, workload


def _prepare(args: argparse.Namespace, cost_model: Any, workload: Any, rate: float | None) -> Any:
    from scheduler_service.sim.slo_profiles import apply_slo_profile
    from scheduler_service.sim.workloads import apply_arrivals

    if rate is not None or not workload.has_arrivals:
        if rate is None:
            raise SystemExit(f"error: trace {args.trace!r} has no arrival times; give --rate")
        workload = apply_arrivals(workload, args.arrival, rate=rate, cv=args.cv, seed=args.seed)
    return apply_slo_profile(args.slo_profile, workload, cost_model, seed=args.seed)


def _sim_config(args: argparse.Namespace, policy: str) -> Any:
    from scheduler_service.sim.simulator import SimConfig

    return SimConfig(
        policy=policy,
        num_workers=args.workers,
        router=args.router,
        block_size=args.block_size,
        kv_gb=args.kv_gb,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        max_tokens=args.max_tokens,
        length_source=args.length_source,
        length_error=args.length_error,
        int8_swap=args.int8_swap,
        seed=args.seed,
        progress=not args.no_progress,
    )


def cmd_simulate(args: argparse.Namespace) -> int:
    from scheduler_service.sim.report import format_table, plot_runs, write_json
    from scheduler_service.sim.simulator import simulate

    cost_model, workload = _setup(args)
    workload = _prepare(args, cost_model, workload, args.rate)
    runs = []
    for policy in args.policy or ["vllm"]:
        run = simulate(_sim_config(args, policy), workload, cost_model)
        run.config["rate"] = args.rate
        runs.append(run)
    stats = workload.stats()
    print(
        f"{workload.name}: {len(workload)} requests, prompt mean {stats.prompt_mean:.0f}, "
        f"output mean {stats.output_mean:.0f}, {cost_model.model.name} on {cost_model.hardware.name} "
        f"x{args.workers} ({cost_model.name} cost model), SLO profile {args.slo_profile}"
    )
    print(format_table(runs))
    for run in runs:
        rejected = run.details["rejected_by_reason"]
        if rejected:
            reasons = ", ".join(f"{k}: {v}" for k, v in rejected.items())
            print(f"{run.policy}: rejected {sum(rejected.values())} ({reasons})")
    if args.json:
        write_json(runs, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        plot_runs(runs, args.plot, f"{workload.name} on {cost_model.model.name} / {cost_model.hardware.name}")
        print(f"wrote {args.plot}")
    return 0


def cmd_capacity(args: argparse.Namespace) -> int:
    import numpy as np

    from scheduler_service.sim.capacity import find_capacity, parse_rule
    from scheduler_service.sim.simulator import simulate

    rule = parse_rule(args.slo_rule)
    cost_model, base = _setup(args)
    results = {}
    for policy in args.policy or ["vllm"]:
        tbt_slo: list[float | None] = [None]

        def run_at(rate: float, policy: str = policy, tbt_slo: list = tbt_slo) -> Any:
            workload = _prepare(args, cost_model, base, rate)
            tbts = [r.slo.tbt_s for r in workload.requests if r.slo is not None and r.slo.tbt_s is not None]
            tbt_slo[0] = float(np.median(tbts)) if tbts else None
            cfg = _sim_config(args, policy)
            cfg.progress = False
            run = simulate(cfg, workload, cost_model)
            run.config["rate"] = rate
            return run

        run_at(args.start_rate)  # learns the workload's TBT SLO for the rule
        result = find_capacity(run_at, rule, tbt_slo[0], start_rate=args.start_rate, rel_tol=args.tolerance)
        results[policy] = {"capacity_req_s": result.capacity_req_s, "probes": result.probes, "tbt_slo_s": tbt_slo[0]}
        print(
            f"{policy}: capacity {result.capacity_req_s:.3f} req/s under {args.slo_rule} (probes: {len(result.probes)})"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"rule": args.slo_rule, "model": args.model, "trace": args.trace, "results": results}, f, indent=2
            )
        print(f"wrote {args.json}")
    return 0


def _delegate(module: str) -> Any:
    def run(args: argparse.Namespace) -> int:
        import importlib

        return int(importlib.import_module(module).main(args.rest) or 0)

    return run


def _serve_commands(sub: argparse._SubParsersAction) -> None:
    """`serve` (workers as subprocesses + the scheduler) and `scheduler` (against running workers)."""
    from services import serve

    p = sub.add_parser("serve", help="start the scheduler and N workers; --demo replays a trace against them")
    serve.add_serve_arguments(p, workers=True)
    p.set_defaults(func=serve.cmd_serve)
    p = sub.add_parser("scheduler", help="run the scheduler service against running workers")
    serve.add_serve_arguments(p, workers=False)
    p.set_defaults(func=serve.cmd_scheduler)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description="Sluice: LLM serving scheduler and simulator")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("simulate", help="replay a trace through policies in the simulator")
    _workload_args(p)
    p.add_argument("--json", help="write metrics JSON here")
    p.add_argument("--plot", help="write a PNG comparison here")
    p.set_defaults(func=cmd_simulate)
    p = sub.add_parser("capacity", help="largest sustainable rate under an SLO rule")
    _workload_args(p)
    p.add_argument("--slo-rule", required=True, help="sarathi, attainment:X, p99_tbt:S, p99_ttft:S, norm_latency:S")
    p.add_argument("--start-rate", type=float, default=1.0)
    p.add_argument("--tolerance", type=float, default=0.05, help="relative width at which bisection stops")
    p.add_argument("--json", help="write results JSON here")
    p.set_defaults(func=cmd_capacity)
    _serve_commands(sub)
    for name, module, text in (
        ("profile", "worker_service.profiler", "measure a worker's step times and write a profile JSON"),
        ("worker", "worker_service.server", "run one worker service"),
    ):
        p = sub.add_parser(name, help=text, add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(func=_delegate(module))
    _client_commands(sub)
    return parser


def _client_commands(sub: Any) -> None:
    """`sluice generate` and `sluice bench`: clients of a running scheduler (services/generate.py, bench.py)."""
    from services import bench, generate

    generate.add_parser(sub)
    bench.add_parser(sub)


_DELEGATED = {"profile": "worker_service.profiler", "worker": "worker_service.server"}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _DELEGATED:
        # NOTE: these commands own their flags; argparse.REMAINDER would reject a leading "--flag".
        import importlib

        return int(importlib.import_module(_DELEGATED[argv[0]]).main(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (KeyError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
