"""The predictor's point rule (`median` or `mode_bin`), judged by what schedulers get from it.

    python benchmarks/predictor_point_rule.py [--n 600] [--rates 2,3] [--seed 0] [--seeds 1]
                                              [--systems alise,econoserve]
                                              [--out docs/results/data/predictor_point_rule.json]

Held-out ShareGPT first turns (the predictor's own test split, `--n` of them drawn with
`--seed`), embedded once; for each point rule the served predictor (its model, its seed history)
predicts every prompt, and:
1. the statistics: bucket accuracy (ALISE's Table 2 measure), MAE, Spearman, Kendall's tau and
   the under-prediction share;
2. the scheduling outcome: the prompts as a trace (their true answer lengths, prompts counted
   in the predictor's tokenizer, Poisson arrivals at each of `--rates`), served on OPT-13B / one
   A100 / 12 GB of KV by ALISE (hybrid batching, resident int8 KV) and by EconoServe (the
   admission reading of benchmarks/repro.py), each with that rule's predictions and, for
   reference, with the true lengths: mean normalized latency (s/token) over the whole run, and
   the evictions that show whether the ranking acted (ALISE's `ewt_swap_outs`, its proactive
   swap-outs by expected wait, and `forced_swap_outs`; the preemptions of every system).
`--seeds N` repeats all of it for seeds seed .. seed + N - 1 (each draws its own prompts and
arrivals); the statistics are per seed.
The default point rule should be the one that gives the schedulers the lower latency; bucket
accuracy alone chose `mode_bin`.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import numpy as np
from tqdm import tqdm

from predictor_service.data import load_samples
from predictor_service.evaluate import select
from predictor_service.metrics import point_metrics
from predictor_service.predictor import LengthPredictor
from scheduler_service.cluster.length_sources import TableLengths
from scheduler_service.costmodel.factory import build_cost_model
from scheduler_service.sim.simulator import PAPER_SETTING, SimConfig, Simulation
from scheduler_service.workloads import Workload, apply_arrivals
from scheduler_service.workloads.base import TraceRequest
from scheduler_service.workloads.tokens import make_token_counter
from sluice.common.paths import data_file
from sluice.common.tokenizer import demo_tokenizer_path
from sluice_bench.options import Parallelism, add_parallel_options, benchmark_parser
from sluice_bench.report import write_json
from sluice_bench.sweep import run_tasks

SHAREGPT = "prompts/sharegpt_v3_conversations.jsonl.gz"
RULES = ("median", "mode_bin")
SYSTEMS = {
    # ALISE's int8 resident KV: 12 GB of bytes hold what 24 GB of fp16 would
    "alise": ("alise:hybrid=true", {"overlap_swap": True}, 24.0),
    "econoserve": ("econoserve:padding=0.15,buffer=0.15,pt_reserve_only=false,admit_future=1", {}, 12.0),
}


def predictions_by_rule(predictor: LengthPredictor, texts: list[str], models: list[str]) -> dict[str, np.ndarray]:
    emb = np.concatenate([predictor.embed(texts[i : i + 64]) for i in tqdm(range(0, len(texts), 64), desc="embed")])
    out = {}
    served = predictor.blend_config
    for rule in RULES:
        predictor.blend_config = replace(served, point=rule)
        preds = predictor.predict_embedded(emb, texts, models)
        out[rule] = np.array([p.tokens for p in preds])
    predictor.blend_config = served
    return out


def trace_of(texts: list[str], true: np.ndarray, rate: float, seed: int) -> Workload:
    count = make_token_counter(demo_tokenizer_path())  # the predictor's tokens, the unit of its predictions
    reqs = [
        TraceRequest(f"p{i}", None, max(1, count(t)), int(n), prompt_text=t, source="sharegpt")
        for i, (t, n) in enumerate(zip(texts, true, strict=True))
    ]
    return apply_arrivals(Workload("sharegpt-held-out", reqs), "poisson", rate=rate, seed=seed)


# ALISE's eviction counters (details.policy_stats): whether its ranking by predicted length acted
EVICTIONS = ("ewt_swap_outs", "forced_swap_outs", "priority_pauses")


def schedule(wl: Workload, table: dict[str, int] | None, system: str) -> dict[str, Any]:
    policy, extra, kv_gb = SYSTEMS[system]
    cm = build_cost_model("analytic", "opt-13b", "a100-80g")
    cfg = replace(
        SimConfig(policy=policy, kv_gb=kv_gb, block_size=16, length_source="oracle", **PAPER_SETTING), **extra
    )
    run = Simulation(cfg, wl, cm, TableLengths(table) if table is not None else None).run()
    m = run.metrics
    # ALISE's counters only; one the policy never moved is absent from its report: 0
    stats: dict[str, float] = dict.fromkeys(EVICTIONS, 0) if system == "alise" else {}
    for report in run.details["policy_stats"].values():
        for key in stats:
            stats[key] += report.get(key, 0)
    return {
        "normalized_latency_s": m["normalized_latency_s"],
        "jct_mean_s": m["jct_s"]["mean"],
        "preemptions": m["preemptions"],
        **stats,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--n", type=int, default=600)
    parser.add_argument("--rates", default="2,3")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=1, help="seeds seed .. seed + seeds - 1")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated: alise, econoserve")
    parser.add_argument("--out", default="docs/results/data/predictor_point_rule.json")
    add_parallel_options(parser)
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    systems = args.systems.split(",")
    if not set(systems) <= set(SYSTEMS):
        parser.error(f"--systems must name {', '.join(SYSTEMS)}, got {args.systems!r}")
    everything = load_samples(data_file(SHAREGPT))
    predictor = LengthPredictor()
    stats: dict[int, dict[str, Any]] = {}
    calls, labels = [], []
    # the predictor runs here, seed by seed; the simulations side by side after
    for seed in range(args.seed, args.seed + args.seeds):
        samples = select(everything, "test", True, args.n, seed)
        texts, models = [s.prompt for s in samples], [s.model for s in samples]
        true = np.array([s.output_tokens for s in samples])
        preds = predictions_by_rule(predictor, texts, models)
        stats[seed] = {rule: point_metrics(true, p) for rule, p in preds.items()}
        for rate, system, rule in [(r, sy, ru) for r in rates for sy in systems for ru in (*RULES, "true lengths")]:
            wl = trace_of(texts, true, rate, seed)
            ids = [r.request_id for r in wl.requests]
            table = None if rule == "true lengths" else {rid: int(p) for rid, p in zip(ids, preds[rule], strict=True)}
            calls.append((wl, table, system))
            labels.append({"rate": rate, "seed": seed, "system": system, "lengths": rule})
    found = run_tasks(schedule, calls, Parallelism.from_args(args), desc="schedule")
    outcome = [{**label, **m} for label, m in zip(labels, found, strict=True)]
    result = {
        "n": len(samples),
        "predictor_version": predictor.version,
        "command": "python benchmarks/predictor_point_rule.py " + " ".join(argv if argv is not None else []),
        "statistics": stats[args.seed] if args.seeds == 1 else stats,
        "scheduling": outcome,
    }
    print(json.dumps(result, indent=1))
    write_json(result, args.out, indent=1)
    return result


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
