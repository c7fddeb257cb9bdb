"""Blends the head's quantiles with the retrieved neighbours' observed lengths (ALISE's ensemble).

    neighbours with similarity >= threshold, weights w_i = exp((sim_i - 1) / temperature)
    retrieval distribution = logistic kernels (scale `bandwidth`) at the neighbours' log lengths,
                             mixed with weights w_i; its quantiles found on a grid
    alpha = W / (W + kappa), W = sum of w_i          (0 without neighbours: the head alone)
    blended quantile(q) = (1 - alpha) * head(q) + alpha * retrieval(q)      (in log(1 + tokens))
    point estimate = blended median; then every quantile's distance from the median is scaled by
    `spread`, chosen on val so that 80% of true lengths fall inside [p10, p90]
    bins (point = "mode_bin", ours): bin probabilities = (1 - alpha) * head's softmax + alpha *
    the neighbours' weighted bin votes; the point estimate is the blended median moved to the
    nearest length inside the most probable bin (unchanged when it is already there); the
    quantiles stay the blend's, so the point can fall outside [p10, p90] when the bin votes
    and the quantiles disagree

ALISE switches between the two (retrieval when a neighbour clears the threshold, else the
MLP); averaging quantiles with a weight that grows with the evidence is the smooth version of
that rule: one exact repeat (w = 1) already outweighs the head when kappa < 1, several close
neighbours more so, and weak neighbours barely move it. The four parameters are chosen on the
validation split by `fit_blend` (never on the held-out test split); the chosen values and the
accuracy of head alone, retrieval alone and the blend are written to the model's metrics.json.

Why `mode_bin`: ALISE scores a prediction by whether it lands in the true length's 100-token
bin. With a wide length distribution (ShareGPT answers span 50 to 650 tokens for similar
prompts) the bin holding the median is often not the most probable one, so the median scores
below the mode. The mode-bin point keeps the median whenever the median's bin is the most
probable and otherwise moves it the least distance that lands in that bin; measured on the
held-out split in docs/results/predictor.md. `median` is ALISE's regression output.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from predictor_service.retrieval import Neighbours
from sluice.contract.length_prediction import BUCKET_WIDTH, NUM_BUCKETS, length_bucket

POINTS = ("median", "mode_bin")

_GRID = np.linspace(0.0, np.log1p(16384.0), 257)  # log(1 + tokens) from 0 to 16k tokens


@dataclass(frozen=True, slots=True)
class BlendConfig:
    k: int = 8
    threshold: float = 0.8
    temperature: float = 0.05
    kappa: float = 0.5
    bandwidth: float = 0.25
    spread: float = 1.0  # widens (> 1) or narrows the quantiles around the median, calibrated on val
    point: str = "median"  # or "mode_bin" (see the module doc)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def neighbour_weights(nb: Neighbours, cfg: BlendConfig) -> np.ndarray:
    sims = nb.similarity.astype(np.float64)
    ok = np.isfinite(sims) & (sims >= cfg.threshold)
    return np.where(ok, np.exp((np.where(ok, sims, 1.0) - 1.0) / cfg.temperature), 0.0)


def retrieval_quantiles(nb: Neighbours, weights: np.ndarray, levels: Sequence[float], bandwidth: float) -> np.ndarray:
    """[B, L] quantiles of the weighted logistic-kernel mixture (rows without weight: zeros)."""
    total = weights.sum(axis=1, keepdims=True)
    z = (_GRID[None, None, :] - nb.log_length[:, :, None].astype(np.float64)) / bandwidth
    cdf = (weights[:, :, None] / np.maximum(total, 1e-12)[:, :, None] / (1.0 + np.exp(-z))).sum(axis=1)
    out = np.zeros((len(weights), len(levels)))
    for b in np.flatnonzero(total[:, 0] > 0):
        out[b] = np.interp(levels, cdf[b], _GRID)
    return out


def blend(
    head_q: np.ndarray, nb: Neighbours, cfg: BlendConfig, levels: Sequence[float]
) -> tuple[np.ndarray, np.ndarray]:
    """(blended log quantiles [B, L], alpha [B])."""
    weights = neighbour_weights(nb, cfg)
    total = weights.sum(axis=1)
    alpha = total / (total + cfg.kappa)
    retr = retrieval_quantiles(nb, weights, levels, cfg.bandwidth)
    mixed = (1.0 - alpha)[:, None] * head_q + alpha[:, None] * retr
    median = mixed[:, [list(levels).index(0.5)]]
    return median + cfg.spread * (mixed - median), alpha


def to_tokens(log_q: np.ndarray) -> np.ndarray:
    return np.maximum(1, np.rint(np.expm1(np.maximum(log_q, 0.0)))).astype(np.int64)


def bin_probabilities(head_probs: np.ndarray, nb: Neighbours, cfg: BlendConfig) -> np.ndarray:
    """[B, bins]: the head's bin probabilities mixed with the neighbours' weighted bin votes
    (the same weights and alpha as the quantile blend)."""
    weights = neighbour_weights(nb, cfg)
    total = weights.sum(axis=1)
    alpha = total / (total + cfg.kappa)
    bins = length_bucket(np.rint(np.expm1(nb.log_length.astype(np.float64))).astype(np.int64))
    votes = np.stack([(weights * (bins == j)).sum(axis=1) for j in range(head_probs.shape[1])], axis=1)
    votes /= np.maximum(total, 1e-12)[:, None]
    return (1.0 - alpha)[:, None] * head_probs + alpha[:, None] * votes


def mode_bin_point(median_tokens: np.ndarray, probs: np.ndarray, width: int = BUCKET_WIDTH) -> np.ndarray:
    """The median moved to the nearest length inside the most probable bin (the last bin open)."""
    b = probs.argmax(axis=1)
    lo = np.maximum(b * width, 1)
    hi = np.where(b >= probs.shape[1] - 1, np.iinfo(np.int64).max, (b + 1) * width - 1)
    return np.clip(np.asarray(median_tokens, dtype=np.int64), lo, hi)


def point_tokens(
    log_q: np.ndarray, head_probs: np.ndarray | None, nb: Neighbours, cfg: BlendConfig, median_at: int
) -> np.ndarray:
    """The point estimate of each row: the blended median, or with `mode_bin` (and a head that
    has bins) the median moved into the most probable bin."""
    median = to_tokens(log_q[:, median_at])
    if cfg.point == "median" or head_probs is None:
        return median
    if cfg.point != "mode_bin":
        raise ValueError(f"point must be one of {POINTS}, got {cfg.point!r}")
    return mode_bin_point(median, bin_probabilities(head_probs, nb, cfg))


# Candidates searched on the validation split.
SEARCH_SPACE = {
    "threshold": (0.5, 0.6, 0.7, 0.8, 0.9, 0.95),
    "temperature": (0.02, 0.05, 0.1, 0.2),
    "kappa": (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 1e9),
    "bandwidth": (0.15, 0.3),
}


def fit_blend(
    head_q: np.ndarray,
    nb: Neighbours,
    score: Callable[[np.ndarray], float],
    levels: Sequence[float],
    k: int,
    head_probs: np.ndarray | None = None,
    point: str = "median",
) -> tuple[BlendConfig, float]:
    """The configuration maximising `score(point tokens)` on a validation set (kappa 1e9 = head alone)."""
    median_at = list(levels).index(0.5)
    best: tuple[float, BlendConfig] | None = None
    bins = length_bucket(np.rint(np.expm1(nb.log_length.astype(np.float64))).astype(np.int64))
    for thr, temp, bw in itertools.product(
        SEARCH_SPACE["threshold"], SEARCH_SPACE["temperature"], SEARCH_SPACE["bandwidth"]
    ):
        base = BlendConfig(k, thr, temp, 1.0, bw, point=point)
        weights = neighbour_weights(nb, base)
        total = weights.sum(axis=1)
        retr = retrieval_quantiles(nb, weights, [0.5], bw)[:, 0]
        if point == "mode_bin" and head_probs is not None:
            votes = np.stack([(weights * (bins == j)).sum(axis=1) for j in range(NUM_BUCKETS)], axis=1)
            votes /= np.maximum(total, 1e-12)[:, None]
        for kappa in SEARCH_SPACE["kappa"]:
            alpha = total / (total + kappa)
            tokens = to_tokens((1 - alpha) * head_q[:, median_at] + alpha * retr)
            if point == "mode_bin" and head_probs is not None:
                tokens = mode_bin_point(tokens, (1 - alpha)[:, None] * head_probs + alpha[:, None] * votes)
            value = score(tokens)
            if best is None or value > best[0]:
                best = (value, BlendConfig(k, thr, temp, kappa, bw, point=point))
    assert best is not None
    return best[1], best[0]


SPREADS = (0.8, 0.9, 1.0, 1.1, 1.2, 1.35, 1.5, 1.75, 2.0, 2.5)


def calibrate_spread(
    head_q: np.ndarray, nb: Neighbours, cfg: BlendConfig, levels: Sequence[float], true_tokens: np.ndarray
) -> tuple[BlendConfig, float]:
    """The spread whose [p10, p90] holds the share of true lengths nearest 0.8 on val; (config, coverage)."""
    lo, hi = list(levels).index(0.1), list(levels).index(0.9)
    best: tuple[float, float, float] | None = None
    for spread in SPREADS:
        log_q, _ = blend(head_q, nb, replace(cfg, spread=spread), levels)
        q = to_tokens(log_q)
        covered = float(np.mean((q[:, lo] <= true_tokens) & (true_tokens <= q[:, hi])))
        if best is None or abs(covered - 0.8) < abs(best[1] - 0.8):
            best = (spread, covered, 0.0)
    assert best is not None
    return replace(cfg, spread=best[0]), best[1]
