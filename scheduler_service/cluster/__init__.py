"""The cluster: every worker's scheduler under one router, built from one ClusterSpec and
driven by the simulator, the live service and the benchmarks through the same methods.

    spec.py            ClusterSpec, WorkerSpec
    length_sources.py  length sources (max_tokens, oracle, noisy_oracle, given, table, online)
    build.py           build_cluster(spec) -> Cluster
    cluster.py         Cluster: submit, plan_step, complete_step, abort, finish, mark_down/up, pop_ended
    disagg.py          DisaggCluster: prefill and decode pools, KV transfers (pop_transfers, complete_transfer)
"""

from scheduler_service.cluster.build import build_cluster
from scheduler_service.cluster.cluster import Cluster
from scheduler_service.cluster.disagg import DisaggCluster
from scheduler_service.cluster.length_sources import LengthSource, TableLengths, build_length_source
from scheduler_service.cluster.spec import ClusterSpec, WorkerSpec

__all__ = [
    "Cluster",
    "ClusterSpec",
    "DisaggCluster",
    "LengthSource",
    "TableLengths",
    "WorkerSpec",
    "build_cluster",
    "build_length_source",
]
