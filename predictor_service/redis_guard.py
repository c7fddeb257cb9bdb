"""Fail-open access to Redis: short timeouts, a small circuit breaker, a counter and one log line.

    caller --guard.call(op, coroutine factory)--> breaker open? -> None at once (counted)
                                               -> the Redis call under a hard deadline
                                                  ok -> result, breaker closes
                                                  error or timeout -> None (counted), breaker
                                                  opens after `failures` in a row

Every caller treats None as "Redis had nothing": a prediction is then computed from the
in-process model and history, so Redis down, slow or flushed costs no request. While the
breaker is open no call waits on Redis at all; after `reset_s` one trial call goes through
(half-open) and a success closes it again, which is how the predictor reconnects when Redis
returns. One WARNING line when the breaker opens and one INFO line when it closes.

NOTE: redis-py's defaults wait 3.24 s for a refused connection (ECOSYSTEM.md); with 50 ms
socket and connect timeouts, one quick retry and this breaker it fails open in about 12 ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from sluice.common.security import redact_url

log = logging.getLogger("sluice.predictor")
T = TypeVar("T")


class CircuitBreaker:
    """closed -> (failures in a row) -> open -> (reset_s) -> half-open -> one success -> closed."""

    def __init__(self, failures: int = 3, reset_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.failures = failures
        self.reset_s = reset_s
        self.clock = clock
        self.consecutive = 0
        self.opened_at: float | None = None

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        return "half_open" if self.clock() - self.opened_at >= self.reset_s else "open"

    def allow(self) -> bool:
        return self.state != "open"

    def record_success(self) -> bool:
        """True when this success closed an open breaker."""
        was_open = self.opened_at is not None
        self.consecutive, self.opened_at = 0, None
        return was_open

    def record_failure(self) -> bool:
        """True when this failure opened the breaker (it was closed before)."""
        self.consecutive += 1
        if self.opened_at is not None:
            self.opened_at = self.clock()  # a failed half-open trial waits another reset_s
            return False
        if self.consecutive >= self.failures:
            self.opened_at = self.clock()
            return True
        return False


def make_redis_client(url: str, timeout_s: float = 0.05, max_connections: int = 16) -> Any:
    import redis.asyncio as redis
    from redis.asyncio.retry import Retry
    from redis.backoff import ConstantBackoff

    return redis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(ConstantBackoff(0.002), 1),
        max_connections=max_connections,
        health_check_interval=0,
    )


class RedisGuard:
    """One Redis client behind a breaker; `call` never raises a Redis or timeout error."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 0.05,
        breaker: CircuitBreaker | None = None,
        on_fail_open: Callable[[str], None] | None = None,
        on_recover: Callable[[], None] | None = None,
    ) -> None:
        self.url = url
        self.where = redact_url(url)  # NOTE: what log lines show: the URL without its password
        self.timeout_s = timeout_s
        self.client = make_redis_client(url, timeout_s)
        self.breaker = breaker or CircuitBreaker()
        self._on_fail_open = on_fail_open or (lambda op: None)
        self._on_recover = on_recover or (lambda: None)

    @property
    def available(self) -> bool:
        return self.breaker.state == "closed"

    async def call(self, op: str, fn: Callable[[Any], Awaitable[T]]) -> T | None:
        if not self.breaker.allow():
            self._on_fail_open(op)
            return None
        try:
            # NOTE: a hard deadline on top of the socket timeouts: a connection that accepts and
            # then says nothing (a stopped server) must not hold a request longer than this.
            result = await asyncio.wait_for(fn(self.client), timeout=4 * self.timeout_s)
        except (TimeoutError, Exception) as exc:
            self._on_fail_open(op)
            if self.breaker.record_failure():
                log.warning(
                    "redis at %s unavailable (%s: %s); serving from the in-process history",
                    self.where,
                    op,
                    redact_url(str(exc)),
                )
            return None
        if self.breaker.record_success():
            log.info("redis at %s is back", self.where)
            self._on_recover()
        return result

    async def close(self) -> None:
        # NOTE: closing a dead connection may fail; there is nothing left to do then.
        with contextlib.suppress(Exception):
            await self.client.aclose()
