"""The KV holders of a queue policy (`policies/mlfq.py`) in rank order without sorting the
paused ones every step.

Why: FastServe pauses thousands of jobs on the GPU (their KV kept) and ranked every KV holder
each step; sorting them all was a fifth of its `schedule()` at 256 running / 10,000 waiting
and grew with the paused set (18,000 paused at 1,000 / 100,000). A paused job's rank changes
only when its policy moves it (and says so), so the paused jobs stay in a sorted list that a
step touches only where it pauses, resumes or reads jobs.

    Scheduler.preempt ──on_preempted──> PausedIndex.touch (also: re-ranked while paused)
    end / return to the router / hand-off ──on_finished──> PausedIndex.drop (its entry)
    step start: PausedIndex.sync ──> `entries` holds exactly kept + swapped, by rank
    RankedHolders(running sorted this step, index): popleft / pop like a deque over
       running + paused in rank order, through two cursors into `entries` (consumed ends)

Entries are flat (level, key, seq, job) tuples (a rank's three fields, then the job: flat
tuples compare faster than nested ones); ranks are unique (seq is the job's sequence number),
so the order is the total order a sort of every KV holder gives, and a job is never compared.
A job's `JobState.filed` is its entry while it is in the list (None: not in it).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Mapping
from typing import TYPE_CHECKING

from scheduler_service.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from scheduler_service.core.step_builder import StepBuilder
    from scheduler_service.policies.mlfq import Rank

Entry = tuple[int, float, int, Request]  # a rank's fields, then its job

_KEPT, _SWAPPED = RequestStatus.PREEMPTED_KEPT, RequestStatus.PREEMPTED_SWAPPED
_DECODING, _PREFILLING = RequestStatus.DECODING, RequestStatus.PREFILLING


def _survivors(entries: list[Entry]) -> list[Entry]:
    """The consumed entries that stay: the job is still paused and this is still its entry."""
    out = []
    for e in entries:
        st = e[3].policy_state
        if st.filed is e:
            status = e[3].status
            if status is _KEPT or status is _SWAPPED:
                out.append(e)
            else:
                st.filed = None
    return out


def _merged(entries: list[Entry], new: list[Entry]) -> list[Entry]:
    """`entries` with the sorted `new` ones filed in order (ranks are unique), in place. Dozens
    of pauses a step land among thousands of entries: the stretch up to the last new one is
    built once and written over the old one (the entries after it move, as a block, once),
    not one move of the tail per entry."""
    if not entries or entries[-1] < new[0]:
        # NOTE: most pauses file the job behind every paused one (FastServe: a job of the
        # deepest level with its newest key)
        entries += new
        return entries
    if len(new) == 1:
        insort(entries, new[0])
        return entries
    out: list[Entry] = []
    lo, n = 0, len(entries)
    for e in new:
        # NOTE: a step's pauses land in clusters (FastServe's: a hundred before every paused job
        # in a third of its steps): one comparison places a new entry that goes before the next
        # old one, the rest are bisected
        if lo < n and entries[lo] < e:
            i = bisect_left(entries, e, lo + 1)
            out += entries[lo:i]
            lo = i
        out.append(e)
    entries[:lo] = out
    return entries


class PausedSpan:
    """Sorted paused entries and the stretch `entries[lo:hi]` a view has not consumed: the
    index's own, or a throwaway one (a prefill pass's victims below one waiting head)."""

    __slots__ = ("entries", "hi", "lo")

    def __init__(self, entries: list[Entry], lo: int = 0, hi: int | None = None) -> None:
        self.entries = entries
        self.lo = lo  # the step's view consumed entries[:lo] and entries[hi:]
        self.hi = len(entries) if hi is None else hi


class PausedIndex(PausedSpan):
    """Paused KV holders (kept or swapped), sorted by rank, kept exact by `touch` + `sync`."""

    def __init__(self, entries_current: bool = False) -> None:
        """`entries_current`: every job's `JobState.entry` is (*its rank, job), and is filed as
        it is (no tuple built per pause: dozens a step, each one more object for the collector)."""
        super().__init__([])
        self.entries_current = entries_current
        self.pending: list[Request] = []  # touched since the last sync
        self.gone: list[Entry] = []  # entries of jobs that ended or left the worker since
        self.rebuilds = 0  # syncs that found the list off the paused set and sorted it again

    def touch(self, req: Request) -> None:
        """The job was paused, re-ranked while paused, or recomputed (left the paused set
        without a step's view consuming it): refiled at the next sync."""
        self.pending.append(req)

    def drop(self, entry: Entry) -> None:
        """The entry's job ended or left this worker: its entry goes at the next sync."""
        self.gone.append(entry)

    def sync(self, kept: Mapping[str, Request], swapped: Mapping[str, Request]) -> None:
        """Folds the last step's view and the touched jobs back into the list; afterwards it
        holds exactly the paused jobs, each under its current rank."""
        entries, lo, hi = self.entries, self.lo, self.hi
        if lo or hi < len(entries):
            # NOTE: only the consumed ends are checked (a job in the middle changed only if
            # touched): an entry stays while its job is paused and it is still the job's entry.
            # The survivors of each end stay in order on their side of the untouched middle,
            # written over the ends in place (no copy of the thousands of entries between).
            if hi < len(entries):
                entries[hi:] = _survivors(entries[hi:])
            if lo:
                entries[:lo] = _survivors(entries[:lo])
        for e in self.gone:
            i = bisect_left(entries, e)
            if i < len(entries) and entries[i] is e:
                del entries[i]
        self.gone = []
        adds: dict[int, Entry] = {}  # this sync's new entries by job, filed in one pass below
        current = self.entries_current
        for req in self.pending:
            st = req.policy_state
            status = req.status
            filed = st.filed
            if status is _KEPT or status is _SWAPPED:
                if filed is None:
                    # NOTE: the common case, a job paused this step (a running job has no entry):
                    # what the lines below do for it
                    adds[id(req)] = st.filed = st.entry if current else (*st.rank, req)
                    continue
                rank = st.rank
                if filed[0] == rank[0] and filed[1] == rank[1] and filed[2] == rank[2]:
                    continue
            elif filed is None:
                continue
            else:
                rank = None
            # NOTE: here the job has an entry (filed), which its move makes stale
            if adds.get(id(req)) is filed:
                del adds[id(req)]  # filed by this sync (touched twice): not in the list yet
            else:
                i = bisect_left(entries, filed)
                if i < len(entries) and entries[i] is filed:
                    del entries[i]
            if rank is not None:
                adds[id(req)] = st.filed = st.entry if current else (*rank, req)
            else:
                st.filed = None
        self.pending = []
        if adds:
            entries = _merged(entries, sorted(adds.values()))
        if len(entries) != len(kept) + len(swapped):
            # NOTE: a path that moved a paused job without `touch`: correct over fast
            self.rebuilds += 1
            for e in entries:
                if e[3].policy_state.filed is e:  # NOTE: another worker's state is not ours to reset
                    e[3].policy_state.filed = None
            entries = sorted((*r.policy_state.rank, r) for r in [*kept.values(), *swapped.values()])
            for e in entries:
                e[3].policy_state.filed = e
        self.entries = entries
        self.lo, self.hi = 0, len(entries)


class RankedHolders:
    """One step's KV holders in rank order, consumed from both ends like a deque: the running
    jobs (sorted this step) merged with the paused index's entries through its cursors."""

    __slots__ = ("_hi", "_index", "_last", "_lo", "_paused", "_run", "stopped_at")

    def __init__(self, running: list[Entry], index: PausedSpan) -> None:
        """`running`: the running jobs' entries, sorted; `index`: the paused entries, read
        (and consumed) through its cursors."""
        self._run = running
        self._lo, self._hi = 0, len(running)
        self._index = index
        self._paused = index.entries
        self._last = False  # the last `pop` took a paused job
        # the entry `run_covered` last stopped at because it ranked after its limit (None: none
        # yet). The jobs are consumed best first, so every job left ranks at or after it for the
        # rest of the step: a walk with a limit ranked before it would stop at once.
        self.stopped_at: Entry | None = None

    def __bool__(self) -> bool:
        return self._lo < self._hi or self._index.lo < self._index.hi

    def pop_before(self, limit: Rank | None) -> Request | None:
        """The best job left if it ranks at or before `limit` (None: any), else None."""
        index = self._index
        paused = self._paused[index.lo] if index.lo < index.hi else None
        # NOTE: an entry against a rank compares its three fields first: never equal, as the
        # rank is another job's
        if self._lo < self._hi:
            entry = self._run[self._lo]
            if paused is None or entry < paused:
                if limit is None or entry <= limit:
                    self._lo += 1
                    return entry[3]
                return None
        if paused is not None and (limit is None or paused <= limit):
            index.lo += 1
            return paused[3]
        return None

    def run_covered(self, limit: Rank | None, step: StepBuilder) -> Request | None:
        """Pops jobs in rank order while they rank at or before `limit` (None: any) and the
        budget has seats and tokens: a running one is scheduled with `covered(job, tokens to
        compute)`, a kept one resumed and scheduled with `resumed(job, tokens)`; returns the
        first job neither does (popped: the caller runs it the general way), or None when the
        next job ranks after `limit`, none is left or the budget is full. What `pop_before`
        and the covered step of each would do, one call for the lot (most of a step)."""
        run, lo, hi = self._run, self._lo, self._hi
        index = self._index
        paused, plo, phi = self._paused, index.lo, index.hi
        budget, covered, resumed = step.budget, step.schedule_if_covered, step.resume_if_covered
        resume = step.resume_covered
        # NOTE: with block allocation `covered`'s and `resumed`'s test is written out below
        # (the table holds the step's tokens and the budget has room): a call fewer per running
        # job, about 130 a FastServe step, and a test fewer per resumed one, about 55; the seat
        # test is the loop's, and nothing takes a seat in between.
        view = step.table_cover()
        tables, scheduled, block_size = view if view is not None else ({}, {}, 0)
        while budget.num_seqs < budget.max_seqs and budget.num_tokens < budget.max_tokens:
            # NOTE: an entry against a rank compares its three fields first: never equal
            if lo < hi and (plo >= phi or run[lo] < paused[plo]):
                entry = run[lo]
                if limit is not None and entry > limit:
                    self.stopped_at = entry
                    break
                lo += 1
            elif plo < phi:
                entry = paused[plo]
                if limit is not None and entry > limit:
                    self.stopped_at = entry
                    break
                plo += 1
            else:
                break
            job = entry[3]
            status = job.status
            computed = job.num_computed_tokens
            n = job.num_prompt_tokens + job.num_output_tokens - computed
            running = status is _DECODING or status is _PREFILLING
            if view is None:
                if running:
                    if covered(job, n):
                        continue
                elif status is _KEPT and resumed(job, n):
                    continue
            elif running or status is _KEPT:
                rid = job.request_id
                table = tables.get(rid)
                if (
                    n > 0
                    and table is not None
                    and rid not in scheduled
                    and len(table) * block_size >= computed + n
                    and budget.num_tokens + n <= budget.max_tokens
                ):
                    if running:
                        budget.num_tokens += n
                        budget.num_seqs += 1
                        scheduled[rid] = n
                    else:
                        resume(job, n)  # NOTE: the same test passed: `resume_if_covered`'s move
                    continue
            self._lo, index.lo = lo, plo
            return job
        self._lo, index.lo = lo, plo
        return None

    def popleft(self) -> Request:
        index = self._index
        if self._lo < self._hi and (index.lo >= index.hi or self._run[self._lo] < self._paused[index.lo]):
            self._lo += 1
            return self._run[self._lo - 1][3]
        if index.lo >= index.hi:
            raise IndexError("popleft from an empty ranking")
        index.lo += 1
        return self._paused[index.lo - 1][3]

    def pop(self) -> Request:
        """The worst job left."""
        index = self._index
        if self._lo < self._hi and (index.lo >= index.hi or self._run[self._hi - 1] > self._paused[index.hi - 1]):
            self._hi -= 1
            self._last = False
            return self._run[self._hi][3]
        if index.lo >= index.hi:
            raise IndexError("pop from an empty ranking")
        index.hi -= 1
        self._last = True
        return self._paused[index.hi][3]

    def append(self, req: Request) -> None:
        """Puts back the job the last `pop` took (deque.append after deque.pop)."""
        if self._last:
            self._index.hi += 1
        else:
            self._hi += 1
