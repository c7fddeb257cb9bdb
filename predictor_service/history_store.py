"""The learned history persisted in Redis, so a restarted predictor reloads what it learned.

    Observe --append(model, embedding, tokens)--> RPUSH prefix:h:<encoder> <packed entry>
    start / Redis back --sync()--> LRANGE (chunks) --> History.add   (once per process)
                                   then the entries queued while Redis was away are written

One Redis list per encoder (the embedding space), not per head version: retraining the head
keeps the history. An entry packs the served model's name, the token count and the float16
embedding (768 bytes) into one string; no prompt text. If Redis loses the list (flushed,
restarted empty), RPUSH answers a shorter length than expected and the process rewrites every
entry it learned, so the next restart still finds them. The list is trimmed to `max_entries`.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections import deque
from typing import Any

import numpy as np

from predictor_service.encoder import EMBEDDING_DIM
from predictor_service.redis_guard import RedisGuard
from predictor_service.retrieval import History

log = logging.getLogger("sluice.predictor")
_HEADER = struct.Struct("<HI")  # model name length, tokens
LOAD_CHUNK = 5000


def pack_entry(model: str, embedding: np.ndarray, tokens: int) -> bytes:
    name = model.encode()
    vec = np.asarray(embedding, dtype=np.float16).reshape(EMBEDDING_DIM).tobytes()
    return _HEADER.pack(len(name), int(tokens)) + name + vec


def unpack_entry(blob: bytes) -> tuple[str, np.ndarray, int]:
    n, tokens = _HEADER.unpack_from(blob)
    start = _HEADER.size
    model = blob[start : start + n].decode()
    vec = np.frombuffer(blob[start + n :], dtype=np.float16).astype(np.float32)
    if vec.shape != (EMBEDDING_DIM,):
        raise ValueError(f"history entry has {vec.size} dims, expected {EMBEDDING_DIM}")
    return model, vec, tokens


class RedisHistoryStore:
    def __init__(self, guard: RedisGuard, history: History, key: str, max_entries: int = 200_000) -> None:
        self.guard = guard
        self.history = history
        self.key = key
        self.max_entries = max_entries
        self.loaded = False
        self.loaded_entries = 0
        self._learned: deque[bytes] = deque(maxlen=max_entries)  # loaded + observed: what a rewrite restores
        self._pending: deque[bytes] = deque(maxlen=max_entries)  # observed while Redis was away
        self._expected_len: int | None = None
        self._sync_lock = asyncio.Lock()

    async def append(self, model: str, embedding: np.ndarray, tokens: int) -> bool:
        """Persists one observation; False (and queued) when Redis is away."""
        blob = pack_entry(model, embedding, tokens)
        self._learned.append(blob)
        if not self.loaded:
            self._pending.append(blob)
            return False
        length = await self.guard.call("history_append", lambda r: self._push(r, [blob]))
        if length is None:
            self._pending.append(blob)
            return False
        await self._check_length(int(length), 1)
        return True

    async def _push(self, r: Any, blobs: list[bytes]) -> int:
        pipe = r.pipeline(transaction=False)
        pipe.rpush(self.key, *blobs)
        pipe.ltrim(self.key, -self.max_entries, -1)
        length, _ = await pipe.execute()
        return int(length)

    async def _check_length(self, length: int, added: int) -> None:
        expected = None if self._expected_len is None else min(self._expected_len + added, self.max_entries)
        self._expected_len = min(length, self.max_entries)
        if expected is not None and length < expected:
            log.warning("redis lost the predictor history (%d entries, expected %d); rewriting it", length, expected)
            await self._rewrite()

    async def _rewrite(self) -> None:
        blobs = list(self._learned)

        async def write(r: Any) -> int:
            await r.delete(self.key)
            for start in range(0, len(blobs), LOAD_CHUNK):
                await r.rpush(self.key, *blobs[start : start + LOAD_CHUNK])
            return len(blobs)

        written = await self.guard.call("history_rewrite", write)
        if written is not None:
            self._expected_len = int(written)

    async def sync(self) -> bool:
        """Loads the persisted history once, then writes what was queued; True when both are done."""
        async with self._sync_lock:
            if not self.loaded and not await self._load():
                return False
            while self._pending:
                batch = [self._pending.popleft() for _ in range(min(LOAD_CHUNK, len(self._pending)))]
                length = await self.guard.call("history_flush", lambda r, b=batch: self._push(r, b))
                if length is None:
                    self._pending.extendleft(reversed(batch))
                    return False
                await self._check_length(int(length), len(batch))
            return True

    async def _load(self) -> bool:
        total = await self.guard.call("history_load", lambda r: r.llen(self.key))
        if total is None:
            return False
        by_model: dict[str, tuple[list[np.ndarray], list[int]]] = {}
        for start in range(0, int(total), LOAD_CHUNK):
            blobs = await self.guard.call("history_load", lambda r, s=start: r.lrange(self.key, s, s + LOAD_CHUNK - 1))
            if blobs is None:
                return False
            for blob in blobs:
                self._learned.append(blob)
                model, vec, tokens = unpack_entry(blob)
                vecs, lens = by_model.setdefault(model, ([], []))
                vecs.append(vec)
                lens.append(tokens)
        for model, (vecs, lens) in by_model.items():
            self.history.add(model, np.stack(vecs), lens)
        self.loaded, self.loaded_entries = True, sum(len(v[1]) for v in by_model.values())
        self._expected_len = int(total)
        log.info("loaded %d learned history entries from redis (%s)", self.loaded_entries, self.key)
        return True

    @property
    def pending(self) -> int:
        return len(self._pending)
