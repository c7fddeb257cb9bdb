"""The policy's hands: everything a policy may do to build one step.

`schedule(req, n)` admits or advances a request by n tokens after allocating its KV
(by the policy's allocation mode) and charging the token budget; it answers False when
the blocks or the budget are not there, which is the policy's cue to preempt or stop.
`preempt`, `swap_in`, `resume` and `return_to_pool` move requests between the
scheduler's sets and record the KV moves the worker must execute.

Prefix caching: a request admitted without KV (waiting, or back from a recompute) starts
with the longest cached prefix of its blocks (`prefix_hit`), shared by reference and
counted as computed; `schedule(req, n)` then advances it by n tokens past that prefix (at
most what is left), so a policy that asks for a whole prompt gets the uncached rest, and one
that asks for a chunk gets a chunk of uncached tokens. `tokens_to_compute` and
`num_new_blocks` let a policy size a request with its hit before it decides.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from typing import Protocol

from kvstore.accounting import AllocationMode, KVCacheManager, required_tokens
from scheduler_service.core.budget import TokenBudget
from scheduler_service.core.metrics import MetricsRecorder
from scheduler_service.core.plan_writer import PlanWriter
from scheduler_service.core.preemption import PreemptionMode, PreemptionReason
from scheduler_service.core.prefix import cached_prefix, shareable_blocks
from scheduler_service.core.request import Request, RequestStatus
from sluice.contract.plan import KVMove, KVMoveKind
from sluice.contract.profile import BatchShape


class _PolicyConfig(Protocol):
    padding: float


class _Policy(Protocol):
    allocation_mode: AllocationMode
    config: _PolicyConfig

    @property
    def int8_swap(self) -> bool: ...


class SchedulerState(Protocol):
    """What a StepBuilder works on: the Scheduler's sets, KV, policy and transitions.

    NOTE: a Protocol rather than the Scheduler class, so that this module (which the policy
    interface names) does not import the scheduler that imports both."""

    kv: KVCacheManager
    policy: _Policy
    metrics: MetricsRecorder
    plans: PlanWriter
    waiting: OrderedDict[str, Request]
    running: dict[str, Request]
    swapped: dict[str, Request]
    kept: dict[str, Request]
    # hits of waiting requests none of whose blocks others can name, kept across steps:
    # request id -> (pool evictions then, its num_tokens then, hit)
    prefix_hits: dict[str, tuple[int, int, list[int]]]

    def admit(self, req: Request, now: float) -> None: ...

    def preempt(
        self, req: Request, mode: PreemptionMode, reason: PreemptionReason, now: float, *, to_front: bool
    ) -> None: ...

    def pause(self, requests: list[Request], reason: PreemptionReason, now: float) -> None: ...

    def resume(self, req: Request, now: float, *, table_replaced: bool) -> None: ...

    def flush_blocks(self, req: Request) -> None: ...

    def return_to_pool(self, req: Request, now: float) -> None: ...

    def end(self, req: Request, status: RequestStatus, now: float, message: str = "") -> None: ...

    def tokens_in_flight(self, request_id: str) -> int: ...


class StepBuilder:
    def __init__(self, scheduler: SchedulerState, budget: TokenBudget, now: float) -> None:
        self._sched = scheduler
        self.kv = scheduler.kv
        self.budget = budget
        self.now = now
        self.scheduled: dict[str, int] = {}  # request id -> tokens this step, batch order
        self.kv_moves: list[KVMove] = []
        self.metadata: dict[str, object] = {}
        self.num_preempted = 0
        self._block_mode = scheduler.policy.allocation_mode in (AllocationMode.BLOCK, AllocationMode.RESERVED)
        # NOTE: max allocation reserves prompt + max_tokens at admission, so its running requests
        # are covered too, by a target the fast path computes without the general one's calls.
        self._max_mode = scheduler.policy.allocation_mode is AllocationMode.MAX
        self._tables = scheduler.kv.gpu_tables
        self._block_size = scheduler.kv.block_size
        self._caching = scheduler.kv.prefix_caching
        self._hits: dict[str, tuple[int, list[int]]] = {}  # request id -> (pool evictions then, hit)
        self._kept_hits = scheduler.prefix_hits

    # Views of the scheduler's sets (ordered: waiting FCFS with preempted at the head,
    # running in admission order).
    @property
    def waiting(self) -> OrderedDict[str, Request]:
        return self._sched.waiting

    @property
    def running(self) -> dict[str, Request]:
        return self._sched.running

    @property
    def swapped(self) -> dict[str, Request]:
        return self._sched.swapped

    @property
    def kept(self) -> dict[str, Request]:
        return self._sched.kept

    def is_scheduled(self, request: Request) -> bool:
        return request.request_id in self.scheduled

    def in_flight(self, request: Request) -> bool:
        """Overlap: a step planned ahead computes the request and its answer has not come
        (what that step samples is not known yet); always False one step at a time."""
        return self._sched.tokens_in_flight(request.request_id) > 0

    def kv_known_to_worker(self, request: Request) -> bool:
        """The worker holds the request (its KV was computed there): a swap would copy it."""
        return self._sched.plans.knows(request.request_id)

    def ids_known_to_worker(self) -> AbstractSet[str]:
        """The ids `kv_known_to_worker` answers True for, to test many requests (read-only)."""
        return self._sched.plans.known_ids

    def tokens_to_cover(self, request: Request, num_tokens: int, mode: AllocationMode | None = None) -> int:
        """Tokens the request's blocks must hold if it advances by num_tokens now."""
        policy = self._sched.policy
        return required_tokens(
            mode or policy.allocation_mode,
            num_tokens_after_step=request.num_computed_tokens + num_tokens,
            num_prompt_tokens=request.num_prompt_tokens,
            max_tokens=request.max_tokens,
            predicted_output_tokens=request.predicted_output_tokens,
            padding=policy.config.padding,
        )

    def can_allocate(
        self, request: Request, num_tokens: int, *, cover: int | None = None, reserve: str | None = None
    ) -> bool:
        target = cover if cover is not None else self.tokens_to_cover(request, num_tokens)
        return self.kv.can_allocate(request.request_id, target, reserve, self.prefix_hit(request))

    # ------------------------------------------------------------------ prefix caching
    def prefix_hit(self, request: Request) -> list[int]:
        """Cached blocks a KV-less waiting request would start with if admitted now: the
        longest cached run of its full blocks, short of its last token (which must be
        computed to sample). [] without prefix caching or for a request holding KV."""
        if not self._caching or request.num_computed_tokens:
            return []
        if request.prefix_salt is None and request.prefix_source is None and request.prompt_token_ids is None:
            # NOTE: no block of it is named by tokens and none of its salted ones was hashed
            # (so none registered): `lookup_hashes` would give nothing to look up. Tested before
            # the table and status tests (the same answer, without their lookups): a queue
            # policy asks three times per admitted head and once per head it sets aside.
            return []
        status = request.status
        if request.request_id in self._tables or (
            status is not RequestStatus.WAITING and status is not RequestStatus.PREEMPTED_RECOMPUTE
        ):  # NOTE: `not status.is_waiting`, inlined
            return []
        evictions = self.kv.gpu.num_evictions
        rid = request.request_id
        memo = self._hits.get(rid)
        if memo is not None and memo[0] == evictions:
            return memo[1]
        num_tokens = request.num_tokens
        kept = self._kept_hits.get(rid)
        if kept is not None and kept[0] == evictions and kept[1] == num_tokens:
            # NOTE: a request none of whose blocks others can name: its hit changes only with
            # evictions (it registers nothing while it waits), so a hit from an earlier step holds
            self._hits[rid] = (evictions, kept[2])
            return kept[2]
        size = self._block_size
        hit = cached_prefix(self.kv, request, (num_tokens - 1) // size)
        self._hits[rid] = (evictions, hit)
        if request.prefix_salt is not None and shareable_blocks(request, size) == 0:
            self._kept_hits[rid] = (evictions, num_tokens, hit)
        return hit

    def batch_shape(self) -> BatchShape:
        """The shape of the step so far, as the simulated executor prices it: each scheduled
        request a decode over its context or a chunk over its computed prefix (a prefix hit is
        computed from the moment it is admitted)."""
        shape = BatchShape()
        running = self._sched.running
        for rid, n in self.scheduled.items():
            req = running[rid]
            done = req.num_computed_tokens
            if n == 1 and done > 0:
                shape.add_decode(done + 1)
            else:
                shape.prefill_chunks.append((n, done))
        return shape

    def tokens_to_compute(self, request: Request) -> int:
        """Tokens the request still has to compute, its prefix hit deducted."""
        n = request.num_prompt_tokens + request.num_output_tokens - request.num_computed_tokens
        if (
            not self._caching
            or request.num_computed_tokens
            or (request.prefix_salt is None and request.prefix_source is None and request.prompt_token_ids is None)
        ):
            return n  # NOTE: `prefix_hit`'s first answers (no hit), inlined: every waiting head a queue policy tries
        return n - len(self.prefix_hit(request)) * self._block_size

    def num_new_blocks(self, request: Request, cover: int) -> int:
        """Free blocks the request takes to cover `cover` tokens (a prefix hit's blocks that
        others hold cost nothing; those waiting in the cache's LRU leave the free pool)."""
        if (
            not self._caching
            or request.num_computed_tokens
            or (request.prefix_salt is None and request.prefix_source is None and request.prompt_token_ids is None)
        ):
            return self.kv.num_new_blocks(request.request_id, cover)  # NOTE: no hit, as in `tokens_to_compute`
        return self.kv.num_new_blocks(request.request_id, cover, self.prefix_hit(request))

    def schedule(
        self,
        request: Request,
        num_tokens: int,
        *,
        cover: int | None = None,
        reserve: str | None = None,
    ) -> bool:
        """Advances `request` by `num_tokens` this step. `cover` overrides the token count
        its blocks must hold (e.g. a whole prompt at admission). False: nothing changed."""
        rid = request.request_id
        computed = request.num_computed_tokens
        to_compute = request.num_prompt_tokens + request.num_output_tokens - computed
        if num_tokens > to_compute and computed and request.status.is_waiting and rid in self._tables:
            # NOTE: it arrived with its KV (moved from a prefill worker); like a prefix hit, a
            # policy that asks for the whole prompt gets the rest.
            num_tokens = to_compute
        if num_tokens <= 0 or num_tokens > to_compute or rid in self.scheduled:
            raise ValueError(f"cannot schedule {num_tokens} tokens of {request!r} (already scheduled or too many)")
        # NOTE: `prefix_hit`'s first answers, inlined: no caching, or a request with KV or with
        # no block a lookup could name has no hit (every admission and chunk asks)
        if (
            not self._caching
            or computed
            or (request.prefix_salt is None and request.prefix_source is None and request.prompt_token_ids is None)
        ):
            hit: list[int] = []
        else:
            hit = self.prefix_hit(request)
        if hit:
            computed = len(hit) * self._block_size
            num_tokens = min(num_tokens, to_compute - computed)
        budget = self.budget
        if budget.num_tokens + num_tokens > budget.max_tokens or budget.num_seqs >= budget.max_seqs:
            return False
        needed = computed + num_tokens
        if cover is not None:
            target = max(cover, needed)
        elif self._block_mode:  # NOTE: the hot path (every decode, every step)
            target = needed
        else:
            target = max(self.tokens_to_cover(request, num_tokens), needed)
        table = self._tables.get(rid)
        if (table is None or len(table) * self._block_size < target) and self.kv.allocate(
            rid, target, reserve, hit
        ) is None:
            self._sched.metrics.kv_alloc_failures += 1
            return False
        status = request.status
        if status is RequestStatus.WAITING or status is RequestStatus.PREEMPTED_RECOMPUTE:
            # NOTE: a waiting request that came with a table (its KV moved here from a prefill
            # worker) made no prefix lookup.
            if self._caching and table is None:
                self._count_hit(request, computed)
            self._sched.admit(request, self.now)
        elif status is not RequestStatus.DECODING and status is not RequestStatus.PREFILLING:
            raise ValueError(f"{request!r} is not waiting or running; swap it in or resume it first")
        budget.num_tokens += num_tokens
        budget.num_seqs += 1
        self.scheduled[rid] = num_tokens
        return True

    def admit_fresh(self, request: Request, num_tokens: int) -> bool:
        """`schedule(request, num_tokens, cover=its tokens)` for a waiting request that has nothing
        computed, no table and no block a prefix lookup could name (no salt, no prefix source, no
        token ids), whose `num_tokens` (all of its tokens) the budget has room for: its tests
        answer yes for it, so this is the rest (queue policies admit dozens of such requests a
        step). False: its blocks are not there (nothing changed)."""
        rid = request.request_id
        if self.kv.allocate(rid, request.num_prompt_tokens + request.num_output_tokens) is None:
            self._sched.metrics.kv_alloc_failures += 1
            return False
        if self._caching:
            # NOTE: `_count_hit(request, 0)` less its memo drops: `prefix_hit` answers [] for
            # such a request before it files a memo, so it has none
            request.num_computed_tokens = request.num_cached_tokens = 0
            self._sched.metrics.on_prefix_lookup(request.num_prompt_tokens + request.num_output_tokens, 0)
        self._sched.admit(request, self.now)
        budget = self.budget
        budget.num_tokens += num_tokens
        budget.num_seqs += 1
        self.scheduled[rid] = num_tokens
        return True

    def _count_hit(self, request: Request, hit_tokens: int) -> None:
        request.num_computed_tokens = hit_tokens
        request.num_cached_tokens = hit_tokens
        self._sched.metrics.on_prefix_lookup(request.num_prompt_tokens + request.num_output_tokens, hit_tokens)
        self._hits.pop(request.request_id, None)
        self._kept_hits.pop(request.request_id, None)

    def schedule_covered(
        self,
        queue: deque[Request],
        *,
        chunk_to_budget: bool = False,
        prefill_limit: Callable[[Request], int] | None = None,
    ) -> Request | None:
        """Pops running requests from the left of `queue` and schedules each for all the tokens
        it has to compute while its blocks already cover them and the budget has room; returns
        the first request that needs more (popped, nothing done to it: the caller schedules it
        with `schedule` and whatever preemption its policy does), or None once the queue is
        empty. `chunk_to_budget`: at most what is left of the token budget each (chunked
        prefill); a request that would get no tokens is passed over. `prefill_limit`: at most
        this many tokens for a request still prefilling (a chunk priced in time).

        NOTE: the decode loop of every continuous-batching policy, once per running request
        per step; a request whose table covers its step (15 decodes in 16 with 16-token
        blocks) is charged here without the general path's calls and lookups. Decisions are
        exactly those of calling `schedule` on each in turn."""
        max_mode = self._max_mode
        if not self._block_mode and not max_mode:
            return queue.popleft() if queue else None
        budget, tables, scheduled, block_size = self.budget, self._tables, self.scheduled, self._block_size
        decoding, prefilling = RequestStatus.DECODING, RequestStatus.PREFILLING
        while queue:
            req = queue.popleft()
            computed = req.num_computed_tokens
            n = req.num_prompt_tokens + req.num_output_tokens - computed
            if chunk_to_budget:
                left = budget.max_tokens - budget.num_tokens
                if n > left:  # NOTE: min() written out, here and below (a call per request per step)
                    n = left
                if prefill_limit is not None and computed < req.prefill_len and n > (limit := prefill_limit(req)):
                    n = limit
                if n <= 0:
                    continue
            # NOTE: schedule_if_covered's test written out (n never exceeds what is left to
            # compute here): one call fewer per running request per step.
            rid = req.request_id
            table = tables.get(rid)
            target = computed + n
            if max_mode:
                target = max(target, req.num_prompt_tokens + req.max_tokens)
            status = req.status
            if (
                n > 0
                and (status is decoding or status is prefilling)
                and table is not None
                and rid not in scheduled
                and len(table) * block_size >= target
                and budget.num_tokens + n <= budget.max_tokens
                and budget.num_seqs < budget.max_seqs
            ):
                budget.num_tokens += n
                budget.num_seqs += 1
                scheduled[rid] = n
            else:
                return req
        return None

    def table_cover(self) -> tuple[Mapping[str, list[int]], dict[str, int], int] | None:
        """(GPU block tables, this step's scheduled tokens, block size) when
        `schedule_if_covered` is the plain test "the table holds every token of the step"
        (block allocation); None when it is not (MAX mode reserves to max_tokens, unbudgeted
        modes have no table to test): then call it. Walks over hundreds of jobs a step write the
        test out with these (a call fewer per job)."""
        if not self._block_mode:  # NOTE: BLOCK or RESERVED; MAX mode is the other kind
            return None
        return self._tables, self.scheduled, self._block_size

    def schedule_if_covered(self, request: Request, num_tokens: int) -> bool:
        """`schedule`'s fast half: advances a running request whose blocks already cover the
        step, when the budget has room. False: nothing changed, and `schedule` decides (or,
        for tokens it does not have to compute, refuses)."""
        budget, rid = self.budget, request.request_id
        table = self._tables.get(rid)
        computed = request.num_computed_tokens
        target = computed + num_tokens
        if self._max_mode:
            target = max(target, request.num_prompt_tokens + request.max_tokens)  # required_tokens(MAX)
        if (
            (self._block_mode or self._max_mode)
            and 0 < num_tokens <= request.num_prompt_tokens + request.num_output_tokens - computed
            and (request.status is RequestStatus.DECODING or request.status is RequestStatus.PREFILLING)
            and rid not in self.scheduled
            and table is not None
            and len(table) * self._block_size >= target
            and budget.num_tokens + num_tokens <= budget.max_tokens
            and budget.num_seqs < budget.max_seqs
        ):
            budget.num_tokens += num_tokens
            budget.num_seqs += 1
            self.scheduled[rid] = num_tokens
            return True
        return False

    def unschedule(self, request: Request) -> None:
        """Takes a request out of this step (its blocks stay allocated)."""
        n = self.scheduled.pop(request.request_id)
        self.budget.give_back(n)

    def preempt(
        self, request: Request, mode: PreemptionMode, reason: PreemptionReason, *, to_front: bool = True
    ) -> None:
        if request.request_id in self.scheduled:
            self.unschedule(request)
        if mode is PreemptionMode.SWAP:
            self._sched.flush_blocks(request)  # NOTE: freed GPU blocks keep its KV cached
        if mode is PreemptionMode.SWAP and not self._sched.plans.knows(request.request_id):
            mode = PreemptionMode.RECOMPUTE  # the worker never computed its KV: nothing to copy
        if mode is PreemptionMode.SWAP and not self._swap_out(request):
            mode = PreemptionMode.RECOMPUTE  # swap space full: recompute is the only way out
        self._sched.preempt(request, mode, reason, self.now, to_front=to_front)
        self.num_preempted += 1

    def pause(self, requests: list[Request], reason: PreemptionReason) -> None:
        """Preempts running requests that are not in this step, keeping their KV on the GPU:
        what `preempt(req, KEEP, reason)` does to each, in order, without its checks for
        the modes that move KV (queue policies pause dozens of jobs a step this way)."""
        scheduled = self.scheduled
        for request in requests:
            if request.request_id in scheduled:
                raise ValueError(f"{request!r} is in this step; unschedule or preempt it instead")
        self._sched.pause(requests, reason, self.now)
        self.num_preempted += len(requests)

    def _swap_out(self, request: Request) -> bool:
        pairs = self.kv.swap_out(request.request_id)
        if pairs is None:
            return False
        if pairs:
            src, dst = zip(*pairs, strict=True)
            int8 = self._sched.policy.int8_swap
            self.kv_moves.append(KVMove(KVMoveKind.SWAP_OUT, request.request_id, src, dst, int8))
        return True

    def swap_in(self, request: Request, reserve: str | None = None) -> bool:
        """Brings a swapped request's KV back to the GPU and into the running set."""
        if request.status is not RequestStatus.PREEMPTED_SWAPPED:
            raise ValueError(f"{request!r} is not swapped out")
        pairs = self.kv.swap_in(request.request_id, reserve)
        if pairs is None:
            return False
        if pairs:
            src, dst = zip(*pairs, strict=True)
            int8 = self._sched.policy.int8_swap
            self.kv_moves.append(KVMove(KVMoveKind.SWAP_IN, request.request_id, src, dst, int8))
        self._sched.resume(request, self.now, table_replaced=True)
        return True

    def resume(self, request: Request) -> None:
        """Puts a kept (offload-free preempted) request back into the running set."""
        if request.status is not RequestStatus.PREEMPTED_KEPT:
            raise ValueError(f"{request!r} is not kept")
        self._sched.resume(request, self.now, table_replaced=False)

    def resume_if_covered(self, request: Request, num_tokens: int) -> bool:
        """`resume`, then `schedule(request, num_tokens)`, for a kept request whose blocks
        already cover the step, when the budget has room (`schedule_if_covered`'s test). False:
        nothing changed (queue policies resume dozens of such jobs a step)."""
        budget, rid = self.budget, request.request_id
        table = self._tables.get(rid)
        target = request.num_computed_tokens + num_tokens
        if self._max_mode:
            target = max(target, request.num_prompt_tokens + request.max_tokens)  # required_tokens(MAX)
        if not (
            (self._block_mode or self._max_mode)
            and request.status is RequestStatus.PREEMPTED_KEPT
            and 0 < num_tokens <= request.num_prompt_tokens + request.num_output_tokens - request.num_computed_tokens
            and rid not in self.scheduled
            and table is not None
            and len(table) * self._block_size >= target
            and budget.num_tokens + num_tokens <= budget.max_tokens
            and budget.num_seqs < budget.max_seqs
        ):
            return False
        self.resume_covered(request, num_tokens)
        return True

    def resume_covered(self, request: Request, num_tokens: int) -> None:
        """`resume_if_covered`'s move once its test passed, also for a walk that made the test
        itself from `table_cover()` (the request is kept, its table holds the step's tokens,
        the budget has the seat and the tokens): FastServe resumes about 55 jobs a step."""
        self._sched.resume(request, self.now, table_replaced=False)
        budget = self.budget
        budget.num_tokens += num_tokens
        budget.num_seqs += 1
        self.scheduled[request.request_id] = num_tokens

    def return_to_pool(self, request: Request) -> None:
        """Frees the request's KV and hands it back to the router (SCLS slices end this way);
        its generated tokens are kept and prefilled again wherever it runs next."""
        if request.request_id in self.scheduled:
            self.unschedule(request)
        self._sched.return_to_pool(request, self.now)

    def shrink_allocation(self, request: Request, num_tokens_kept: int) -> list[int]:
        self._flush_if_leaving(request, self.kv.num_blocks_for(num_tokens_kept))
        freed = self.kv.free_tail(request.request_id, num_tokens_kept)
        if freed:
            self._sched.plans.replace_table(request.request_id)
        return freed

    def _flush_if_leaving(self, request: Request, keep: int) -> None:
        """`flush_blocks` before the request's table is cut to its first `keep` blocks, when a
        full block of computed KV is among those that leave (registered then, it stays cached
        as when it was freed whole). Otherwise nothing it could find later leaves: its blocks
        register as they would have (as they fill, or when its KV is freed), and a request
        that owns its blocks keeps owning them (EconoServe trims and lends the unused tail of
        every reservation: flushing there hashed and registered every block of those requests)."""
        if self._caching and self._sched.computed_on_worker(request) // self._block_size > keep:
            self._sched.flush_blocks(request)

    def lend_blocks(self, host: Request, guest: Request, num_blocks: int) -> list[int]:
        """Moves the tail of the host's allocation to the guest (EconoServe KV pipelining)."""
        # NOTE: the guest's KV stays where it is (its table only grows): nothing to flush
        self._flush_if_leaving(host, len(self._tables.get(host.request_id, ())) - num_blocks)
        moved = self.kv.transfer_tail(host.request_id, guest.request_id, num_blocks)
        self._sched.plans.replace_table(host.request_id)
        return moved

    def finish(self, request: Request, status: RequestStatus, message: str = "") -> None:
        """Ends a request from inside a policy (e.g. a deadline that cannot be met)."""
        if request.request_id in self.scheduled:
            self.unschedule(request)
        self._sched.end(request, status, self.now, message)
