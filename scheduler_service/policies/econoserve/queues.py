"""EconoServe's two waiting queues (seed 001, sections 3.3 and 3.4): indexes, not sorts.

Why: `schedule()` runs every iteration over queues of 10,000 requests, so each queue is a
bisect-sorted list updated per event (O(log n) search, a memmove per insert), never re-sorted.

What: a task's ordering key is (deadline bucket ascending, occupied-KV bucket descending,
length bucket descending, arrival sequence) (section 3.4). With ordering off (variants D and
SD) the key is the arrival sequence alone, i.e. FIFO. Beside the priority order:
- `PTQueue` keeps the prompts sorted by length, so the batcher binary-searches the prompt
  whose length is closest to (not above) the tokens still missing to the target forward size.
- `GTQueue` groups decoding tasks by predicted remaining length (the time-synced groups of
  section 3.3.2), keeps the KV-resident ones sorted by remaining length for KVCPipe's
  "closest to l/2 - b" search, and sums the blocks the queued GTs still need (the PT
  admission check keeps that demand satisfiable).

Inputs: the request's deadline (JCT SLO), its GPU blocks, its prompt or predicted length.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right, insort
from collections.abc import Iterator
from dataclasses import dataclass

from scheduler_service.core.request import Request

Key = tuple[float, int, int, int]


@dataclass(frozen=True)
class OrderingConfig:
    enabled: bool
    deadline_bucket_s: float  # width of an absolute-deadline window
    kv_bucket_tokens: int  # width of an occupied-KV range
    length_bucket_tokens: int  # width of a predicted-RL / prompt-length range


def ordering_key(cfg: OrderingConfig, request: Request, occupied_tokens: int, length: int, seq: int) -> Key:
    """Three bucketed keys in the paper's priority, then arrival. NOTE: the paper buckets the
    time LEFT to the deadline (0.2-0.5 s, 0.5-2 s, > 2 s); as the clock advances every task
    moves down together, so absolute-deadline order is what the buckets preserve. Fixed
    absolute windows keep that order and let the key stay constant while a task is queued."""
    if not cfg.enabled:
        return (0.0, 0, 0, seq)
    deadline = request.deadline
    window = math.floor(deadline / cfg.deadline_bucket_s) if deadline is not None else math.inf
    return (window, -(occupied_tokens // cfg.kv_bucket_tokens), -(length // cfg.length_bucket_tokens), seq)


class SortedIndex:
    """A bisect-sorted list of (key, request id) with O(log n) lookup by id."""

    __slots__ = ("_items", "_keys")

    def __init__(self) -> None:
        self._items: list[tuple[tuple, str]] = []
        self._keys: dict[str, tuple] = {}

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, rid: str) -> bool:
        return rid in self._keys

    def add(self, rid: str, key: tuple) -> None:
        if rid in self._keys:
            self.remove(rid)
        self._keys[rid] = key
        insort(self._items, (key, rid))

    def remove(self, rid: str) -> bool:
        key = self._keys.pop(rid, None)
        if key is None:
            return False
        i = bisect_left(self._items, (key, rid))
        del self._items[i]
        return True

    def first(self) -> str | None:
        return self._items[0][1] if self._items else None

    def ids(self) -> Iterator[str]:
        """In key order; a snapshot, so callers may remove while iterating."""
        return iter([rid for _, rid in self._items])

    def largest_at_most(self, bound: int) -> str | None:
        """The entry with the largest first key component <= bound (keys start with a length)."""
        i = bisect_right(self._items, ((bound, math.inf),)) - 1
        return self._items[i][1] if i >= 0 else None


class PTQueue:
    """Prompts waiting for their (first) chunk: priority order plus a length index."""

    def __init__(self) -> None:
        self.order = SortedIndex()
        self.by_length = SortedIndex()  # key (prompt tokens, seq)

    def __len__(self) -> int:
        return len(self.order)

    def __contains__(self, rid: str) -> bool:
        return rid in self.order

    def push(self, rid: str, key: Key, length: int) -> None:
        self.order.add(rid, key)
        self.by_length.add(rid, (length, key[-1]))

    def remove(self, rid: str) -> bool:
        self.by_length.remove(rid)
        return self.order.remove(rid)

    def closest_fit(self, need: int) -> str | None:
        """Binary search: the prompt whose length is closest to `need` without exceeding it."""
        return self.by_length.largest_at_most(need)


class GTQueue:
    """Decoding tasks waiting for KV, grouped by predicted remaining length."""

    def __init__(self) -> None:
        self.order = SortedIndex()
        self.groups: dict[int, set[str]] = {}
        self.group_of: dict[str, int] = {}
        self.resident = SortedIndex()  # KV on the GPU; key (remaining length, seq): KVCPipe guests
        self.demand: dict[str, int] = {}  # blocks each still needs to start its group
        self.pending_blocks = 0

    def __len__(self) -> int:
        return len(self.order)

    def __contains__(self, rid: str) -> bool:
        return rid in self.order

    def push(self, rid: str, key: Key, group_len: int, remaining: int, resident: bool, demand: int) -> None:
        self.remove(rid)
        self.order.add(rid, key)
        self.groups.setdefault(group_len, set()).add(rid)
        self.group_of[rid] = group_len
        if resident:
            self.resident.add(rid, (remaining, key[-1]))
        self.demand[rid] = demand
        self.pending_blocks += demand

    def remove(self, rid: str) -> bool:
        if not self.order.remove(rid):
            return False
        group_len = self.group_of.pop(rid)
        members = self.groups[group_len]
        members.discard(rid)
        if not members:
            del self.groups[group_len]
        self.resident.remove(rid)
        self.pending_blocks -= self.demand.pop(rid)
        return True

    def group_members(self, rid: str) -> list[str]:
        """The head's whole group, in priority order (a group is small)."""
        members = self.groups[self.group_of[rid]]
        return sorted(members, key=lambda m: self.order._keys[m])

    def closest_guest(self, max_remaining: int) -> str | None:
        return self.resident.largest_at_most(max_remaining)

    def last_resident(self, exclude: str) -> str | None:
        """The lowest-priority queued GT holding GPU blocks, other than `exclude`."""
        for _, rid in reversed(self.order._items):
            if rid != exclude and rid in self.resident:
                return rid
        return None


@dataclass
class TaskState:
    """The policy's per-request record (kept in `Request.policy_state`)."""

    seq: int
    remaining: int = 0  # predicted output tokens still to generate, as of the last (re)grouping
    target: int = 0  # output tokens at which that prediction says it ends
    group: int | None = None  # running group id (time-synced batching)
    planned_tokens: int | None = None  # tokens its first GT allocation covered (provisioning log)
    future_blocks: int = 0  # output blocks a PT in prefill will ask for as a GT
    prompt_blocks: int = 0  # reserve blocks a PT in prefill was admitted with
    host: str | None = None  # KVCPipe: the GT whose blocks it borrows
    lent_blocks: int = 0  # blocks borrowed from the host
    guests: list[str] | None = None  # KVCPipe: GTs living in its lent tail, innermost last
