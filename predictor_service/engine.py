"""The predictor service's engine: query cache, micro-batched model, learned history, Redis.

    predict(queries) --cache.get_many (exact match)--> hits answered (source "cache")
                     --misses: MicroBatcher --LengthPredictor (one onnxruntime batch)--> predictions
                     --> clipped to each max_tokens; written to the cache in the background
    observe(query, tokens) --embedding (remembered from Predict, else encoded)--> history.add
                           --> RedisHistoryStore.append (queued while Redis is away)
                           --> cache.delete (the next prediction of this prompt sees it)

With a Redis URL the cache and the history live in Redis behind one fail-open guard
(redis_guard.py); without one, an in-process MemoryCache and no persistence. A maintenance
task re-syncs the history store every second until the persisted history is loaded and
nothing is queued, which is how a predictor that started while Redis was down, or that
lost it for a while, catches up when Redis returns.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from predictor_service.batcher import MicroBatcher
from predictor_service.cache import MemoryCache, QueryCache, RedisCache, cache_key, prompt_digest
from predictor_service.history_store import RedisHistoryStore
from predictor_service.predictor import LengthPredictor
from predictor_service.redis_guard import CircuitBreaker, RedisGuard
from predictor_service.service_metrics import PredictorMetrics
from sluice.contract.length_prediction import SOURCE_CACHE, LengthPrediction

log = logging.getLogger("sluice.predictor")
EMBEDDING_MEMORY = 8192  # recent (model, prompt) embeddings kept for Observe


@dataclass(frozen=True, slots=True)
class Query:
    request_id: str
    prompt: str | tuple[int, ...]
    model: str = ""
    max_tokens: int = 0


@dataclass
class EngineConfig:
    redis_url: str | None = None  # e.g. redis://127.0.0.1:6379/0; None: in-process cache, no persistence
    key_prefix: str = "sluice:predictor"
    cache_ttl_s: float = 3600.0
    redis_timeout_s: float = 0.05
    breaker_failures: int = 3
    breaker_reset_s: float = 1.0
    batch_window_s: float = 0.001
    max_batch: int = 32
    served_tokenizer: str | None = None  # tokenizer.json that token-id prompts are decoded with


class PredictorEngine:
    def __init__(
        self, predictor: LengthPredictor, config: EngineConfig | None = None, metrics: PredictorMetrics | None = None
    ) -> None:
        self.predictor = predictor
        self.config = config or EngineConfig()
        self.metrics = metrics or PredictorMetrics()
        self.guard: RedisGuard | None = None
        self.store: RedisHistoryStore | None = None
        self.cache: QueryCache = MemoryCache(ttl_s=self.config.cache_ttl_s)
        self.batcher: MicroBatcher[tuple[str, str], tuple[LengthPrediction, np.ndarray]] = MicroBatcher(
            self._run_batch,
            window_s=self.config.batch_window_s,
            max_batch=self.config.max_batch,
            on_batch=self.metrics.batch.observe,
        )
        self._embeddings: OrderedDict[str, np.ndarray] = OrderedDict()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._cache_writes: set[asyncio.Task[Any]] = set()
        self._maintenance: asyncio.Task[None] | None = None
        self._tokenizer: Any = None

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self.config.redis_url:
            self.guard = RedisGuard(
                self.config.redis_url,
                timeout_s=self.config.redis_timeout_s,
                breaker=CircuitBreaker(self.config.breaker_failures, self.config.breaker_reset_s),
                on_fail_open=lambda op: self.metrics.fail_open.labels(op).inc(),
                on_recover=self._on_redis_back,
            )
            self.cache = RedisCache(self.guard, self.config.cache_ttl_s)
            namespace = self.predictor.version.split("-mlp-")[0]
            self.store = RedisHistoryStore(
                self.guard, self.predictor.history, f"{self.config.key_prefix}:h:{namespace}"
            )
            await self.store.sync()
            self._maintenance = asyncio.get_running_loop().create_task(self._maintain(), name="predictor-maintenance")
        # Warm up before the server says SERVING: the first request would otherwise pay for
        # loading the served tokenizer and the ONNX sessions' first runs (seconds on a busy
        # CPU), past any deadline the scheduler gives it.
        await asyncio.to_thread(self._warm_up)
        self.batcher.start()
        self._update_gauges()

    def _warm_up(self) -> None:
        self.text_of((0,))
        self.predictor.predict(["warm-up"])

    @property
    def tokenizer_loaded(self) -> bool:
        return self._tokenizer is not None

    async def close(self) -> None:
        if self._maintenance is not None:
            self._maintenance.cancel()
        for task in list(self._tasks):
            task.cancel()
        await self.batcher.close()
        if self.guard is not None:
            await self.guard.close()

    def _on_redis_back(self) -> None:
        if self.store is not None:
            self._spawn(self.store.sync())

    async def _maintain(self) -> None:
        while True:
            await asyncio.sleep(self.config.breaker_reset_s)
            if self.store is not None and (not self.store.loaded or self.store.pending):
                await self.store.sync()
            self._update_gauges()

    def _update_gauges(self) -> None:
        self.metrics.history.set(len(self.predictor.history))
        self.metrics.redis_available.set(1 if self.guard is not None and self.guard.available else 0)

    def _spawn(self, coro: Any, group: set[asyncio.Task[Any]] | None = None) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        for tasks in (self._tasks, group):
            if tasks is not None:
                tasks.add(task)
                task.add_done_callback(tasks.discard)

    # ------------------------------------------------------------ predictions
    def text_of(self, prompt: str | Sequence[int]) -> str:
        """Token-id prompts are decoded with the served model's tokenizer (default: the demo models')."""
        if isinstance(prompt, str):
            return prompt
        if self._tokenizer is None:
            from sluice.common.tokenizer import Tokenizer

            self._tokenizer = (
                Tokenizer(self.config.served_tokenizer) if self.config.served_tokenizer else Tokenizer.demo()
            )
        return self._tokenizer.decode(list(prompt))

    def vocab_size(self) -> int:
        self.text_of(())
        return int(self._tokenizer.vocab_size)

    def _run_batch(self, items: list[tuple[str, str]]) -> list[tuple[LengthPrediction, np.ndarray]]:
        texts, models = [t for t, _ in items], [m for _, m in items]
        embeddings = self.predictor.embed(texts)
        preds = self.predictor.predict_embedded(embeddings, texts, models)
        return list(zip(preds, embeddings, strict=True))

    def _remember(self, digest: str, embedding: np.ndarray) -> None:
        self._embeddings[digest] = embedding
        self._embeddings.move_to_end(digest)
        while len(self._embeddings) > EMBEDDING_MEMORY:
            self._embeddings.popitem(last=False)

    def _key(self, q: Query) -> str:
        return cache_key(self.config.key_prefix, self.predictor.version, q.model, q.prompt)

    async def predict(self, queries: Sequence[Query]) -> list[LengthPrediction]:
        t0 = time.perf_counter()
        keys = [self._key(q) for q in queries]
        found = await self.cache.get_many(keys)
        misses = [i for i, hit in enumerate(found) if hit is None]
        self.metrics.cache.labels("hit").inc(len(queries) - len(misses))
        self.metrics.cache.labels("miss").inc(len(misses))
        results: list[LengthPrediction | None] = [
            None if hit is None else hit.with_source(SOURCE_CACHE) for hit in found
        ]
        if misses:
            items = [(self.text_of(queries[i].prompt), queries[i].model) for i in misses]
            computed = await self.batcher.submit_many(items)
            for i, (pred, emb) in zip(misses, computed, strict=True):
                results[i] = pred
                self._remember(prompt_digest(queries[i].model, queries[i].prompt), emb)
            writes = [(keys[i], pred) for i, (pred, _) in zip(misses, computed, strict=True)]
            self._spawn(self.cache.set_many(writes), self._cache_writes)
        latency = (time.perf_counter() - t0) / max(1, len(queries))
        out = [
            r.clipped(q.max_tokens).with_source(r.source, latency) for r, q in zip(results, queries, strict=True) if r
        ]
        for p in out:
            self.metrics.predictions.labels(p.source).inc()
        self.metrics.latency.observe(time.perf_counter() - t0)
        return out

    # ------------------------------------------------------------ learning
    async def observe(self, query: Query, true_tokens: int, finished_naturally: bool = True) -> bool:
        """Adds (prompt, true length) to the history; a truncated length (not finished
        naturally) is only a lower bound and is not learned. Returns whether it was added."""
        if not finished_naturally or true_tokens <= 0:
            return False
        digest = prompt_digest(query.model, query.prompt)
        embedding = self._embeddings.get(digest)
        if embedding is None:
            ((_, embedding),) = await self.batcher.submit_many([(self.text_of(query.prompt), query.model)])
        self.predictor.observe(embedding, query.model, true_tokens)
        persisted = await self.store.append(query.model, embedding, true_tokens) if self.store is not None else False
        if self._cache_writes:
            # NOTE: a cache write of this prompt's old prediction still in flight would land after
            # the delete below and serve the stale value until its TTL; the guard bounds the wait.
            await asyncio.wait(list(self._cache_writes))
        await self.cache.delete(self._key(query))
        self.metrics.observations.labels("true" if persisted else "false").inc()
        self.metrics.history.set(len(self.predictor.history))
        return True
