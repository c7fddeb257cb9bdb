"""ClusterSpec: everything that defines a cluster of workers' schedulers, in one value.

Both drivers build one from their `Deployment` (cluster/deployment.py: `cluster_spec`), the
simulator with the cost model's KV arithmetic, the live scheduler with what each worker's Info
and Warmup answered; tests and benchmarks of a bare cluster build them directly. Its own
defaults are the plain engine's (the papers': steps planned one after another, no bound on
waiting requests, no offline queue); a deployment's come from `Deployment`.
`build_cluster` (cluster/build.py) turns any of them into the same objects, so every policy
sees the same `PolicyContext` fields live and simulated.

    policy, router              registered names with options ("sarathi:budget=512")
    workers                     one WorkerSpec each: KV blocks on GPU and CPU, block size, role
                                (prefill, decode or mixed; cluster/disagg.py)
    cost_model                  prices steps for the policies and routers that plan in time
    max_model_len, limits       context length, sequences and tokens per step, the waiting bound
                                across all workers (None: none)
    tbt_slo_s                   the deployment's TBT SLO (sarathi's budget, AccelGen's pivot)
    int8_swap                   swapped KV is int8-compressed
    prefix_caching              computed full blocks are cached by prefix hash and shared
    length_source               where predicted output lengths come from (cluster/length_sources.py)
    decode_router               picks the decode worker of a disaggregated cluster's requests
    int8_transfer               KV moved from a prefill to a decode worker is int8-compressed
    overlap                     a worker's next plan may be made while its step runs
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_service.cluster.length_sources import LengthSource, MaxTokensLengths
from scheduler_service.core.policy import PolicyContext
from scheduler_service.core.scheduler import SchedulerConfig
from scheduler_service.costmodel.base import CostModel
from scheduler_service.routers import RouterContext
from sluice.contract.limits import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_NUM_SEQS,
    token_budget,
)


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    num_gpu_blocks: int
    num_cpu_blocks: int
    block_size: int = DEFAULT_BLOCK_SIZE
    role: str = "mixed"


@dataclass(frozen=True)
class ClusterSpec:
    policy: str
    workers: tuple[WorkerSpec, ...]
    cost_model: CostModel
    max_model_len: int
    router: str = "round_robin"
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int | None = None  # None: contract.limits.token_budget
    max_waiting: int | None = None  # all workers together, checked by Cluster.submit; None: no bound
    queue_timeout_s: float | None = None
    tbt_slo_s: float | None = None
    int8_swap: bool = False
    length_source: LengthSource = field(default_factory=MaxTokensLengths)
    prefix_caching: bool = True  # automatic prefix caching in every worker's KV accounting
    decode_router: str = "kv_aware"  # picks a request's decode worker (disaggregated clusters)
    int8_transfer: bool = False  # KV moved between workers is int8-compressed (half the bytes)
    overlap: bool = False  # plans may be made one step ahead (core/overlap.py; overlap_safe policies)
    # offline-class requests wait in a queue of this bound, yielding to online ones
    # (core/offline.py); 0: they are routed as online ones are
    max_offline_waiting: int = 0

    def __post_init__(self) -> None:
        if not self.workers:
            raise ValueError("a cluster needs at least one worker")
        roles = {w.role for w in self.workers}
        if not roles <= {"prefill", "decode", "mixed"}:
            raise ValueError(f"worker roles must be prefill, decode or mixed, got {sorted(roles)}")
        if "prefill" in roles and roles.isdisjoint({"decode", "mixed"}):
            raise ValueError("a cluster with prefill workers needs a decode (or mixed) worker")
        if "decode" in roles and roles.isdisjoint({"prefill", "mixed"}):
            raise ValueError("a cluster with decode workers needs a prefill (or mixed) worker")
        if len({w.block_size for w in self.workers}) > 1:
            raise ValueError(f"workers have different block sizes: {sorted({w.block_size for w in self.workers})}")

    @property
    def disaggregated(self) -> bool:
        """Some worker only prefills or only decodes: requests move between pools (cluster/disagg.py)."""
        return any(w.role != "mixed" for w in self.workers)

    @property
    def block_size(self) -> int:
        return self.workers[0].block_size

    @property
    def step_token_budget(self) -> int:
        return token_budget(self.max_num_batched_tokens, self.max_model_len)

    def policy_context(self, worker_id: int) -> PolicyContext:
        worker = self.workers[worker_id]
        return PolicyContext(
            worker_id=worker_id,
            block_size=worker.block_size,
            num_gpu_blocks=worker.num_gpu_blocks,
            num_cpu_blocks=worker.num_cpu_blocks,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.step_token_budget,
            cost_model=self.cost_model,
            tbt_slo_s=self.tbt_slo_s,
            int8_swap=self.int8_swap,
        )

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.step_token_budget,
            max_model_len=self.max_model_len,
            max_waiting=None,  # NOTE: the cluster bounds new requests; a re-routed one was admitted already
            queue_timeout_s=self.queue_timeout_s,
            overlap=self.overlap,
        )

    def router_context(self) -> RouterContext:
        return RouterContext(
            block_size=self.block_size,
            num_gpu_blocks=min(w.num_gpu_blocks for w in self.workers),
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            cost_model=self.cost_model,
        )
