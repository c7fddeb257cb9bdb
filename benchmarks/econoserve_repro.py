"""Reproduces EconoServe's evaluation (seed 001, section 4, Figures 9, 11 and 13) in the
simulator: normalized latency vs request rate, the sustainable rate at equal normalized
latency against vllm, sarathi and orca, the D / SD / SDO / full ablation, the Oracle line,
KV and GPU utilization and KV allocation failures.

Setting (paper section 2.1 and 4): OPT-13B on one A100-80G with 12 GB of KV, block 32, Poisson
arrivals, the econoserve-{alpaca,sharegpt,bookcorpus} synthetic workloads (Table 2
statistics), JCT SLOs from the `econoserve` profile; padding 10% / 15% / 20% and KVCPipe
buffer 15% / 15% / 10% per trace (section 4); lengths from `noisy_oracle` (the paper's
predictor is right about 75% of the time), the Oracle line uses `oracle`.
Sustainable rate: the largest rate whose mean normalized latency stays within
`--latency-scale` x the unloaded per-token latency (t_p / mean output + t_g, the terms of the
paper's JCT SLO), found by `find_capacity` with the `norm_latency:S` rule.

`--part real` runs econoserve, vllm, sarathi and orca on the shared real traces (azure-conv,
azure-code, sharegpt, arxiv, mooncake; Mistral-7B, whose 32k context admits their prompts)
with the accelgen SLO profile: capacity at 50% request-level SLO attainment (`--real-rule`).

    python benchmarks/econoserve_repro.py --part synthetic
    python benchmarks/econoserve_repro.py --part real --num-requests 300
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from scheduler_service.costmodel.base import CostModel
from scheduler_service.costmodel.factory import build_cost_model
from scheduler_service.costmodel.pivot import pivot_forward_size
from scheduler_service.sim.capacity import find_capacity, parse_rule
from scheduler_service.sim.simulator import PAPER_SETTING, SimConfig, SimRun, Simulation
from scheduler_service.sim.slo_profiles import apply_slo_profile, econoserve_latencies
from scheduler_service.workloads import apply_arrivals, load_trace
from scheduler_service.workloads.base import Workload


@dataclass(frozen=True)
class TraceSetting:
    padding: float
    buffer: float
    max_model_len: int | None  # BookCorpus: 2048-token prompts plus their answers
    num_requests: int
    start_rate: float


SYNTHETIC = {
    # NOTE: Alpaca's requests are tiny: a finite trace drains within the latency bound unless it
    # is long, so it gets 3,000 requests (the paper runs 36 req/s for hours).
    "econoserve-alpaca": TraceSetting(0.10, 0.15, None, 3000, 16.0),
    "econoserve-sharegpt": TraceSetting(0.15, 0.15, None, 400, 1.0),
    "econoserve-bookcorpus": TraceSetting(0.20, 0.10, 4096, 300, 0.25),
}
MAIN = ["EconoServe", "vLLM", "Sarathi-Serve", "Orca"]
ABLATION = ["EconoServe-D", "EconoServe-SD", "EconoServe-SDO", "EconoServe", "Oracle"]
REAL = ["azure-conv", "azure-code", "sharegpt", "arxiv", "mooncake"]
REAL_POLICIES = ["EconoServe", "vLLM", "Sarathi-Serve", "Orca"]


def line_spec(label: str, s: TraceSetting, tfs: int) -> tuple[str, str]:
    """(policy spec, length source) of one line of the figures."""
    econo = f"padding={s.padding},buffer={s.buffer}"
    return {
        "EconoServe": (f"econoserve:{econo}", "noisy_oracle"),
        "Oracle": (f"econoserve:{econo}", "oracle"),
        "EconoServe-D": (f"econoserve:variant=D,{econo}", "noisy_oracle"),
        "EconoServe-SD": (f"econoserve:variant=SD,{econo}", "noisy_oracle"),
        "EconoServe-SDO": (f"econoserve:variant=SDO,{econo}", "noisy_oracle"),
        # The paper's vLLM swaps on KV allocation failures (section 2.1).
        "vLLM": ("vllm:preemption_mode=swap", "max_tokens"),
        # Same GPU target as EconoServe's TFS, so the comparison is about KV and ordering.
        "Sarathi-Serve": (f"sarathi:budget={tfs}", "max_tokens"),
        "Orca": ("orca:max_batch_size=8", "max_tokens"),
    }[label]


class Bench:
    def __init__(self, cm: CostModel, trace: str, s: TraceSetting, slo: str, kv_gb: float | None, seed: int) -> None:
        self.cm, self.trace, self.s, self.slo, self.kv_gb, self.seed = cm, trace, s, slo, kv_gb, seed
        self.base = load_trace(trace, num_requests=s.num_requests, seed=seed)
        self.tfs = pivot_forward_size(cm)[0]

    def workload(self, rate: float) -> Workload:
        return apply_slo_profile(self.slo, apply_arrivals(self.base, "poisson", rate=rate, seed=self.seed), self.cm, 0)

    def run(self, label: str, rate: float) -> SimRun:
        spec, source = line_spec(label, self.s, self.tfs)
        cfg = SimConfig(
            policy=spec,
            kv_gb=self.kv_gb,
            block_size=32,
            length_source=source,
            max_model_len=self.s.max_model_len,
            seed=self.seed,
            **PAPER_SETTING,
        )
        sim = Simulation(cfg, self.workload(rate), self.cm)
        run = sim.run()
        run.config["rate"] = rate
        policy = sim.cluster.schedulers[0].policy
        if hasattr(policy, "stats_report"):
            run.details["policy"] = policy.stats_report()
        return run


def summarize(run: SimRun, tfs: int) -> dict[str, Any]:
    m, d = run.metrics, run.details
    return {
        "rate": run.config["rate"],
        "norm_latency_s": m["normalized_latency_s"],
        "jct_p50_s": m["jct_s"]["p50"],
        "slo_attainment_req": m["slo_attainment_req"],
        "throughput_tok_s": m["throughput_tok_s"],
        "kv_util": m["kv_util_mean"],
        "gpu_util": (d["mean_forward_size"] or 0.0) / tfs,  # forward size / TFS
        "kv_alloc_failures": m["kv_alloc_failures"],
        "preemptions": m["preemptions"],
        "finished": m["num_finished"],
        "requests": m["num_requests"],
        "policy_stats": d.get("policy", {}),
    }


def synthetic(args: argparse.Namespace) -> dict[str, Any]:
    cm = build_cost_model("analytic", "opt-13b", "a100-80g")
    out: dict[str, Any] = {}
    labels = list(dict.fromkeys(MAIN + ABLATION))
    for trace, s in SYNTHETIC.items():
        if args.traces and trace not in args.traces:
            continue
        bench = Bench(cm, trace, s, "econoserve", 12.0, args.seed)
        t_p, t_g = econoserve_latencies(bench.base, cm)
        limit = args.latency_scale * (t_p / float(bench.base.output_lengths().mean()) + t_g)
        rule = parse_rule(f"norm_latency:{limit}")
        caps: dict[str, Any] = {}
        for label in tqdm(labels, desc=f"capacity {trace}", leave=False):
            res = find_capacity(lambda r, lb=label, b=bench: b.run(lb, r), rule, None, s.start_rate, rel_tol=0.04)
            at = summarize(res.run_at_capacity, bench.tfs) if res.run_at_capacity else None
            caps[label] = {"capacity": res.capacity_req_s, "probes": res.probes, "at_capacity": at}
        top = max(c["capacity"] for c in caps.values())
        rates = [round(top * f, 4) for f in (0.2, 0.4, 0.6, 0.8, 1.0, 1.2)]
        curves = {
            label: [summarize(bench.run(label, r), bench.tfs) for r in rates]
            for label in tqdm(labels, desc=f"curves {trace}", leave=False)
        }
        ref = caps["vLLM"]["capacity"]
        common = [summarize(bench.run(lb, ref), bench.tfs) for lb in labels] if ref > 0 else []
        out[trace] = {
            "norm_latency_limit_s": limit,
            "tfs": bench.tfs,
            "capacity": caps,
            "rates": rates,
            "curves": curves,
            "at_vllm_capacity": dict(zip(labels, common, strict=False)),
        }
    return out


def real(args: argparse.Namespace) -> dict[str, Any]:
    cm = build_cost_model("analytic", "mistral-7b", "a100-80g")
    rule = parse_rule(args.real_rule)
    out: dict[str, Any] = {}
    for trace in REAL:
        s = TraceSetting(0.15, 0.15, None, args.num_requests, 0.5)
        bench = Bench(cm, trace, s, "accelgen", None, args.seed)
        caps = {}
        for label in tqdm(REAL_POLICIES, desc=f"capacity {trace}", leave=False):
            res = find_capacity(lambda r, lb=label, b=bench: b.run(lb, r), rule, None, s.start_rate, rel_tol=0.1)
            at = summarize(res.run_at_capacity, bench.tfs) if res.run_at_capacity else None
            caps[label] = {"capacity": res.capacity_req_s, "at_capacity": at}
        out[trace] = {"tfs": bench.tfs, "capacity": caps}
    return out


def synthetic_tables(res: dict[str, Any]) -> str:
    paper = {
        "econoserve-sharegpt": "2.5-4x vLLM, 1.25-2.25x Sarathi, 22-64x Orca",
        "econoserve-bookcorpus": "2.5-2.8x vLLM, 1.88-2.33x Sarathi, 12.5-13x Orca",
        "econoserve-alpaca": "1.13-2.14x vLLM, 1.2-1.24x Sarathi, 5.6-9x Orca",
    }
    lines = [
        "| trace | S (s/token) | EconoServe | Oracle | vLLM | Sarathi | Orca | Econo/vLLM | Econo/Sarathi"
        " | Econo/Orca | paper (all models) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for trace, r in res.items():
        c = {k: v["capacity"] for k, v in r["capacity"].items()}
        ratio = lambda a, b, c=c: f"{c[a] / c[b]:.2f}x" if c[b] else "inf"  # noqa: E731
        lines.append(
            f"| {trace} | {r['norm_latency_limit_s']:.3f} | {c['EconoServe']:.2f} | {c['Oracle']:.2f} | "
            f"{c['vLLM']:.2f} | {c['Sarathi-Serve']:.2f} | {c['Orca']:.2f} | {ratio('EconoServe', 'vLLM')} | "
            f"{ratio('EconoServe', 'Sarathi-Serve')} | {ratio('EconoServe', 'Orca')} | {paper[trace]} |"
        )
    lines += ["", "| trace | D | SD | SDO | full | Oracle |", "|---|---:|---:|---:|---:|---:|"]
    for trace, r in res.items():
        c = {k: v["capacity"] for k, v in r["capacity"].items()}
        lines.append(f"| {trace} | " + " | ".join(f"{c[k]:.2f}" for k in ABLATION) + " |")
    lines += [
        "",
        "At vLLM's sustainable rate (same load for every line):",
        "",
        "| trace | line | norm. latency (s/tok) | KV util | GPU util (fwd/TFS) | KV alloc failures | preemptions |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for trace, r in res.items():
        for label, row in r["at_vllm_capacity"].items():
            lines.append(
                f"| {trace} | {label} | {row['norm_latency_s']:.4f} | {row['kv_util']:.2f} | {row['gpu_util']:.3f} | "
                f"{row['kv_alloc_failures']} | {row['preemptions']} |"
            )
    return "\n".join(lines)


def real_table(res: dict[str, Any]) -> str:
    lines = [
        "| trace | EconoServe | vLLM | Sarathi | Orca | Econo/vLLM | Econo/Sarathi |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for trace, r in res.items():
        c = {k: v["capacity"] for k, v in r["capacity"].items()}
        ratio = lambda a, b, c=c: f"{c[a] / c[b]:.2f}x" if c[b] else "inf"  # noqa: E731
        lines.append(
            f"| {trace} | {c['EconoServe']:.2f} | {c['vLLM']:.2f} | {c['Sarathi-Serve']:.2f} | {c['Orca']:.2f} | "
            f"{ratio('EconoServe', 'vLLM')} | {ratio('EconoServe', 'Sarathi-Serve')} |"
        )
    return "\n".join(lines)


def plot_synthetic(res: dict[str, Any], prefix: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name, labels in (("curves", [*MAIN, "Oracle"]), ("ablation", ABLATION)):
        fig, axes = plt.subplots(1, len(res), figsize=(4.2 * len(res), 3.4))
        for ax, (trace, r) in zip(np.atleast_1d(axes), res.items(), strict=True):
            for label in labels:
                ys = [row["norm_latency_s"] for row in r["curves"][label]]
                ax.plot(r["rates"], ys, marker="o", ms=3, label=label)
            ax.axhline(r["norm_latency_limit_s"], color="gray", ls=":", lw=1)
            ax.set_yscale("log")
            ax.set_title(trace.replace("econoserve-", ""))
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel("normalized latency (s/token)")
        np.atleast_1d(axes)[0].legend(fontsize=7)
        fig.suptitle(f"EconoServe reproduction ({name}): OPT-13B, A100-80G, 12 GB KV (simulated)", fontsize=9)
        fig.tight_layout()
        fig.savefig(f"{prefix}_{name}.png", dpi=110)
        plt.close(fig)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    labels = [*MAIN, *ABLATION[:3], "Oracle"]
    for ax, key, title in zip(
        axes,
        ("kv_util", "gpu_util", "kv_alloc_failures"),
        ("KV utilization", "GPU utilization", "KV alloc failures"),
        strict=True,
    ):
        width = 0.8 / len(labels)
        for i, label in enumerate(labels):
            vals = [r["at_vllm_capacity"].get(label, {}).get(key, 0) for r in res.values()]
            ax.bar([x + i * width for x in range(len(res))], vals, width, label=label)
        ax.set_xticks([x + 0.4 for x in range(len(res))], [t.replace("econoserve-", "") for t in res])
        ax.set_title(f"{title} at vLLM's sustainable rate", fontsize=9)
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(f"{prefix}_utilization.png", dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["synthetic", "real"], default="synthetic")
    parser.add_argument("--num-requests", type=int, default=300, help="per real trace")
    parser.add_argument("--latency-scale", type=float, default=5.0)
    # NOTE: accelgen TTFT SLOs are the length group's mean prefill time x U[0.5, 1.5], so a share of the
    # requests miss them even when alone: 90% attainment is out of reach at any rate.
    parser.add_argument("--real-rule", default="attainment:0.5", help="capacity rule for --part real")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="docs/results/data/econoserve", help="prefix of the PNGs")
    parser.add_argument("--data", default="econoserve-data/econoserve", help="prefix of the JSON and markdown tables")
    parser.add_argument("--traces", nargs="*", help="synthetic traces to (re)run; the others are kept from --data")
    args = parser.parse_args()
    Path(args.data).parent.mkdir(parents=True, exist_ok=True)
    if args.part == "synthetic":
        saved = Path(f"{args.data}_synthetic.json")
        res = json.loads(saved.read_text()) if args.traces and saved.exists() else {}
        res.update(synthetic(args))
        res = {t: res[t] for t in SYNTHETIC if t in res}
        table = synthetic_tables(res)
        plot_synthetic(res, args.out)
    else:
        res = real(args)
        table = real_table(res)
    Path(f"{args.data}_{args.part}.json").write_text(json.dumps(res, indent=1, default=float))
    Path(f"{args.data}_{args.part}.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
