"""Build a cost model by kind name: the one entry point the simulator and the CLI use.

Data flow: (kind, model name or ModelSpec, GPU name, TP, optional profile path) ->
`COST_MODELS.get(kind)` -> a constructed `CostModel`. Importing this module imports the three
implementations, which registers "analytic", "profile" and "fitted".

    analytic  presets only (any preset model x GPU)
    profile   Vidur operator profiles; A100 / H100 and the presets in PROFILE_SOURCES
    fitted    a `sluice profile` JSON (profile_path); the model is the profiled one
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from scheduler_service.costmodel import analytic, fitted, operator_profiles  # noqa: F401  (registers the kinds)
from scheduler_service.costmodel.base import COST_MODELS, CostModel, ModelSpec
from scheduler_service.costmodel.presets import get_hardware, get_model
from scheduler_service.costmodel.profile_schema import WorkerProfile


def resolve_model(model: str | ModelSpec, tensor_parallel: int = 1) -> ModelSpec:
    """A preset name ("llama-2-7b", "llama-2-70b@tp4") or a ModelSpec, at the given TP."""
    if isinstance(model, ModelSpec):
        return model if tensor_parallel == 1 else replace(model, tensor_parallel=tensor_parallel)
    return get_model(model, tensor_parallel)


def build_cost_model(
    kind: str,
    model: str | ModelSpec,
    hardware: str,
    tensor_parallel: int = 1,
    profile_path: str | Path | None = None,
) -> CostModel:
    """A cost model of `kind` for `model` on `hardware`; "fitted" needs `profile_path`."""
    cls = COST_MODELS.get(kind)
    if cls is fitted.FittedCostModel:
        return _build_fitted(model, hardware, profile_path)
    if profile_path is not None:
        raise ValueError(f"profile_path is only used by the 'fitted' cost model, not {kind!r}")
    return cls(resolve_model(model, tensor_parallel), get_hardware(hardware))


def _build_fitted(model: str | ModelSpec, hardware: str, profile_path: str | Path | None) -> CostModel:
    if profile_path is None:
        raise ValueError("the 'fitted' cost model needs profile_path (a `sluice profile` JSON)")
    profile = WorkerProfile.load(profile_path)
    wanted = model.name if isinstance(model, ModelSpec) else model.partition("@")[0]
    profiled = profile.model.name.partition("@")[0]
    if wanted.lower() != profiled.lower():
        raise ValueError(f"{profile_path} profiles {profiled!r}, not {wanted!r}; a fitted model prices only its own")
    return fitted.FittedCostModel(profile, get_hardware(hardware))
