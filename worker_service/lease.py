"""A worker serves one scheduler: the lease taken at Warmup.

    Warmup     Lease.grant(presented session, scheduler name)
                 no live lease, the caller presents the live session, or names the scheduler that
                 holds it (that scheduler restarted) -> a new session id
                 (the worker's state is wiped by that Warmup, so older streams end)
                 another caller while the lease is live -> LeaseError FAILED_PRECONDITION
    Execute    Lease.check(presented) at the stream's start and for every step; Lease.renew
    Release    Lease.check; Lease.renew
    Health     renews when it carries the live session (the scheduler's idle probes)

The session id travels as gRPC metadata `x-sluice-session` (SESSION_KEY); it is a random
capability, never logged or shown to anyone but the caller of the Warmup that made it. A
lease lapses when nobody holding it has called for `ttl_s` seconds: a scheduler that died
(or restarted: it keeps no state) lets another scheduler, or its own next incarnation, take
the worker after that. The scheduler renews every `ttl_s / 4` at the latest (steps, probes).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable
from typing import Any

SESSION_KEY = "x-sluice-session"
HOLDER_KEY = "x-sluice-scheduler"  # the scheduler's name (host:port it serves on), sent with Warmup
LEASE_LEFT_KEY = "x-sluice-lease-left-s"  # trailing metadata of a refused Warmup: seconds until it lapses
DEFAULT_LEASE_TTL_S = 20.0


class LeaseError(Exception):
    """A call refused by the lease; `code` is the gRPC status name to answer with; `left_s`
    (a refused Warmup) how long the lease lives if its holder does not call again."""

    def __init__(self, code: str, message: str, left_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.left_s = left_s


def holder_of(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    for key, value in metadata or ():
        if key == HOLDER_KEY:
            return value.decode() if isinstance(value, bytes) else str(value)
    return None


def session_of(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    for key, value in metadata or ():
        if key == SESSION_KEY:
            return value.decode() if isinstance(value, bytes) else str(value)
    return None


class Lease:
    def __init__(self, ttl_s: float = DEFAULT_LEASE_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        if not ttl_s > 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self.clock = clock
        self.session: str | None = None
        self.holder: str | None = None  # the name the lease's scheduler gave (HOLDER_KEY), if any
        self.renewed_at = 0.0
        self.num_grants = 0
        self.num_refused = 0

    def live(self) -> bool:
        return self.session is not None and self.clock() - self.renewed_at < self.ttl_s

    def grant(self, presented: str | None, holder: str | None = None) -> str:
        """A new session for the caller of Warmup, or LeaseError when another holds the lease.

        A caller naming the same scheduler as the live lease's holder takes it over at once: it
        is that scheduler restarted (a name is the host and port a scheduler serves on, which no
        two live schedulers share), so the old lease's holder is provably gone."""
        if self.live() and presented != self.session and not (holder and holder == self.holder):
            self.num_refused += 1
            left = self.ttl_s - (self.clock() - self.renewed_at)
            who = f"scheduler {self.holder}" if self.holder else "another scheduler"
            raise LeaseError(
                "FAILED_PRECONDITION",
                f"the worker is leased to {who}; the lease lapses in {left:.1f} s unless renewed "
                f"(lease_ttl_s {self.ttl_s:g} after its holder's last call)",
                left_s=left,
            )
        self.session = secrets.token_urlsafe(24)
        self.holder = holder
        self.renewed_at = self.clock()
        self.num_grants += 1
        return self.session

    def clear(self) -> None:
        """A Warmup that failed gives the lease up: anyone may try again."""
        self.session = None

    def check(self, presented: str | None) -> None:
        """Raises LeaseError unless `presented` is the live session; renews it."""
        if self.session is None:
            raise LeaseError("FAILED_PRECONDITION", "the worker has no lease: call Warmup first to take it")
        if presented is None:
            raise LeaseError(
                "FAILED_PRECONDITION",
                f"{SESSION_KEY} metadata missing: send the session id Warmup returned",
            )
        if not secrets.compare_digest(presented.encode(), self.session.encode()):
            raise LeaseError(
                "PERMISSION_DENIED",
                f"{SESSION_KEY}: not this worker's lease (another scheduler holds it, or a later Warmup replaced it)",
            )
        self.renewed_at = self.clock()

    def renew_if_holder(self, presented: str | None) -> bool:
        if (
            presented is not None
            and self.session is not None
            and secrets.compare_digest(presented.encode(), self.session.encode())
        ):
            self.renewed_at = self.clock()
            return True
        return False
