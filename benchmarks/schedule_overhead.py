"""`schedule()` overhead of each baseline with 256 running and 10,000 waiting requests
(target: p99 under 1 ms). The running requests decode; the queue holds prompts from the
sharegpt trace that cannot all fit, so every call looks at a long queue.

    python benchmarks/schedule_overhead.py --steps 300
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
from scheduler_service.sim.workloads import load_trace

POLICIES = ["vllm", "vllm_chunked", "sarathi:budget=512", "orca:max_batch_size=256", "sls:batch_size=256"]


def build(policy: str, prompts: list[int], outputs: list[int]) -> Scheduler:
    block_size = 16
    # Room for 256 running requests even when each reserves prompt + max_tokens (orca, sls);
    # the 10,000 waiting prompts still cannot all fit, so the queue stays long.
    num_blocks = 256 * 520
    kv = KVCacheManager(num_blocks, 4096, block_size)
    ctx = PolicyContext(0, block_size, num_blocks, 4096, 8192, 256, 8192)
    sched = Scheduler(0, kv, build_policy(policy, ctx), SchedulerConfig(256, 8192, 8192, max_waiting=20_000))
    for i, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
        sched.add_request(
            Request(f"r{i}", arrival_time=0.0, num_prompt_tokens=min(p, 2000), sampling=SamplingParams(max_tokens=o)),
            0.0,
        )
    return sched


def fill_running(sched: Scheduler) -> None:
    now = 0.0
    while len(sched.running) < 256 and sched.waiting:
        before = len(sched.running)
        plan = sched.schedule(now)
        sched.on_step_result(StepResult(plan.step_id, dict.fromkeys(plan.sample_ids, 1), total_s=0.01), now)
        now += 0.01
        if len(sched.running) == before and not plan.num_scheduled_tokens:
            break


def measure(policy: str, steps: int, prompts: list[int], outputs: list[int]) -> tuple[float, float, int, int]:
    sched = build(policy, prompts, outputs)
    fill_running(sched)
    times = []
    now = 10.0
    for _ in range(steps):
        t0 = time.perf_counter()
        plan = sched.schedule(now)
        times.append(time.perf_counter() - t0)
        sched.on_step_result(StepResult(plan.step_id, dict.fromkeys(plan.sample_ids, 1), total_s=0.01), now)
        now += 0.01
    a = np.array(times) * 1e3
    return float(a.mean()), float(np.percentile(a, 99)), len(sched.running), len(sched.waiting)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    wl = load_trace("sharegpt", num_requests=10_256)
    prompts = [r.prompt_tokens for r in wl.requests]
    outputs = [6000] * len(prompts)  # nobody finishes during the measurement (prompts are capped at 2000)
    print(f"{'policy':<26} {'mean ms':>8} {'p99 ms':>8} {'p99/1ms':>8} {'running':>8} {'waiting':>8}")
    for policy in tqdm(POLICIES, desc="policies", leave=False):
        mean, p99, running, waiting = measure(policy, args.steps, prompts, outputs)
        tqdm.write(f"{policy:<26} {mean:8.3f} {p99:8.3f} {p99 / 1.0:8.2f} {running:8d} {waiting:8d}")


if __name__ == "__main__":
    main()
