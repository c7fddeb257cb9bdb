"""Moves the continuous-batching baselines share: KV-pressure preemption of the newest
request (vLLM), priority preemption, swap-in of swapped requests, FCFS admission.

vLLM's rule, which every baseline here follows: when a running request needs a block and
none is free, preempt the most recently admitted running request (recompute by default,
swap as an option) and put it at the head of the waiting queue; if the request itself is
the newest, it is the one preempted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from scheduler_service.core.policy import PolicyConfig
from scheduler_service.core.preemption import PreemptionMode, PreemptionReason
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.step_builder import StepBuilder
from scheduler_service.costmodel.base import CostModel
from scheduler_service.policies.decisions import priority_key, priority_victim_key


@dataclass
class ContinuousBatchingConfig(PolicyConfig):
    watermark: float = 0.01  # share of GPU blocks kept free at admission (vLLM)
    priority: bool = False  # order waiting by (priority, arrival) and preempt for priority


_MODES = {mode.value: mode for mode in PreemptionMode}


def preemption_mode(config: PolicyConfig) -> PreemptionMode:
    # NOTE: asked twice a step by every baseline; a dict lookup, where the enum's call costs a
    # few microseconds (an unknown mode still fails there, naming the value).
    mode = _MODES.get(config.preemption_mode)
    return mode if mode is not None else PreemptionMode(config.preemption_mode)


def waiting_order(step: StepBuilder, by_priority: bool) -> Iterator[Request]:
    """FCFS (preempted requests already sit at the head), or by (priority, arrival)."""
    if not by_priority:
        return _fcfs(step.waiting)
    return iter(sorted(step.waiting.values(), key=lambda r: priority_key(r.priority, r.arrival_time)))


def _fcfs(waiting: dict[str, Request]) -> Iterator[Request]:
    """Yields the queue's head while the caller keeps taking it: O(admitted), not O(queue),
    since FCFS admission stops at the first request that does not fit."""
    while waiting:
        head = next(iter(waiting.values()))
        yield head
        if waiting and next(iter(waiting.values())) is head:
            return


def victim_order(running: list[Request], by_priority: bool) -> list[Request]:
    """Running requests, the first to preempt LAST (so `pop()` yields the next victim)."""
    if not by_priority:
        return running
    return sorted(running, key=lambda r: priority_victim_key(r.priority, r.arrival_time), reverse=True)


def schedule_with_preemption(
    step: StepBuilder,
    request: Request,
    num_tokens: int,
    victims: deque[Request],
    mode: PreemptionMode,
) -> bool:
    """Schedules `request`, preempting victims from the right end of `victims` while its
    KV does not fit. False when the budget is spent or the request itself had to be preempted."""
    while not step.schedule(request, num_tokens):
        if not step.budget.can_fit(num_tokens):
            return False
        victim = victims.pop() if victims else request
        step.preempt(victim, mode, PreemptionReason.KV_PRESSURE)
        if victim is request:
            return False
    return True


def never_fits(step: StepBuilder, request: Request, watermark: float) -> bool:
    """vLLM's AllocStatus.NEVER: the whole prompt needs more blocks than the pool holds less its
    watermark, so no amount of waiting makes room. Such a request is rejected, not left at the
    head of an FCFS queue, where it would block every request behind it for good."""
    kv = step.kv
    return kv.num_blocks_for(request.num_tokens) > kv.gpu.num_blocks - int(watermark * kv.gpu.num_blocks)


def admission_fits(step: StepBuilder, request: Request, cover_tokens: int, watermark: float) -> bool:
    """The request's blocks for `cover_tokens` fit and leave the watermark free."""
    kv = step.kv
    need = step.num_new_blocks(request, cover_tokens)
    return kv.gpu.num_available() - need >= int(watermark * kv.gpu.num_blocks)


def swap_in_fcfs(step: StepBuilder, max_running: int) -> int:
    """Brings swapped requests back in swap-out order while blocks and seats allow;
    each also decodes this step (its blocks must cover one more token)."""
    n = 0
    for req in list(step.swapped.values()):
        if len(step.running) >= max_running or not step.budget.can_fit(1):
            break
        need = step.kv.num_blocks_for(req.num_computed_tokens + 1)
        if need > step.kv.gpu.num_available() or not step.swap_in(req):
            break
        if not step.schedule(req, req.num_tokens_to_compute if req.is_prefill else 1):
            break
        n += 1
    return n


def preempt_for_priority(step: StepBuilder, request: Request, cover_tokens: int, mode: PreemptionMode) -> bool:
    """Frees room for a waiting request by preempting running requests of strictly lower
    priority (larger value), lowest first; vLLM preempts only under KV pressure, which is
    why users find its priorities ignored."""
    candidates = sorted(
        (r for r in step.running.values() if r.priority > request.priority),
        key=lambda r: (r.priority, -r.arrival_time),
    )
    while not step.can_allocate(request, 0, cover=cover_tokens) and candidates:
        victim = candidates.pop()
        step.preempt(victim, mode, PreemptionReason.PRIORITY)
    return step.can_allocate(request, 0, cover=cover_tokens)


def time_limited_chunk(step: StepBuilder, cost_model: CostModel, limit_s: float, request: Request, tokens: int) -> int:
    """At most `tokens` of the request's prefill, cut so that the step's predicted time (the
    cost model on the step's shape so far plus this chunk over its prefix, a prefix hit
    included) stays within `limit_s`; a binary search over the chunk size. Never 0 for the
    step's first chunk, so a prompt always progresses (at least a block's worth)."""
    if tokens <= 0:
        return tokens
    shape = step.batch_shape()
    prefix = request.num_computed_tokens or len(step.prefix_hit(request)) * step.kv.block_size
    floor = 0 if shape.prefill_chunks else min(tokens, step.kv.block_size)
    chunks = shape.prefill_chunks

    def fits(n: int) -> bool:
        chunks.append((n, prefix))
        ok = cost_model.iteration_time(shape) <= limit_s
        chunks.pop()
        return ok

    if fits(tokens):
        return tokens
    if floor == 0 and (tokens == 1 or not fits(1)):
        # NOTE: the search below finds the largest chunk that fits, as step time grows with the
        # chunk; when one token does not fit, that is none (a step's later prefills, every step)
        return 0
    low, high = 0, tokens  # fits(low) (or low == 0), not fits(high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return max(low, floor)


def reject_unservable(step: StepBuilder, request: Request, why: str) -> None:
    step.finish(request, RequestStatus.FINISHED_REJECTED, why)
