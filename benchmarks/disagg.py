"""Disaggregated prefill and decode vs colocated serving, in the simulator (the "Disaggregated
prefill and decode" page, docs/results/disaggregation.md, comes from this script).

    python benchmarks/disagg.py --out docs/results/data/disagg            (JSON + Markdown table + PNG)

For each trace, at the same total GPU count G (default 4):

    colocated    vllm, sarathi, econoserve on G workers (least_work router)
    disagg       every split P prefill + D decode workers, P + D = G (vllm on both pools,
                 DistServe's FCFS continuous batching; KV moved over NVLink)
    goodput      DistServe's: the largest Poisson rate at which >= 90% of requests meet both
                 their TTFT and their TBT SLO (TBT judged on the request's mean gap, DistServe's
                 TPOT rule), per GPU
    transfer     the best split's KV transfer cost at its goodput: seconds p50/p99, GB moved,
                 and its attainment there with the KV over InfiniBand and Ethernet instead
    why          at the best split's goodput rate: each configuration's TTFT-only and TBT-only
                 attainment (which SLO a colocated deployment misses)
    sizing       the cheapest P/D split meeting the target at colocated vllm's goodput rate;
                 and EconoServe's comparison (up to 78% fewer GPUs than DistServe at the same
                 goodput): at the best split's goodput rate, the cheapest split against the
                 fewest colocated econoserve (and vllm) workers meeting the same target

Traces: prompt-heavy `arxiv` (summarization, prompt mean 2.5k tokens, output 280) and the
`azure-conv` conversation trace on llama-2-7b / A100-80GB (4k context), and the long-context
`mooncake` trace (prompt mean 13k, up to 128k) on llama-3.1-8b / H100 with max_tokens capped
at 2,048 as in benchmarks/long_context.py. SLOs per request (DistServe states its SLOs in
seconds for its models; ours are the same multiples of this model's uncontended latencies):
TTFT = --ttft-scale x the request's own prefill time, TBT = --tbt-scale x one batch-1 decode
step at the trace's median context. Analytic cost model; every run is deterministic (seeded).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from scheduler_service.core.slo import SLOClass, SLOSpec
from scheduler_service.costmodel.base import CostModel
from scheduler_service.costmodel.factory import build_cost_model
from scheduler_service.sim.disagg_search import DISTSERVE_ATTAINMENT, cheapest_split, fewest_workers, goodput
from scheduler_service.sim.simulator import PAPER_SETTING, SimConfig, SimRun, simulate
from scheduler_service.workloads import Workload, apply_arrivals, load_trace
from sluice_bench.options import Parallelism, add_parallel_options, benchmark_parser
from sluice_bench.report import format_table, write_json
from sluice_bench.sweep import run_tasks


@dataclass(frozen=True)
class TraceSetup:
    trace: str
    model: str
    hardware: str
    max_tokens: int | None
    start_rate: float


TRACES = {
    "arxiv": TraceSetup("arxiv", "llama-2-7b", "a100-80g", None, 2.0),
    "azure-conv": TraceSetup("azure-conv", "llama-2-7b", "a100-80g", None, 4.0),
    "mooncake": TraceSetup("mooncake", "llama-3.1-8b", "h100-80g", 2048, 0.5),
}
COLOCATED = ("vllm", "sarathi", "econoserve")


@cache
def cost_model(model: str, hardware: str) -> CostModel:
    return build_cost_model("analytic", model, hardware)


@cache
def base_workload(name: str, n: int, ttft_scale: float, tbt_scale: float, which: str = "both") -> Workload:
    setup = TRACES[name]
    cm = cost_model(setup.model, setup.hardware)
    wl = load_trace(setup.trace, num_requests=n, seed=0)
    context = int(np.median(wl.prompt_lengths()) + np.median(wl.output_lengths()) / 2)
    tbt = tbt_scale * cm.decode_time(1, context)
    prefill = cache(cm.prefill_time)
    slos = [
        SLOSpec(
            ttft_s=ttft_scale * prefill(max(1, r.prompt_tokens)) if which in ("both", "ttft") else None,
            tbt_s=tbt if which in ("both", "tbt") else None,
            slo_class=SLOClass.ONLINE,
        )
        for r in wl.requests
    ]
    return wl.with_slos(slos, f"disagg(ttft={ttft_scale:g}x prefill, tbt={tbt_scale:g}x decode = {tbt:.4f}s)")


def config_for(name: str, kind: str, prefill: int, decode: int, gpus: int, network: str = "nvlink") -> SimConfig:
    setup = TRACES[name]
    base = SimConfig(
        max_tokens=setup.max_tokens, length_source="oracle", router="least_work", network=network, **PAPER_SETTING
    )
    if kind == "disagg":
        return replace(base, policy="vllm", prefill_workers=prefill, decode_workers=decode)
    return replace(base, policy=kind, num_workers=gpus)


def simulate_at(args: argparse.Namespace, name: str, config: SimConfig, rate: float, which: str = "both") -> SimRun:
    setup = TRACES[name]
    wl = base_workload(name, args.num_requests, args.ttft_scale, args.tbt_scale, which)
    run = simulate(
        config, apply_arrivals(wl, "poisson", rate=rate, seed=args.seed), cost_model(setup.model, setup.hardware)
    )
    run.config["rate"] = rate
    return run


def summary(run: SimRun | None) -> dict[str, Any]:
    if run is None:
        return {}
    m = run.metrics
    out = {
        "attainment": m["slo_attainment_req"],
        "ttft_p50_s": m["ttft_s"]["p50"],
        "ttft_p99_s": m["ttft_s"]["p99"],
        "tbt_p99_s": m["tbt_s"]["p99"],
        "throughput_req_s": m["throughput_req_s"],
    }
    if "disagg" in run.details:
        out["transfer"] = run.details["disagg"]
    return out


def capacity_job(job: tuple[argparse.Namespace, str, str, int, int]) -> dict[str, Any]:
    args, name, kind, prefill, decode = job
    config = config_for(name, kind, prefill, decode, args.gpus)
    label = f"{prefill}P+{decode}D" if kind == "disagg" else kind
    result = goodput(
        lambda rate: simulate_at(args, name, config, rate),
        args.gpus,
        start_rate=TRACES[name].start_rate,
        rel_tol=args.tolerance,
        max_probes=args.max_probes,
    )
    return {
        "trace": name,
        "config": label,
        "kind": kind,
        "prefill": prefill,
        "decode": decode,
        "goodput_req_s": result.rate_req_s,
        "goodput_per_gpu": result.per_gpu,
        "probes": result.capacity.probes,
        "at_goodput": summary(result.capacity.run_at_capacity),
    }


def diagnosis_job(job: tuple[argparse.Namespace, str, str, int, int, float, str, str]) -> dict[str, Any]:
    args, name, kind, prefill, decode, rate, which, network = job
    run = simulate_at(args, name, config_for(name, kind, prefill, decode, args.gpus, network), rate, which)
    return {
        "trace": name,
        "kind": kind,
        "prefill": prefill,
        "decode": decode,
        "rate": rate,
        "which": which,
        "network": network,
        **summary(run),
    }


def sizing_job(job: tuple[argparse.Namespace, str, float, float]) -> dict[str, Any]:
    """GPUs each deployment needs for one rate: the cheapest P/D split at colocated vllm's
    goodput rate, and EconoServe's comparison (its paper: up to 78% fewer GPUs than DistServe at
    the same goodput): at the best split's goodput rate, the cheapest split against the fewest
    colocated econoserve (and vllm) workers."""
    args, name, vllm_rate, disagg_rate = job
    limit = 2 * args.gpus

    def split_at(rate: float):
        return lambda p, d: simulate_at(args, name, config_for(name, "disagg", p, d, args.gpus), rate)

    def colocated_at(policy: str, rate: float):
        return lambda n: simulate_at(args, name, config_for(name, policy, 0, 0, n), rate)

    def split(search) -> dict[str, Any] | None:
        b = search.best
        return None if b is None else {"prefill": b.prefill, "decode": b.decode, "attainment": b.attainment}

    out: dict[str, Any] = {"trace": name, "vllm_rate": vllm_rate, "disagg_rate": disagg_rate}
    if vllm_rate > 0:
        out["split_at_vllm_rate"] = split(cheapest_split(split_at(vllm_rate), max_workers=args.gpus + 1))
    if disagg_rate > 0:
        out["split_at_disagg_rate"] = split(cheapest_split(split_at(disagg_rate), max_workers=args.gpus))
        for policy in ("econoserve", "vllm"):
            found = fewest_workers(colocated_at(policy, disagg_rate), max_workers=limit)
            out[f"{policy}_workers_at_disagg_rate"] = None if found.best is None else found.best.prefill
    return out


def sizing_phase(args: argparse.Namespace, rows: list[dict[str, Any]]) -> list[dict]:
    jobs = []
    for name in args.traces:
        vllm = next(r for r in rows if r["trace"] == name and r["config"] == "vllm")["goodput_req_s"]
        disagg = max(r["goodput_req_s"] for r in rows if r["trace"] == name and r["kind"] == "disagg")
        jobs.append((args, name, vllm, disagg))
    return run_tasks(sizing_job, [(job,) for job in jobs], Parallelism.from_args(args), desc="sizing")


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    parallelism = Parallelism.from_args(args)
    jobs = [(args, name, kind, 0, 0) for name in args.traces for kind in args.colocated]
    jobs += [(args, name, "disagg", p, args.gpus - p) for name in args.traces for p in range(1, args.gpus)]
    rows = run_tasks(capacity_job, [(job,) for job in jobs], parallelism, desc="goodput searches")
    best = {
        name: max((r for r in rows if r["trace"] == name and r["kind"] == "disagg"), key=lambda r: r["goodput_req_s"])
        for name in args.traces
    }
    diag_jobs = []
    for name in args.traces:
        b = best[name]
        rate = b["goodput_req_s"]
        if rate <= 0:
            continue
        for which in ("ttft", "tbt"):
            diag_jobs += [(args, name, kind, 0, 0, rate, which, "nvlink") for kind in args.colocated]
            diag_jobs.append((args, name, "disagg", b["prefill"], b["decode"], rate, which, "nvlink"))
        for network in ("infiniband", "ethernet"):
            diag_jobs.append((args, name, "disagg", b["prefill"], b["decode"], rate, "both", network))
    diags = run_tasks(diagnosis_job, [(job,) for job in diag_jobs], parallelism, desc="diagnosis")
    sizing = [] if args.skip_sizing else sizing_phase(args, rows)
    return {
        "args": {k: v for k, v in vars(args).items() if k not in ("out", "ray")},
        "goodput": rows,
        "diagnosis": diags,
        "sizing": sizing,
    }


def report(data: dict[str, Any], out: Path) -> str:
    args = data["args"]
    rows = data["goodput"]
    lines = [
        f"Goodput per GPU (>= {DISTSERVE_ATTAINMENT:.0%} of requests within TTFT {args['ttft_scale']:g}x prefill "
        f"and TBT {args['tbt_scale']:g}x decode), {args['gpus']} GPUs, {args['num_requests']} requests per run",
        "",
    ]
    goodput = []
    for name in args["traces"]:
        vllm = next(r for r in rows if r["trace"] == name and r["config"] == "vllm")["goodput_req_s"]
        for r in (r for r in rows if r["trace"] == name):
            t = r["at_goodput"].get("transfer")
            at = r["at_goodput"]
            goodput.append(
                {
                    "trace": name,
                    "config": r["config"],
                    "goodput req/s": f"{r['goodput_req_s']:.2f}",
                    "per GPU": f"{r['goodput_per_gpu']:.3f}",
                    "vs colocated vllm": f"{r['goodput_req_s'] / vllm:.2f}x" if vllm > 0 else "n/a",
                    "TTFT p50 / p99 s": f"{at['ttft_p50_s']:.2f} / {at['ttft_p99_s']:.2f}" if at else "",
                    "TBT p99 ms": f"{at['tbt_p99_s'] * 1e3:.0f}" if at else "",
                    "transfer p50 / p99 ms": (
                        f"{t['transfer_s_p50'] * 1e3:.2f} / {t['transfer_s_p99'] * 1e3:.2f}"
                        if t and t["transfer_s_p50"]
                        else ""
                    ),
                    "GB moved": f"{t['bytes'] / 1e9:.0f}" if t else "",
                }
            )
    right = ("goodput req/s", "per GPU", "vs colocated vllm", "TBT p99 ms", "GB moved")
    lines += [format_table(goodput, right=right)]
    lines += ["", "Which SLO is missed, at the best split's goodput rate (attainment judging one SLO only):", ""]
    diags = data["diagnosis"]
    missed = []
    for name in args["traces"]:
        configs = sorted({(d["kind"], d["prefill"], d["decode"]) for d in diags if d["trace"] == name})
        for kind, p, dd in configs:
            got = {
                d["which"]: d
                for d in diags
                if d["trace"] == name
                and d["network"] == "nvlink"
                and (d["kind"], d["prefill"], d["decode"]) == (kind, p, dd)
            }
            if "ttft" not in got:
                continue
            missed.append(
                {
                    "trace": name,
                    "rate": f"{got['ttft']['rate']:.2f}",
                    "config": f"{p}P+{dd}D" if kind == "disagg" else kind,
                    "TTFT-only": f"{got['ttft']['attainment']:.1%}",
                    "TBT-only": f"{got['tbt']['attainment']:.1%}",
                }
            )
    lines += [format_table(missed, right=("rate", "TTFT-only", "TBT-only"))]
    lines += ["", "The best split with its KV over slower links, at its NVLink goodput rate:", ""]
    links = [
        {
            "trace": d["trace"],
            "split": f"{d['prefill']}P+{d['decode']}D",
            "network": d["network"],
            "attainment": f"{d['attainment']:.1%}",
            "transfer p50 / p99 ms": (
                f"{d['transfer']['transfer_s_p50'] * 1e3:.1f} / {d['transfer']['transfer_s_p99'] * 1e3:.1f}"
            ),
        }
        for d in diags
        if d["network"] != "nvlink"
    ]
    lines += [
        format_table(links, ["trace", "split", "network", "attainment", "transfer p50 / p99 ms"], right=("attainment",))
    ]
    lines += [
        "",
        f"GPUs each deployment needs for one rate (>= 90% within SLOs; colocated searched up to {2 * args['gpus']} "
        f"workers, splits up to {args['gpus'] + 1} at vllm's rate and {args['gpus']} at the split's own):",
        "",
    ]

    def gpus(split: dict[str, Any] | None) -> str:
        return (
            "none"
            if split is None
            else f"{split['prefill']}P+{split['decode']}D = {split['prefill'] + split['decode']}"
        )

    sizing = []
    for s in data["sizing"]:
        if "split_at_vllm_rate" in s:
            sizing.append(
                {
                    "trace": s["trace"],
                    "rate": f"{s['vllm_rate']:.2f}",
                    "the rate is": f"vllm's goodput on {args['gpus']}",
                    "cheapest P+D": gpus(s["split_at_vllm_rate"]),
                    "colocated vllm": str(args["gpus"]),
                    "colocated econoserve": "",
                }
            )
        if "split_at_disagg_rate" in s:
            e, v = s["econoserve_workers_at_disagg_rate"], s["vllm_workers_at_disagg_rate"]
            sizing.append(
                {
                    "trace": s["trace"],
                    "rate": f"{s['disagg_rate']:.2f}",
                    "the rate is": f"best split's goodput on {args['gpus']}",
                    "cheapest P+D": gpus(s["split_at_disagg_rate"]),
                    "colocated vllm": str(v or "none"),
                    "colocated econoserve": str(e or "none"),
                }
            )
    columns = ["trace", "rate", "the rate is", "cheapest P+D", "colocated vllm", "colocated econoserve"]
    lines += [format_table(sizing, columns, right=("rate", "colocated vllm", "colocated econoserve"))]
    text = "\n".join(lines) + "\n"
    out.with_suffix(".md").write_text(text)
    _plot(data, out.with_suffix(".png"))
    return text


def _plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = data["args"]["traces"]
    fig, axes = plt.subplots(1, len(traces), figsize=(4.5 * len(traces), 3.6), squeeze=False)
    for ax, name in zip(axes[0], traces, strict=True):
        rows = [r for r in data["goodput"] if r["trace"] == name]
        colors = ["tab:blue" if r["kind"] != "disagg" else "tab:orange" for r in rows]
        ax.bar([r["config"] for r in rows], [r["goodput_per_gpu"] for r in rows], color=colors)
        ax.set_title(name)
        ax.set_ylabel("goodput per GPU (req/s)")
        ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--traces", nargs="+", default=list(TRACES), choices=list(TRACES))
    parser.add_argument("--colocated", nargs="+", default=list(COLOCATED), help="colocated policies (vllm first)")
    parser.add_argument("--skip-sizing", action="store_true", help="no sizing phase (GPUs needed per rate)")
    parser.add_argument("--gpus", type=int, default=4, help="total GPUs of every configuration")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--ttft-scale", type=float, default=2.5)
    parser.add_argument("--tbt-scale", type=float, default=5.0)
    parser.add_argument("--tolerance", type=float, default=0.08, help="relative precision of each goodput search")
    parser.add_argument("--max-probes", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("docs/results/data/disagg"))
    parser.add_argument("--from-json", action="store_true", help="only redraw the tables and plot from OUT.json")
    parser.add_argument("--resize", action="store_true", help="with --from-json: run the sizing phase again")
    add_parallel_options(parser)
    args = parser.parse_args()
    if args.from_json:
        data = json.loads(args.out.with_suffix(".json").read_text())
        if args.resize:
            data["sizing"] = sizing_phase(args, data["goodput"])
            write_json(data, args.out.with_suffix(".json"), indent=1)
    else:
        data = run_all(args)
        write_json(data, args.out.with_suffix(".json"), indent=1)
    print(report(data, args.out))


if __name__ == "__main__":
    main()
