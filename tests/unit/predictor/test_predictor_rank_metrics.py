"""Kendall's tau and the under-prediction share: the measures a length-aware scheduler feels
(ordering jobs right, not allocating too little), reported beside bucket accuracy."""

from __future__ import annotations

import numpy as np

from predictor_service.metrics import kendall_tau, point_metrics


def _tau_b_by_pairs(x: np.ndarray, y: np.ndarray) -> float:
    """The textbook definition, pair by pair: (C - D) / sqrt((P - T_x) (P - T_y))."""
    c = d = tx = ty = p = 0
    for i in range(len(x)):
        for j in range(i + 1, len(x)):
            p += 1
            sx, sy = np.sign(x[i] - x[j]), np.sign(y[i] - y[j])
            tx += sx == 0
            ty += sy == 0
            c += sx * sy > 0
            d += sx * sy < 0
    return float((c - d) / np.sqrt((p - tx) * (p - ty)))


def test_kendall_tau_is_tau_b_with_ties() -> None:
    rng = np.random.default_rng(0)
    true = rng.integers(1, 30, 300)  # many ties
    pred = true + rng.integers(-10, 10, 300)
    assert abs(kendall_tau(pred, true, chunk=64) - _tau_b_by_pairs(pred, true)) < 1e-9
    assert kendall_tau(true, true) == 1.0 and kendall_tau(-true, true) == -1.0


def test_point_metrics_report_the_under_prediction_share() -> None:
    true = np.array([100, 200, 300, 400])
    m = point_metrics(true, np.array([90, 210, 250, 400]))
    assert m["under_share"] == 0.5  # 90 < 100 and 250 < 300; equal is not under
    assert m["kendall_tau"] == 1.0  # the order is still right
    assert m["mae_tokens"] == (10 + 10 + 50) / 4
