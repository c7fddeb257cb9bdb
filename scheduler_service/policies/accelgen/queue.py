"""AccelGen's remaining-time arithmetic and its queue index (seed 000, section 4.3).

Data flow: a request enters the queue (arrival, preemption, or return from an iteration)
-> `RemainingTime` turns its iteration SLO into an absolute deadline, `deadline = t0 + T_r`
with `T_r = SLO - T_e` at entry (T_w is 0 then; later `T_r(now) = deadline - now`, which is
exactly `SLO - T_w - T_e`) -> `DeadlineIndex` keeps one heap per kind of request (holding
GPU KV: running; not holding it: waiting, preempted, swapped) keyed by that deadline, so
`schedule()` pops only the heads it looks at: O(log n) per event, never a sort of 10,000.
A waiting request found past its SLO (it waited longer than the SLO itself: that token is
lost whatever happens) moves to a third heap, so it cannot crowd out requests that can
still be saved. A request's entry is replaced, never edited: the old one goes stale (its sequence number
no longer matches) and is skipped when it reaches the top.

Offline requests (a JCT SLO only) get a per-iteration allowed wait instead of an SLO:
`T_e = N_ck * T_max + S_g * (T_max + P_max * P)` and `T_r = (SLO_JCT - T_e) / (N_ck + S_g)`;
what an iteration over- or under-uses is carried into the next (`JCTBudget`).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.policies.decisions import (
    is_offline_slo,
    iteration_slo_s,
    jct_allowed_s,
    num_chunks,
    online_remaining_s,
)


@dataclass(slots=True)
class JCTBudget:
    """Per-iteration allowed wait of an offline request, with the carry of section 4.3:
    finishing d later than allowed leaves T_r - d for the next iteration, d earlier T_r + d."""

    base_s: float  # (SLO_JCT - T_e) / (N_ck + S_g), fixed when the request enters the queue
    carry_s: float = 0.0  # cumulative under-use (+) or over-use (-) so far

    @property
    def allowed_s(self) -> float:
        return self.base_s + self.carry_s

    def record_wait(self, waited_s: float) -> None:
        """The request waited `waited_s` this iteration: carry the difference forward."""
        self.carry_s = self.allowed_s - waited_s


@dataclass(slots=True)
class AccelGenState:
    """The policy's slot on a Request."""

    request: Request
    t0: float  # when it last entered the queue (the iteration clock's start)
    deadline: float = 0.0  # t0 + T_r at entry
    slo_end: float = 0.0  # t0 + its iteration SLO: past it the SLO is already missed
    late: bool = False  # a waiting request whose SLO was missed, in the late heap
    seq: int = -1  # sequence number of its live heap entry (-1: none)
    holds_kv: bool = False  # which heap the live entry is in
    jct: JCTBudget | None = None
    preempted_at: float | None = None
    # its iteration SLOs, defaults applied (`RemainingTime.iteration_slo`'s two answers; a
    # request's SLO never changes): read here, a step at 1,000 running touches no SLO object
    ttft_slo_s: float = 0.0
    tbt_slo_s: float = 0.0


class WindowMax:
    """The largest of the last `window` observations (0: of all of them), a monotonic deque:
    O(1) amortized per observation."""

    def __init__(self, prior: float, window: int) -> None:
        self.window = window
        self._all_time = prior
        self._count = 0
        self._deque: deque[tuple[int, float]] = deque()  # (index, value), values decreasing
        self._prior = prior

    def observe(self, value: float) -> None:
        self._count += 1
        self._all_time = max(self._all_time, value)
        if not self.window:
            return
        while self._deque and self._deque[-1][1] <= value:
            self._deque.pop()
        self._deque.append((self._count, value))
        while self._deque[0][0] <= self._count - self.window:
            self._deque.popleft()

    @property
    def value(self) -> float:
        if not self.window:
            return self._all_time
        return self._deque[0][1] if self._deque else self._prior


class RemainingTime:
    """T_r and its inputs: T_max (largest batch time over the last `t_max_window` steps; 0:
    seen so far), L_c (average chunk length), P_max (longest preemption seen) and P
    (preemptions per generated token).

    Why a window: the all-time maximum is set once by the largest prefill of the run (a 4K
    chunk's iteration) and then makes every decode "urgent" (T_r = TBT - T_max <= T_max) for
    the rest of the run, so Algorithm 2 never runs. The paper's T_max estimates the time of
    the iterations a request will wait through; the recent maximum is that estimate."""

    def __init__(
        self,
        t_max_prior_s: float,
        chunk_prior: int,
        default_ttft_s: float,
        default_tbt_s: float,
        t_max_window: int = 0,
    ) -> None:
        self._t_max = WindowMax(t_max_prior_s, t_max_window)
        self.default_ttft_s = default_ttft_s
        self.default_tbt_s = default_tbt_s
        self._chunk_sum = float(chunk_prior)
        self._chunk_count = 1
        self.p_max_s = 0.0
        self._preemptions = 0
        self._tokens = 0

    # ------------------------------------------------------------------ observations
    @property
    def t_max_s(self) -> float:
        return self._t_max.value

    def observe_step(self, total_s: float, chunk_sizes: list[int], num_tokens: int) -> None:
        self._t_max.observe(total_s)
        for n in chunk_sizes:
            self._chunk_sum += n
            self._chunk_count += 1
        self._tokens += num_tokens

    def observe_preemption(self) -> None:
        self._preemptions += 1

    def observe_preemption_length(self, seconds: float) -> None:
        self.p_max_s = max(self.p_max_s, seconds)

    @property
    def avg_chunk(self) -> float:
        return self._chunk_sum / self._chunk_count

    @property
    def preempt_prob(self) -> float:
        return self._preemptions / self._tokens if self._tokens else 0.0

    # ------------------------------------------------------------------ formulas
    def iteration_slo(self, request: Request) -> float:
        """TTFT SLO for its prompt, TBT SLO for each later token (defaults when absent)."""
        slo = request.slo
        return iteration_slo_s(
            request.num_output_tokens, slo.ttft_s, slo.tbt_s, self.default_ttft_s, self.default_tbt_s
        )

    def num_chunks(self, request: Request) -> int:
        """N_ck = ceil(S_r / L_c) for a prompt (or its rest), 1 for a decode."""
        return num_chunks(request.num_prefill_remaining, self.avg_chunk)

    def online_remaining(self, request: Request) -> float:
        """T_r at entry (T_w = 0): SLO - N_ck * T_max."""
        return online_remaining_s(self.iteration_slo(request), self.num_chunks(request), self.t_max_s)

    def jct_budget(self, request: Request, slo_left_s: float) -> JCTBudget:
        """Allowed wait per iteration of an offline request with `slo_left_s` of its JCT SLO left."""
        n_ck = self.num_chunks(request) if request.is_prefill else 0
        s_g = request.remaining_output_estimate
        return JCTBudget(jct_allowed_s(slo_left_s, n_ck, s_g, self.t_max_s, self.p_max_s, self.preempt_prob))


def is_offline(request: Request) -> bool:
    slo = request.slo
    return is_offline_slo(slo.ttft_s, slo.tbt_s, slo.jct_s)


def holds_kv(request: Request) -> bool:
    return request.status.is_running or request.status is RequestStatus.PREEMPTED_KEPT


WAITING, RUNNING, LATE = 0, 1, 2
IndexEntry = tuple[float, int, str, AccelGenState]  # key, seq, request id, its state


class DeadlineIndex:
    """Three heaps of (key, seq, request id, state): requests holding GPU KV, waiting ones, and
    waiting ones whose SLO is already missed (late); the key is the deadline (SLO order) or
    the arrival time (FCFS, the /Order ablation). An entry is live while its state's `seq` is
    the entry's (a state dropped, or replaced under its id, has its `seq` set to -1), so a pop
    tells a live entry from a stale one without looking the id up among every request's state
    (100,000 and more: a cache miss or more per pop, a thousand pops a step at 1,000 running);
    sequence numbers are unique, so entries never compare their states."""

    def __init__(self) -> None:
        self._heaps: tuple[list[IndexEntry], ...] = ([], [], [])
        self.holders = self._heaps[RUNNING]  # the KV holders' heap (a policy's loop pops it inline)
        self._seq = 0
        self.states: dict[str, AccelGenState] = {}

    def __len__(self) -> int:
        return len(self.states)

    @staticmethod
    def _heap_of(state: AccelGenState) -> int:
        if state.holds_kv:
            return RUNNING
        return LATE if state.late else WAITING

    def push(self, rid: str, state: AccelGenState, key: float, kv: bool) -> None:
        self._seq += 1
        state.seq = self._seq
        state.holds_kv = kv
        states = self.states
        old = states.setdefault(rid, state)
        if old is not state:
            old.seq = -1  # NOTE: its entries go stale, as `states.get(rid)` would no longer find it
            states[rid] = state
        heapq.heappush(self._heaps[self._heap_of(state)], (key, self._seq, rid, state))

    def demote(self, entry: IndexEntry) -> None:
        """Moves a popped waiting entry to the late heap (same key)."""
        state = entry[3]
        state.late = True
        self.push(entry[2], state, entry[0], False)

    def restore(self, entry: IndexEntry) -> None:
        """Puts back an entry popped by `pop` and not used (stale ones vanish on their own)."""
        state = entry[3]
        if state.seq == entry[1]:
            heapq.heappush(self._heaps[self._heap_of(state)], entry)

    def restore_all(self, entries: list[IndexEntry]) -> None:
        """`restore` of each entry, in order (a step puts back a few hundred)."""
        heaps, push = self._heaps, heapq.heappush
        for entry in entries:
            state = entry[3]
            if state.seq == entry[1]:
                push(heaps[RUNNING if state.holds_kv else LATE if state.late else WAITING], entry)

    def drop(self, rid: str) -> AccelGenState | None:
        state = self.states.pop(rid, None)
        if state is not None:
            state.seq = -1
        return state

    def peek(self, which: int) -> IndexEntry | None:
        heap = self._heaps[which]
        while heap:
            top = heap[0]
            if top[3].seq == top[1]:
                return top
            heapq.heappop(heap)
        return None

    def pop(self, allow_waiting: bool, include_late: bool = False) -> IndexEntry | None:
        """The entry with the smallest key over the heaps asked for (KV holders always;
        waiting ones when `allow_waiting`; late ones too when `include_late`)."""
        if not allow_waiting:
            # NOTE: every step once the seats are full: the KV holders' heap alone
            heap = self._heaps[RUNNING]
            while heap:
                entry = heapq.heappop(heap)
                if entry[3].seq == entry[1]:
                    return entry
            return None
        best = self.peek(RUNNING)
        best_heap = RUNNING
        if allow_waiting:
            for h in (WAITING, LATE) if include_late else (WAITING,):
                top = self.peek(h)
                if top is not None and (best is None or top < best):
                    best, best_heap = top, h
        return None if best is None else heapq.heappop(self._heaps[best_heap])
