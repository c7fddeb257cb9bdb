"""The simulator's `--length-source predictor[:DIR]` and `predictor-online[:DIR]`: the flag
read, the predictor's side (predictor_service/trace_lengths.py) handed the trace's prompts and
its answers handed to the cluster as a length source (scheduler_service/cluster/length_sources.py).

    predictor[:DIR]         every prediction made once before the run -> TableLengths
                            (from the prompts where every request has text, else drawn from
                            the predictor's held-out error model)
    predictor-online[:DIR]  the predictor in the run, its history learning -> LearningLengths

No DIR: the committed model.
"""

from __future__ import annotations

from pathlib import Path

from predictor_service.trace_lengths import (
    OnlineTracePredictor,
    TracePrompt,
    error_model_lengths,
    predict_trace,
)
from scheduler_service.cluster.length_sources import LearningLengths, TableLengths
from scheduler_service.workloads import Workload

PREFIX = "predictor"
ONLINE = "predictor-online"


def is_predictor_source(spec: str) -> bool:
    return spec == PREFIX or spec.startswith(PREFIX + ":")


def is_online_source(spec: str) -> bool:
    """`predictor-online[:DIR]`: the predictor in the run, its history learning (LearningLengths)."""
    return spec == ONLINE or spec.startswith(ONLINE + ":")


def model_dir_of(spec: str) -> Path | None:
    """`predictor` -> None (the committed model), `predictor:DIR` -> DIR."""
    _, _, rest = spec.partition(":")
    return Path(rest) if rest else None


def trace_prompts(workload: Workload) -> list[TracePrompt]:
    """The requests that carry prompt text, as the predictor side takes them."""
    return [TracePrompt(r.request_id, r.prompt_text, r.source) for r in workload.requests if r.prompt_text]


def predictor_lengths(spec: str, workload: Workload, seed: int = 0, progress: bool = True) -> TableLengths:
    """Predicted output tokens for every request of `workload` (see the module docstring)."""
    model_dir = model_dir_of(spec)
    requests = workload.requests
    if requests and all(r.prompt_text for r in requests):
        return TableLengths(predict_trace(model_dir, trace_prompts(workload), progress), name="predictor")
    true_lengths = {r.request_id: r.output_tokens for r in requests}
    return TableLengths(error_model_lengths(model_dir, true_lengths, seed), name="predictor-error-model")


def online_predictor_lengths(spec: str, workload: Workload, progress: bool = True) -> LearningLengths:
    """The predictor inside the run (`predictor-online[:DIR]`), its prompts embedded now."""
    return LearningLengths(OnlineTracePredictor(model_dir_of(spec), trace_prompts(workload), progress))
