"""Reproduces AccelGen's evaluation (seed 000, sections 6.1 to 6.3, Figures 11 and 12) in the
simulator: OPT-13B on one A100-80GB with 12 GB of KV cache, block size 32, outputs up to
2048 tokens, the `accelgen-mix` workload (Alpaca / ShareGPT / 35% BookCorpus), the paper's
SLO profile (TTFT = group prefill latency x U[0.5, 1.5], TBT = 0.1875 s x U[0.75, 1.25]),
Poisson arrivals. A share of the requests (`--offline-share`, default 20%) is offline: it
carries a JCT SLO instead (EconoServe's recipe, 2 x (t_p + t_g x l_g)), since the paper reports
JCT-SLO attainment without saying how its JCT SLOs were set.

Runs accelgen, its ablations (/chunk, /order, /batch) and the baselines (vllm, vllm_chunked,
sarathi, orca) over a sweep of arrival rates (the paper's 8 req/s among them), then the
same policies on the real traces with the accelgen SLO profile. Writes a JSON of every run,
markdown tables and PNGs.

    python benchmarks/accelgen_repro.py --num-requests 300 --rates 0.25 0.5 1 2 8 \\
        --trace-rate 1.0 --trace-requests 300 --out docs/results/data/accelgen \\
        --json docs/results/data/accelgen_results.json
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from scheduler_service.core.slo import SLOClass, SLOSpec
from scheduler_service.costmodel.factory import build_cost_model
from scheduler_service.sim.simulator import PAPER_SETTING, SimConfig, simulate
from scheduler_service.sim.slo_profiles import apply_slo_profile, econoserve_latencies
from scheduler_service.workloads import apply_arrivals, load_trace
from scheduler_service.workloads.base import Workload

MODEL, HARDWARE, KV_GB, BLOCK = "opt-13b", "a100-80g", 12.0, 32
MAX_OUTPUT = 2048
POLICIES = {
    "accelgen": "accelgen",
    "/chunk": "accelgen:chunk=false",
    "/order": "accelgen:order=false",
    "/batch": "accelgen:batch=false",
    "vllm": "vllm",
    "vllm_chunked": "vllm_chunked:budget=512",
    "sarathi": "sarathi",
    "orca": "orca",
}
TRACES = ["azure-conv", "azure-code", "sharegpt", "arxiv", "mooncake"]
KEYS = (
    "throughput_tok_s",
    "throughput_req_s",
    "goodput_req_s",
    "slo_attainment_iter",
    "slo_attainment_req",
    "slo_attainment_jct",
    "compute_util_mean",
    "kv_util_mean",
    "preemptions",
)


def with_offline(wl: Workload, share: float, cm: Any, seed: int) -> Workload:
    """Gives `share` of the requests a JCT SLO (offline) in place of their TTFT/TBT."""
    if share <= 0:
        return wl
    t_p, t_g = econoserve_latencies(wl, cm)
    rng = np.random.default_rng(seed + 17)
    pick = rng.random(len(wl)) < share
    slos = [
        SLOSpec(jct_s=2.0 * (t_p + t_g * r.output_tokens), slo_class=SLOClass.OFFLINE) if off else r.slo
        for r, off in zip(wl.requests, pick, strict=True)
    ]
    return wl.with_slos(slos, f"offline share {share:g}")


def workload(trace: str, n: int, rate: float, offline: float, seed: int) -> Workload:
    cm = build_cost_model("analytic", MODEL, HARDWARE)
    wl = apply_arrivals(load_trace(trace, num_requests=n, seed=seed), "poisson", rate=rate, seed=seed)
    return with_offline(apply_slo_profile("accelgen", wl, cm, seed), offline, cm, seed)


def run_one(job: tuple[str, str, str, int, float, float, int]) -> dict[str, Any]:
    label, spec, trace, n, rate, offline, seed = job
    cm = build_cost_model("analytic", MODEL, HARDWARE)
    kv_tokens = cm.num_kv_blocks(BLOCK, 0.9, KV_GB) * BLOCK
    # NOTE: the context is capped at what the 12 GB KV cache holds, so one request always fits alone.
    config = SimConfig(
        policy=spec,
        kv_gb=KV_GB,
        block_size=BLOCK,
        max_model_len=kv_tokens,
        max_tokens=MAX_OUTPUT,
        length_source="oracle",
        seed=seed,
        **PAPER_SETTING,
    )
    run = simulate(config, workload(trace, n, rate, offline, seed), cm)
    m = run.metrics
    row = {"policy": label, "spec": spec, "trace": trace, "rate": rate, "n": n}
    row.update({k: m[k] for k in KEYS})
    row["jct_mean_s"] = m["jct_s"]["mean"]
    row["ttft_p50_s"] = m["ttft_s"]["p50"]
    row["tbt_p99_s"] = m["tbt_s"]["p99"]
    row["sched_ms_mean"] = m["sched_overhead_ms"]["mean"]
    row["sched_ms_p99"] = m["sched_overhead_ms"]["p99"]
    row["finished"] = m["num_finished"]
    row["mean_forward"] = run.details["mean_forward_size"]
    return row


def fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def table(rows: list[dict], group: str) -> str:
    head = (
        f"| {group} | policy | tok/s | req/s | goodput | iter-SLO | req-SLO | JCT-SLO | JCT s | compute util "
        "| unalloc KV | preempt | sched ms mean/p99 |"
    )
    lines = [head, "|---|---|" + "---:|" * 11]
    for r in rows:
        unalloc = None if r["kv_util_mean"] is None else 1.0 - r["kv_util_mean"]
        lines.append(
            f"| {r[group]} | {r['policy']} | {fmt(r['throughput_tok_s'], 1)} | {fmt(r['throughput_req_s'], 3)} "
            f"| {fmt(r['goodput_req_s'], 3)} | {fmt(r['slo_attainment_iter'])} | {fmt(r['slo_attainment_req'])} "
            f"| {fmt(r['slo_attainment_jct'])} | {fmt(r['jct_mean_s'], 1)} | {fmt(r['compute_util_mean'])} "
            f"| {fmt(unalloc)} | {r['preemptions']} | {fmt(r['sched_ms_mean'], 3)}/{fmt(r['sched_ms_p99'], 3)} |"
        )
    return "\n".join(lines)


def ratios(rows: list[dict], key: str) -> str:
    """accelgen's metric over each baseline's, per rate (the paper's 'x higher')."""
    lines = [f"| rate | {' | '.join(p for p in POLICIES if p != 'accelgen')} |", "|---:|" + "---:|" * 7]
    for rate in sorted({r["rate"] for r in rows}):
        at = {r["policy"]: r[key] for r in rows if r["rate"] == rate}
        cells = [
            fmt(at["accelgen"] / at[p], 2) + "x" if at.get(p) else ("inf" if at.get("accelgen") else "-")
            for p in POLICIES
            if p != "accelgen"
        ]
        lines.append(f"| {rate:g} | {' | '.join(cells)} |")
    return "\n".join(lines)


def plot_rates(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("throughput_tok_s", "throughput (tok/s)"),
        ("goodput_req_s", "goodput (req/s)"),
        ("slo_attainment_iter", "iteration-SLO attainment"),
        ("slo_attainment_jct", "JCT-SLO attainment"),
        ("jct_mean_s", "mean JCT (s)"),
        ("compute_util_mean", "compute util (S_f / S_b)"),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(14, 7))
    for ax, (key, title) in zip(axes.flat, panels, strict=True):
        for label in POLICIES:
            pts = sorted((r["rate"], r[key]) for r in rows if r["policy"] == label and r[key] is not None)
            style = "-" if label in ("accelgen", "/chunk", "/order", "/batch") else "--"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", ms=3, label=label)
        ax.set_xscale("log")
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_title(title, fontsize=10)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("AccelGen reproduction: OPT-13B, A100-80GB, 12 GB KV, accelgen-mix, accelgen SLOs (simulated)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_traces(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [p for p in POLICIES if not p.startswith("/")]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for ax, (key, title) in zip(
        axes,
        [
            ("throughput_tok_s", "throughput (tok/s)"),
            ("goodput_req_s", "goodput (req/s)"),
            ("slo_attainment_iter", "iteration-SLO attainment"),
        ],
        strict=True,
    ):
        width = 0.8 / len(labels)
        for i, label in enumerate(labels):
            vals = [
                next((r[key] or 0.0 for r in rows if r["trace"] == t and r["policy"] == label), 0.0) for t in TRACES
            ]
            ax.bar([x + (i - len(labels) / 2) * width for x in range(len(TRACES))], vals, width, label=label)
        ax.set_xticks(range(len(TRACES)), TRACES, fontsize=8)
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=300)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0, 8.0])
    parser.add_argument("--trace-rate", type=float, default=1.0)
    parser.add_argument("--trace-requests", type=int, default=300)
    parser.add_argument("--offline-share", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--skip-traces", action="store_true")
    parser.add_argument("--out", default="docs/results/data/accelgen", help="prefix of the PNGs")
    parser.add_argument(
        "--json", default="docs/results/data/accelgen_results.json", help="every run, with its markdown beside"
    )
    args = parser.parse_args()
    jobs = [
        (label, spec, "accelgen-mix", args.num_requests, rate, args.offline_share, args.seed)
        for rate in args.rates
        for label, spec in POLICIES.items()
    ]
    if not args.skip_traces:
        jobs += [
            (label, spec, trace, args.trace_requests, args.trace_rate, 0.0, args.seed)
            for trace in TRACES
            for label, spec in POLICIES.items()
            if not label.startswith("/")
        ]
    with ProcessPoolExecutor(args.workers) as pool:
        rows = list(tqdm(pool.map(run_one, jobs), total=len(jobs), desc="simulations"))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=1))
    mix = [r for r in rows if r["trace"] == "accelgen-mix"]
    traces = [r for r in rows if r["trace"] != "accelgen-mix"]
    text = [
        "## accelgen-mix, rate sweep\n",
        table(mix, "rate"),
        "\n\n## accelgen throughput (tok/s) over each system\n",
        ratios(mix, "throughput_tok_s"),
        "\n\n## accelgen goodput over each system\n",
        ratios(mix, "goodput_req_s"),
    ]
    if traces:
        text += [f"\n\n## real traces at {args.trace_rate:g} req/s\n", table(traces, "trace")]
    md = "\n".join(text) + "\n"
    Path(args.json).with_suffix(".md").write_text(md)
    print(md)
    plot_rates(mix, Path(f"{out}_rates.png"))
    if traces:
        plot_traces(traces, Path(f"{out}_traces.png"))


if __name__ == "__main__":
    main()
