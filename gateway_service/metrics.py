"""Prometheus metrics of the gateway (its own registry, served at GET /metrics on its port).

The scheduler's serving metrics (TTFT, ITL, queue time as the scheduler sees them) stay on
the scheduler's metrics port; these are what HTTP adds and what only the gateway sees:
requests by route and status, time to first token as the HTTP client sees it (from the
request's arrival at the gateway to its first content chunk), the gateway's own work before it
calls the scheduler, tokens returned, requests in flight and clients that left mid-request.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sluice.common.prom import QUEUE_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS

PREFIX = "sluice_gateway_"
ROUTES = ("/v1/completions", "/v1/chat/completions")


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            PREFIX + "requests", "HTTP requests answered, by route and status", ["route", "status"], registry=r
        )
        self.duration = Histogram(
            PREFIX + "request_duration_seconds",
            "Arrival to the last byte of generation requests",
            ["route"],
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Arrival at the gateway to the first content chunk sent (streaming requests)",
            ["route"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.prepare = Histogram(
            PREFIX + "request_prepare_seconds",
            "Arrival to the scheduler's Generate calls started (body, fields, template: the gateway's own work)",
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(PREFIX + "generation_tokens", "Completion tokens returned to clients", registry=r)
        self.running = Gauge(PREFIX + "requests_running", "Generation requests in flight", registry=r)
        self.disconnects = Counter(
            PREFIX + "client_disconnects", "Generation requests whose client left before the end (aborted)", registry=r
        )
        # NOTE: each request's series looked up once here (labels() takes a lock and builds its key)
        self._ttft = {route: self.ttft.labels(route) for route in ROUTES}
        self._duration = {route: self.duration.labels(route) for route in ROUTES}
        self._requests: dict[tuple[str, int], Counter] = {}

    def ttft_of(self, route: str) -> Histogram:
        return self._ttft.get(route) or self.ttft.labels(route)

    def duration_of(self, route: str) -> Histogram:
        return self._duration.get(route) or self.duration.labels(route)

    def request_done(self, route: str, status: int) -> None:
        """Counts an answered request by route and status."""
        series = self._requests.get((route, status))
        if series is None:
            series = self._requests[(route, status)] = self.requests.labels(route, str(status))
        series.inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
