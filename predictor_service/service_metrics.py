"""Prometheus metrics of the predictor service (own registry, `sluice_predictor_` prefix).

engine --> predictions_total{source}, cache_total{result}, prediction_seconds,
           batch_size, observations_total{persisted}, history_entries,
           redis_fail_open_total{op}, redis_available
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "sluice_predictor_"
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class PredictorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.predictions = Counter(PREFIX + "predictions", "Predictions answered, by source.", ("source",), registry=r)
        self.cache = Counter(PREFIX + "cache", "Query-cache lookups, by result (hit, miss).", ("result",), registry=r)
        self.latency = Histogram(
            PREFIX + "prediction_seconds",
            "Server time per Predict or PredictBatch call.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch = Histogram(
            PREFIX + "encode_batch_size", "Prompts per encoder batch.", buckets=BATCH_BUCKETS, registry=r
        )
        self.observations = Counter(
            PREFIX + "observations",
            "Observe calls added to the history, by persisted (true/false).",
            ("persisted",),
            registry=r,
        )
        self.history = Gauge(PREFIX + "history_entries", "Entries in the in-process retrieval history.", registry=r)
        self.fail_open = Counter(
            PREFIX + "redis_fail_open",
            "Redis operations skipped or failed, answered from the process instead (fail-open).",
            ("op",),
            registry=r,
        )
        self.redis_available = Gauge(
            PREFIX + "redis_available", "1 while the Redis circuit breaker is closed.", registry=r
        )

    def fail_open_count(self) -> float:
        return sum(s.value for m in self.fail_open.collect() for s in m.samples if s.name.endswith("_total"))
