"""What real predictions cost the policies that schedule on predicted lengths: every seed policy
in the simulator with the oracle's lengths, the predictor's, a symmetric-noise oracle and none
(max_tokens), side by side on the same workload, model, GPU and KV size.

    sharegpt-conversations-2k   ShareGPT first turns, text: the predictor runs on the prompts
    alpaca-eval-2models         AlpacaEval outputs of two models, text: the predictor runs on
                                the prompts with the answering model as its input
    (lengths counted in the predictor's tokenizer's tokens, as the predictor counts them)

Policies that read predicted lengths: alise (SRTF priority; a job that outruns its prediction
has it doubled and is demoted), econoserve (exact KV allocation and GT groups; a GT that outruns
its allocation is stopped and regrouped), accelgen (remaining time in its queue order), scls
(its router's load estimate; one worker here, so no routing choice), and as references that read
none: vllm, sarathi, fastserve (skip-join MLFQ on the prompt), sls.

For each trace the predictions are scored against the truth (MAE, share under-predicted and
ALISE's doublings: sum over requests of ceil(log2(true / predicted)) where true > predicted,
the number of times ALISE's rule doubles a prediction before it covers the request).

    python benchmarks/length_sources.py [--num-requests 600] [--seeds 2] [--json out.json]
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import numpy as np
from tqdm import tqdm

from scheduler_service.cluster.length_sources import TableLengths
from scheduler_service.costmodel.factory import build_cost_model
from scheduler_service.sim.simulator import PAPER_SETTING, SimConfig, simulate
from scheduler_service.sim.slo_profiles import apply_slo_profile
from scheduler_service.workloads import Workload, apply_arrivals, load_trace
from services.predictor_lengths import predictor_lengths
from sluice.common.tokenizer import demo_tokenizer_path
from sluice.contract.length_prediction import bucket_accuracy
from sluice_bench.options import SERIAL, Parallelism, add_common_options, benchmark_parser, seed_list
from sluice_bench.report import format_table, write_json
from sluice_bench.sweep import run_tasks

POLICIES = ("alise", "econoserve", "accelgen", "scls", "fastserve", "sls", "sarathi", "vllm")
# never read a predicted length (scheduler_service/policies): run once, with the oracle, as references
LENGTH_FREE = ("fastserve", "sls", "sarathi", "vllm")
SOURCES = ("oracle", "predictor", "noisy_oracle", "max_tokens")
# (trace, arrivals/s): offered output tokens/s a little above what vllm sustains on one A100
# with 8 GB of KV, so queues form and the order in which requests are served matters
TRACES = (("sharegpt-conversations-2k", 8.0), ("alpaca-eval-2models", 5.0))
MODEL, HARDWARE, KV_GB = "llama-2-7b", "a100-80g", 8.0


def prediction_errors(workload: Workload, table: TableLengths) -> dict[str, float]:
    true = np.array([max(1, r.output_tokens) for r in workload.requests], dtype=float)
    pred = np.array([max(1, table.predictions[r.request_id]) for r in workload.requests], dtype=float)
    under = true > pred
    return {
        "mae_tokens": float(np.mean(np.abs(true - pred))),
        "under_share": float(np.mean(under)),
        "alise_doublings": int(np.sum(np.ceil(np.log2(true[under] / pred[under])))),
        "bucket_accuracy": bucket_accuracy(true.astype(int).tolist(), pred.astype(int).tolist()),
    }


def _row(trace: str, policy: str, source: str, seed: int, run: Any) -> dict[str, Any]:
    m, d = run.metrics, run.details
    by_reason: dict[str, int] = defaultdict(int)
    for key, n in d["preemptions_by_mode_reason"].items():
        by_reason[str(key).rsplit("/", 1)[-1]] += n  # "mode/reason" -> reason
    stats = d["policy_stats"].get("0", {})
    return {
        "trace": trace,
        "policy": policy,
        "lengths": source,
        "seed": seed,
        "throughput_tok_s": m["throughput_tok_s"],
        "goodput_req_s": m["goodput_req_s"],
        "jct_p50_s": m["jct_s"]["p50"],
        "normalized_latency_s": m["normalized_latency_s"],
        "preemptions": m["preemptions"],
        "preemptions_by_reason": dict(by_reason),
        "finished": m["num_finished"],
        # a policy that keeps counters (EconoServe) reports a counter that never ran as absent
        "regrouped": stats.get("regrouped", 0) if stats else None,
        "mispredicted_kept": stats.get("mispredicted_kept", 0) if stats else None,
    }


def run_one(workload: Workload, table: TableLengths, policy: str, source: str, seed: int) -> Any:
    """One policy with one length source on one seed's workload (`table`: the predictor's answers)."""
    cost_model = build_cost_model("analytic", MODEL, HARDWARE)
    router = "scls" if policy == "scls" else "round_robin"
    config = SimConfig(
        policy=policy,
        router=router,
        kv_gb=KV_GB,
        max_model_len=4096,
        length_source=source if source != "predictor" else "oracle",
        seed=seed,
        **PAPER_SETTING,
    )
    return simulate(config, workload, cost_model, table if source == "predictor" else None)


def run(num_requests: int, seeds: list[int], parallelism: Parallelism = SERIAL) -> dict[str, Any]:
    cost_model = build_cost_model("analytic", MODEL, HARDWARE)
    tokenizer = str(demo_tokenizer_path())
    errors: dict[str, dict[str, float]] = {}
    jobs = [(t, s) for t in TRACES for s in seeds]
    runs = [(p, s) for p in POLICIES for s in SOURCES if p not in LENGTH_FREE or s == "oracle"]
    calls, labels = [], []
    # the predictor runs here, once per trace and seed; the simulations side by side after
    for (trace, rate), seed in tqdm(jobs, desc="predictions", unit="trace"):
        workload = load_trace(trace, num_requests=num_requests, seed=seed, tokenizer_path=tokenizer)
        workload = apply_arrivals(workload, "poisson", rate=rate, seed=seed)
        workload = apply_slo_profile("accelgen", workload, cost_model, seed=seed)
        table = predictor_lengths("predictor", workload, seed=seed, progress=False)
        assert table.name == "predictor", "these traces carry prompt text: the predictor itself must run"
        errors.setdefault(trace, prediction_errors(workload, table))
        for policy, source in runs:
            calls.append((workload, table, policy, source, seed))
            labels.append((trace, policy, source, seed))
    results = run_tasks(run_one, calls, parallelism, desc="policy x length source")
    rows = [_row(*label, result) for label, result in zip(labels, results, strict=True)]
    return {"rows": rows, "prediction_errors": errors, "seeds": seeds, "num_requests": num_requests}


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    vals = [r[key] for r in rows if r[key] is not None]
    return float(np.mean(vals)) if vals else math.nan


def tables(res: dict[str, Any]) -> str:
    rows = res["rows"]
    errors = [
        {
            "trace": trace,
            "bucket accuracy": f"{e['bucket_accuracy']:.2f}",
            "MAE tokens": f"{e['mae_tokens']:.0f}",
            "under-predicted": f"{e['under_share']:.0%}",
            "ALISE doublings": str(e["alise_doublings"]),
        }
        for trace, e in res["prediction_errors"].items()
    ]
    out = ["Predictions against the truth:", "", format_table(errors)]
    for key, label, fmt in (
        ("normalized_latency_s", "normalized latency (s/token)", "{:.3f}"),
        ("jct_p50_s", "JCT p50 (s)", "{:.1f}"),
        ("throughput_tok_s", "throughput (tok/s)", "{:.0f}"),
    ):
        out += ["", f"{label}, mean over seeds {res['seeds']}:", ""]
        lines = []
        for trace, _ in TRACES:
            for policy in POLICIES:
                line = {"trace": trace, "policy": policy}
                if policy in LENGTH_FREE:
                    value = fmt.format(_mean(_of(rows, trace, policy, "oracle"), key))
                    line |= {SOURCES[0]: value, **dict.fromkeys(SOURCES[1:], "same")}
                    lines.append(line | {"predictor / oracle": "reads none"})
                    continue
                by = {s: _mean(_of(rows, trace, policy, s), key) for s in SOURCES}
                ratio = by["predictor"] / by["oracle"] if by["oracle"] else math.nan
                line |= {s: fmt.format(by[s]) for s in SOURCES}
                lines.append(line | {"predictor / oracle": f"{ratio:.2f}x"})
        out.append(format_table(lines))
    out += ["", "Preemptions (by reason) and EconoServe's regroups, mean over seeds:", ""]
    lines = []
    for trace, _ in TRACES:
        for policy in POLICIES:
            cells = []
            for s in SOURCES if policy not in LENGTH_FREE else ("oracle",):
                mine = _of(rows, trace, policy, s)
                reasons: dict[str, float] = defaultdict(float)
                for r in mine:
                    for k, n in r["preemptions_by_reason"].items():
                        reasons[k] += n / len(mine)
                text = f"{_mean(mine, 'preemptions'):.0f}"
                if reasons:
                    text += " (" + ", ".join(f"{k} {v:.0f}" for k, v in sorted(reasons.items())) + ")"
                if mine[0]["regrouped"] is not None:
                    text += f"; regrouped {_mean(mine, 'regrouped'):.0f}"
                cells.append(text)
            cells += ["same"] * (len(SOURCES) - len(cells))
            lines.append({"trace": trace, "policy": policy, **dict(zip(SOURCES, cells, strict=True))})
    out.append(format_table(lines))
    return "\n".join(out)


def _of(rows: list[dict[str, Any]], trace: str, policy: str, source: str) -> list[dict[str, Any]]:
    return [r for r in rows if (r["trace"], r["policy"], r["lengths"]) == (trace, policy, source)]


def main() -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--num-requests", type=int, default=600)
    add_common_options(parser, seeds=2, parallel=True)
    args = parser.parse_args()
    res = run(args.num_requests, seed_list(args), Parallelism.from_args(args))
    print(tables(res))
    if args.json:
        write_json(res, args.json, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
