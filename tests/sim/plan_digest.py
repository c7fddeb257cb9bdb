"""Digests of a simulation's full step-by-step decisions, for the plan-identity regression test.

Every plan a worker makes is reduced to what the policy decided: the scheduled requests with
their token counts in batch order, the requests it samples, the KV moves (swaps, lends), the
releases, and every transition the step caused (preemptions with their mode and reason,
returns to the router, ends with their status). The steps are chained into one SHA-256, with a
checkpoint every `CHECKPOINT_EVERY` steps, so a failing case names the first stretch of steps
that differs. Wall time never enters: only decisions and the virtual clock do.

Cases are small (a few hundred requests) so that the whole grid runs in seconds. The goldens
live in tests/data/plan_digests.json; after a change that is MEANT to alter decisions, record
them again with

    python tests/sim/plan_digest.py            # rewrites tests/data/plan_digests.json
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
GOLDEN_PATH = ROOT / "tests" / "data" / "plan_digests.json"
CHECKPOINT_EVERY = 200

# Every registered policy, with options where a default would leave a decision path unused.
POLICIES = (
    "vllm",
    "vllm:priority=true",
    "vllm:preemption_mode=swap",
    "vllm_chunked",
    "sarathi:budget=512",
    "orca:max_batch_size=64",
    "sls:batch_size=64",
    "fastgen",
    "fastserve",
    "alise",
    "scls:batch_size=64",
    "econoserve",
    "accelgen",
)
# Policies whose overlapped runs are checked too (overlap changes their sequence only as
# docs/ARCHITECTURE.md's overlap audit says, so it is pinned like the plain runs).
OVERLAP_POLICIES = (
    "vllm",
    "vllm_chunked",
    "sarathi:budget=512",
    "orca:max_batch_size=64",
    "sls:batch_size=64",
    "fastserve",
    "alise",
    "scls:batch_size=64",
    "econoserve",
    "accelgen",
)


@dataclass(frozen=True)
class Case:
    trace: str  # a trace or synthetic workload name
    num_requests: int
    rate: float  # Poisson requests/s, high enough that queues build and KV runs short
    slo_profile: str
    length_source: str
    kv_gb: float  # small, so that preemption and swaps happen
    max_tokens: int  # cap of the outputs, so that a case takes few steps


CASES = {
    "sharegpt": Case("sharegpt", 150, 20.0, "accelgen", "noisy_oracle", 2.5, 96),
    "mooncake": Case("mooncake", 100, 4.0, "none", "oracle", 4.0, 64),
    "accelgen-mix": Case("accelgen-mix", 150, 20.0, "accelgen", "oracle", 3.0, 128),
}
SEEDS = (0, 1)


def case_key(policy: str, trace: str, seed: int, overlap: bool) -> str:
    return f"{policy}|{trace}|seed={seed}" + ("|overlap" if overlap else "")


def all_keys() -> list[tuple[str, str, int, bool]]:
    keys = [(p, t, s, False) for p in POLICIES for t in CASES for s in SEEDS]
    keys += [(p, t, s, True) for p in OVERLAP_POLICIES for t in CASES for s in SEEDS]
    return keys


class _Recorder:
    """Chains one worker's steps: the events since the previous plan, then the plan."""

    def __init__(self) -> None:
        self.chain = hashlib.sha256()
        self.events: list[tuple[Any, ...]] = []
        self.steps = 0
        self.checkpoints: list[str] = []
        self.preemptions = 0
        self.finished = 0

    def event(self, *item: Any) -> None:
        self.events.append(item)

    def plan(self, plan: Any) -> None:
        moves = [(int(m.kind), m.request_id, len(m.src_block_ids)) for m in plan.kv_moves]
        step = (
            list(plan.num_scheduled_tokens.items()),
            sorted(plan.sample_ids),
            moves,
            list(plan.release_ids),
            self.events,
        )
        self.chain.update(repr(step).encode())
        self.events = []
        self.steps += 1
        if self.steps % CHECKPOINT_EVERY == 0:
            self.checkpoints.append(self.chain.hexdigest()[:16])


def _wrap(sched: Any, rec: _Recorder) -> None:
    """Records the scheduler's transitions and plans (instance attributes shadow its methods,
    and the StepBuilder and the cluster call them through the instance)."""
    schedule, preempt, end, back = sched.schedule, sched.preempt, sched.end, sched.return_to_pool
    pause = sched.pause

    def on_schedule(now: float) -> Any:
        plan = schedule(now)
        rec.plan(plan)
        return plan

    def on_preempt(req: Any, mode: Any, reason: Any, now: float, *, to_front: bool) -> None:
        rec.preemptions += 1
        rec.event("preempt", req.request_id, str(mode.value), str(reason.value), to_front)
        preempt(req, mode, reason, now, to_front=to_front)

    def on_pause(requests: list[Any], reason: Any, now: float) -> None:
        # NOTE: `preempt(req, KEEP, reason, now, to_front=True)` of each, in one call: the
        # same event per request, in order
        for req in requests:
            rec.preemptions += 1
            rec.event("preempt", req.request_id, "keep", str(reason.value), True)
        pause(requests, reason, now)

    def on_end(req: Any, status: Any, now: float, message: str = "") -> None:
        rec.finished += 1
        rec.event("end", req.request_id, int(status))
        end(req, status, now, message)

    def on_return(req: Any, now: float) -> None:
        rec.event("return", req.request_id)
        back(req, now)

    sched.schedule, sched.preempt, sched.end, sched.return_to_pool = on_schedule, on_preempt, on_end, on_return
    sched.pause = on_pause


def run_case(policy: str, trace: str, seed: int, overlap: bool) -> dict[str, Any]:
    """Simulates the case and returns its digest record."""
    from scheduler_service.costmodel.factory import build_cost_model
    from scheduler_service.sim.simulator import SimConfig, Simulation
    from scheduler_service.sim.slo_profiles import apply_slo_profile
    from scheduler_service.workloads import apply_arrivals, load_trace

    case = CASES[trace]
    cm = build_cost_model("analytic", "llama-2-7b", "a100-80g")
    wl = load_trace(case.trace, num_requests=case.num_requests, seed=seed)
    wl = apply_arrivals(wl, "poisson", rate=case.rate, seed=seed)
    wl = apply_slo_profile(case.slo_profile, wl, cm, seed=seed)
    config = SimConfig(
        policy=policy,
        max_model_len=8192,
        max_tokens=case.max_tokens,
        kv_gb=case.kv_gb,
        swap_space_gib=1.0,
        length_source=case.length_source,
        seed=seed,
        overlap=overlap,
        max_waiting=None,  # the digests were recorded with unbounded queues and no offline queue
        max_offline_waiting=0,
    )
    sim = Simulation(config, wl, cm)
    recorders: dict[int, _Recorder] = {}
    for w, sched in sim.cluster.schedulers.items():
        recorders[w] = _Recorder()
        _wrap(sched, recorders[w])
    run = sim.run()
    rec = recorders[0]
    return {
        "steps": rec.steps,
        "preemptions": rec.preemptions,
        "ended": rec.finished,
        "finished": run.metrics["num_finished"],
        "digest": rec.chain.hexdigest()[:32],
        "checkpoints": rec.checkpoints,
    }


def load_goldens() -> dict[str, dict[str, Any]]:
    return json.loads(GOLDEN_PATH.read_text())


def record_all(progress: Callable[[str], None] = print) -> None:
    goldens = {}
    for policy, trace, seed, overlap in all_keys():
        key = case_key(policy, trace, seed, overlap)
        goldens[key] = run_case(policy, trace, seed, overlap)
        progress(f"{key}: {goldens[key]['steps']} steps, {goldens[key]['preemptions']} preemptions")
    GOLDEN_PATH.write_text(json.dumps(goldens, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    record_all()
