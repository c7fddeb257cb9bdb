"""Simulator decisions unchanged: every registered policy on the sharegpt and azure-conv
traces, metrics written to JSON and compared with an earlier run of this script.

    python benchmarks/sim_regression.py --out before.json            (on the old code)
    python benchmarks/sim_regression.py --out after.json --compare before.json

A refactor that must not change decisions shows `identical` on every row. Wall-time metrics
(`sched_overhead_ms`) are left out: they measure the machine, not the decisions.
`--no-prefix-caching` runs the policies without automatic prefix caching (on by default),
to compare with runs of code that had none.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from scheduler_service import policies  # noqa: F401  (registers the policies)
from scheduler_service.core.policy import POLICIES
from scheduler_service.costmodel.factory import build_cost_model
from scheduler_service.sim.simulator import PAPER_SETTING, SimConfig, simulate
from scheduler_service.sim.slo_profiles import apply_slo_profile
from scheduler_service.workloads import apply_arrivals, load_trace
from sluice_bench.options import SERIAL, Parallelism, add_parallel_options, benchmark_parser
from sluice_bench.report import print_table, write_json
from sluice_bench.sweep import run_tasks

# (name, trace, rate or None for the trace's own arrivals, workers, router, length source, SLO profile)
SCENARIOS = (
    ("sharegpt", "sharegpt", 2.0, 1, "round_robin", "oracle", "sarathi-relaxed"),
    ("azure-conv", "azure-conv", None, 2, "least_work", "max_tokens", "econoserve"),
)
MODEL, HARDWARE, KV_GB = "llama-2-7b", "a100-80g", 12.0


def run_scenario(scenario: tuple, policy: str, num_requests: int, prefix_caching: bool) -> dict[str, Any]:
    """One policy on one scenario: its metrics, wall-time ones left out."""
    _name, trace, rate, workers, router, lengths, slo = scenario
    cost_model = build_cost_model("analytic", MODEL, HARDWARE)
    workload = load_trace(trace, num_requests=num_requests, seed=0)
    if rate is not None:
        workload = apply_arrivals(workload, "poisson", rate=rate, seed=0)
    workload = apply_slo_profile(slo, workload, cost_model, seed=0)
    config = SimConfig(
        policy=policy,
        num_workers=workers,
        router=router,
        kv_gb=KV_GB,
        max_model_len=8192,
        length_source=lengths,
        prefix_caching=prefix_caching,
        **PAPER_SETTING,
    )
    metrics = simulate(config, workload, cost_model).metrics
    metrics.pop("sched_overhead_ms", None)
    return metrics


def run_all(num_requests: int, prefix_caching: bool = True, parallelism: Parallelism = SERIAL) -> dict[str, Any]:
    jobs = [(s, p) for s in SCENARIOS for p in POLICIES.names()]
    calls = [(scenario, policy, num_requests, prefix_caching) for scenario, policy in jobs]
    results = run_tasks(run_scenario, calls, parallelism, desc="policies x traces")
    return {f"{scenario[0]}/{policy}": m for (scenario, policy), m in zip(jobs, results, strict=True)}


def _differences(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        diffs = []
        for key in sorted(set(a) | set(b)):
            diffs += _differences(a.get(key), b.get(key), f"{path}.{key}" if path else key)
        return diffs
    if isinstance(a, float) and isinstance(b, float):
        return [] if abs(a - b) <= 1e-9 * max(1.0, abs(a)) else [f"{path}: {a:.6g} -> {b:.6g}"]
    return [] if a == b else [f"{path}: {a} -> {b}"]


def main() -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--num-requests", type=int, default=400)
    parser.add_argument("--out", required=True, help="write the metrics of every run here (JSON)")
    parser.add_argument("--compare", help="an earlier --out of this script")
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    add_parallel_options(parser)
    args = parser.parse_args()
    results = run_all(args.num_requests, args.prefix_caching, Parallelism.from_args(args))
    write_json(results, args.out, indent=1, sort_keys=True)
    if not args.compare:
        return 0
    before = json.loads(Path(args.compare).read_text())
    changed = 0
    rows = []
    for key in sorted(set(before) | set(results)):
        a, b = before.get(key, {}), results.get(key, {})
        diffs = _differences(a, b)
        changed += bool(diffs)
        rows.append(
            {
                "run": key,
                "tok/s before": a.get("throughput_tok_s"),
                "tok/s after": b.get("throughput_tok_s"),
                "JCT p50 before": a.get("jct_s", {}).get("p50"),
                "after": b.get("jct_s", {}).get("p50"),
                "same": "identical" if not diffs else "CHANGED: " + "; ".join(diffs[:3]),
            }
        )
    print_table(rows, digits=6)
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
