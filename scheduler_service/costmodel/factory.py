"""Build a cost model by kind name: the one entry point the simulator and the CLI use.

Data flow: (kind, model name or ModelSpec, GPU name, TP, optional profile path) ->
`COST_MODELS.get(kind)` -> a constructed `CostModel`. Importing this module imports the three
implementations, which registers "analytic", "profile" and "fitted".

    analytic  presets only (any preset model x GPU)
    profile   Vidur operator profiles; A100 / H100 and the presets in PROFILE_SOURCES
    fitted    a `sluice profile` JSON (profile_path); the model is the profiled one
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from scheduler_service.costmodel import analytic, fitted, operator_profiles  # noqa: F401  (registers the kinds)
from scheduler_service.costmodel.base import COST_MODELS, CostModel, HardwareSpec
from scheduler_service.costmodel.presets import get_hardware, get_model
from sluice.common.config import opt
from sluice.contract.profile import ModelSpec, WorkerProfile


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


def build_worker_cost_model(
    model: ModelSpec, hardware: HardwareSpec, profile_path: str | Path | None = None
) -> CostModel:
    """The live scheduler's cost model of a worker: fitted from the worker's own `sluice
    profile` when one is given, else the analytic roofline of the model and hardware the
    worker described (its Info: model dimensions, and a hardware preset or measured figures)."""
    if profile_path is None:
        return analytic.AnalyticCostModel(model, hardware)
    profile = WorkerProfile.load(profile_path)
    if profile.model.name.partition("@")[0].lower() != model.name.partition("@")[0].lower():
        raise ValueError(f"{profile_path} profiles {profile.model.name!r}, but the workers serve {model.name!r}")
    return fitted.FittedCostModel(profile, hardware)


@dataclass
class CostModelConfig:
    """Which cost model prices the simulated steps (`sluice simulate`, `sluice capacity`)."""

    model: str = opt("llama-2-7b", "model preset, e.g. llama-2-7b, mistral-7b, yi-34b@tp2")
    hardware: str = opt("a100-80g", "GPU preset: a100-80g, h100-80g, h200, a40, v100-32g")
    tp: int = opt(1, "tensor-parallel degree")
    cost_model: str = opt("analytic", "analytic, profile (Vidur's measured operators) or fitted")
    profile: str | None = opt(None, "a `sluice profile` JSON for the fitted cost model")

    def build(self) -> CostModel:
        return build_cost_model(self.cost_model, self.model, self.hardware, self.tp, self.profile)
