"""The plug-in's policies: what a Sluice policy decides inside vLLM's scheduler loop.

No vLLM here (tests/unit/test_layers.py checks it): a policy sees `Job`s, each wrapping a
request object with vLLM's field names (request_id, arrival_time, priority, num_prompt_tokens,
num_output_tokens, num_computed_tokens, max_tokens), and every rule it applies is a function
of `scheduler_service.policies.decisions`, the ones Sluice's own policies call.

What a policy can set before vLLM's own `schedule()` runs (the rest is vLLM's loop):

    Job.rank                    the order in which vLLM's loop admits waiting requests
                                (`reorders_waiting` False: vLLM's FCFS deque, untouched)
    running_order               the running list's order (by `Job.rank` or `Job.vrank`): vLLM
                                serves it front to back under the token budget and, when KV runs
                                short, preempts its LAST entry, so the order is also the victim
    token_budget(...)           this step's token budget (vLLM's max_num_scheduled_tokens), or
                                `fixed_budget` once
    admission_cap()             this step's cap on running requests (vLLM's max_num_active_seqs)
    on_step(jobs, step_s, now)  what the previous step served, and how long it took
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, ClassVar, Protocol

from scheduler_service.costmodel.pivot import pivot_forward_size
from scheduler_service.policies.accelgen.queue import WindowMax
from scheduler_service.policies.alise.policy import DEFAULT_ALPHA_S, DEFAULT_BETA_S, DEFAULT_T0_S
from scheduler_service.policies.decisions import (
    aging_due,
    alise_level,
    alise_remaining_s,
    budget_from_tbt_slo,
    demoted_level,
    eq6_budget,
    iteration_slo_s,
    jct_allowed_s,
    mispredicted_length,
    mlfq_quanta,
    num_chunks,
    online_remaining_s,
    priority_key,
    priority_victim_key,
    quantum_spent,
    skip_join_level,
    slo_class_rank,
)
from sluice.common.registry import Registry
from sluice.contract.profile import BatchShape
from sluice_vllm.config import PluginConfigError, build_options
from sluice_vllm.hints import Hints


class RequestView(Protocol):
    """The fields of vLLM's `Request` the policies read."""

    request_id: str
    arrival_time: float
    priority: int
    num_prompt_tokens: int
    num_computed_tokens: int
    max_tokens: int

    @property
    def num_output_tokens(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...


_seq = itertools.count(1)
RANK = attrgetter("rank")


class Job:
    """The plug-in's state of one request (the request object itself stays vLLM's)."""

    __slots__ = (
        "arrived",
        "attained",
        "clock",
        "deadline",
        "hints",
        "level",
        "predicted",
        "rank",
        "req",
        "seq",
        "t0",
        "vrank",
    )

    def __init__(self, req: RequestView, hints: Hints, now: float) -> None:
        self.req = req
        self.hints = hints
        self.seq = next(_seq)
        self.arrived = now  # on the plug-in's clock (vLLM's arrival_time is wall-clock time)
        self.predicted = max(1, hints.predicted_tokens or req.max_tokens)  # no prediction: max_tokens
        self.level = 0
        self.clock = now  # last served (ALISE's aging clock)
        self.attained = 0.0  # FastServe: service in the current level
        self.t0 = now  # AccelGen: when it last entered the queue
        self.deadline = 0.0
        # NOTE: the order keys are cached on the job and refreshed only when they change, so
        # a step sorts with a C-level key instead of recomputing 256 keys in Python.
        self.rank: Any = self.seq  # ascending: served first, and the last running one is the victim
        self.vrank: Any = None  # priority policies: running order is this key, descending

    @property
    def prefill_left(self) -> int:
        return max(0, self.req.num_prompt_tokens - self.req.num_computed_tokens)


@dataclass(frozen=True, slots=True)
class LinearStepTime:
    """A step's seconds as `base + per_token * tokens`: the price list the SLO-derived rules
    need (Sarathi's tau, AccelGen's pivot, FastServe's skip-join), fitted to the served
    engine with `benchmarks/vllm_plugin.py --fit`."""

    base_s: float
    per_token_s: float

    def prefill_time(self, num_tokens: int, prefix: int = 0) -> float:
        return self.base_s + self.per_token_s * num_tokens

    def iteration_time(self, shape: BatchShape) -> float:
        tokens = sum(n for n, _ in shape.prefill_chunks) + shape.num_decodes
        return self.base_s + self.per_token_s * tokens


@dataclass(frozen=True, slots=True)
class Limits:
    """vLLM's own limits, which every budget and cap stays within."""

    max_num_seqs: int
    max_num_batched_tokens: int


@dataclass
class StepTimeOptions:
    # The step-time line: a round default; fit it to the served engine (the plug-in's `fit_*`
    # counters, `step_time_line`): a tiny Llama on the shared CPU machine measured 9.2 ms + 460 us/token.
    step_base_ms: float = 5.0  # fixed cost of one step
    step_us_per_token: float = 100.0  # cost per scheduled token

    def pricer(self) -> LinearStepTime:
        if self.step_base_ms < 0 or self.step_us_per_token <= 0:
            raise PluginConfigError("step_base_ms must be >= 0 and step_us_per_token > 0")
        return LinearStepTime(self.step_base_ms / 1e3, self.step_us_per_token / 1e6)


class PluginPolicy:
    name: ClassVar[str]
    options_cls: ClassVar[type] = StepTimeOptions
    reorders_waiting: ClassVar[bool] = True  # waiting requests sorted by `Job.rank` each step
    running_order: ClassVar[str | None] = None  # "rank" or "vrank": the running list sorted by it
    running_descending: ClassVar[bool] = False
    budget_reads_jobs: ClassVar[bool] = False  # token_budget needs the running and waiting jobs

    def __init__(self, options: Any, limits: Limits) -> None:
        self.options = options
        self.limits = limits

    def on_add(self, job: Job, now: float) -> None:
        """A new request."""

    def on_prediction(self, job: Job, now: float) -> None:
        """A prediction arrived from the predictor service after the request was added."""

    def before_step(self, waiting: Sequence[Job], running: Sequence[Job], now: float) -> None:
        """Level changes that do not depend on the batch (aging)."""

    @property
    def fixed_budget(self) -> int | None:
        """A token budget set once (Sarathi's tau), not per step."""
        return None

    def order_running(self, jobs: list[Job]) -> list[Job]:
        """The running order as a list (the scheduler sorts vLLM's list in place by the same key)."""
        if self.running_order is None:
            return list(jobs)
        return sorted(jobs, key=attrgetter(self.running_order), reverse=self.running_descending)

    def token_budget(self, running: Sequence[Job], waiting: Sequence[Job], now: float) -> int | None:
        return None

    def admission_cap(self) -> int | None:
        return None

    def refresh_every(self) -> int:
        """`on_step` hears the jobs served over this many steps at once: a per-job pass over 256
        running requests every step would cost more than the 0.5 ms a step may add."""
        return 1

    def on_step_time(self, step_s: float) -> None:
        """Every step: how long it took."""

    def on_step(self, served: Sequence[Job], step_s: float, now: float) -> None:
        """The jobs served since the last call (their counters updated) and the seconds of
        those steps (`refresh_every()` steps)."""


POLICIES: Registry[type[PluginPolicy]] = Registry("plug-in policy")


def register(cls: type[PluginPolicy]) -> type[PluginPolicy]:
    return POLICIES.add(cls.name, cls)


def build_policy(name: str, options: dict[str, str], limits: Limits) -> PluginPolicy:
    if name not in POLICIES:
        raise PluginConfigError(f"SLUICE_VLLM_POLICY: unknown policy {name!r}; known: {', '.join(POLICIES.names())}")
    cls = POLICIES.get(name)
    return cls(build_options(cls.options_cls, options, name), limits)


# ------------------------------------------------------------------------------ FCFS


@dataclass
class NoOptions:
    pass


@register
class FCFS(PluginPolicy):
    """vLLM's own order (`vllm`/`vllm_chunked`'s FCFS): the plug-in changes nothing."""

    name = "fcfs"
    options_cls = NoOptions
    reorders_waiting = False


# ------------------------------------------------------------------------------ priorities


@register
class StrictPriority(PluginPolicy):
    """`vllm` with priority=true: waiting by (priority, arrival); the victim is the lowest
    priority (largest value), the earliest of those (Sluice's `victim_order`)."""

    name = "priority"
    options_cls = NoOptions
    running_order = "vrank"
    running_descending = True

    def on_add(self, job: Job, now: float) -> None:
        job.rank = priority_key(job.req.priority, job.req.arrival_time)
        job.vrank = priority_victim_key(job.req.priority, job.req.arrival_time)


@dataclass
class SLOClassOptions(StepTimeOptions):
    tile: int = 32  # the budget from a TBT SLO is a multiple of this (CPU KV blocks are 32 tokens)


@register
class SLOClasses(PluginPolicy):
    """Online requests before offline ones, then strict priority; offline requests are the
    first victims; the token budget is Sarathi's, derived from the tightest TBT SLO among the
    running online requests (none given: vLLM's budget)."""

    name = "slo_class"
    options_cls = SLOClassOptions
    running_order = "vrank"
    running_descending = True
    budget_reads_jobs = True

    def __init__(self, options: SLOClassOptions, limits: Limits) -> None:
        super().__init__(options, limits)
        self.pricer = options.pricer()

    def on_add(self, job: Job, now: float) -> None:
        cls, r = slo_class_rank(job.hints.offline), job.req
        job.rank = (cls, *priority_key(r.priority, r.arrival_time))
        job.vrank = (-cls, *priority_victim_key(r.priority, r.arrival_time))

    def token_budget(self, running: Sequence[Job], waiting: Sequence[Job], now: float) -> int | None:
        slos = [j.hints.tbt_s for j in running if j.hints.tbt_s is not None and not j.hints.offline]
        if not slos:
            return None
        return budget_from_tbt_slo(self.pricer, min(slos), self.options.tile, self.limits.max_num_batched_tokens)


# ------------------------------------------------------------------------------ Sarathi


@dataclass
class SarathiOptions(StepTimeOptions):
    budget: int | None = None  # a fixed tau; None: derived from tbt_slo_ms
    tbt_slo_ms: float | None = None  # None and no budget: the paper's strict 512
    tile: int = 32  # tau is a multiple of this (the paper: 128 on GPUs; CPU KV blocks are 32)


@register
class Sarathi(PluginPolicy):
    """Sarathi-Serve's stall-free batching is vLLM's chunked prefill with tau as the budget:
    FCFS order, tau from a TBT SLO (Sluice's `budget_from_tbt_slo`): the `tbt_slo_ms` option
    fixes it once; without it (and without `budget`) tau follows the tightest TBT SLO of the
    requests' own `tbt_ms` (running or waiting), as Sluice's Sarathi does (core/slo.py), else 512."""

    name = "sarathi"
    options_cls = SarathiOptions
    reorders_waiting = False

    def __init__(self, options: SarathiOptions, limits: Limits) -> None:
        super().__init__(options, limits)
        cap = limits.max_num_batched_tokens
        self.follows_clients = options.budget is None and options.tbt_slo_ms is None
        self.budget_reads_jobs = self.follows_clients  # NOTE: an instance's answer: fixed taus read no jobs
        self._taus: dict[float, int] = {}  # tau per client TBT SLO, each priced once
        if options.budget is not None:
            if options.budget < 1:
                raise PluginConfigError(f"SLUICE_VLLM_POLICY: sarathi.budget must be positive, got {options.budget}")
            self.tau = min(options.budget, cap)
        elif options.tbt_slo_ms is not None:
            if options.tbt_slo_ms <= 0:
                raise PluginConfigError("SLUICE_VLLM_POLICY: sarathi.tbt_slo_ms must be positive")
            self.tau = budget_from_tbt_slo(options.pricer(), options.tbt_slo_ms / 1e3, options.tile, cap)
        else:
            self.tau = min(512, cap)  # the paper's strict budget, until a client brings a TBT SLO
            self.pricer = options.pricer()

    @property
    def fixed_budget(self) -> int | None:
        return None if self.follows_clients else self.tau

    def token_budget(self, running: Sequence[Job], waiting: Sequence[Job], now: float) -> int | None:
        if not self.follows_clients:
            return self.tau
        # the requests waiting too, as Sluice's Sarathi counts every request on its worker
        slos = [
            j.hints.tbt_s
            for jobs in (running, waiting)
            for j in jobs
            if j.hints.tbt_s is not None and not j.hints.offline
        ]
        if not slos:
            return self.tau
        tightest = min(slos)
        if (tau := self._taus.get(tightest)) is None:
            cap = self.limits.max_num_batched_tokens
            tau = self._taus[tightest] = budget_from_tbt_slo(self.pricer, tightest, self.options.tile, cap)
        return tau


# ------------------------------------------------------------------------------ ALISE


@dataclass
class AliseOptions:
    num_queues: int = 6
    level_base_tokens: int = 32
    aging_s: float | None = None  # aging period K; None: 16 x queue 1's bound, as in Sluice
    job_limit: int = 0  # GPU job limit M: caps the running requests (0: vLLM's max_num_seqs)
    t0_s: float = DEFAULT_T0_S  # prefill seconds per prompt token (Eq. 4)
    alpha_s: float = DEFAULT_ALPHA_S  # decode seconds per token per context token (Eq. 5)
    beta_s: float = DEFAULT_BETA_S  # decode seconds per token at zero context
    refresh_steps: int = 8  # running jobs' ranks, misprediction and aging clocks refresh this often


@register
class Alise(PluginPolicy):
    """ALISE: predicted remaining time first, in queues by doubling remaining time, aging lifts a
    waiting job one queue per `aging_s`; the worst-ranked running job is the KV victim; a job
    past its prediction has it doubled and drops a queue."""

    name = "alise"
    options_cls = AliseOptions
    running_order = "rank"

    def __init__(self, options: AliseOptions, limits: Limits) -> None:
        super().__init__(options, limits)
        if options.num_queues < 1 or options.level_base_tokens < 1:
            raise PluginConfigError("SLUICE_VLLM_POLICY: alise.num_queues and level_base_tokens must be >= 1")
        o = options
        self.level_base_s = o.level_base_tokens * (o.alpha_s * 256 + o.beta_s)  # T_dec(256, base tokens)
        self.age_s = o.aging_s if o.aging_s is not None else 16 * self.level_base_s
        if self.age_s <= 0:
            raise PluginConfigError("SLUICE_VLLM_POLICY: alise.aging_s must be positive")

    def remaining_s(self, job: Job) -> float:
        o, r = self.options, job.req
        return alise_remaining_s(
            o.t0_s, o.alpha_s, o.beta_s, job.prefill_left, r.num_tokens, job.predicted, r.num_output_tokens
        )

    def rerank(self, job: Job) -> None:
        job.rank = (job.level, self.remaining_s(job), job.seq)

    def on_add(self, job: Job, now: float) -> None:
        job.level = alise_level(self.remaining_s(job), self.level_base_s, self.options.num_queues)
        self.rerank(job)

    def on_prediction(self, job: Job, now: float) -> None:
        if job.req.num_computed_tokens == 0:  # still waiting: its queue follows the new prediction
            self.on_add(job, now)

    def before_step(self, waiting: Sequence[Job], running: Sequence[Job], now: float) -> None:
        for job in waiting:
            if job.level > 0 and aging_due(job.clock, self.age_s, now):
                job.level -= 1
                job.clock = now
                self.rerank(job)

    def admission_cap(self) -> int | None:
        return self.options.job_limit or None

    def refresh_every(self) -> int:
        return max(1, self.options.refresh_steps)

    def on_step(self, served: Sequence[Job], step_s: float, now: float) -> None:
        nq = self.options.num_queues
        o, base = self.options, self.level_base_s
        t0, alpha, beta = o.t0_s, o.alpha_s, o.beta_s
        for job in served:
            job.clock = now
            r = job.req
            if job.prefill_left:
                self.rerank(job)
                continue
            if r.num_output_tokens >= job.predicted:
                job.predicted = mispredicted_length(job.predicted, r.num_output_tokens)
                job.level = demoted_level(job.level, self.remaining_s(job), base, nq)
            remaining = alise_remaining_s(t0, alpha, beta, 0, r.num_tokens, job.predicted, r.num_output_tokens)
            if job.level > 1:
                job.level = min(job.level, alise_level(remaining, base, nq))
            job.rank = (job.level, remaining, job.seq)


# ------------------------------------------------------------------------------ FastServe


@dataclass
class FastServeOptions(StepTimeOptions):
    num_queues: int = 5
    quantum_ms: float | None = None  # queue 0's quantum; None: one step's fixed cost x 4
    refresh_steps: int = 8  # attained service is added up over this many steps


@register
class FastServe(PluginPolicy):
    """FastServe's skip-join MLFQ: a job joins the first queue whose quantum covers its
    prefill, drops a queue when it used that queue's quantum, FIFO inside a queue; the
    worst-ranked running job is the KV victim."""

    name = "fastserve"
    options_cls = FastServeOptions
    running_order = "rank"

    def __init__(self, options: FastServeOptions, limits: Limits) -> None:
        super().__init__(options, limits)
        self.pricer = options.pricer()
        base = options.quantum_ms / 1e3 if options.quantum_ms is not None else 4 * self.pricer.base_s
        if base <= 0 or options.num_queues < 1:
            raise PluginConfigError("SLUICE_VLLM_POLICY: fastserve.quantum_ms and num_queues must be positive")
        self.quanta = mlfq_quanta(base, options.num_queues)

    def on_add(self, job: Job, now: float) -> None:
        job.level = skip_join_level(self.quanta, self.pricer.prefill_time(job.req.num_prompt_tokens))
        job.rank = (job.level, job.seq)

    def refresh_every(self) -> int:
        return max(1, self.options.refresh_steps)

    def on_step(self, served: Sequence[Job], step_s: float, now: float) -> None:
        for job in served:
            job.attained += step_s
            if quantum_spent(job.level, job.attained, self.quanta):
                job.level += 1
                job.attained = 0.0
                job.seq = next(_seq)  # the tail of the next queue
                job.rank = (job.level, job.seq)


# ------------------------------------------------------------------------------ AccelGen


@dataclass
class AccelGenOptions(StepTimeOptions):
    default_ttft_ms: float = 1000.0
    default_tbt_ms: float = 187.5  # normal reading speed (section 4.3)
    min_budget: int = 256  # floor of S_b
    pivot_tokens: int | None = None  # S_pf; None: the pivot of the step-time line
    pivot_ms: float | None = None  # T_pf
    t_max_window: int = 128  # T_max: the largest step time over this many recent steps
    refresh_steps: int = 4  # running requests re-enter the queue (new deadline) this often


@register
class AccelGen(PluginPolicy):
    """AccelGen's iteration-level urgency: every request (waiting or running, a running one
    re-entering the queue after each token) is ordered by its deadline `t0 + T_r`; the budget
    of the step is Eq. 6 for the tightest iteration SLO in it; the victim is the request with
    the largest T_r. Offline requests (JCT only) get their per-iteration allowed wait."""

    name = "accelgen"
    options_cls = AccelGenOptions
    running_order = "rank"
    budget_reads_jobs = True

    def __init__(self, options: AccelGenOptions, limits: Limits) -> None:
        super().__init__(options, limits)
        pricer = options.pricer()
        if options.pivot_tokens and options.pivot_ms:
            self.pivot_tokens, self.pivot_s = options.pivot_tokens, options.pivot_ms / 1e3
        else:
            self.pivot_tokens, self.pivot_s = pivot_forward_size(pricer, max_tokens=limits.max_num_batched_tokens)  # type: ignore[arg-type]
        self.t_max = WindowMax(self.pivot_s, options.t_max_window)
        self.avg_chunk = float(limits.max_num_batched_tokens)

    def iteration_slo(self, job: Job) -> float:
        h, o = job.hints, self.options
        return iteration_slo_s(
            job.req.num_output_tokens, h.ttft_s, h.tbt_s, o.default_ttft_ms / 1e3, o.default_tbt_ms / 1e3
        )

    def _file(self, job: Job, t0: float) -> None:
        job.t0 = t0
        n_ck = num_chunks(job.prefill_left, self.avg_chunk)
        t_max = self.t_max.value
        if job.hints.offline and job.hints.jct_s is not None:
            slo_left = job.arrived + job.hints.jct_s - t0
            n = n_ck if job.prefill_left else 0
            left = max(1, job.predicted - job.req.num_output_tokens)
            job.deadline = t0 + jct_allowed_s(slo_left, n, left, t_max, 0.0, 0.0)
        else:
            job.deadline = t0 + online_remaining_s(self.iteration_slo(job), n_ck, t_max)
        job.rank = (job.deadline, job.seq)

    def on_add(self, job: Job, now: float) -> None:
        self._file(job, now)

    def on_prediction(self, job: Job, now: float) -> None:
        if job.hints.offline:
            self._file(job, job.t0)

    def token_budget(self, running: Sequence[Job], waiting: Sequence[Job], now: float) -> int | None:
        first = min(itertools.chain(running, waiting[:1]), key=RANK, default=None)
        if first is None:
            return None
        o = self.options
        return eq6_budget(
            self.pivot_tokens, self.pivot_s, self.iteration_slo(first), o.min_budget, self.limits.max_num_batched_tokens
        )

    def refresh_every(self) -> int:
        return max(1, self.options.refresh_steps)

    def on_step_time(self, step_s: float) -> None:
        self.t_max.observe(step_s)

    def on_step(self, served: Sequence[Job], step_s: float, now: float) -> None:
        # NOTE: an online request past its prompt re-enters with T_r = its TBT SLO - T_max,
        # the same for every request with the same SLO: computed once per SLO, not per
        # request (the refresh step's time was most of the plug-in's per-step cost).
        remaining: dict[float | None, float] = {}
        t_max = self.t_max.value
        default_tbt = self.options.default_tbt_ms / 1e3
        for job in served:
            req, hints = job.req, job.hints
            if hints.offline or req.num_output_tokens == 0 or req.num_computed_tokens < req.num_prompt_tokens:
                # a prompt keeps its clock (its TTFT runs from arrival); a token restarts it
                self._file(job, job.t0 if job.prefill_left and not hints.offline else now)
                continue
            tbt = hints.tbt_s
            left = remaining.get(tbt)
            if left is None:
                left = remaining[tbt] = online_remaining_s(tbt if tbt is not None else default_tbt, 1, t_max)
            job.t0 = now
            job.deadline = now + left
            job.rank = (job.deadline, job.seq)


def describe(policy: PluginPolicy) -> dict[str, Any]:
    """What the trace records about the policy at start."""
    out: dict[str, Any] = {"policy": policy.name, "options": dict(vars(policy.options))}
    for attr in ("tau", "age_s", "quanta", "pivot_tokens", "pivot_s", "level_base_s"):
        if hasattr(policy, attr):
            out[attr] = getattr(policy, attr)
    return out


def step_time_line(counters: dict[str, float]) -> LinearStepTime | None:
    """The least-squares line through the steps the scheduler saw (its `fit_*` counters), or
    None with too few or too alike steps."""
    n, x, y, xx, xy = (float(counters.get(k, 0.0)) for k in ("fit_n", "fit_x", "fit_y", "fit_xx", "fit_xy"))
    den = n * xx - x * x
    if n < 10 or den <= 0:
        return None
    b = (n * xy - x * y) / den
    a = (y - b * x) / n
    return LinearStepTime(max(a, 0.0), max(b, 1e-9))
