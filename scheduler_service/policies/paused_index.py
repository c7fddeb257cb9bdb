"""The KV holders of a queue policy (`policies/mlfq.py`) in rank order without sorting the
paused ones every step.

Why: FastServe pauses thousands of jobs on the GPU (their KV kept) and ranked every KV holder
each step; sorting them all was a fifth of its `schedule()` at 256 running / 10,000 waiting
and grew with the paused set (18,000 paused at 1,000 / 100,000). A paused job's rank changes
only when its policy moves it (and says so), so the paused jobs stay in a sorted list that a
step touches only where it pauses, resumes or reads jobs.

    Scheduler.preempt ──on_preempted──> PausedIndex.touch (also: re-ranked while paused,
       recomputed, finished)
    step start: PausedIndex.sync ──> `entries` holds exactly kept + swapped, by rank
    RankedHolders(running sorted this step, index): popleft / pop like a deque over
       running + paused in rank order, through two cursors into `entries` (consumed ends)

Entries are (rank, job); ranks are unique (their last field is the job's sequence number),
so the order is the total order a sort of every KV holder gives. A job's `JobState.filed` is
the rank it is filed under (None: not in the list).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Mapping
from typing import TYPE_CHECKING

from scheduler_service.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from scheduler_service.policies.mlfq import Rank

Entry = tuple["Rank", Request]

_KEPT, _SWAPPED = RequestStatus.PREEMPTED_KEPT, RequestStatus.PREEMPTED_SWAPPED


def _still_filed(entry: Entry) -> bool:
    """A consumed entry goes back to the list: its job is still paused under that rank."""
    req = entry[1]
    status = req.status
    if (status is _KEPT or status is _SWAPPED) and req.policy_state.filed == entry[0]:
        return True
    if req.policy_state.filed == entry[0]:
        req.policy_state.filed = None
    return False


class PausedIndex:
    """Paused KV holders (kept or swapped), sorted by rank, kept exact by `touch` + `sync`."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.lo = self.hi = 0  # the step's view consumed entries[:lo] and entries[hi:]
        self.pending: list[Request] = []  # touched since the last sync
        self.rebuilds = 0  # syncs that found the list off the paused set and sorted it again

    def touch(self, req: Request) -> None:
        """The job was paused, re-ranked while paused, or left the paused set by a path
        that does not consume it from a step's view (recompute, end): refiled at the next sync."""
        self.pending.append(req)

    def sync(self, kept: Mapping[str, Request], swapped: Mapping[str, Request]) -> None:
        """Folds the last step's view and the touched jobs back into the list; afterwards it
        holds exactly the paused jobs, each under its current rank."""
        entries, lo, hi = self.entries, self.lo, self.hi
        if lo or hi < len(entries):
            # NOTE: only the consumed ends are checked; a job in the middle changed only if touched
            entries = [e for e in entries[:lo] if _still_filed(e)] + entries[lo:hi]
            entries += [e for e in self.entries[hi:] if _still_filed(e)]
        for req in self.pending:
            st = req.policy_state
            status = req.status
            want = st.rank if status is _KEPT or status is _SWAPPED else None
            if st.filed == want:
                continue
            if st.filed is not None:
                i = bisect_left(entries, (st.filed,))
                if i < len(entries) and entries[i][1] is req:
                    del entries[i]
            if want is not None:
                insort(entries, (want, req))
            st.filed = want
        self.pending = []
        if len(entries) != len(kept) + len(swapped):
            # NOTE: a path that moved a paused job without `touch`: correct over fast
            self.rebuilds += 1
            for _, req in entries:
                req.policy_state.filed = None
            entries = sorted((r.policy_state.rank, r) for r in [*kept.values(), *swapped.values()])
            for rank, req in entries:
                req.policy_state.filed = rank
        self.entries = entries
        self.lo, self.hi = 0, len(entries)


class RankedHolders:
    """One step's KV holders in rank order, consumed from both ends like a deque: the running
    jobs (sorted this step) merged with the paused index's entries through its cursors."""

    __slots__ = ("_hi", "_index", "_last", "_lo", "_paused", "_run")

    def __init__(self, running: list[Entry], index: PausedIndex) -> None:
        self._run = running
        self._lo, self._hi = 0, len(running)
        self._index = index
        self._paused = index.entries
        self._last = False  # the last `pop` took a paused job

    def __bool__(self) -> bool:
        return self._lo < self._hi or self._index.lo < self._index.hi

    def pop_before(self, limit: Rank | None) -> Request | None:
        """The best job left if it ranks at or before `limit` (None: any), else None."""
        index = self._index
        paused = self._paused[index.lo] if index.lo < index.hi else None
        if self._lo < self._hi:
            entry = self._run[self._lo]
            if paused is None or entry[0] < paused[0]:
                if limit is None or entry[0] <= limit:
                    self._lo += 1
                    return entry[1]
                return None
        if paused is not None and (limit is None or paused[0] <= limit):
            index.lo += 1
            return paused[1]
        return None

    def popleft(self) -> Request:
        index = self._index
        if self._lo < self._hi and (index.lo >= index.hi or self._run[self._lo][0] < self._paused[index.lo][0]):
            self._lo += 1
            return self._run[self._lo - 1][1]
        if index.lo >= index.hi:
            raise IndexError("popleft from an empty ranking")
        index.lo += 1
        return self._paused[index.lo - 1][1]

    def pop(self) -> Request:
        """The worst job left."""
        index = self._index
        if self._lo < self._hi and (index.lo >= index.hi or self._run[self._hi - 1][0] > self._paused[index.hi - 1][0]):
            self._hi -= 1
            self._last = False
            return self._run[self._hi][1]
        if index.lo >= index.hi:
            raise IndexError("pop from an empty ranking")
        index.hi -= 1
        self._last = True
        return self._paused[index.hi][1]

    def append(self, req: Request) -> None:
        """Puts back the job the last `pop` took (deque.append after deque.pop)."""
        if self._last:
            self._index.hi += 1
        else:
            self._hi += 1
