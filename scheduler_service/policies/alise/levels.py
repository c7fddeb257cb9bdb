"""A step's paused jobs by queue, in rank order, for ALISE's Algorithm 2 (`AlisePolicy.after_batch`).

Why: Algorithm 2 walks the queues in priority order and, per queue, its paused jobs by EWT,
where a job's EWT sums the remaining times of every job ranked ahead of it. Read from a list
of every KV holder, that walk visits each paused job every step, although in most steps every
queue's paused jobs fit under the job limit M and none is swapped out: nothing moves. Hundreds
of jobs sit paused in a long run (365 after 200 steps at 256 running / 10,000 waiting, 893
after 500), so the walk grew with the run.

`IndexedLevels` answers from the policy's paused index instead: a queue's size is two
bisections of the index's untouched middle (ranks start with the queue) plus the few entries
the step consumed at its ends and the running jobs it paused; a queue's jobs, and the sum of
the running jobs' remaining times, are read only when a queue needs its EWTs. `SortedLevels`
is the same from a sorted list of every KV holder (the policy without the index; the tests
compare the two).

    step start: PausedIndex.sync, running jobs sorted (`run`)
    the step consumes the index's ends (resumes from the left, evictions from the right)
    after_batch: count(q) for every queue; jobs(q) and running_ahead() only where needed
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Collection, Iterable

from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.policies.paused_index import Entry, PausedSpan

_KEPT, _SWAPPED = RequestStatus.PREEMPTED_KEPT, RequestStatus.PREEMPTED_SWAPPED
_DECODING, _PREFILLING = RequestStatus.DECODING, RequestStatus.PREFILLING


def _by_level(entries: Iterable[Entry]) -> dict[int, list[Entry]]:
    out: dict[int, list[Entry]] = {}
    for e in entries:
        out.setdefault(e[0], []).append(e)
    return out


class SortedLevels:
    """The paused jobs among a step's KV holders (sorted by rank at its start), by queue."""

    def __init__(self, ranked: list[Request], scheduled: Collection[str]) -> None:
        by_level: dict[int, list[Entry]] = {}
        ahead = 0.0
        for req in ranked:
            status = req.status
            rank = req.policy_state.rank
            if status is _KEPT or status is _SWAPPED:
                by_level.setdefault(rank[0], []).append((*rank, req))
            elif req.request_id in scheduled or status is _DECODING or status is _PREFILLING:  # is_running
                ahead += rank[1]
        self._by_level = by_level
        self._ahead = ahead
        self.total = sum(len(v) for v in by_level.values())

    def count(self, level: int) -> int:
        return len(self._by_level.get(level, ()))

    def jobs(self, level: int) -> list[Entry]:
        return self._by_level.get(level, [])

    def running_ahead(self) -> float:
        """The remaining times of the holders that run on, summed in rank order."""
        return self._ahead


class IndexedLevels:
    """The paused jobs after a step, by queue, from the paused index as the step left it
    (`entries[lo:hi]` untouched) and the step's running jobs as it sorted them (`run`)."""

    def __init__(self, index: PausedSpan, run: list[Entry], scheduled: Collection[str]) -> None:
        entries, lo, hi = index.entries, index.lo, index.hi
        self._entries, self._lo, self._hi = entries, lo, hi
        self._run = run
        self._scheduled = scheduled
        left = [e for e in entries[:lo] if (s := e[3].status) is _KEPT or s is _SWAPPED]
        right = [e for e in entries[hi:] if (s := e[3].status) is _KEPT or s is _SWAPPED]
        paused_now = [e for e in run if (s := e[3].status) is _KEPT or s is _SWAPPED]
        self._left, self._right, self._paused_now = _by_level(left), _by_level(right), _by_level(paused_now)
        self.total = hi - lo + len(left) + len(right) + len(paused_now)

    def _middle(self, level: int) -> tuple[int, int]:
        """The untouched entries of queue `level`: `entries[a:b]` (ranks start with the queue)."""
        entries, lo, hi = self._entries, self._lo, self._hi
        a = bisect_left(entries, (level,), lo, hi)
        return a, bisect_left(entries, (level + 1,), a, hi)

    def count(self, level: int) -> int:
        a, b = self._middle(level)
        n = b - a
        for part in (self._left, self._right, self._paused_now):
            got = part.get(level)
            if got:
                n += len(got)
        return n

    def jobs(self, level: int) -> list[Entry]:
        a, b = self._middle(level)
        # NOTE: the index's consumed left end, its middle and its right end are in rank order
        # one after the other; the jobs this step paused go among them
        out = [*self._left.get(level, ()), *self._entries[a:b], *self._right.get(level, ())]
        paused_now = self._paused_now.get(level)
        if paused_now:
            out += paused_now
            out.sort()
        return out

    def running_ahead(self) -> float:
        """`SortedLevels.running_ahead`: the running jobs and the paused ones the step resumed
        (all at the index's consumed left end), summed in rank order."""
        scheduled = self._scheduled
        holders = [*self._run, *self._entries[: self._lo]]
        holders.sort()
        ahead = 0.0
        for e in holders:
            req = e[3]
            if req.request_id in scheduled or (s := req.status) is _DECODING or s is _PREFILLING:
                ahead += e[1]
        return ahead
