"""What the offline queue (scheduler_service/core/offline.py) costs the scheduler's CPU, side
by side in one run with the queue off (`max_offline_waiting` 0: offline requests go to the
workers' queues as online ones do, the code path before the queue).

One Cluster (`--policy`, vllm_chunked by default; 2 workers, 256 seats each), driven as the live loop drives it
(submit, plan_step, complete_step with one token per sampled request), with `--arrivals`
requests per step for `--steps` steps (64-token prompts, 32 output tokens):

    online     online requests only: the queue's checks on every submission and step
    backlog    --backlog offline requests submitted first, then the same online traffic: the
               queue places offline work into the room online requests leave (every step
               while the queue is not empty) and yields it back; off, the offline requests
               wait in the workers' queues and the policy walks them

per cell: the mean TTFT of the online requests that finished, and how many did (simulated time,
20 ms a step: what the queue is for); CPU seconds of the whole drive (time.thread_time) and per
step (medians over rounds); the ratio on/off of each round (on and off run next to each other, in alternating order) and
their median; `--rounds` repeats everything.

    python benchmarks/offline_queue_overhead.py [--steps 2000] [--arrivals 4] [--backlog 10000] [--rounds 5]
"""

from __future__ import annotations

import json
import statistics
import time

from scheduler_service.cluster import ClusterSpec, WorkerSpec, build_cluster
from scheduler_service.core.request import Request
from scheduler_service.core.slo import SLOClass, SLOSpec
from scheduler_service.costmodel.factory import build_cost_model
from sluice.contract.plan import StepResult
from sluice.contract.sampling import SamplingParams
from sluice_bench.options import benchmark_parser
from sluice_bench.report import write_json

ONLINE = SLOSpec(ttft_s=1.0, tbt_s=0.2, slo_class=SLOClass.ONLINE)
OFFLINE = SLOSpec(slo_class=SLOClass.OFFLINE)
STEP_S = 0.02


def drive(
    policy: str, max_offline_waiting: int, steps: int, arrivals: int, backlog: int
) -> tuple[float, int, float, int]:
    """CPU seconds of the whole drive, the requests that finished, the mean TTFT of the online
    ones that finished (simulated seconds, STEP_S a step), and how many of them finished."""
    spec = ClusterSpec(
        policy=policy,
        workers=(WorkerSpec(20_000, 1024, 16), WorkerSpec(20_000, 1024, 16)),
        cost_model=build_cost_model("analytic", "llama-2-7b", "a100-80g"),
        max_model_len=4096,
        max_num_seqs=256,
        max_waiting=1_000_000,
        max_offline_waiting=max_offline_waiting,
    )
    cluster = build_cluster(spec)
    sampling = SamplingParams(max_tokens=32, ignore_eos=True)

    def request(rid: str, slo: SLOSpec, now: float) -> Request:
        return Request(rid, arrival_time=now, num_prompt_tokens=64, sampling=sampling, slo=slo)

    start = time.thread_time()
    for i in range(backlog):
        cluster.submit(request(f"off{i}", OFFLINE, 0.0), 0.0)
    finished, online_ttft = 0, []
    for k in range(steps):
        now = k * STEP_S
        for j in range(arrivals):
            cluster.submit(request(f"on{k}-{j}", ONLINE, now), now)
        for w in cluster.schedulers:
            plan = cluster.plan_step(w, now)
            if plan is not None:
                result = StepResult(plan.step_id, dict.fromkeys(plan.sample_ids, 7), total_s=STEP_S)
                ended = cluster.complete_step(w, result, now + STEP_S).finished
                finished += len(ended)
                online_ttft += [r.first_token_time - r.arrival_time for r in ended if r.request_id.startswith("on")]
    seconds = time.thread_time() - start
    return seconds, finished, statistics.fmean(online_ttft) if online_ttft else 0.0, len(online_ttft)


def main() -> None:
    p = benchmark_parser(__doc__)
    p.add_argument("--policy", default="vllm_chunked")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--arrivals", type=int, default=4, help="online requests submitted per step")
    p.add_argument("--backlog", type=int, default=10_000, help="offline requests submitted first (backlog cells)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    cells = {"online": 0, "backlog": args.backlog}
    modes = {"on": 4096 if args.backlog <= 4096 else args.backlog, "off": 0}
    times: dict[str, list[float]] = {f"{c}/{m}": [] for c in cells for m in modes}
    done: dict[str, int] = {}
    ttft: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for cell, backlog in cells.items():
            order = list(modes.items()) if r % 2 == 0 else list(reversed(modes.items()))
            for mode, bound in order:
                seconds, finished, online_ttft, online_done = drive(
                    args.policy, bound, args.steps, args.arrivals, backlog
                )
                times[f"{cell}/{mode}"].append(seconds)
                done[f"{cell}/{mode}"] = finished
                ttft[f"{cell}/{mode}"] = [round(online_ttft, 3), online_done]
                print(f"round {r} {cell}/{mode}: {seconds:.3f} s CPU, {finished} finished ({online_done} online)")
    figures = {
        "policy": args.policy,
        "steps": args.steps,
        "arrivals_per_step": args.arrivals,
        "backlog": args.backlog,
        "cpu_s": {k: round(statistics.median(v), 3) for k, v in times.items()},
        "cpu_ms_per_step": {k: round(statistics.median(v) / args.steps * 1e3, 4) for k, v in times.items()},
        "finished": done,
        # what the CPU buys: [mean TTFT of the online requests that finished (simulated s), how many]
        "online_ttft_s_and_finished": ttft,
        # NOTE: each round's own ratio (its on and off ran next to each other), then the median
        "ratio_on_off": {
            c: round(statistics.median(a / b for a, b in zip(times[f"{c}/on"], times[f"{c}/off"], strict=True)), 3)
            for c in cells
        },
        "ratio_on_off_rounds": {
            c: [round(a / b, 3) for a, b in zip(times[f"{c}/on"], times[f"{c}/off"], strict=True)] for c in cells
        },
    }
    print(json.dumps(figures, indent=2))
    if args.json:
        write_json(figures, args.json, indent=2, quiet=True)


if __name__ == "__main__":
    main()
