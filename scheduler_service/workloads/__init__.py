"""Workloads for the simulator and the live benchmark.

Data flow: `load_trace(name_or_path)` (a shared trace, a prompt set, any file in a known
format, or a synthetic generator with the papers' statistics) -> `Workload` of
`TraceRequest`s -> `apply_arrivals` (trace timestamps, rescaled, Poisson or Gamma) ->
`scheduler_service.sim.slo_profiles.apply_slo_profile` -> simulator / `sluice bench`.
"""

from scheduler_service.workloads.arrivals import (
    ARRIVAL_PROCESSES,
    apply_arrivals,
    gamma_arrivals,
    poisson_arrivals,
    rescale_to_rate,
)
from scheduler_service.workloads.base import (
    TRACE_FORMATS,
    TraceFormat,
    TraceRequest,
    Workload,
    WorkloadStats,
)
from scheduler_service.workloads.loader import (
    SHORT_NAMES,
    detect_format,
    known_names,
    load_trace,
    read_trace_file,
    resolve_path,
)
from scheduler_service.workloads.sluice_jsonl import write_sluice_jsonl
from scheduler_service.workloads.synthetic import SYNTHETIC_WORKLOADS, LengthDist, SyntheticSpec, generate_synthetic
from scheduler_service.workloads.tokens import (
    HFTokenizerCounter,
    TokenCounter,
    WordTokenCounter,
    make_token_counter,
)

__all__ = [
    "ARRIVAL_PROCESSES",
    "SHORT_NAMES",
    "SYNTHETIC_WORKLOADS",
    "TRACE_FORMATS",
    "HFTokenizerCounter",
    "LengthDist",
    "SyntheticSpec",
    "TokenCounter",
    "TraceFormat",
    "TraceRequest",
    "WordTokenCounter",
    "Workload",
    "WorkloadStats",
    "apply_arrivals",
    "detect_format",
    "gamma_arrivals",
    "generate_synthetic",
    "known_names",
    "load_trace",
    "make_token_counter",
    "poisson_arrivals",
    "read_trace_file",
    "rescale_to_rate",
    "resolve_path",
    "write_sluice_jsonl",
]
