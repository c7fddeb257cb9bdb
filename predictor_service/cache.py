"""The exact-match query cache: a hash of (predictor version, served model, prompt) -> prediction.

    Predict --cache_key--> get -> hit: the stored prediction (source "cache")
                                  miss: predict, then set (TTL with jitter)
    Observe --> delete (the prompt's next prediction must see what was just learned)

`RedisCache` shares entries between replicas and restarts; `MemoryCache` (an LRU with the same
TTL rule) is used when no Redis is configured, e.g. `sluice serve --demo`. No raw prompt is
stored anywhere: keys are SHA-256 digests, values the prediction's JSON.
NOTE: jitter spreads the expiry of entries written in one burst (a trace replay) so they do
not all miss together one TTL later.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from predictor_service.redis_guard import RedisGuard
from sluice.contract.length_prediction import LengthPrediction

DEFAULT_TTL_S = 3600.0
JITTER = 0.1  # each entry lives TTL x (1 +- 10%)


def prompt_digest(model: str, prompt: str | Sequence[int]) -> str:
    """Identifies (served model, prompt) without storing the prompt (token ids hash distinctly from text)."""
    body = prompt if isinstance(prompt, str) else "ids:" + ",".join(map(str, prompt))
    return hashlib.sha256(f"{model}\x00{body}".encode("utf-8", "surrogatepass")).hexdigest()


def cache_key(prefix: str, version: str, model: str, prompt: str | Sequence[int]) -> str:
    return f"{prefix}:q:{version}:{prompt_digest(model, prompt)}"


def ttl_with_jitter(ttl_s: float, rng: random.Random) -> float:
    return ttl_s * (1.0 + rng.uniform(-JITTER, JITTER))


class QueryCache(Protocol):
    async def get_many(self, keys: Sequence[str]) -> list[LengthPrediction | None]: ...

    async def set_many(self, items: Sequence[tuple[str, LengthPrediction]]) -> None: ...

    async def delete(self, key: str) -> None: ...


class MemoryCache:
    """An in-process LRU with per-entry expiry."""

    def __init__(self, max_entries: int = 100_000, ttl_s: float = DEFAULT_TTL_S, seed: int = 0) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._rng = random.Random(seed)
        self._entries: OrderedDict[str, tuple[float, LengthPrediction]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    async def get_many(self, keys: Sequence[str]) -> list[LengthPrediction | None]:
        now = time.monotonic()
        out: list[LengthPrediction | None] = []
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or entry[0] < now:
                self._entries.pop(key, None)
                out.append(None)
                continue
            self._entries.move_to_end(key)
            out.append(entry[1])
        return out

    async def set_many(self, items: Sequence[tuple[str, LengthPrediction]]) -> None:
        now = time.monotonic()
        for key, pred in items:
            self._entries[key] = (now + ttl_with_jitter(self.ttl_s, self._rng), pred)
            self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    async def delete(self, key: str) -> None:
        self._entries.pop(key, None)


class RedisCache:
    """Entries in Redis through the fail-open guard: any Redis trouble reads as a miss."""

    def __init__(self, guard: RedisGuard, ttl_s: float = DEFAULT_TTL_S, seed: int = 0) -> None:
        self.guard = guard
        self.ttl_s = ttl_s
        self._rng = random.Random(seed)

    async def get_many(self, keys: Sequence[str]) -> list[LengthPrediction | None]:
        if not keys:
            return []
        values = await self.guard.call("cache_get", lambda r: r.mget(list(keys)))
        if values is None:
            return [None] * len(keys)
        return [None if v is None else LengthPrediction.from_dict(json.loads(v)) for v in values]

    async def set_many(self, items: Sequence[tuple[str, LengthPrediction]]) -> None:
        if not items:
            return

        async def write(r: object) -> object:
            pipe = r.pipeline(transaction=False)  # type: ignore[attr-defined]
            for key, pred in items:
                ttl_ms = int(ttl_with_jitter(self.ttl_s, self._rng) * 1000)
                pipe.set(key, json.dumps(pred.to_dict(), separators=(",", ":")), px=ttl_ms)
            return await pipe.execute()

        await self.guard.call("cache_set", write)

    async def delete(self, key: str) -> None:
        await self.guard.call("cache_delete", lambda r: r.delete(key))
