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

from tqdm import tqdm

from scheduler_service import policies  # noqa: F401  (registers the policies)
from scheduler_service.core.policy import POLICIES
from scheduler_service.costmodel.factory import build_cost_model
from scheduler_service.sim.simulator import PAPER_SETTING, SimConfig, simulate
from scheduler_service.sim.slo_profiles import apply_slo_profile
from scheduler_service.workloads import apply_arrivals, load_trace

# (name, trace, rate or None for the trace's own arrivals, workers, router, length source, SLO profile)
SCENARIOS = (
    ("sharegpt", "sharegpt", 2.0, 1, "round_robin", "oracle", "sarathi-relaxed"),
    ("azure-conv", "azure-conv", None, 2, "least_work", "max_tokens", "econoserve"),
)
MODEL, HARDWARE, KV_GB = "llama-2-7b", "a100-80g", 12.0


def run_all(num_requests: int, prefix_caching: bool = True) -> dict[str, Any]:
    cost_model = build_cost_model("analytic", MODEL, HARDWARE)
    out: dict[str, Any] = {}
    jobs = [(s, p) for s in SCENARIOS for p in POLICIES.names()]
    for scenario, policy in tqdm(jobs, desc="policies x traces", unit="run"):
        name, trace, rate, workers, router, lengths, slo = scenario
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
        out[f"{name}/{policy}"] = metrics
    return out


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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=400)
    parser.add_argument("--out", required=True)
    parser.add_argument("--compare", help="an earlier --out of this script")
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    results = run_all(args.num_requests, args.prefix_caching)
    Path(args.out).write_text(json.dumps(results, indent=1, sort_keys=True))
    if not args.compare:
        return 0
    before = json.loads(Path(args.compare).read_text())
    changed = 0
    print(f"{'run':<28} {'tok/s before':>12} {'tok/s after':>12} {'JCT p50 before':>15} {'after':>8}  same")
    for key in sorted(set(before) | set(results)):
        a, b = before.get(key, {}), results.get(key, {})
        diffs = _differences(a, b)
        changed += bool(diffs)
        print(
            f"{key:<28} {a.get('throughput_tok_s', 0):12.1f} {b.get('throughput_tok_s', 0):12.1f} "
            f"{a.get('jct_s', {}).get('p50') or 0:15.2f} {b.get('jct_s', {}).get('p50') or 0:8.2f}  "
            f"{'identical' if not diffs else 'CHANGED: ' + '; '.join(diffs[:3])}"
        )
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
