"""Overlapped scheduling: the core's half of keeping one step in flight ahead.

With overlap the driver plans step N+1 while the worker still runs step N, so a plan
commits the step it describes at once instead of when its answer comes back:

    schedule(now) -> plan N+1     commit_plan: every scheduled request's computed tokens
                                  advance now, and each request that samples gets a
                                  placeholder (num_output_tokens + 1, no token id yet)
    ... worker runs N, then N+1; the token sampled in N is the input of N+1: the worker
        knows it, so no token value crosses the wire before N+1 starts ...
    on_step_result(result N)      resolve_step: placeholders become the sampled tokens,
                                  stop conditions are checked on the real tokens; a request
                                  that stops is ended, and its step in flight (N+1) is voided:
                                  the extra token it samples is discarded, never streamed

Decisions stay on committed state: at plan time a policy sees exactly the counts it would
see without overlap one step later (a placeholder counts as the token it stands for), and
the KV of the speculative step is allocated like any step's (freed when the request ends).
What step N could change is not guessed: a request that stops at N is still running when
N+1 is planned (its extra step is wasted, never wrong), and blocks it frees are reused from
N+2 on. A recompute preemption or an end drops a request's placeholders and voids its steps
in flight (`Scheduler._void`); a failed step resets the worker, which voids every step in
flight. A policy's bookkeeping on counts runs in `Policy.on_step_committed`, called here
when the plan is made (one step at a time: with the answer), so the next plan sees it as it
would one step later; what only an answer brings (finishes, step times) reaches the plan after
next. A policy not `overlap_safe` is driven one step at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from kvstore.accounting import KVCacheManager
from scheduler_service.core.metrics import MetricsRecorder
from scheduler_service.core.policy import Policy
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.step_outputs import StepOutputs
from sluice.contract.plan import StepPlan, StepResult


class OverlapHost(Protocol):
    """What the overlap bookkeeping needs of the Scheduler (named here, so this module does
    not import the scheduler that imports it)."""

    worker_id: int
    kv: KVCacheManager
    policy: Policy
    config: Any  # SchedulerConfig (its max_model_len), defined beside the Scheduler
    metrics: MetricsRecorder
    requests: dict[str, Request]
    running: dict[str, Request]
    pending_tokens: dict[str, int]

    def computed_on_worker(self, req: Request) -> int: ...
    def cache_computed_blocks(self, req: Request, computed: int) -> None: ...
    def stop_status(self, req: Request, token: int, n: int) -> RequestStatus | None: ...
    def end(self, req: Request, status: RequestStatus, now: float, message: str = "") -> None: ...
    def pop_finished(self) -> list[Request]: ...


@dataclass(slots=True)
class InFlight:
    """A plan sent to the worker and not answered yet; `voided`: requests whose results
    from it are not to be applied (they ended or restart from scratch meanwhile)."""

    plan: StepPlan
    voided: set[str] = field(default_factory=set)


def commit_plan(sched: OverlapHost, plan: StepPlan, now: float) -> None:
    """The plan's step counts as done for the next plan: tokens computed, placeholders for
    the tokens it samples (resolved by `resolve_step`)."""
    running, pending, metrics = sched.running, sched.pending_tokens, sched.metrics
    decoding = RequestStatus.DECODING
    sample_ids = plan.sample_ids
    for rid, n in plan.num_scheduled_tokens.items():
        req = running[rid]
        req.num_computed_tokens += n
        if req.status is not decoding:
            metrics.prefill_tokens += n
            if req.num_computed_tokens >= req.prefill_len:
                req.status = decoding
        if rid in sample_ids:
            req.num_output_tokens += 1
            pending[rid] = pending.get(rid, 0) + 1
    sched.policy.on_step_committed(plan, now)


def resolve_step(sched: OverlapHost, entry: InFlight, result: StepResult, now: float) -> StepOutputs | None:
    """Applies the answer to a committed plan: tokens in place of its placeholders, stops
    checked on them. None when the worker left out a token it owed (the caller resets it)."""
    plan, voided = entry.plan, entry.voided
    requests, pending = sched.requests, sched.pending_tokens
    sampled = result.sampled_token_ids
    if len(sampled) < len(plan.sample_ids) and _missing_token(plan, voided, requests, sampled):
        return None
    tokens: list[tuple[Request, int]] = []
    max_model_len = sched.config.max_model_len
    caching = sched.kv.prefix_caching
    for rid in plan.num_scheduled_tokens:
        if rid in voided:
            continue
        req = requests.get(rid)
        if req is None:
            continue
        # NOTE: tokens in flight only lower the count, so a request whose next block is not due
        # even counting them has nothing to register (most steps: a block fills every 16 tokens).
        if caching and req.num_computed_tokens >= req.cache_due and req.status.is_running:
            sched.cache_computed_blocks(req, sched.computed_on_worker(req))
        token = sampled.get(rid)
        if token is None or rid not in plan.sample_ids:
            continue
        left = pending[rid] - 1
        if left:
            pending[rid] = left
        else:
            del pending[rid]
        req.output_token_ids.append(token)
        req.token_times.append(now)
        if req.first_token_time is None:
            req.first_token_time = now
        tokens.append((req, token))
        out = len(req.output_token_ids)  # real tokens: the placeholders of later steps do not count
        if (
            out >= req.max_tokens
            or req.num_prompt_tokens + out >= max_model_len
            or token in req.eos_token_ids
            or token in req.sampling.stop_token_ids
        ):
            stop = sched.stop_status(req, token, out)
            if stop is not None:
                sched.end(req, stop, now)
    if plan.num_scheduled_tokens:
        sched.metrics.on_step(sched.worker_id, plan, result, now, sched.kv)
    sched.policy.on_step_result(plan, result, now)
    return StepOutputs(tokens, sched.pop_finished())


def _missing_token(plan: StepPlan, voided: set[str], requests: dict[str, Request], sampled: object) -> bool:
    return any(rid not in sampled and rid not in voided and rid in requests for rid in plan.sample_ids)  # type: ignore[operator]
