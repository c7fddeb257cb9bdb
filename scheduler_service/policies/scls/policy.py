"""`scls`: slice-level scheduling, the worker side (SCLS, seed 002, sections 4.1 and 7).

Why choose it: static-batching engines (no continuous batching) serving mixed lengths on
many workers; slices bound each batch's serving time and memory, so batches can be
large, padding small and workers balanced. Pair it with the `scls` router (the adaptive
batcher, max-min offloader and adaptive pool interval, `policies/scls/router.py`).

What it does (static, the paper's main design): the worker serves one batch at a time
for at most S iterations (the prefill yields the first token, then S-1 decodes), every
row padded to the batch's longest input. Rows whose request finished keep producing
invalid tokens until the slice ends, unless all rows finish first (an early return).
When the slice ends, unfinished requests go back to the router's pool with their
generated tokens (`step.return_to_pool`: KV freed, the next slice re-prefills prompt +
generated) and are batched again with new arrivals. The padding is priced by the
simulator through the plan metadata (`padded_len`, `padded_context`, `pad_tokens`,
`invalid_tokens`, `invalid_context_sum`), as `sls` does: live rows decode at the padded context.

Which requests form a batch: the `scls` router stamps each request it places with a
`SliceTag` (batch id, slice length) in `request.policy_state`; requests sharing a batch
id are started together, batches in the order they arrived (the worker's local queue).
Untagged requests (any other router, e.g. round robin for the SO ablation) are batched
by the worker itself: FCFS, `batch_size` rows, as far as their KV fits.

Continuous variant (`keep_kv=true`, section 7): no padding and no static batch; requests
join and leave at iteration level, each reserving KV for its next S tokens only; when a
request's slice ends and others are waiting, its KV is swapped to CPU instead of freed
(no prefill recompute) and it is swapped back in, FCFS, ahead of new arrivals.

Variable-length attention (`varlen_attention=true`, ours, off by default): the engine runs
variable-length attention, so a static batch has no pad rows: each row prefills only its
own tokens (a slice's re-prefill also skips what the prefix cache still holds of the
request) and decodes at its own context; finished rows still run until the slice ends, at
their own context. Long-context runs set it, with the router's option of the same name.

Inputs: prompt and generated lengths; no output-length prediction (slices make it moot).
Configuration: slice_len (S, 128; the router's tag overrides it), batch_size (16, rows of
a worker-formed batch), keep_kv (false), varlen_attention (false).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from itertools import islice

from scheduler_service.core.policy import POLICIES, Policy, PolicyConfig, PolicyContext
from scheduler_service.core.preemption import PreemptionMode, PreemptionReason
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.step_builder import StepBuilder
from scheduler_service.policies.scls.batcher import SliceTag, slice_tag

_DECODING, _PREFILLING = RequestStatus.DECODING, RequestStatus.PREFILLING


@dataclass
class SCLSConfig(PolicyConfig):
    slice_len: int = 128  # S: iterations per slice when the router's tag does not say
    batch_size: int = 16  # rows of a batch the worker forms itself (untagged requests, SO)
    keep_kv: bool = False  # continuous batching; swap KV at slice end instead of returning
    varlen_attention: bool = False  # ours: no pad rows (the engine runs variable-length attention)


@dataclass
class SCLSStats:
    """What the paper reports about slices (Figures 13, 14, 16): read by benchmarks."""

    num_batches: int = 0
    rows: int = 0  # sum of batch sizes
    early_returns: int = 0
    returned: int = 0  # requests handed back to the pool at a slice end
    swapped: int = 0  # keep_kv: requests swapped out at a slice end
    reprefill_tokens: int = 0  # tokens prefilled again at the start of a request's later slices
    pad_tokens: int = 0  # padding rows' tokens of the batches' prefills
    slices_per_request: Counter[int] = field(default_factory=Counter)


@dataclass
class _Slice:
    members: list[Request]
    padded_len: int
    slice_len: int
    iteration: int = 1  # tokens each row has produced in this slice (the prefill made one)
    start_len: dict[str, int] = field(default_factory=dict)  # each row's tokens when the slice began


@POLICIES.register("scls")
class SCLSPolicy(Policy):
    name = "scls"
    config_cls = SCLSConfig
    # NOTE: a slice ends (its members back to the pool) only after its last step's answer;
    # rows that finish at step N decode once more in N+1 (voided), as finished rows do anyway.
    overlap_safe = True
    config: SCLSConfig

    def __init__(self, config: PolicyConfig, ctx: PolicyContext) -> None:
        super().__init__(config, ctx)
        if self.config.slice_len < 1 or self.config.batch_size < 1:
            raise ValueError("scls needs slice_len >= 1 and batch_size >= 1")
        self.slice: _Slice | None = None
        self.batches: OrderedDict[int, list[Request]] = OrderedDict()  # tagged batches not started yet
        self.stats = SCLSStats()

    def token_budget(self, now: float) -> int:
        if self.config.keep_kv:
            return self.ctx.max_num_batched_tokens
        # NOTE: a static batch prefills all its padded rows in one iteration.
        return self.ctx.max_num_seqs * self.ctx.max_model_len

    def stats_report(self) -> dict[str, object]:
        st = self.stats
        return {
            "slices": st.num_batches,  # one static batch serves one slice
            "rows": st.rows,
            "early_returns": st.early_returns,
            "returned_to_pool": st.returned,
            "swapped_at_slice_end": st.swapped,
            "reprefill_tokens": st.reprefill_tokens,
            "pad_tokens": st.pad_tokens,
            "finished_after_slices": {str(k): v for k, v in sorted(st.slices_per_request.items())},
        }

    # ------------------------------------------------------------------ hooks
    def on_arrival(self, request: Request, now: float) -> None:
        tag = slice_tag(request.policy_state)
        request.policy_state = tag
        if tag.batch_id is not None and not self.config.keep_kv:
            self.batches.setdefault(tag.batch_id, []).append(request)

    def on_finished(self, request: Request, now: float) -> None:
        tag = slice_tag(request.policy_state)
        group = self.batches.get(tag.batch_id) if tag.batch_id is not None else None
        if group is not None and request in group:  # left before its batch started (abort)
            group.remove(request)
        if request.status.is_finished:
            self.stats.slices_per_request[tag.num_slices] += 1

    # ------------------------------------------------------------------ schedule
    def schedule(self, step: StepBuilder, now: float) -> None:
        if self.config.keep_kv:
            self._schedule_continuous(step)
            return
        current = self.slice
        if current is not None:
            # NOTE: `status.is_running`, inlined (every member, every step)
            live = [r for r in current.members if (s := r.status) is _DECODING or s is _PREFILLING]
            if live and current.iteration < current.slice_len:
                self._decode(step, current, live)
                return
            if any(step.in_flight(r) for r in live):
                # NOTE: planned ahead, the slice's last step is still running: its members go
                # back to the pool once its tokens are in (returned now, they would lose them
                # to a recompute), so this plan is empty, as one step at a time would wait.
                return
            self._end_slice(step, current, live)
        self._start_batch(step)

    def _end_slice(self, step: StepBuilder, current: _Slice, live: list[Request]) -> None:
        self.slice = None
        if not live:
            self.stats.early_returns += current.iteration < current.slice_len
            return
        for req in live:
            step.return_to_pool(req)
        self.stats.returned += len(live)

    def _decode(self, step: StepBuilder, current: _Slice, live: list[Request]) -> None:
        current.iteration += 1
        # NOTE: every live member in turn, as `schedule` would take it; those whose slice
        # reservation covers the step (all of them, but for a lost reservation) in one call
        queue = deque(live)
        while (req := step.schedule_covered(queue)) is not None:
            if not step.schedule(req, req.num_tokens_to_compute):
                step.return_to_pool(req)  # its slice reservation was lost: the pool takes it back
        invalid = len(current.members) - len(live)
        if self.config.varlen_attention:
            if invalid:
                # Finished rows still run, producing invalid tokens, each at its own context.
                done = [r for r in current.members if not r.status.is_running]
                context_sum = sum(current.start_len[r.request_id] + current.iteration - 1 for r in done)
                step.metadata.update(invalid_tokens=invalid, invalid_context_sum=context_sum)
            return
        # Every row of a static batch, live or finished, decodes at the padded context
        # (the prefill made token 1 at padded_len + 1).
        context = current.padded_len + current.iteration - 1
        step.metadata["padded_context"] = context
        if invalid:
            # Finished rows still run, producing invalid tokens.
            step.metadata.update(invalid_tokens=invalid, invalid_context_sum=invalid * context)

    def _start_batch(self, step: StepBuilder) -> None:
        candidates, slice_len, batch_id = self._next_candidates(step)
        if not candidates:
            return
        members = []
        for req in candidates:
            if not step.schedule(req, req.num_tokens_to_compute, cover=_slice_cover(req, slice_len)):
                break
            members.append(req)
        rest = candidates[len(members) :]
        if rest and batch_id is not None:  # NOTE: never expected (the router checked memory); keep them queued
            self.batches[batch_id] = rest
            self.batches.move_to_end(batch_id, last=False)
        if not members:
            return
        padded = max(r.num_tokens for r in members)
        varlen = self.config.varlen_attention
        pad = 0
        for req in members:
            tag = slice_tag(req.policy_state)
            if tag.num_slices:  # a later slice: its prompt and generated tokens are prefilled again
                self.stats.reprefill_tokens += req.num_tokens_to_compute
            tag.num_slices += 1
            if not varlen:
                tag.pad_tokens += padded - req.num_tokens
                pad += padded - req.num_tokens
        self.slice = _Slice(members, padded, slice_len, start_len={r.request_id: r.num_tokens for r in members})
        self.stats.num_batches += 1
        self.stats.rows += len(members)
        self.stats.pad_tokens += pad
        if not varlen:  # variable-length attention: every row prefills at its own length
            step.metadata.update(padded_len=padded, pad_tokens=pad)

    def _next_candidates(self, step: StepBuilder) -> tuple[list[Request], int, int | None]:
        """The oldest tagged batch still waiting, else up to batch_size untagged requests FCFS."""
        while self.batches:
            batch_id, group = self.batches.popitem(last=False)
            group = [r for r in group if r.request_id in step.waiting]
            if group:
                tag = slice_tag(group[0].policy_state)
                return group, tag.slice_len or self.config.slice_len, batch_id
        head = list(islice(step.waiting.values(), self.config.batch_size))
        return head, self.config.slice_len, None

    # ------------------------------------------------------------------ keep_kv
    def _schedule_continuous(self, step: StepBuilder) -> None:
        slice_len = self.config.slice_len
        pressure = bool(step.waiting or step.swapped)
        swapped_now: set[str] = set()
        for req in list(step.running.values()):
            if self._slice_over(req) and pressure:
                step.preempt(req, PreemptionMode.SWAP, PreemptionReason.SLICE_END, to_front=False)
                swapped_now.add(req.request_id)
                self.stats.swapped += 1
                continue
            if self._slice_over(req):
                self._begin_slice(req, slice_len)
            if not step.schedule(req, req.num_tokens_to_compute, cover=self._cover(req)):
                step.preempt(req, PreemptionMode.SWAP, PreemptionReason.KV_PRESSURE, to_front=False)
                swapped_now.add(req.request_id)
        self._swap_in(step, swapped_now, slice_len)
        self._admit(step, slice_len)

    def _swap_in(self, step: StepBuilder, skip: set[str], slice_len: int) -> None:
        for req in list(step.swapped.values()):
            if req.request_id in skip:
                continue
            if len(step.running) >= self.ctx.max_num_seqs or not step.budget.can_fit(1):
                return
            end = _slice_cover(req, slice_len)
            if step.kv.num_blocks_for(end) > step.kv.gpu.num_available() or not step.swap_in(req):
                return
            self._begin_slice(req, slice_len)
            if not step.schedule(req, req.num_tokens_to_compute, cover=self._cover(req)):
                step.preempt(req, PreemptionMode.SWAP, PreemptionReason.KV_PRESSURE, to_front=False)
                return

    def _admit(self, step: StepBuilder, slice_len: int) -> None:
        for req in list(islice(step.waiting.values(), self.ctx.max_num_seqs)):
            if len(step.running) >= self.ctx.max_num_seqs:
                return
            if not step.schedule(req, req.num_tokens_to_compute, cover=_slice_cover(req, slice_len)):
                return
            self._begin_slice(req, slice_len)

    def _begin_slice(self, req: Request, slice_len: int) -> None:
        tag = slice_tag(req.policy_state)
        tag.slice_end = _slice_cover(req, slice_len)
        tag.num_slices += 1
        req.policy_state = tag

    @staticmethod
    def _slice_over(req: Request) -> bool:
        return req.num_tokens >= slice_tag(req.policy_state).slice_end

    @staticmethod
    def _cover(req: Request) -> int:
        return slice_tag(req.policy_state).slice_end


def _slice_cover(req: Request, slice_len: int) -> int:
    """Tokens a request's KV must hold through a slice starting now (never past its limit)."""
    return min(req.num_tokens + slice_len, req.num_prompt_tokens + req.max_tokens)


__all__ = ["SCLSConfig", "SCLSPolicy", "SCLSStats", "SliceTag"]
