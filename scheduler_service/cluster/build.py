"""build_cluster: a ClusterSpec -> one Scheduler and policy per worker (each with its own
KVCacheManager from one KVAccounting), one router, one Cluster (a DisaggCluster when
some worker only prefills or only decodes). The simulator, the live
scheduler and the benchmarks all build their clusters here."""

from __future__ import annotations

from collections.abc import Callable

from kvstore.accounting import KVAccounting
from scheduler_service import policies  # noqa: F401  (registers the policies and SCLS's routers)
from scheduler_service.cluster.cluster import Cluster
from scheduler_service.cluster.disagg import DisaggCluster
from scheduler_service.cluster.spec import ClusterSpec
from scheduler_service.core.metrics import MetricsRecorder
from scheduler_service.core.policy import build_policy
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.routers import build_router


def build_cluster(
    spec: ClusterSpec, metrics: MetricsRecorder | None = None, timer: Callable[[], float] | None = None
) -> Cluster:
    """`timer`: a wall clock the driver lends to measure the policies' scheduling overhead
    (the core itself never reads one); None measures nothing."""
    metrics = metrics or MetricsRecorder()
    kv = KVAccounting()
    config = spec.scheduler_config()
    schedulers = []
    for w, worker in enumerate(spec.workers):
        manager = kv.add_worker(
            w, worker.num_gpu_blocks, worker.num_cpu_blocks, worker.block_size, prefix_caching=spec.prefix_caching
        )
        policy = build_policy(spec.policy, spec.policy_context(w))
        schedulers.append(Scheduler(w, manager, policy, config, metrics))
    router = build_router(spec.router, spec.router_context())
    if spec.disaggregated:
        decode_router = build_router(spec.decode_router, spec.router_context())
        return DisaggCluster(spec, schedulers, router, kv, metrics, timer, decode_router)
    return Cluster(spec, schedulers, router, kv, metrics, timer)
