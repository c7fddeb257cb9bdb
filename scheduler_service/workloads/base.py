"""Workload data: one `TraceRequest` per request, a `Workload` of them, and the trace-format registry.

Data flow: a trace file (or a synthetic generator) -> `TraceRequest`s -> `Workload` ->
arrival process (`arrivals.py`) -> SLO profile (`slo_profiles.py`) -> simulator or live
benchmark. A `Workload` is never changed in place: `with_arrivals`, `with_slos`, `head`
and `sample` return new ones and append a line to `metadata["history"]`, so a result file
can say exactly which requests, arrivals and SLOs produced it.

Statistics follow `shared/data/README.md`: percentiles interpolate linearly (numpy's
default) and the mean rate is requests / span, where span = last - first arrival.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from scheduler_service.core.slo import SLOSpec
from sluice.common.registry import Registry


@dataclass(frozen=True, slots=True)
class TraceRequest:
    request_id: str
    arrival_s: float | None  # seconds from the workload's start; None for length-only traces
    prompt_tokens: int
    output_tokens: int
    prompt_text: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    slo: SLOSpec | None = None
    priority: int = 0
    tenant: str = ""
    source: str = ""  # the data set or generator component the request came from
    prefix_hash_ids: tuple[int, ...] = ()  # Mooncake: hashes of the prompt's 512-token prefix blocks
    output_token_ids: tuple[int, ...] | None = None  # the reference answer's ids (multi-turn traces)


@dataclass(frozen=True, slots=True)
class WorkloadStats:
    num_requests: int
    prompt_mean: float
    prompt_median: float
    prompt_p90: float
    output_mean: float
    output_median: float
    output_p90: float
    span_s: float | None  # last minus first arrival; None without arrivals
    rate_req_s: float | None  # num_requests / span_s

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(slots=True)
class Workload:
    name: str
    requests: list[TraceRequest]
    metadata: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    @property
    def has_arrivals(self) -> bool:
        return bool(self.requests) and all(r.arrival_s is not None for r in self.requests)

    def prompt_lengths(self) -> np.ndarray:
        return np.fromiter((r.prompt_tokens for r in self.requests), dtype=np.int64, count=len(self.requests))

    def output_lengths(self) -> np.ndarray:
        return np.fromiter((r.output_tokens for r in self.requests), dtype=np.int64, count=len(self.requests))

    def arrivals(self) -> np.ndarray:
        """Arrival times in seconds; ValueError when any request has none."""
        if not self.has_arrivals:
            raise ValueError(f"workload {self.name!r} has no arrival times; give it a rate (Poisson or Gamma)")
        return np.array([r.arrival_s for r in self.requests], dtype=np.float64)

    def derive(self, requests: list[TraceRequest], step: str, **metadata: Any) -> Workload:
        """A new workload with these requests; `step` is appended to the provenance history."""
        meta = copy.deepcopy(self.metadata)
        meta["history"] = [*meta.get("history", []), step]
        meta.update(metadata)
        return Workload(self.name, requests, meta)

    def with_arrivals(self, arrivals: Sequence[float] | np.ndarray, description: str = "arrivals") -> Workload:
        if len(arrivals) != len(self.requests):
            raise ValueError(f"{len(arrivals)} arrival times for {len(self.requests)} requests")
        requests = [dataclasses.replace(r, arrival_s=float(t)) for r, t in zip(self.requests, arrivals, strict=True)]
        return self.derive(requests, description, arrivals=description)

    def with_slos(self, slos: Sequence[SLOSpec | None], description: str = "slos") -> Workload:
        if len(slos) != len(self.requests):
            raise ValueError(f"{len(slos)} SLOs for {len(self.requests)} requests")
        requests = [dataclasses.replace(r, slo=s) for r, s in zip(self.requests, slos, strict=True)]
        return self.derive(requests, description, slo_profile=description)

    def head(self, n: int) -> Workload:
        if n < 0:
            raise ValueError(f"head needs n >= 0, got {n}")
        return self.derive(self.requests[:n], f"head({n})")

    def sample(self, n: int, seed: int = 0, replace: bool = False) -> Workload:
        """n requests drawn uniformly. Without replacement the trace order (and arrivals) is kept;
        with replacement (AccelGen section 6.1 builds its mix that way) ids get a `#k` suffix to
        stay unique and arrival times are dropped, since repeated requests cannot share one."""
        rng = np.random.default_rng(seed)
        if replace:
            picks = rng.integers(0, len(self.requests), size=n)
            requests = [
                dataclasses.replace(self.requests[i], request_id=f"{self.requests[i].request_id}#{k}", arrival_s=None)
                for k, i in enumerate(picks)
            ]
        else:
            if n > len(self.requests):
                raise ValueError(f"cannot sample {n} of {len(self.requests)} requests without replacement")
            picks = np.sort(rng.choice(len(self.requests), size=n, replace=False))
            requests = [self.requests[i] for i in picks]
        return self.derive(requests, f"sample(n={n}, seed={seed}, replace={replace})")

    def stats(self) -> WorkloadStats:
        if not self.requests:
            raise ValueError(f"workload {self.name!r} is empty")
        prompts, outputs = self.prompt_lengths(), self.output_lengths()
        span = rate = None
        if self.has_arrivals:
            times = self.arrivals()
            span = float(times.max() - times.min())
            rate = len(times) / span if span > 0 else None
        return WorkloadStats(
            num_requests=len(self.requests),
            prompt_mean=float(prompts.mean()),
            prompt_median=float(np.median(prompts)),
            prompt_p90=float(np.percentile(prompts, 90)),
            output_mean=float(outputs.mean()),
            output_median=float(np.median(outputs)),
            output_p90=float(np.percentile(outputs, 90)),
            span_s=span,
            rate_req_s=rate,
        )

    def summary(self) -> dict[str, Any]:
        """What a result file records about its workload: name, statistics and provenance."""
        return {"name": self.name, "stats": self.stats().to_dict(), "metadata": self.metadata}


@dataclass(frozen=True, slots=True)
class FileHead:
    """What format detection sees of a file: its container and its first record."""

    path: Path
    kind: str  # "csv", "jsonl" or "json-array"
    columns: tuple[str, ...] = ()  # CSV header
    first_record: dict[str, Any] | None = None  # first JSON object


@dataclass(frozen=True, slots=True)
class ReadOptions:
    num_requests: int | None  # stop after this many requests
    token_counter: Callable[[str], int]  # text formats only


# A reader returns the requests and what the format wants recorded (skipped rows and why).
Reader = Callable[[Path, ReadOptions], tuple[list[TraceRequest], dict[str, Any]]]


@dataclass(frozen=True, slots=True)
class TraceFormat:
    name: str
    description: str
    matches: Callable[[FileHead], bool]
    read: Reader


TRACE_FORMATS: Registry[TraceFormat] = Registry("trace format")


def register_format(fmt: TraceFormat) -> TraceFormat:
    return TRACE_FORMATS.register(fmt.name)(fmt)
