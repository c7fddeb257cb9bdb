"""LiveMetrics: the simulator's MetricsRecorder, plus the live service's traces and Prometheus.

    core events (admitted, preempted, rejected, finished) --> MetricsRecorder (same definitions
                                                               as the simulator)
                                                          --> RequestTrace of the request
                                                          --> ServingMetrics (when given)

The core already reports every event these need, so tracing and Prometheus hang off the
recorder instead of adding hooks to the core. Both are optional: without `setup_tracing`
a RequestTrace is a non-recording span (a few hundred ns), and `serving` may be None.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from scheduler_service.core.admission import Decision
from scheduler_service.core.metrics import MetricsRecorder
from scheduler_service.core.preemption import PreemptionMode, PreemptionReason, RejectReason
from scheduler_service.core.request import Request, RequestStatus
from sluice.common.telemetry import RequestTrace
from sluice.contract.length_prediction import LengthPrediction

if TYPE_CHECKING:
    from sluice.common.prom import ServingMetrics

_COMPLETED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)


class LiveMetrics(MetricsRecorder):
    def __init__(self, model: str, policy: str, serving: ServingMetrics | None = None) -> None:
        super().__init__()
        self.model = model
        self.policy = policy
        self.serving = serving
        self.traces: dict[str, RequestTrace] = {}
        self.length_predictions: dict[str, LengthPrediction] = {}  # the predictor's answers, by request

    def initialise_series(self, workers: Sequence[str]) -> None:
        """Every labelled Prometheus series at zero from the start (modes, reasons, workers)."""
        if self.serving is None:
            return
        self.serving.initialise(
            preemptions=[(m, r) for m in PreemptionMode for r in PreemptionReason],
            rejections=list(RejectReason),
            workers=workers,
        )
        for worker in workers:
            self.serving.set_worker_up(worker, True)

    def on_stream_end(self, request: Request) -> None:
        """An accepted request ended (its stream gets its last message or status)."""
        if self.serving is not None:
            self.serving.inc_finished(request.status.finish_reason or "error")

    def on_worker(self, worker_id: int, *, up: bool) -> None:
        if self.serving is not None:
            self.serving.set_worker_up(str(worker_id), up)

    def on_worker_removed(self, worker_id: int) -> None:
        if self.serving is not None:
            self.serving.remove_worker(str(worker_id))

    def on_reconnect(self, worker_id: int) -> None:
        if self.serving is not None:
            self.serving.inc_reconnect(str(worker_id))

    # ------------------------------------------------------------------ request spans
    def start_trace(self, request: Request, labels: Mapping[str, str] | None = None) -> RequestTrace:
        sp = request.sampling
        slo = request.slo
        attrs: dict[str, Any] = {
            "model": self.model,
            "max_tokens": sp.max_tokens,
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "top_k": sp.top_k,
            "input_tokens": request.num_prompt_tokens,
            "sluice.policy": self.policy,
            "sluice.priority": request.priority,
            "sluice.slo.class": str(slo.effective_class),
            "sluice.length_source": request.length_source,
        }
        if sp.seed is not None:
            attrs["seed"] = sp.seed
        for name in ("ttft_s", "tbt_s", "jct_s"):
            if getattr(slo, name) is not None:
                attrs[f"sluice.slo.{name}"] = getattr(slo, name)
        if request.predicted_output_tokens is not None:
            attrs["sluice.predicted_output_tokens"] = request.predicted_output_tokens
        for key, value in (labels or {}).items():
            attrs[f"sluice.label.{key}"] = value
        trace = RequestTrace(request.request_id, attrs)
        trace.phase("queue")
        self.traces[request.request_id] = trace
        request.traceparent = trace.traceparent()
        return trace

    def on_scheduled(self, request: Request, prefill: bool | None = None) -> None:
        """The request is in this step's batch: its span leaves the queue phase. `prefill`: whether
        the step computes its prefill (given when the plan already committed the step: overlap)."""
        trace = self.traces.get(request.request_id)
        if trace is not None and trace.current_phase != "decode":
            is_prefill = request.is_prefill if prefill is None else prefill
            trace.phase("prefill" if is_prefill else "decode")

    def on_first_token(self, request: Request) -> None:
        trace = self.traces.get(request.request_id)
        if trace is not None:
            trace.phase("decode")

    # ------------------------------------------------------------------ core events
    def on_preempt(self, request: Request, mode: PreemptionMode, reason: PreemptionReason, now: float) -> None:
        super().on_preempt(request, mode, reason, now)
        trace = self.traces.get(request.request_id)
        if trace is not None:
            trace.event("preemption", {"mode": str(mode), "reason": str(reason)})
            if mode is PreemptionMode.SWAP:
                trace.event("swap", {"direction": "out"})
            trace.phase("queue")
        if self.serving is not None:
            self.serving.inc_preemption(str(mode), str(reason))

    def on_admission(self, request: Request, decision: Decision, why: str) -> None:
        """The admission decision on the request's span and in the admission counter; `why` is
        the counter's reason for an admitted request (slo, no_slo, offline, off)."""
        trace = self.traces.get(request.request_id)
        reason = decision.reason or why
        if trace is not None:
            attrs: dict[str, Any] = {"sluice.admission": "admit" if decision.admit else "refuse"}
            attrs["sluice.admission.reason"] = reason
            if decision.estimate is not None:
                attrs["sluice.admission.ttft_estimate_s"] = decision.estimate.ttft_s
                attrs["sluice.admission.tbt_estimate_s"] = decision.estimate.tbt_s
                attrs["sluice.admission.batch"] = decision.estimate.batch
            for key, value in attrs.items():
                trace.span.set_attribute(key, value)
        if self.serving is not None:
            self.serving.inc_admission("admit" if decision.admit else "refuse", reason)

    def on_reject(self, request: Request, reason: RejectReason, now: float) -> None:
        super().on_reject(request, reason, now)
        if self.serving is not None:
            self.serving.inc_rejected(str(reason))
        self._end_trace(request, error=f"rejected: {reason}")

    def on_finish(self, request: Request, now: float) -> None:
        super().on_finish(request, now)
        if self.serving is not None and request.status in _COMPLETED:
            self._observe(request)
        ok = request.status in _COMPLETED or request.status is RequestStatus.FINISHED_ABORTED
        self._end_trace(request, error=None if ok else (request.finish_message or request.status.name))

    def _observe(self, request: Request) -> None:
        serving = self.serving
        assert serving is not None
        times = request.token_times
        arrival = request.arrival_time
        serving.observe_ttft(times[0] - arrival)
        serving.observe_e2e(times[-1] - arrival)
        serving.observe_queue(request.queue_time)
        for a, b in itertools.pairwise(times):
            serving.observe_itl(b - a)
        if len(times) > 1:
            serving.observe_tpot((times[-1] - times[0]) / (len(times) - 1))
        serving.inc_tokens(request.num_prompt_tokens, len(times))

    # ------------------------------------------------------------------ length predictions
    def on_length_prediction(self, request: Request, prediction: LengthPrediction) -> None:
        """The predictor answered for a live request (after it was admitted)."""
        self.length_predictions[request.request_id] = prediction
        trace = self.traces.get(request.request_id)
        if trace is not None:
            attrs = {"tokens": prediction.tokens, "source": prediction.source, "latency_s": prediction.latency_s}
            trace.event("length_prediction", attrs)

    def _length_attributes(self, request: Request) -> dict[str, Any]:
        prediction = self.length_predictions.pop(request.request_id, None)
        if prediction is None:
            return {"sluice.length_source": request.length_source}
        error = prediction.tokens - request.num_output_tokens
        if self.serving is not None and request.status in _COMPLETED:
            self.serving.observe_length_error(abs(error))
        return {
            "sluice.length_source": request.length_source,
            "sluice.length.predicted_tokens": prediction.tokens,
            "sluice.length.error_tokens": error,
        }

    def _end_trace(self, request: Request, error: str | None) -> None:
        length = self._length_attributes(request)
        trace = self.traces.pop(request.request_id, None)
        if trace is None:
            return
        trace.finish(
            {
                "output_tokens": request.num_output_tokens,
                "finish_reasons": [request.status.finish_reason or "unknown"],
                "sluice.preemptions": request.num_preemptions,
                "sluice.queue_time_s": request.queue_time,
                **length,
            },
            error=error,
        )
