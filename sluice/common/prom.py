"""Prometheus metrics of the serving path, named as vLLM names them (prefix `sluice_`).

    live loop / Generate handler --observe_* / set_* / inc_*--> ServingMetrics (own registry)
    worker servicer --on_step / set_*--> WorkerMetrics (own registry; `sluice worker --metrics-port`)
    Prometheus --GET /metrics--> start_metrics_server(port, metrics) --> exposition text

Names, units and histogram buckets are vLLM's (`vllm:time_to_first_token_seconds` becomes
`sluice_time_to_first_token_seconds`: colons are reserved for recording rules), so a vLLM
Grafana dashboard works after a prefix swap, with two deliberate exceptions: KV usage is
`sluice_kv_cache_usage_ratio` (it is a ratio in [0, 1]; vLLM's `_perc` name says otherwise),
and queue time has buckets from 0.1 ms (an idle scheduler admits in microseconds, and vLLM's
first bucket, 0.3 s, hid every queueing delay below it). Every series carries vLLM's
`model_name` label, and every labelled series is created at zero when the metrics are
(`rate()` over a series that appears at its first event misses that event). Each metrics
object owns its CollectorRegistry: two servers (or two tests) in one process never clash.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

# From 100 us: admission on an idle scheduler takes microseconds, a full queue seconds.
# |predicted - generated| output tokens of a request the predictor answered for.
LENGTH_ERROR_BUCKETS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)
QUEUE_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip
STEP_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip

PREFIX = "sluice_"
# vLLM's `request_success_total{finished_reason}` values, plus the endings a Sluice request
# that was accepted can have besides (all appear in the counter from the start at zero).
FINISHED_REASONS = ("stop", "length", "abort", "timeout", "rejected", "error")
# Why the scheduler used another length than the predictor's (the predictor wiring counts).
PREDICTOR_FALLBACK_REASONS = ("timeout", "unavailable", "error", "invalid_answer")
STEP_ERROR_CODES = ("INVALID_ARGUMENT", "ABORTED", "FAILED_PRECONDITION", "UNAVAILABLE", "INTERNAL")


ADMISSION_SERIES = (
    ("admit", "slo"),
    ("admit", "no_slo"),
    ("admit", "offline"),
    ("admit", "offline_queue"),
    ("admit", "off"),
    ("refuse", "ttft"),
    ("refuse", "tbt"),
    ("refuse", "cold"),
    ("refuse", "offline_queue_full"),
)


class ServingMetrics:
    """The scheduler's serving metrics; thread-safe (prometheus_client locks each child)."""

    def __init__(self, model_name: str = "", registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        labels = ("model_name",)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Any:
            h = Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)
            return h.labels(model_name)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return Counter(PREFIX + name, doc, labels + extra, registry=self.registry)

        self.ttft = histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.length_error = histogram(
            "length_prediction_error_tokens",
            "Histogram of |predicted - generated| output tokens of requests the length predictor answered for.",
            LENGTH_ERROR_BUCKETS,
        )
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request (mean gap after the first token).",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS
        )
        self.queue = histogram(
            "request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", QUEUE_BUCKETS
        )
        self.running = gauge("num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("kv_cache_usage_ratio", "KV-cache usage over all workers, in [0, 1].")
        self._preemptions = counter(
            "num_preemptions", "Cumulative number of preemptions from the engine.", ("mode", "reason")
        )
        self._rejected = counter("requests_rejected", "Requests refused at admission.", ("reason",))
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.").labels(model_name)
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.").labels(
            model_name
        )
        self._outcomes_and_workers(counter)

    def _outcomes_and_workers(self, counter: Any) -> None:
        """Requests by ending, predictor fallbacks, worker health; series that need no
        scheduler knowledge start at zero here."""
        self._success = counter(
            "request_success", "Count of accepted requests that ended, by finish reason.", ("finished_reason",)
        )
        self._fallbacks = counter(
            "predictor_fallbacks", "Requests whose output length did not come from the predictor.", ("reason",)
        )
        self._worker_up = Gauge(
            PREFIX + "worker_up", "1 while the worker is connected and stepping, else 0.", ("model_name", "worker_id"),
            registry=self.registry,
        )  # fmt: skip
        self._reconnects = counter("worker_reconnects", "Sessions re-established with a lost worker.", ("worker_id",))
        self._admission = counter(
            "admission_decisions",
            "SLO-aware admission: requests admitted or refused, and the SLO a refusal could not meet.",
            ("decision", "reason"),
        )
        for decision, reason in ADMISSION_SERIES:
            self._admission.labels(self.model_name, decision, reason)
        for reason in FINISHED_REASONS:
            self._success.labels(self.model_name, reason)
        for reason in PREDICTOR_FALLBACK_REASONS:
            self._fallbacks.labels(self.model_name, reason)

    def initialise(
        self, preemptions: Iterable[tuple[str, str]] = (), rejections: Iterable[str] = (), workers: Iterable[str] = ()
    ) -> None:
        """Creates these labelled series at zero (the scheduler knows the modes and reasons)."""
        for mode, reason in preemptions:
            self._preemptions.labels(self.model_name, str(mode), str(reason))
        for reason in rejections:
            self._rejected.labels(self.model_name, str(reason))
        for worker in workers:
            self._worker_up.labels(self.model_name, str(worker))
            self._reconnects.labels(self.model_name, str(worker))

    # ------------------------------------------------------------ latencies (seconds)
    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def observe_tpot(self, seconds: float) -> None:
        self.tpot.observe(seconds)

    def observe_e2e(self, seconds: float) -> None:
        self.e2e.observe(seconds)

    def observe_length_error(self, tokens: int) -> None:
        self.length_error.observe(tokens)

    def observe_queue(self, seconds: float) -> None:
        self.queue.observe(seconds)

    # ------------------------------------------------------------ state
    def set_running(self, n: int) -> None:
        self.running.set(n)

    def set_waiting(self, n: int) -> None:
        self.waiting.set(n)

    def set_kv_usage(self, fraction: float) -> None:
        """Used / total accelerator KV blocks over all workers, in [0, 1]."""
        self.kv_usage.set(fraction)

    # ------------------------------------------------------------ counters
    def inc_preemption(self, mode: str, reason: str) -> None:
        self._preemptions.labels(self.model_name, str(mode), str(reason)).inc()

    def inc_rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, str(reason)).inc()

    def inc_finished(self, finished_reason: str) -> None:
        """An accepted request ended: stop, length, abort, timeout, rejected or error."""
        self._success.labels(self.model_name, finished_reason).inc()

    def inc_admission(self, decision: str, reason: str) -> None:
        """decision admit (reason: slo, no_slo, offline, off) or refuse (reason: ttft, tbt, cold)."""
        self._admission.labels(self.model_name, decision, reason).inc()

    def inc_predictor_fallback(self, reason: str) -> None:
        self._fallbacks.labels(self.model_name, reason).inc()

    def set_worker_up(self, worker_id: str, up: bool) -> None:
        self._worker_up.labels(self.model_name, str(worker_id)).set(1.0 if up else 0.0)

    def inc_reconnect(self, worker_id: str) -> None:
        self._reconnects.labels(self.model_name, str(worker_id)).inc()

    def remove_worker(self, worker_id: str) -> None:
        """The worker left the cluster (scaled down): its series go, as its pod's do."""
        for metric in (self._worker_up, self._reconnects):
            with contextlib.suppress(KeyError):
                metric.remove(self.model_name, str(worker_id))

    def inc_tokens(self, prompt: int, generation: int) -> None:
        if prompt:
            self.prompt_tokens.inc(prompt)
        if generation:
            self.generation_tokens.inc(generation)


class WorkerMetrics:
    """A worker's own metrics (`sluice worker --metrics-port`): steps, their time and errors,
    requests held, readiness and lease refusals."""

    def __init__(self, model_name: str = "", worker_id: str = "0", registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels, values = ("model_name", "worker_id"), (model_name, str(worker_id))

        def make(kind: Any, name: str, doc: str, **kw: Any) -> Any:
            return kind(PREFIX + name, doc, labels, registry=self.registry, **kw).labels(*values)

        self.steps = make(Counter, "worker_steps", "Steps executed.")
        self.tokens = make(Counter, "worker_scheduled_tokens", "Tokens computed (prefill chunks and decodes).")
        self.step_time = make(Histogram, "worker_step_duration_seconds", "Seconds per step.", buckets=STEP_BUCKETS)
        self.held = make(Gauge, "worker_num_requests", "Requests the worker holds.")
        self.ready = make(Gauge, "worker_ready", "1 while warmed up and the engine works, else 0.")
        self.refusals = make(
            Counter, "worker_lease_refusals", "Calls refused because another scheduler holds the lease."
        )
        self._errors = Counter(
            PREFIX + "worker_step_errors", "Steps answered with an error, by code.", (*labels, "code"),
            registry=self.registry,
        )  # fmt: skip
        self._labels = values
        for code in STEP_ERROR_CODES:
            self._errors.labels(*values, code)

    def on_step(self, seconds: float, num_tokens: int, error_code: str | None, num_held: int) -> None:
        if error_code is not None:
            self._errors.labels(*self._labels, error_code).inc()
        else:
            self.steps.inc()
            self.tokens.inc(num_tokens)
            self.step_time.observe(seconds)
        self.held.set(num_held)


_servers: dict[int, Any] = {}
_servers_lock = threading.Lock()


def start_metrics_server(port: int, metrics: ServingMetrics | WorkerMetrics, addr: str = "127.0.0.1") -> int:
    """Serves `metrics` as Prometheus text on http://addr:port/metrics in a daemon thread;
    port 0 picks a free one. Returns the bound port."""
    server, _thread = start_http_server(port, addr=addr, registry=metrics.registry)
    bound = int(server.server_port)
    with _servers_lock:
        _servers[bound] = server
    return bound


def stop_metrics_server(port: int) -> None:
    """Stops a server start_metrics_server returned `port` for (no-op for unknown ports)."""
    with _servers_lock:
        server = _servers.pop(port, None)
    if server is not None:
        server.shutdown()
        server.server_close()
