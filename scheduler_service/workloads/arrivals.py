"""Arrival processes: a workload's requests in, the same requests with arrival times out.

- `trace`: keep the trace's own timestamps; with a target rate, multiply every gap by one
  constant, which keeps the order and the burstiness (the advice of `shared/data/README.md`
  for the Azure and Mooncake traces) and makes the mean rate (requests / span) the target.
- `poisson`: exponential gaps at `rate` (the papers' default: Sarathi-Serve section 5,
  AccelGen section 3, EconoServe Table 2).
- `gamma`: Gamma gaps with mean 1/rate and coefficient of variation `cv`; cv = 1 is
  Poisson, cv > 1 is burstier.
- `auto`: `trace` when the workload has timestamps, else `poisson`.

Every process starts at t = 0 and is deterministic under `seed` (a numpy Generator).
Length-only traces (Vidur/Sarathi CSVs, prompt sets) need a rate: asking for trace
arrivals, or giving no rate, is a ValueError that says so.
"""

from __future__ import annotations

import numpy as np

from scheduler_service.workloads.base import Workload

ARRIVAL_PROCESSES = ("auto", "trace", "poisson", "gamma")


def _check_rate(rate: float | None, workload: Workload) -> float:
    if rate is None:
        raise ValueError(f"workload {workload.name!r} has no arrival times: give a rate (requests/s)")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    return float(rate)


def rescale_to_rate(arrivals: np.ndarray, rate: float) -> np.ndarray:
    """Multiply every gap by one factor so that len / span equals `rate`; the earliest arrival is 0."""
    times = np.asarray(arrivals, dtype=np.float64)
    if len(times) < 2:
        return np.zeros_like(times)
    start = float(times.min())
    span = float(times.max()) - start
    if span <= 0:
        raise ValueError("all arrivals are at the same instant; a rate cannot be rescaled")
    factor = (len(times) / span) / rate
    return (times - start) * factor


def poisson_arrivals(num_requests: int, rate: float, seed: int | np.random.SeedSequence = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=max(num_requests - 1, 0))
    return np.concatenate([[0.0], np.cumsum(gaps)])[:num_requests]


def gamma_arrivals(num_requests: int, rate: float, cv: float, seed: int | np.random.SeedSequence = 0) -> np.ndarray:
    if not cv > 0:
        raise ValueError(f"cv must be > 0, got {cv}")
    rng = np.random.default_rng(seed)
    shape = 1.0 / cv**2  # a Gamma's CV is 1 / sqrt(shape)
    gaps = rng.gamma(shape, 1.0 / (rate * shape), size=max(num_requests - 1, 0))
    return np.concatenate([[0.0], np.cumsum(gaps)])[:num_requests]


def apply_arrivals(
    workload: Workload, process: str = "auto", rate: float | None = None, cv: float = 1.0, seed: int = 0
) -> Workload:
    if process not in ARRIVAL_PROCESSES:
        raise ValueError(f"unknown arrival process {process!r}; known: {', '.join(ARRIVAL_PROCESSES)}")
    if process == "auto":
        process = "trace" if workload.has_arrivals else "poisson"
    n = len(workload)
    if process == "trace":
        times = workload.arrivals()
        if rate is None:
            return workload
        rate = _check_rate(rate, workload)
        return workload.with_arrivals(rescale_to_rate(times, rate), f"trace arrivals rescaled to {rate:g} req/s")
    rate = _check_rate(rate, workload)
    if process == "poisson":
        return workload.with_arrivals(poisson_arrivals(n, rate, seed), f"poisson(rate={rate:g}, seed={seed})")
    return workload.with_arrivals(gamma_arrivals(n, rate, cv, seed), f"gamma(rate={rate:g}, cv={cv:g}, seed={seed})")
