"""Cluster: the workers' schedulers under one router, and the one way any driver moves them.
A driver (the simulator's event loop, a live worker loop, a benchmark) is only a clock plus
an executor:

    cluster.submit(request, now)          length source, router: a worker's queue or the pool
    cluster.release_held(now)             the router places what it held (global batching)
    plan = cluster.plan_step(worker, now) the policy decides; None when nothing is to run
    ... the executor runs the plan (cost model, or a worker over gRPC) ...
    out = cluster.complete_step(worker, result, now)     tokens appended, stops checked
    cluster.abort(id, now) / cluster.finish(id, status, now)   a client or a stop string
    cluster.mark_down(worker, now) / mark_up(worker, now)      a lost worker's requests move
    cluster.add_worker(spec, now) / remove_worker(worker, now) the worker set changes (scaling):
                                          a removed worker's requests move as a lost one's do
    cluster.pop_ended()                   every request that ended since the last call

Offline-class requests (spec.max_offline_waiting > 0, colocated clusters) wait in the
cluster's offline queue instead (core/offline.py): a worker takes them in `plan_step`, behind
its online requests, into the room these leave (`offline_room`, the driver's rule); an online
request placed on a worker sends the offline ones that must give way back to the queue's head.

Requests that leave a worker unfinished (a policy returned them, their worker died) go back
through the router (offline ones to the offline queue). Every request that ends after its
submission was accepted comes out of `pop_ended` exactly once: finished, aborted, timed out, or
rejected on re-routing. Nothing outside this class touches the router's pool or the offline queue.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace

from kvstore.accounting import KVAccounting
from scheduler_service.cluster.spec import ClusterSpec, WorkerSpec
from scheduler_service.core.metrics import MetricsRecorder
from scheduler_service.core.offline import OfflineQueue, Room, is_offline, to_place, yielding
from scheduler_service.core.policy import Policy, build_policy
from scheduler_service.core.preemption import RejectReason
from scheduler_service.core.prefix import cached_prefix
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.scheduler import Scheduler, StepOutputs
from scheduler_service.routers import Router, WorkerLoad
from sluice.contract.plan import KVTransfer, KVTransferResult, StepPlan, StepResult

# Asked about the worker the router chose for a new request: None admits, a reason refuses.
Admission = Callable[[Request, int], RejectReason | None]
# What a worker's online requests leave idle for offline ones (core/offline.py).
OfflineRoom = Callable[[int], Room]


class Cluster:
    def __init__(
        self,
        spec: ClusterSpec,
        schedulers: list[Scheduler],
        router: Router,
        kv: KVAccounting,
        metrics: MetricsRecorder,
        timer: Callable[[], float] | None = None,
    ) -> None:
        self.spec = spec
        self.schedulers = {s.worker_id: s for s in schedulers}
        self.kv = kv
        self.metrics = metrics
        self.healthy = {s.worker_id: True for s in schedulers}  # read it; change it with mark_down/mark_up
        self._router = router
        self._timer = timer
        self._ended: list[Request] = []
        self._admit: Admission | None = None  # set during submit()
        queued = spec.max_offline_waiting > 0 and not spec.disaggregated
        self.offline = OfflineQueue(spec.max_offline_waiting) if queued else None
        self.offline_room: OfflineRoom = self._every_seat  # the driver may set its own rule
        # worker -> ids of the offline requests placed there, in placement order (a dict as an ordered set)
        self._offline_placed: dict[int, dict[str, None]] = {}

    # ------------------------------------------------------------------ intake
    def submit(self, request: Request, now: float, admit: Admission | None = None) -> RejectReason | None:
        """Places a new request (or holds it in the router's pool); a reason when refused.
        `admit` (the live scheduler's SLO-aware admission) is asked about the worker the router
        chose before the request is placed there, and may refuse it (not for disaggregated
        clusters, whose placement is two-staged)."""
        self.spec.length_source.assign(request)
        if self.offline is not None and is_offline(request):
            # NOTE: never asked to `admit`: it has no latency SLO to miss, and it yields
            if not self.any_healthy:
                return self._reject(request, RejectReason.NO_WORKER, now)
            if self.offline.full:
                return self._reject(request, RejectReason.OFFLINE_QUEUE_FULL, now)
            self.offline.push(request)
            return None
        bound = self.spec.max_waiting
        if bound is not None and self.num_waiting >= bound:
            return self._reject(request, RejectReason.QUEUE_FULL, now)
        self._admit = admit
        try:
            return self._route(request, now)
        finally:
            self._admit = None

    def release_held(self, now: float) -> None:
        router = self._router
        if not router.held:
            return  # NOTE: called after every event: no loads built while the router holds nothing
        for request, worker in router.release(self.loads(), now):
            self._place_or_end(request, worker, now)

    # ------------------------------------------------------------------ one step
    def plan_step(self, worker: int, now: float) -> StepPlan | None:
        """The worker's next plan; None when nothing is to run (answered here)."""
        sched = self.schedulers[worker]
        if self.offline:
            self._take_offline(worker, now)
        timer = self._timer
        start = timer() if timer is not None else 0.0
        plan = sched.schedule(now)
        if timer is not None:
            self.metrics.on_schedule_overhead(timer() - start)
        self._settle(worker, sched.pop_finished(), now)
        if plan.is_empty:
            sched.on_step_result(StepResult(plan.step_id, {}, 0.0), now)
            return None
        return plan

    def complete_step(self, worker: int, result: StepResult, now: float) -> StepOutputs:
        out = self.schedulers[worker].on_step_result(result, now)
        self._settle(worker, out.finished, now)
        return out

    # ------------------------------------------------------------------ outside events
    def abort(self, request_id: str, now: float, message: str = "aborted") -> bool:
        """Ends an unfinished request wherever it is (a worker's sets or the router's pool);
        its blocks are free at once and its worker is told next step."""
        return self.finish(request_id, RequestStatus.FINISHED_ABORTED, now, message)

    def finish(self, request_id: str, status: RequestStatus, now: float, message: str = "") -> bool:
        """Ends a request for a reason found outside the core (an abort, a stop string in the text)."""
        for worker, sched in self.schedulers.items():
            if sched.finish(request_id, status, now, message):
                self._settle(worker, sched.pop_finished(), now)
                return True
        held = self._router.held
        for i, request in enumerate(held):
            if request.request_id == request_id:
                del held[i]
                self._end_unplaced(request, status, now, message)
                return True
        if self.offline is not None and (request := self.offline.remove(request_id)) is not None:
            self._end_unplaced(request, status, now, message)
            return True
        return False

    def _end_unplaced(self, request: Request, status: RequestStatus, now: float, message: str) -> None:
        request.status = status
        request.finish_time = now
        request.finish_message = message
        self.metrics.on_finish(request, now)
        self._ended.append(request)

    def update_prediction(self, request_id: str, tokens: int, source: str, now: float) -> bool:
        """A predicted output length that arrived after the request was submitted: applied
        wherever the request is (a worker's policy re-files it; in the router's pool it is read
        when the request is placed). False when the request has already ended."""
        if any(s.update_prediction(request_id, tokens, source, now) for s in self.schedulers.values()):
            return True
        for request in (*self._router.held, *(self.offline or ())):
            if request.request_id == request_id:
                request.predicted_output_tokens = max(1, min(tokens, request.max_tokens))
                request.length_source = source
                return True
        return False

    def mark_down(self, worker: int, now: float) -> list[Request]:
        """A worker died: its requests go to the others (recompute) and still finish."""
        self.healthy[worker] = False
        moved = self.schedulers[worker].evacuate(now)
        for request in moved:
            self._router.on_request_left(request, worker, now)
            if self._route(request, now) is not None:
                self._ended.append(request)
        if self.offline and not self.any_healthy:
            for request in self.offline.clear():
                self._ended.append(request)
                self._reject(request, RejectReason.NO_WORKER, now)
        return moved

    def mark_up(self, worker: int, now: float) -> None:
        self.healthy[worker] = True
        self.release_held(now)

    def add_worker(self, worker: WorkerSpec, now: float) -> int:
        """A worker joins the running cluster (scaling up): its own KV pool and policy, built
        as build_cluster builds every worker's, then the router's pool is offered to it.
        Returns its id: ids are never reused, so the spec's `workers[id]` stays its own."""
        worker_id = len(self.spec.workers)
        spec = replace(self.spec, workers=(*self.spec.workers, worker))  # checks the block size
        policy = build_policy(spec.policy, spec.policy_context(worker_id))
        manager = self.kv.add_worker(
            worker_id, worker.num_gpu_blocks, worker.num_cpu_blocks, worker.block_size, spec.prefix_caching
        )
        self.spec = spec
        self.schedulers[worker_id] = Scheduler(worker_id, manager, policy, spec.scheduler_config(), self.metrics)
        self.healthy[worker_id] = True
        self.release_held(now)
        return worker_id

    def remove_worker(self, worker: int, now: float) -> list[Request]:
        """A worker leaves the cluster for good (scaling down): its requests are re-routed
        and recomputed exactly as a lost worker's (or end when no worker is left), then its
        scheduler and KV pool are dropped. The driver must not have a step of it in flight."""
        moved = self.mark_down(worker, now)
        del self.schedulers[worker], self.healthy[worker], self.kv.workers[worker]
        return moved

    def reject_leftovers(self, now: float) -> None:
        """Requests no policy could ever place (e.g. more KV than a worker has) end as
        rejected, so every request of a trace is accounted for (the simulator's last sweep)."""
        for worker, sched in self.schedulers.items():
            for rid in list(sched.requests):
                sched.finish(rid, RequestStatus.FINISHED_REJECTED, now, "unschedulable: never fit this worker")
            self._settle(worker, sched.pop_finished(), now)
        for request in self._router.held:
            request.status = RequestStatus.FINISHED_REJECTED
            self.metrics.on_reject(request, RejectReason.UNSCHEDULABLE, now)
            self._ended.append(request)
        self._router.held.clear()
        for request in self.offline.clear() if self.offline is not None else ():
            request.status = RequestStatus.FINISHED_REJECTED
            self.metrics.on_reject(request, RejectReason.UNSCHEDULABLE, now)
            self._ended.append(request)

    def pop_transfers(self) -> list[KVTransfer]:
        """KV transfers between workers for the driver to run (only a DisaggCluster issues any)."""
        return []

    def complete_transfer(self, result: KVTransferResult, now: float) -> None:
        raise RuntimeError(f"transfer {result.transfer_id} answered, but a colocated cluster issues none")

    def pop_ended(self) -> list[Request]:
        ended, self._ended = self._ended, []
        return ended

    # ------------------------------------------------------------------ queries
    def loads(self, request: Request | None = None) -> list[WorkerLoad]:
        """Each worker's load; with `request` (for a router that wants it), also how many of
        its tokens the worker's prefix cache holds and the tokens its queue has to compute."""
        loads = [
            WorkerLoad(
                worker_id=w,
                healthy=self.healthy[w],
                num_waiting=len(s.waiting),
                num_running=len(s.running),
                free_gpu_blocks=s.kv.gpu.num_free,
                total_gpu_blocks=s.kv.gpu.num_blocks,
            )
            for w, s in self.schedulers.items()
        ]
        if request is not None:
            # NOTE: O(workers x (request blocks + waiting requests)) per routed request; only
            # the prefix-aware router asks for it.
            for load in loads:
                sched = self.schedulers[load.worker_id]
                if load.healthy:
                    load.cached_tokens = self._cached_tokens(sched, request)
                    load.waiting_tokens = sum(r.num_tokens_to_compute for r in sched.waiting.values())
        return loads

    @staticmethod
    def _cached_tokens(sched: Scheduler, request: Request) -> int:
        kv = sched.kv
        if not kv.prefix_caching:
            return 0
        limit = (request.num_tokens - 1) // kv.block_size
        return len(cached_prefix(kv, request, limit)) * kv.block_size

    def next_wakeup(self, now: float, workers: Iterable[int]) -> float | None:
        """When the router or one of these workers' policies wants a step even if nothing
        else happens (e.g. a policy holds requests back until then)."""
        due = self._router.next_release(now)
        schedulers = self.schedulers
        for w in workers:  # NOTE: after every simulated event: no lists built
            t = schedulers[w].policy.next_wakeup(now)
            if t is not None and (due is None or t < due):
                due = t
        return due

    def asks_for_wakeups(self) -> bool:
        """Whether the router or a worker's policy implements a wake-up (`next_release`,
        `next_wakeup`); when none does, `next_wakeup` is always None and a driver need not ask
        it after every event."""
        if type(self._router).next_release is not Router.next_release:
            return True
        return any(type(s.policy).next_wakeup is not Policy.next_wakeup for s in self.schedulers.values())

    def holds_offline(self, worker: int) -> bool:
        """Whether offline requests from the offline queue are on the worker (O(1) when none are:
        online admission and placement ask it for every request)."""
        placed = self._offline_placed.get(worker)
        if not placed:
            return False
        requests = self.schedulers[worker].requests
        if len(placed) > 2 * len(requests):
            # NOTE: those that ended or moved drop out, now and then
            placed = self._offline_placed[worker] = {rid: None for rid in placed if rid in requests}
        # NOTE: the first placed mostly end first: ids that left are dropped from the front
        while placed and (first := next(iter(placed))) not in requests:
            del placed[first]
        return bool(placed)

    def has_work(self, worker: int) -> bool:
        sched = self.schedulers[worker]
        if sched.has_work:
            return True
        queue = self.offline
        return bool(queue) and self.healthy[worker] and to_place(sched, queue, self.offline_room(worker)) > 0

    def overlaps(self, worker: int) -> bool:
        """The worker's next plan may be made while a step of it is in flight (the spec asks
        for overlap and the policy keeps no state between plan and result)."""
        return self.schedulers[worker].overlap

    def is_in_flight(self, worker: int, step_id: int) -> bool:
        """The step is unanswered and still valid (a failure before it voids it)."""
        return self.schedulers[worker].is_in_flight(step_id)

    @property
    def any_healthy(self) -> bool:
        return any(self.healthy.values())

    @property
    def num_held(self) -> int:
        return len(self._router.held)

    @property
    def num_waiting(self) -> int:
        return sum(len(s.waiting) for s in self.schedulers.values()) + self.num_held

    @property
    def num_unfinished(self) -> int:
        return sum(s.num_unfinished for s in self.schedulers.values()) + self.num_held + self.num_offline_queued

    @property
    def num_offline_queued(self) -> int:
        """Offline requests in the offline queue (not counted in num_waiting, max_waiting's measure)."""
        return len(self.offline) if self.offline is not None else 0

    @property
    def router(self) -> Router:
        """The router, for reading its state (reports, tests); it is changed only through this class."""
        return self._router

    # ------------------------------------------------------------------ internals
    def _route(self, request: Request, now: float) -> RejectReason | None:
        router = self._router
        if self.offline is not None and is_offline(request):
            if not self.any_healthy:
                return self._reject(request, RejectReason.NO_WORKER, now)
            self.offline.push_front([request])  # NOTE: a re-route: it was admitted, it goes first
            return None
        worker = router.select(request, self.loads(request if router.wants_prefix_match else None), now)
        if worker is None:
            if not self.any_healthy:
                return self._reject(request, RejectReason.NO_WORKER, now)
            self._router.held.append(request)
            return None
        if self._admit is not None and (refused := self._admit(request, worker)) is not None:
            router.on_request_left(request, worker, now)
            return self._reject(request, refused, now)
        reason = self._place(request, worker, now)
        if reason is None and self.offline is not None:
            self._yield_offline(worker, now)
        return reason

    def _place(self, request: Request, worker: int, now: float) -> RejectReason | None:
        reason = self.schedulers[worker].add_request(request, now)
        if reason is not None:
            self._router.on_request_left(request, worker, now)
        return reason

    def _every_seat(self, worker: int) -> Room:
        return Room(self.schedulers[worker].config.max_num_seqs)

    def _take_offline(self, worker: int, now: float) -> None:
        """The worker takes queued offline requests into the seats its online ones leave idle."""
        queue = self.offline
        if queue is None or not self.healthy[worker]:
            return
        placed = self._offline_placed.setdefault(worker, {})
        for _ in range(to_place(self.schedulers[worker], queue, self.offline_room(worker))):
            request = queue.pop()
            placed.pop(request.request_id, None)
            placed[request.request_id] = None
            self._place_or_end(request, worker, now)

    def _yield_offline(self, worker: int, now: float) -> None:
        """An online request was placed on the worker: its offline requests that must give way
        go back to the offline queue's head (core/offline.py)."""
        assert self.offline is not None
        if not self.holds_offline(worker):
            return
        sched = self.schedulers[worker]
        out = yielding(sched, self.offline_room(worker).seats, self._offline_placed[worker])
        for request in out:
            sched.withdraw(request, now)
            self._router.on_request_left(request, worker, now)
        self.offline.push_front(out)

    def _place_or_end(self, request: Request, worker: int, now: float) -> None:
        if self._place(request, worker, now) is not None:
            self._ended.append(request)

    def _reject(self, request: Request, reason: RejectReason, now: float) -> RejectReason:
        request.status = RequestStatus.FINISHED_REJECTED
        request.finish_time = now
        request.finish_message = str(reason)
        self.metrics.on_reject(request, reason, now)
        return reason

    def _settle(self, worker: int, finished: list[Request], now: float) -> None:
        """Finished requests leave the router's books; requests the policy handed back are
        placed again (possibly on another worker)."""
        router = self._router
        lengths = self.spec.length_source
        for request in finished:
            router.on_request_left(request, worker, now)
            lengths.observe(request)
        self._ended += finished
        for request in self.schedulers[worker].pop_returned():
            router.on_request_left(request, worker, now)
            if self._route(request, now) is not None:
                self._ended.append(request)
