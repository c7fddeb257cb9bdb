"""Reproduces ALISE's evaluation (seed 003, section 4) in the simulator, plus FastServe.

Parts (each writes docs/results/data/alise_<part>.json and, where it has one, docs/results/data/alise_<part>.png,
and prints markdown tables):
- latency:  normalized latency vs rate (its Figure 6) for alise (noisy-oracle lengths,
            relative error `--length-error`), oracle-alise (true lengths), vllm, orca;
            OPT-13B / 6.7B / 2.7B on one V100-32GB and OPT-13B on one A100-80GB; the
            econoserve-alpaca and econoserve-sharegpt synthetic workloads (the papers'
            published length statistics), Poisson arrivals. Rates are fractions of vLLM's
            saturated throughput on each setup; each trace lasts as long as
            `--num-requests` take at that throughput (the request count grows with the rate).
- memory:   alise's memory managers swap vs recompute vs defer on Alpaca (its Figure 8),
            and on ShareGPT for OPT-13B on a V100 (`memory_oracle`: the same with true lengths).
- capacity: the largest rate with mean normalized latency <= S (`find_capacity`, rule
            `norm_latency:S`; S = `--slo-factor` x vLLM's idle normalized latency, which is
            about the paper's 200 ms for OPT-13B on a V100), and its ratio to vLLM (the
            paper's 1.8x Alpaca / 2.1x ShareGPT). Each probe's trace has a fixed duration
            (`--capacity-requests` / vLLM's peak rate), as the paper's 30-minute traces do.
- aging:    alise's age threshold vs Defer on ShareGPT (OPT-13B/V100, 2x vLLM's peak).
- oracle:   alise and fastserve with length_source oracle vs noisy_oracle vs max_tokens.
- traces:   alise, fastserve and vllm on the shared real traces (azure-conv, azure-code,
            sharegpt, arxiv, mooncake) with 1, 2 and 4 workers, routers round_robin and
            least_work, Mistral-7B on A100-80GB (32K context: the traces' long prompts fit).

ALISE runs overlap swaps with compute (`overlap_swap`, as its engine does) and swap int8
KV (its `int8` option, on by default); the baselines swap nothing in these settings.

    python benchmarks/alise_repro.py --part all --num-requests 300 --jobs 2
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from tqdm import tqdm

from scheduler_service.costmodel.factory import build_cost_model
from scheduler_service.sim.capacity import find_capacity, parse_rule
from scheduler_service.sim.simulator import PAPER_SETTING, SimConfig, SimRun, simulate
from scheduler_service.workloads import apply_arrivals, load_trace

SETUPS = [("opt-13b", "v100-32g"), ("opt-6.7b", "v100-32g"), ("opt-2.7b", "v100-32g"), ("opt-13b", "a100-80g")]
WORKLOADS = ["econoserve-alpaca", "econoserve-sharegpt"]
RATE_FRACTIONS = [0.5, 1.0, 1.5, 2.0, 2.5, 3.0]
# (label, policy spec, length source)
MAIN = [
    ("vllm", "vllm", "max_tokens"),
    ("orca", "orca", "max_tokens"),
    ("alise", "alise", "noisy_oracle"),
    ("oracle-alise", "alise", "oracle"),
]
MEMORY = [
    ("swap", "alise", "noisy_oracle"),
    ("recompute", "alise:memory=recompute", "noisy_oracle"),
    ("defer", "alise:memory=defer", "noisy_oracle"),
]
# NOTE: orca's capacity is read off the latency curves: its max allocation makes each probe
# run one request at a time on a V100, far too slow to bisect.
CAPACITY_POLICIES = [p for p in MAIN if p[0] != "orca"]
CAPACITY_SETUPS = [("opt-13b", "v100-32g"), ("opt-2.7b", "v100-32g")]
ORACLE_LOAD = 2.0  # the oracle comparison runs at twice vLLM's peak: queues form, order matters
TRACE_LOAD = 2.0  # per worker, x vLLM's burst throughput on one worker
MEMORY_ORACLE = [(label + "-oracle", spec, "oracle") for label, spec, _ in MEMORY]
TRACES = ["azure-conv", "azure-code", "sharegpt", "arxiv", "mooncake"]
TRACE_POLICIES = [
    ("vllm", "vllm", "max_tokens"),
    ("alise", "alise", "noisy_oracle"),
    ("fastserve", "fastserve", "max_tokens"),
]


def run_one(job: dict[str, Any]) -> dict[str, Any]:
    """One simulation; `job` is plain data so that worker processes can take it."""
    cm = build_cost_model("analytic", job["model"], job["hardware"])
    wl = apply_arrivals(
        load_trace(job["workload"], num_requests=job["n"], seed=job["seed"]),
        "poisson",
        rate=job["rate"],
        seed=job["seed"],
        **PAPER_SETTING,
    )
    alise_like = job["spec"].startswith(("alise", "fastserve"))
    cfg = SimConfig(
        policy=job["spec"],
        length_source=job["source"],
        length_error=job["length_error"],
        num_workers=job.get("workers", 1),
        router=job.get("router", "round_robin"),
        overlap_swap=alise_like,
        seed=job["seed"],
        **PAPER_SETTING,
    )
    m = simulate(cfg, wl, cm).metrics
    return {
        **job,
        "norm_latency_s": m["normalized_latency_s"],
        "jct_mean_s": m["jct_s"]["mean"],
        "jct_p99_s": m["jct_s"]["p99"],
        "ttft_p99_s": m["ttft_s"]["p99"],
        "throughput_req_s": m["throughput_req_s"],
        "throughput_tok_s": m["throughput_tok_s"],
        "preemptions": m["preemptions"],
        "num_finished": m["num_finished"],
        "num_requests": m["num_requests"],
        "sched_p99_ms": m["sched_overhead_ms"]["p99"],
    }


def peak_rate(model: str, hardware: str, workload: str, n: int, seed: int, workers: int = 1) -> float:
    """vLLM's saturated throughput (every request at once): the scale of the rate grid."""
    job = _job(model, hardware, workload, "vllm", "vllm", "max_tokens", 1000.0 * workers, n, seed, 0.1)
    job["workers"] = workers
    return run_one(job)["throughput_req_s"]


def _job(
    model: str, hw: str, wl: str, label: str, spec: str, source: str, rate: float, n: int, seed: int, err: float
) -> dict:
    return {
        "model": model,
        "hardware": hw,
        "workload": wl,
        "label": label,
        "spec": spec,
        "source": source,
        "rate": rate,
        "n": n,
        "seed": seed,
        "length_error": err,
    }


def run_all(jobs: list[dict], workers: int, desc: str) -> list[dict]:
    if workers <= 1:
        return [run_one(j) for j in tqdm(jobs, desc=desc)]
    with ProcessPoolExecutor(workers) as pool:
        return list(tqdm(pool.map(run_one, jobs), total=len(jobs), desc=desc))


# ---------------------------------------------------------------------- parts
def part_curves(args: argparse.Namespace, policies: list, setups: list, workloads: list, name: str) -> list[dict]:
    jobs = []
    for model, hw in setups:
        for wl in workloads:
            peak = peak_rate(model, hw, wl, args.num_requests, args.seed)
            for frac in RATE_FRACTIONS:
                rate = round(frac * peak, 3)
                n = max(200, int(frac * args.num_requests))  # NOTE: a fixed duration, as the paper's traces
                for label, spec, source in policies:
                    job = _job(model, hw, wl, label, spec, source, rate, n, args.seed, args.length_error)
                    job["peak"] = peak
                    jobs.append(job)
    rows = run_all(jobs, args.jobs, name)
    _save(args, name, rows)
    _plot_curves(rows, [p[0] for p in policies], Path(args.out) / f"alise_{name}.png", setups, workloads)
    print(_curve_table(rows, [p[0] for p in policies]))
    return rows


def part_capacity(
    args: argparse.Namespace,
    policies: list | None = None,
    factor: float | None = None,
    workloads: list[str] | None = None,
    name: str = "capacity",
) -> list[dict]:
    rows = []
    factor = args.slo_factor if factor is None else factor
    for model, hw in CAPACITY_SETUPS:
        for wl in workloads or WORKLOADS:
            peak = peak_rate(model, hw, wl, args.num_requests, args.seed)
            idle = _job(model, hw, wl, "vllm", "vllm", "max_tokens", 0.05 * peak, 100, args.seed, args.length_error)
            slo = factor * run_one(idle)["norm_latency_s"]
            rule = parse_rule(f"norm_latency:{slo}")
            for label, spec, source in policies or CAPACITY_POLICIES:
                # NOTE: the trace lasts as long as `capacity_requests` take at vLLM's peak.
                run_at = _rate_runner(model, hw, wl, spec, source, args, args.capacity_requests / peak, label)
                res = find_capacity(run_at, rule, None, start_rate=0.5 * peak, rel_tol=0.05, max_probes=12)
                row = {"model": model, "hardware": hw, "workload": wl, "label": label, "slo_s": slo}
                row.update(capacity=res.capacity_req_s, probes=res.probes)
                tqdm.write(json.dumps(row))
                rows.append(row)
    _save(args, name, rows)
    if name == "capacity":
        print(_capacity_table(rows))
    return rows


def kv_gb_for(label: str, model: str, hw: str) -> float | None:
    """`*-int8kv`: the KV pool holds twice the tokens, as when all resident KV is int8 (the
    paper's setting: "INT8 for the KV cache" in every experiment)."""
    if not label.endswith("int8kv"):
        return None
    cm = build_cost_model("analytic", model, hw)
    return 2 * cm.num_kv_blocks(16) * 16 * cm.model.kv_bytes_per_token_per_gpu / 2**30


def _rate_runner(
    model: str, hw: str, wl: str, spec: str, source: str, args: argparse.Namespace, duration_s: float, label: str = ""
) -> Callable[[float], SimRun]:
    """Runs at a rate over a trace of fixed duration (the paper's 30-minute traces): the
    request count grows with the rate, so overload shows as growing latency, not a bounded
    drain of a fixed batch (which SRTF would always pass)."""
    cm = build_cost_model("analytic", model, hw)
    alise_like = spec.startswith(("alise", "fastserve"))

    def run_at(rate: float) -> SimRun:
        n = int(min(args.capacity_requests * 4, max(200, rate * duration_s)))
        base = load_trace(wl, num_requests=n, seed=args.seed)
        cfg = SimConfig(
            policy=spec,
            length_source=source,
            length_error=args.length_error,
            overlap_swap=alise_like,
            kv_gb=kv_gb_for(label, model, hw),
            seed=args.seed,
            **PAPER_SETTING,
        )
        run = simulate(cfg, apply_arrivals(base, "poisson", rate=rate, seed=args.seed), cm)
        run.config["rate"] = rate
        return run

    return run_at


def part_oracle(args: argparse.Namespace) -> list[dict]:
    jobs = []
    model, hw = "opt-13b", "v100-32g"
    for wl in WORKLOADS:
        peak = peak_rate(model, hw, wl, args.num_requests, args.seed)
        for spec in ("alise", "fastserve"):
            for source in ("oracle", "noisy_oracle", "max_tokens"):
                rate = round(ORACLE_LOAD * peak, 3)
                jobs.append(
                    _job(model, hw, wl, spec, spec, source, rate, args.num_requests, args.seed, args.length_error)
                )
    rows = run_all(jobs, args.jobs, "oracle")
    _save(args, "oracle", rows)
    lines = ["| workload | policy | oracle | noisy_oracle | max_tokens |", "|---|---|---:|---:|---:|"]
    for wl in WORKLOADS:
        for spec in ("alise", "fastserve"):
            cells = [
                next(r for r in rows if (r["workload"], r["spec"], r["source"]) == (wl, spec, s))
                for s in ("oracle", "noisy_oracle", "max_tokens")
            ]
            lines.append(f"| {wl} | {spec} | " + " | ".join(f"{c['norm_latency_s']:.3f}" for c in cells) + " |")
    print("\n".join(lines))
    return rows


def part_aging(args: argparse.Namespace) -> list[dict]:
    """ALISE's age threshold vs Defer on ShareGPT, OPT-13B/V100 at 2x vLLM's peak (docs/results/alise_fastserve.md,
    "Memory managers"): where aging, not swapping, decides the memory managers' order."""
    model, hw, wl = "opt-13b", "v100-32g", "econoserve-sharegpt"
    rate = 1.03  # 2 x vLLM's 400-request burst throughput here (0.517 req/s), as in the latency part
    specs = ["alise", "alise:age_threshold_s=60", "alise:age_threshold_s=200", "alise:age_threshold_s=1e9"]
    specs.append("alise:memory=defer")
    jobs = [
        _job(model, hw, wl, spec, spec, src, rate, 800, args.seed, args.length_error)
        for src in ("oracle", "noisy_oracle")
        for spec in specs
    ]
    rows = run_all(jobs, args.jobs, "aging")
    _save(args, "aging", rows)
    print("| lengths | policy | norm. latency (s/token) | p99 JCT (s) | preemptions |\n|---|---|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['source']} | {r['spec']} | {r['norm_latency_s']:.3f} | {r['jct_p99_s']:.0f} | {r['preemptions']} |"
        )
    return rows


def part_traces(args: argparse.Namespace) -> list[dict]:
    model, hw = "mistral-7b", "a100-80g"
    jobs = []
    for trace in TRACES:
        peak = peak_rate(model, hw, trace, args.num_requests, args.seed)
        for workers in (1, 2, 4):
            for router in ("round_robin", "least_work"):
                if workers == 1 and router == "least_work":
                    continue
                for label, spec, source in TRACE_POLICIES:
                    job = _job(
                        model,
                        hw,
                        trace,
                        label,
                        spec,
                        source,
                        round(TRACE_LOAD * peak * workers, 3),
                        args.num_requests,
                        args.seed,
                        args.length_error,
                    )
                    job.update(workers=workers, router=router, peak=peak)
                    jobs.append(job)
    rows = run_all(jobs, args.jobs, "traces")
    _save(args, "traces", rows)
    lines = [
        "| trace | workers | router | rate | norm. latency vllm / alise / fastserve (s/token) "
        "| p99 JCT vllm / alise / fastserve (s) | finished (v/a/f) |",
        "|---|---:|---|---:|---|---|---|",
    ]
    for trace in TRACES:
        for workers, router in (
            (1, "round_robin"),
            (2, "round_robin"),
            (2, "least_work"),
            (4, "round_robin"),
            (4, "least_work"),
        ):
            cell = {
                r["label"]: r for r in rows if (r["workload"], r["workers"], r["router"]) == (trace, workers, router)
            }
            v, a, f = cell["vllm"], cell["alise"], cell["fastserve"]
            lines.append(
                f"| {trace} | {workers} | {router} | {v['rate']:.2f} | {v['norm_latency_s']:.3f} / "
                f"{a['norm_latency_s']:.3f} / {f['norm_latency_s']:.3f} | "
                f"{v['jct_p99_s']:.1f} / {a['jct_p99_s']:.1f} / {f['jct_p99_s']:.1f} | "
                f"{v['num_finished']}/{a['num_finished']}/{f['num_finished']} of {v['num_requests']} |"
            )
    print("\n".join(lines))
    return rows


# ---------------------------------------------------------------------- output
def _save(args: argparse.Namespace, name: str, rows: list[dict]) -> None:
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"alise_{name}.json").write_text(json.dumps(rows, indent=1, default=str))


def _curve_table(rows: list[dict], labels: list[str]) -> str:
    lines = ["| model | GPU | workload | rate (x vLLM peak) | rate req/s | " + " | ".join(labels) + " |"]
    lines.append("|---|---|---|---:|---:|" + "---:|" * len(labels))
    keys = sorted(
        {(r["model"], r["hardware"], r["workload"], r["rate"]) for r in rows}, key=lambda k: (k[0], k[1], k[2], k[3])
    )
    for model, hw, wl, rate in keys:
        cell = {
            r["label"]: r
            for r in rows
            if (r["model"], r["hardware"], r["workload"], r["rate"]) == (model, hw, wl, rate)
        }
        frac = rate / next(iter(cell.values()))["peak"]
        vals = " | ".join(f"{cell[lab]['norm_latency_s']:.3f}" for lab in labels)
        lines.append(f"| {model} | {hw} | {wl.split('-')[1]} | {frac:.2f} | {rate:.2f} | {vals} |")
    return "\n".join(lines)


def _capacity_table(rows: list[dict]) -> str:
    lines = [
        "| model | GPU | workload | norm. latency bound (s/token) | vllm | alise | oracle-alise | alise / vllm "
        "| oracle-alise / vllm |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for model, hw, wl in sorted({(r["model"], r["hardware"], r["workload"]) for r in rows}):
        sel = [r for r in rows if (r["model"], r["hardware"], r["workload"]) == (model, hw, wl)]
        cap = {r["label"]: r["capacity"] for r in sel}
        v = cap["vllm"] or float("nan")
        lines.append(
            f"| {model} | {hw} | {wl.split('-')[1]} | {sel[0]['slo_s']:.3f} | {cap['vllm']:.2f} | {cap['alise']:.2f} | "
            f"{cap['oracle-alise']:.2f} | {cap['alise'] / v:.2f}x | {cap['oracle-alise'] / v:.2f}x |"
        )
    return "\n".join(lines)


def _plot_curves(rows: list[dict], labels: list[str], path: Path, setups: list, workloads: list) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(workloads), len(setups), figsize=(3.6 * len(setups), 3.0 * len(workloads)), squeeze=False
    )
    for i, wl in enumerate(workloads):
        for j, (model, hw) in enumerate(setups):
            ax = axes[i][j]
            for lab in labels:
                pts = sorted(
                    (r["rate"], r["norm_latency_s"])
                    for r in rows
                    if (r["model"], r["hardware"], r["workload"], r["label"]) == (model, hw, wl, lab)
                )
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", ms=3, label=lab)
            ax.set_yscale("log")
            ax.set_title(f"{model} {hw}\n{wl}", fontsize=8)
            ax.set_xlabel("rate (req/s)", fontsize=8)
            ax.set_ylabel("normalized latency (s/token)", fontsize=8)
            ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parts = ["latency", "memory", "memory_oracle", "aging", "capacity", "capacity_extra", "oracle", "traces", "all"]
    parser.add_argument("--part", choices=parts, default="all")
    parser.add_argument("--num-requests", type=int, default=300)
    parser.add_argument("--length-error", type=float, default=0.1, help="relative std of alise's noisy-oracle lengths")
    parser.add_argument(
        "--slo-factor", type=float, default=4.0, help="capacity bound: this x vLLM's normalized latency when idle"
    )
    parser.add_argument(
        "--capacity-requests", type=int, default=800, help="requests of a capacity probe at vLLM's peak rate"
    )
    parser.add_argument("--jobs", type=int, default=2, help="simulations in parallel")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="docs/results/data")
    args = parser.parse_args()
    everything = ["latency", "memory", "memory_oracle", "aging", "oracle", "capacity", "capacity_extra", "traces"]
    parts = everything if args.part == "all" else [args.part]
    for part in parts:
        if part == "latency":
            part_curves(args, MAIN, SETUPS, WORKLOADS, "latency")
        elif part == "memory":
            part_curves(args, MEMORY, SETUPS[:3], WORKLOADS[:1], "memory")
            part_curves(args, MEMORY, SETUPS[:1], WORKLOADS[1:], "memory_sharegpt")
        elif part == "memory_oracle":
            part_curves(args, MEMORY_ORACLE, SETUPS[:1], WORKLOADS[1:], "memory_sharegpt_oracle")
        elif part == "aging":
            part_aging(args)
        elif part == "capacity":
            part_capacity(args)
        elif part == "capacity_extra":
            part_capacity(args, [("alise-int8kv", "alise", "noisy_oracle")], name="capacity_int8kv")
            part_capacity(args, CAPACITY_POLICIES, 10.0, WORKLOADS[1:], "capacity_loose")
        elif part == "oracle":
            part_oracle(args)
        else:
            part_traces(args)


if __name__ == "__main__":
    main()
