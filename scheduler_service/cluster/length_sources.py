"""Length sources: where a request's predicted output length comes from, applied by the
Cluster when a request is submitted (so the simulator and the live service share the rule).

    max_tokens     no prediction: policies plan with the request's max_tokens
    oracle         the true length (simulation only: the trace knows it)
    noisy_oracle   the true length times (1 + N(0, error)), clipped to [1, max_tokens]
    given          keep what the request carries (live: the client's field or the predictor's
                   answer, set at intake), else no prediction
    table          precomputed predictions by request id (a predictor run over a trace's prompts)
    online         a predictor asked at submission, told each true length when a request
                   stops on its own (LearningLengths; the simulator's `predictor-online` wraps
                   predictor_service.trace_lengths.OnlineTracePredictor), as the live
                   service's predictor learns

A request that already carries a prediction keeps it, so a request re-routed after a lost
worker or a returned slice is never predicted twice.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar, Protocol

import numpy as np

from scheduler_service.core.request import Request, RequestStatus


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


class LearningPredictor(Protocol):
    num_observed: int

    def predict(self, request_id: str) -> int | None: ...

    def observe(self, request_id: str, output_tokens: int) -> None: ...


class LearningLengths(LengthSource):
    """A predictor asked when each request is submitted and told each request's true length
    when it ends on its own."""

    name = "predictor-online"  # type: ignore[assignment]

    def __init__(self, predictor: LearningPredictor) -> None:
        self.predictor = predictor

    def predict(self, request: Request) -> int | None:
        return self.predictor.predict(request.request_id)

    def observe(self, request: Request) -> None:
        # NOTE: only a request that stopped on its own: a length cut at max_tokens is a lower
        # bound and an abort says nothing (the live predictor's rule)
        if request.status is RequestStatus.FINISHED_STOPPED:
            self.predictor.observe(request.request_id, request.num_output_tokens)


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
