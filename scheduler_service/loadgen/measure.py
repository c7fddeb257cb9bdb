"""A bench run measured with the simulator's definitions: a MetricsRecorder
(scheduler_service.core.metrics) fed with one Request rebuilt per record, so `sluice bench`
writes the `sluice simulate --json` document. Metrics only the server sees (compute and KV
utilization, scheduling overhead, load imbalance, KV allocation failures) are null; preemptions
come from each request's final timings."""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from scheduler_service.loadgen.requests import RequestRecord

if TYPE_CHECKING:
    from scheduler_service.sim.simulator import SimRun

SERVER_ONLY_METRICS = ("compute_util_mean", "kv_util_mean", "kv_used_mean", "kv_alloc_failures", "load_imbalance_s")


def _reject_reason(message: str) -> Any:
    from scheduler_service.core.preemption import RejectReason

    return next((r for r in RejectReason if r.value in message), RejectReason.QUEUE_FULL)


def _final_status(record: RequestRecord) -> Any:
    from scheduler_service.core.request import RequestStatus

    if record.error_code:
        return (
            RequestStatus.FINISHED_TIMEOUT if record.error_code == "DEADLINE_EXCEEDED" else RequestStatus.FINISHED_ERROR
        )
    by_reason = {
        "stop": RequestStatus.FINISHED_STOPPED,
        "length": RequestStatus.FINISHED_LENGTH,
        "abort": RequestStatus.FINISHED_ABORTED,
        "timeout": RequestStatus.FINISHED_TIMEOUT,
    }
    status = by_reason.get(record.finish_reason or "", RequestStatus.FINISHED_ERROR)
    if status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH) and not record.token_times:
        return RequestStatus.FINISHED_ERROR  # a completion without a token cannot be measured
    return status


def _is_rejected(record: RequestRecord) -> bool:
    return record.error_code == "RESOURCE_EXHAUSTED" or record.finish_reason == "rejected"


def record_metrics(records: Sequence[RequestRecord]) -> Any:
    """A MetricsRecorder fed with one rebuilt Request per record (the simulator's definitions)."""
    from scheduler_service.core.metrics import MetricsRecorder
    from scheduler_service.core.request import Request, RequestStatus
    from sluice.contract.sampling import SamplingParams

    recorder = MetricsRecorder()
    for rec in records:
        r = rec.request
        request = Request(
            r.request_id,
            arrival_time=rec.sent_s,
            num_prompt_tokens=rec.prompt_tokens or r.num_prompt_tokens,
            sampling=SamplingParams(max_tokens=r.max_tokens),
            slo=r.slo,
            priority=r.priority,
            tenant=r.tenant,
        )
        if _is_rejected(rec):
            request.status = RequestStatus.FINISHED_REJECTED
            recorder.on_reject(request, _reject_reason(rec.message), rec.end_s)
            continue
        recorder.on_admitted(request)
        request.token_times = array("d", rec.token_times)
        request.num_output_tokens = len(rec.token_times)
        if rec.timings is not None:
            request.queue_time = rec.timings.queue_s
            request.num_preemptions = rec.timings.num_preemptions
            if rec.timings.num_preemptions:
                recorder.preemptions[("unknown", "unknown")] += rec.timings.num_preemptions
        request.status = _final_status(rec)
        recorder.on_finish(request, rec.token_times[-1] if rec.token_times else rec.end_s)
    return recorder


def summarize(
    records: Sequence[RequestRecord], *, policy: str, workload: str, config: dict[str, Any] | None = None
) -> SimRun:
    """The run as a SimRun: `metrics` has exactly the simulator's keys (server-only ones null),
    `details` the recorder's details plus the client's view (errors by gRPC code)."""
    from scheduler_service.sim.simulator import SimRun

    recorder = record_metrics(records)
    metrics = recorder.summary()
    for key in SERVER_ONLY_METRICS:
        metrics[key] = None
    metrics["sched_overhead_ms"] = {"mean": None, "p99": None}
    details = recorder.details()
    details["client"] = {
        "errors_by_code": dict(Counter(r.error_code for r in records if r.error_code)),
        "finish_reasons": dict(Counter(r.finish_reason for r in records if r.finish_reason)),
        "measured_by": "client",
    }
    return SimRun(policy=policy, workload=workload, config=dict(config or {}), metrics=metrics, details=details)
