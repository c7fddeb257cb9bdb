"""The per-worker scheduling core, driven identically by the simulator and the live service:

    add_request(req, now) -> RejectReason | None      # bounded queue, length check
    abort(request_id, now)                            # KV freed now, worker told next step
    plan = schedule(now)                              # the policy fills a StepBuilder
    outputs = on_step_result(result, now)             # tokens appended, stops checked

The scheduler owns the request sets (waiting FCFS with preempted requests at the head,
running in admission order, swapped, kept) and the worker's KV block tables; it turns
the policy's decisions into a StepPlan that sends new requests once in full and known
ones as a diff. A failed step or a lost worker resets the worker's requests to recompute.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field

from kvstore.accounting import KVCacheManager
from scheduler_service.core.budget import TokenBudget
from scheduler_service.core.metrics import MetricsRecorder
from scheduler_service.core.plan import CachedRequestData, NewRequestData, StepPlan, StepResult
from scheduler_service.core.policy import Policy
from scheduler_service.core.preemption import PreemptionMode, PreemptionReason, RejectReason
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.step_builder import StepBuilder


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256  # sequences per step
    max_num_batched_tokens: int = 8192  # tokens per step (a policy's budget may be smaller)
    max_model_len: int = 4096  # prompt + output limit of the model
    max_waiting: int = 100_000  # bound of the waiting queue; beyond it requests are rejected
    queue_timeout_s: float | None = None  # a request never admitted within this is dropped
    drop_expired_deadlines: bool = False  # drop waiting requests whose JCT deadline passed


@dataclass(slots=True)
class StepOutputs:
    tokens: list[tuple[Request, int]] = field(default_factory=list)  # (request, new token id)
    finished: list[Request] = field(default_factory=list)


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
        self._known: set[str] = set()  # requests the worker holds
        self._sent_blocks: dict[str, int] = {}  # blocks of each table the worker has been sent
        self._table_replaced: set[str] = set()  # tables to send whole next time
        self._pending_releases: list[str] = []
        self._expiry: list[tuple[float, str]] = []
        self._step_id = 0
        self._inflight: StepPlan | None = None

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
        if len(self.waiting) >= self.config.max_waiting:
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
        self._finish(request, status, now, "aborted" if status is RequestStatus.FINISHED_ABORTED else "")
        return True

    # ------------------------------------------------------------------ one step
    def schedule(self, now: float) -> StepPlan:
        self._expire(now)
        budget = TokenBudget(self.policy.token_budget(now), self.config.max_num_seqs)
        step = StepBuilder(self, budget, now)
        self.policy.schedule(step, now)
        plan = self._build_plan(step)
        self._inflight = plan
        return plan

    def _build_plan(self, step: StepBuilder) -> StepPlan:
        new: list[NewRequestData] = []
        ids: list[str] = []
        blocks: list[tuple[int, ...]] = []
        resumed: list[bool] = []
        computed: list[int] = []
        sample: list[str] = []
        tables, running, known = self.kv.gpu_tables, self.running, self._known
        sent, replaced = self._sent_blocks, self._table_replaced
        for rid, n in step.scheduled.items():
            req = running[rid]
            table = tables[rid]
            size = len(table)
            if rid not in known:
                new.append(self._new_request_data(req, table))
                known.add(rid)
                replaced.discard(rid)
            elif rid in replaced:
                replaced.discard(rid)
                ids.append(rid)
                blocks.append(tuple(table))
                resumed.append(True)
                computed.append(req.num_computed_tokens)
            elif size > sent[rid]:
                # NOTE: only requests whose table grew are listed: a 256-decode step whose
                # blocks did not change sends no per-request diff at all.
                ids.append(rid)
                blocks.append(tuple(table[sent[rid] :]))
                resumed.append(False)
                computed.append(req.num_computed_tokens)
            sent[rid] = size
            if req.num_computed_tokens + n >= req.num_prompt_tokens + req.num_output_tokens:
                sample.append(rid)
        self._step_id += 1
        releases = tuple(self._pending_releases)
        self._pending_releases.clear()
        return StepPlan(
            step_id=self._step_id,
            worker_id=self.worker_id,
            new_requests=tuple(new),
            cached_requests=CachedRequestData(tuple(ids), tuple(blocks), tuple(resumed), tuple(computed)),
            num_scheduled_tokens=step.scheduled,
            sample_ids=frozenset(sample),
            release_ids=releases,
            kv_moves=tuple(step.kv_moves),
            token_budget=step.budget.max_tokens,
            metadata=step.metadata,
        )

    @staticmethod
    def _new_request_data(req: Request, table: list[int]) -> NewRequestData:
        token_ids = tuple(req.all_token_ids()) if req.prompt_token_ids is not None else ()
        return NewRequestData(
            request_id=req.request_id,
            prompt_token_ids=token_ids,
            num_tokens=req.num_tokens,
            sampling=req.sampling,
            block_ids=tuple(table),
            num_computed_tokens=req.num_computed_tokens,
            num_output_tokens=req.num_output_tokens,
            traceparent=req.traceparent,
        )

    def on_step_result(self, result: StepResult, now: float) -> StepOutputs:
        plan, self._inflight = self._inflight, None
        if plan is None or result.step_id != plan.step_id:
            raise RuntimeError(f"step result {result.step_id} does not answer the plan in flight")
        if result.error is not None:
            self.reset_worker(now, error_request_id=result.error.request_id, message=result.error.message)
            return StepOutputs(finished=self.pop_finished())
        tokens: list[tuple[Request, int]] = []
        running = self.running
        sampled = result.sampled_token_ids
        decoding = RequestStatus.DECODING
        max_model_len = self.config.max_model_len
        for rid, n in plan.num_scheduled_tokens.items():
            req = running.get(rid)
            if req is None:  # aborted while the step ran
                continue
            req.num_computed_tokens += n
            if req.status is not decoding and req.num_computed_tokens >= req.prefill_len:
                req.status = decoding
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
                    self._finish(req, stop, now)
        if plan.num_scheduled_tokens:
            self.metrics.on_step(self.worker_id, plan, result, now, self.kv)
        self.policy.on_step_result(plan, result, now)
        return StepOutputs(tokens, self.pop_finished())

    def _stop_status(self, req: Request, token: int) -> RequestStatus | None:
        sp = req.sampling
        n = req.num_output_tokens
        if n >= sp.min_tokens and ((token in req.eos_token_ids and not sp.ignore_eos) or token in sp.stop_token_ids):
            return RequestStatus.FINISHED_STOPPED
        if n >= req.max_tokens or req.num_prompt_tokens + n >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # ------------------------------------------------------------------ queries
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.kept or self._pending_releases)

    @property
    def has_step_in_flight(self) -> bool:
        return self._inflight is not None

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def pop_finished(self) -> list[Request]:
        done, self._finished = self._finished, []
        return done

    def pop_returned(self) -> list[Request]:
        back, self.returned = self.returned, []
        return back

    def finish(self, request_id: str, status: RequestStatus, now: float, message: str = "") -> bool:
        """Ends a request for a reason found outside the core (a stop string in the text)."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._finish(request, status, now, message)
        return True

    # ------------------------------------------------------------------ transitions
    def _admit(self, req: Request, now: float) -> None:
        del self.waiting[req.request_id]
        self.running[req.request_id] = req
        req.status = RequestStatus.PREFILLING if req.is_prefill else RequestStatus.DECODING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        req.queue_time += now - req.queue_enter_time

    def _detach(self, req: Request) -> None:
        rid = req.request_id
        for group in (self.running, self.waiting, self.swapped, self.kept):
            if group.pop(rid, None) is not None:
                return

    def _forget(self, rid: str) -> None:
        """The worker must drop the request (its blocks are already free here)."""
        self._sent_blocks.pop(rid, None)
        self._table_replaced.discard(rid)
        if rid in self._known:
            self._known.discard(rid)
            self._pending_releases.append(rid)

    def _preempt(
        self, req: Request, mode: PreemptionMode, reason: PreemptionReason, now: float, *, to_front: bool
    ) -> None:
        rid = req.request_id
        self._detach(req)
        if mode is PreemptionMode.RECOMPUTE:
            self.kv.free(rid)
            self._forget(rid)
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

    def _resume(self, req: Request, now: float, *, table_replaced: bool) -> None:
        self._detach(req)
        self.running[req.request_id] = req
        req.status = RequestStatus.PREFILLING if req.is_prefill else RequestStatus.DECODING
        req.queue_time += now - req.queue_enter_time
        if table_replaced:
            self._table_replaced.add(req.request_id)

    def _return_to_pool(self, req: Request, now: float) -> None:
        rid = req.request_id
        self._detach(req)
        self.kv.free(rid)
        self._forget(rid)
        del self.requests[rid]
        req.num_computed_tokens = 0
        req.prefill_len = req.num_tokens
        req.status = RequestStatus.WAITING
        req.worker_id = None
        req.queue_enter_time = now
        self.returned.append(req)
        self.metrics.num_requests -= 1  # NOTE: counted again where it is placed next, so once in all
        self.policy.on_finished(req, now)

    def _finish(self, req: Request, status: RequestStatus, now: float, message: str = "") -> None:
        rid = req.request_id
        self._detach(req)
        self.kv.free(rid)
        self._forget(rid)
        self.requests.pop(rid, None)
        req.status = status
        req.finish_time = now
        req.finish_message = message
        self._finished.append(req)
        self.metrics.on_finish(req, now)
        self.policy.on_finished(req, now)

    def _expire(self, now: float) -> None:
        heap = self._expiry
        while heap and heap[0][0] <= now:
            _, rid = heapq.heappop(heap)
            req = self.requests.get(rid)
            if req is not None and req.status.is_waiting:
                self._finish(req, RequestStatus.FINISHED_TIMEOUT, now, "queue timeout or deadline passed while waiting")

    # ------------------------------------------------------------------ failures
    def reset_worker(self, now: float, *, error_request_id: str = "", message: str = "") -> None:
        """The worker's state is lost or unreliable: every request it held is recomputed,
        except the one a failed step blamed, which ends with an error."""
        self._inflight = None
        held = [*self.running.values(), *self.kept.values(), *self.swapped.values()]
        for req in held:
            if req.request_id == error_request_id:
                self._finish(req, RequestStatus.FINISHED_ERROR, now, message)
            else:
                self._preempt(req, PreemptionMode.RECOMPUTE, PreemptionReason.WORKER_RESET, now, to_front=True)
        if error_request_id in self.waiting:
            self._finish(self.waiting[error_request_id], RequestStatus.FINISHED_ERROR, now, message)
        self._pending_releases = sorted(set(self._pending_releases) | self._known)
        self._known.clear()
        self._sent_blocks.clear()
        self._table_replaced.clear()

    def evacuate(self, now: float) -> list[Request]:
        """The worker is gone: frees everything and returns its unfinished requests, reset
        to be prefilled again elsewhere (prompt + tokens generated so far)."""
        self._inflight = None
        out: list[Request] = []
        for req in [*self.running.values(), *self.kept.values(), *self.swapped.values(), *self.waiting.values()]:
            self._return_to_pool(req, now)
            out.append(req)
        self.returned = [r for r in self.returned if r not in out]
        self._known.clear()
        self._pending_releases.clear()
        return out

    def assert_empty(self) -> None:
        """The leak check: no requests left and no blocks owned."""
        leftovers = [self.requests, self.waiting, self.running, self.swapped, self.kept]
        if any(leftovers):
            raise AssertionError(f"requests left on worker {self.worker_id}: {list(self.requests)}")
        self.kv.assert_empty()
