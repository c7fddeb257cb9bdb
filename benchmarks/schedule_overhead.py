"""`schedule()` overhead of every policy with 256 running and 10,000 waiting requests, and
each policy's ratio to vllm's measured in the same run (targets: mean within 3x of vllm's,
p99 within 5x); with `--sizes` also at larger shapes, and how each policy's mean grows from
the first shape to the last (sub-linear in the queue: the growth stays below the queue's).

The queue holds the first sharegpt prompts (capped at 2,000 tokens; the trace is repeated
past its 30,731 requests) with the AccelGen SLO profile and oracle output lengths, so deadline
indexes, length-ordered queues and EWT estimates are all exercised; nobody finishes during
the measurement (max_tokens 6,000, no EOS), so every measured step sees the full queue. The
pool fits the running requests even when each reserves prompt + max_tokens (orca, sls),
never the whole queue. Policies are measured in turn; `--rounds` repeats the whole sequence
(vllm included) and reports the median of each policy's per-round ratio. With `--interleave`
every policy is filled first and their steps then alternate (step k of each, vllm's among
them, one after another), so a busy minute of a shared machine lands on all of them alike.

The garbage collector runs once between the fill and the measured steps. Filling leaves
tens of thousands of young objects whose count decides when the next full collection comes:
without it, one 25-35 ms collection of the whole heap (10,000 queued requests) fell inside
FastServe's 300 measured steps in some runs and not in others, and alone moved its mean by
0.1 ms (0.8x of vllm's). Collections that the measured steps' own allocations set off still
count.

Each shape's state is reached by the policy itself: every request arrives at time 0 through
`add_request`, and steps (`schedule()`, then an answer sampling one token per finished
prompt) run until the running set holds the shape's count, admission stalls, or the running
set has not grown for 500 steps (a policy whose own rules keep its batch smaller: Sarathi,
pricing its steps against the tightest TBT SLO of 100,000 queued requests, runs about 100).
Options written for 256 running follow the shape: batch sizes become the running count and a
token budget keeps its tokens per running request (Sarathi's 512 is 2,000 at 1,000 running).
Filling 1,000 running takes 1 to 1,000 steps per policy, about two minutes for all of them
(AccelGen's 900 steps at 1,000 running are most of it).

    python benchmarks/schedule_overhead.py --steps 300
    python benchmarks/schedule_overhead.py --steps 100 --sizes 256:10000,1000:10000,1000:100000
    python benchmarks/schedule_overhead.py --policy vllm --policy accelgen:batch=false
    python benchmarks/schedule_overhead.py --steps 200 --clock cpu --rounds 3 --interleave
    python benchmarks/schedule_overhead.py --steps 600 --window 100 --clock cpu
    python benchmarks/schedule_overhead.py --steps 300 --clock cpu --rounds 3 --adjacent

With `--adjacent` the policies are measured in turn, each right after 300 (`--steps`) more
steps of one vllm scheduler kept for the round, and its ratio is to those: a shared machine's
slow spells last seconds (every policy measured in one ran 1.7-2x slower, vllm's steps
included when they fell in it), so a ratio to a vllm measured a second earlier reads the same
machine, where the plain in-turn ratio compares rounds' ends with their starts.

With `--window N` each policy's mean is also reported per window of N steps (median over the
rounds), to show whether a policy's cost stops growing with the run's length: the state
moves as the queue drains into the running and paused sets (FastServe's paused jobs grow by
a dozen a step, AccelGen's requests leave the urgent path after about 100 steps, ALISE's
waiting jobs age together every 250 steps or so).
"""

from __future__ import annotations

import gc
import itertools
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from scheduler_service import policies  # noqa: F401
from scheduler_service.cluster import ClusterSpec, WorkerSpec, build_cluster
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.costmodel.base import CostModel
from scheduler_service.costmodel.factory import build_cost_model
from scheduler_service.sim.slo_profiles import apply_slo_profile
from scheduler_service.workloads import TraceRequest, load_trace
from scheduler_service.workloads.base import Workload
from sluice.contract.plan import StepResult
from sluice.contract.sampling import SamplingParams
from sluice_bench.options import benchmark_parser
from sluice_bench.report import format_table, write_json

POLICIES = [
    "vllm_chunked",
    "sarathi:budget=512",
    "orca:max_batch_size=256",
    "sls:batch_size=256",
    "accelgen",
    "econoserve",
    "alise",
    "fastserve",
    "scls:batch_size=256",
]
BASELINE = "vllm"
RUNNING = 256
BLOCK_SIZE = 16
BLOCKS_PER_RUNNING = 520
STEP_S = 0.02


def build(policy: str, requests: list[TraceRequest], cost_model: CostModel, running: int = RUNNING) -> Scheduler:
    spec = ClusterSpec(
        policy=_sized(policy, running),
        workers=(WorkerSpec(running * BLOCKS_PER_RUNNING, 4096, BLOCK_SIZE),),
        cost_model=cost_model,
        max_model_len=8192,
        max_num_seqs=running,
        max_num_batched_tokens=8192,
        max_waiting=len(requests) + 1,
        overlap=False,  # the scheduler stepped on its own, one step after the last
    )
    sched = build_cluster(spec).schedulers[0]
    for i, tr in enumerate(requests):
        request = Request(
            f"r{i}",
            arrival_time=0.0,
            num_prompt_tokens=min(tr.prompt_tokens, 2000),
            sampling=SamplingParams(max_tokens=6000),
            slo=tr.slo,
            predicted_output_tokens=tr.output_tokens,
        )
        sched.add_request(request, 0.0)
    return sched


CLOCK = time.perf_counter  # --clock cpu: time.thread_time, the CPU time of this thread


def advance(sched: Scheduler, now: float) -> tuple[float, int]:
    t0 = CLOCK()
    plan = sched.schedule(now)
    elapsed = CLOCK() - t0
    sched.on_step_result(StepResult(plan.step_id, dict.fromkeys(plan.sample_ids, 1), total_s=STEP_S), now + STEP_S)
    return elapsed, len(plan.num_scheduled_tokens)


SEAT_OPTIONS = ("max_batch_size", "batch_size")  # seats: written as 256, set to the shape's running
PER_SEAT_OPTIONS = ("budget",)  # tokens per step: scaled with the running (Sarathi's 512 -> 2,000 at 1,000)


def _sized(policy: str, running: int) -> str:
    """Options written for 256 running follow the shape: batch sizes (orca, sls, scls) become
    the running count, a token budget (sarathi) keeps its tokens per running request."""
    if running == RUNNING or ":" not in policy:
        return policy
    name, _, rest = policy.partition(":")
    items = []
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        if key in SEAT_OPTIONS and value == str(RUNNING):
            value = str(running)
        elif key in PER_SEAT_OPTIONS and value.isdigit():
            value = str(int(value) * running // RUNNING)
        items.append(f"{key}{eq}{value}")
    return f"{name}:{','.join(items)}"


# NOTE: a policy whose own rules hold its batch below the shape (Sarathi pricing its steps
# against the tightest TBT SLO of 100,000 queued requests runs about 120) would step until its
# requests reach max_tokens: the fill ends once the running set has not grown for this many steps.
MAX_STEPS_WITHOUT_GROWTH = 500


def fill(sched: Scheduler, running: int = RUNNING) -> float:
    """Steps until `running` requests run (or admission stalls); returns the virtual time."""
    now, idle, most, since = 0.0, 0, 0, 0
    while len(sched.running) < running and sched.waiting and idle < 50 and since < MAX_STEPS_WITHOUT_GROWTH:
        before = len(sched.running)
        _, scheduled = advance(sched, now)
        now += STEP_S
        idle = idle + 1 if len(sched.running) == before and not scheduled else 0
        if len(sched.running) > most:
            most, since = len(sched.running), 0
        else:
            since += 1
    return now


def _summary(times: list[float], sched: Scheduler, window: int) -> dict[str, Any]:
    a = np.array(times) * 1e3
    out: dict[str, Any] = {
        "mean": float(a.mean()),
        "p50": float(np.percentile(a, 50)),
        "p99": float(np.percentile(a, 99)),
        "max": float(a.max()),  # NOTE: in the JSON only: one step's spike (ALISE's aging wave)
        "running": len(sched.running),
        "paused": len(sched.kept) + len(sched.swapped),
        "waiting": len(sched.waiting),
    }
    if window:
        out["windows"] = [float(a[i : i + window].mean()) for i in range(0, len(a), window)]
    return out


def measure(
    policy: str,
    steps: int,
    requests: list[TraceRequest],
    cost_model: CostModel,
    running: int = RUNNING,
    window: int = 0,
) -> dict[str, Any]:
    sched = build(policy, requests, cost_model, running)
    now = fill(sched, running)
    return measure_steps(sched, now, steps, window)


def measure_steps(sched: Scheduler, now: float, steps: int, window: int = 0) -> dict[str, Any]:
    """`steps` more steps of a filled scheduler from virtual time `now`, timed."""
    gc.collect()  # NOTE: every window starts from a collected heap (see the module's docstring)
    times = []
    for k in range(steps):
        elapsed, _ = advance(sched, now + k * STEP_S)
        times.append(elapsed)
    return _summary(times, sched, window)


def measure_adjacent(
    specs: list[str], steps: int, requests: list[TraceRequest], cost_model: CostModel, running: int, window: int
) -> dict[str, dict[str, Any]]:
    """Every policy in turn, each right after `steps` more steps of one vllm scheduler kept for
    the round: its ratio is against those (`vllm_adjacent`), measured a second before it."""
    base = build(BASELINE, requests, cost_model, running)
    now = fill(base, running)
    out: dict[str, dict[str, Any]] = {}
    for policy in specs:
        adjacent = measure_steps(base, now, steps)
        now += steps * STEP_S
        if policy == BASELINE:
            out[policy] = measure_steps(base, now, steps, window)
            now += steps * STEP_S
        else:
            out[policy] = measure(policy, steps, requests, cost_model, running, window)
        out[policy]["vllm_adjacent"] = {"mean": adjacent["mean"], "p99": adjacent["p99"]}
    return out


def measure_interleaved(
    specs: list[str],
    steps: int,
    requests: list[TraceRequest],
    cost_model: CostModel,
    running: int = RUNNING,
    window: int = 0,
) -> dict[str, dict[str, Any]]:
    """`measure` of every policy, their steps alternating: step k of each in turn."""
    scheds = {p: build(p, requests, cost_model, running) for p in specs}
    starts = {p: fill(sched, running) for p, sched in scheds.items()}
    gc.collect()
    times: dict[str, list[float]] = {p: [] for p in specs}
    for k in range(steps):
        for p, sched in scheds.items():
            times[p].append(advance(sched, starts[p] + k * STEP_S)[0])
    return {p: _summary(times[p], sched, window) for p, sched in scheds.items()}


def workload_of(size: int, cost_model: CostModel) -> list[TraceRequest]:
    trace = load_trace("sharegpt", num_requests=min(size, 30_731)).requests
    requests = [trace[i % len(trace)] for i in range(size)]
    return apply_slo_profile("accelgen", Workload("sharegpt", requests, {}), cost_model, seed=0).requests


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--policy", action="append", help="policy spec; repeat (default: every policy)")
    parser.add_argument("--sizes", default="256:10000", help="running:waiting shapes, comma-separated")
    parser.add_argument("--rounds", type=int, default=1, help="repeat every policy and vllm; median ratio")
    parser.add_argument(
        "--interleave", action="store_true", help="fill every policy, then alternate their steps (shared machines)"
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall time per call, or the thread's CPU time (steadier on a shared machine)",
    )
    parser.add_argument(
        "--adjacent",
        action="store_true",
        help="in turn, each policy against vllm's steps measured just before it (one vllm kept for the round)",
    )
    parser.add_argument(
        "--window", type=int, default=0, help="also report each policy's mean per window of this many steps"
    )
    parser.add_argument("--json", type=Path, help="write every shape's rows, the growth and the run's settings here")
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.thread_time if args.clock == "cpu" else time.perf_counter
    cost_model = build_cost_model("analytic", "llama-2-7b", "a100-80g")
    specs = [BASELINE] + [p for p in (args.policy or POLICIES) if p != BASELINE]
    sizes = [tuple(int(x) for x in s.split(":")) for s in args.sizes.split(",")]
    means: dict[tuple[str, int, int], float] = {}
    record: dict[str, Any] = {
        "config": {
            "steps": args.steps,
            "rounds": args.rounds,
            "interleave": args.interleave,
            "clock": args.clock,
            "sizes": args.sizes,
            "policies": specs,
            "load_average_at_start": os.getloadavg(),
        },
        "shapes": {},
    }
    for running, waiting in sizes:
        requests = workload_of(running + waiting, cost_model)
        results: dict[str, list[dict[str, float]]] = {p: [] for p in specs}
        with tqdm(total=args.rounds * len(specs), desc=f"{running}:{waiting}", leave=False) as bar:
            for _ in range(args.rounds):
                if args.interleave or args.adjacent:
                    if args.interleave:
                        measured = measure_interleaved(specs, args.steps, requests, cost_model, running, args.window)
                    else:
                        measured = measure_adjacent(specs, args.steps, requests, cost_model, running, args.window)
                    for policy, r in measured.items():
                        results[policy].append(r)
                    bar.update(len(specs))
                    continue
                for policy in specs:
                    results[policy].append(measure(policy, args.steps, requests, cost_model, running, args.window))
                    bar.update(1)
        tqdm.write(
            f"\n{running} running, {waiting} waiting, {args.steps} steps, {args.rounds} round(s), {args.clock} time"
            + (", steps interleaved" if args.interleave else "")
            + (", each against vllm's steps just before it" if args.adjacent else "")
        )
        rows = []
        for policy in specs:
            rs = results[policy]
            # NOTE: with --adjacent, against the vllm steps measured just before the policy's
            bases = [r.get("vllm_adjacent", b) for r, b in zip(rs, results[BASELINE], strict=True)]
            mean_ratio = statistics.median(r["mean"] / b["mean"] for r, b in zip(rs, bases, strict=True))
            p99_ratio = statistics.median(r["p99"] / b["p99"] for r, b in zip(rs, bases, strict=True))
            mean = statistics.median(r["mean"] for r in rs)
            means[(policy, running, waiting)] = mean
            last = rs[-1]
            rows.append(
                {
                    "policy": policy,
                    "mean ms": mean,
                    "p50 ms": statistics.median(r["p50"] for r in rs),
                    "p99 ms": statistics.median(r["p99"] for r in rs),
                    "mean/vllm": mean_ratio,
                    "p99/vllm": p99_ratio,
                    "running": last["running"],
                    "paused": last["paused"],
                    "waiting": last["waiting"],
                }
            )
        ms, ratio = "{:.3f}", "{:.2f}x"
        formats = {"mean ms": ms, "p50 ms": ms, "p99 ms": ms, "mean/vllm": ratio, "p99/vllm": ratio}
        tqdm.write(format_table(rows, formats=formats))
        if args.window:
            tqdm.write(
                f"\nmean ms per window of {args.window} steps (median over the rounds), and the last window / vllm's"
            )
            windows = []
            for policy in specs:
                per = [statistics.median(w) for w in zip(*(r["windows"] for r in results[policy]), strict=True)]
                base = [statistics.median(w) for w in zip(*(r["windows"] for r in results[BASELINE]), strict=True)]
                row: dict[str, Any] = {"policy": policy}
                row.update({f"{i * args.window}-": v for i, v in enumerate(per)})
                row["last/vllm"] = per[-1] / base[-1]
                windows.append(row)
            tqdm.write(
                format_table(
                    windows, formats={k: (ratio if k == "last/vllm" else ms) for k in windows[0] if k != "policy"}
                )
            )
        record["shapes"][f"{running}:{waiting}"] = {
            "rows": rows,
            "per_round": {p: results[p] for p in specs},
            "specs": {p: _sized(p, running) for p in specs},
        }
    if len(sizes) > 1:
        # NOTE: each shape against the one before it (with 1000:10000 between, the queue's
        # growth apart from the batch's), and the last against the first. The verdict reads the
        # pairs whose running count is the same (the queue's growth alone) when there are any.
        pairs = list(itertools.pairwise(sizes))
        if len(sizes) > 2:
            pairs.append((sizes[0], sizes[-1]))
        judged = [pair for pair in pairs if pair[0][0] == pair[1][0] and pair[1][1] > pair[0][1]] or [pairs[-1]]
        tqdm.write("\ngrowth of the mean between shapes (sub-linear: below the queue's growth)")
        rows = []
        for policy in specs:
            row: dict[str, Any] = {"policy": policy}
            linear = False
            for pair in pairs:
                (r0, w0), (r1, w1) = pair
                growth = means[(policy, r1, w1)] / means[(policy, r0, w0)]
                row[f"{r0}:{w0} -> {r1}:{w1} (queue x{w1 / w0:.0f}, running x{r1 / r0:.1f})"] = growth
                linear = linear or (pair in judged and growth >= w1 / w0)
            row["verdict"] = "NOT sub-linear" if linear else "sub-linear"
            rows.append(row)
        growth_format = "x{:.2f}"
        tqdm.write(format_table(rows, formats={k: growth_format for k in rows[0] if "->" in k}))
        record["growth"] = rows
    if args.json:
        record["config"]["load_average_at_end"] = os.getloadavg()
        write_json(record, args.json, indent=1)


if __name__ == "__main__":
    main()
