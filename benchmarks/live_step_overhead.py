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

Overlapped scheduling, side by side (`--modes`, after the table above): the same decode
steps driven as the live loop drives them, with overlap off (plan, send, wait, apply) and on
(plan N+1 and send it before reading answer N, live/pipeline.py), against an echo worker whose
step takes `--step-ms` of device time (20 ms), awaited off the worker's CPU as a GPU's kernels
run (`--echo-async-device`), with its engine pipeline on and off side by side (`--worker-pipelines`:
worker_service/step_pipeline.py launches step N+1 before collecting N, so the worker's own
per-step work runs while the device computes), and with `--zero-ms` against echo workers with
no device time (a step's period is then the system's overhead itself):

    visible overhead = step period (answer to answer, steady decode) - the emulated device step
    beyond the worker = step period - the worker's own time for the step (StepResult.total_s)
    decode throughput = sequences / step period

The target is a visible overhead of at most 1% of a 20 ms step at 256 sequences with overlap
on, and a decode throughput with overlap at least as high as without. `--model-worker` adds
the torch CPU model (tiny-llama, dummy weights) at `--model-seqs` sequences (with the same
`--worker-pipelines`: on a CPU the pipeline has no device to hide work behind, so `on` there
measures what its bookkeeping costs; `auto` leaves it off). With the worker pipeline on, a step's
time on the worker counts from when it could start (received, and the step before collected) to
its collection, so "period - worker's step" is what passes between two steps beyond the worker.

    python benchmarks/live_step_overhead.py --modes-only [--mode-sizes 64,256] [--step-ms 20] [--rounds 3]
        [--worker-pipelines on,off] [--zero-ms] [--model-worker] [--policies vllm,fastserve,...]

`--policies` runs the overlap comparison for each policy spec given (`name:key=value,...`; the
vllm policy by default), interleaved; a policy that is not overlap-safe runs one step at a
time with overlap on too, as the live loop drives it. The steady state measured is every
request decoding, so a policy that batches rows needs room for all of them (e.g.
`sls:batch_size=256`, `orca:max_batch_size=256`, `scls:batch_size=256`).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from scheduler_service import policies  # noqa: F401  (registers the policies)
from scheduler_service.cluster import Cluster, ClusterSpec, WorkerSpec, build_cluster
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.costmodel.factory import build_cost_model
from scheduler_service.live.remote import RemoteWorker, WarmupOptions
from sluice.contract.plan_codec import plan_to_proto
from sluice.contract.sampling import SamplingParams
from sluice.v1 import worker_pb2
from sluice_bench.live import spawn_worker
from sluice_bench.options import benchmark_parser
from sluice_bench.report import format_table

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
    return make_cluster(n).schedulers[0]


def make_cluster(n: int, overlap: bool = False, prompt_len: int = PROMPT_LEN, policy: str = "vllm") -> Cluster:
    spec = ClusterSpec(
        policy=policy,
        workers=(WorkerSpec(NUM_GPU_BLOCKS, 0, BLOCK_SIZE),),
        cost_model=build_cost_model("analytic", "llama-2-7b", "a100-80g"),
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=max(n, 1),
        max_num_batched_tokens=max(2048, n * prompt_len),
        overlap=overlap,
    )
    return build_cluster(spec)


def add_requests(sched: Scheduler, n: int, max_tokens: int, prompt_len: int = PROMPT_LEN) -> None:
    for i in range(n):
        prompt = [1000 + (i * 37 + j) % 1000 for j in range(prompt_len)]
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


MS = "{:.3f}"


def size_table(results: list[SizeResult]) -> str:
    rows = [
        {
            "running seqs": r.n,
            "build ms": r.build_ms,
            "encode ms (in rpc)": r.encode_ms,
            "rpc ms": r.rpc_ms,
            "worker ms (in rpc)": r.worker_ms,
            "apply ms": r.apply_ms,
            "total ms": r.total_ms,
            "share of 20 ms": r.share,
            "plan bytes": r.plan_bytes,
            "whole-request bytes": r.whole_bytes,
        }
        for r in results
    ]
    formats = {k: MS for k in rows[0] if k.endswith("ms") or "ms (" in k} if rows else {}
    formats |= {"share of 20 ms": "{:.1%}", "plan bytes": "{:.0f}", "whole-request bytes": "{:.0f}"}
    return format_table(rows, formats=formats)


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


# ---------------------------------------------------------------- overlap on and off


@dataclass
class ModeResult:
    worker: str  # which worker answered: "echo 20 ms", "echo 0 ms", "tiny-llama CPU"
    n: int
    overlap: bool
    period_ms: float  # answer to answer, steady decode
    device_ms: float  # the emulated device step (echo); 0 for the model worker
    gap_ms: float  # period - the step's time on the worker (from taking the plan to answering)
    mean_period_ms: float = 0.0  # the mean over the steps: steps per second, whatever the jitter

    @property
    def visible_ms(self) -> float:
        return self.period_ms - self.device_ms

    @property
    def share(self) -> float:
        return self.visible_ms / 1e3 / GPU_STEP_S

    @property
    def tok_s(self) -> float:
        return self.n / ((self.mean_period_ms or self.period_ms) / 1e3)


async def measure_mode(
    address: str, n: int, steps: int, warmup: int, overlap: bool, prompt_len: int = PROMPT_LEN, policy: str = "vllm"
) -> tuple[float, float, float]:
    """Median step period (s) over `steps` steady decode steps, driven as the live loop drives
    them (with overlap, up to two plans on the stream: StepPipeline's turn; else one), the
    median of period - the worker's own time for the step (its StepResult.total_s), and the
    mean period."""
    remote = RemoteWorker(0, address, step_timeout_s=60.0)
    await remote.connect(WarmupOptions(num_gpu_blocks=NUM_GPU_BLOCKS, swap_space_gib=0.0), 60.0)
    cluster = make_cluster(n, overlap, prompt_len, policy)
    sched = cluster.schedulers[0]
    assert cluster.overlaps(0) == overlap or policy != "vllm"
    # NOTE: a policy with a prefill budget (chunks) prefills the last request up to n * prompt_len
    # / budget steps after the first: the first must still be decoding then
    slack = 0 if policy == "vllm" else n * prompt_len // 64
    add_requests(sched, n, max_tokens=warmup + steps + 8 + slack, prompt_len=prompt_len)
    depth = 2 if cluster.overlaps(0) else 1  # a policy that is not overlap-safe: one at a time
    sent: list[bool] = []  # per plan on the stream: a steady decode step
    periods: list[float] = []
    gaps: list[float] = []
    last = 0.0
    steady = 0
    try:
        while steady < warmup + steps:
            if len(sent) < depth and cluster.has_work(0):
                plan = cluster.plan_step(0, time.monotonic())
                if plan is not None:
                    await remote.send(plan)
                    decode = len(plan.num_scheduled_tokens) == n and plan.total_num_scheduled_tokens == n
                    sent.append(decode and not plan.new_requests)
                    if len(sent) < depth:
                        continue  # the worker was idle: plan ahead before waiting
            if not sent:
                raise RuntimeError(f"{policy}: the requests ended before {steps} steady decode steps of all {n}")
            result = await remote.receive()
            assert result.error is None, result.error
            cluster.complete_step(0, result, time.monotonic())
            done = time.perf_counter()
            if sent.pop(0):
                steady += 1
                if steady > warmup:
                    periods.append(done - last)
                    gaps.append(done - last - result.total_s)
            last = done
        while sent:  # drain what is still on the stream
            cluster.complete_step(0, await remote.receive(), time.monotonic())
            sent.pop(0)
    finally:
        await remote.end_lease()
        await remote.close()
    return statistics.median(periods), statistics.median(gaps), statistics.fmean(periods)


async def modes_async(args: argparse.Namespace) -> list[ModeResult]:
    from tqdm import tqdm

    sizes = [int(s) for s in args.mode_sizes.split(",") if s]  # none: the model worker only
    pipelines = [p.strip() for p in args.worker_pipelines.split(",")]
    # (label, engine, device step ms, sizes, prompt length, worker flags)
    workers: list[tuple[str, str, float, list[int], int, tuple[str, ...]]] = []
    for pipeline in pipelines if sizes else ():
        flags = ("--worker-pipeline", pipeline)
        echo = ("--echo-step-ms", str(args.step_ms), "--echo-async-device", *flags)
        workers.append(
            (f"echo {args.step_ms:g} ms, worker pipeline {pipeline}", "echo", args.step_ms, sizes, PROMPT_LEN, echo)
        )
        if args.step_ms and args.zero_ms:
            zero = ("--echo-step-ms", "0", "--echo-async-device", *flags)
            workers.append((f"echo 0 ms, worker pipeline {pipeline}", "echo", 0.0, sizes, PROMPT_LEN, zero))
    if args.model_worker:
        for pipeline in pipelines:
            flags = ("--worker-pipeline", pipeline)
            workers.append((f"tiny-llama CPU, worker pipeline {pipeline}", "torch", 0.0, [args.model_seqs], 16, flags))
    specs = [p.strip() for p in args.policies.split(";" if ";" in args.policies else ",") if p.strip()]
    jobs = [(w, n, o, p) for w in workers for n in w[3] for p in specs for o in (False, True)]
    periods: dict[tuple[str, int, bool], list[tuple[float, float, float]]] = {}
    # NOTE: every worker runs from the start and the rounds go over all of them in turn
    # (interleaved): this machine's speed drifts from minute to minute.
    spawned = {w[0]: spawn_worker(engine=w[1], extra=w[5], worker_id=i) for i, w in enumerate(workers)}
    try:
        with tqdm(total=args.rounds * len(jobs), desc="overlap on/off", unit="run", leave=False) as bar:
            for _ in range(args.rounds):
                for (label, engine, _, _, prompt_len, _), n, overlap, policy in jobs:
                    steps = args.steps if engine == "echo" else max(20, args.steps // 4)
                    address = spawned[label].address
                    measured = await measure_mode(address, n, steps, args.warmup, overlap, prompt_len, policy)
                    row = label if specs == ["vllm"] else f"{label}, {policy}"
                    periods.setdefault((row, n, overlap), []).append(measured)
                    bar.update()
    finally:
        for worker in spawned.values():
            worker.stop()
    out = []
    for (label, n, overlap), values in periods.items():
        device = next(w[2] for w in workers if label.startswith(w[0]))
        period = statistics.median(v[0] for v in values) * 1e3
        gap = statistics.median(v[1] for v in values) * 1e3
        mean = statistics.median(v[2] for v in values) * 1e3
        out.append(ModeResult(label, n, overlap, period, device, gap, mean))
    return out


def format_modes(results: list[ModeResult]) -> str:
    rows = [
        {
            "worker": r.worker,
            "running seqs": r.n,
            "overlap": "on" if r.overlap else "off",
            "step period ms": r.period_ms,
            "visible overhead ms": r.visible_ms,
            "share of 20 ms": r.share,
            "mean period ms": r.mean_period_ms,
            "visible (mean) ms": r.mean_period_ms - r.device_ms,
            "period - worker's step ms": r.gap_ms,
            "decode tok/s": r.tok_s,
        }
        for r in results
    ]
    formats = {k: MS for k in rows[0] if k.endswith(" ms")} if rows else {}
    formats |= {"share of 20 ms": "{:.2%}", "decode tok/s": "{:,.0f}"}
    return format_table(rows, formats=formats)


def modes_summary(results: list[ModeResult]) -> str:
    by = {(r.worker, r.n, r.overlap): r for r in results}
    lines = []
    for (worker, n, overlap), on in by.items():
        if not overlap:
            continue
        off = by[(worker, n, False)]
        before, after = off.mean_period_ms - off.device_ms, on.mean_period_ms - on.device_ms
        lines.append(
            f"{worker}, {n} seqs: visible overhead {off.visible_ms:.3f} -> {on.visible_ms:.3f} ms "
            f"({off.share:.2%} -> {on.share:.2%} of 20 ms; from the mean period {before:.3f} -> {after:.3f} ms, "
            f"{before / 1e3 / GPU_STEP_S:.2%} -> {after / 1e3 / GPU_STEP_S:.2%}), beyond the worker's own step "
            f"{off.gap_ms:.3f} -> {on.gap_ms:.3f} ms; throughput x{on.tok_s / off.tok_s:.2f} with overlap"
        )
    return "\n".join(lines)


def main() -> int:
    p = benchmark_parser(__doc__)
    p.add_argument("--sizes", default="1,4,16,64,128,256")
    p.add_argument("--steps", type=int, default=100, help="measured decode steps per size")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3, help="measure every size this many times, interleaved")
    p.add_argument("--markdown", help="also write the table here")
    p.add_argument("--modes", action="store_true", help="also measure overlap on and off side by side")
    p.add_argument("--modes-only", action="store_true", help="only the overlap on/off comparison")
    p.add_argument("--mode-sizes", default="64,256", help="running sequences for --modes")
    p.add_argument("--step-ms", type=float, default=20.0, help="the echo worker's emulated device step for --modes")
    p.add_argument("--model-worker", action="store_true", help="--modes also with the torch CPU model (tiny-llama)")
    p.add_argument("--model-seqs", type=int, default=32, help="sequences for --model-worker")
    p.add_argument(
        "--worker-pipelines", default="on,off", help="the echo workers' --worker-pipeline settings, side by side"
    )
    p.add_argument("--zero-ms", action="store_true", help="--modes also against echo workers with no device time")
    p.add_argument(
        "--policies",
        default="vllm",
        help="policy specs for --modes, measured in turn (separated by ';' where one has options, else ',')",
    )
    args = p.parse_args()
    if args.modes or args.modes_only:
        modes = asyncio.run(modes_async(args))
        text = format_modes(modes) + "\n\n" + modes_summary(modes)
        print(text)
        if args.markdown:
            Path(args.markdown).with_suffix(".modes.md").write_text(text + "\n")
        if args.modes_only:
            return 0
    sizes = [int(s) for s in args.sizes.split(",")]
    results = asyncio.run(main_async(sizes, args.steps, args.warmup, args.rounds))
    table = size_table(results)
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
