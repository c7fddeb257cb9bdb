"""What real predictions cost the policies that schedule on predicted lengths: every seed policy
in the simulator with the oracle's lengths, the predictor's, and none (max_tokens), side by side
on the same workload, model, GPU and KV size.

    sharegpt-conversations-2k   prompts with text: the predictor runs on them (lengths counted
                                in its tokenizer's tokens, as the predictor counts)
    azure-conv                  no text: predictions drawn from the predictor's held-out error
                                model (the empirical residuals by true length)

    python benchmarks/length_sources.py [--num-requests 600] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from tqdm import tqdm

from scheduler_service.costmodel.factory import build_cost_model
from scheduler_service.sim.simulator import SimConfig, simulate
from scheduler_service.sim.slo_profiles import apply_slo_profile
from scheduler_service.sim.workloads import apply_arrivals, load_trace
from services.lengths import predictor_lengths
from sluice.common.tokenizer import demo_tokenizer_path

POLICIES = ("vllm", "alise", "econoserve", "accelgen", "scls")
SOURCES = ("oracle", "predictor", "max_tokens")
# (trace, arrivals/s, tokenizer for text) at a load where queues form on one A100 with 8 GB of KV
TRACES = (("sharegpt-conversations-2k", 8.0, True), ("azure-conv", 5.0, False))
MODEL, HARDWARE, KV_GB = "llama-2-7b", "a100-80g", 8.0


def run(num_requests: int) -> list[dict[str, Any]]:
    cost_model = build_cost_model("analytic", MODEL, HARDWARE)
    rows = []
    jobs = [(t, p, s) for t in TRACES for p in POLICIES for s in SOURCES]
    workloads = {}
    for trace, rate, text in TRACES:
        tokenizer = str(demo_tokenizer_path()) if text else None
        workload = load_trace(trace, num_requests=num_requests, seed=0, tokenizer_path=tokenizer)
        workload = apply_arrivals(workload, "poisson", rate=rate, seed=0)
        workload = apply_slo_profile("accelgen", workload, cost_model, seed=0)
        workloads[trace] = (workload, predictor_lengths("predictor", workload, seed=0, progress=False))
    for (trace, _rate, _text), policy, source in tqdm(jobs, desc="policy x length source", unit="run"):
        workload, table = workloads[trace]
        router = "scls" if policy == "scls" else "round_robin"
        config = SimConfig(policy=policy, router=router, kv_gb=KV_GB, max_model_len=4096, length_source=source)
        result = simulate(config, workload, cost_model, table if source == "predictor" else None)
        m = result.metrics
        rows.append(
            {
                "trace": trace,
                "policy": policy,
                "lengths": source if source != "predictor" else table.name,
                "throughput_tok_s": m["throughput_tok_s"],
                "goodput_req_s": m["goodput_req_s"],
                "jct_p50_s": m["jct_s"]["p50"],
                "normalized_latency_s": m["normalized_latency_s"],
                "preemptions": m["preemptions"],
                "finished": m["num_finished"],
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=600)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = run(args.num_requests)
    print("| trace | policy | lengths | tok/s | goodput req/s | JCT p50 s | norm latency s/token | preemptions |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['trace']} | {r['policy']} | {r['lengths']} | {r['throughput_tok_s']:.0f} | "
            f"{r['goodput_req_s']:.2f} | {r['jct_p50_s']:.1f} | {r['normalized_latency_s']:.3f} | {r['preemptions']} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
