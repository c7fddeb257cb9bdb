"""`schedule()` overhead of AccelGen (and its ablations) next to vLLM with 256 running and
10,000 waiting requests (target: p99 under 2 ms). Same setting as
`benchmarks/schedule_overhead.py`: the running requests decode, the queue holds sharegpt
prompts that cannot all fit; here every request carries an AccelGen-profile SLO so the
deadline index is exercised.

    python benchmarks/accelgen_overhead.py --steps 300
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from tqdm import tqdm

from kvstore.accounting import KVCacheManager
from scheduler_service import policies  # noqa: F401
from scheduler_service.core.plan import StepResult
from scheduler_service.core.policy import PolicyContext, build_policy
from scheduler_service.core.request import Request
from scheduler_service.core.sampling import SamplingParams
from scheduler_service.core.scheduler import Scheduler, SchedulerConfig
from scheduler_service.costmodel.factory import build_cost_model
from scheduler_service.sim.slo_profiles import apply_slo_profile
from scheduler_service.sim.workloads import load_trace

POLICIES = [
    "vllm",
    "accelgen",
    "accelgen:chunk=false",
    "accelgen:order=false",
    "accelgen:batch=false",
]


def build(policy: str, requests: list) -> Scheduler:
    block_size = 16
    num_blocks = 256 * 160
    kv = KVCacheManager(num_blocks, 4096, block_size)
    cm = build_cost_model("analytic", "opt-13b", "a100-80g")
    ctx = PolicyContext(0, block_size, num_blocks, 4096, 8192, 256, 8192, cost_model=cm)
    sched = Scheduler(0, kv, build_policy(policy, ctx), SchedulerConfig(256, 8192, 8192, max_waiting=20_000))
    for i, tr in enumerate(requests):
        req = Request(
            f"r{i}",
            arrival_time=0.0,
            num_prompt_tokens=min(tr.prompt_tokens, 2000),
            sampling=SamplingParams(max_tokens=6000),
            slo=tr.slo,
        )
        sched.add_request(req, 0.0)
    return sched


def advance(sched: Scheduler, now: float) -> float:
    t0 = time.perf_counter()
    plan = sched.schedule(now)
    elapsed = time.perf_counter() - t0
    sched.on_step_result(StepResult(plan.step_id, dict.fromkeys(plan.sample_ids, 1), total_s=0.05), now + 0.05)
    return elapsed


def measure(policy: str, steps: int, requests: list) -> tuple[float, float, int, int]:
    sched = build(policy, requests)
    now = 0.0
    while len(sched.running) < 256 and sched.waiting and now < 100.0:
        advance(sched, now)
        now += 0.05
    times = [advance(sched, now + 0.05 * k) for k in range(steps)]
    a = np.array(times) * 1e3
    return float(a.mean()), float(np.percentile(a, 99)), len(sched.running), len(sched.waiting)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    cm = build_cost_model("analytic", "opt-13b", "a100-80g")
    wl = apply_slo_profile("accelgen", load_trace("sharegpt", num_requests=10_256), cm, seed=0)
    print(f"{'policy':<24} {'mean ms':>8} {'p99 ms':>8} {'running':>8} {'waiting':>8}")
    for policy in tqdm(POLICIES, desc="policies", leave=False):
        mean, p99, running, waiting = measure(policy, args.steps, wl.requests)
        tqdm.write(f"{policy:<24} {mean:8.3f} {p99:8.3f} {running:8d} {waiting:8d}")


if __name__ == "__main__":
    main()
