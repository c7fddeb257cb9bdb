"""Length sources: where a request's predicted output length comes from, applied by the
Cluster when a request is submitted (so the simulator and the live service share the rule).

    max_tokens     no prediction: policies plan with the request's max_tokens
    oracle         the true length (simulation only: the trace knows it)
    noisy_oracle   the true length times (1 + N(0, error)), clipped to [1, max_tokens]
    given          keep what the request carries (live: the client's field or the predictor's
                   answer, set at intake), else no prediction
    table          precomputed predictions by request id (a predictor run over a trace's prompts)
    online         the predictor at submission, its history learning each finished request's
                   true length (services/predictor_lengths.py), as the live service's does

A request that already carries a prediction keeps it, so a request re-routed after a lost
worker or a returned slice is never predicted twice.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar

import numpy as np

from scheduler_service.core.request import Request


class LengthSource(ABC):
    name: ClassVar[str] = "abstract"

    def assign(self, request: Request) -> None:
        if request.predicted_output_tokens is not None:
            return
        predicted = self.predict(request)
        if predicted is not None:
            request.predicted_output_tokens = int(min(request.max_tokens, max(1, predicted)))
            request.length_source = self.name

    @abstractmethod
    def predict(self, request: Request) -> int | None:
        """Predicted output tokens, or None for none."""

    def observe(self, request: Request) -> None:
        """A request ended; a source that learns (the predictor's history, ALISE's Algorithm 1
        line 12) records its true length here. Most sources learn nothing."""


class MaxTokensLengths(LengthSource):
    name = "max_tokens"

    def predict(self, request: Request) -> int | None:
        return None


class GivenLengths(MaxTokensLengths):
    """Whatever the request already carries (set before submission)."""

    name = "given"


class OracleLengths(LengthSource):
    name = "oracle"

    def predict(self, request: Request) -> int | None:
        if request.true_output_tokens is None:
            raise ValueError(f"the oracle length source needs the true length of {request.request_id!r}")
        return request.true_output_tokens


class NoisyOracleLengths(OracleLengths):
    """A symmetric Gaussian error around the truth (a crude stand-in for a real predictor)."""

    name = "noisy_oracle"

    def __init__(self, relative_error: float, seed: int) -> None:
        self.relative_error = relative_error
        self._rng = np.random.default_rng(seed)

    def predict(self, request: Request) -> int | None:
        true_out = super().predict(request)
        assert true_out is not None
        return round(true_out * (1.0 + self._rng.normal(0.0, self.relative_error)))


class TableLengths(LengthSource):
    """Predictions computed ahead of the run (e.g. the predictor over a trace's prompt texts)."""

    def __init__(self, predictions: Mapping[str, int], name: str = "predictor") -> None:
        self.predictions = predictions
        self.name = name  # type: ignore[misc]

    def predict(self, request: Request) -> int | None:
        return self.predictions.get(request.request_id)


BUILTIN_LENGTH_SOURCES = ("max_tokens", "oracle", "noisy_oracle", "given")


def build_length_source(name: str, *, relative_error: float = 0.2, seed: int = 0) -> LengthSource:
    if name == "max_tokens":
        return MaxTokensLengths()
    if name == "oracle":
        return OracleLengths()
    if name == "noisy_oracle":
        return NoisyOracleLengths(relative_error, seed)
    if name == "given":
        return GivenLengths()
    raise ValueError(f"unknown length source {name!r}; known: {', '.join(BUILTIN_LENGTH_SOURCES)}")
