"""The predictor against the real Redis at 127.0.0.1:6379: cache, persisted history, fail-open, recovery.

Every test uses its own key prefix and deletes only its own keys; "down" is a closed port, a
server that accepts and never answers, or a proxy the test stops: never the shared server."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import numpy as np
import pytest
import redis.asyncio as redis
from predictor_harness import REDIS_URL, TEST_PREFIX, RedisProxy, closed_port, delete_test_keys, silent_server

from predictor_service.engine import EngineConfig, PredictorEngine, Query

PROMPT = "Write a detailed travel guide for three days in Lisbon, with a budget for each day."


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    name = f"{TEST_PREFIX}:{uuid.uuid4().hex[:8]}"
    yield name
    await delete_test_keys(name)


async def engine_for(predictor, url: str, prefix: str, **kw: object) -> PredictorEngine:
    config = EngineConfig(redis_url=url, key_prefix=prefix, breaker_reset_s=0.2, **kw)  # type: ignore[arg-type]
    engine = PredictorEngine(predictor.with_new_history(), config)
    await engine.start()
    return engine


async def test_cache_misses_then_hits_in_redis_with_a_ttl_and_no_prompt_stored(tiny_predictor, prefix) -> None:
    engine = await engine_for(tiny_predictor, REDIS_URL, prefix, cache_ttl_s=100.0)
    try:
        q = Query("a", PROMPT, "chatgpt-sharegpt")
        (miss,) = await engine.predict([q])
        await asyncio.sleep(0.05)
        (hit,) = await engine.predict([q])
    finally:
        await engine.close()
    assert miss.source != "cache" and hit.source == "cache" and hit.tokens == miss.tokens
    client = redis.Redis.from_url(REDIS_URL)
    try:
        keys = [k async for k in client.scan_iter(match=f"{prefix}:q:*")]
        assert len(keys) == 1
        ttl = await client.ttl(keys[0])
        value = await client.get(keys[0])
    finally:
        await client.aclose()
    assert 85 <= ttl <= 110, "TTL with jitter of +-10%"
    assert b"Lisbon" not in keys[0] and b"Lisbon" not in value, "no raw prompt in Redis"


async def test_learned_history_survives_a_restart(tiny_predictor, prefix) -> None:
    first = await engine_for(tiny_predictor, REDIS_URL, prefix)
    q = Query("a", PROMPT, "tiny-llama")
    try:
        (before,) = await first.predict([q])
        truth = 1400 if before.tokens < 600 else 12
        assert await first.observe(q, truth)
        assert await first.observe(Query("b", "Another prompt entirely.", "tiny-llama"), 33)
    finally:
        await first.close()
    restarted = await engine_for(tiny_predictor, REDIS_URL, prefix)
    try:
        assert restarted.store is not None and restarted.store.loaded_entries == 2
        assert restarted.predictor.history.size("tiny-llama") == 2
        (after,) = await restarted.predict([q])
    finally:
        await restarted.close()
    assert abs(after.tokens - truth) < abs(before.tokens - truth)


async def test_redis_refusing_connections_costs_no_prediction(tiny_predictor, prefix) -> None:
    engine = await engine_for(tiny_predictor, f"redis://127.0.0.1:{closed_port()}/0", prefix)
    try:
        t0 = time.perf_counter()
        results = [await engine.predict([Query(str(i), f"{PROMPT} {i}", "tiny-llama")]) for i in range(20)]
        elapsed = time.perf_counter() - t0
        assert await engine.observe(Query("o", PROMPT, "tiny-llama"), 50), "learned in process while Redis is away"
    finally:
        await engine.close()
    assert all(len(r) == 1 and r[0].tokens > 0 for r in results)
    assert engine.metrics.fail_open_count() >= 3
    assert engine.guard is not None and engine.guard.breaker.state != "closed"
    assert engine.store is not None and engine.store.pending == 1
    assert elapsed < 10.0, "no request waits on Redis' default 3 s connect timeout"


async def test_a_redis_that_accepts_and_never_answers_costs_no_prediction(tiny_predictor, prefix) -> None:
    async with silent_server() as port:
        engine = await engine_for(tiny_predictor, f"redis://127.0.0.1:{port}/0", prefix)
        try:
            results = [await engine.predict([Query(str(i), f"{PROMPT} {i}", "tiny-llama")]) for i in range(10)]
        finally:
            await engine.close()
    assert all(r[0].tokens > 0 for r in results)
    assert engine.metrics.fail_open_count() >= 3


async def test_reconnects_loads_history_and_flushes_what_it_learned_when_redis_returns(tiny_predictor, prefix) -> None:
    port = closed_port()
    proxy = RedisProxy(port)
    engine = await engine_for(tiny_predictor, f"redis://127.0.0.1:{port}/0", prefix)
    try:
        assert engine.store is not None and not engine.store.loaded
        assert await engine.observe(Query("o", PROMPT, "tiny-llama"), 77)
        assert engine.store.pending == 1
        await proxy.start()
        for _ in range(100):  # the maintenance task retries every breaker_reset_s (0.2 s)
            await engine.predict([Query("p", "keep asking", "tiny-llama")])
            if engine.store.loaded and engine.store.pending == 0:
                break
            await asyncio.sleep(0.05)
        assert engine.store.loaded and engine.store.pending == 0
        assert engine.guard is not None and engine.guard.breaker.state == "closed"
    finally:
        await engine.close()
        await proxy.stop()
    client = redis.Redis.from_url(REDIS_URL)
    try:
        assert await client.llen(engine.store.key) == 1
    finally:
        await client.aclose()


async def test_a_flushed_history_is_rewritten_from_the_process(tiny_predictor, prefix) -> None:
    engine = await engine_for(tiny_predictor, REDIS_URL, prefix)
    client = redis.Redis.from_url(REDIS_URL)
    try:
        for i in range(3):
            await engine.observe(Query(str(i), f"prompt number {i}", "tiny-llama"), 10 + i)
        assert engine.store is not None
        await client.delete(engine.store.key)  # only our own key: the shared server is never flushed
        await engine.observe(Query("4", "prompt number 4", "tiny-llama"), 40)
        assert await client.llen(engine.store.key) == 4
        (pred,) = await engine.predict([Query("p", "prompt number 1", "tiny-llama")])
        assert pred.tokens > 0
    finally:
        await client.aclose()
        await engine.close()
    tokens = np.sort(engine.predictor.history.arrays("tiny-llama")[1])
    assert list(tokens) == [10, 11, 12, 40]
