"""The deployment, described once: the settings the simulator and the live scheduler share.

`SimConfig` (sim/simulator.py) and `LiveConfig` (live/config.py) both extend `Deployment`, so
each setting has one name, one default and one meaning in both drivers, and the flags of
`sluice simulate`, `sluice scheduler` and `sluice serve` are generated from the same fields.
What only one driver has stays in its own config: the simulator's model of hardware, KV size
in GiB and CPU overheads; the live scheduler's predictor, admission, timeouts and reconnects.

Both drivers turn a description into the same `ClusterSpec` with `cluster_spec` below, given
what they know of the workers (the simulator: the cost model's KV arithmetic; the live
scheduler: each worker's Info and Warmup answers). A test builds both from one description and
checks that every policy gets the same `PolicyContext` and decides the same
(tests/integration/test_one_driver.py).

The TBT SLO a request is held to is resolved by one function, `request_tbt_slo`
(core/slo.py): its own `tbt_ms`, else the deployment's `tbt_slo_s`; policies that size a step
by it (Sarathi) take the tightest of the requests on the worker, live and simulated alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from scheduler_service.cluster.length_sources import LengthSource
from scheduler_service.cluster.spec import ClusterSpec, WorkerSpec
from scheduler_service.costmodel.base import CostModel
from sluice.common.config import opt
from sluice.contract.limits import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_MAX_OFFLINE_WAITING,
    DEFAULT_MAX_WAITING,
    DEFAULT_SWAP_SPACE_GIB,
)

# The engine of the papers' systems (vLLM v0 and the schedulers built on it): each step planned
# after the last one's result, no bound on waiting requests, no offline queue. For a bare
# cluster (`ClusterSpec(..., **SYNCHRONOUS_UNBOUNDED)`) or a description (`replace(d, **...)`).
SYNCHRONOUS_UNBOUNDED: dict[str, Any] = {"overlap": False, "max_waiting": None, "max_offline_waiting": 0}


@dataclass
class Deployment:
    policy: str = opt("vllm", "policy[:key=value,...] as registered in scheduler_service.policies")
    router: str = opt("round_robin", "router[:key=value,...] across the workers (scheduler_service.routers)")
    max_num_seqs: int = opt(DEFAULT_MAX_NUM_SEQS, "sequences per step and worker")
    max_num_batched_tokens: int | None = opt(
        None, "tokens per step and worker (a policy's budget may be smaller); none: max(8192, max_model_len)"
    )
    max_model_len: int | None = opt(None, "context length limit; none: the model's (the smallest the workers report)")
    # NOTE: one bound for the whole cluster, checked when a request arrives (cluster/cluster.py);
    # a request re-routed from a lost worker was admitted already and is never refused by it.
    max_waiting: int | None = opt(
        DEFAULT_MAX_WAITING,
        "requests waiting for admission across all workers; beyond it a new request is refused "
        "(RESOURCE_EXHAUSTED, queue_full); none: no bound (as vLLM, and the papers' systems)",
    )
    max_offline_waiting: int = opt(
        DEFAULT_MAX_OFFLINE_WAITING,
        "offline-class requests queued behind online work, all workers (never refused for an SLO; they use the "
        "seats online requests leave idle and give way to them: scheduler_service/core/offline.py); beyond it "
        "refused (OFFLINE_QUEUE_FULL); 0: offline requests are routed as online ones are, within max_waiting",
    )
    queue_timeout_s: float | None = opt(None, "a request not admitted within this many seconds ends as timed out")
    tbt_slo_s: float | None = opt(
        None,
        "TBT SLO in seconds of every online request that sets none itself (its tbt_ms wins); policies that size "
        "a step by it (sarathi) take the tightest of the requests on the worker",
    )
    int8_swap: bool = opt(False, "int8-compress swapped KV (where the workers support it)")
    prefix_caching: bool = opt(True, "automatic prefix caching: reuse the KV of full blocks a request shares")
    overlap: bool = opt(
        True,
        "plan each worker's next step while it runs the current one (overlapped scheduling, for the policies "
        "that are overlap-safe; --no-overlap: each step is planned after the last one's result)",
    )
    gpu_memory_utilization: float | None = opt(
        None,
        "share of accelerator memory a worker may use in all; "
        f"none: the worker's own ({DEFAULT_GPU_MEMORY_UTILIZATION})",
    )
    swap_space_gib: float | None = opt(
        None, f"host swap space per worker in GiB; none: the worker's own ({DEFAULT_SWAP_SPACE_GIB:g})"
    )
    transfer_timeout_s: float = opt(
        10.0, "disaggregated: a KV transfer not done in this many seconds is given up (the decode worker recomputes)"
    )
    int8_transfer: bool = opt(False, "disaggregated: int8-compress the KV moved between workers (where supported)")

    @property
    def worker_gpu_memory_utilization(self) -> float:
        """The share a worker uses: this deployment's, else a worker's own default."""
        return (
            self.gpu_memory_utilization if self.gpu_memory_utilization is not None else DEFAULT_GPU_MEMORY_UTILIZATION
        )

    @property
    def worker_swap_space_gib(self) -> float:
        return self.swap_space_gib if self.swap_space_gib is not None else DEFAULT_SWAP_SPACE_GIB

    def check(self, label: Callable[[str], str] = lambda name: f"{name}:") -> None:
        """Refuses a setting neither driver can run with, in one line naming the field as
        `label` writes it (the live scheduler: `max_waiting:`; the simulator: its flag)."""

        def refuse(name: str, rule: str) -> None:
            raise ValueError(f"{label(name)} must be {rule}, got {getattr(self, name)}")

        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting"):
            if (value := getattr(self, name)) is not None and value < 1:
                refuse(name, ">= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            refuse("max_model_len", ">= 2 (a prompt token and an output token)")
        for name in ("max_offline_waiting", "swap_space_gib"):
            if (value := getattr(self, name)) is not None and value < 0:
                refuse(name, ">= 0")
        for name in ("queue_timeout_s", "tbt_slo_s", "transfer_timeout_s"):
            if (value := getattr(self, name)) is not None and not value > 0:
                refuse(name, "> 0")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            refuse("gpu_memory_utilization", "in (0, 1]")


def cluster_spec(
    deployment: Deployment,
    workers: Sequence[WorkerSpec],
    cost_model: CostModel,
    max_model_len: int,
    length_source: LengthSource,
    **resolved: Any,
) -> ClusterSpec:
    """The cluster a description gives on these workers: the one mapping both drivers use.
    `resolved` carries what a driver learnt that narrows a setting (the live scheduler: int8
    only where every worker supports it; the simulator: its decode router)."""
    d = deployment
    values: dict[str, Any] = dict(
        policy=d.policy,
        workers=tuple(workers),
        cost_model=cost_model,
        max_model_len=max_model_len,
        router=d.router,
        max_num_seqs=d.max_num_seqs,
        max_num_batched_tokens=d.max_num_batched_tokens,
        max_waiting=d.max_waiting,
        queue_timeout_s=d.queue_timeout_s,
        tbt_slo_s=d.tbt_slo_s,
        int8_swap=d.int8_swap,
        length_source=length_source,
        prefix_caching=d.prefix_caching,
        int8_transfer=d.int8_transfer,
        overlap=d.overlap,
        max_offline_waiting=d.max_offline_waiting,
    )
    values.update(resolved)
    return ClusterSpec(**values)
