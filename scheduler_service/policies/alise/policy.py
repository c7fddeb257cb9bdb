"""`alise`: speculative shortest-remaining-first scheduling with EWT-based KV swapping
(ALISE, ICCAD'24, seed 003, section 3).

Why choose it: FCFS lets one long answer hold up many short ones (head-of-line blocking);
knowing each job's predicted length, ALISE serves the job closest to done first and
preempts at every iteration, which cuts mean and normalized latency on mixed traffic.

What it does:
- Execution-time model (section 3.1, Eq. 4-5): `T_pre(s) = s*T0`, `T_dec(s, n) = n*(alpha*s + beta)`,
  fitted by least squares on the cost model's latencies (batch 1, as the paper profiles);
  a job's remaining time is its remaining prefill plus `T_dec(context, predicted - generated)`.
- Priority queues (section 3.1): queue i >= 1 holds jobs whose remaining time is below
  `base * 2^(i-1)` (base = `T_dec(256, level_base_tokens)`), shortest remaining first inside a
  queue; every iteration the batch is the best-ranked jobs that fit (seats, token budget, KV),
  the others pause (iteration-level preemption, their KV kept on the GPU). As a running job
  nears its end its remaining time, and so its queue, shrinks.
- Virtual aging: a job not served for `age_threshold_s` moves up one queue; queue 0 is
  reachable only by aging and runs first, so no job starves.
- Misprediction: a job that reaches its predicted length without finishing has its
  prediction doubled and is demoted at least one queue.
- Dynamic swapping (Algorithm 2, Eq. 7): `EWT(J) = min(sum of the remaining times of the jobs
  ranked ahead of J, T_promote(J))`; per queue in priority order, by ascending EWT, paused jobs
  are kept on the GPU (or swapped in ahead of time) while under the GPU job limit M, the others
  are swapped out; M shrinks by each queue's size. Swapped KV is int8 (`int8`: half the bytes).
- Engine (its "execution engine is based on vLLM", section 4): a step that can admit waiting
  jobs (in rank order, whole prompts; on a full engine a job takes the seat of a worse-ranked
  running one, which is paused; evicting only lower-ranked jobs' KV) is prefill-only, as in
  `vllm`; otherwise the KV holders run in rank order. `hybrid` (ours) mixes admissions and decodes in one batch, which
  is chunked-prefill-style batching the `vllm` baseline does not have.
- Memory managers (Figure 8): `memory=swap` (the above), `memory=recompute` (evicted jobs drop
  their KV, no proactive swapping), `memory=defer` (no eviction for new jobs: they wait).

Inputs: `Request.predicted_output_tokens` (any length source: oracle, noisy oracle, predictor;
None falls back to max_tokens), the cost model in `PolicyContext` (the fit).
Configuration: see `AliseConfig`. Deviations from the paper are NOTE'd where they are made.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import numpy as np

from scheduler_service.core.policy import POLICIES, PolicyContext
from scheduler_service.core.preemption import PreemptionMode, PreemptionReason
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.step_builder import StepBuilder
from scheduler_service.costmodel.base import CostModel
from scheduler_service.policies.alise.aging import DueQueue
from scheduler_service.policies.alise.levels import IndexedLevels, SortedLevels
from scheduler_service.policies.decisions import (
    alise_level,
    alise_remaining_s,
    demoted_level,
    mispredicted_length,
)
from scheduler_service.policies.mlfq import JobState, MemoryMode, QueuePolicy, QueuePolicyConfig, Rank
from scheduler_service.policies.paused_index import Entry
from sluice.contract.plan import StepPlan, StepResult

# NOTE: used only when there is no cost model to fit (unit tests): a 7B-class model on an A100.
DEFAULT_T0_S = 2e-4
DEFAULT_ALPHA_S = 1e-6
DEFAULT_BETA_S = 0.02


@dataclass
class AliseConfig(QueuePolicyConfig):
    num_queues: int = 6  # queues by remaining time (plus queue 0, reached only by aging)
    level_base_tokens: int = 32  # queue 1 holds jobs with less than T_dec(256, this) left
    age_threshold_s: float | None = None  # aging period K; None: 16 x queue 1's bound
    job_limit: int = 0  # GPU job limit M of Algorithm 2; 0: as many jobs as GPU KV holds
    swap_headroom: float = 0.05  # share of GPU blocks that swapping in ahead of time leaves free
    int8: bool = True  # swapped-out KV is int8 (halves the bytes moved)
    t0: float | None = None  # prefill seconds per prompt token; None: fitted
    alpha: float | None = None  # decode seconds per token per context token; None: fitted
    beta: float | None = None  # decode seconds per token at zero context; None: fitted
    hybrid: bool = False  # ours: prompts join the decodes in one batch; off: vLLM's engine (prefill-only steps)


@dataclass(frozen=True, slots=True)
class ExecTimeModel:
    """ALISE's Eq. 4-5: `T_pre(s) = s*T0`, `T_dec(s, n) = n*(alpha*s + beta)`."""

    t0: float
    alpha: float
    beta: float

    def prefill(self, s: int) -> float:
        return s * self.t0

    def decode(self, s: int, n: int) -> float:
        return n * (self.alpha * s + self.beta)

    @classmethod
    def fit(cls, cost_model: CostModel, max_len: int, num_points: int = 24) -> ExecTimeModel:
        """Least squares on the cost model's prefill and single-sequence decode latencies."""
        s = np.linspace(16, max(32, max_len), num_points).astype(int)
        pre = np.array([cost_model.prefill_time(int(x)) for x in s])
        t0 = float(np.linalg.lstsq(s[:, None].astype(float), pre, rcond=None)[0][0])
        dec = np.array([cost_model.decode_time(1, int(x)) for x in s])
        design = np.stack([s.astype(float), np.ones(len(s))], axis=1)
        alpha, beta = (float(v) for v in np.linalg.lstsq(design, dec, rcond=None)[0])
        return cls(t0, max(alpha, 0.0), max(beta, 1e-9))


def build_exec_model(config: AliseConfig, ctx: PolicyContext) -> ExecTimeModel:
    if ctx.cost_model is not None:
        fitted = ExecTimeModel.fit(ctx.cost_model, ctx.max_model_len)
    else:
        fitted = ExecTimeModel(DEFAULT_T0_S, DEFAULT_ALPHA_S, DEFAULT_BETA_S)
    return ExecTimeModel(
        fitted.t0 if config.t0 is None else config.t0,
        fitted.alpha if config.alpha is None else config.alpha,
        fitted.beta if config.beta is None else config.beta,
    )


@POLICIES.register("alise")
class AlisePolicy(QueuePolicy):
    name = "alise"
    # NOTE: ranks and mispredictions follow committed counts (`on_step_committed`), so a plan
    # made ahead sees them as one step at a time does; a job that ends at step N is judged
    # with it (its rank in plan N+1, where it computes one voided token, may differ).
    overlap_safe = True
    # NOTE: a paused job's rank moves only where its queue does (aging, `rerank_paused`), and
    # hundreds sit paused in a long run: sorting them every step, and walking them all in
    # Algorithm 2, grew with the run (4.5x vllm's schedule() over 300 steps)
    index_paused = True
    config_cls = AliseConfig
    config: AliseConfig

    def __init__(self, config: AliseConfig, ctx: PolicyContext) -> None:
        super().__init__(config, ctx, num_levels=config.num_queues + 1)
        self.model = build_exec_model(config, ctx)
        self.level_base_s = self.model.decode(256, config.level_base_tokens)
        self.age_s = config.age_threshold_s if config.age_threshold_s is not None else 16 * self.level_base_s
        self._aging = DueQueue()  # when each job's aging check is due
        self._judged: dict[int, list[Request]] = {}  # step id -> jobs it found mispredicted

    @property
    def int8_swap(self) -> bool:
        """ALISE's own option decides whether its swapped KV is int8 (section 3.3)."""
        return self.config.int8

    # ------------------------------------------------------------------ estimates
    def remaining_time(self, req: Request) -> float:
        st: JobState = req.policy_state
        m = self.model
        return alise_remaining_s(
            m.t0, m.alpha, m.beta, req.num_prefill_remaining, req.num_tokens, st.predicted, req.num_output_tokens
        )

    def level_for(self, remaining_s: float) -> int:
        """Queue of a job by remaining time: 1 below the base, one more per doubling."""
        return alise_level(remaining_s, self.level_base_s, self.config.num_queues)

    def rank(self, req: Request) -> Rank:
        st: JobState = req.policy_state
        return (st.level, self.remaining_time(req), st.seq)

    def ranked_entries(self, jobs: Collection[Request]) -> list[Entry]:
        # NOTE: `refresh_ranks` and the entries in one pass, `remaining_time` inlined (the same
        # arithmetic): the running jobs, every step
        t0, alpha, beta = self.model.t0, self.model.alpha, self.model.beta
        out: list[Entry] = []
        for r in jobs:
            st: JobState = r.policy_state
            n_tok = r.num_prompt_tokens + r.num_output_tokens
            left = st.predicted - r.num_output_tokens
            pre = r.prefill_len - r.num_computed_tokens
            t = (left if left > 1 else 1) * (alpha * n_tok + beta) + (t0 * pre if pre > 0 else 0.0)
            level, seq = st.level, st.seq
            st.rank = (level, t, seq)
            out.append((level, t, seq, r))
        out.sort()
        return out

    def weight(self, req: Request) -> float:
        return self.remaining_time(req)

    def key_and_weight(self, req: Request) -> tuple[float, float]:
        # NOTE: both are the remaining time: computed once
        remaining = self.remaining_time(req)
        return remaining, remaining

    # ------------------------------------------------------------------ hooks
    def on_arrival(self, request: Request, now: float) -> None:
        predicted = request.predicted_output_tokens or request.max_tokens
        st = JobState(level=1, key=0.0, seq=self.next_seq(), clock=now, predicted=max(1, predicted))
        request.policy_state = st
        st.level = self.level_for(self.remaining_time(request))
        self.jobs[request.request_id] = request
        self.requeue(request)
        self._aging.push(now + self.age_s, st.seq, request)

    def on_prediction(self, request: Request, now: float) -> None:
        """A later prediction: the job's remaining time and, while it waits without KV, its queue."""
        st: JobState = request.policy_state
        st.predicted = max(1, request.predicted_output_tokens or request.max_tokens)
        if request.status.is_waiting:
            st.level = self.level_for(self.remaining_time(request))
            self.requeue(request)

    def on_step_committed(self, plan: StepPlan, now: float) -> None:
        """A job's queue follows its remaining time as it runs, and a job that reached its
        predicted length without finishing has its prediction doubled and is demoted. On
        counts only, so with overlap the next plan sees both as it does one step at a time;
        a job judged so that then finishes at this very step (known from the answer) was
        not mispredicted: `on_step_result` takes it off the count."""
        jobs = self.jobs
        judged: list[Request] = []
        for rid in plan.num_scheduled_tokens:
            req = jobs.get(rid)
            if req is None:
                continue
            st: JobState = req.policy_state
            if req.is_prefill:
                continue
            if req.num_output_tokens >= st.predicted:
                self._mispredicted(req, st)
                judged.append(req)
            elif st.level > 1:
                st.level = min(st.level, self.level_for(self.remaining_time(req)))
        if judged:
            self._judged[plan.step_id] = judged

    def on_step_result(self, plan: StepPlan, result: StepResult, now: float) -> None:
        jobs = self.jobs
        for rid in plan.num_scheduled_tokens:
            req = jobs.get(rid)
            if req is not None:
                req.policy_state.clock = now
        for req in self._judged.pop(plan.step_id, ()):
            if req.status.is_finished:  # planned ahead: it ended at the step that judged it
                self.stats["mispredictions"] -= 1
        if self._judged and min(self._judged) < plan.step_id:  # steps a failure voided
            self._judged = {k: v for k, v in self._judged.items() if k > plan.step_id}

    def _mispredicted(self, req: Request, st: JobState) -> None:
        """Generated reached the prediction without finishing: double it and demote."""
        self.stats["mispredictions"] += 1
        st.predicted = mispredicted_length(st.predicted, req.num_output_tokens)
        st.level = demoted_level(st.level, self.remaining_time(req), self.level_base_s, self.config.num_queues)

    # ------------------------------------------------------------------ aging
    def before_step(self, step: StepBuilder, now: float) -> None:
        due = self._aging.pop_due(now)
        if not due:
            return
        age, jobs, queues, aging = self.age_s, self.jobs, self.queues, self._aging
        t0, alpha, beta = self.model.t0, self.model.alpha, self.model.beta
        finished = RequestStatus.FINISHED_STOPPED
        moved: list[Request] = []  # waiting jobs promoted, moved up together below
        keys: list[float] = []  # their remaining times, their new keys
        next_due = now + age  # the next check of every job promoted now
        again: list[tuple[int, Request]] = []  # their checks' entries, filed for it together below
        # NOTE: jobs that arrived together age together (9,500 in one step of the schedule
        # overhead benchmark): `_promote` of a waiting job is written out here (`aging_due` and
        # `remaining_time` with the same arithmetic) and `LevelQueues.move_up` moves them all;
        # the paused and running ones go through `_promote`.
        for entry in due:
            req = entry[1]
            st: JobState = req.policy_state
            if req.status >= finished or req.request_id not in jobs or st.level == 0:
                continue
            if st.clock + age <= now:  # NOTE: `aging_due`: the due time's arithmetic, or rounding loops
                if st.in_heap:
                    st.clock = now
                    left = st.predicted - req.num_output_tokens
                    pre = req.prefill_len - req.num_computed_tokens
                    keys.append(
                        (left if left > 1 else 1) * (alpha * (req.num_prompt_tokens + req.num_output_tokens) + beta)
                        + (t0 * pre if pre > 0 else 0.0)
                    )
                    moved.append(req)
                    again.append(entry)
                    continue
                self._promote(req, st, now)
            if st.clock == now:
                again.append(entry)
            else:
                aging.push_entry(st.clock + age, entry)
        if again:
            aging.push_entries(next_due, again)
        if moved:
            queues.move_up(moved, keys)
            self.stats["agings"] += len(moved)

    def _promote(self, req: Request, st: JobState, now: float) -> None:
        waiting = st.in_heap
        self.queues.discard(req)
        self.stats["agings"] += 1
        st.level -= 1
        st.clock = now
        if waiting:
            self.requeue(req)
        else:
            self.rerank_paused(req)  # a paused KV holder is sorted by its cached rank

    @property
    def hybrid_batches(self) -> bool:
        return self.config.hybrid

    def prefill_step(self, step: StepBuilder) -> bool:
        return not self.config.hybrid and self.admit_prefills(step) > 0

    # ------------------------------------------------------------------ Algorithm 2
    def after_batch(self, step: StepBuilder, now: float) -> None:
        if self.memory is not MemoryMode.SWAP or not (step.kept or step.swapped):
            return
        kept, swapped, scheduled = step.kept, step.swapped, step.scheduled
        # NOTE: every job scheduled is running, and every running job that sits out was ranked
        # (admitted jobs are scheduled), so the walk below counts this many idle ones.
        idle = len(step.running) - len(scheduled)
        slots = self._job_limit(step, len(scheduled) + len(kept) + idle) - len(scheduled) - idle
        if not swapped and slots > len(kept) + len(self.queues):
            # Nothing to do, which the EWTs would find after sorting every paused job: no job
            # is swapped out (to bring back), and the limit M cannot run out before the last
            # paused job's turn even after every level's waiting jobs are counted against it.
            return
        paused = self._paused_levels(step)
        # NOTE: read before anything moves; a queue's moves touch only its own jobs. Each queue
        # with swapped jobs, with the fewest tokens any of them has computed: its smallest
        # early swap-in (`_swap_in_early`'s need grows with the tokens).
        swapped_levels: dict[int, int] = {}
        for r in swapped.values():
            level, computed = r.policy_state.rank[0], r.num_computed_tokens
            if computed < swapped_levels.get(level, computed + 1):
                swapped_levels[level] = computed
        sums, counts = self.queues.sums, self.queues.counts
        cpu, gpu_tables = step.kv.cpu, step.kv.gpu_tables
        cpu_free = cpu.num_available()
        known = step.ids_known_to_worker()
        ahead: float | None = None  # summed once a queue needs its EWTs
        none_out: bool | None = None  # `_none_can_swap_out`, once a queue asks whether a job can go
        passed: list[int] = []  # queues walked since, whose part of `ahead` is not summed yet
        for level in range(self.num_levels):
            n = paused.count(level)
            if n == 0 or (slots >= n and level not in swapped_levels):
                # NOTE: each of the queue's jobs finds a slot and none is swapped out (or it has
                # none), so no EWT order changes anything here: only what it adds to `ahead` (its
                # waiting jobs' sum, then its jobs in rank order, as `_ewts` adds them) is needed,
                # and only if a later queue needs its EWTs.
                passed.append(level)
                slots -= n
                slots -= counts[level]
                continue
            fewest = swapped_levels.get(level)
            no_swap_in = (
                slots <= 0 or fewest is None or not self._early_swap_in_fits(step, step.kv.num_blocks_for(fewest + 1))
            )
            no_swap_out = slots >= n
            jobs: list[Entry] | None = None  # the queue's jobs, read only where a scan or the walk needs them
            if no_swap_in and not no_swap_out:
                if cpu_free == 0 and none_out is None:
                    none_out = _none_can_swap_out(kept, gpu_tables, known)
                # NOTE: with the swap space full, one answer for every queue (the walk only takes
                # kept jobs away); with space left (a swap-in freed some), the queue's own scan
                if cpu_free == 0 and none_out:
                    no_swap_out = True
                else:
                    jobs = paused.jobs(level)
                    no_swap_out = not _swappable(jobs, gpu_tables, cpu_free, known)
            if no_swap_in and no_swap_out:
                # NOTE: the walk below brings swapped jobs back only among the queue's first
                # `slots` (by EWT), then swaps kept ones out, so nothing moves when neither can
                # happen whatever the order: no swapped job of the queue (or no slot left), or
                # the GPU's headroom too small for the smallest of them (the swap-ins come first,
                # and only they could change the free space), and no job past the slots, or none
                # of this queue's that can go (each is known to the worker, its KV more than the
                # swap space has free). It counts as walked, as above. Once the swap space is
                # full, that is most queues of most steps, the queue where the slots run out too.
                passed.append(level)
                slots -= n
                slots -= counts[level]
                continue
            if ahead is None:
                ahead = paused.running_ahead()
                ahead += sum(r.policy_state.key for r in self.admitted)  # their key is their remaining time
            for done in passed:
                if done:
                    ahead += sums[done - 1]
                for e in paused.jobs(done):
                    ahead += e[1]
            passed = []
            if level:
                ahead += sums[level - 1]
            ewts, ahead = self._ewts(paused.jobs(level) if jobs is None else jobs, ahead, now)
            ewts.sort()  # NOTE: by (EWT, seq): seqs are unique, so a job is never compared
            for _, _, req in ewts:
                if slots > 0:
                    if req.status is RequestStatus.PREEMPTED_SWAPPED:
                        self._swap_in_early(step, req)
                        cpu_free = cpu.num_available()
                elif req.status is RequestStatus.PREEMPTED_KEPT and (
                    len(gpu_tables.get(req.request_id, ())) <= cpu_free or req.request_id not in known
                ):
                    # NOTE: `can_swap_out`, its tests in the cheaper order, against the free swap
                    # space kept current here (only this loop's moves change it): once the swap
                    # space is full, a thousand paused jobs a step fail it. A proactive swap-out
                    # the swap space cannot take is skipped (the job stays paused on the GPU),
                    # never turned into a recompute.
                    step.preempt(req, PreemptionMode.SWAP, PreemptionReason.PRIORITY)
                    self.stats["ewt_swap_outs"] += 1  # Algorithm 2's proactive swap-out
                    cpu_free = cpu.num_available()
                slots -= 1
            # NOTE: the paper's M -= len(q); the queue's waiting jobs count too (they are
            # ranked against its paused ones), which offloads deep queues under load.
            slots -= counts[level]

    def _paused_levels(self, step: StepBuilder) -> IndexedLevels | SortedLevels:
        """The step's paused jobs by queue: from the paused index, or the sorted KV holders."""
        if not self.index_paused:
            return SortedLevels(self.ranked, step.scheduled)
        levels = IndexedLevels(self.paused, self.run_entries, step.scheduled)
        if levels.total != len(step.kept) + len(step.swapped):
            # NOTE: a path that moved a paused job without the index being told: correct over fast
            self.paused.rebuilds += 1
            holders = {id(e[3]): e for e in [*self.paused.entries[: self.paused.lo], *self.run_entries]}
            for r in [*step.kept.values(), *step.swapped.values()]:
                holders[id(r)] = (*r.policy_state.rank, r)
            return SortedLevels([e[3] for e in sorted(holders.values())], step.scheduled)
        return levels

    def _ewts(self, jobs: Iterable[Entry], ahead: float, now: float) -> tuple[list[tuple[float, int, Request]], float]:
        """(EWT, seq, job) of one level's paused jobs in rank order: the time the jobs ranked
        ahead take, or sooner if aging lifts it to queue 0 first (Eq. 7's T_promote: the
        levels left to climb times the age threshold, plus what is left of this one)."""
        out: list[tuple[float, int, Request]] = []
        age = self.age_s
        for _, remaining, seq, req in jobs:
            st: JobState = req.policy_state
            if st.level == 0:
                out.append((ahead, seq, req))
            else:
                wait = age - (now - st.clock)
                promote = age * (st.level - 1) + (wait if wait > 0.0 else 0.0)
                out.append((ahead if ahead < promote else promote, seq, req))
            ahead += remaining
        return out, ahead

    def _job_limit(self, step: StepBuilder, num_resident: int) -> int:
        """M: the configured limit, or as many jobs as the GPU's KV holds at their mean size."""
        if self.config.job_limit > 0:
            return self.config.job_limit
        gpu = step.kv.gpu
        mean_blocks = gpu.num_used / num_resident if num_resident else 1.0
        return int(gpu.num_blocks * (1.0 - self.config.swap_headroom) / max(1.0, mean_blocks))

    def _early_swap_in_fits(self, step: StepBuilder, need: int) -> bool:
        """Whether `need` GPU blocks taken ahead of time leave the configured headroom free."""
        gpu = step.kv.gpu
        return gpu.num_available() - need >= int(self.config.swap_headroom * gpu.num_blocks)

    def _swap_in_early(self, step: StepBuilder, req: Request) -> None:
        """A swapped job within the limit comes back ahead of time when the GPU has headroom:
        it runs when its rank comes up, with no copy then."""
        if self._early_swap_in_fits(step, step.kv.num_blocks_for(req.num_computed_tokens + 1)) and step.swap_in(req):
            self.stats["ewt_early_swap_ins"] += 1
            if self.index_paused:
                self.paused.touch(req)  # NOTE: it runs now: its entry leaves the index at the next sync


def _none_can_swap_out(kept: Mapping[str, Request], tables: Mapping[str, list[int]], known: AbstractSet[str]) -> bool:
    """With the swap space full, whether no kept job passes `can_swap_out`: each is known to the
    worker (one that is not has no KV to copy) and holds a GPU block. Then no queue's
    `_swappable` can answer True: one pass over the kept jobs a step, in C, instead of a scan of
    each queue past the limit (a thousand paused jobs a step once the swap space is full)."""
    return kept.keys() <= known and all(map(tables.get, kept))


def _swappable(jobs: list[Entry], tables: Mapping[str, list[int]], cpu_free: int, known: AbstractSet[str]) -> bool:
    """Whether a kept job of `jobs` passes `can_swap_out` with `cpu_free` swap blocks free."""
    kept = RequestStatus.PREEMPTED_KEPT
    for e in jobs:
        req = e[3]
        if req.status is kept and (len(tables.get(req.request_id, ())) <= cpu_free or req.request_id not in known):
            return True
    return False
