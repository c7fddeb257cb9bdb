"""Output-length predictions as the scheduler and the simulator see them (numpy at most).

    predictor service --Predict--> LengthPrediction(tokens, quantiles, source, version, latency)
    held-out errors (`sluice predictor train|eval`) --LengthErrorModel.fit--> error_model.json
    simulator, trace without text --LengthErrorModel.sample(true_len, rng)--> LengthPrediction

`tokens` is the point estimate a policy allocates or ranks by (the predicted median); the
quantiles say how sure the predictor is (EconoServe's padding, ALISE's demotion). The error
model replays the predictor's own held-out errors, as ratios predicted/true drawn from the
examples whose true length fell in the same length bucket: skewed and heavy-tailed as the
real errors are, where a symmetric Gaussian would not be.

The bucket rule of ALISE's Table 2 lives here too (`length_bucket`, `bucket_accuracy`), so the
predictor's evaluation and any analysis in the simulator judge accuracy the same way.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# ALISE's accuracy rule: equal 100-token bins, the last one open ([900, inf) with 10 bins).
BUCKET_WIDTH = 100
NUM_BUCKETS = 10

SOURCE_CACHE = "cache"
SOURCE_RETRIEVAL = "retrieval"
SOURCE_HEAD = "head"
SOURCE_BLEND = "blend"
SOURCE_FALLBACK = "fallback"
SOURCE_ERROR_MODEL = "error_model"


@dataclass(frozen=True, slots=True)
class LengthPrediction:
    """A predicted output length in tokens with its uncertainty.

    `quantiles` is ((level, tokens), ...) by ascending level, e.g. ((0.1, 40), (0.5, 120),
    (0.9, 400)); `tokens` is the point estimate (the median unless a caller clips it)."""

    tokens: int
    quantiles: tuple[tuple[float, int], ...] = ()
    source: str = SOURCE_HEAD
    predictor_version: str = ""
    latency_s: float = 0.0

    def quantile(self, level: float) -> int:
        """Tokens at `level`, interpolated linearly between the given quantiles (clamped at the ends)."""
        if not self.quantiles:
            return self.tokens
        levels = [q for q, _ in self.quantiles]
        values = [v for _, v in self.quantiles]
        return round(float(np.interp(level, levels, values)))

    @property
    def p10(self) -> int:
        return self.quantile(0.1)

    @property
    def p50(self) -> int:
        return self.quantile(0.5)

    @property
    def p90(self) -> int:
        return self.quantile(0.9)

    def clipped(self, max_tokens: int) -> LengthPrediction:
        """The same prediction with every value capped at `max_tokens` (a request never runs longer)."""
        if max_tokens <= 0:
            return self
        quantiles = tuple((q, min(v, max_tokens)) for q, v in self.quantiles)
        return LengthPrediction(
            min(self.tokens, max_tokens), quantiles, self.source, self.predictor_version, self.latency_s
        )

    def with_source(self, source: str, latency_s: float | None = None) -> LengthPrediction:
        latency = self.latency_s if latency_s is None else latency_s
        return LengthPrediction(self.tokens, self.quantiles, source, self.predictor_version, latency)

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "quantiles": [[q, v] for q, v in self.quantiles],
            "source": self.source,
            "predictor_version": self.predictor_version,
            "latency_s": self.latency_s,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LengthPrediction:
        quantiles = tuple((float(q), int(v)) for q, v in data.get("quantiles", ()))
        return cls(
            int(data["tokens"]),
            quantiles,
            str(data.get("source", SOURCE_HEAD)),
            str(data.get("predictor_version", "")),
            float(data.get("latency_s", 0.0)),
        )


def length_bucket(tokens: int | np.ndarray, width: int = BUCKET_WIDTH, num_buckets: int = NUM_BUCKETS) -> Any:
    """Index of the `width`-token bin a length falls in; the last of `num_buckets` bins is open."""
    return np.minimum(np.asarray(tokens) // width, num_buckets - 1)


def bucket_accuracy(
    true: Sequence[int] | np.ndarray,
    predicted: Sequence[int] | np.ndarray,
    width: int = BUCKET_WIDTH,
    num_buckets: int = NUM_BUCKETS,
) -> float:
    """Share of predictions whose bin is the true length's bin (ALISE, Table 2)."""
    t, p = np.asarray(true), np.asarray(predicted)
    if t.shape != p.shape or t.size == 0:
        raise ValueError(f"need two equal non-empty sequences, got {t.shape} and {p.shape}")
    return float(np.mean(length_bucket(t, width, num_buckets) == length_bucket(p, width, num_buckets)))


# Buckets of the error model: true lengths in [edge_i, edge_i+1) share a residual distribution.
ERROR_MODEL_EDGES = (1, 16, 32, 64, 128, 256, 512, 1024)


@dataclass
class LengthErrorModel:
    """The empirical distribution of the predictor's held-out errors by true-length bucket.

    Each row of `residuals[b]` is one held-out example whose true length fell in bucket b:
    log(point / true) followed by log(quantile / true) for each of `levels`. `sample`
    draws a row of the true length's bucket and applies it to the true length, so a
    simulated prediction errs exactly as often, as far and as one-sidedly as the real one."""

    levels: tuple[float, ...]
    edges: tuple[int, ...] = ERROR_MODEL_EDGES
    residuals: list[np.ndarray] = field(default_factory=list)
    predictor_version: str = ""
    description: str = ""

    @classmethod
    def fit(
        cls,
        true: Sequence[int] | np.ndarray,
        predictions: Sequence[LengthPrediction],
        *,
        predictor_version: str = "",
        description: str = "",
        max_per_bucket: int = 2000,
        seed: int = 0,
    ) -> LengthErrorModel:
        if not predictions:
            raise ValueError("fit needs at least one prediction")
        levels = tuple(q for q, _ in predictions[0].quantiles)
        t = np.maximum(np.asarray(true, dtype=np.float64), 1.0)
        rows = np.array([[p.tokens, *(v for _, v in p.quantiles)] for p in predictions], dtype=np.float64)
        logs = np.log(np.maximum(rows, 1.0)) - np.log(t)[:, None]
        model = cls(levels, ERROR_MODEL_EDGES, [], predictor_version, description)
        which = model._bucket_of(t)
        rng = np.random.default_rng(seed)
        for b in range(len(model.edges)):
            chosen = logs[which == b]
            if len(chosen) > max_per_bucket:
                chosen = chosen[rng.choice(len(chosen), max_per_bucket, replace=False)]
            model.residuals.append(chosen.astype(np.float32))
        return model

    def _bucket_of(self, true: np.ndarray) -> np.ndarray:
        return np.clip(np.searchsorted(np.asarray(self.edges), true, side="right") - 1, 0, len(self.edges) - 1)

    def _rows_near(self, bucket: int) -> np.ndarray:
        """The bucket's residuals, else the nearest non-empty bucket's."""
        order = sorted(range(len(self.residuals)), key=lambda b: (abs(b - bucket), b))
        for b in order:
            if len(self.residuals[b]):
                return self.residuals[b]
        raise ValueError("the error model has no residuals")

    def sample(self, true_len: int, rng: np.random.Generator) -> LengthPrediction:
        """A prediction for a request whose true output length is `true_len`, erring as the predictor does."""
        rows = self._rows_near(int(self._bucket_of(np.array([max(true_len, 1)]))[0]))
        row = rows[int(rng.integers(len(rows)))]
        values = [max(1, round(max(true_len, 1) * math.exp(float(r)))) for r in row]
        quantiles = tuple(zip(self.levels, sorted(values[1:]), strict=True))
        return LengthPrediction(values[0], quantiles, SOURCE_ERROR_MODEL, self.predictor_version, 0.0)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "sluice.length_error_model",
            "description": self.description,
            "predictor_version": self.predictor_version,
            "levels": list(self.levels),
            "edges": list(self.edges),
            "columns": ["log(point/true)", *(f"log(q{q:g}/true)" for q in self.levels)],
            "residuals": [np.round(r, 4).tolist() for r in self.residuals],
        }

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_json(), separators=(",", ":")))
        return path

    @classmethod
    def load(cls, path: str | Path) -> LengthErrorModel:
        data = json.loads(Path(path).read_text())
        if data.get("kind") != "sluice.length_error_model":
            raise ValueError(f"{path} is not a length error model")
        width = 1 + len(data["levels"])
        residuals = [np.asarray(r, dtype=np.float32).reshape(-1, width) for r in data["residuals"]]
        return cls(
            tuple(data["levels"]), tuple(data["edges"]), residuals, data["predictor_version"], data["description"]
        )
