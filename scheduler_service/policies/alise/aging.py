"""When each ALISE job's aging check is due (section 3.1's virtual aging), by time.

Why: every unfinished job is checked once per aging period, in the order of (due time, job
sequence number). Jobs that arrived together, or were promoted in the same step, come due
together: when 10,000 queued requests age at once, a heap of one entry per job popped and
pushed each of them. Here the jobs due at one time share a bucket, so a step's checks cost one
heap operation per distinct due time, and the order is the one a heap of (time, seq, job)
entries gives.
"""

from __future__ import annotations

import heapq

from scheduler_service.core.request import Request


class DueQueue:
    """(due time, seq, job) entries in due-time buckets; `pop_due` takes every bucket that is due."""

    def __init__(self) -> None:
        self._times: list[float] = []  # a heap of the buckets' due times
        self._buckets: dict[float, list[tuple[int, Request]]] = {}

    def __len__(self) -> int:
        return sum(len(b) for b in self._buckets.values())

    def push(self, due: float, seq: int, req: Request) -> None:
        self.push_entry(due, (seq, req))

    def push_entry(self, due: float, entry: tuple[int, Request]) -> None:
        """Files an entry `pop_due` gave again (the same tuple: a wave of thousands allocates none)."""
        bucket = self._buckets.get(due)
        if bucket is None:
            self._buckets[due] = [entry]
            heapq.heappush(self._times, due)
        else:
            bucket.append(entry)

    def push_entries(self, due: float, entries: list[tuple[int, Request]]) -> None:
        """`push_entry(due, e)` of each (a bucket is sorted when it is taken, so the order in
        which its entries come does not matter)."""
        bucket = self._buckets.get(due)
        if bucket is None:
            self._buckets[due] = entries
            heapq.heappush(self._times, due)
        else:
            bucket += entries

    def pop_due(self, now: float) -> list[tuple[int, Request]]:
        """Every (seq, job) due at or before `now`, by due time then seq (seqs are unique, so a
        job is never compared); entries pushed while the caller walks them are the next call's."""
        times = self._times
        if not times or times[0] > now:
            return []
        out: list[tuple[int, Request]] = []
        while times and times[0] <= now:
            bucket = self._buckets.pop(heapq.heappop(times))
            bucket.sort()
            out += bucket
        return out
