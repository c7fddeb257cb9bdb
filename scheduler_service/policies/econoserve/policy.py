"""`econoserve`: decoupled PT/GT queues, time-synced GT groups, KV pipelining, ordering
(EconoServe, Shen and Sen, seed 001, section 3, Algorithm 1).

Why choose it: it keeps both resources full in every iteration, the GPU with prompt tokens
and the KV cache with exactly-allocated decoding tasks, and it avoids KV allocation failures
by allocating each GT its predicted output (plus padding) up front.

What it does, each iteration (variant `full`; D, SD, SDO drop components):
1. Decoupling (3.3.1). Prompts (PTs) wait in the PT queue, decoding tasks (GTs) in the GT
   queue. A PT gets KV for its prompt only; once prefilled it becomes a GT and waits, holding
   its prompt KV, until its group is started with prompt + predicted output x (1 + padding)
   (`AllocationMode.EXACT`). A `reserve` share of the blocks is kept for PTs and for
   under-predicted GTs (`BlockPool.set_reserve`); GT groups never take it.
2. Time-synced batching (3.3.2). Running GTs decode one token each. GTs with the same
   predicted remaining length (rounded up to `group_tokens`) form a group and start together,
   so they end together. When a group completes (or none runs), whole groups are taken from
   the GT queue until the free KV is allocated; the group that does not fit is split; a GT
   made meanwhile waits for that (without `sync`, variant D, groups are refilled every step).
   Then PTs are taken until the prompt tokens reach TFS: the head of the
   PT queue if it fits, else the PT whose length is closest to the remaining need (binary
   search on the length index), else a chunk of the head. PTs' prompt KV comes from the
   reserve only (`pt_reserve_only`): the prompts being prefilled hold at most the reserve
   (one prompt larger than the reserve may start alone). Ours (`pt_reserve_only=false`): a
   PT takes any free KV, as long as the free KV still covers `admit_future` x (its own
   predicted output and the demand of the queued GTs).
   Misprediction: a GT that filled its allocation first takes blocks from the reserve; when
   the reserve is spent it is stopped with its KV kept on the GPU (offload-free preemption,
   `PreemptionMode.KEEP`), given a new predicted remaining length (`regroup_factor` x its
   tokens so far) and queued again, where its occupied KV lifts its priority.
   Under- and over-provisioned KV is logged per request (`provisioning`, `stats()`).
3. KVCPipe (3.2): see `econoserve_pipe`.
4. Ordering (3.4): see `econoserve_queues` (deadline, occupied KV, length; each bucketed).

Inputs: predicted output lengths (any length source: oracle, noisy_oracle, max_tokens),
JCT SLOs (deadlines), the cost model (TFS = its pivot forward size).
Configuration: variant (D | SD | SDO | full), sync / order / pipe (override the variant),
tfs, padding, reserve, buffer, group_tokens, regroup_factor, deadline_bucket_s,
kv_bucket_tokens, length_bucket_tokens, pt_reserve_only, admit_future (ours).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from kvstore.accounting import KVCacheManager
from scheduler_service.core.policy import POLICIES, Policy, PolicyConfig, PolicyContext
from scheduler_service.core.preemption import PreemptionMode, PreemptionReason
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.step_builder import StepBuilder
from scheduler_service.costmodel.pivot import pivot_forward_size
from scheduler_service.policies.econoserve.pipe import KVPipe
from scheduler_service.policies.econoserve.queues import GTQueue, OrderingConfig, PTQueue, TaskState, ordering_key
from sluice.contract.plan import StepPlan

RESERVE = "econoserve"
VARIANTS = {
    "D": (False, False, False),
    "SD": (True, False, False),
    "SDO": (True, True, False),
    "full": (True, True, True),
}


@dataclass
class EconoServeConfig(PolicyConfig):
    allocation: str = "exact"  # EconoServe's exact allocation (kvstore.accounting)
    padding: float = 0.15  # share added to the predicted output (paper: 10% / 15% / 20%)
    variant: str = "full"  # D (decoupling) | SD (+ time-synced batching) | SDO (+ ordering) | full (+ KVCPipe)
    sync: bool | None = None  # time-synced batching and best-fit PT search; None: from variant
    order: bool | None = None  # three-key queue ordering; None: from variant
    pipe: bool | None = None  # KV pipelining; None: from variant
    tfs: int | None = None  # target forward size (prompt tokens per iteration); None: cost-model pivot
    reserve: float = 0.03  # share of GPU blocks kept for PTs and under-predicted GTs
    buffer: float = 0.15  # KVCPipe slack, share of the guest's predicted RL (paper: 10% BookCorpus)
    group_tokens: int = 16  # predicted remaining lengths are grouped in ranges of this many tokens
    regroup_factor: float = 0.5  # a mispredicted GT's new remaining length = this x its tokens so far
    deadline_bucket_s: float = 0.5  # ordering key 1: width of a deadline window
    kv_bucket_tokens: int = 128  # ordering key 2: width of an occupied-KV range
    length_bucket_tokens: int = 128  # ordering key 3: width of a predicted-RL / prompt-length range
    pt_reserve_only: bool = True  # PTs' prompt KV comes from the reserve only (3.3.1); off (ours): any free KV
    # ours, with pt_reserve_only off: the free KV must also cover this share of the predicted
    # output blocks (its own + queued GTs'); 0: the prompt only
    admit_future: float = 0.0


@POLICIES.register("econoserve")
class EconoServePolicy(Policy):
    name = "econoserve"
    # NOTE: a PT becomes a GT when its last prefill step is committed (`on_step_committed`);
    # a group that completes at step N is refilled from N+2 on, as any seat a finish frees.
    overlap_safe = True
    config_cls = EconoServeConfig
    config: EconoServeConfig

    def __init__(self, config: PolicyConfig, ctx: PolicyContext) -> None:
        super().__init__(config, ctx)
        cfg = self.config
        if cfg.variant not in VARIANTS:
            raise ValueError(f"econoserve variant must be one of {', '.join(VARIANTS)}, got {cfg.variant!r}")
        sync, order, pipe = VARIANTS[cfg.variant]
        self.sync = sync if cfg.sync is None else cfg.sync
        self.pipelining = pipe if cfg.pipe is None else cfg.pipe
        self.ordering = OrderingConfig(
            order if cfg.order is None else cfg.order,
            cfg.deadline_bucket_s,
            cfg.kv_bucket_tokens,
            cfg.length_bucket_tokens,
        )
        self.tfs = self._resolve_tfs()
        self.stats: Counter[str] = Counter()
        self.provisioning: dict[str, tuple[int, int]] = {}  # request id -> (over, under) tokens
        self.states: dict[str, TaskState] = {}
        self.ptq = PTQueue()
        self.gtq = GTQueue()
        self.active: dict[str, Request] = {}  # GTs decoding in the batch
        self.prefilling: dict[str, Request] = {}  # PTs admitted, prompt not done
        self.group_live: dict[int, int] = {}
        self.pipe = KVPipe(cfg.buffer, RESERVE, self.stats)
        self._pt_future_blocks = 0
        self._pt_blocks = 0  # prompt blocks of the PTs being prefilled (they live in the reserve)
        self._reserve_blocks = 0
        self._refill = True
        self._seq = 0
        self._next_group = 0
        self._kv: KVCacheManager | None = None  # the worker's KV, known from the first step on

    def _resolve_tfs(self) -> int:
        if self.config.tfs:
            return self.config.tfs
        if self.ctx.cost_model is None:
            return self.ctx.max_num_batched_tokens
        size, _ = pivot_forward_size(self.ctx.cost_model, max_tokens=self.ctx.max_num_batched_tokens)
        return size

    def token_budget(self, now: float) -> int:
        return self.tfs + self.ctx.max_num_seqs

    def stats_report(self) -> dict[str, object]:
        """Counters for reports: components' activity and the KV provisioning log."""
        over = [o for o, _ in self.provisioning.values()]
        under = [u for _, u in self.provisioning.values()]
        return {
            "tfs": self.tfs,
            **dict(self.stats),
            "requests_logged": len(self.provisioning),
            "requests_over_provisioned": sum(1 for o in over if o > 0),
            "requests_under_provisioned": sum(1 for u in under if u > 0),
            "over_provisioned_tokens": sum(over),
            "under_provisioned_tokens": sum(under),
        }

    # ------------------------------------------------------------------ one step
    def schedule(self, step: StepBuilder, now: float) -> None:
        if self._kv is None:
            self._kv = step.kv
            self._reserve_blocks = round(self.config.reserve * step.kv.gpu.num_blocks)
            step.kv.gpu.set_reserve(RESERVE, self._reserve_blocks)
        self.pipe.reclaim(step)
        for rid, req in list(self.active.items()):
            if rid in self.active:  # a host may have evicted this guest earlier in the loop
                self._decode(step, req)
        if not self.sync or self._refill or not self.active:
            self._refill = False
            if self.pipelining and len(self.gtq.resident):
                # NOTE: running GTs' unused tails first: a hosted GT takes no free KV at all.
                self.pipe.lend_all(step, list(self.active.values()), self.gtq, self._start_guest)
            hosts = self._start_groups(step)
            if self.pipelining and hosts:
                self.pipe.lend_all(step, hosts, self.gtq, self._start_guest)
        self._fill_prompts(step)
        if not step.scheduled and not self.active and not self.prefilling:
            self._unstick(step)

    def _decode(self, step: StepBuilder, req: Request) -> None:
        if not step.budget.can_fit(1):
            return
        kv = step.kv
        need = req.num_computed_tokens + 1
        if need > kv.capacity(req.request_id) and req.policy_state.guests:
            self.pipe.evict_guests(step, req, need)
        if need <= kv.capacity(req.request_id):
            step.schedule(req, 1, cover=need)
            return
        # Under-provisioned: the reserve first, then offload-free preemption.
        if step.schedule(req, 1, cover=need, reserve=RESERVE):
            self.stats["reserve_blocks_used"] += 1
            return
        self.stats["mispredicted_kept"] += 1
        step.preempt(req, PreemptionMode.KEEP, PreemptionReason.MISPREDICTION)

    # ------------------------------------------------------------------ GT groups
    def _seats(self, step: StepBuilder) -> bool:
        return step.budget.can_fit(1) and len(self.active) + len(self.prefilling) < self.ctx.max_num_seqs

    def _start_groups(self, step: StepBuilder) -> list[Request]:
        """Whole groups from the GT queue head until the free KV is allocated (split the last)."""
        started: list[Request] = []
        while len(self.gtq) and self._seats(step):
            head = self.gtq.order.first()
            assert head is not None
            members = self.gtq.group_members(head) if self.sync else [head]
            group = self._next_group
            self._next_group += 1
            taken = 0
            for rid in members:
                req = self._queued(step, rid)
                if not self._seats(step) or not self._start_gt(step, req, group):
                    break
                started.append(req)
                taken += 1
            if taken:
                self.stats["gt_groups_started"] += 1
            if taken < len(members):
                self.stats["gt_groups_split"] += int(taken > 0)
                break
        return started

    @staticmethod
    def _queued(step: StepBuilder, rid: str) -> Request:
        return step.running.get(rid) or step.kept.get(rid) or step.swapped[rid]

    def _gt_cover(self, step: StepBuilder, req: Request, remaining: int) -> int:
        """Exact allocation from where the GT stands: its computed tokens + predicted remaining
        output x (1 + padding). For a fresh GT this is `required_tokens(EXACT)` less the one
        slot of the last token, whose KV is never computed (Figure 7: RL 32 holds 32 slots)."""
        padded = req.num_computed_tokens + math.ceil(remaining * (1.0 + self.config.padding))
        return min(req.num_prompt_tokens + req.max_tokens, max(req.num_computed_tokens + 1, padded))

    def _start_gt(
        self, step: StepBuilder, req: Request, group: int, reserve: str | None = None, cover: int | None = None
    ) -> bool:
        state: TaskState = req.policy_state
        cover = cover or self._gt_cover(step, req, state.remaining)
        if req.status is RequestStatus.PREEMPTED_SWAPPED:
            if step.kv.num_blocks_for(cover) > step.kv.gpu.num_available(reserve) or not step.swap_in(req, reserve):
                return False
        elif not step.can_allocate(req, 1, cover=cover, reserve=reserve):
            return False
        elif req.status is RequestStatus.PREEMPTED_KEPT:
            step.resume(req)
        self.gtq.remove(req.request_id)
        if not step.schedule(req, 1, cover=cover, reserve=reserve):
            raise RuntimeError(f"{req!r} passed the KV and budget checks but could not be scheduled")
        self._activate(req, group)
        if state.planned_tokens is None:
            state.planned_tokens = step.kv.capacity(req.request_id)
        return True

    def _unstick(self, step: StepBuilder) -> None:
        """Nothing runs and nothing could start (mispredictions ate the slack): the GT queue's
        head takes the reserve, then the KV of lower-priority queued GTs (swapped out), then
        whatever is left; a prompt larger than the whole cache is rejected."""
        if len(self.gtq):
            head = self._queued(step, self.gtq.order.first() or "")
            group = self._next_group
            self._next_group += 1
            while not self._start_gt(step, head, group, RESERVE):
                victim = self.gtq.last_resident(exclude=head.request_id)
                if victim is None:
                    self._start_partial(step, head, group)
                    return
                self.stats["unstick_swaps"] += 1
                step.preempt(self._queued(step, victim), PreemptionMode.SWAP, PreemptionReason.KV_PRESSURE)
            return
        head_id = self.ptq.order.first()
        if head_id is not None:
            step.finish(
                step.waiting[head_id], RequestStatus.FINISHED_REJECTED, "unschedulable: prompt larger than the KV cache"
            )

    def _start_partial(self, step: StepBuilder, req: Request, group: int) -> None:
        kv = step.kv
        have = len(kv.gpu_tables.get(req.request_id, ())) if req.status is not RequestStatus.PREEMPTED_SWAPPED else 0
        room = (have + kv.gpu.num_available(RESERVE)) * kv.block_size
        cover = min(self._gt_cover(step, req, req.policy_state.remaining), room)
        if cover < req.num_computed_tokens + 1 or not self._start_gt(step, req, group, RESERVE, cover):
            step.finish(req, RequestStatus.FINISHED_REJECTED, "unschedulable: needs more KV than the worker has")

    def _start_guest(self, step: StepBuilder, guest: Request) -> None:
        """KVCPipe's guests run on lent blocks: no new allocation."""
        self.gtq.remove(guest.request_id)
        if guest.status is RequestStatus.PREEMPTED_KEPT:
            step.resume(guest)
        step.schedule(guest, 1, cover=guest.num_computed_tokens + 1)
        self._activate(guest, None)
        state: TaskState = guest.policy_state
        if state.planned_tokens is None:
            state.planned_tokens = step.kv.capacity(guest.request_id)

    def _activate(self, req: Request, group: int | None) -> None:
        self.active[req.request_id] = req
        req.policy_state.group = group
        if group is not None:
            self.group_live[group] = self.group_live.get(group, 0) + 1

    def _leave_group(self, state: TaskState) -> None:
        if state.group is None:
            return
        left = self.group_live[state.group] - 1
        if left:
            self.group_live[state.group] = left
        else:
            del self.group_live[state.group]
            self._refill = True  # a group completed: its KV is free for whole queued groups
        state.group = None

    # ------------------------------------------------------------------ PTs
    def _fill_prompts(self, step: StepBuilder) -> None:
        need = self.tfs
        for req in list(self.prefilling.values()):
            n = min(req.num_prefill_remaining, need)
            if n > 0 and step.schedule(req, n, cover=req.prefill_len, reserve=RESERVE):
                need -= n
        while need > 0 and len(self.ptq) and self._seats(step):
            head = self.ptq.order.first()
            assert head is not None
            req = step.waiting[head]
            if req.prefill_len > need and self.sync:
                fit = self.ptq.closest_fit(need)
                if fit is not None:
                    req = step.waiting[fit]
                    self.stats["pt_best_fit"] += 1
            n = min(req.prefill_len, need)
            if not self._admit_pt(step, req, n):
                break
            need -= n

    def _admit_pt(self, step: StepBuilder, req: Request, num_tokens: int) -> bool:
        kv = step.kv
        prompt_blocks = kv.num_blocks_for(req.prefill_len)
        future = max(0, kv.num_blocks_for(self._future_cover(step, req)) - prompt_blocks)
        busy = self.active or self.prefilling or len(self.gtq) or step.scheduled
        if not self.config.pt_reserve_only:  # ours: any free KV, its future demand included
            committed = self.gtq.pending_blocks + self._pt_future_blocks
            if busy and prompt_blocks + self.config.admit_future * (future + committed) > kv.gpu.num_free:
                self.stats["pt_refused_future_kv"] += 1
                return False
        elif self.prefilling and self._pt_blocks + prompt_blocks > self._reserve_blocks:
            # The paper's rule: PTs' prompt KV comes from the reserve only (3.3.1, "a small
            # amount of KVC is reserved for PTs"); a prompt larger than the whole reserve
            # still starts when no other PT is being prefilled, or it would never run.
            self.stats["pt_refused_reserve_full"] += 1
            return False
        if not step.schedule(req, num_tokens, cover=req.prefill_len, reserve=RESERVE):
            return False
        self.stats["pt_reserve_admissions" if self.config.pt_reserve_only else "pt_pool_admissions"] += 1
        if num_tokens < req.prefill_len:
            self.stats["pt_chunks"] += 1
        self.ptq.remove(req.request_id)
        self.prefilling[req.request_id] = req
        req.policy_state.future_blocks = future
        self._pt_future_blocks += future
        req.policy_state.prompt_blocks = prompt_blocks
        self._pt_blocks += prompt_blocks
        return True

    def _future_cover(self, step: StepBuilder, req: Request) -> int:
        """Tokens a waiting PT's blocks will cover once it starts as a GT."""
        remaining = self._predicted_remaining(req, max(1, req.num_output_tokens))
        padded = req.prefill_len + math.ceil(remaining * (1.0 + self.config.padding))
        return min(req.num_prompt_tokens + req.max_tokens, padded)

    # ------------------------------------------------------------------ queues
    def _predicted_remaining(self, req: Request, outputs_after: int) -> int:
        predicted = req.predicted_output_tokens if req.predicted_output_tokens is not None else req.max_tokens
        return max(1, min(predicted, req.max_tokens) - outputs_after)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _push_pt(self, req: Request) -> None:
        state: TaskState = req.policy_state
        key = ordering_key(self.ordering, req, 0, req.prefill_len, state.seq)
        self.ptq.push(req.request_id, key, req.prefill_len)

    def _push_gt(self, req: Request, remaining: int, resident: bool) -> None:
        state: TaskState = req.policy_state
        state.remaining = remaining
        state.target = req.num_output_tokens + remaining
        bs = self.ctx.block_size
        assert self._kv is not None, "GTs exist only after the first step"
        blocks = len(self._kv.gpu_tables.get(req.request_id, ())) if resident else 0
        group_len = -(-remaining // self.config.group_tokens) * self.config.group_tokens
        cover = min(
            req.num_prompt_tokens + req.max_tokens,
            req.num_computed_tokens + math.ceil(remaining * (1.0 + self.config.padding)),
        )
        demand = max(0, -(-cover // bs) - blocks)
        key = ordering_key(self.ordering, req, blocks * bs, remaining, state.seq)
        self.gtq.push(req.request_id, key, group_len, remaining, resident, demand)

    def _forget(self, req: Request) -> None:
        rid = req.request_id
        state: TaskState = req.policy_state
        self.ptq.remove(rid)
        self.gtq.remove(rid)
        self.active.pop(rid, None)
        if self.prefilling.pop(rid, None) is not None:
            self._pt_future_blocks -= state.future_blocks
            state.future_blocks = 0
            self._pt_blocks -= state.prompt_blocks
            state.prompt_blocks = 0
        self._leave_group(state)

    # ------------------------------------------------------------------ hooks
    def on_arrival(self, request: Request, now: float) -> None:
        request.policy_state = TaskState(seq=self._next_seq())
        self.states[request.request_id] = request.policy_state
        self._push_pt(request)

    def on_preempted(self, request: Request, now: float) -> None:
        state: TaskState = request.policy_state
        self._forget(request)
        if request.status is not RequestStatus.PREEMPTED_KEPT:
            self.pipe.on_guest_gone(request, self.states)
            self.pipe.orphan_guests(request, self.states)
        if request.status is RequestStatus.PREEMPTED_RECOMPUTE:
            state.remaining = 0
            self._push_pt(request)
            return
        left = state.target - request.num_output_tokens
        if left <= 0:  # it outran its prediction (kept, or a guest evicted by its host): predict again
            left = max(1, math.ceil(self.config.regroup_factor * request.num_output_tokens))
            self.stats["regrouped"] += 1
        remaining = min(left, max(1, request.max_tokens - request.num_output_tokens))
        self._push_gt(request, remaining, request.status is RequestStatus.PREEMPTED_KEPT)

    def on_finished(self, request: Request, now: float) -> None:
        state: TaskState | None = request.policy_state
        if state is None or request.request_id not in self.states:
            return
        self._forget(request)
        self.pipe.on_guest_gone(request, self.states)
        self.pipe.orphan_guests(request, self.states)
        if state.planned_tokens is not None and request.status.is_finished:
            used = request.num_tokens
            self.provisioning[request.request_id] = (
                max(0, state.planned_tokens - used),
                max(0, used - state.planned_tokens),
            )
        del self.states[request.request_id]

    def on_step_committed(self, plan: StepPlan, now: float) -> None:
        """A PT whose prefill the step completed becomes a GT. Done when the step is committed
        (with overlap: when it is planned), so the next plan finds it in the GT queue, not in
        neither queue (its prefill done, no group yet)."""
        for rid, req in list(self.prefilling.items()):
            if req.status is RequestStatus.DECODING:
                state: TaskState = req.policy_state
                del self.prefilling[rid]
                self._pt_future_blocks -= state.future_blocks
                state.future_blocks = 0
                self._pt_blocks -= state.prompt_blocks
                state.prompt_blocks = 0
                self._push_gt(req, self._predicted_remaining(req, req.num_output_tokens), True)
                # NOTE: time-synced batching starts GT groups only when a group completes (or
                # none runs); refilling on every new GT made SD behave like D.
                self._refill = self._refill or not self.sync
