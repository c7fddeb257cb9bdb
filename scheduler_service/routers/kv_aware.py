"""`kv_aware`: the worker with the most free KV blocks once its waiting queue is admitted
(free blocks minus its waiting requests times the mean prompt blocks it was sent); ties go
to the worker with fewer running requests."""

from __future__ import annotations

from collections.abc import Sequence

from scheduler_service.core.request import Request
from scheduler_service.routers.base import ROUTERS, Router, RouterContext, WorkerLoad


@ROUTERS.register("kv_aware")
class KVAwareRouter(Router):
    name = "kv_aware"

    def __init__(self, block_size: int = 16) -> None:
        super().__init__()
        self.block_size = block_size
        self._sent: dict[int, list[int]] = {}  # worker -> [requests on it, their prompt blocks]
        self._placed: dict[str, tuple[int, int]] = {}

    @classmethod
    def create(cls, options: dict[str, str], ctx: RouterContext) -> Router:
        if options:
            raise ValueError(f"router 'kv_aware' takes no options, got {sorted(options)}")
        return cls(ctx.block_size)

    def effective_free(self, load: WorkerLoad) -> float:
        n, blocks = self._sent.get(load.worker_id, (0, 0))
        mean_blocks = blocks / n if n else 0.0
        return load.free_gpu_blocks - load.num_waiting * mean_blocks

    def select(self, request: Request, loads: Sequence[WorkerLoad], now: float) -> int | None:
        healthy = [w for w in loads if w.healthy]
        if not healthy:
            return None
        best = max(healthy, key=lambda w: (self.effective_free(w), -w.num_running, -w.worker_id))
        blocks = -(-request.num_tokens // self.block_size)
        sent = self._sent.setdefault(best.worker_id, [0, 0])
        sent[0] += 1
        sent[1] += blocks
        self._placed[request.request_id] = (best.worker_id, blocks)
        return best.worker_id

    def on_request_left(self, request: Request, worker_id: int, now: float) -> None:
        placed = self._placed.pop(request.request_id, None)
        if placed is not None:
            sent = self._sent[placed[0]]
            sent[0] -= 1
            sent[1] -= placed[1]
