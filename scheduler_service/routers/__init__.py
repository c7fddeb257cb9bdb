"""Routers: which worker's queue a request joins (the global half of Vidur's split).

    base.py       the contract: Router, WorkerLoad, RouterContext, ROUTERS, build_router
    basic.py      round_robin, least_work
    kv_aware.py   kv_aware
    prefix_aware.py  prefix_aware (longest cached prefix, balanced against load)
SCLS's `max_min` and `scls` routers live with SCLS (`policies/scls/router.py`) and are
registered when `scheduler_service.policies` is imported.
"""

from scheduler_service.routers import basic, kv_aware, prefix_aware  # noqa: F401  (registration)
from scheduler_service.routers.base import (
    ROUTERS,
    Router,
    RouterContext,
    WorkerLoad,
    build_router,
    healthy_ids,
)
from scheduler_service.routers.basic import LeastWorkRouter, RoundRobinRouter
from scheduler_service.routers.kv_aware import KVAwareRouter
from scheduler_service.routers.prefix_aware import PrefixAwareRouter

__all__ = [
    "ROUTERS",
    "KVAwareRouter",
    "LeastWorkRouter",
    "PrefixAwareRouter",
    "RoundRobinRouter",
    "Router",
    "RouterContext",
    "WorkerLoad",
    "build_router",
    "healthy_ids",
]
