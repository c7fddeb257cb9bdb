"""`accelgen`: heterogeneous-SLO, multi-resource batching (AccelGen, Shen & Sen, seed 000,
sections 4.2 to 4.4, Algorithms 1 and 2).

Why choose it: mixed traffic (short chats, 4K-100K-token documents, offline jobs) where each
request carries its own TTFT / TBT or JCT SLO; it sizes every iteration to the tightest SLO
in the batch, serves the requests closest to missing theirs first, and fills what is left
so that both the compute budget and the free KV end up used.

What it does, each iteration (`schedule`):
1. Ordering (section 4.3, switch `order`): every queued request (waiting, preempted, and
   each running one, which returns to the queue after every iteration) has a remaining
   time `T_r = SLO - T_w - N_ck * T_max`, kept as an absolute deadline in a heap index
   (`accelgen_queue`); offline requests get `T_r = (SLO_JCT - T_e) / (N_ck + S_g)` per
   iteration with the over/under-use carried forward. Off: FCFS by arrival.
2. Token budget (section 4.2, switch `chunk`): `S_b = S_pf * SLO_min / T_pf` (Eq. 6), S_pf
   and T_pf the cost model's pivot forward size, SLO_min the iteration SLO of the first
   request chosen (the queue is tightest first); tokens are taken until S_f = S_b, a prompt
   cut where the budget ends continues next iteration; ERA: a new long prompt (>=
   `long_prompt_tokens`) does not start while another is being prefilled. Off: a fixed
   budget (`fixed_budget`, Sarathi-style leftover chunks, no ERA).
3. Batching (section 4.4, switch `batch`): urgent requests (`T_r <= T_max`) go in first in
   T_r order (equivalent to "all in, then drop the largest T_r while S_f > S_b"); then the
   non-urgent ones with `T_r <= T_r1 + gamma` become candidates, a prompt too large for the
   budget is cut to min(fill the budget, fill the free KV), and the candidate nearest to
   the free (compute, KV) point is added until none fits (`accelgen_select`; KV arithmetic in `accelgen_kv`). Off: the
   ordered queue fills the budget greedily.
T_max (section 4.3) is the largest step time over the last `t_max_window` steps (0: the
all-time maximum, which one long prefill fixes for the whole run, so every decode stays
"urgent" and Algorithm 2 never runs).
KV allocation (Algorithm 2's D_m): per chunk, as the paper describes; a new prompt is admitted
only when the free KV also covers the rest of every prompt already started (its own too), so
started prompts can finish (`accelgen_kv.prompt_rest_blocks`: without it, per-chunk allocation
livelocks). `allocate_whole_prompt` (ours) allocates the whole prompt at its first chunk.
Late requests: a waiting request that has already waited longer than its SLO cannot meet
it any more; with `demote_missed` (ours, off by default) it stops being urgent and is served by
Algorithm 2 after the requests that can still be saved, instead of starving every running
decode under overload (earliest-deadline-first's domino effect).
KV pressure: as in the paper's implementation (section 5, "we directly use vLLM to handle
KVC overflow and preemptions"), only a running request that needs a block preempts; the
victim is the running request with the largest T_r (recompute by default). A request
over the compute budget is not preempted: it keeps its KV and waits in the queue.
Inputs: per-request SLOs, the predicted output length (JCT SLOs; max_tokens when None),
the cost model (pivot forward size), step durations (T_max).
Long prompts (`price_in_time`, part of `chunk`, on by default): Eq. 6 turns SLO_min into
tokens with the pivot's tokens-per-second, which holds over short prefixes only; a chunk also
stops where the step's predicted time (the cost model, the chunk's attention over its prefix
included) would pass SLO_min, as `sarathi` does.
Configuration: chunk, order, batch, era, price_in_time, long_prompt_tokens, gamma_s, default_ttft_s,
default_tbt_s, min_budget, fixed_budget, pivot_tokens, pivot_s, watermark, max_candidates,
max_scan, allocate_whole_prompt, demote_missed, t_max_window, preemption_mode.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass, field

from scheduler_service.core.policy import POLICIES, Policy, PolicyConfig, PolicyContext
from scheduler_service.core.preemption import PreemptionReason
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.step_builder import StepBuilder
from scheduler_service.costmodel.pivot import pivot_forward_size
from scheduler_service.policies.accelgen.kv import (
    cover_tokens,
    fits_with_watermark,
    kv_fit,
    kv_victim,
    prompt_rest_blocks,
)
from scheduler_service.policies.accelgen.queue import (
    AccelGenState,
    DeadlineIndex,
    IndexEntry,
    RemainingTime,
    holds_kv,
    is_offline,
)
from scheduler_service.policies.accelgen.select import Candidate, CandidateSet, DecodePoint
from scheduler_service.policies.common import preemption_mode, time_limited_chunk
from scheduler_service.policies.decisions import eq6_budget
from sluice.contract.plan import StepPlan, StepResult

Entry = IndexEntry
_DECODING = RequestStatus.DECODING
_PREFILLING = RequestStatus.PREFILLING
MAX_ADMISSION_MISSES = 4  # waiting requests that failed to get KV before admission stops this step


@dataclass
class AccelGenConfig(PolicyConfig):
    chunk: bool = True  # SLO-guaranteed dynamic chunking (Eq. 6 budget + ERA); off: fixed budget
    order: bool = True  # iteration-level SLO-based prioritization; off: FCFS
    batch: bool = True  # multi-resource-aware batching (Algorithms 1, 2); off: greedy fill
    era: bool = True  # Exclusive Request Allocation (part of `chunk`)
    long_prompt_tokens: int = 4096  # a prompt this long is "long" for ERA
    gamma_s: float = 0.75  # candidate window: T_r <= T_r(first non-urgent) + gamma (section 6.1)
    default_ttft_s: float = 1.0  # prompt SLO when a request has no TTFT SLO
    # TBT SLO of a request that sets none: this option, else the deployment's (`tbt_slo_s`, as
    # core/slo.py resolves it for every policy), else normal reading speed (section 4.3)
    default_tbt_s: float | None = None
    min_budget: int = 256  # floor of S_b: TTFT SLOs below one iteration's fixed cost would starve it
    fixed_budget: int = 512  # S_b when `chunk` is off (Sarathi's strict budget)
    pivot_tokens: int | None = None  # S_pf override (default: the cost model's pivot)
    pivot_s: float | None = None  # T_pf override
    max_candidates: int = 256  # candidates per Algorithm 2 window
    max_scan: int = 2048  # queue entries one step may look at
    watermark: float = 0.01  # share of GPU blocks new admissions leave free (vLLM's watermark)
    allocate_whole_prompt: bool = False  # ours: blocks for the whole prompt at its first chunk (vLLM's way)
    price_in_time: bool = True  # a prompt chunk also stops where the step's predicted time passes SLO_min
    demote_missed: bool = False  # ours: a waiting request past its SLO is no longer urgent (not in the paper)
    t_max_window: int = 128  # T_max = largest step time over this many recent steps (0: all-time maximum)


@dataclass(slots=True)
class _Round:
    """The state of one `schedule` call."""

    step: StepBuilder
    now: float
    budget_set: bool = False
    slo_s: float = float("inf")  # the tightest iteration SLO that fixed the budget (chunks priced against it)
    decode_slo_s: float | None = None  # the tightest TBT SLO of the running decodes (computed once a round)
    allow_waiting: bool = True
    misses: int = 0
    scanned: int = 0
    deferred: list[Entry] = field(default_factory=list)
    # A prefill at this computed prefix (or a longer one) gets no chunk this round: one token of
    # it already priced the step past SLO_min, and the step, the prefix and a tighter SLO only
    # add time. Valid while nothing left the batch (`memo_preempted` = the step's preemptions then).
    no_chunk_from: float = float("inf")
    memo_preempted: int = 0
    cuts: int = 0  # prompts set aside by the memo in `_take_urgent` (stats, added once a round)


READING_SPEED_TBT_S = 0.1875  # normal reading speed (section 4.3)


@POLICIES.register("accelgen")
class AccelGenPolicy(Policy):
    name = "accelgen"
    config_cls = AccelGenConfig
    # NOTE: planned ahead, a batch returns to the queue at the next plan instead of with its
    # answer (`schedule`), and its step's time reaches T_max one plan later.
    overlap_safe = True
    config: AccelGenConfig

    def __init__(self, config: AccelGenConfig, ctx: PolicyContext) -> None:
        super().__init__(config, ctx)
        self.default_tbt_s = config.default_tbt_s or ctx.tbt_slo_s or READING_SPEED_TBT_S
        self.pivot_tokens, self.pivot_s = self._pivot()
        self.rt = RemainingTime(
            self.pivot_s, self.pivot_tokens, config.default_ttft_s, self.default_tbt_s, config.t_max_window
        )
        self.index = DeadlineIndex()
        self.long_active: set[str] = set()
        self._batch: list[Request] = []  # the batch being planned
        self._chunks: list[int] = []  # its prefill chunks (T_max's average chunk)
        # step id -> (batch, chunks) of a committed step whose answer has not come
        self._to_return: dict[int, tuple[list[Request], list[int]]] = {}
        self._mode = preemption_mode(config)
        # a prompt chunk is priced in time (`_schedule`)
        self._priced = config.chunk and config.price_in_time and ctx.cost_model is not None
        self.num_alg2_placements = 0  # requests Algorithm 2's Euclidean rule added (reports)
        # counters for reports (`stats_report`): whether each of the paper's mechanisms fired
        self.stats: Counter[str] = Counter()

    def _pivot(self) -> tuple[int, float]:
        c = self.config
        if c.pivot_tokens and c.pivot_s:
            return c.pivot_tokens, c.pivot_s
        if self.ctx.cost_model is not None:
            return pivot_forward_size(self.ctx.cost_model)
        return self.ctx.max_num_batched_tokens, self.default_tbt_s

    # ------------------------------------------------------------------ budget (Eq. 6)
    def budget_for(self, slo_min_s: float) -> int:
        """S_b for a batch whose tightest iteration SLO is `slo_min_s`."""
        cap = self.ctx.max_num_batched_tokens
        if not self.config.chunk:
            return min(self.config.fixed_budget, cap)
        return eq6_budget(self.pivot_tokens, self.pivot_s, slo_min_s, self.config.min_budget, cap)

    def _fix_budget(self, r: _Round, slo_s: float) -> None:
        """The first chosen request fixes SLO_min (queue tightest first); under FCFS a later,
        tighter request lowers it again (section 4.2)."""
        budget = r.step.budget
        r.slo_s = min(r.slo_s, slo_s)
        if not r.budget_set:
            budget.max_tokens = self.budget_for(slo_s)
            r.budget_set = True
        elif not self.config.order:
            budget.max_tokens = max(budget.num_tokens, min(budget.max_tokens, self.budget_for(slo_s)))

    # ------------------------------------------------------------------ queue entries
    def _enqueue(self, req: Request, t0: float | None) -> None:
        state: AccelGenState = req.policy_state
        if t0 is not None:
            state.t0 = t0
        state.late = False
        if is_offline(req) and state.jct is not None:
            state.deadline = state.t0 + state.jct.allowed_s
            state.slo_end = float("inf")
        else:
            state.deadline = state.t0 + self.rt.online_remaining(req)
            state.slo_end = state.t0 + self.rt.iteration_slo(req)
        key = state.deadline if self.config.order else req.arrival_time
        self.index.push(req.request_id, state, key, holds_kv(req))

    def _new_jct_budget(self, req: Request, now: float) -> None:
        if is_offline(req):
            slo_left = req.arrival_time + float(req.slo.jct_s or 0.0) - now
            req.policy_state.jct = self.rt.jct_budget(req, slo_left)

    def on_arrival(self, request: Request, now: float) -> None:
        state = request.policy_state = AccelGenState(request, now)
        slo = request.slo
        state.ttft_slo_s = slo.ttft_s if slo.ttft_s is not None else self.rt.default_ttft_s
        state.tbt_slo_s = slo.tbt_s if slo.tbt_s is not None else self.rt.default_tbt_s
        self._new_jct_budget(request, now)
        self._enqueue(request, now)

    def on_prediction(self, request: Request, now: float) -> None:
        """A later prediction changes an offline request's JCT budget (its tokens left), hence its
        deadline; an online request's deadline rests on its iteration SLOs alone."""
        if request.status.is_waiting and self.index.drop(request.request_id) is not None:
            self._new_jct_budget(request, now)
            self._enqueue(request, None)

    def on_preempted(self, request: Request, now: float) -> None:
        self.rt.observe_preemption()
        self.long_active.discard(request.request_id)
        request.policy_state.preempted_at = now
        self._new_jct_budget(request, now)
        self._enqueue(request, now)

    def on_finished(self, request: Request, now: float) -> None:
        self.index.drop(request.request_id)
        self.long_active.discard(request.request_id)

    def on_step_committed(self, plan: StepPlan, now: float) -> None:
        """The step's batch goes back to the queue when its answer comes (`on_step_result`),
        or, planned ahead, at the next `schedule` if that comes first."""
        self._to_return[plan.step_id] = (self._batch, self._chunks)

    def on_step_result(self, plan: StepPlan, result: StepResult, now: float) -> None:
        batch, chunks = self._to_return.pop(plan.step_id, ((), ()))
        self.rt.observe_step(result.total_s, list(chunks), len(result.sampled_token_ids))
        self._return_batch(batch, now)
        if self._to_return and min(self._to_return) < plan.step_id:  # steps a failure voided
            self._to_return = {k: v for k, v in self._to_return.items() if k > plan.step_id}

    def _return_batch(self, batch: list[Request] | tuple[()], now: float) -> None:
        """The batch's requests return to the queue (each running one is in every iteration's
        ordering); emptied, so that it returns once."""
        for req in batch:
            if not req.status.is_running:
                continue  # finished (already dropped) or preempted (already re-queued)
            if req.is_prefill:
                self._enqueue(req, req.policy_state.t0 if not is_offline(req) else now)
            else:
                self.long_active.discard(req.request_id)
                self._enqueue(req, now)  # a returned TG task: its clock restarts at its token
        if batch:
            batch.clear()

    # ------------------------------------------------------------------ one iteration
    def schedule(self, step: StepBuilder, now: float) -> None:
        # NOTE: overlap: the batch of the step in flight returns now, as one step at a time
        # its answer returns it just before this plan (a TG task's clock restarts here: the
        # moment its step's token would be acted on); that step's time enters T_max with
        # its answer, one plan later.
        for batch, _ in self._to_return.values():
            self._return_batch(batch, now)
        self._batch = []
        self._chunks = []
        r = _Round(step, now, allow_waiting=len(step.running) < self.ctx.max_num_seqs)
        first_non_urgent = self._take_urgent(r, include_late=False)
        if self._has_room(r) and not self.config.batch:
            self._take_urgent(r, include_late=True)  # greedy fill goes on into the late requests
        elif self._has_room(r):
            if first_non_urgent is None:
                first_non_urgent = self.index.pop(r.allow_waiting, include_late=True)
            if first_non_urgent is not None:
                self._select_requests(r, first_non_urgent)
        elif first_non_urgent is not None:
            r.deferred.append(first_non_urgent)
        if not step.scheduled and r.deferred:
            self._ensure_progress(r)
        self.index.restore_all(r.deferred)
        step.metadata["accelgen_budget"] = step.budget.max_tokens
        if r.cuts:
            self.stats["price_in_time_cuts"] += r.cuts
        self._count_step(r)

    def _count_step(self, r: _Round) -> None:
        stats = self.stats
        if not r.step.scheduled:
            return
        stats["steps"] += 1
        stats["forward_tokens"] += r.step.budget.num_tokens
        if r.budget_set:
            stats["budget_tokens"] += r.step.budget.max_tokens
            # Eq. 6 binds: the step's forward size reached S_b (something was cut or left out)
            stats["budget_bound_steps"] += r.step.budget.remaining_tokens <= 0

    def stats_report(self) -> dict[str, object]:
        return {**dict(sorted(self.stats.items())), "alg2_placements": self.num_alg2_placements}

    def _ensure_progress(self, r: _Round) -> None:
        """Nothing fit (every candidate needs a block and none is free): the first request
        in queue order that can run, preempting for KV as Algorithm 1 does, runs."""
        r.deferred.sort()
        for i, entry in enumerate(r.deferred):
            state = entry[3]
            if state.seq == entry[1] and self._take(r, state.request):
                del r.deferred[i]
                return

    @staticmethod
    def _has_room(r: _Round) -> bool:
        return not r.budget_set or r.step.budget.remaining_tokens > 0

    def _take_urgent(self, r: _Round, include_late: bool) -> Entry | None:
        """Algorithm 1, lines 1-4 (all of the queue when `batch` is off): returns the first
        entry left for Algorithm 2, or None."""
        config, index, now = self.config, self.index, r.now
        in_phase_one = not config.batch or config.order
        urgent_only = config.batch
        demote_missed, max_scan = config.demote_missed, config.max_scan
        deferred, budget, take = r.deferred, r.step.budget, self._take
        t_max = self.rt.t_max_s  # NOTE: moves only with a step's answer, never inside a round
        # NOTE: the two kinds of entry that make up most of a step (a covered decode, and a
        # running prompt past the prefix that already got no chunk), answered here as `_take`
        # answers them, without the call; anything else goes through `_take`.
        step = r.step
        holders, heappop = index.holders, heapq.heappop
        covered, batch = step.schedule_if_covered, self._batch
        fast, priced = config.order, self._priced
        while r.scanned < max_scan:
            if r.allow_waiting:
                entry = index.pop(True, include_late)
                if entry is None:
                    return None
            else:
                # NOTE: `index.pop(False)` (the KV holders' heap alone, every step once the seats
                # are full), inlined
                while holders:
                    entry = heappop(holders)
                    if entry[3].seq == entry[1]:
                        break
                else:
                    return None
            r.scanned += 1
            state = entry[3]
            if demote_missed and not state.holds_kv and not state.late and now > state.slo_end:
                self.stats["demoted_missed"] += 1
                index.demote(entry)
                continue
            if not in_phase_one or (urgent_only and state.deadline - now > t_max):  # not urgent: T_r > T_max
                return entry
            req = state.request
            status = req.status
            if r.budget_set and fast and status is _DECODING and state.jct is None and covered(req, 1):
                batch.append(req)  # `_take`'s hot path: a returned TG task whose blocks cover its step
            elif (
                r.budget_set
                and fast
                and status is _PREFILLING
                and priced
                and 0 < r.no_chunk_from <= req.num_computed_tokens < req.prefill_len
                and r.memo_preempted == step.num_preempted
            ):
                # `_take`'s set-aside (see there): SLO_min lowered by its iteration SLO, the cut counted
                v = state.ttft_slo_s if req.num_output_tokens == 0 else state.tbt_slo_s
                if v < r.slo_s:
                    r.slo_s = v
                if req.num_prompt_tokens + req.num_output_tokens > req.num_computed_tokens and (
                    budget.max_tokens > budget.num_tokens
                ):
                    r.cuts += 1
                deferred.append(entry)
            elif not take(r, req):
                deferred.append(entry)
            if r.budget_set and budget.max_tokens <= budget.num_tokens:
                return None
        return None

    def _take(self, r: _Round, req: Request) -> bool:
        """Adds `req` with as many tokens as the budget leaves (a prompt is cut there)."""
        status = req.status
        if r.budget_set and self.config.order:
            step = r.step
            if status is _DECODING and req.policy_state.jct is None:
                # NOTE: the hot path, a returned TG task (every decode, every step)
                if step.schedule_if_covered(req, 1) or step.schedule(req, 1):
                    self._batch.append(req)
                    return True
            elif (
                status is _PREFILLING
                and self._priced
                and 0 < r.no_chunk_from <= req.num_computed_tokens < req.prefill_len
                and r.memo_preempted == step.num_preempted
            ):
                # NOTE: most of a step at 256 running: a running prompt past the prefix that
                # already got no chunk this round. What `_admissible` (a running prompt past
                # its first chunk passes), `_fix_budget` and `_schedule` (the memo) answer,
                # without the calls.
                r.slo_s = min(r.slo_s, self.rt.iteration_slo(req))
                if req.num_tokens_to_compute > 0 and step.budget.remaining_tokens > 0:
                    self.stats["price_in_time_cuts"] += 1
                return False
        if not self._admissible(r, req):
            return False
        self._fix_budget(r, self.rt.iteration_slo(req))
        n = min(req.num_tokens_to_compute, r.step.budget.remaining_tokens)
        if n <= 0:
            return False
        return self._schedule(r, req, n)

    def _admissible(self, r: _Round, req: Request) -> bool:
        """Seats, ERA and the admission-miss limit; swapped requests come back first."""
        step = r.step
        if req.status.is_waiting and len(step.running) >= self.ctx.max_num_seqs:
            r.allow_waiting = False
            return False
        if self._era_blocks(req):
            return False
        if req.status is RequestStatus.PREEMPTED_SWAPPED and not step.swap_in(req):
            self._miss(r)
            return False
        return True

    def _era_blocks(self, req: Request) -> bool:
        if not (self.config.chunk and self.config.era) or req.num_computed_tokens or not req.is_prefill:
            return False
        if req.prefill_len < self.config.long_prompt_tokens:
            return False
        blocked = any(rid != req.request_id for rid in self.long_active)
        self.stats["era_holds"] += blocked
        return blocked

    def _miss(self, r: _Round) -> None:
        r.misses += 1
        if r.misses >= MAX_ADMISSION_MISSES:
            r.allow_waiting = False

    def _schedule(self, r: _Round, req: Request, n: int) -> bool:
        step = r.step
        if req.status is _DECODING and req.num_computed_tokens >= req.prefill_len and step.schedule_if_covered(req, n):
            # NOTE: a decode whose blocks cover its step (Algorithm 2 picks dozens a step): what
            # the general path below does for it (no pricing, cover = computed + n), without it
            self._scheduled(r, req, n)
            return True
        waiting = req.status.is_waiting
        cm = self.ctx.cost_model
        priced = req.is_prefill and self.config.chunk and self.config.price_in_time and cm is not None
        if priced and 0 < r.no_chunk_from <= req.num_computed_tokens and r.memo_preempted == step.num_preempted:
            self.stats["price_in_time_cuts"] += 1  # the cut pricing would make, counted alike
            return False  # NOTE: what time_limited_chunk answers (see _Round.no_chunk_from), without pricing
        if not waiting and req.is_prefill:
            n = min(n, max(kv_fit(step.kv, req, self.config.watermark), 1))  # a chunk that fits beats a preemption
        if priced:
            cut = time_limited_chunk(step, cm, self._step_slo(r), req, n)
            self.stats["price_in_time_cuts"] += cut < n
            n = cut
            if n <= 0:
                if req.num_computed_tokens:  # NOTE: 0 here means one token did not fit (common.py)
                    if r.memo_preempted != step.num_preempted:
                        r.no_chunk_from, r.memo_preempted = float("inf"), step.num_preempted
                    r.no_chunk_from = min(r.no_chunk_from, req.num_computed_tokens)
                return False
        cover = cover_tokens(req, n, self.config.allocate_whole_prompt)
        committed = 0
        if waiting and req.is_prefill and not self.config.allocate_whole_prompt:
            # the rest of every started prompt, this one's included, beyond this chunk's blocks
            committed = prompt_rest_blocks(step.kv, step.running, req) - step.kv.num_new_blocks(req.request_id, cover)
        if waiting and not fits_with_watermark(step.kv, req, cover, self.config.watermark, committed):
            self._miss(r)
            return False
        while not step.schedule(req, n, cover=cover):
            if waiting or not step.budget.can_fit(n):
                if waiting:
                    self._miss(r)
                return False
            victim = kv_victim(step, req, self.config.order)
            step.preempt(victim or req, self._mode, PreemptionReason.KV_PRESSURE)
            self.stats["kv_preemptions"] += 1
            if victim is None:
                return False
        self._scheduled(r, req, n)
        return True

    def _step_slo(self, r: _Round) -> float:
        """SLO_min of the batch: the SLO that fixed the budget, or a running decode's tighter
        TBT SLO (every running decode belongs to the batch: it is urgent or it is chosen)."""
        if r.decode_slo_s is None:
            # NOTE: `RemainingTime.iteration_slo` of every running decode, inlined (256 a step),
            # from the SLOs its state keeps (the state is at hand: the round popped it)
            best = float("inf")
            for q in r.step.running.values():
                if q.num_computed_tokens >= q.prefill_len:
                    st = q.policy_state
                    v = st.ttft_slo_s if q.num_output_tokens == 0 else st.tbt_slo_s
                    if v < best:
                        best = v
            r.decode_slo_s = best
        return min(r.slo_s, r.decode_slo_s)

    def _scheduled(self, r: _Round, req: Request, n: int) -> None:
        state: AccelGenState = req.policy_state
        if state.preempted_at is not None:
            self.rt.observe_preemption_length(r.now - state.preempted_at)
            state.preempted_at = None
        if state.jct is not None:
            state.jct.record_wait(r.now - state.t0)
        if req.is_prefill:
            self._chunks.append(n)
            if req.prefill_len >= self.config.long_prompt_tokens:
                self.long_active.add(req.request_id)
        self._batch.append(req)

    # ------------------------------------------------------------------ Algorithm 2
    def _select_requests(self, r: _Round, first: Entry) -> None:
        """Windows of candidates (T_r within T_r1 + gamma), each filled by the Euclidean
        rule, until the budget or the KV is used up or the scan limit is reached."""
        step = r.step
        nxt: Entry | None = first
        while nxt is not None and r.scanned < self.config.max_scan:
            window, nxt = self._window(r, nxt)
            if not r.budget_set:
                # NOTE: `RemainingTime.iteration_slo` of each, from the SLOs its state keeps (as
                # `_step_slo` does): a window holds up to 256 entries
                tightest = float("inf")
                for e in window:
                    st = e[3]
                    v = st.ttft_slo_s if st.request.num_output_tokens == 0 else st.tbt_slo_s
                    if v < tightest:
                        tightest = v
                self._fix_budget(r, tightest)
            cands = self._candidates(r, window)
            picked = self._fill(r, cands)
            r.deferred.extend(cands.leftovers())
            if not picked or step.budget.remaining_tokens <= 0 or self._free_kv_tokens(step) <= 0:
                break  # NOTE: a window where nothing fits ends the search (the next ones are less urgent)
        if nxt is not None:
            r.deferred.append(nxt)

    def _window(self, r: _Round, first: Entry) -> tuple[list[Entry], Entry | None]:
        window = [first]
        limit = first[0] + self.config.gamma_s
        max_candidates, max_scan, order = self.config.max_candidates, self.config.max_scan, self.config.order
        index = self.index
        if not r.allow_waiting and len(index.holders) <= 2 * max_candidates:
            return self._sorted_holders_window(r, window, limit)
        pop, waiting = index.pop, r.allow_waiting
        while len(window) < max_candidates and r.scanned < max_scan:
            entry = pop(waiting, include_late=True)
            if entry is None:
                return window, None
            r.scanned += 1
            if order and entry[0] > limit:
                return window, entry
            window.append(entry)
        return window, None

    def _sorted_holders_window(self, r: _Round, window: list[Entry], limit: float) -> tuple[list[Entry], Entry | None]:
        """`_window` when the seats are full and the KV holders' heap is at most two windows long:
        `index.pop(False)` of each, read in order from the heap sorted once, its consumed entries
        cut off at the end (a sorted list is a heap, and the entries are unique, so later pops
        come in the same order). At 256 running a window is every running request once none is
        urgent, and one sort of 256 entries is half the time of 256 pops; a heap several windows
        long (1,000 running) is popped, as a step may stop after its first window."""
        max_candidates, max_scan, order = self.config.max_candidates, self.config.max_scan, self.config.order
        holders = self.index.holders
        holders.sort()
        i, size = 0, len(holders)
        nxt: Entry | None = None
        while len(window) < max_candidates and r.scanned < max_scan:
            while i < size:
                entry = holders[i]
                i += 1
                if entry[3].seq == entry[1]:
                    break
            else:
                break
            r.scanned += 1
            if order and entry[0] > limit:
                nxt = entry
                break
            window.append(entry)
        del holders[:i]
        return window, nxt

    def _free_kv_tokens(self, step: StepBuilder) -> int:
        """A_m: unallocated KV in tokens (the watermark binds only new admissions)."""
        return step.kv.gpu.num_available() * step.kv.block_size

    def _candidates(self, r: _Round, window: list[Entry]) -> CandidateSet:
        """Demand points (D_c, D_m); a prompt larger than the budget left is cut to
        min(fill the budget, fill the free KV) (Algorithm 2, lines 4-6)."""
        step = r.step
        kv = step.kv
        a_c = step.budget.remaining_tokens
        a_m = self._free_kv_tokens(step)
        cands = CandidateSet()
        decodes, tables, bs = cands.decodes, kv.gpu_tables, kv.block_size
        for entry in window:
            req = entry[3].request
            if req.status is _DECODING and req.num_computed_tokens >= req.prefill_len:
                # NOTE: most of a window, a running decode: what the general path below answers
                # for it (no seat or ERA test applies, D_m = the blocks computed + n takes)
                n = req.num_prompt_tokens + req.num_output_tokens - req.num_computed_tokens
                if n <= 0:
                    r.deferred.append(entry)
                    continue
                table = tables.get(req.request_id)
                need = -(-(req.num_computed_tokens + n) // bs) - (len(table) if table else 0)
                d_m = need * bs if need > 0 else 0
                group = decodes.get(d_m)
                if group is None:
                    decodes[d_m] = group = []
                group.append((n, entry, req))  # NOTE: `cands.add` of its Candidate, without the object
                continue
            if (req.status.is_waiting and len(step.running) >= self.ctx.max_num_seqs) or self._era_blocks(req):
                r.deferred.append(entry)
                continue
            n = req.num_tokens_to_compute
            if req.is_prefill and n > a_c:
                n = min(n, a_c, kv.capacity(req.request_id) + a_m - req.num_computed_tokens)
            if n <= 0:
                r.deferred.append(entry)
                continue
            d_m = (
                kv.num_new_blocks(req.request_id, cover_tokens(req, n, self.config.allocate_whole_prompt))
                * kv.block_size
            )
            if req.status is RequestStatus.PREEMPTED_SWAPPED:
                d_m += len(kv.cpu_tables.get(req.request_id, ())) * kv.block_size
            cands.add(Candidate(req, entry, n, d_m), is_decode=not req.is_prefill)
        return cands

    def _fill(self, r: _Round, cands: CandidateSet) -> int:
        """Adds the nearest fitting candidate until none fits; returns how many were added."""
        step = r.step
        budget, gpu, bs = step.budget, step.kv.gpu, step.kv.block_size
        picked = 0
        while budget.max_tokens > budget.num_tokens:
            a_c = budget.max_tokens - budget.num_tokens
            pick, prompt_fits = cands.nearest(a_c, gpu.num_available() * bs)  # A_m: `_free_kv_tokens`
            if pick is None:
                break
            if not prompt_fits and pick.kv_tokens == 0:
                placed, rest = self._drain_covered(r, pick, cands.decodes[0])
                picked += placed
                if rest is None:
                    continue
                pick, a_c = rest, budget.max_tokens - budget.num_tokens
            req = pick.request
            prompt = req.is_prefill
            if self._admissible(r, req) and self._schedule(r, req, min(pick.tokens, a_c)):
                picked += 1
                self.num_alg2_placements += 1
                self.stats["alg2_prompt_chunks" if prompt else "alg2_decodes"] += 1
            else:
                r.deferred.append(pick.entry)
        return picked

    def _drain_covered(self, r: _Round, pick: Candidate, group: list[DecodePoint]) -> tuple[int, Candidate | None]:
        """`_fill`'s picks once the nearest is a decode that needs no block and no prompt fits:
        returns how many were placed, and the pick it could not place this way (None: the
        budget or the group ran out), for `_fill` to place the general way.

        Why exact: no prompt fits (A_c, A_m) and no decode that needs a block fits A_m, so
        while A_m does not grow (a covered decode allocates nothing) and A_c only shrinks, every
        next nearest pick is this group's last candidate; a running decode whose blocks cover
        its step is what `_admissible` passes and `_schedule` places through
        `schedule_if_covered`. At 256 running / 10,000 waiting, about 70 of the 75 decodes
        Algorithm 2 places a step (200 steps after the fill) take this path."""
        budget, covered, batch = r.step.budget, r.step.schedule_if_covered, self._batch
        # NOTE: with block allocation `covered`'s test is written out below (a call fewer per
        # decode, about 70 a step), as `RankedHolders.run_covered` does
        view = r.step.table_cover()
        tables, scheduled, block_size = view if view is not None else ({}, {}, 0)
        placed = 0
        tokens, entry, req = pick.tokens, pick.entry, pick.request  # the decode at hand
        stuck = True  # the walk ends at a decode it cannot place (False: the budget or the group ran out)
        while True:
            left = budget.max_tokens - budget.num_tokens
            n = tokens if tokens < left else left
            computed = req.num_computed_tokens
            if req.status is not _DECODING or computed < req.prefill_len:
                break
            if view is None:
                if not covered(req, n):
                    break
            else:
                rid = req.request_id
                table = tables.get(rid)
                if not (
                    0 < n <= req.num_prompt_tokens + req.num_output_tokens - computed
                    and rid not in scheduled
                    and table is not None
                    and len(table) * block_size >= computed + n
                    and budget.num_tokens + n <= budget.max_tokens
                    and budget.num_seqs < budget.max_seqs
                ):
                    break
                budget.num_tokens += n
                budget.num_seqs += 1
                scheduled[rid] = n
            state: AccelGenState = req.policy_state
            if state.preempted_at is not None or state.jct is not None:
                self._scheduled(r, req, n)
            else:
                batch.append(req)  # all `_scheduled` does for it
            placed += 1
            if not group or budget.max_tokens <= budget.num_tokens:
                stuck = False
                break
            tokens, entry, req = group.pop()
        if placed:
            self.num_alg2_placements += placed
            self.stats["alg2_decodes"] += placed
        # NOTE: the group's candidates are (D_c, entry, request) points: the one the walk ends
        # at becomes a Candidate (D_m 0, as the pick's) only now, for `_fill`'s general path
        return placed, Candidate(req, entry, tokens, 0) if stuck else None
