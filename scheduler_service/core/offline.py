"""Offline-class requests yield to online ones: a queue in front of the workers' own, below
every policy (the policies stay as they are, and see offline work only when it is placed).

    OfflineQueue      offline requests not yet on a worker, FIFO, bounded by its own max_size
    Room              what a worker's online requests leave idle: seats, and the prompt tokens
                      one step can add without stretching it past their TBT
    to_place()        how many of the queue's head the worker takes now, before its next plan:
                      as many as its room holds beside the online requests there (waiting ones
                      included, which stay ahead of them in the worker's queue)
    yielding()        what gives way when an online request is placed on a worker: every
                      offline request still waiting there (it has computed nothing), then the
                      held ones that computed least, until the worker holds at most its seats

The Room is the driver's (the live scheduler: the largest batch whose step fits the tightest
TBT SLO of the online requests, at the worker's measured speed; every seat when there is no
TBT to keep). The prompt tokens bound matters as much as the seats: a step is never cut short,
so an online request that arrives while the worker computes a lump of offline prompts waits
for that step whatever it is.

So an online request is never queued behind an offline one: offline work is placed behind the
online requests a worker holds, and a placed offline request that has not started goes back to
the queue's head when an online one arrives. Offline requests have no latency SLO to miss
(at most a loose JCT), so they are never refused for one: only the queue's bound refuses them.
Online admission estimates the worker without its offline requests, since these yield.
Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.slo import SLOClass


def is_offline(request: Request) -> bool:
    return request.slo.effective_class is SLOClass.OFFLINE


class OfflineQueue:
    def __init__(self, max_size: int) -> None:
        if max_size < 1:
            raise ValueError(f"max_offline_waiting must be >= 1, got {max_size}")
        self.max_size = max_size
        self._items: deque[Request] = deque()

    @property
    def full(self) -> bool:
        return len(self._items) >= self.max_size

    def push(self, request: Request) -> None:
        """A new offline request (the caller checked `full`)."""
        self._items.append(request)

    def push_front(self, requests: Iterable[Request]) -> None:
        """Requests that yielded (or whose worker left) go first, in their order: they were
        admitted already, so the bound never refuses them."""
        self._items.extendleft(reversed(list(requests)))

    def pop(self) -> Request:
        return self._items.popleft()

    def remove(self, request_id: str) -> Request | None:
        for request in self._items:
            if request.request_id == request_id:
                self._items.remove(request)
                return request
        return None

    def get(self, request_id: str) -> Request | None:
        return next((r for r in self._items if r.request_id == request_id), None)

    def clear(self) -> list[Request]:
        items = list(self._items)
        self._items.clear()
        return items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)


@dataclass(frozen=True, slots=True)
class Room:
    seats: int  # requests the worker holds while its online ones meet their SLOs
    prompt_tokens: int = 1 << 30  # offline prompt tokens one plan may add


def to_place(sched: Scheduler, queue: Iterable[Request], room: Room) -> int:
    """How many requests from the head of `queue` the worker takes now: within its seats
    (and max_num_seqs) and its room for prompt tokens, of which the first request alone may
    exceed it when no online request is there (else a long prompt would never be placed)."""
    seats = min(room.seats, sched.config.max_num_seqs) - len(sched.requests)
    count = tokens = 0
    for request in queue:
        if count >= seats:
            break
        tokens += request.num_tokens_to_compute
        if tokens > room.prompt_tokens and (count or not all(is_offline(r) for r in sched.requests.values())):
            break
        count += 1
    return count


def yielding(sched: Scheduler, seats: int, offline_ids: Iterable[str]) -> list[Request]:
    """The offline requests on the worker that give way to the online ones there (module
    docstring): the waiting ones, then the held ones that computed least, down to `seats`.
    `offline_ids`: the ids of the offline requests placed on the worker (others are skipped),
    so that the online ones are never walked."""
    requests, waiting = sched.requests, sched.waiting
    mine = [r for rid in offline_ids if (r := requests.get(rid)) is not None]
    out = [r for r in mine if r.request_id in waiting]
    excess = len(requests) - len(out) - max(0, seats)
    if excess > 0:
        held = [r for r in mine if r.request_id not in waiting]
        # NOTE: the least computed first (the least work is redone when it comes back), of
        # those alike the one placed last
        held.reverse()
        held.sort(key=lambda r: r.num_computed_tokens)
        out += held[:excess]
    return out
