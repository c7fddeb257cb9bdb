"""Prometheus metrics of the serving path, named as vLLM names them (prefix `sluice_`).

    live loop / Generate handler --observe_* / set_* / inc_*--> ServingMetrics (own registry)
    Prometheus --GET /metrics--> start_metrics_server(port, metrics) --> exposition text

Names, units and histogram buckets are vLLM's (`vllm:time_to_first_token_seconds` becomes
`sluice_time_to_first_token_seconds`: colons are reserved for recording rules), so a vLLM
Grafana dashboard works after a prefix swap. Every series carries vLLM's `model_name`
label. Each ServingMetrics owns its CollectorRegistry: two servers (or two tests) in one
process never clash over the global registry.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
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

PREFIX = "sluice_"


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
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request (mean gap after the first token).",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS
        )
        self.queue = histogram(
            "request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.running = gauge("num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self._preemptions = counter(
            "num_preemptions", "Cumulative number of preemptions from the engine.", ("mode", "reason")
        )
        self._rejected = counter("requests_rejected", "Requests refused at admission.", ("reason",))
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.").labels(model_name)
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.").labels(
            model_name
        )

    # ------------------------------------------------------------ latencies (seconds)
    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def observe_tpot(self, seconds: float) -> None:
        self.tpot.observe(seconds)

    def observe_e2e(self, seconds: float) -> None:
        self.e2e.observe(seconds)

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

    def inc_tokens(self, prompt: int, generation: int) -> None:
        if prompt:
            self.prompt_tokens.inc(prompt)
        if generation:
            self.generation_tokens.inc(generation)


_servers: dict[int, Any] = {}
_servers_lock = threading.Lock()


def start_metrics_server(port: int, metrics: ServingMetrics, addr: str = "0.0.0.0") -> int:
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
