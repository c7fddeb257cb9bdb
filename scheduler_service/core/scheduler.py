"""The per-worker scheduling core, driven identically by the simulator and the live service:

    add_request(req, now) -> RejectReason | None      # bounded queue, length check
    abort(request_id, now)                            # KV freed now, worker told next step
    plan = schedule(now)                              # the policy fills a StepBuilder
    outputs = on_step_result(result, now)             # tokens appended, stops checked

The scheduler owns the request sets (waiting FCFS with preempted requests at the head,
running in admission order, swapped, kept) and the worker's KV block tables; it turns
the policy's decisions into a StepPlan that sends new requests once in full and known
ones as a diff. A failed step or a lost worker resets the worker's requests to recompute.

With `overlap` (and a policy that is `overlap_safe`) a plan may be made while the previous one
is still in flight: each plan commits its step at once and its answer resolves placeholder
tokens (core/overlap.py).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from dataclasses import dataclass
from functools import partial
from operator import attrgetter

from kvstore.accounting import KVCacheManager
from scheduler_service.core.budget import TokenBudget
from scheduler_service.core.metrics import MetricsRecorder
from scheduler_service.core.overlap import InFlight, commit_plan, resolve_step
from scheduler_service.core.plan_writer import PlanWriter
from scheduler_service.core.policy import Policy
from scheduler_service.core.preemption import PreemptionMode, PreemptionReason, RejectReason
from scheduler_service.core.prefix import NO_LIMIT, block_hashes, owns_blocks, request_salt, shareable_blocks
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.step_builder import StepBuilder
from scheduler_service.core.step_outputs import StepOutputs
from sluice.contract.plan import StepPlan, StepResult

_computed = attrgetter("num_computed_tokens")  # NOTE: summed over the running set every step


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256  # sequences per step
    max_num_batched_tokens: int = 8192  # tokens per step (a policy's budget may be smaller)
    max_model_len: int = 4096  # prompt + output limit of the model
    # bound of this worker's waiting queue (a scheduler on its own); a cluster passes None and
    # bounds new requests across its workers instead (cluster/cluster.py)
    max_waiting: int | None = None
    queue_timeout_s: float | None = None  # a request never admitted within this is dropped
    drop_expired_deadlines: bool = False  # drop waiting requests whose JCT deadline passed
    overlap: bool = False  # plans may be made one step ahead of the answers (core/overlap.py)


class Scheduler:
    def __init__(
        self,
        worker_id: int,
        kv: KVCacheManager,
        policy: Policy,
        config: SchedulerConfig | None = None,
        metrics: MetricsRecorder | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.kv = kv
        self.policy = policy
        self.config = config or SchedulerConfig()
        self.metrics = metrics or MetricsRecorder()
        self.requests: dict[str, Request] = {}
        self.waiting: OrderedDict[str, Request] = OrderedDict()
        self.running: dict[str, Request] = {}
        self.swapped: dict[str, Request] = {}
        self.kept: dict[str, Request] = {}
        self.returned: list[Request] = []  # handed back to the router (drained by the cluster)
        self._finished: list[Request] = []
        self.plans = PlanWriter(worker_id)  # what the worker has been told
        self._expiry: list[tuple[float, str]] = []
        self._inflight: deque[InFlight] = deque()  # plans sent and not answered, oldest first
        # NOTE: only for policies whose decisions a one-step lag leaves as the placeholders allow.
        self.overlap = self.config.overlap and getattr(policy, "overlap_safe", False)
        self.pending_tokens: dict[str, int] = {}  # overlap: request id -> placeholders not resolved yet
        # prefix hits of waiting requests that only their own KV can serve (StepBuilder.prefix_hit)
        self.prefix_hits: dict[str, tuple[int, int, list[int]]] = {}
        # Prefix caching registers a request's shareable blocks as they fill and its salted ones
        # (found only by itself) when its KV is freed (`flush_blocks`); under overlap both count
        # only the tokens of answered steps (`computed_on_worker`).

    # ------------------------------------------------------------------ intake
    def add_request(self, request: Request, now: float) -> RejectReason | None:
        reason = self._admission_check(request)
        if reason is not None:
            request.status = RequestStatus.FINISHED_REJECTED
            request.finish_time = now
            request.finish_message = str(reason)
            self.metrics.on_reject(request, reason, now)
            return reason
        request.worker_id = self.worker_id
        request.queue_enter_time = now
        self.requests[request.request_id] = request
        self.waiting[request.request_id] = request
        self.metrics.on_admitted(request)
        expire = self._expiry_time(request)
        if expire is not None:
            heapq.heappush(self._expiry, (expire, request.request_id))
        self.policy.on_arrival(request, now)
        return None

    def _admission_check(self, request: Request) -> RejectReason | None:
        if request.request_id in self.requests:
            return RejectReason.DUPLICATE_ID
        if request.num_prompt_tokens + 1 > self.config.max_model_len:
            return RejectReason.PROMPT_TOO_LONG
        if request.num_prompt_tokens + request.max_tokens > self.config.max_model_len:
            return RejectReason.PROMPT_TOO_LONG
        if self.kv.num_blocks_for(request.num_prompt_tokens + 1) > self.kv.gpu.num_blocks:
            # NOTE: vLLM "ignores" such prompts; left in an FCFS queue they would block it forever.
            return RejectReason.EXCEEDS_KV_CAPACITY
        if self.config.max_waiting is not None and len(self.waiting) >= self.config.max_waiting:
            return RejectReason.QUEUE_FULL
        return None

    def _expiry_time(self, request: Request) -> float | None:
        times = []
        if self.config.queue_timeout_s is not None:
            times.append(request.arrival_time + self.config.queue_timeout_s)
        if self.config.drop_expired_deadlines and request.deadline is not None:
            times.append(request.deadline)
        return min(times) if times else None

    def abort(self, request_id: str, now: float, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> bool:
        """Ends a live request; its blocks are free at once and the worker is told next step."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        self.end(request, status, now, "aborted" if status is RequestStatus.FINISHED_ABORTED else "")
        return True

    # ------------------------------------------------------------------ one step
    def schedule(self, now: float) -> StepPlan:
        self._expire(now)
        budget = TokenBudget(self.policy.token_budget(now), self.config.max_num_seqs)
        step = StepBuilder(self, budget, now)
        self.policy.schedule(step, now)
        follows = self._inflight[-1].plan.step_id if self.overlap and self._inflight else 0
        plan = self.plans.write(
            step.scheduled,
            self.running,
            self.kv.gpu_tables,
            step.kv_moves,
            step.budget.max_tokens,
            step.metadata,
            follows_step_id=follows,
        )
        if not self.overlap:
            self._inflight.clear()
        self._inflight.append(InFlight(plan))
        if self.overlap:
            commit_plan(self, plan, now)
        return plan

    def on_step_result(self, result: StepResult, now: float) -> StepOutputs:
        entry = self._take_inflight(result.step_id)
        plan = entry.plan
        if result.error is not None:
            # NOTE: a failed step changed nothing on the worker, and the steps after it are void:
            # the releases they carried are sent again with the reset's.
            unapplied = [rid for e in (entry, *self._inflight) for rid in e.plan.release_ids]
            self.reset_worker(now, error_request_id=result.error.request_id, message=result.error.message)
            self.plans.release_again(unapplied)
            return StepOutputs(finished=self.pop_finished())
        if self.overlap:
            out = resolve_step(self, entry, result, now)
            if out is None:
                self.reset_worker(now, message=f"step {result.step_id} left out tokens the plan asked for")
                return StepOutputs(finished=self.pop_finished())
            return out
        tokens: list[tuple[Request, int]] = []
        running = self.running
        sampled = result.sampled_token_ids
        decoding = RequestStatus.DECODING
        max_model_len = self.config.max_model_len
        metrics = self.metrics
        caching = self.kv.prefix_caching
        for rid, n in plan.num_scheduled_tokens.items():
            req = running.get(rid)
            if req is None:  # aborted while the step ran
                continue
            req.num_computed_tokens += n
            if req.status is not decoding:
                metrics.prefill_tokens += n
                if req.num_computed_tokens >= req.prefill_len:
                    req.status = decoding
            if caching and req.num_computed_tokens >= req.cache_due:
                self.cache_computed_blocks(req, req.num_computed_tokens)
            token = sampled.get(rid)
            if token is None:
                continue
            req.output_token_ids.append(token)
            req.num_output_tokens += 1
            req.token_times.append(now)
            if req.first_token_time is None:
                req.first_token_time = now
            tokens.append((req, token))
            out = req.num_output_tokens
            # NOTE: the cheap tests first; _stop_status decides (min_tokens, ignore_eos) only
            # for the one token in many that could end its request.
            if (
                out >= req.max_tokens
                or req.num_prompt_tokens + out >= max_model_len
                or token in req.eos_token_ids
                or token in req.sampling.stop_token_ids
            ):
                stop = self._stop_status(req, token)
                if stop is not None:
                    self.end(req, stop, now)
        if plan.num_scheduled_tokens:
            used = sum(map(_computed, self.running.values()))
            if self.kept:
                used += sum(map(_computed, self.kept.values()))
            self.metrics.on_step(self.worker_id, plan, result, now, self.kv, used)
        self.policy.on_step_committed(plan, now)
        self.policy.on_step_result(plan, result, now)
        return StepOutputs(tokens, self.pop_finished())

    def _take_inflight(self, step_id: int) -> InFlight:
        """The plan a result answers: the oldest in flight (or an empty plan, answered at once)."""
        inflight = self._inflight
        if inflight and inflight[0].plan.step_id == step_id:
            return inflight.popleft()
        if inflight and inflight[-1].plan.step_id == step_id and inflight[-1].plan.is_empty:
            return inflight.pop()
        raise RuntimeError(f"step result {step_id} does not answer the plan in flight")

    def is_in_flight(self, step_id: int) -> bool:
        """The plan is sent and unanswered (False once a failure voided it)."""
        return any(e.plan.step_id == step_id for e in self._inflight)

    def tokens_in_flight(self, request_id: str) -> int:
        """Tokens of the request that plans in flight compute (committed ahead under overlap)."""
        return sum(e.plan.num_scheduled_tokens.get(request_id, 0) for e in self._inflight if request_id not in e.voided)

    def _void(self, req: Request) -> None:
        """Overlap: the request ended or restarts from scratch: its results from plans in flight
        are not applied and its placeholders are dropped."""
        rid = req.request_id
        for entry in self._inflight:
            if rid in entry.plan.num_scheduled_tokens:
                entry.voided.add(rid)
        req.num_output_tokens -= self.pending_tokens.pop(rid, 0)

    def computed_on_worker(self, req: Request) -> int:
        """Tokens of the request whose KV exists on the worker: under overlap, those of steps
        still in flight are counted in `num_computed_tokens` already and are left out here."""
        n = req.num_computed_tokens
        return n - self.tokens_in_flight(req.request_id) if self.overlap else n

    def cache_computed_blocks(self, req: Request, computed: int) -> None:
        """Registers the request's full shareable blocks among its first `computed` tokens (after
        the step that computed them: a block is found only once its KV exists); `cache_due` says
        when the next one is full, so the steps in between cost one comparison (never per token)."""
        kv = self.kv
        size = kv.block_size
        # NOTE: once one of its salted hashes exists (its KV was freed before), it registers every
        # block as it fills: a hash registered already makes a later copy stay unregistered. A
        # request that owns its blocks (`owns_blocks`) registers none: its freed KV is its run.
        rid = req.request_id
        cap = shareable_blocks(req, size)
        if req.prefix_salt is not None and (cap or rid in kv.hashed):
            cap = NO_LIMIT
        full = min(computed // size, cap)
        if full > kv.num_registered(rid):
            kv.cache_blocks(rid, block_hashes(req, size, full), full)
        done = kv.num_registered(rid)
        req.cache_due = (done + 1) * size if done < cap else NO_LIMIT

    def flush_blocks(self, req: Request) -> None:
        """Its KV is about to be freed (or to leave): its salted full blocks are registered
        too, so that its own re-admission finds them as if they had been registered as they filled."""
        req.cache_due = 0
        if self.kv.prefix_caching:
            kv = self.kv
            self.prefix_hits.pop(req.request_id, None)
            if owns_blocks(req, kv):
                # NOTE: its KV leaves other than by `release_kv` (a swap, a shrink, a loan, a
                # hand-off): its blocks here are registered from now on, as they were before runs
                kv.mark_hashed(req.request_id)
            full = self.computed_on_worker(req) // kv.block_size
            if full > kv.num_registered(req.request_id):
                kv.cache_blocks(req.request_id, block_hashes(req, kv.block_size, full), full)

    def release_kv(self, req: Request) -> None:
        """Frees the KV of a request that lives on (a recompute preemption, a return to the
        router): `flush_blocks`, `_void` under overlap, then `kv.free`. A request that owns its
        blocks leaves them in the LRU as its own run instead of hashing and registering each
        (`KVCacheManager.free_owned`): the same pool, hit and evictions, O(1) LRU work."""
        kv = self.kv
        rid = req.request_id
        self.prefix_hits.pop(rid, None)
        here = rid in kv.gpu_tables
        if not here or not kv.prefix_caching or kv.num_registered(rid) or not owns_blocks(req, kv):
            if here:
                self.flush_blocks(req)  # NOTE: before `_void`, while its steps in flight still count
            else:
                req.cache_due = 0  # NOTE: nothing to register (what it left here before stays)
            if self.overlap:
                self._void(req)
            kv.free(rid)
            return
        req.cache_due = 0
        size = kv.block_size
        # NOTE: what `flush_blocks` would register: its full computed blocks that have a hash
        full = min(self.computed_on_worker(req), req.num_prompt_tokens + req.num_output_tokens) // size
        if full and req.prefix_salt is None:
            req.prefix_salt = request_salt(rid)  # NOTE: as hashing its first salted block would
        if self.overlap:
            self._void(req)
        kv.free_owned(rid, full, partial(block_hashes, req, size))

    def _stop_status(self, req: Request, token: int) -> RequestStatus | None:
        return self.stop_status(req, token, req.num_output_tokens)

    def stop_status(self, req: Request, token: int, n: int) -> RequestStatus | None:
        """How the request ends after `token`, its n-th output token; None when it goes on."""
        sp = req.sampling
        if n >= sp.min_tokens and ((token in req.eos_token_ids and not sp.ignore_eos) or token in sp.stop_token_ids):
            return RequestStatus.FINISHED_STOPPED
        if n >= req.max_tokens or req.num_prompt_tokens + n >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # ------------------------------------------------------------------ queries
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.kept or self.plans.has_pending_releases)

    @property
    def has_step_in_flight(self) -> bool:
        return bool(self._inflight)

    @property
    def num_steps_in_flight(self) -> int:
        return len(self._inflight)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def pop_finished(self) -> list[Request]:
        done, self._finished = self._finished, []
        return done

    def pop_returned(self) -> list[Request]:
        back, self.returned = self.returned, []
        return back

    def update_prediction(self, request_id: str, tokens: int, source: str, now: float) -> bool:
        """A prediction of the output length that arrived after the request (capped by max_tokens);
        the policy re-files the request if it uses the prediction at arrival."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        request.predicted_output_tokens = max(1, min(tokens, request.max_tokens))
        request.length_source = source
        self.policy.on_prediction(request, now)
        return True

    def finish(self, request_id: str, status: RequestStatus, now: float, message: str = "") -> bool:
        """Ends a request for a reason found outside the core (a stop string in the text)."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        self.end(request, status, now, message)
        return True

    # ------------------------------------------------------------------ transitions
    # The StepBuilder's hands: a policy's decisions become these moves between the sets.
    def admit(self, req: Request, now: float) -> None:
        del self.waiting[req.request_id]
        self.running[req.request_id] = req
        # NOTE: `req.is_prefill`, inlined (as in `resume`: dozens of jobs a step)
        req.status = RequestStatus.PREFILLING if req.num_computed_tokens < req.prefill_len else RequestStatus.DECODING
        req.cache_due = 0
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        req.queue_time += now - req.queue_enter_time

    def _detach(self, req: Request) -> None:
        rid = req.request_id
        # NOTE: the set its status names first (a resume or a pause moves dozens of jobs a step
        # under the queue policies); a request sits in one set at most, so this finds the same.
        status = req.status
        first = (
            self.kept
            if status is RequestStatus.PREEMPTED_KEPT
            else self.running
            if status is RequestStatus.DECODING or status is RequestStatus.PREFILLING
            else None
        )
        if first is not None and first.pop(rid, None) is not None:
            return
        for group in (self.running, self.waiting, self.swapped, self.kept):
            if group.pop(rid, None) is not None:
                return

    def preempt(
        self, req: Request, mode: PreemptionMode, reason: PreemptionReason, now: float, *, to_front: bool
    ) -> None:
        rid = req.request_id
        if mode is PreemptionMode.KEEP and self.running.pop(rid, None) is not None:
            # NOTE: a pause, dozens a step under the queue policies: the running job leaves the
            # running set for the kept one (what `_detach` finds first, and the KEEP branch below)
            req.status = RequestStatus.PREEMPTED_KEPT
            self.kept[rid] = req
            req.queue_enter_time = now
            req.num_preemptions += 1
            self.metrics.on_preempt(req, mode, reason, now)
            self.policy.on_preempted(req, now)
            return
        self._detach(req)
        if mode is PreemptionMode.RECOMPUTE:
            self.release_kv(req)
            self.plans.forget(rid)
            req.num_computed_tokens = 0
            req.prefill_len = req.num_tokens
            req.status = RequestStatus.PREEMPTED_RECOMPUTE
            self.waiting[rid] = req
            if to_front:
                self.waiting.move_to_end(rid, last=False)
        elif mode is PreemptionMode.SWAP:
            req.status = RequestStatus.PREEMPTED_SWAPPED
            self.swapped[rid] = req
        else:
            req.status = RequestStatus.PREEMPTED_KEPT
            self.kept[rid] = req
        req.queue_enter_time = now
        req.num_preemptions += 1
        self.metrics.on_preempt(req, mode, reason, now)
        self.policy.on_preempted(req, now)

    def pause(self, requests: list[Request], reason: PreemptionReason, now: float) -> None:
        """`preempt(req, KEEP, reason, now)` of each running request in turn (queue policies
        pause dozens a step), with the preemption counter added to once for all of them."""
        running, kept = self.running, self.kept
        status = RequestStatus.PREEMPTED_KEPT
        for req in requests:
            rid = req.request_id
            if running.pop(rid, None) is None:
                raise ValueError(f"{req!r} is not running; preempt it instead")
            req.status = status
            kept[rid] = req
            req.queue_enter_time = now
            req.num_preemptions += 1
        self.policy.on_paused(requests, now)
        self.metrics.on_pauses(requests, reason, now)

    def resume(self, req: Request, now: float, *, table_replaced: bool) -> None:
        if self.kept.pop(req.request_id, None) is None:  # NOTE: a kept job: `_detach`'s first find
            self._detach(req)
        self.running[req.request_id] = req
        req.status = RequestStatus.PREFILLING if req.num_computed_tokens < req.prefill_len else RequestStatus.DECODING
        req.cache_due = 0
        req.queue_time += now - req.queue_enter_time
        if table_replaced:
            self.plans.replace_table(req.request_id)

    def return_to_pool(self, req: Request, now: float) -> None:
        rid = req.request_id
        self.release_kv(req)
        self._detach(req)
        self.plans.forget(rid)
        del self.requests[rid]
        req.num_computed_tokens = 0
        req.prefill_len = req.num_tokens
        req.status = RequestStatus.WAITING
        req.worker_id = None
        req.queue_enter_time = now
        self.returned.append(req)
        self.metrics.num_requests -= 1  # NOTE: counted again where it is placed next, so once in all
        self.policy.on_finished(req, now)

    def withdraw(self, req: Request, now: float) -> None:
        """The request leaves this worker unfinished for the cluster to hold (an offline
        request giving way to online ones, core/offline.py): as `return_to_pool`, but not handed
        to the router. One that held KV counts as a priority preemption (recompute)."""
        held = not req.status.is_waiting
        self.return_to_pool(req, now)
        self.returned.pop()
        if held:
            req.num_preemptions += 1
            self.metrics.on_preempt(req, PreemptionMode.RECOMPUTE, PreemptionReason.PRIORITY, now)

    def hand_off(self, req: Request, now: float) -> None:
        """The request leaves this worker with its KV (disaggregation: its prefill is done and
        its KV moves to a decode worker). Unlike `return_to_pool` its blocks stay allocated
        under its id, for the cluster to free once the transfer is answered; the worker is
        told to drop the request (its blocks' contents are untouched until they are reused)."""
        rid = req.request_id
        self._detach(req)
        self.flush_blocks(req)
        self.plans.forget(rid)
        del self.requests[rid]
        req.worker_id = None
        self.metrics.num_requests -= 1  # NOTE: counted again where it is placed next, so once in all
        self.policy.on_finished(req, now)

    def end(self, req: Request, status: RequestStatus, now: float, message: str = "") -> None:
        rid = req.request_id
        kv = self.kv
        # NOTE: a request that owns its blocks registered none of them: parked too
        park = kv.prefix_caching and (req.prefix_salt is None or owns_blocks(req, kv))
        computed = self.computed_on_worker(req) if park else 0  # NOTE: before `_void`, as in `flush_blocks`
        if self.overlap:
            self._void(req)  # NOTE: the extra token of a step in flight is discarded, never streamed
        self._detach(req)
        if park:
            # NOTE: its salted blocks can never be found now: parked, not hashed (prefix.py)
            kv.free_parked(rid, computed // kv.block_size)
        else:
            kv.free(rid)
        if req.prefix_salt is not None:
            kv.forget_owner(rid)
            self.prefix_hits.pop(rid, None)
        self.plans.forget(rid)
        self.requests.pop(rid, None)
        req.status = status
        req.finish_time = now
        req.finish_message = message
        req.block_hashes = None  # NOTE: a 100k-token prompt's hashes are 6k ints; its blocks keep them
        self._finished.append(req)
        self.metrics.on_finish(req, now)
        self.policy.on_finished(req, now)

    def _expire(self, now: float) -> None:
        heap = self._expiry
        while heap and heap[0][0] <= now:
            _, rid = heapq.heappop(heap)
            req = self.requests.get(rid)
            if req is not None and req.status.is_waiting:
                self.end(req, RequestStatus.FINISHED_TIMEOUT, now, "queue timeout or deadline passed while waiting")

    # ------------------------------------------------------------------ failures
    def reset_worker(self, now: float, *, error_request_id: str = "", message: str = "") -> None:
        """The worker's state is lost or unreliable: every request it held is recomputed,
        except the one a failed step blamed, which ends with an error. Under overlap every step
        in flight is void (it was planned on the failed step's outcome)."""
        self._inflight.clear()
        held = [*self.running.values(), *self.kept.values(), *self.swapped.values()]
        for req in held:
            if req.request_id == error_request_id:
                self.end(req, RequestStatus.FINISHED_ERROR, now, message)
            else:
                self.preempt(req, PreemptionMode.RECOMPUTE, PreemptionReason.WORKER_RESET, now, to_front=True)
        if error_request_id in self.waiting:
            self.end(self.waiting[error_request_id], RequestStatus.FINISHED_ERROR, now, message)
        self.kv.clear_prefix_cache()  # NOTE: what the worker's cache holds is no longer known
        self.prefix_hits.clear()
        self.plans.reset()
        self.pending_tokens.clear()

    def evacuate(self, now: float) -> list[Request]:
        """The worker is gone: frees everything and returns its unfinished requests, reset
        to be prefilled again elsewhere (prompt + tokens generated so far)."""
        self._inflight.clear()
        out: list[Request] = []
        for req in [*self.running.values(), *self.kept.values(), *self.swapped.values(), *self.waiting.values()]:
            self.return_to_pool(req, now)
            out.append(req)
        self.returned = [r for r in self.returned if r not in out]
        self.kv.clear_prefix_cache()  # NOTE: a worker that comes back starts with an empty cache
        self.prefix_hits.clear()
        self.plans.clear()
        self.pending_tokens.clear()
        return out

    def assert_empty(self) -> None:
        """The leak check: no requests left and no blocks owned."""
        leftovers = [self.requests, self.waiting, self.running, self.swapped, self.kept]
        if any(leftovers):
            raise AssertionError(f"requests left on worker {self.worker_id}: {list(self.requests)}")
        self.kv.assert_empty()
