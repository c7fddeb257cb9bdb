"""Workers' schedulers under one router: the object both drivers (simulator, live loop)
feed arrivals into and drain outcomes from.

    submit(req, now)        router picks a worker (or holds it); the worker's queue takes it
    after_step(worker, out) finished requests leave the router's books; requests a policy
                            handed back (SCLS slices, a lost worker) are placed again
"""

from __future__ import annotations

from scheduler_service.core.metrics import MetricsRecorder
from scheduler_service.core.preemption import RejectReason
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.router import Router, WorkerLoad


class Cluster:
    def __init__(self, schedulers: list[Scheduler], router: Router, metrics: MetricsRecorder) -> None:
        self.schedulers = {s.worker_id: s for s in schedulers}
        self.router = router
        self.metrics = metrics
        self.healthy = {s.worker_id: True for s in schedulers}
        self.rejected: list[Request] = []

    def loads(self) -> list[WorkerLoad]:
        return [
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

    def submit(self, request: Request, now: float) -> RejectReason | None:
        worker = self.router.select(request, self.loads(), now)
        if worker is None:
            if not any(self.healthy.values()):
                return self._reject(request, RejectReason.NO_WORKER, now)
            self.router.held.append(request)
            return None
        return self._place(request, worker, now)

    def _place(self, request: Request, worker: int, now: float) -> RejectReason | None:
        reason = self.schedulers[worker].add_request(request, now)
        if reason is not None:
            self.router.on_request_left(request, worker, now)
            self.rejected.append(request)
        return reason

    def _reject(self, request: Request, reason: RejectReason, now: float) -> RejectReason:
        request.status = RequestStatus.FINISHED_REJECTED
        request.finish_time = now
        request.finish_message = str(reason)
        self.metrics.on_reject(request, reason, now)
        self.rejected.append(request)
        return reason

    def release_held(self, now: float) -> None:
        for request, worker in self.router.release(self.loads(), now):
            self._place(request, worker, now)

    def after_step(self, worker: int, finished: list[Request], now: float) -> None:
        for request in finished:
            self.router.on_request_left(request, worker, now)
        for request in self.schedulers[worker].pop_returned():
            self.router.on_request_left(request, worker, now)
            self.submit(request, now)

    def mark_down(self, worker: int, now: float) -> list[Request]:
        """A worker died: its requests go to the others (recompute) and still finish."""
        self.healthy[worker] = False
        moved = self.schedulers[worker].evacuate(now)
        for request in moved:
            self.router.on_request_left(request, worker, now)
            self.submit(request, now)
        return moved

    def mark_up(self, worker: int) -> None:
        self.healthy[worker] = True

    @property
    def num_unfinished(self) -> int:
        return sum(s.num_unfinished for s in self.schedulers.values()) + len(self.router.held)
