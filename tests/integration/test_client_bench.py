"""`sluice bench` without a server: requests built from a real trace slice (clipped to the
model's context), and the metrics JSON built from client-side timestamps with the
simulator's MetricsRecorder definitions."""

from __future__ import annotations

from array import array

import pytest

from scheduler_service.core.metrics import METRIC_KEYS, MetricsRecorder
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.slo import NO_SLO, SLOSpec
from scheduler_service.loadgen.measure import summarize
from scheduler_service.loadgen.requests import (
    PROMPT_TOKEN_BASE,
    PROMPT_TOKEN_SPAN,
    BenchRequest,
    RequestRecord,
    prepare_requests,
)
from scheduler_service.workloads import load_trace
from sluice.common.client import Timings
from sluice.contract.sampling import SamplingParams

SLO = SLOSpec(ttft_s=0.5, tbt_s=0.1)


def record(rid: str, sent: float, times: list[float], slo: SLOSpec = SLO, **kw: object) -> RequestRecord:
    request = BenchRequest(rid, sent, (PROMPT_TOKEN_BASE,) * 8, 8, len(times) or 4, slo)
    rec = RequestRecord(request, sent_s=sent, end_s=(times[-1] if times else sent + 0.01), token_times=list(times))
    rec.finish_reason = kw.pop("finish_reason", "length")  # type: ignore[assignment]
    rec.prompt_tokens = 8
    for key, value in kw.items():
        setattr(rec, key, value)
    return rec


def test_prepare_requests_clips_a_real_trace_to_the_model_context() -> None:
    workload = load_trace("arxiv", num_requests=40)
    requests = prepare_requests(workload, 2048, max_tokens=64, oracle_lengths=True)
    assert len(requests) == 40
    assert any(tr.prompt_tokens > 2047 for tr in workload.requests), "the slice must exercise clipping"
    for tr, r in zip(workload.requests, requests, strict=True):
        assert r.num_prompt_tokens == min(tr.prompt_tokens, 2047)
        assert 1 <= r.max_tokens <= min(tr.output_tokens, 64, 2048 - r.num_prompt_tokens)
        assert r.ignore_eos, "oracle lengths run to exactly the trace's length"
        assert isinstance(r.prompt, tuple) and len(r.prompt) == r.num_prompt_tokens
        assert all(PROMPT_TOKEN_BASE <= t < PROMPT_TOKEN_BASE + PROMPT_TOKEN_SPAN for t in r.prompt)
    assert requests[0].prompt != requests[1].prompt[: len(requests[0].prompt)], "prompts differ between requests"


def test_prepare_requests_hides_the_true_length_unless_told() -> None:
    workload = load_trace("azure-conv", num_requests=40)
    blind = prepare_requests(workload, 2048)
    capped = prepare_requests(workload, 2048, max_tokens=300)
    assert len({tr.output_tokens for tr in workload.requests}) > 10, "the slice must have varied lengths"
    for r, c in zip(blind, capped, strict=True):
        assert r.max_tokens == 2048 - r.num_prompt_tokens, "max_tokens is the context left, not the true length"
        assert c.max_tokens == min(300, 2048 - c.num_prompt_tokens)
        assert not r.ignore_eos and not c.ignore_eos, "the model decides when to stop"
    oracle = prepare_requests(workload, 2048, oracle_lengths=True)
    assert [r.max_tokens for r in oracle] == [
        min(tr.output_tokens, 2048 - r.num_prompt_tokens) for tr, r in zip(workload.requests, oracle, strict=True)
    ]


def test_prepare_requests_needs_text_when_asked_for_it() -> None:
    workload = load_trace("arxiv", num_requests=2)
    with pytest.raises(ValueError, match="no prompt text"):
        prepare_requests(workload, 2048, prompt_source="text")


def test_summary_has_exactly_the_simulators_keys_with_server_only_ones_null() -> None:
    run = summarize([record("a", 0.0, [0.2, 0.25, 0.3])], policy="vllm", workload="w", config={"mode": "live"})
    doc = run.to_json()
    assert set(doc) == {"policy", "workload", "config", "metrics", "details"}
    assert tuple(doc["metrics"]) == METRIC_KEYS
    for key in ("compute_util_mean", "kv_util_mean", "kv_alloc_failures", "load_imbalance_s"):
        assert doc["metrics"][key] is None
    assert doc["metrics"]["sched_overhead_ms"] == {"mean": None, "p99": None}
    assert doc["details"]["client"]["measured_by"] == "client"


def test_client_timestamps_give_the_simulators_latencies_and_attainment() -> None:
    records = [
        record("fast", 0.0, [0.2, 0.25, 0.3, 0.35]),  # meets TTFT and TBT
        record("slow-first", 1.0, [1.8, 1.85]),  # TTFT 0.8 s misses
        record(
            "preempted",
            2.0,
            [2.1, 2.4],
            timings=Timings(0.05, 0.1, 0.4, 0.3, 0.3, 2, False),
        ),  # gap 0.3 s misses TBT
        record("full", 3.0, [], finish_reason=None, error_code="RESOURCE_EXHAUSTED", message="queue_full: 256 waiting"),
        record("lost", 4.0, [], finish_reason="error", message="worker lost"),
    ]
    m = summarize(records, policy="vllm", workload="w").metrics
    assert m["num_requests"] == 5 and m["num_finished"] == 3
    assert m["ttft_s"]["p50"] == pytest.approx(0.2)
    assert m["ttft_s"]["mean"] == pytest.approx((0.2 + 0.8 + 0.1) / 3)
    assert m["jct_s"]["mean"] == pytest.approx((0.35 + 0.85 + 0.4) / 3)
    assert m["tbt_s"]["p50"] == pytest.approx(0.05)
    assert m["slo_attainment_req"] == pytest.approx(1 / 5), "rejected and failed requests count as misses"
    assert m["slo_attainment_iter"] == pytest.approx((1 + 3 + 0 + 1 + 1 + 0) / (1 + 3 + 1 + 1 + 1 + 1))
    assert m["preemptions"] == 2
    assert m["throughput_tok_s"] == pytest.approx(8 / 4.01), "the window runs to the last ending, failed ones too"
    details = summarize(records, policy="vllm", workload="w").details
    assert details["rejected_by_reason"] == {"queue_full": 1}
    assert details["ended_by_status"]["FINISHED_ERROR"] == 1
    assert details["queue_time_s"]["p50"] == pytest.approx(0.0), "server queue time where the server gave it"


def test_bench_and_simulator_definitions_agree_on_the_same_timestamps() -> None:
    times = {"a": (0.0, [0.3, 0.32, 0.36]), "b": (0.5, [0.9, 1.0]), "c": (0.7, [1.5, 1.51, 1.6, 1.62])}
    sim = MetricsRecorder()
    for rid, (arrival, tokens) in times.items():
        request = Request(
            rid, arrival_time=arrival, num_prompt_tokens=8, sampling=SamplingParams(max_tokens=8), slo=SLO
        )
        sim.on_admitted(request)
        request.token_times = array("d", tokens)
        request.status = RequestStatus.FINISHED_LENGTH
        sim.on_finish(request, tokens[-1])
    live = summarize([record(rid, a, t) for rid, (a, t) in times.items()], policy="p", workload="w").metrics
    expected = sim.summary()
    for key in ("throughput_tok_s", "throughput_req_s", "goodput_req_s", "slo_attainment_iter", "slo_attainment_req"):
        assert live[key] == pytest.approx(expected[key]), key
    for key in ("ttft_s", "tbt_s", "jct_s"):
        assert live[key] == pytest.approx(expected[key]), key
    assert live["normalized_latency_s"] == pytest.approx(expected["normalized_latency_s"])


def test_a_request_without_slo_is_judged_met() -> None:
    m = summarize([record("a", 0.0, [5.0, 9.0], slo=NO_SLO)], policy="p", workload="w").metrics
    assert m["slo_attainment_req"] == 1.0 and m["slo_attainment_iter"] is None
