"""`schedule()` overhead of `econoserve` (each variant) next to `vllm` with 256 running and
10,000 waiting requests (target: p99 under 2 ms; the garbage collector is held off during the timed call).

Requests come from the sharegpt trace with oracle lengths and end at their true length, so
groups complete, GT groups are refilled, KVCPipe lends and the PT queue is searched during the
measurement; the waiting queue is topped up to 10,000 after every step.

    python benchmarks/econoserve_overhead.py --steps 400
"""

from __future__ import annotations

import gc
import time

import numpy as np
from tqdm import tqdm

from scheduler_service import policies  # noqa: F401
from scheduler_service.cluster import ClusterSpec, WorkerSpec, build_cluster
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.costmodel.factory import build_cost_model
from scheduler_service.workloads import load_trace
from sluice.contract.plan import StepResult
from sluice.contract.sampling import SamplingParams
from sluice_bench.options import benchmark_parser
from sluice_bench.report import print_table

POLICIES = ["vllm", "econoserve:variant=D", "econoserve:variant=SD", "econoserve:variant=SDO", "econoserve"]
RUNNING = 256
WAITING = 10_000
BLOCK = 16


class Feeder:
    """Adds trace requests (oracle predictions) and answers steps with EOS at the true length."""

    def __init__(self, sched: Scheduler, prompts: list[int], outputs: list[int]) -> None:
        self.sched, self.prompts, self.outputs = sched, prompts, outputs
        self.truth: dict[str, int] = {}
        self.i = 0

    def top_up(self, now: float) -> None:
        while len(self.sched.waiting) < WAITING:
            p, o = self.prompts[self.i % len(self.prompts)], self.outputs[self.i % len(self.outputs)]
            rid = f"r{self.i}"
            self.i += 1
            req = Request(
                rid,
                arrival_time=now,
                num_prompt_tokens=min(p, 1500),
                sampling=SamplingParams(max_tokens=2000),
                predicted_output_tokens=min(o, 2000),
                eos_token_ids=frozenset({0}),
            )
            self.truth[rid] = min(o, 2000)
            self.sched.add_request(req, now)

    def step(self, now: float) -> float:
        # NOTE: the collector runs between steps, not inside the timed call: its pauses depend
        # on the whole process's heap (10,000 queued requests), not on the policy.
        gc.disable()
        t0 = time.perf_counter()
        plan = self.sched.schedule(now)
        took = time.perf_counter() - t0
        gc.enable()
        running = self.sched.running
        sampled = {rid: 0 if running[rid].num_output_tokens + 1 >= self.truth[rid] else 1 for rid in plan.sample_ids}
        self.sched.on_step_result(StepResult(plan.step_id, sampled, total_s=0.02), now)
        self.top_up(now)
        return took


def build(policy: str) -> Scheduler:
    num_blocks = RUNNING * 3500 // BLOCK  # every one of 256 fits: max_num_seqs binds, the queue stays long
    spec = ClusterSpec(
        policy=policy,
        workers=(WorkerSpec(num_blocks, 8192, BLOCK),),
        cost_model=build_cost_model("analytic", "llama-2-7b", "a100-80g"),
        max_model_len=4096,
        max_num_seqs=RUNNING,
        max_num_batched_tokens=8192,
        max_waiting=20_000,
        overlap=False,  # the scheduler stepped on its own, one step after the last
    )
    return build_cluster(spec).schedulers[0]


def measure(policy: str, steps: int, prompts: list[int], outputs: list[int]) -> dict[str, float]:
    sched = build(policy)
    feeder = Feeder(sched, prompts, outputs)
    feeder.top_up(0.0)
    now = 0.0
    for _ in range(300):  # warm up to a steady state
        feeder.step(now)
        now += 0.02
    times = [feeder.step(now + 0.02 * k) for k in range(steps)]
    a = np.array(times) * 1e3
    return {
        "mean_ms": float(a.mean()),
        "p50_ms": float(np.percentile(a, 50)),
        "p99_ms": float(np.percentile(a, 99)),
        "running": len(sched.running) + len(sched.kept),
        "waiting": len(sched.waiting),
    }


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    wl = load_trace("sharegpt", num_requests=12_000, seed=0)
    prompts = [r.prompt_tokens for r in wl.requests]
    outputs = [max(2, r.output_tokens) for r in wl.requests]
    rows = []
    for policy in tqdm(POLICIES, desc="policies", leave=False):
        r = measure(policy, args.steps, prompts, outputs)
        ms = {f"{k} ms": r[f"{k}_ms"] for k in ("mean", "p50", "p99")}
        rows.append({"policy": policy, **ms, "running": r["running"], "waiting": r["waiting"]})
    print_table(rows, formats=dict.fromkeys(("mean ms", "p50 ms", "p99 ms"), "{:.3f}"))


if __name__ == "__main__":
    main()
