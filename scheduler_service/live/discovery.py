"""WorkerDiscovery: the worker set follows a DNS name, so workers scale without a restart.

    --workers-dns NAME:PORT (repeat, or comma-separated)    e.g. a Kubernetes headless Service
    every refresh_s:  resolve each NAME (getaddrinfo, as gRPC's own DNS resolver does) ->
                      every address it answers becomes a worker at ADDRESS:PORT
        new address        LiveScheduler.add_worker (Info, Warmup, a loop), beside the refreshes;
                           one that cannot be reached yet is tried again at the next refresh,
                           one that serves another model (or less) is refused until it leaves
                           the name
        address gone       LiveScheduler.remove_worker after `drop_after` resolutions in a row
                           without it: its requests are re-queued as a dead worker's are
        resolution fails   nothing changes (a DNS outage never empties the cluster)

A headless Service answers the IPs of its ready pods only (readiness is the worker's engine
running), so a scaled-up worker appears once it can serve and a scaled-down one disappears
when its pod terminates. A terminating worker usually breaks its step stream first: the loop
then marks it down at once (its requests move), and the removal that follows only forgets
it. `drop_after` (2) rides out a readiness probe that fails once.

Workers named with `--worker` are never removed by discovery; an address both lists name is
one worker. With TLS, a discovered worker's certificate is checked against the name resolved
(e.g. `sluice-worker`), not the IP it is dialled at, as gRPC's own DNS resolver does.
`resolver` is the seam for tests and other name services: a coroutine from a host name to its
IP addresses.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from scheduler_service.core.request import Request
from scheduler_service.live.remote import WorkerLost

log = logging.getLogger(__name__)

Resolver = Callable[[str], Awaitable[list[str]]]


class NoWorkerFound(TimeoutError):
    """The names answered no worker address in time (at start)."""


class Membership(Protocol):
    """What discovery needs of the LiveScheduler (which imports this module)."""

    closing: bool

    def worker_addresses(self) -> dict[str, int]: ...

    async def add_worker(self, address: str) -> int: ...

    async def remove_worker(self, address: str) -> list[Request]: ...


@dataclass(frozen=True, slots=True)
class DnsTarget:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str, field: str = "workers_dns") -> DnsTarget:
        host, sep, port = text.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{field}: {text!r} is not NAME:PORT (e.g. sluice-worker:50061)")
        return cls(host.strip("[]"), int(port))

    def address(self, ip: str) -> str:
        return f"[{ip}]:{self.port}" if ":" in ip else f"{ip}:{self.port}"


async def resolve_host(host: str) -> list[str]:
    """Every IP address the system resolver answers for `host` (A and AAAA), sorted."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


class WorkerDiscovery:
    def __init__(
        self,
        targets: Sequence[DnsTarget],
        refresh_s: float = 5.0,
        *,
        drop_after: int = 2,
        resolver: Resolver = resolve_host,
        static: Sequence[str] = (),
    ) -> None:
        """`static`: the `--worker` addresses, which discovery never adds or removes."""
        if not targets:
            raise ValueError("workers_dns: at least one NAME:PORT")
        if refresh_s <= 0:
            raise ValueError(f"workers_dns_refresh_s must be positive, got {refresh_s}")
        if drop_after < 1:
            raise ValueError(f"workers_dns_drop_after must be at least 1, got {drop_after}")
        self.targets = tuple(targets)
        self.refresh_s = refresh_s
        self.drop_after = drop_after
        self.resolver = resolver
        self.static = frozenset(static)
        self.managed: set[str] = set()  # addresses this discovery added (or found at start)
        self.refused: set[str] = set()  # serve another model: not tried again while listed
        self._missing: dict[str, int] = {}  # managed address -> resolutions in a row without it
        self._adding: dict[str, asyncio.Task] = {}  # joins in progress
        self._names: dict[str, str] = {}  # address -> the name it was resolved from
        self.num_added = 0
        self.num_removed = 0
        self.num_requeued = 0  # requests the removed workers held, re-queued on the others

    async def resolve(self) -> set[str] | None:
        """The addresses the names answer now; None when any name failed to resolve."""
        names: dict[str, str] = {}
        for target in self.targets:
            try:
                ips = await self.resolver(target.host)
            except (OSError, UnicodeError) as exc:  # socket.gaierror is an OSError
                log.warning("workers_dns: %s did not resolve (%s): the worker set is unchanged", target.host, exc)
                return None
            names.update((target.address(ip), target.host) for ip in ips)
        found = set(names) - self.static
        self._names = {a: n for a, n in self._names.items() if a in self.managed} | names
        return found

    def authority(self, address: str) -> str | None:
        """The name `address` was resolved from (TLS checks the worker's certificate against it)."""
        return self._names.get(address)

    async def initial(self, timeout_s: float) -> list[str]:
        """The discovered part of the first worker set, waiting (re-resolving every refresh)
        until the names answer at least one address; TimeoutError naming them after timeout_s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            found = await self.resolve()
            if found:
                self.managed = set(found)
                return sorted(found)
            if loop.time() + self.refresh_s > deadline:
                names = ", ".join(f"{t.host}:{t.port}" for t in self.targets)
                raise NoWorkerFound(f"workers_dns: no worker address for {names} within {timeout_s:g} s")
            await asyncio.sleep(self.refresh_s)

    async def run(self, live: Membership) -> None:
        try:
            while not live.closing:
                await asyncio.sleep(self.refresh_s)
                try:
                    await self.refresh(live)
                except Exception:
                    # NOTE: a bug here must not stop discovery for the scheduler's lifetime.
                    log.exception("workers_dns: refresh failed")
        finally:
            adding = list(self._adding.values())
            for task in adding:
                task.cancel()
            await asyncio.gather(*adding, return_exceptions=True)

    async def refresh(self, live: Membership) -> None:
        """One reconciliation: add what the names answer and the cluster lacks, remove what
        they stopped answering (after drop_after resolutions)."""
        found = await self.resolve()
        if found is None or live.closing:
            return
        self.refused &= found
        known = live.worker_addresses()
        new = sorted(a for a in found if a not in known and a not in self.refused and a not in self._adding)
        gone = []
        for address in sorted(self.managed - found):
            self._missing[address] = self._missing.get(address, 0) + 1
            if self._missing[address] >= self.drop_after:
                gone.append(address)
        for address in self.managed & found:
            self._missing.pop(address, None)
        for address in gone:
            self.managed.discard(address)
            self._missing.pop(address, None)
            if address in known:
                self.num_requeued += len(await live.remove_worker(address))
                self.num_removed += 1
        # NOTE: joins run beside the refreshes: a worker slow to answer (or leased to a previous
        # scheduler until its lease lapses) delays neither the others nor the removals.
        for address in new:
            self._adding[address] = asyncio.create_task(self._add(live, address), name=f"sluice-join-{address}")

    async def _add(self, live: Membership, address: str) -> None:
        try:
            await live.add_worker(address)
        except ValueError as exc:
            log.error("workers_dns: %s", exc)
            self.refused.add(address)
            return
        except WorkerLost as exc:  # not reachable (or leased elsewhere) yet
            log.warning("workers_dns: worker %s not added yet: %s", address, exc)
            return
        finally:
            self._adding.pop(address, None)
        self.managed.add(address)
        self.num_added += 1


def parse_targets(values: Sequence[str]) -> list[DnsTarget]:
    """`--workers-dns` values (comma-separated lists allowed)."""
    return [DnsTarget.parse(v) for value in values for v in value.split(",") if v.strip()]


__all__ = ["DnsTarget", "Membership", "NoWorkerFound", "WorkerDiscovery", "parse_targets", "resolve_host"]
