"""Sizing a disaggregated deployment (DistServe's placement question, by simulation):

    goodput(run_at, num_gpus)          DistServe's goodput: the largest rate at which at least
                                       `target` of the requests meet all their SLOs (TTFT and TBT),
                                       found by doubling then bisection (sim/capacity.py); per GPU
                                       = that rate / GPUs
    cheapest_split(run_split, rate)    the fewest GPUs, split into P prefill + D decode workers,
                                       whose simulation at `rate` meets the target; among the
                                       splits of that size, the one with the highest attainment

`run_at(rate)` and `run_split(prefill, decode)` are the caller's simulations (a trace, a
model, a policy), so the search knows nothing of workloads. Splits of one size are tried
from the prefill-heaviest down; a size is skipped only after every split of it missed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler_service.sim.capacity import CapacityResult, find_capacity, parse_rule
from scheduler_service.sim.simulator import SimRun

DISTSERVE_ATTAINMENT = 0.9  # DistServe's goodput: the rate at which 90% of requests meet their SLOs


@dataclass(frozen=True)
class Goodput:
    rate_req_s: float
    num_gpus: int
    capacity: CapacityResult

    @property
    def per_gpu(self) -> float:
        return self.rate_req_s / self.num_gpus


def goodput(
    run_at: Callable[[float], SimRun],
    num_gpus: int,
    *,
    target: float = DISTSERVE_ATTAINMENT,
    start_rate: float = 1.0,
    rel_tol: float = 0.05,
    max_probes: int = 16,
) -> Goodput:
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")
    rule = parse_rule(f"attainment:{target}")
    result = find_capacity(run_at, rule, None, start_rate=start_rate, rel_tol=rel_tol, max_probes=max_probes)
    return Goodput(result.capacity_req_s, num_gpus, result)


@dataclass(frozen=True)
class SplitTrial:
    prefill: int
    decode: int
    attainment: float
    run: SimRun


@dataclass
class SplitSearch:
    best: SplitTrial | None  # None: no split of at most max_workers workers meets the target
    tried: list[SplitTrial] = field(default_factory=list)


def cheapest_split(
    run_split: Callable[[int, int], SimRun],
    *,
    target: float = DISTSERVE_ATTAINMENT,
    max_workers: int = 8,
    min_workers: int = 2,
) -> SplitSearch:
    if min_workers < 2 or max_workers < min_workers:
        raise ValueError(f"need 2 <= min_workers <= max_workers, got {min_workers} and {max_workers}")
    search = SplitSearch(None)
    for total in range(min_workers, max_workers + 1):
        meeting = []
        for prefill in range(total - 1, 0, -1):
            run = run_split(prefill, total - prefill)
            trial = SplitTrial(prefill, total - prefill, float(run.metrics["slo_attainment_req"] or 0.0), run)
            search.tried.append(trial)
            if trial.attainment >= target:
                meeting.append(trial)
        if meeting:
            search.best = max(meeting, key=lambda t: (t.attainment, -t.prefill))
            return search
    return search


def fewest_workers(
    run_n: Callable[[int], SimRun], *, target: float = DISTSERVE_ATTAINMENT, max_workers: int = 8
) -> SplitSearch:
    """The fewest colocated workers whose simulation (`run_n(workers)`) meets the target (the
    colocated side of EconoServe's "GPUs at the same goodput" comparison); `best.prefill` is
    the worker count and `best.decode` 0."""
    search = SplitSearch(None)
    for n in range(1, max_workers + 1):
        run = run_n(n)
        trial = SplitTrial(n, 0, float(run.metrics["slo_attainment_req"] or 0.0), run)
        search.tried.append(trial)
        if trial.attainment >= target:
            search.best = trial
            return search
    return search
