"""Router decision cost: each router placing 10,000 pending requests on 64 workers, the
`scls` router's one release of a 10,000-request pool (DP batcher + max-min offloader),
and the DP batcher alone on 2,000 requests. Request lengths come from the sharegpt trace
(inputs and outputs clipped to 1024, as in the SCLS reproduction).

    python benchmarks/router_overhead.py
"""

from __future__ import annotations

import time

import numpy as np

from scheduler_service.core.request import Request
from scheduler_service.costmodel.factory import build_cost_model
from scheduler_service.policies.scls.batcher import dp_batches
from scheduler_service.policies.scls.estimator import MemoryEstimator, ServingTimeEstimator
from scheduler_service.routers import RouterContext, WorkerLoad, build_router
from scheduler_service.workloads import load_trace
from sluice.contract.sampling import SamplingParams
from sluice_bench.options import benchmark_parser
from sluice_bench.report import print_table

BLOCK = 16


def requests(n: int) -> list[Request]:
    wl = load_trace("sharegpt", num_requests=n)
    reps = -(-n // len(wl))
    rows = (wl.requests * reps)[:n]
    return [
        Request(
            f"r{i}",
            arrival_time=0.0,
            num_prompt_tokens=min(r.prompt_tokens, 1024),
            sampling=SamplingParams(max_tokens=1024),
            predicted_output_tokens=min(r.output_tokens, 1024),
        )
        for i, r in enumerate(rows)
    ]


def worker_loads(num_workers: int, num_blocks: int, rng: np.random.Generator) -> list[WorkerLoad]:
    return [
        WorkerLoad(
            w, True, int(rng.integers(0, 50)), int(rng.integers(0, 200)), int(rng.integers(0, num_blocks)), num_blocks
        )
        for w in range(num_workers)
    ]


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--pending", type=int, default=10_000)
    parser.add_argument("--dp-requests", type=int, default=2_000)
    args = parser.parse_args()
    cm = build_cost_model("profile", "llama-2-13b", "a100-80g")
    num_blocks = cm.num_kv_blocks(BLOCK)
    ctx = RouterContext(BLOCK, num_blocks, 2048, 256, cm)
    rng = np.random.default_rng(0)
    loads = worker_loads(args.workers, num_blocks, rng)
    reqs = requests(args.pending)
    print(f"{args.workers} workers, {args.pending} pending requests, {num_blocks} KV blocks per worker\n")
    rows = []
    for name in ("round_robin", "least_work", "max_min", "kv_aware"):
        router = build_router(name, ctx)
        t0 = time.perf_counter()
        for r in reqs:
            router.select(r, loads, 0.0)
        dt = time.perf_counter() - t0
        rows.append({"router": name, "total ms": dt * 1e3, "us per decision": dt / len(reqs) * 1e6})
    router = build_router("scls", ctx)
    for r in reqs:
        router.select(r, loads, 0.0)
        router.held.append(r)
    t0 = time.perf_counter()
    placed = router.release(loads, router.next_release(0.0) or 0.0)
    dt = time.perf_counter() - t0
    scls = "scls (one release of the pool: DP + max-min)"
    rows.append({"router": scls, "total ms": dt * 1e3, "us per decision": dt / len(placed) * 1e6})
    print_table(rows, formats={"total ms": "{:.1f}", "us per decision": "{:.2f}"})
    est = ServingTimeEstimator.fit_from_cost_model(cm)
    mem = MemoryEstimator(num_blocks * BLOCK, BLOCK)
    lengths = [r.num_tokens for r in reqs[: args.dp_requests]]
    t0 = time.perf_counter()
    batches = dp_batches(lengths, 128, est, mem, 256)
    dt = time.perf_counter() - t0
    print(
        f"\nDP batcher, {len(lengths)} requests: {dt * 1e3:.1f} ms, {len(batches)} batches, "
        f"mean {len(lengths) / len(batches):.1f} rows (group sizes capped by memory and 256 rows)"
    )


if __name__ == "__main__":
    main()
