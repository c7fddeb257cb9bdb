"""Simulator speed: 10,000 requests of the sharegpt trace through `vllm` and `sarathi`
(target: under 30 s each on a 2-core machine). Prints wall time and requests/s.

    python benchmarks/simulator_speed.py --num-requests 10000
"""

from __future__ import annotations

import argparse
import time

from scheduler_service.costmodel.factory import build_cost_model
from scheduler_service.sim.simulator import SimConfig, simulate
from scheduler_service.sim.workloads import apply_arrivals, load_trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--rate", type=float, default=1.0)
    args = parser.parse_args()
    cm = build_cost_model("analytic", "llama-2-7b", "a100-80g")
    wl = apply_arrivals(load_trace("sharegpt", num_requests=args.num_requests), "poisson", rate=args.rate, seed=0)
    print(f"{'policy':<10} {'wall s':>8} {'req/s simulated':>16} {'target 30 s':>12} {'steps':>8} {'finished':>9}")
    for policy in ("vllm", "sarathi"):
        t0 = time.perf_counter()
        run = simulate(SimConfig(policy=policy, max_model_len=8192, progress=True), wl, cm)
        wall = time.perf_counter() - t0
        steps = run.details["num_steps"]
        done = run.metrics["num_finished"]
        print(f"{policy:<10} {wall:8.1f} {len(wl) / wall:16.0f} {wall / 30:11.2f}x {steps:8d} {done:9d}")


if __name__ == "__main__":
    main()
