"""`vllm_chunked`: stall-free batching with chunked prefills (the machinery `sarathi` builds on).

Why choose them: decodes are never paused for a prefill, so time between tokens stays
bounded while prompts still flow in (Sarathi-Serve, OSDI'24, Algorithm 3, section 4.3).
What they do, each iteration, under a token budget tau: (1) every running decode gets
its token; (2) every partially prefilled request gets its next chunk,
min(remaining prompt, tau - tokens so far); (3) new requests FCFS while their whole
prompt can get blocks, each with a chunk sized to the leftover budget. KV pressure
preempts the newest running request, as in vLLM.
`vllm_chunked` uses a fixed budget (vLLM's chunked-prefill mode); `sarathi`
(policies/sarathi/) derives it from a TBT SLO and, by default, also prices every chunk in
time (`step_time_s`): a chunk is cut so that the step's predicted time (cost model: the
decodes, the chunks so far, and this chunk's attention over its prefix) stays within the
SLO. A token budget alone cannot: on llama-3.1-8b / H100 (analytic cost model) the tau that
fits a 0.367 s SLO over an empty prefix, 10,496 tokens, takes 2.6 s over a 100k-token prefix.
Configuration: budget, watermark, preemption_mode, priority.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from scheduler_service.core.policy import POLICIES, Policy, PolicyConfig, PolicyContext
from scheduler_service.core.request import Request
from scheduler_service.core.step_builder import StepBuilder
from scheduler_service.policies.common import (
    ContinuousBatchingConfig,
    admission_fits,
    never_fits,
    preempt_for_priority,
    preemption_mode,
    reject_unservable,
    schedule_with_preemption,
    swap_in_fcfs,
    time_limited_chunk,
    victim_order,
    waiting_order,
)


@dataclass
class ChunkedConfig(ContinuousBatchingConfig):
    budget: int | None = 2048  # tokens per iteration (tau)
    allocate_whole_prompt: bool = True  # blocks for the whole prompt at the first chunk (vLLM v0 / Sarathi)


@POLICIES.register("vllm_chunked")
class ChunkedPrefillPolicy(Policy):
    name = "vllm_chunked"
    overlap_safe = True  # no state between schedule and on_step_result
    config_cls = ChunkedConfig
    config: ChunkedConfig

    def __init__(self, config: PolicyConfig, ctx: PolicyContext) -> None:
        super().__init__(config, ctx)
        self.budget = self._resolve_budget()
        self.step_time_s = self._resolve_step_time()

    def _resolve_budget(self) -> int:
        return self.config.budget or self.ctx.max_num_batched_tokens

    def _resolve_step_time(self) -> float | None:
        """A step's time limit that chunks are priced against; None: tokens only."""
        return None

    def chunk_limit(self, step: StepBuilder, request: Request, tokens: int) -> int:
        """At most `tokens` of the request's prefill, priced in time against `step_time_s`."""
        cm, limit = self.ctx.cost_model, self.step_time_s
        if limit is None or cm is None:
            return tokens
        return time_limited_chunk(step, cm, limit, request, tokens)

    def token_budget(self, now: float) -> int:
        return self.budget

    def seat_limit(self) -> int:
        """Running sequences at most (FastGen caps them below the engine's max_num_seqs)."""
        return self.ctx.max_num_seqs

    def running_queue(self, step: StepBuilder) -> deque[Request]:
        """The running requests in the order they are served; victims come off the right end."""
        running = victim_order(list(step.running.values()), self.config.priority)
        # Decodes first, then ongoing prefills (the newest prefills are the first victims).
        # NOTE: one pass (Request.is_prefill's test written out), every step of every chunking policy.
        decodes: list[Request] = []
        prefills: list[Request] = []
        for r in running:
            (prefills if r.num_computed_tokens < r.prefill_len else decodes).append(r)
        decodes += prefills
        return deque(decodes)

    def admission_order(self, step: StepBuilder) -> Iterator[Request]:
        """The waiting requests in the order they are admitted (admission stops at the first that does not fit)."""
        return waiting_order(step, self.config.priority)

    def schedule(self, step: StepBuilder, now: float) -> None:
        mode = preemption_mode(self.config)
        queue = self.running_queue(step)
        limit = (lambda r: self.chunk_limit(step, r, r.num_tokens_to_compute)) if self.step_time_s else None
        while (req := step.schedule_covered(queue, chunk_to_budget=True, prefill_limit=limit)) is not None:
            n = min(req.num_tokens_to_compute, step.budget.remaining_tokens)
            if req.is_prefill:
                n = self.chunk_limit(step, req, n)
            if n > 0:
                schedule_with_preemption(step, req, n, queue, mode)
        # NOTE: most steps have nothing swapped and nothing waiting: no calls for them
        if step.swapped and not step.num_preempted:
            swap_in_fcfs(step, self.seat_limit())
        if step.waiting and not step.swapped:
            self._admit_new(step)

    def _admit_new(self, step: StepBuilder) -> None:
        mode = preemption_mode(self.config)
        for req in self.admission_order(step):
            left = step.budget.remaining_tokens
            if left <= 0 or len(step.running) >= self.seat_limit():
                break
            if never_fits(step, req, self.config.watermark):
                reject_unservable(step, req, "unschedulable: the prompt needs more KV than the worker has")
                continue
            cover = self._cover(req)
            fits = admission_fits(step, req, cover, self.config.watermark)
            if not fits and self.config.priority:
                fits = preempt_for_priority(step, req, cover, mode)
            n = self.chunk_limit(step, req, min(step.tokens_to_compute(req), left))
            if not fits or n <= 0 or not step.schedule(req, n, cover=cover):
                break

    def _cover(self, req: Request) -> int:
        return req.num_tokens if self.config.allocate_whole_prompt else 0
