"""The ground-floor length contract: ALISE's bucket rule, LengthPrediction, the error model."""

from __future__ import annotations

import numpy as np
import pytest

from sluice.contract.length_prediction import (
    LengthErrorModel,
    LengthPrediction,
    bucket_accuracy,
    length_bucket,
)


def test_bucket_rule_uses_equal_100_token_bins_with_the_last_one_open() -> None:
    assert list(length_bucket(np.array([0, 99, 100, 199, 899, 900, 5000]))) == [0, 0, 1, 1, 8, 9, 9]
    assert bucket_accuracy([50, 150, 950, 3000], [99, 200, 2000, 901]) == pytest.approx(0.75)
    assert bucket_accuracy([99], [100]) == 0.0, "neighbouring lengths across a bin edge do not count"


def test_bucket_accuracy_refuses_mismatched_inputs() -> None:
    with pytest.raises(ValueError):
        bucket_accuracy([1, 2], [1])


def test_prediction_quantiles_interpolate_and_clip() -> None:
    p = LengthPrediction(100, ((0.1, 20), (0.5, 100), (0.9, 400)), "head", "v1", 0.001)
    assert (p.p10, p.p50, p.p90) == (20, 100, 400)
    assert p.quantile(0.7) == 250
    clipped = p.clipped(150)
    assert clipped.tokens == 100 and clipped.p90 == 150 and clipped.p10 == 20
    assert LengthPrediction.from_dict(p.to_dict()) == p


def test_error_model_replays_one_sided_errors_by_length_bucket(tmp_path) -> None:
    rng = np.random.default_rng(0)
    true = rng.integers(20, 1000, size=4000)
    # a predictor that over-predicts short answers 2x and under-predicts long ones by half
    ratio = np.where(true < 128, 2.0, 0.5) * np.exp(rng.normal(0, 0.1, size=len(true)))
    preds = [
        LengthPrediction(int(t * r), ((0.1, int(t * r * 0.5)), (0.5, int(t * r)), (0.9, int(t * r * 2))))
        for t, r in zip(true, ratio, strict=True)
    ]
    model = LengthErrorModel.fit(true, preds, predictor_version="v1")
    loaded = LengthErrorModel.load(model.save(tmp_path / "error_model.json"))
    draws = np.random.default_rng(1)
    short = np.array([loaded.sample(60, draws).tokens for _ in range(300)]) / 60
    long = np.array([loaded.sample(700, draws).tokens for _ in range(300)]) / 700
    assert 1.7 < np.median(short) < 2.3 and 0.4 < np.median(long) < 0.6
    s = loaded.sample(700, draws)
    assert s.source == "error_model" and s.p10 <= s.p50 <= s.p90 and s.predictor_version == "v1"


def test_error_model_borrows_the_nearest_bucket_when_its_own_is_empty() -> None:
    model = LengthErrorModel.fit(
        [300, 400], [LengthPrediction(150, ((0.5, 150),)), LengthPrediction(200, ((0.5, 200),))]
    )
    assert model.sample(40, np.random.default_rng(0)).tokens == 20, "half, as in the only filled bucket"
