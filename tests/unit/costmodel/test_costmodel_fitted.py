"""The fitted model recovers the coefficients of a synthetic worker profile (a GPU-like roofline
knee included) and reports its error, in sample and on held-out steps."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from scheduler_service.costmodel.fitted import FEATURES, FittedCostModel, nnls, step_features
from scheduler_service.costmodel.presets import get_model
from sluice.contract.profile import BatchShape, StepSample, SwapSample, WorkerProfile

TRUE = dict(zip(FEATURES, (4e-3, 3e-5, 2e-5, 1e-9, 4e-8, 5e-5, 0.0), strict=True))
SWAP_OUT = (1e-4, 1 / 20e9)  # fixed seconds, seconds per byte
SWAP_IN = (2e-4, 1 / 24e9)


def random_shape(rng: random.Random) -> BatchShape:
    shape = BatchShape(
        prefill_chunks=[(rng.randint(1, 1024), rng.choice((0, 256, 2048))) for _ in range(rng.randint(0, 3))]
    )
    for _ in range(rng.randint(0 if shape.prefill_chunks else 1, 64)):
        shape.add_decode(rng.randint(16, 4096))
    return shape


def synthetic_profile(noise: float, seed: int = 7, truth: dict[str, float] = TRUE, knee: int = 0) -> WorkerProfile:
    rng = random.Random(seed)
    steps = []
    for _ in range(200):
        shape = random_shape(rng)
        exact = sum(truth[name] * f for name, f in zip(FEATURES, step_features(shape, knee), strict=True))
        steps.append(StepSample(shape, exact * (1 + rng.uniform(-noise, noise))))
    swaps = [
        SwapSample(direction, n, n * 2**20, fixed + n * 2**20 * per_byte)
        for direction, (fixed, per_byte) in (("out", SWAP_OUT), ("in", SWAP_IN))
        for n in (1, 8, 64, 512)
    ]
    return WorkerProfile(get_model("llama-2-7b"), "cuda:0 (NVIDIA H100 80GB HBM3)", "bfloat16", 16, "now", steps, swaps)


def test_exact_profile_recovers_every_coefficient(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    synthetic_profile(noise=0.0).save(path)
    cm = FittedCostModel.from_file(path)
    report = cm.fit_report()
    for name, value in TRUE.items():
        assert report.coefficients[name] == pytest.approx(value, rel=1e-4), name
    assert report.mape < 1e-6 and report.swap_mape is not None and report.swap_mape < 1e-6
    assert cm.hardware.name == "h100-80g"  # recognised from the device string


def test_noisy_profile_reports_its_error_and_still_predicts_within_it() -> None:
    cm = FittedCostModel(synthetic_profile(noise=0.10))
    report = cm.fit_report()
    assert 0.02 < report.mape < 0.06  # uniform +-10% noise has a mean absolute error of 5%
    assert len(report.relative_errors) == 200
    probe = BatchShape(prefill_chunks=[(512, 0)], num_decodes=16, decode_context_sum=16 * 1000)
    exact = sum(TRUE[n] * f for n, f in zip(FEATURES, step_features(probe), strict=True))
    assert cm.iteration_time(probe) == pytest.approx(exact, rel=0.05)


def test_swaps_are_priced_per_direction() -> None:
    cm = FittedCostModel(synthetic_profile(noise=0.0))
    gib = 2**30
    assert cm.swap_time(gib, "out") == pytest.approx(SWAP_OUT[0] + gib * SWAP_OUT[1])
    assert cm.iteration_time(BatchShape(swap_in_bytes=gib)) == pytest.approx(SWAP_IN[0] + gib * SWAP_IN[1])


def test_missing_int8_swap_samples_fall_back_to_the_gpu_pcie_figure() -> None:
    cm = FittedCostModel(synthetic_profile(noise=0.0), int8_swaps=True)
    assert cm.swap_time(50 * 10**9, "out") == pytest.approx(1.0)  # H100 preset: 50 GB/s


def test_nnls_keeps_coefficients_non_negative_where_least_squares_would_not() -> None:
    a = np.array([[1.0, 0.0], [1.0, 1.0], [1.0, 2.0]])
    b = np.array([3.0, 2.0, 1.0])  # unconstrained slope is -1
    x = nnls(a, b)
    assert x[1] == 0.0 and x[0] == pytest.approx(2.0)


def test_profile_without_steps_is_refused() -> None:
    profile = synthetic_profile(noise=0.0)
    profile.steps = []
    with pytest.raises(ValueError, match="no step samples"):
        FittedCostModel(profile)


def test_a_roofline_knee_is_found_and_keeps_small_steps_flat() -> None:
    """GEMMs that read the weights whatever the rows until 192 rows, as on an H100."""
    truth = dict(TRUE, gemm_shortfall=TRUE["prefill_tokens"])
    cm = FittedCostModel(synthetic_profile(noise=0.0, truth=truth, knee=192))
    assert cm.knee == 192
    assert cm.fit_report().mape < 1e-6
    small, at_knee = cm.prefill_time(16), cm.prefill_time(192)
    assert small == pytest.approx(at_knee, rel=0.01)  # only the (tiny) attention term differs
    assert cm.prefill_time(1024) > 2 * at_knee


def test_holdout_prices_only_steps_it_was_not_fitted_on() -> None:
    profile = synthetic_profile(noise=0.0)
    for sample in profile.steps[::4]:
        sample.time_s *= 2  # recorded twice as slow: a model fitted on the others says half
    report = FittedCostModel(profile).holdout(every=4)
    assert report.num_fitted == 150 and len(report.relative_errors) == 50
    assert report.relative_errors == pytest.approx([-0.5] * 50, abs=1e-6)
    assert report.median == pytest.approx(0.5, abs=1e-6)
