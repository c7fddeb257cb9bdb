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

Long contexts (ours, every option off by default; `sls_batching.py` has the rules):
`group_window` forms each batch around the oldest request from the requests closest to it
in prompt and predicted output length among the oldest `group_window`; `max_pad_share`
keeps a request out of a batch whose padded prefill would cost more than (1 + share) x
its rows' own prefill; `varlen_attention` is an engine that runs variable-length attention
(no pad rows: each row prefills and decodes at its own length; finished rows still run
until the batch ends, at their own context; the pad bound then has nothing to bound and
grouping looks at the predicted output length only). Long-context runs set them.
Options: `sls:batch_size=8,group_window=0,max_pad_share=0,varlen_attention=false`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from scheduler_service.core.policy import POLICIES, Policy, PolicyConfig, PolicyContext
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.step_builder import StepBuilder
from scheduler_service.policies.baselines.sls_batching import grouped_candidates, within_pad_bound

_DECODING, _PREFILLING = RequestStatus.DECODING, RequestStatus.PREFILLING


@dataclass
class SLSConfig(PolicyConfig):
    allocation: str = "max"
    batch_size: int = 8
    group_window: int = 0  # ours: batch the closest of the oldest N by prompt and output length; 0: FCFS
    max_pad_share: float = 0.0  # ours: bound on padded / own prefill cost - 1; 0: no bound (padded rows only)
    varlen_attention: bool = False  # ours: no pad rows (the engine runs variable-length attention)


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
        # NOTE: `status.is_running`, inlined (every member, every step)
        live = [r for r in self.batch.members if (s := r.status) is _DECODING or s is _PREFILLING]
        if live:
            self._decode(step, live)
        elif step.waiting:
            self._start_batch(step)

    def _start_batch(self, step: StepBuilder) -> None:
        cfg = self.config
        fcfs = cfg.group_window <= 0
        # Rows that are not padded cost their own length wherever they go: no pad bound.
        pad_share = 0.0 if cfg.varlen_attention else cfg.max_pad_share
        members: list[Request] = []
        for req in grouped_candidates(
            list(step.waiting.values()), cfg.group_window, by_prompt=not cfg.varlen_attention
        ):
            if len(members) >= cfg.batch_size:
                break
            if members and not within_pad_bound(
                [r.num_tokens for r in (*members, req)], pad_share, self.ctx.cost_model
            ):
                if fcfs:
                    break  # FCFS: this request heads the next batch
                continue
            if not step.schedule(req, req.num_tokens_to_compute):
                break
            members.append(req)
        if not members:
            return
        padded = max(r.num_tokens for r in members)
        self.batch = _Batch(members, padded, 0)
        if cfg.varlen_attention:
            return  # every row prefills at its own length: no pad
        step.metadata.update(padded_len=padded, pad_tokens=sum(padded - r.num_tokens for r in members))

    def _decode(self, step: StepBuilder, live: list[Request]) -> None:
        batch = self.batch
        batch.iteration += 1
        # NOTE: every live member in turn, as `schedule` would take it; those whose reserved
        # blocks cover the step (all but a member's first decode) in one call
        queue = deque(live)
        while (req := step.schedule_covered(queue)) is not None:
            step.schedule(req, req.num_tokens_to_compute)
        done = [r for r in batch.members if (s := r.status) is not _DECODING and s is not _PREFILLING]
        if self.config.varlen_attention:
            if done:
                # Finished rows still run in the static batch, each at its own context.
                step.metadata.update(
                    invalid_tokens=len(done),
                    invalid_context_sum=sum(r.num_prompt_tokens + batch.iteration for r in done),
                )
            return
        step.metadata["padded_context"] = batch.padded_len + batch.iteration  # live rows decode padded too
        if done:
            # Finished members still occupy their row, at the padded context length.
            step.metadata.update(
                invalid_tokens=len(done), invalid_context_sum=len(done) * (batch.padded_len + batch.iteration)
            )
