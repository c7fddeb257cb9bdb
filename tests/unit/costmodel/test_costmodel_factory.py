"""`build_cost_model` builds every registered kind by name and rejects wrong combinations."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler_service.costmodel.base import COST_MODELS
from scheduler_service.costmodel.factory import build_cost_model
from scheduler_service.costmodel.presets import get_model
from sluice.contract.profile import BatchShape, StepSample, WorkerProfile


def tiny_profile(path: Path) -> Path:
    steps = [StepSample(BatchShape(prefill_chunks=[(n, 0)]), 0.01 + n * 1e-5) for n in (16, 64, 256, 1024)]
    steps += [StepSample(BatchShape(num_decodes=b, decode_context_sum=b * 500), 0.01 + b * 2e-5) for b in (1, 8, 32)]
    WorkerProfile(get_model("llama-2-7b"), "cpu", "float32", 16, "now", steps).save(path)
    return path


def test_importing_the_factory_registers_all_three_kinds() -> None:
    assert {"analytic", "profile", "fitted"} <= set(COST_MODELS.names())


def test_each_kind_prices_a_batch(tmp_path: Path) -> None:
    shape = BatchShape(prefill_chunks=[(128, 0)], num_decodes=8, decode_context_sum=4000)
    analytic = build_cost_model("analytic", "llama-2-70b", "h100-80g", tensor_parallel=4)
    profile = build_cost_model("profile", "llama-2-70b@tp4", "h100-80g")
    fitted = build_cost_model("fitted", "llama-2-7b", "a100-80g", profile_path=tiny_profile(tmp_path / "p.json"))
    assert analytic.model.tensor_parallel == profile.model.tensor_parallel == 4
    assert analytic.iteration_time(shape) > 0 and profile.iteration_time(shape) > 0
    assert fitted.iteration_time(shape) == pytest.approx(0.01 + 128e-5 + 8 * 2e-5, rel=0.05)


def test_wrong_combinations_fail_with_a_reason(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match="analytic"):
        build_cost_model("magic", "llama-2-7b", "a100-80g")
    with pytest.raises(ValueError, match="profile_path"):
        build_cost_model("fitted", "llama-2-7b", "a100-80g")
    with pytest.raises(ValueError, match="not 'opt-13b'"):
        build_cost_model("fitted", "opt-13b", "a100-80g", profile_path=tiny_profile(tmp_path / "p.json"))
