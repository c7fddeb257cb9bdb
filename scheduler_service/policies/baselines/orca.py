"""`orca`: iteration-level scheduling with max allocation (Orca, OSDI'22, as the seed
papers configure it).

Why choose it: the first continuous-batching system; the reference point for the cost
of reserving the worst case. What it does: FCFS up to a fixed batch size (8 in the
papers, 16 for very large models); at admission a request reserves KV for prompt +
max_tokens, so it never needs preemption; whole prompts are prefilled in the same
iteration as the running decodes (a hybrid batch, no chunking).
Configuration: max_batch_size, allocation (max).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from scheduler_service.core.policy import POLICIES, Policy, PolicyConfig
from scheduler_service.core.step_builder import StepBuilder
from scheduler_service.policies.common import preemption_mode, schedule_with_preemption


@dataclass
class OrcaConfig(PolicyConfig):
    allocation: str = "max"
    max_batch_size: int = 8


@POLICIES.register("orca")
class OrcaPolicy(Policy):
    name = "orca"
    config_cls = OrcaConfig
    config: OrcaConfig
    # No state of its own: it reads the running and waiting requests, whose counts overlap
    # commits at plan time; a finish at step N frees a seat from N+2 on, as in vllm.
    overlap_safe = True

    def token_budget(self, now: float) -> int:
        # NOTE: Orca has no token budget; whole prompts of a full batch must always fit.
        return self.config.max_batch_size * self.ctx.max_model_len

    def schedule(self, step: StepBuilder, now: float) -> None:
        mode = preemption_mode(self.config)
        queue = deque(step.running.values())
        while (req := step.schedule_covered(queue)) is not None:
            schedule_with_preemption(step, req, req.num_tokens_to_compute, queue, mode)
        # NOTE: FCFS admission stops at the first request that does not fit, and each one
        # admitted leaves the queue: only the heads are looked at, never a copy of the queue.
        waiting, running, limit = step.waiting, step.running, self.config.max_batch_size
        while waiting and len(running) < limit:
            req = next(iter(waiting.values()))
            if not step.schedule(req, req.num_tokens_to_compute):
                break
