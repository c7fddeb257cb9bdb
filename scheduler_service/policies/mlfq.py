"""Multi-level priority queues with iteration-level preemption: the machinery `alise` and
`fastserve` share (ALISE, seed 003, section 3.1; FastServe's skip-join MLFQ).

Why: both policies rank every unfinished job by (queue level, key within the level) and
each iteration run the best-ranked jobs that fit, pausing the others; only the ranking
(predicted remaining time vs. time of entering the level) and the per-level rules (aging,
quanta) differ, so those stay in the policies and the walk lives here.

How data flows:

    arrival / recompute preemption ──> LevelQueues (a heap per level, lazy deletion)
    running (hold KV) ──> re-ranked and sorted each step
    kept + swapped (paused, hold KV) ──> a PausedIndex, sorted by cached rank and refiled only
       where a job is paused, resumed or moved (a paused job's rank changes only when a policy
       moves its level, which refreshes it there); without `index_paused`, every KV holder is
       sorted each step (the reference the tests compare the index with)
    schedule(): merge the two in rank order ──> run each job that fits (seats, tokens, KV)
       KV short: evict the lowest-ranked GPU holder not yet reached (swap or recompute);
       `defer` never evicts for a new job: it waits
    running but not run this step ──> preempted KEEP (KV stays on the GPU, paused)

Waiting jobs (no KV) sit in the heaps with static keys, so a step pops only the heads it
admits or skips: O((batch + KV jobs) log n), never a sort of the whole queue.
"""

from __future__ import annotations

import heapq
from abc import abstractmethod
from bisect import bisect_right, insort
from collections import Counter, deque
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from enum import StrEnum
from operator import attrgetter

from scheduler_service.core.policy import Policy, PolicyConfig, PolicyContext
from scheduler_service.core.preemption import PreemptionMode, PreemptionReason
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.step_builder import StepBuilder
from scheduler_service.policies.paused_index import Entry, PausedIndex, PausedSpan, RankedHolders

# NOTE: a waiting head whose prompt does not fit the step's leftover tokens is set aside;
# after this many the walk stops looking at waiting jobs for this step (bounds the pops).
MAX_SKIPPED_WAITING = 32

Rank = tuple[int, float, int]
QueueEntry = tuple[float, int, int, Request]  # a waiting job's (key, seq, version, job)
_DECODING, _PREFILLING = RequestStatus.DECODING, RequestStatus.PREFILLING
_WAITING, _RECOMPUTE = RequestStatus.WAITING, RequestStatus.PREEMPTED_RECOMPUTE


class RankDeque(deque[Request]):
    """KV holders in rank order (a deque over a sorted list), with RankedHolders' peek."""

    # RankedHolders.stopped_at: the rank of the job `run_covered` last stopped at (None: none yet)
    stopped_at: Rank | None = None

    def pop_before(self, limit: Rank | None) -> Request | None:
        """The best job left if it ranks at or before `limit` (None: any), else None."""
        if self and (limit is None or self[0].policy_state.rank <= limit):
            return self.popleft()
        return None

    def run_covered(self, limit: Rank | None, step: StepBuilder) -> Request | None:
        """RankedHolders.run_covered over the deque."""
        budget, covered, resumed = step.budget, step.schedule_if_covered, step.resume_if_covered
        while self and budget.num_seqs < budget.max_seqs and budget.num_tokens < budget.max_tokens:
            job = self[0]
            if limit is not None and job.policy_state.rank > limit:
                self.stopped_at = job.policy_state.rank
                return None
            self.popleft()
            status = job.status
            n = job.num_prompt_tokens + job.num_output_tokens - job.num_computed_tokens
            if status is _DECODING or status is _PREFILLING:
                if covered(job, n):
                    continue
            elif status is RequestStatus.PREEMPTED_KEPT and resumed(job, n):
                continue
            return job
        return None


Victims = RankDeque | RankedHolders  # GPU holders ranked below the current job, worst at the right


class MemoryMode(StrEnum):
    SWAP = "swap"  # evicted KV goes to CPU (ALISE's manager, FastServe)
    RECOMPUTE = "recompute"  # evicted KV is dropped and prefilled again later (ALISE strawman)
    DEFER = "defer"  # no eviction for new jobs: they wait for memory (ALISE strawman)


@dataclass(slots=True)
class JobState:
    """Per-request state of a queue policy (kept in `Request.policy_state`)."""

    level: int
    key: float  # order inside the level, smaller first
    seq: int  # tie-break: order of (re)queueing
    clock: float  # when its aging clock last restarted (served, or promoted)
    version: int = 0  # bumped to invalidate heap entries
    in_heap: bool = False
    weight: float = 0.0  # what it adds to its level's sum while waiting (ALISE: remaining time)
    predicted: int = 0  # ALISE: predicted output tokens (doubled on misprediction)
    attained: float = 0.0  # FastServe: service received in the current level
    rank: Rank = (0, 0.0, 0)  # while it holds KV: its rank as last refreshed
    filed: tuple[int, float, int, Request] | None = None  # its entry in the policy's PausedIndex
    # (*rank, job), built where the rank moves, by a policy whose `entries_current` says so
    entry: tuple[int, float, int, Request] | None = None


class LevelQueues:
    """One heap per level of the waiting (KV-less) jobs, with per-level counts and sums.

    Each level also has a front: a short sorted list of entries that rank before every entry
    of its heap, read before the heap. A step takes waiting heads and puts back those it set
    aside (a prompt the tokens left cannot hold: about 30 a FastServe step, the same heads
    step after step); they go back to the front as they came out, instead of each sifting
    through a heap of thousands twice. Entries are (key, seq, version, job); ranks are unique,
    so the fronts and heaps together give the order one heap would."""

    def __init__(self, num_levels: int) -> None:
        self.heaps: list[list[QueueEntry]] = [[] for _ in range(num_levels)]
        self.fronts: list[list[QueueEntry]] = [[] for _ in range(num_levels)]  # ascending, before the heap
        # NOTE: every level's front, then its heap (the lists are never replaced, only changed
        # in place): built once, where a peek per waiting head rebuilt it (ALISE's prefill pass)
        self._order = [
            pair for front, heap in zip(self.fronts, self.heaps, strict=True) for pair in ((front, False), (heap, True))
        ]
        self.counts = [0] * num_levels
        self.sums = [0.0] * num_levels
        self.changes = 0  # bumped by every push and discard: a peeked head is stale once it moves
        self.filed = 0  # bumped wherever entries are filed: a list found empty may hold one since

    def __len__(self) -> int:
        return sum(self.counts)

    def push(self, req: Request) -> None:
        st: JobState = req.policy_state
        if st.in_heap:
            self.discard(req)
        st.version += 1
        st.in_heap = True
        self.changes += 1
        self._file((st.key, st.seq, st.version, req), st.level)
        self.counts[st.level] += 1
        self.sums[st.level] += st.weight

    def _file(self, entry: QueueEntry, level: int) -> None:
        """Files an entry where it keeps the front before its heap."""
        self.filed += 1
        front = self.fronts[level]
        if front and entry < front[-1]:
            insort(front, entry)
        else:
            heapq.heappush(self.heaps[level], entry)

    def put_back(self, entries: list[QueueEntry]) -> None:
        """Files again, unchanged, live entries taken from this level's heads this step (their
        jobs untouched since). Those ranked before the level's front and heap go to the
        front in one move; the rest are filed one by one."""
        entries.sort()
        self.filed += 1
        level = entries[0][3].policy_state.level
        front, heap = self.fronts[level], self.heaps[level]
        last = entries[-1]
        if (not front or last < front[0]) and (not heap or last < heap[0]):
            front[:0] = entries
        else:
            for entry in entries:
                self._file(entry, level)
        self.changes += 1

    def move_up(self, jobs: list[Request], keys: list[float]) -> None:
        """Moves each waiting job one level up with its new key, which is also its weight: what
        `discard`, then `push`, of each in turn do (every level's count and sum take the same
        additions in the same order, so its sum is the same float), except that the new entries
        are filed level by level at the end, and a heap that takes many at once is rebuilt
        without its stale entries instead of sifting each in (aging moves thousands of waiting
        jobs in one step when they arrived together)."""
        counts, sums = self.counts, self.sums
        new: list[list[QueueEntry]] = [[] for _ in counts]  # by level
        for req, key in zip(jobs, keys, strict=True):
            st: JobState = req.policy_state
            level = st.level
            counts[level] -= 1
            sums[level] -= st.weight
            st.version += 2  # NOTE: the versions `discard`, then `push`, would give
            level -= 1
            st.level, st.key, st.weight = level, key, key
            counts[level] += 1
            sums[level] += key
            new[level].append((key, st.seq, st.version, req))
        self.changes += 2 * len(jobs)
        self.filed += 1
        for level, entries in enumerate(new):
            if entries:
                self._file_many(level, entries)

    def _file_many(self, level: int, new: list[QueueEntry]) -> None:
        """Files new entries of one level where `push` would put each."""
        front, heap = self.fronts[level], self.heaps[level]
        if front:
            last = front[-1]
            for entry in new:
                if entry < last:
                    insort(front, entry)
            new = [e for e in new if e > last]
        if len(new) * 8 > len(heap):
            # NOTE: the stale entries (mostly of the jobs just moved) go as it is rebuilt
            heap[:] = [e for e in heap if (st := e[3].policy_state).in_heap and st.version == e[2]]
            heap += new
            heapq.heapify(heap)
        else:
            for entry in new:
                heapq.heappush(heap, entry)

    def discard(self, req: Request) -> None:
        """Takes a job out (lazily: its entry goes stale)."""
        st: JobState = req.policy_state
        if not st.in_heap:
            return
        st.in_heap = False
        st.version += 1
        self.changes += 1
        self.counts[st.level] -= 1
        self.sums[st.level] -= st.weight

    def in_order(self) -> list[tuple[list[QueueEntry], bool]]:
        """Every level's front, then its heap, best level first: (entries, is a heap), in a list
        of the caller's own."""
        return self._order.copy()

    def peek(self) -> Request | None:
        for entries, is_heap in self._order:
            while entries:
                _, _, version, req = entries[0]
                st: JobState = req.policy_state
                if st.in_heap and st.version == version:
                    return req
                if is_heap:
                    heapq.heappop(entries)
                else:
                    del entries[0]
        return None

    def pop(self) -> Request | None:
        req = self.peek()
        if req is not None:
            self.take(req)
        return req

    def take(self, head: Request) -> None:
        """Pops `head`, which `peek` returned with no push or discard since (a live entry at its
        level's front is the head: `peek` dropped the stale ones before it)."""
        level = head.policy_state.level
        front = self.fronts[level]
        if front:
            del front[0]
        else:
            heapq.heappop(self.heaps[level])
        self.discard(head)


@dataclass
class QueuePolicyConfig(PolicyConfig):
    memory: str = "swap"  # swap | recompute | defer: what happens when GPU KV is short
    watermark: float = 0.01  # share of GPU blocks a new job's prompt must leave free


class QueuePolicy(Policy):
    """Iteration-level preemptive scheduling over ranked levels; subclasses rank jobs."""

    config: QueuePolicyConfig
    # True: paused jobs sit in a PausedIndex and a step reads them lazily (their ranks change
    # only where the policy says so, through `rerank_paused`); False: every KV holder is
    # sorted each step into `ranked`. FastServe and ALISE index; the sorted path is the
    # simple one a new policy starts from, and the reference the tests compare the index with.
    index_paused = False
    # True: the policy sets `JobState.entry` to (*rank, job) wherever it sets the rank, and
    # `refresh_ranks` moves no rank, so a step sorts its running jobs' entries without building
    # them (with `index_paused`)
    entries_current = False

    def __init__(self, config: PolicyConfig, ctx: PolicyContext, num_levels: int) -> None:
        super().__init__(config, ctx)
        self.memory = MemoryMode(self.config.memory)
        self.num_levels = num_levels
        self.queues = LevelQueues(num_levels)
        self.jobs: dict[str, Request] = {}  # every unfinished job on this worker
        self.ranked: list[Request] = []  # without `index_paused`: this step's KV holders in rank order
        self.run_entries: list[Entry] = []  # with `index_paused`: this step's running jobs' entries, sorted
        self.admitted: list[Request] = []  # waiting jobs this step admitted
        self.paused = PausedIndex(self.entries_current)  # with `index_paused`: the kept and swapped jobs by rank
        self._ranked_at: StepBuilder | None = None  # the step `ranked` was sorted in (prefill pass)
        self._seq = 0
        # counters for reports (`stats_report`): which preemption path moved a job, and why
        self.stats: Counter[str] = Counter()

    # ------------------------------------------------------------------ ranking
    @abstractmethod
    def rank(self, req: Request) -> Rank:
        """(level, key, seq) of a job now; smaller runs first."""

    @staticmethod
    def filed_rank(req: Request) -> Rank:
        """The rank a waiting job was filed with (its key is static while it waits)."""
        st: JobState = req.policy_state
        return (st.level, st.key, st.seq)

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    # ------------------------------------------------------------------ hooks
    def on_preempted(self, request: Request, now: float) -> None:
        if request.status is RequestStatus.PREEMPTED_RECOMPUTE:
            self.requeue(request)
        if self.index_paused:
            self.paused.pending.append(request)  # PausedIndex.touch (dozens of pauses a step)

    def on_paused(self, requests: list[Request], now: float) -> None:
        # NOTE: `on_preempted` of each (kept jobs: nothing to requeue), in one call
        if self.index_paused:
            self.paused.pending.extend(requests)

    def on_finished(self, request: Request, now: float) -> None:
        if isinstance(request.policy_state, JobState):
            self.queues.discard(request)
            st: JobState = request.policy_state
            st.entry = None  # NOTE: it refers to the request: dropped so that no cycle outlives it
            if st.filed is not None:
                # NOTE: its entry is dropped by identity: a job handed back to the router may be
                # placed elsewhere (a new state) before this index's next sync
                self.paused.drop(st.filed)
                st.filed = None
        self.jobs.pop(request.request_id, None)

    def requeue(self, req: Request) -> None:
        """(Re)files a KV-less job in its level's heap with a fresh key and weight."""
        st: JobState = req.policy_state
        self.queues.discard(req)
        st.key, st.weight = self.key_and_weight(req)
        self.queues.push(req)

    def key_and_weight(self, req: Request) -> tuple[float, float]:
        """A waiting job's key in its level and what it adds to the level's sum."""
        return self.rank(req)[1], self.weight(req)

    def unfile(self, req: Request) -> bool:
        """Before an answer moves a job's level: with overlap the job may have left the batch
        since the step it answers (paused, or recomputed into a level's heap, whose counts go
        by its level): True when it was taken out of its heap (`refile` puts it back)."""
        waiting = req.policy_state.in_heap
        if waiting:
            self.queues.discard(req)
        return waiting

    def refile(self, req: Request, waiting: bool) -> None:
        """After the move: a waiting job goes back in its new level's heap, a paused one is
        re-ranked in the paused index; a running job is ranked by the next step, as always."""
        if waiting:
            self.requeue(req)
        elif not req.status.is_running:
            self.rerank_paused(req)

    def weight(self, req: Request) -> float:
        """What a waiting job adds to its level's sum (ALISE: its remaining time)."""
        return 0.0

    # ------------------------------------------------------------------ one step
    def schedule(self, step: StepBuilder, now: float) -> None:
        self.before_step(step, now)
        if self.prefill_step(step):
            # vLLM's engine: a prefill-only iteration; the running jobs sit this step out
            # (they are not paused: nothing took their seat).
            step.metadata["phase"] = "prefill"
        else:
            self.fill_batch(step, admit_waiting=self.hybrid_batches)
            scheduled = step.scheduled
            idle = [r for rid, r in step.running.items() if rid not in scheduled]
            if idle:
                step.pause(idle, PreemptionReason.PRIORITY)
                self.stats["priority_pauses"] += len(idle)
        self.after_batch(step, now)
        # NOTE: dropped at once, so this step's thousands of (rank, job) pairs die young
        # instead of surviving into the collector's oldest generation: kept until the next
        # step, they set off a full collection of the whole heap every few steps (30-40 ms
        # stalls with FastServe's thousands of paused jobs).
        self.ranked = []
        self.run_entries = []
        self.admitted = []
        self._ranked_at = None

    def before_step(self, step: StepBuilder, now: float) -> None:
        """Level changes that do not depend on the batch (aging)."""

    @property
    def hybrid_batches(self) -> bool:
        """Whether waiting jobs join the running ones in one batch (False: `prefill_step` admits them)."""
        return True

    def prefill_step(self, step: StepBuilder) -> bool:
        """A policy on vLLM's engine admits prompts here, in a prefill-only iteration, and
        answers True when it did; False (the default): one hybrid batch of every kind of job."""
        return False

    def admit_prefills(self, step: StepBuilder) -> int:
        """vLLM's prefill pass with the queue in rank order: waiting heads are admitted
        (whole prompts) while seats, tokens and KV allow; a head may evict only GPU holders
        ranked below it. Returns how many were admitted."""
        indexed = self.index_paused
        if indexed:
            # NOTE: only running jobs can give a seat, and a head's victims are read from the
            # sorted running jobs and the paused index: the paused jobs are never sorted
            run = self.running_entries(step)
            paused = self.paused
        else:
            self.ranked = self.ranked_kv_jobs(step)
        self._ranked_at = step
        self.admitted = []
        skipped: list[Request] = []
        budget, queues = step.budget, self.queues
        while budget.num_tokens < budget.max_tokens:
            head = queues.peek()
            if head is None:
                break
            head_rank = self.filed_rank(head)
            if len(step.running) >= self.ctx.max_num_seqs and not self._pause_worse(step, head_rank):
                break
            queues.pop()
            # NOTE: ranks are unique: the jobs below the head are a tail of each sorted list
            if indexed:
                span = PausedSpan(paused.entries, bisect_right(paused.entries, head_rank))
                victims: Victims = RankedHolders(run[bisect_right(run, head_rank) :], span)
            else:
                victims = RankDeque(self.ranked[bisect_right(self.ranked, head_rank, key=_RANK) :])
            verdict = self._admit(step, head, victims)
            if indexed and span.hi < paused.hi:
                paused.hi = span.hi  # NOTE: entries it evicted: the next sync and `after_batch` look at them
            if verdict and step.is_scheduled(head):
                self.admitted.append(head)
                continue
            skipped.append(head)
            if verdict is None or len(skipped) >= MAX_SKIPPED_WAITING or not budget.can_fit(1):
                break
        for req in skipped:
            if req.status.is_waiting:
                self.queues.push(req)
        return len(self.admitted)  # NOTE: `ranked` and `admitted` stay for `after_batch`

    def _pause_worse(self, step: StepBuilder, rank: Rank) -> bool:
        """Iteration-level preemption on a full engine: the worst-ranked running job below
        `rank` gives its seat (paused, KV kept). False when every running job ranks better."""
        scheduled = step.scheduled
        indexed = self.index_paused
        # NOTE: with the index, only the running jobs (sorted this step) are walked: no paused
        # job can give a seat, and no list of their requests is built for the walk
        for item in reversed(self.run_entries if indexed else self.ranked):
            req = item[3] if indexed else item
            if req.policy_state.rank <= rank:
                return False
            # NOTE: `req.status.is_running and not step.is_scheduled(req)`, inlined: the walk from
            # the worst end passes every paused job ranked below the head (hundreds a head for
            # ALISE at 1,000 running)
            status = req.status
            if (status is _DECODING or status is _PREFILLING) and req.request_id not in scheduled:
                step.preempt(req, PreemptionMode.KEEP, PreemptionReason.PRIORITY)
                self.stats["priority_pauses"] += 1
                return True
        return False

    def after_batch(self, step: StepBuilder, now: float) -> None:
        """Memory moves once the batch is fixed (ALISE's Algorithm 2)."""

    def refresh_ranks(self, jobs: Iterable[Request]) -> None:
        """Stores each job's rank now in its state (the sort key of `ranked_kv_jobs`)."""
        rank = self.rank
        for r in jobs:
            r.policy_state.rank = rank(r)

    def rerank_paused(self, req: Request) -> None:
        """A paused job's rank moved (its policy changed its level): refreshed, and refiled."""
        self.refresh_ranks((req,))
        if self.index_paused:
            self.paused.touch(req)

    def kv_holders(self, step: StepBuilder) -> Victims:
        """Every KV holder in rank order, to consume from both ends: the running jobs re-ranked
        and sorted, merged with the paused index (`index_paused`), or `ranked_kv_jobs`."""
        if self.index_paused:
            if self._ranked_at is step:
                # NOTE: the prefill pass admitted nothing: no rank moved since it sorted the
                # running jobs, and those it paused or evicted are the index's after the sync
                self.paused.sync(step.kept, step.swapped)
                self.run_entries = [e for e in self.run_entries if (s := e[3].status) is _DECODING or s is _PREFILLING]
            else:
                self.running_entries(step)
            return RankedHolders(self.run_entries, self.paused)
        if self._ranked_at is step:
            # NOTE: ranked by this step's prefill pass, which admitted nothing: no job's
            # rank moved since, and the holders are those of then less any it evicted
            # to recompute (as a new ranking would find them).
            running, kept, swapped = step.running, step.kept, step.swapped
            self.ranked = [r for r in self.ranked if (rid := r.request_id) in running or rid in kept or rid in swapped]
        else:
            self.ranked = self.ranked_kv_jobs(step)
        return RankDeque(self.ranked)

    def running_entries(self, step: StepBuilder) -> list[Entry]:
        """With `index_paused`: brings the paused index up to date and sorts the running jobs'
        entries (re-ranked, unless `entries_current`) into `run_entries`."""
        self.paused.sync(step.kept, step.swapped)
        running = step.running.values()
        if self.entries_current:
            self.run_entries = sorted([r.policy_state.entry for r in running])
        else:
            self.run_entries = self.ranked_entries(running)
        return self.run_entries

    def ranked_entries(self, jobs: Collection[Request]) -> list[Entry]:
        """`refresh_ranks(jobs)`, and their entries (*rank, job) sorted."""
        self.refresh_ranks(jobs)
        return sorted([(*r.policy_state.rank, r) for r in jobs])

    def ranked_kv_jobs(self, step: StepBuilder) -> list[Request]:
        """Every KV holder, best rank first.

        NOTE: only running jobs are re-ranked: they are the ones whose remaining work moved.
        A paused job keeps the rank it had when it last ran until its policy changes its
        level (and refreshes it then). Besides the time, this keeps a step from allocating a
        (rank, job) pair per paused job: thousands of them, alive across the collector's
        young collections, set off a full collection every few dozen steps (30-40 ms stalls
        with FastServe's paused jobs)."""
        self.refresh_ranks(step.running.values())
        jobs = [*step.running.values(), *step.kept.values(), *step.swapped.values()]
        jobs.sort(key=_RANK)
        return jobs

    def fill_batch(self, step: StepBuilder, admit_waiting: bool = True) -> None:
        """Runs jobs in rank order (KV holders and waiting heads merged, unless not
        `admit_waiting`) while seats and tokens last; lower-ranked GPU holders are the eviction
        victims (deque's right end)."""
        kv_jobs = self.kv_holders(step)
        self.admitted = []
        skipped: list[QueueEntry] = []  # the set-aside heads' entries
        budget, queues = step.budget, self.queues
        run_kv_job, run_covered = self._run_kv_job, kv_jobs.run_covered
        tokens_to_compute, scheduled = step.tokens_to_compute, step.scheduled
        levels = queues.in_order()
        filed = queues.filed  # when `levels` was last read whole
        counts, sums, heappop = queues.counts, queues.sums, heapq.heappop
        waiting_open = admit_waiting
        head: Request | None = None
        head_rank: Rank | None = None  # a KV job runs first if it ranks at or before it (None: no head)
        head_at: list[QueueEntry] = []  # the front or heap whose first entry is the head's
        head_in_heap = False
        peeked = -1  # queues.changes when head was peeked
        while budget.num_seqs < budget.max_seqs and budget.num_tokens < budget.max_tokens:
            if not waiting_open:
                head = head_rank = None
            elif peeked != queues.changes:
                # NOTE: re-peeked only when the queues moved (a pop, or a job an eviction
                # sent back to recompute): most of a step is running jobs ranked ahead.
                # `queues.peek()` and `filed_rank`, inlined (40 to 250 heads a step)
                if filed != queues.filed:
                    # NOTE: an entry was filed since: a list dropped below as empty may hold it
                    levels, filed = queues.in_order(), queues.filed
                head = head_rank = None
                empty = 0  # the lists before the head's, all empty now
                for entries, is_heap in levels:
                    while entries:
                        top = entries[0]
                        st = top[3].policy_state
                        if st.in_heap and st.version == top[2]:
                            head, head_rank, head_in_heap = top[3], (st.level, st.key, st.seq), is_heap
                            head_at = entries
                            break
                        if is_heap:
                            heappop(entries)
                        else:
                            del entries[0]
                    if head is not None:
                        break
                    empty += 1
                if empty:
                    # NOTE: they stay empty until something is filed (then `levels` is read
                    # again): the next peeks start past them (FastServe's waiting jobs sit in its
                    # last level, after eight empty lists, and a step peeks about 45 heads)
                    del levels[:empty]
                peeked = queues.changes
            # NOTE: most of a step: the KV holders ranked ahead of the waiting head, each
            # scheduled (a kept one resumed too) in one call when its blocks cover its step.
            # Not called when the job it last stopped at ranks after this head (every job left
            # does, and it would stop at once): after each admitted or set-aside head, dozens a step.
            stopped_at = kv_jobs.stopped_at
            if head_rank is None or stopped_at is None or stopped_at < head_rank:
                job = run_covered(head_rank, step)
                if job is not None:
                    run_kv_job(step, job, kv_jobs)
                    continue
            # NOTE: with seats and tokens left, `run_covered` stopped at a job ranked after the
            # head, or none is left: `pop_before(head_rank)` would answer None too
            if head is None or budget.num_seqs >= budget.max_seqs or budget.num_tokens >= budget.max_tokens:
                break
            # NOTE: `queues.take(head)` (peeked when `changes` was what it is now), inlined
            st = head.policy_state
            top = heappop(head_at) if head_in_heap else head_at.pop(0)
            st.in_heap = False
            st.version += 1
            queues.changes += 1
            counts[st.level] -= 1
            sums[st.level] -= st.weight
            if head.prefix_salt is None and head.prefix_source is None and head.prompt_token_ids is None:
                # NOTE: `tokens_to_compute`'s answer for a job no prefix lookup can hit, inlined
                n = head.num_prompt_tokens + head.num_output_tokens - head.num_computed_tokens
            else:
                n = tokens_to_compute(head)
            if n <= budget.max_tokens and budget.num_tokens + n > budget.max_tokens:
                # NOTE: `_admit`'s answer (False) for a prompt the tokens left cannot hold (a seat
                # is free here), without the call: about 30 heads a step
                skipped.append(top)
                waiting_open = len(skipped) < MAX_SKIPPED_WAITING
                continue
            verdict = self._admit(step, head, kv_jobs, n)
            if verdict and head.request_id in scheduled:  # NOTE: step.is_scheduled(head), inlined
                self.admitted.append(head)
            elif verdict is None:  # memory short and new jobs must wait (defer)
                skipped.append(top)
                waiting_open = False
            elif not verdict:
                skipped.append(top)
                waiting_open = len(skipped) < MAX_SKIPPED_WAITING
        back: dict[int, list[QueueEntry]] = {}  # untouched set-aside entries by level
        for top in skipped:
            req = top[3]
            status = req.status
            if status is not _WAITING and status is not _RECOMPUTE:  # NOTE: `is_waiting`, inlined
                continue
            st = req.policy_state
            if not st.in_heap and st.version == top[2] + 1:
                # NOTE: untouched since it was taken: its entry goes back as it was (what `push`
                # does, less a new version and a new tuple: about 30 heads a step, each tuple one
                # more young object for the collector), to its level's front when it still
                # ranks first there (`put_back`). Entries of one job differ only in version,
                # older ones are stale, so every live entry is ordered as `push` would order it.
                st.version -= 1
                st.in_heap = True
                counts[st.level] += 1
                sums[st.level] += st.weight
                back.setdefault(st.level, []).append(top)
            else:
                queues.push(req)
        for entries in back.values():
            queues.put_back(entries)

    def _run_kv_job(self, step: StepBuilder, req: Request, victims: Victims) -> None:
        n = req.num_tokens_to_compute
        status = req.status
        kv = step.kv
        if status is RequestStatus.DECODING or status is RequestStatus.PREFILLING:
            if step.schedule_if_covered(req, n) or step.schedule(req, n):
                return  # NOTE: the hot path: a running job whose blocks are there
        elif status is RequestStatus.PREEMPTED_KEPT:
            # NOTE: the common resume (FastServe resumes dozens a step): its blocks cover the
            # step, so there is nothing to allocate or evict (the general path below would find
            # no block needed and do just this).
            if step.resume_if_covered(req, n):
                return
            table = kv.gpu_tables.get(req.request_id)
            if table and len(table) * kv.block_size >= req.num_computed_tokens + n:
                if step.budget.can_fit(n):
                    step.resume(req)
                    if not step.schedule_if_covered(req, n):
                        step.schedule(req, n)
                return
        if not step.budget.can_fit(n):
            return
        target = req.num_computed_tokens + n
        swapped = status is RequestStatus.PREEMPTED_SWAPPED
        need = kv.num_blocks_for(target) if swapped else kv.num_new_blocks(req.request_id, target)
        # NOTE: a job that holds KV and needs a block to go on may cost a victim its KV (vLLM's
        # rule); bringing a swapped job back may only swap others out, never recompute them.
        if need and not self._make_room(step, need, victims, new_job=False, swap_only=swapped):
            return
        if swapped:
            if not step.swap_in(req):
                return
        elif status is RequestStatus.PREEMPTED_KEPT:
            step.resume(req)
        step.schedule(req, n)

    def _admit(self, step: StepBuilder, req: Request, victims: Victims, n: int | None = None) -> bool | None:
        """Admits a waiting job with its whole prompt (hybrid batch, no chunking); `n`: its
        `step.tokens_to_compute` when the caller has it. False: it does not fit this step;
        None: memory is short and it must wait."""
        if n is None:
            n = step.tokens_to_compute(req)
        budget = step.budget
        if n > budget.max_tokens:
            step.finish(req, RequestStatus.FINISHED_REJECTED, f"prompt_too_long: {n} tokens exceed the token budget")
            return True
        if budget.num_seqs >= budget.max_seqs or budget.num_tokens + n > budget.max_tokens:  # not budget.can_fit(n)
            return False
        kv = step.kv
        gpu = kv.gpu
        num_tokens = req.num_prompt_tokens + req.num_output_tokens
        watermark = int(self.config.watermark * gpu.num_blocks)
        blocks = kv.num_blocks_for(num_tokens)
        if blocks + watermark > gpu.num_blocks:
            step.finish(req, RequestStatus.FINISHED_REJECTED, "unschedulable: prompt needs more KV than the worker has")
            return True
        fresh = (
            req.prefix_salt is None
            and req.prefix_source is None
            and req.prompt_token_ids is None
            and req.request_id not in kv.gpu_tables
        )
        # NOTE: fresh, `step.num_new_blocks`'s answer for a request with no table and no block a
        # prefix lookup could name (no hit): all of its blocks are new
        need = blocks + watermark if fresh else step.num_new_blocks(req, num_tokens) + watermark
        # NOTE: `_make_room` returns True at once when the blocks are free (most admissions)
        if gpu.num_available() < need and not self._make_room(step, need, victims, new_job=True, swap_only=True):
            return None if self.memory is MemoryMode.DEFER else False
        if fresh:
            return step.admit_fresh(req, n)  # NOTE: `schedule(req, n, cover=num_tokens)` without its tests
        return step.schedule(req, n, cover=num_tokens)

    def _make_room(
        self, step: StepBuilder, need_blocks: int, victims: Victims, *, new_job: bool, swap_only: bool
    ) -> bool:
        """Evicts lower-ranked GPU holders until `need_blocks` are free; `defer` evicts
        nothing for a new job; `swap_only` stops at a victim whose KV cannot go to CPU."""
        gpu = step.kv.gpu
        while gpu.num_available() < need_blocks:
            if (new_job and self.memory is MemoryMode.DEFER) or not self._evict_one(step, victims, swap_only):
                return False
        return True

    def _evict_one(self, step: StepBuilder, victims: Victims, swap_only: bool) -> bool:
        """Preempts the lowest-ranked GPU holder not yet reached.

        NOTE: with `memory=swap` a job is evicted for a new or a swapped-out job only if its
        KV can go to CPU (or was never computed). The papers evict by swapping (FastServe's
        proactive KV manager, ALISE's Algorithm 2); falling back to recompute once the swap
        space was full was ours, and it was the preemption storm: 9,182 of ALISE's 9,635 and
        12,408 of FastServe's 12,856 preemptions (400 ShareGPT requests, 12 GB of KV, 16 GB
        of swap) dropped a victim's KV to admit a job that was itself evicted soon after."""
        while victims:
            victim = victims.pop()
            if victim.status is RequestStatus.PREEMPTED_SWAPPED:
                continue  # holds no GPU blocks
            if swap_only and self.memory is MemoryMode.SWAP and not self.can_swap_out(step, victim):
                victims.append(victim)
                return False
            mode = self.evict_mode()
            if step.in_flight(victim) and (mode is PreemptionMode.RECOMPUTE or not self.can_swap_out(step, victim)):
                # NOTE: overlap: a step planned ahead still computes the victim, and recomputed
                # now it would lose that step's token (the lowest-ranked job is often the one
                # admitted last, which then never progressed: a livelock). It is paused (KV
                # kept) and evicted by the next plan, once that token is in; the job that
                # needed room waits one step, as one step at a time it would have found the
                # victim with its token.
                if victim.status is not RequestStatus.PREEMPTED_KEPT:
                    step.preempt(victim, PreemptionMode.KEEP, PreemptionReason.KV_PRESSURE)
                self.stats["evictions_after_answer"] += 1
                return False
            step.preempt(victim, mode, PreemptionReason.KV_PRESSURE)
            # a forced eviction (KV pressure), by what actually happened to the victim's KV
            swapped = victim.status is RequestStatus.PREEMPTED_SWAPPED
            self.stats["forced_swap_outs" if swapped else "forced_recomputes"] += 1
            return True
        return False

    def stats_report(self) -> dict[str, object]:
        return dict(sorted(self.stats.items()))

    @staticmethod
    def can_swap_out(step: StepBuilder, req: Request) -> bool:
        """Its KV fits the free swap space, or it has none to lose (admitted this step)."""
        if not step.kv_known_to_worker(req):
            return True
        return len(step.kv.gpu_tables.get(req.request_id, ())) <= step.kv.cpu.num_available()

    def evict_mode(self) -> PreemptionMode:
        # NOTE: defer keeps running jobs alive, but a decode that needs a block when none
        # is free must take one from somewhere: it recomputes the lowest-ranked, as vLLM does.
        return PreemptionMode.SWAP if self.memory is MemoryMode.SWAP else PreemptionMode.RECOMPUTE


_RANK = attrgetter("policy_state.rank")
