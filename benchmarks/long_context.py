"""Long contexts and shared prefixes, measured side by side in the simulator (the
"Long contexts and prefix caching" page, docs/results/long_context.md, comes from this script).

    python benchmarks/long_context.py --out docs/results/data/long_context        (JSON + PNG + tables)

Workloads: the shared Mooncake trace (prompts up to 191k tokens, hash_ids per 512-token
block; its timestamps rescaled to the rate) on llama-3.1-8b (131,072-token context) on one
H100, and `sharegpt-multiturn` (every ShareGPT turn with the conversation so far, real token
ids). Four parts:

    prefix     vllm with prefix caching on and off: TTFT p50, prefill tokens computed, and
               the share of prompt tokens found cached (and the trace's own prefix share)
    policies   every policy on the long-context trace at a load vllm serves below 50% KV:
               throughput / vllm's, preemptions / requests (targets 0.9 and 1); `sls` and
               `scls` as the papers run them and with our long-context options (OURS)
    capacity   sarathi vs vllm under the relaxed Sarathi SLO rule (P99 TBT <= 25x a decode
               iteration, median queueing <= 2 s), sarathi with and without time-priced chunks
    routers    round_robin, least_work, prefix_aware on 4 workers: TTFT p50 and hits

Requests' max_tokens are capped at 2,048 (`--max-tokens`): a client of a 128k model asks
for an answer, not for the whole context; the trace's longest answer is 893 tokens. Orca's
and EconoServe's reservations depend on it (with no cap each reserves up to 128k tokens).
Length-using policies get the oracle (the papers' "Oracle" line).

`--parts` runs a subset; the parts not run are copied from the existing OUT.json.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from scheduler_service import policies  # noqa: F401  (registration)
from scheduler_service.core.policy import POLICIES
from scheduler_service.costmodel.base import CostModel
from scheduler_service.costmodel.factory import build_cost_model
from scheduler_service.sim.capacity import find_capacity, parse_rule
from scheduler_service.sim.simulator import PAPER_SETTING, SimConfig, SimRun, Simulation, simulate
from scheduler_service.sim.slo_profiles import apply_slo_profile
from scheduler_service.workloads import Workload, apply_arrivals, load_trace
from sluice_bench.options import Parallelism, add_parallel_options, benchmark_parser
from sluice_bench.report import print_table, write_json
from sluice_bench.sweep import run_tasks

MODEL, HARDWARE, MAX_TOKENS = "llama-3.1-8b", "h100-80g", 2048
BASE = SimConfig(max_tokens=MAX_TOKENS, length_source="oracle", **PAPER_SETTING)
PARTS = ("prefix", "policies", "capacity", "routers")
MULTITURN_RATES = (4.0, 8.0, 12.0, 16.0, 20.0, 22.0, 24.0)  # one worker; without caching vllm saturates near 22

# Every policy runs with its defaults (the papers' settings; `scls` with its router). Next to
# them, the long-context options of ours, each named in the row: (row, policy, router).
OURS = [
    ("sls (ours: grouped, pad bound)", "sls:group_window=64,max_pad_share=0.25", "round_robin"),
    ("sls (ours: grouped, varlen)", "sls:group_window=64,varlen_attention=true", "round_robin"),
    ("scls (ours: prefill share)", "scls", "scls:max_prefill_share=0.5"),
    (
        "scls (ours: varlen, S=256)",
        "scls:varlen_attention=true",
        "scls:max_prefill_share=0.8,varlen_attention=true,slice_len=256",
    ),
    (
        "scls (ours: varlen, S=256, I<=10s)",
        "scls:varlen_attention=true",
        "scls:max_prefill_share=0.8,varlen_attention=true,slice_len=256,max_interval_s=10",
    ),
]


def workload(trace: str, n: int, rate: float, cm: CostModel, slo: str = "none") -> Workload:
    wl = load_trace(trace, num_requests=n, seed=0)
    wl = apply_arrivals(wl, "auto" if wl.has_arrivals else "poisson", rate=rate, seed=0)
    return apply_slo_profile(slo, wl, cm, seed=0)


def summary(run: SimRun) -> dict[str, Any]:
    m, d = run.metrics, run.details
    return {
        "throughput_req_s": m["throughput_req_s"],
        "throughput_tok_s": m["throughput_tok_s"],
        "ttft_p50_s": m["ttft_s"]["p50"],
        "ttft_p99_s": m["ttft_s"]["p99"],
        "tbt_p99_s": m["tbt_s"]["p99"],
        "kv_util": m["kv_util_mean"],
        "preemptions": m["preemptions"],
        "num_requests": m["num_requests"],
        "num_finished": m["num_finished"],
        "rejected": d["rejected_by_reason"],
        "prefill_tokens": d["prefill_tokens"],
        "prefix_cache": d["prefix_cache"],
        "pad_tokens": d["pad_tokens"],
    }


def run(config: SimConfig, wl: Workload, cm: CostModel) -> dict[str, Any]:
    return summary(simulate(config, wl, cm))


def run_timed(config: SimConfig, wl: Workload, cm: CostModel) -> dict[str, Any]:
    """`run`, plus where the simulated time went: steps that prefill (any row computes more than
    one token or its first) against decode-only steps, their rows, and the invalid rows."""
    sim = Simulation(config, wl, cm)
    split = {"prefill_steps_s": 0.0, "decode_steps_s": 0.0, "prefill_steps": 0, "decode_steps": 0}
    rows = {"prefill": 0, "decode": 0}

    for executor in sim.executors.values():

        def timed(plan: Any, execute: Any = executor.execute, computed: dict[str, int] = executor.computed) -> Any:
            result = execute(plan)
            kind = "decode"
            for rid, n in plan.num_scheduled_tokens.items():
                if n > 1 or computed.get(rid, 0) == n:
                    kind = "prefill"
                    break
            split[f"{kind}_steps_s"] += result.total_s
            split[f"{kind}_steps"] += 1
            rows[kind] += len(plan.num_scheduled_tokens)
            return result

        executor.execute = timed  # type: ignore[method-assign]
    result = sim.run()
    out = summary(result)
    out["time_split"] = {
        **split,
        "rows_per_prefill_step": rows["prefill"] / max(1, split["prefill_steps"]),
        "rows_per_decode_step": rows["decode"] / max(1, split["decode_steps"]),
        "invalid_tokens": result.details["invalid_tokens"],
        "window_s": result.details["window_s"],
    }
    return out


def prefix_one(name: str, trace: str, n: int, rate: float) -> dict[str, Any]:
    cm = build_cost_model("analytic", MODEL, HARDWARE)
    wl = workload(trace, n, rate, cm)
    on = run(replace(BASE, policy="vllm"), wl, cm)
    off = run(replace(BASE, policy="vllm", prefix_caching=False), wl, cm)
    share = on["prefix_cache"]["hit_rate"] or 0.0
    return {
        "trace": trace,
        "requests": n,
        "rate": rate,
        "on": on,
        "off": off,
        "cached_share": share,
        "trace_prefix_share": trace_prefix_share(wl),
        "ttft_p50_drop": 1 - on["ttft_p50_s"] / off["ttft_p50_s"],
        "prefill_drop": 1 - on["prefill_tokens"] / off["prefill_tokens"],
    }


def prefix_part(scenarios: list[tuple[str, str, int, float]], parallelism: Parallelism) -> dict[str, Any]:
    found = run_tasks(prefix_one, scenarios, parallelism, desc="prefix caching on/off")
    return {scenario[0]: r for scenario, r in zip(scenarios, found, strict=True)}


def trace_prefix_share(wl: Workload) -> float:
    """Share of prompt tokens an earlier request of the trace already had as a prefix (what an
    unbounded cache could skip), from hash_ids (512-token blocks) or the multi-turn metadata."""
    if "prefix_share" in wl.metadata:
        return float(wl.metadata["prefix_share"])
    seen: set[tuple[int, ...]] = set()
    total = hit = 0
    per = int(wl.metadata.get("prefix_block_tokens", 512))
    for r in wl.requests:
        ids, k = r.prefix_hash_ids, 0
        while k < len(ids) and ids[: k + 1] in seen:
            k += 1
        total += r.prompt_tokens
        hit += min(k * per, r.prompt_tokens - 1)
        seen.update(ids[: i + 1] for i in range(len(ids)))
    return hit / total if total else 0.0


def policy_one(rate: float, policy: str, router: str, n: int) -> dict[str, Any]:
    cm = build_cost_model("analytic", MODEL, HARDWARE)
    return run_timed(replace(BASE, policy=policy, router=router), workload("mooncake", n, rate, cm), cm)


def policies_part(n: int, rates: list[float], parallelism: Parallelism) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # SCLS is its router plus its policy
    rows = [(p, p, "scls" if p == "scls" else "round_robin") for p in POLICIES.names()] + OURS
    jobs = [(rate, row) for rate in rates for row in rows]
    calls = [(rate, policy, router, n) for rate, (_, policy, router) in jobs]
    found = run_tasks(policy_one, calls, parallelism, desc="policies on long contexts")
    for (rate, (name, policy, router)), result in zip(jobs, found, strict=True):
        out.setdefault(str(rate), {})[name] = {"policy": policy, "router": router, **result}
    return out


def capacity_one(policy: str, n: int) -> dict[str, Any]:
    """`policy`'s capacity on Mooncake under the sarathi rule (doubling, then bisection)."""
    cm = build_cost_model("analytic", MODEL, HARDWARE)
    base = load_trace("mooncake", num_requests=n, seed=0)
    probe = apply_slo_profile("sarathi-relaxed", apply_arrivals(base, "auto", rate=1.0, seed=0), cm, seed=0)
    tbt = float(np.median([r.slo.tbt_s for r in probe.requests]))

    def run_at(rate: float) -> SimRun:
        wl = apply_slo_profile("sarathi-relaxed", apply_arrivals(base, "auto", rate=rate, seed=0), cm, seed=0)
        result = simulate(replace(BASE, policy=policy), wl, cm)
        result.config["rate"] = rate
        return result

    found = find_capacity(run_at, parse_rule("sarathi"), tbt, start_rate=0.25, rel_tol=0.05)
    at = found.run_at_capacity
    return {
        "tbt_slo_s": tbt,
        "capacity_req_s": found.capacity_req_s,
        "probes": found.probes,
        "tbt_p99_at_capacity_s": at.metrics["tbt_s"]["p99"] if at else None,
    }


def capacity_part(n: int, parallelism: Parallelism) -> dict[str, Any]:
    names = ["vllm", "sarathi", "sarathi:price_in_time=false"]
    found = run_tasks(capacity_one, [(p, n) for p in names], parallelism, desc="capacity")
    out: dict[str, Any] = {"tbt_slo_s": found[0]["tbt_slo_s"]}
    for policy, result in zip(names, found, strict=True):
        out[policy] = {k: v for k, v in result.items() if k != "tbt_slo_s"}
    return out


def router_one(trace: str, n: int, rate: float, router: str) -> dict[str, Any]:
    cm = build_cost_model("analytic", MODEL, HARDWARE)
    return run(replace(BASE, policy="vllm", num_workers=4, router=router), workload(trace, n, rate, cm), cm)


def routers_part(scenarios: list[tuple[str, str, int, float]], parallelism: Parallelism) -> dict[str, Any]:
    out: dict[str, Any] = {}
    jobs = [(s, r) for s in scenarios for r in ("round_robin", "least_work", "prefix_aware")]
    calls = [(trace, n, rate, router) for (_, trace, n, rate), router in jobs]
    found = run_tasks(router_one, calls, parallelism, desc="routers, 4 workers")
    for ((name, trace, n, rate), router), result in zip(jobs, found, strict=True):
        out.setdefault(name, {"trace": trace, "requests": n, "rate": rate})[router] = result
    return out


def print_tables(results: dict[str, Any]) -> None:
    print("\n## prefix caching (vllm, one H100)")
    rows = []
    for r in sorted(results["prefix"].values(), key=lambda r: (r["trace"], r["rate"])):
        on, off = r["on"], r["off"]
        rows.append(
            {
                "trace": f"{r['trace']} ({r['requests']})",
                "rate": r["rate"],
                "cached share (trace's)": f"{r['cached_share']:.1%} ({r['trace_prefix_share']:.1%})",
                "TTFT p50 off -> on": f"{off['ttft_p50_s']:.3f} -> {on['ttft_p50_s']:.3f} s",
                "drop": f"{r['ttft_p50_drop']:.1%}",
                "prefill tokens off -> on": f"{off['prefill_tokens']:,} -> {on['prefill_tokens']:,}",
                "prefill drop": f"{r['prefill_drop']:.1%}",
                "req/s off / on": f"{off['throughput_req_s']:.2f} / {on['throughput_req_s']:.2f}",
                "KV off": off["kv_util"],
            }
        )
    print_table(rows, formats={"rate": "{}", "KV off": "{:.2f}"})
    for rate, runs in results["policies"].items():
        vllm = runs["vllm"]
        print(f"\n## every policy, mooncake at {rate} req/s (vllm KV {vllm['kv_util']:.0%})")
        rows = [
            {
                "policy": policy,
                "req/s": r["throughput_req_s"],
                "/ vllm": r["throughput_req_s"] / vllm["throughput_req_s"],
                "preemptions": f"{r['preemptions']} / {r['num_requests']}",
                "TTFT p50": r["ttft_p50_s"] or 0,
                "TBT p99": r["tbt_p99_s"] or 0,
                "KV": r["kv_util"] or 0,
                "pad tokens": r["pad_tokens"],
                "prefill tokens": r["prefill_tokens"],
            }
            for policy, r in runs.items()
        ]
        formats = {"req/s": "{:.3f}", "/ vllm": "{:.2f}", "TTFT p50": "{:.2f}", "TBT p99": "{:.3f}", "KV": "{:.2f}"}
        print_table(rows, formats=formats | {"pad tokens": "{:,}", "prefill tokens": "{:,}"})
        print(f"\n## where the time went, mooncake at {rate} req/s")
        rows = []
        for policy, r in runs.items():
            t = r.get("time_split")
            if t is None:
                continue
            rows.append(
                {
                    "policy": policy,
                    "/ vllm": r["throughput_req_s"] / vllm["throughput_req_s"],
                    "prefill steps (s)": t["prefill_steps_s"],
                    "decode-only steps (s)": t["decode_steps_s"],
                    "decode steps": t["decode_steps"],
                    "rows per decode step": t["rows_per_decode_step"],
                    "rows per prefill step": t["rows_per_prefill_step"],
                    "invalid tokens": t["invalid_tokens"],
                    "window (s)": t["window_s"],
                }
            )
        whole, one = "{:,.0f}", "{:.1f}"
        formats = {"/ vllm": "{:.2f}", "prefill steps (s)": whole, "decode-only steps (s)": whole}
        formats |= {"decode steps": "{:,}", "rows per decode step": one, "rows per prefill step": one}
        print_table(rows, formats=formats | {"invalid tokens": "{:,}", "window (s)": whole})
    cap = results["capacity"]
    print(f"\n## capacity, relaxed SLO (P99 TBT <= {cap['tbt_slo_s']:.3f} s, median queueing <= 2 s)")
    rows = [
        {"policy": policy, "capacity req/s": r["capacity_req_s"], "P99 TBT there (s)": r["tbt_p99_at_capacity_s"]}
        for policy, r in cap.items()
        if policy != "tbt_slo_s"
    ]
    print_table(rows, formats={"capacity req/s": "{:.3f}", "P99 TBT there (s)": "{}"})
    for name, runs in results["routers"].items():
        print(f"\n## routers, 4 workers, {name} at {runs['rate']} req/s")
        rows = [
            {
                "router": router,
                "TTFT p50 (s)": runs[router]["ttft_p50_s"],
                "TTFT p99 (s)": runs[router]["ttft_p99_s"],
                "prefix cache hits": runs[router]["prefix_cache"]["hit_rate"],
                "req/s": runs[router]["throughput_req_s"],
            }
            for router in ("round_robin", "least_work", "prefix_aware")
        ]
        formats = {"TTFT p50 (s)": "{:.3f}", "TTFT p99 (s)": "{:.2f}", "prefix cache hits": "{:.1%}", "req/s": "{:.2f}"}
        print_table(rows, formats=formats)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rate, runs = next(reversed(results["policies"].items()))
    names = list(runs)
    vllm = runs["vllm"]["throughput_req_s"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    axes[0].bar(names, [runs[p]["throughput_req_s"] / vllm for p in names], color="tab:blue")
    axes[0].axhline(0.9, color="tab:red", linestyle="--", label="target 0.9")
    axes[0].set_title(f"throughput / vllm, mooncake at {rate} req/s", fontsize=9)
    axes[0].legend(fontsize=8)
    axes[0].tick_params(axis="x", rotation=60, labelsize=7)
    for label in axes[0].get_xticklabels():
        label.set_horizontalalignment("right")
    multiturn = sorted((r for r in results["prefix"].values() if r["trace"] != "mooncake"), key=lambda r: r["rate"])
    rates = [r["rate"] for r in multiturn]
    axes[1].plot(rates, [r["ttft_p50_drop"] for r in multiturn], "o-", label="TTFT p50 drop")
    axes[1].plot(rates, [r["cached_share"] for r in multiturn], "s--", label="prompt tokens cached (target)")
    axes[1].set_xlabel("req/s (one worker)", fontsize=8)
    axes[1].set_title("vllm with prefix caching, sharegpt-multiturn", fontsize=9)
    axes[1].legend(fontsize=8)
    routers = results["routers"]
    labels = list(routers)
    xs = np.arange(len(labels))
    for i, router in enumerate(("round_robin", "least_work", "prefix_aware")):
        axes[2].bar(xs + 0.27 * (i - 1), [routers[k][router]["ttft_p50_s"] for k in labels], 0.27, label=router)
    axes[2].set_xticks(xs, labels, fontsize=8)
    axes[2].set_title("TTFT p50 (s), 4 workers", fontsize=9)
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--out", default="docs/results/data/long_context", help="writes OUT.json and OUT.png")
    parser.add_argument(
        "--requests", type=int, default=1000, help="Mooncake requests of the policies and capacity parts"
    )
    parser.add_argument("--rates", default="0.5,1.0", help="Mooncake rates of the policies part (req/s)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
    add_parallel_options(parser)
    args = parser.parse_args()
    parallelism = Parallelism.from_args(args)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--parts: unknown part(s) {unknown}; choose from {PARTS}")
    prefix_scenarios = [("mooncake", "mooncake", 3993, 1.0)] + [
        (f"sharegpt-multiturn@{rate:g}", "sharegpt-multiturn", 2000, rate) for rate in MULTITURN_RATES
    ]
    router_scenarios = [
        ("sharegpt-multiturn", "sharegpt-multiturn", 2000, 12.0),
        ("mooncake", "mooncake", 3993, 3.0),
    ]
    out = Path(args.out)
    previous = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").exists() else {}
    missing = [p for p in PARTS if p not in parts and p not in previous]
    if missing:
        parser.error(f"--parts: {missing} not run and not in {out.with_suffix('.json')}; run them too")
    jobs = {
        "prefix": lambda: prefix_part(prefix_scenarios, parallelism),
        "policies": lambda: policies_part(args.requests, [float(x) for x in args.rates.split(",")], parallelism),
        "capacity": lambda: capacity_part(min(args.requests, 600), parallelism),
        "routers": lambda: routers_part(router_scenarios, parallelism),
    }
    results: dict[str, Any] = {"model": MODEL, "hardware": HARDWARE, "max_tokens": MAX_TOKENS}
    for part in PARTS:
        if part in parts:
            results[part] = jobs[part]()
        else:
            print(f"{part}: copied from {out.with_suffix('.json')} (not run)")
            results[part] = previous[part]
    write_json(results, out.with_suffix(".json"), indent=1, quiet=True)
    plot(results, out.with_suffix(".png"))
    print_tables(results)
    print(f"\nwrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
