"""Prometheus metrics: vLLM's names with the sluice_ prefix, vLLM's buckets (queue time from
0.1 ms), labels by mode, reason and model with every labelled series present at zero from the
start, KV usage as a ratio, finished requests by reason, worker up/down and reconnects, the
worker's own metrics, one registry per metrics object, and /metrics served over HTTP."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sluice.common.prom import (
    FINISHED_REASONS,
    ITL_BUCKETS,
    PREDICTOR_FALLBACK_REASONS,
    QUEUE_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    ServingMetrics,
    WorkerMetrics,
    start_metrics_server,
    stop_metrics_server,
)

EXPECTED = {
    "sluice_time_to_first_token_seconds": "histogram",
    "sluice_inter_token_latency_seconds": "histogram",
    "sluice_request_time_per_output_token_seconds": "histogram",
    "sluice_e2e_request_latency_seconds": "histogram",
    "sluice_request_queue_time_seconds": "histogram",
    "sluice_num_requests_running": "gauge",
    "sluice_num_requests_waiting": "gauge",
    "sluice_kv_cache_usage_ratio": "gauge",
    "sluice_num_preemptions": "counter",
    "sluice_requests_rejected": "counter",
    "sluice_request_success": "counter",
    "sluice_predictor_fallbacks": "counter",
    "sluice_worker_up": "gauge",
    "sluice_worker_reconnects": "counter",
    "sluice_prompt_tokens": "counter",
    "sluice_generation_tokens": "counter",
    # ours: how far live length predictions landed from the observed lengths
    "sluice_length_prediction_error_tokens": "histogram",
    # ours: SLO-aware admission's decisions (admit / refuse, and why)
    "sluice_admission_decisions": "counter",
}


def families(metrics: ServingMetrics | WorkerMetrics) -> dict:
    return {m.name: m for m in metrics.registry.collect()}


def sample(metrics: ServingMetrics | WorkerMetrics, name: str, **labels: str) -> float:
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(f"{name} {labels}")


def test_metric_names_and_types_are_vllms_with_our_prefix() -> None:
    found = families(ServingMetrics("tiny-llama"))
    assert {name: f.type for name, f in found.items()} == EXPECTED
    assert all(":" not in name for name in found), "colons are reserved for recording rules"


def test_histograms_use_vllms_bucket_boundaries() -> None:
    m = ServingMetrics("m")
    m.observe_ttft(0.03)
    bounds = {
        "sluice_time_to_first_token_seconds": TTFT_BUCKETS,
        "sluice_inter_token_latency_seconds": ITL_BUCKETS,
        "sluice_e2e_request_latency_seconds": REQUEST_LATENCY_BUCKETS,
        "sluice_request_queue_time_seconds": QUEUE_BUCKETS,
    }
    for name, expected in bounds.items():
        les = [float(s.labels["le"]) for s in families(m)[name].samples if s.name.endswith("_bucket")]
        assert les == [*expected, float("inf")], name
    assert TTFT_BUCKETS[:3] == (0.001, 0.005, 0.01) and TTFT_BUCKETS[-1] == 2560.0
    assert QUEUE_BUCKETS[0] < 0.001, "an idle scheduler admits in microseconds"
    assert sample(m, "sluice_time_to_first_token_seconds_bucket", le="0.04") == 1
    assert sample(m, "sluice_time_to_first_token_seconds_bucket", le="0.02") == 0


def test_counters_and_gauges_carry_their_labels() -> None:
    m = ServingMetrics("tiny-llama")
    m.inc_preemption("swap", "kv_pressure")
    m.inc_preemption("swap", "kv_pressure")
    m.inc_preemption("recompute", "priority")
    m.inc_rejected("queue_full")
    m.inc_tokens(prompt=100, generation=7)
    m.set_running(3)
    m.set_waiting(9)
    m.set_kv_usage(0.25)
    total = "sluice_num_preemptions_total"
    assert sample(m, total, mode="swap", reason="kv_pressure", model_name="tiny-llama") == 2
    assert sample(m, total, mode="recompute", reason="priority") == 1
    assert sample(m, "sluice_requests_rejected_total", reason="queue_full") == 1
    assert sample(m, "sluice_prompt_tokens_total") == 100
    assert sample(m, "sluice_generation_tokens_total") == 7
    assert sample(m, "sluice_num_requests_running", model_name="tiny-llama") == 3
    assert sample(m, "sluice_num_requests_waiting") == 9
    assert sample(m, "sluice_kv_cache_usage_ratio") == 0.25


def test_labelled_series_exist_at_zero_before_any_event() -> None:
    m = ServingMetrics("tiny-llama")
    m.initialise(preemptions=[("swap", "kv_pressure")], rejections=["queue_full", "no_worker"], workers=["0", "1"])
    for reason in FINISHED_REASONS:
        assert sample(m, "sluice_request_success_total", finished_reason=reason) == 0
    for reason in PREDICTOR_FALLBACK_REASONS:
        assert sample(m, "sluice_predictor_fallbacks_total", reason=reason) == 0
    assert sample(m, "sluice_num_preemptions_total", mode="swap", reason="kv_pressure") == 0
    assert sample(m, "sluice_requests_rejected_total", reason="no_worker") == 0
    assert sample(m, "sluice_worker_reconnects_total", worker_id="1") == 0
    assert sample(m, "sluice_worker_up", worker_id="0") == 0


def test_finished_requests_worker_health_and_fallbacks_are_counted() -> None:
    m = ServingMetrics("tiny-llama")
    m.inc_finished("stop")
    m.inc_finished("stop")
    m.inc_finished("rejected")
    m.set_worker_up("0", True)
    m.set_worker_up("1", False)
    m.inc_reconnect("1")
    m.inc_predictor_fallback("timeout")
    assert sample(m, "sluice_request_success_total", finished_reason="stop") == 2
    assert sample(m, "sluice_request_success_total", finished_reason="rejected") == 1
    assert sample(m, "sluice_request_success_total", finished_reason="length") == 0
    assert (sample(m, "sluice_worker_up", worker_id="0"), sample(m, "sluice_worker_up", worker_id="1")) == (1, 0)
    assert sample(m, "sluice_worker_reconnects_total", worker_id="1") == 1
    assert sample(m, "sluice_predictor_fallbacks_total", reason="timeout") == 1


def test_worker_metrics_count_steps_errors_and_lease_refusals() -> None:
    w = WorkerMetrics("tiny-llama", "3")
    w.on_step(0.004, 48, None, num_held=2)
    w.on_step(0.0, 0, "INVALID_ARGUMENT", num_held=2)
    w.refusals.inc()
    w.ready.set(1)
    assert sample(w, "sluice_worker_steps_total", worker_id="3") == 1
    assert sample(w, "sluice_worker_scheduled_tokens_total") == 48
    assert sample(w, "sluice_worker_step_errors_total", code="INVALID_ARGUMENT") == 1
    assert sample(w, "sluice_worker_step_errors_total", code="INTERNAL") == 0, "every code starts at zero"
    assert sample(w, "sluice_worker_step_duration_seconds_count") == 1
    assert sample(w, "sluice_worker_num_requests") == 2
    assert sample(w, "sluice_worker_lease_refusals_total") == 1
    assert sample(w, "sluice_worker_ready") == 1


def test_two_instances_do_not_share_a_registry() -> None:
    a, b = ServingMetrics("a"), ServingMetrics("b")
    a.inc_rejected("queue_full")
    assert sample(a, "sluice_requests_rejected_total", reason="queue_full") == 1
    with pytest.raises(KeyError):
        sample(b, "sluice_requests_rejected_total", reason="queue_full")
    assert sample(b, "sluice_request_success_total", finished_reason="stop") == 0


def test_metrics_endpoint_serves_the_exposition_format() -> None:
    m = ServingMetrics("tiny-llama")
    m.observe_e2e(1.2)
    m.observe_queue(0.1)
    m.observe_itl(0.02)
    m.inc_preemption("recompute", "kv_pressure")
    port = start_metrics_server(0, m, addr="127.0.0.1")
    try:
        assert port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    finally:
        stop_metrics_server(port)
    parsed = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(EXPECTED) <= set(parsed)
    e2e = {s.name: s.value for s in parsed["sluice_e2e_request_latency_seconds"].samples if not s.labels.get("le")}
    assert e2e["sluice_e2e_request_latency_seconds_count"] == 1
    assert e2e["sluice_e2e_request_latency_seconds_sum"] == pytest.approx(1.2)
    (preempt,) = [s for s in parsed["sluice_num_preemptions"].samples if s.name.endswith("_total")]
    assert preempt.labels == {"model_name": "tiny-llama", "mode": "recompute", "reason": "kv_pressure"}


def test_admission_decisions_start_at_zero_and_count_by_decision_and_reason() -> None:
    metrics = ServingMetrics("tiny-llama")
    assert sample(metrics, "sluice_admission_decisions_total", decision="refuse", reason="tbt") == 0
    metrics.inc_admission("refuse", "tbt")
    metrics.inc_admission("admit", "slo")
    assert sample(metrics, "sluice_admission_decisions_total", decision="refuse", reason="tbt") == 1
    assert sample(metrics, "sluice_admission_decisions_total", decision="admit", reason="slo") == 1
