"""Accuracy measures of length predictions (numpy only).

    bucket_accuracy   ALISE's rule (sluice.contract.length_prediction): same 100-token bin, last bin open
    mae_tokens        mean |predicted - true| in tokens
    spearman          rank correlation of predicted and true lengths (ties get average ranks)
    kendall_tau       Kendall's tau-b of predicted and true lengths: the share of job pairs a
                      shortest-first scheduler orders rightly, minus the share it orders wrongly
    under_share       share of jobs whose prediction is below their true length (what costs
                      a scheduler that allocates or ranks by the prediction: ALISE, EconoServe)
    coverage_80       share of true lengths inside [p10, p90]
    mode_bucket_rate  share of the most common true bin: what the best constant could score
    constant_mae      MAE of the best constant (the true median): what a predictor must beat

`accuracy_report` breaks these down by source (ShareGPT, ShareGPT first turns, AlpacaEval)
for the blend, the head alone and retrieval alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from sluice.contract.length_prediction import LengthPrediction, bucket_accuracy, length_bucket


def _ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.arange(len(x), dtype=np.float64)
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=ranks)
    return sums[inverse] / counts[inverse]


def spearman(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray) -> float:
    ra, rb = _ranks(np.asarray(a, dtype=np.float64)), _ranks(np.asarray(b, dtype=np.float64))
    if ra.std() == 0 or rb.std() == 0:
        return 0.0
    return float(np.corrcoef(ra, rb)[0, 1])


def kendall_tau(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray, chunk: int = 512) -> float:
    """Kendall's tau-b (ties in either variable corrected), exact over all pairs in row chunks."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    n = len(x)
    concordant = tied_x = tied_y = 0.0
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        dx = np.sign(x[lo:hi, None] - x[None, :])
        dy = np.sign(y[lo:hi, None] - y[None, :])
        upper = np.arange(lo, hi)[:, None] < np.arange(n)[None, :]  # each pair once
        concordant += float((dx * dy)[upper].sum())
        tied_x += float(((dx == 0) & upper).sum())
        tied_y += float(((dy == 0) & upper).sum())
    pairs = n * (n - 1) / 2
    denom = np.sqrt((pairs - tied_x) * (pairs - tied_y))
    return float(concordant / denom) if denom > 0 else 0.0


def point_metrics(true: np.ndarray, points: np.ndarray) -> dict[str, float]:
    return {
        "bucket_accuracy": bucket_accuracy(true, points),
        "mae_tokens": float(np.mean(np.abs(points - true))),
        "spearman": spearman(points, true),
        "kendall_tau": kendall_tau(points, true),
        "under_share": float(np.mean(np.asarray(points) < np.asarray(true))),
    }


def mode_bucket_rate(true: np.ndarray) -> float:
    return float(np.bincount(length_bucket(true)).max() / len(true))


def coverage(true: np.ndarray, preds: Sequence[LengthPrediction], lo: float = 0.1, hi: float = 0.9) -> float:
    return float(np.mean([p.quantile(lo) <= t <= p.quantile(hi) for t, p in zip(true, preds, strict=True)]))


def accuracy_report(
    split: Any,
    preds: Sequence[LengthPrediction],
    head_points: np.ndarray,
    retr_points: np.ndarray,
    extra: dict[str, np.ndarray] | None = None,
) -> dict[str, Any]:
    """Per subset: n, blend / head / retrieval (and any `extra` named points) point metrics, 80%
    interval coverage, mode-bin rate."""
    true = split.tokens
    points = np.array([p.tokens for p in preds])
    subsets = {
        "all": np.ones(len(true), dtype=bool),
        "sharegpt": np.array([s.source == "sharegpt" for s in split.samples]),
        "sharegpt_first_turn": np.array([s.source == "sharegpt" and s.first_turn for s in split.samples]),
        "alpaca-eval": np.array([s.source == "alpaca-eval" for s in split.samples]),
    }
    out: dict[str, Any] = {}
    for name, m in subsets.items():
        if not m.any():
            continue
        out[name] = {
            "n": int(m.sum()),
            "blend": point_metrics(true[m], points[m]),
            "head": point_metrics(true[m], head_points[m]),
            "retrieval": point_metrics(true[m], retr_points[m]),
            **{name: point_metrics(true[m], pts[m]) for name, pts in (extra or {}).items()},
            "coverage_p10_p90": coverage(true[m], [p for p, keep in zip(preds, m, strict=True) if keep]),
            "mode_bucket_rate": mode_bucket_rate(true[m]),
            "constant_mae_tokens": float(np.mean(np.abs(true[m] - np.median(true[m])))),
            "true_tokens": {q: float(np.percentile(true[m], q)) for q in (10, 50, 90)},
        }
    return out
