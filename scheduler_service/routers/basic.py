"""The plain routers: `round_robin` (the next healthy worker in turn) and `least_work`
(the worker with the fewest outstanding tokens: still to prefill plus predicted to decode)."""

from __future__ import annotations

from collections.abc import Sequence

from scheduler_service.core.request import Request
from scheduler_service.routers.base import ROUTERS, Router, WorkerLoad, healthy_ids


@ROUTERS.register("round_robin")
class RoundRobinRouter(Router):
    name = "round_robin"

    def __init__(self) -> None:
        super().__init__()
        self._next = 0

    def select(self, request: Request, loads: Sequence[WorkerLoad], now: float) -> int | None:
        n = len(loads)
        for i in range(n):
            load = loads[(self._next + i) % n]
            if load.healthy:
                self._next = (self._next + i + 1) % n
                return load.worker_id
        return None


@ROUTERS.register("least_work")
class LeastWorkRouter(Router):
    """Least outstanding work: tokens still to prefill plus (predicted) tokens to decode."""

    name = "least_work"

    def __init__(self) -> None:
        super().__init__()
        self.work: dict[int, int] = {}
        self._charged: dict[str, tuple[int, int]] = {}

    @staticmethod
    def estimate(request: Request) -> int:
        return request.num_tokens_to_compute + request.remaining_output_estimate

    def select(self, request: Request, loads: Sequence[WorkerLoad], now: float) -> int | None:
        ids = healthy_ids(loads)
        if not ids:
            return None
        best = min(ids, key=lambda w: (self.work.get(w, 0), w))
        cost = self.estimate(request)
        self.work[best] = self.work.get(best, 0) + cost
        self._charged[request.request_id] = (best, cost)
        return best

    def on_request_left(self, request: Request, worker_id: int, now: float) -> None:
        charged = self._charged.pop(request.request_id, None)
        if charged is not None:
            self.work[charged[0]] -= charged[1]
