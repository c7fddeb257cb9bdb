"""Scheduler-to-worker overhead per step, as a share of a 20 ms GPU-like step.

    n requests (64-token prompts) -> Scheduler (vllm policy) over the real KV accounting
    each step:  build   Scheduler.schedule(now)                        -> StepPlan
                rpc     RemoteWorker.execute: plan_to_proto, write on the Execute stream,
                        worker process decodes + checks + answers (echo engine: no model),
                        read, result_from_proto
                apply   Scheduler.on_step_result(result, now)
    measured over `--steps` decode steps with all n requests running (after prefill), for
    n = 1 .. 256; the worker is a separate process (`sluice worker --engine echo`).

The target is at most 5% of a 20 ms step at 256 sequences. The step message carries diffs:
known requests by id, new block ids only when a table grows, and in the steady decode state
not even the ids (`same_scheduled_ids`; the worker answers tokens in step order). The table
prints its size next to what re-sending every request whole (all token ids and the block
table) would cost.

`--rounds R` measures every size R times, interleaved, and reports the median over the
rounds' medians: this machine's speed drifts by tens of percent from minute to minute, and
interleaving keeps one slow minute from landing on one size.

    python benchmarks/live_step_overhead.py [--sizes 1,4,16,64,128,256] [--steps 100] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from live_common import spawn_worker

from scheduler_service import policies  # noqa: F401  (registers the policies)
from scheduler_service.cluster import ClusterSpec, WorkerSpec, build_cluster
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.costmodel.factory import build_cost_model
from scheduler_service.live.remote import RemoteWorker, WarmupOptions
from sluice.contract.plan_codec import plan_to_proto
from sluice.contract.sampling import SamplingParams
from sluice.v1 import worker_pb2

GPU_STEP_S = 0.020
TARGET_SHARE = 0.05
PROMPT_LEN = 64
BLOCK_SIZE = 16
NUM_GPU_BLOCKS = 8192
MAX_MODEL_LEN = 2048


@dataclass
class SizeResult:
    n: int
    build_ms: float
    encode_ms: float
    rpc_ms: float
    worker_ms: float
    apply_ms: float
    total_ms: float
    plan_bytes: float
    whole_bytes: float

    @property
    def share(self) -> float:
        return self.total_ms / 1e3 / GPU_STEP_S


def make_scheduler(n: int) -> Scheduler:
    spec = ClusterSpec(
        policy="vllm",
        workers=(WorkerSpec(NUM_GPU_BLOCKS, 0, BLOCK_SIZE),),
        cost_model=build_cost_model("analytic", "llama-2-7b", "a100-80g"),
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=max(n, 1),
        max_num_batched_tokens=max(2048, n * PROMPT_LEN),
    )
    return build_cluster(spec).schedulers[0]


def add_requests(sched: Scheduler, n: int, max_tokens: int) -> None:
    for i in range(n):
        prompt = [1000 + (i * 37 + j) % 1000 for j in range(PROMPT_LEN)]
        request = Request(
            f"r{i}",
            arrival_time=0.0,
            prompt_token_ids=prompt,
            sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        )
        assert sched.add_request(request, 0.0) is None


def whole_bytes(sched: Scheduler) -> int:
    """The step message if every running request were re-sent in full (ids and block table)."""
    msg = worker_pb2.ExecuteRequest(step_id=1)
    for request in sched.running.values():
        tokens = request.all_token_ids()
        num_blocks = -(-len(tokens) // BLOCK_SIZE)
        msg.new_requests.append(
            worker_pb2.NewRequest(
                request_id=request.request_id,
                prompt_token_ids=tokens,
                block_ids=range(
                    num_blocks * int(request.request_id[1:]), num_blocks * (int(request.request_id[1:]) + 1)
                ),
            )
        )
        msg.scheduled_ids.append(request.request_id)
        msg.num_scheduled_tokens.append(1)
        msg.sample.append(True)
    return msg.ByteSize()


async def measure(address: str, n: int, steps: int, warmup: int) -> SizeResult:
    remote = RemoteWorker(0, address, step_timeout_s=30.0)
    await remote.connect(WarmupOptions(num_gpu_blocks=NUM_GPU_BLOCKS, swap_space_gib=0.0), 60.0)
    sched = make_scheduler(n)
    add_requests(sched, n, max_tokens=warmup + steps + 8)
    rows: dict[str, list[float]] = {k: [] for k in ("build", "encode", "rpc", "worker", "apply", "total", "bytes")}
    step = 0
    whole = 0
    try:
        while step < warmup + steps:
            now = time.monotonic()
            t0 = time.perf_counter()
            plan = sched.schedule(now)
            t1 = time.perf_counter()
            result = await remote.execute(plan)
            t2 = time.perf_counter()
            sched.on_step_result(result, time.monotonic())
            t3 = time.perf_counter()
            assert result.error is None, result.error
            decoding = len(sched.running) == n and all(v == 1 for v in plan.num_scheduled_tokens.values())
            if not decoding:
                continue  # prefill steps are not the steady state measured here
            step += 1
            if step <= warmup:
                continue
            e0 = time.perf_counter()
            msg = plan_to_proto(plan, same_scheduled_ids=step > 1)  # as PlanSender sends a steady step
            encode = time.perf_counter() - e0
            rows["build"].append(t1 - t0)
            rows["encode"].append(encode)
            rows["rpc"].append(t2 - t1)
            rows["worker"].append(result.total_s)
            rows["apply"].append(t3 - t2)
            rows["total"].append(t3 - t0)
            rows["bytes"].append(msg.ByteSize())
            if not whole:
                whole = whole_bytes(sched)
    finally:
        await remote.end_lease()  # the next measurement dials the same worker with a new session
        await remote.close()
    med = {k: statistics.median(v) for k, v in rows.items()}
    return SizeResult(
        n,
        med["build"] * 1e3,
        med["encode"] * 1e3,
        med["rpc"] * 1e3,
        med["worker"] * 1e3,
        med["apply"] * 1e3,
        med["total"] * 1e3,
        med["bytes"],
        whole,
    )


def format_table(results: list[SizeResult]) -> str:
    head = (
        "| running seqs | build ms | encode ms (in rpc) | rpc ms | worker ms (in rpc) | apply ms | total ms "
        "| share of 20 ms | plan bytes | whole-request bytes |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in results:
        lines.append(
            f"| {r.n} | {r.build_ms:.3f} | {r.encode_ms:.3f} | {r.rpc_ms:.3f} | {r.worker_ms:.3f} | {r.apply_ms:.3f} "
            f"| {r.total_ms:.3f} | {r.share:.1%} | {r.plan_bytes:.0f} | {r.whole_bytes:.0f} |"
        )
    return "\n".join(lines)


def combine(rounds: list[SizeResult]) -> SizeResult:
    """Median of every column over the rounds of one size."""
    med = {f: statistics.median(getattr(r, f) for r in rounds) for f in SizeResult.__dataclass_fields__}
    return SizeResult(**{**med, "n": rounds[0].n})


async def main_async(sizes: list[int], steps: int, warmup: int, rounds: int) -> list[SizeResult]:
    from tqdm import tqdm

    worker = spawn_worker(engine="echo")
    by_size: dict[int, list[SizeResult]] = {n: [] for n in sizes}
    try:
        with tqdm(total=rounds * len(sizes), desc="step overhead", unit="size", leave=False) as bar:
            for _ in range(rounds):
                for n in sizes:
                    by_size[n].append(await measure(worker.address, n, steps, warmup))
                    bar.update()
    finally:
        worker.stop()
    return [combine(by_size[n]) for n in sizes]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,4,16,64,128,256")
    p.add_argument("--steps", type=int, default=100, help="measured decode steps per size")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3, help="measure every size this many times, interleaved")
    p.add_argument("--markdown", help="also write the table here")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    results = asyncio.run(main_async(sizes, args.steps, args.warmup, args.rounds))
    table = format_table(results)
    print(table)
    last = results[-1]
    verdict = "meets" if last.share <= TARGET_SHARE else "misses"
    smaller = last.whole_bytes / max(last.plan_bytes, 1)
    summary = (
        f"\nat {last.n} sequences (median of {args.rounds} rounds): {last.total_ms:.2f} ms "
        f"per step = {last.share:.1%} of a 20 ms step ({verdict} the {TARGET_SHARE:.0%} target); the plan is "
        f"{smaller:.0f}x smaller than re-sending whole requests"
    )
    print(summary)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n" + summary + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
