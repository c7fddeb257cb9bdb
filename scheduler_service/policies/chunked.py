"""`vllm_chunked` and `sarathi`: stall-free batching with chunked prefills.

Why choose them: decodes are never paused for a prefill, so time between tokens stays
bounded while prompts still flow in (Sarathi-Serve, OSDI'24, Algorithm 3, section 4.3).
What they do, each iteration, under a token budget tau: (1) every running decode gets
its token; (2) every partially prefilled request gets its next chunk,
min(remaining prompt, tau - tokens so far); (3) new requests FCFS while their whole
prompt can get blocks, each with a chunk sized to the leftover budget. KV pressure
preempts the newest running request, as in vLLM.
`vllm_chunked` uses a fixed budget (vLLM's chunked-prefill mode). `sarathi` derives tau
once from a TBT SLO: the largest forward size whose predicted iteration time (cost
model) is within the SLO, rounded down to a multiple of the tile size (default 128; the
paper's settings are 512 strict and 2048 relaxed).
Configuration: budget, tbt_slo_s, tile, watermark, preemption_mode, priority.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from scheduler_service.core.policy import POLICIES, Policy, PolicyConfig, PolicyContext
from scheduler_service.core.request import Request
from scheduler_service.core.step_builder import StepBuilder
from scheduler_service.costmodel.base import CostModel
from scheduler_service.policies.common import (
    ContinuousBatchingConfig,
    admission_fits,
    preempt_for_priority,
    preemption_mode,
    schedule_with_preemption,
    swap_in_fcfs,
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
    config_cls = ChunkedConfig
    config: ChunkedConfig

    def __init__(self, config: PolicyConfig, ctx: PolicyContext) -> None:
        super().__init__(config, ctx)
        self.budget = self._resolve_budget()

    def _resolve_budget(self) -> int:
        return self.config.budget or self.ctx.max_num_batched_tokens

    def token_budget(self, now: float) -> int:
        return self.budget

    def schedule(self, step: StepBuilder, now: float) -> None:
        mode = preemption_mode(self.config)
        running = victim_order(list(step.running.values()), self.config.priority)
        # Decodes first, then ongoing prefills; victims come off the right end (newest prefills).
        queue = deque([r for r in running if not r.is_prefill] + [r for r in running if r.is_prefill])
        while (req := step.schedule_covered(queue, chunk_to_budget=True)) is not None:
            n = min(req.num_tokens_to_compute, step.budget.remaining_tokens)
            if n > 0:
                schedule_with_preemption(step, req, n, queue, mode)
        if not step.num_preempted:
            swap_in_fcfs(step, self.ctx.max_num_seqs)
        if not step.swapped:
            self._admit_new(step)

    def _admit_new(self, step: StepBuilder) -> None:
        mode = preemption_mode(self.config)
        for req in waiting_order(step, self.config.priority):
            left = step.budget.remaining_tokens
            if left <= 0 or len(step.running) >= self.ctx.max_num_seqs:
                break
            cover = self._cover(req)
            fits = admission_fits(step, req, cover, self.config.watermark)
            if not fits and self.config.priority:
                fits = preempt_for_priority(step, req, cover, mode)
            if not fits or not step.schedule(req, min(req.num_tokens_to_compute, left), cover=cover):
                break

    def _cover(self, req: Request) -> int:
        return req.num_tokens if self.config.allocate_whole_prompt else 0


@dataclass
class SarathiConfig(ChunkedConfig):
    budget: int | None = None  # fixed tau; None derives it from tbt_slo_s
    tbt_slo_s: float | None = None  # None: the workload's TBT SLO (context extras), else tau = 512
    tile: int = 128  # tau is rounded down to a multiple of this


def budget_from_tbt_slo(cost_model: CostModel, tbt_slo_s: float, tile: int, max_tokens: int = 16384) -> int:
    """Largest multiple of `tile` whose prefill iteration time fits in the TBT SLO
    (at least one tile, so progress is always possible)."""
    best = tile
    size = tile
    while size <= max_tokens and cost_model.prefill_time(size) <= tbt_slo_s:
        best = size
        size += tile
    return best


@POLICIES.register("sarathi")
class SarathiPolicy(ChunkedPrefillPolicy):
    name = "sarathi"
    config_cls = SarathiConfig
    config: SarathiConfig

    def _resolve_budget(self) -> int:
        if self.config.budget:
            return self.config.budget
        slo = self.config.tbt_slo_s or self.ctx.extras.get("tbt_slo_s")
        if slo is None or self.ctx.cost_model is None:
            return 512  # the paper's strict-SLO budget
        return budget_from_tbt_slo(self.ctx.cost_model, float(slo), self.config.tile)
