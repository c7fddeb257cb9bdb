"""Which requests a simulation replays: a trace (or synthetic workload), its arrival process
and its SLOs, as `sluice simulate` and `sluice capacity` take them.

    WorkloadConfig.load()                                  the trace's requests (lengths, times)
    WorkloadConfig.prepare(workload, cost_model, rate)     arrivals at `rate` (or the trace's own)
                                                           -> SLOs of the profile
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_service.costmodel.base import CostModel
from scheduler_service.sim.slo_profiles import apply_slo_profile
from scheduler_service.workloads import Workload, apply_arrivals, load_trace
from sluice.common.config import opt


@dataclass
class WorkloadConfig:
    trace: str = opt("", "a shared trace name, a synthetic workload name, or a file path")
    num_requests: int = opt(1000, "requests taken from the trace")
    rate: float | None = opt(None, "arrivals/s: rescales trace timestamps, or Poisson for length-only traces")
    arrival: str = opt("auto", "auto, trace, poisson or gamma")
    cv: float = opt(1.0, "coefficient of variation of gamma arrivals")
    slo_profile: str = opt("none", "none, accelgen, econoserve, sarathi-strict or sarathi-relaxed")
    seed: int = opt(0, "seed of sampling, arrivals and SLOs")
    tokenizer: str | None = opt(
        None, "tokenizer.json for text traces; none: 1.3 tokens per word (sharegpt-multiturn: the MiniLM tokenizer)"
    )

    def load(self) -> Workload:
        if not self.trace:
            raise ValueError("give a trace (--trace NAME or PATH)")
        if self.num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {self.num_requests}")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"--rate must be > 0 requests/s, got {self.rate}")
        if self.cv <= 0:
            raise ValueError(f"--cv must be > 0, got {self.cv}")
        return load_trace(self.trace, num_requests=self.num_requests, seed=self.seed, tokenizer_path=self.tokenizer)

    def prepare(self, workload: Workload, cost_model: CostModel, rate: float | None) -> Workload:
        """Arrivals at `rate` (the trace's own when None and it has them), then the SLO profile."""
        if rate is not None or not workload.has_arrivals:
            if rate is None:
                raise ValueError(f"trace {self.trace!r} has no arrival times; give --rate")
            workload = apply_arrivals(workload, self.arrival, rate=rate, cv=self.cv, seed=self.seed)
        return apply_slo_profile(self.slo_profile, workload, cost_model, seed=self.seed)
