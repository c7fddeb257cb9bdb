"""The router contract: global scheduling across workers, which worker's queue a request joins.

A router sees one `WorkerLoad` per worker and answers a worker id, or None to hold the
request in its own pool (routers that batch globally, like SCLS's, release held
requests at `next_release`). It is told when a request leaves a worker so load
estimates stay exact. Pure: no clock, no I/O. Registered by name in `ROUTERS`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduler_service.core.policy import parse_policy_spec
from scheduler_service.core.request import Request
from sluice.common.registry import Registry

if TYPE_CHECKING:
    from scheduler_service.costmodel.base import CostModel


@dataclass(slots=True)
class WorkerLoad:
    worker_id: int
    healthy: bool
    num_waiting: int
    num_running: int
    free_gpu_blocks: int
    total_gpu_blocks: int
    # Filled only for a router that `wants_prefix_match`:
    cached_tokens: int = 0  # of the request being placed, found in this worker's prefix cache
    waiting_tokens: int = 0  # tokens its waiting requests still have to compute


@dataclass(frozen=True, slots=True)
class RouterContext:
    """What a router may know about the workers it places on (all workers alike)."""

    block_size: int = 16
    num_gpu_blocks: int = 0  # per worker; 0 = unknown
    max_model_len: int = 4096
    max_num_seqs: int = 256
    cost_model: CostModel | None = None


class Router(ABC):
    name = "abstract"
    # A router that sets this is given, in each WorkerLoad of `select`, how many of the
    # request's tokens that worker's prefix cache holds (a lookup per worker per request).
    wants_prefix_match = False

    def __init__(self) -> None:
        self.held: list[Request] = []

    @classmethod
    def create(cls, options: dict[str, str], ctx: RouterContext) -> Router:
        """Builds the router from `name:key=value,...` options; routers without options
        take none."""
        if options:
            raise ValueError(f"router {cls.name!r} takes no options, got {sorted(options)}")
        return cls()

    @abstractmethod
    def select(self, request: Request, loads: Sequence[WorkerLoad], now: float) -> int | None:
        """The worker for `request`, or None to hold it in `self.held`."""

    def on_request_left(self, request: Request, worker_id: int, now: float) -> None:
        """`request` finished on, or was returned by, `worker_id`."""

    def release(self, loads: Sequence[WorkerLoad], now: float) -> list[tuple[Request, int]]:
        """Held requests to place now (routers that hold nothing return []); the cluster asks
        only while `held` has requests."""
        return []

    def next_release(self, now: float) -> float | None:
        return None

    def stats_report(self) -> dict[str, object]:
        """Counters a router keeps about its own decisions (e.g. SCLS's memory-rule caps),
        for the simulator's `router_stats`; empty for a router that keeps none."""
        return {}


ROUTERS: Registry[type[Router]] = Registry("router")


def build_router(spec: str, ctx: RouterContext | None = None) -> Router:
    """`scls:variant=lb,slice_len=64` -> the registered router, built with its options."""
    name, options = parse_policy_spec(spec)
    return ROUTERS.get(name).create(options, ctx or RouterContext())


def healthy_ids(loads: Sequence[WorkerLoad]) -> list[int]:
    return [w.worker_id for w in loads if w.healthy]
