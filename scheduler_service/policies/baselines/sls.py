"""`sls`: sequence-level (static) batching (the SCLS paper's baseline; Sarathi-Serve
Algorithm 1, request-level batching).

Why choose it: the pre-continuous-batching baseline (FasterTransformer-style engines).
What it does: takes a batch of up to `batch_size` requests FCFS (max allocation: each
reserves prompt + max_tokens), prefills them together padded to the batch's longest
prompt, then decodes until EVERY member finishes. Members that finish early keep
"generating" padding until the batch ends: those invalid tokens, and the prompt padding,
are counted (plan metadata `pad_tokens`, `invalid_tokens`) and priced by the simulator
(`padded_len`, `invalid_context_sum`), as the paper's engines compute them.
Across workers, pair it with the round-robin router.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_service.core.policy import POLICIES, Policy, PolicyConfig, PolicyContext
from scheduler_service.core.request import Request
from scheduler_service.core.step_builder import StepBuilder


@dataclass
class SLSConfig(PolicyConfig):
    allocation: str = "max"
    batch_size: int = 8


@dataclass
class _Batch:
    members: list[Request] = field(default_factory=list)
    padded_len: int = 0  # longest prompt of the batch
    iteration: int = 0


@POLICIES.register("sls")
class SLSPolicy(Policy):
    name = "sls"
    config_cls = SLSConfig
    config: SLSConfig
    # Its batch is made and advanced in `schedule` only (no hook reads step results); members
    # that finish at step N decode once more in N+1 (voided) before the next batch starts.
    overlap_safe = True

    def __init__(self, config: PolicyConfig, ctx: PolicyContext) -> None:
        super().__init__(config, ctx)
        self.batch = _Batch()

    def token_budget(self, now: float) -> int:
        return self.config.batch_size * self.ctx.max_model_len

    def schedule(self, step: StepBuilder, now: float) -> None:
        live = [r for r in self.batch.members if r.status.is_running]
        if live:
            self._decode(step, live)
        elif step.waiting:
            self._start_batch(step)

    def _start_batch(self, step: StepBuilder) -> None:
        members = []
        for req in list(step.waiting.values()):
            if len(members) >= self.config.batch_size or not step.schedule(req, req.num_tokens_to_compute):
                break
            members.append(req)
        if not members:
            return
        padded = max(r.num_tokens for r in members)
        self.batch = _Batch(members, padded, 0)
        step.metadata.update(padded_len=padded, pad_tokens=sum(padded - r.num_tokens for r in members))

    def _decode(self, step: StepBuilder, live: list[Request]) -> None:
        batch = self.batch
        batch.iteration += 1
        for req in live:
            step.schedule(req, req.num_tokens_to_compute)
        step.metadata["padded_context"] = batch.padded_len + batch.iteration  # live rows decode padded too
        invalid = len(batch.members) - len(live)
        if invalid:
            # Finished members still occupy their row, at the padded context length.
            step.metadata.update(
                invalid_tokens=invalid, invalid_context_sum=invalid * (batch.padded_len + batch.iteration)
            )
