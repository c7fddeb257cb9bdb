"""The discrete-event simulator: a trace's requests arrive on a virtual clock, a router
places them, and each worker runs the scheduling core with a SimulatedExecutor.

    arrivals (trace or Poisson) ──> Cluster.submit ──> Scheduler (per worker)
    idle worker with work: plan = schedule(now); result = executor.execute(plan)
                           completion event at now + result.total_s
    completion: on_step_result(result, t); finished requests leave; next step starts
    KV transfer (disaggregated clusters): Cluster.pop_transfers -> SimulatedTransfers prices it
                 on the network link -> complete_transfer at its answer time

With `overlap` (and an overlap_safe policy) a worker holds up to two steps, as the live loop
does: the next plan is made while the current step runs, so its CPU overhead (the executor's
overhead model) runs then too; it starts when both the previous step and its own CPU work are
done: start = max(previous end, planned + overhead), end = start + model time.

Only virtual time advances; the wall time of `schedule()` is measured as the scheduling
overhead. Every request ends: finished, rejected with a reason, or (if a policy can never
place it) rejected as unschedulable at the end.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from scheduler_service.cluster import (
    ClusterSpec,
    DisaggCluster,
    LengthSource,
    WorkerSpec,
    build_cluster,
    build_length_source,
)
from scheduler_service.cluster.deployment import SYNCHRONOUS_UNBOUNDED, Deployment, cluster_spec
from scheduler_service.core.metrics import MetricsRecorder
from scheduler_service.core.prefix import PrefixSource
from scheduler_service.core.request import Request
from scheduler_service.core.slo import NO_SLO
from scheduler_service.costmodel.base import CostModel
from scheduler_service.sim.executor import SIM_EOS, SimulatedExecutor
from scheduler_service.sim.network import NETWORKS, gpu_family, load_network
from scheduler_service.sim.swap_costs import swap_costs
from scheduler_service.sim.transfer import SimulatedTransfers
from scheduler_service.workloads.base import TraceRequest, Workload
from sluice.common.config import cli_name, opt
from sluice.contract.limits import DEFAULT_BLOCK_SIZE
from sluice.contract.plan import KVTransferResult, StepResult
from sluice.contract.sampling import SamplingParams

BUILTIN_SIM_LENGTH_SOURCES = ("oracle", "noisy_oracle", "max_tokens")
# The setting of the papers' systems, which the paper reproductions and the simulator's own
# benchmarks run (`replace(config, **PAPER_SETTING)`): the papers' engine (SYNCHRONOUS_UNBOUNDED:
# steps planned one after another, unbounded queues, no offline queue) with 16 GiB of host swap
# per GPU. The defaults describe a Sluice deployment instead (overlapped, bounded, 4 GiB).
PAPER_SETTING: dict[str, Any] = {**SYNCHRONOUS_UNBOUNDED, "swap_space_gib": 16.0}


@dataclass
class SimConfig(Deployment):
    """A simulation: the deployment (cluster/deployment.py, shared with the live scheduler: one
    default and one meaning per setting) plus what only the simulator models (workers and their
    KV in GiB, CPU overheads, swap and transfer pricing, where predicted lengths come from)."""

    num_workers: int = opt(1, "workers (one GPU each, or one tensor-parallel group)", cli="workers")
    block_size: int = opt(DEFAULT_BLOCK_SIZE, "KV block size in tokens")
    kv_gb: float | None = opt(None, "KV cache per worker in GiB; none: the GPU's memory minus the weights")
    max_tokens: int | None = opt(None, "cap of every request's max_tokens; none: the context left")
    length_source: str = opt(
        "max_tokens",
        "predicted output lengths: max_tokens, oracle, noisy_oracle, or predictor[:DIR] (the real predictor on the "
        "trace's prompts; its held-out error model for traces without text)",
    )
    length_error: float = opt(0.2, "relative standard deviation of noisy_oracle")
    overlap_swap: bool = opt(False, "swaps run on their own stream and overlap the forward pass")
    # CPU time of the serving stack per step outside the model (scheduling, transport,
    # streaming), as Vidur's optional CPU overheads: step_overhead_s + seq_overhead_s x seqs, plus
    # new_seq_overhead_s for each sequence whose prefill starts in the step.
    step_overhead_s: float = opt(0.0, "serving-stack CPU time per step outside the model")
    seq_overhead_s: float = opt(0.0, "serving-stack CPU time per scheduled sequence")
    new_seq_overhead_s: float = opt(
        0.0, "serving-stack CPU time per sequence whose prefill starts in the step (its admission into the engine)"
    )
    overlap_hides_overhead: bool = opt(
        True,
        "with --overlap the CPU overhead runs while the previous step does (the scheduler's share); "
        "false keeps it on the step's path, for an overhead fitted to what overlapped live steps still show",
    )
    # What a swap costs beyond bytes / PCIe bandwidth (vLLM v0): each block is copied per layer,
    # keys and values apart (2 x layers cudaMemcpyAsync calls per block), and the step that
    # swaps waits for the copies before its forward pass.
    swap_copy_overhead_s: float = opt(0.0, "seconds per KV copy call of a swap (2 x layers calls per block)")
    swap_stall_s: float = opt(0.0, "seconds a step that swaps stalls beyond its copies")
    swap_costs: str = opt(
        "",
        "named swap pricing that sets --swap-copy-overhead-s and --swap-stall-s: vllm-v0 (assumed), "
        "sluice-h100 (measured on an H100) or none (scheduler_service/sim/swap_costs.py)",
    )
    # Disaggregated prefill and decode (cluster/disagg.py): prefill-only and decode-only pools.
    prefill_workers: int = opt(
        0, "prefill-only workers (with --decode-workers: a disaggregated cluster instead of --workers)"
    )
    decode_workers: int = opt(0, "decode-only workers (with --prefill-workers)")
    decode_router: str = opt("kv_aware", "router[:key=value,...] that picks each request's decode worker")
    network: str = opt("nvlink", "link of KV transfers between workers: nvlink, infiniband, pcie, ethernet")
    transfer_failure_rate: float = opt(0.0, "share of KV transfers that fail (fault injection; seeded)")
    seed: int = opt(0, "seed of the noisy oracle (the workload's --seed)", flag=False)
    progress: bool = opt(False, "progress bar", flag=False)

    def validate(self) -> None:
        """Refuses a setting no simulation can run with, in one line naming its flag (the
        deployment's settings by `Deployment.check`, as the live scheduler checks them)."""
        self.check(lambda name: flag_of(self, name))
        at_least(self, "num_workers", 1)
        at_least(self, "block_size", 1)
        at_least(self, "max_tokens", 1)
        for name in (
            "length_error",
            "step_overhead_s",
            "seq_overhead_s",
            "new_seq_overhead_s",
            "swap_copy_overhead_s",
            "swap_stall_s",
            "prefill_workers",
        ):
            at_least(self, name, 0)
        at_least(self, "decode_workers", 0)
        if self.swap_costs:
            swap_costs(self.swap_costs)  # a clear error for an unknown name
            if self.swap_copy_overhead_s or self.swap_stall_s:
                raise ValueError("--swap-costs sets --swap-copy-overhead-s and --swap-stall-s: give one or the other")
        if (self.prefill_workers > 0) != (self.decode_workers > 0):
            got = f"got {self.prefill_workers} and {self.decode_workers}"
            raise ValueError(f"--prefill-workers and --decode-workers go together, {got}")
        if self.network not in NETWORKS:
            raise ValueError(f"--network must be one of {', '.join(NETWORKS)}, got {self.network!r}")
        if not 0 <= self.transfer_failure_rate <= 1:
            raise ValueError(f"--transfer-failure-rate must be in [0, 1], got {self.transfer_failure_rate}")
        if self.kv_gb is not None and self.kv_gb <= 0:
            raise ValueError(f"--kv-gb must be > 0 GiB, got {self.kv_gb}")

    @property
    def disaggregated(self) -> bool:
        return self.prefill_workers > 0


def flag_of(config: object, name: str) -> str:
    """The command-line flag of `config`'s field `name` (`--workers` for `num_workers`)."""
    return "--" + next(cli_name(f) for f in fields(config) if f.name == name).replace("_", "-")  # type: ignore[arg-type]


def at_least(config: object, name: str, low: float, why: str = "") -> None:
    """`config.name` is None or >= low; else ValueError naming the field's flag."""
    value = getattr(config, name)
    if value is not None and value < low:
        reason = f" ({why})" if why else ""
        raise ValueError(f"{flag_of(config, name)} must be >= {low}{reason}, got {value}")


@dataclass
class SimRun:
    policy: str
    workload: str
    config: dict[str, Any]
    metrics: dict[str, Any]
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "workload": self.workload,
            "config": self.config,
            "metrics": self.metrics,
            "details": self.details,
        }


def swap_pricing(config: SimConfig, num_layers: int) -> tuple[float, float]:
    """(seconds per block moved beyond its bytes, seconds per step that swaps) for the executor."""
    if config.swap_costs:
        named = swap_costs(config.swap_costs)
        return named.copy_overhead_s * 2 * num_layers, named.stall_s
    return config.swap_copy_overhead_s * 2 * num_layers, config.swap_stall_s


class Simulation:
    def __init__(
        self,
        config: SimConfig,
        workload: Workload,
        cost_model: CostModel,
        length_source: LengthSource | None = None,
    ) -> None:
        """`length_source`: predictions made outside (e.g. the predictor over the trace's
        prompts, as a TableLengths); None builds `config.length_source` by name."""
        config.validate()
        if not workload.requests:
            raise ValueError(f"workload {workload.name!r} has no requests")
        if not workload.has_arrivals:
            raise ValueError(f"workload {workload.name!r} has no arrival times: give a rate")
        self.config = config
        self.workload = workload
        self.cost_model = cost_model
        model_len = config.max_model_len
        self.max_model_len = model_len if model_len is not None else cost_model.model.max_model_len
        self.truth: dict[str, int] = {}
        self.spec = self._cluster_spec(length_source)
        self.cluster = build_cluster(self.spec, MetricsRecorder(), timer=time.perf_counter)
        self.metrics = self.cluster.metrics
        self.kv = self.cluster.kv
        bytes_per_block = cost_model.model.kv_bytes_per_token_per_gpu * config.block_size
        self.executors = {
            w: SimulatedExecutor(
                cost_model,
                bytes_per_block,
                self.truth,
                config.overlap_swap,
                overhead=(config.step_overhead_s, config.seq_overhead_s, config.new_seq_overhead_s),
                swap_costs=swap_pricing(config, cost_model.model.num_layers),
            )
            for w in self.cluster.schedulers
        }
        self.link = load_network(config.network, gpu_family(cost_model.hardware.name))
        self.transfers = SimulatedTransfers(
            self.link, bytes_per_block, config.transfer_timeout_s, config.transfer_failure_rate, config.seed
        )

    def _cluster_spec(self, length_source: LengthSource | None) -> ClusterSpec:
        cfg = self.config
        if length_source is None:
            if cfg.length_source not in BUILTIN_SIM_LENGTH_SOURCES:
                raise ValueError(
                    f"length_source must be one of {', '.join(BUILTIN_SIM_LENGTH_SOURCES)} "
                    f"(or predictions given as a table), got {cfg.length_source!r}"
                )
            length_source = build_length_source(cfg.length_source, relative_error=cfg.length_error, seed=cfg.seed)
        num_gpu = self.cost_model.num_kv_blocks(cfg.block_size, cfg.worker_gpu_memory_utilization, cfg.kv_gb)
        bytes_per_block = self.cost_model.model.kv_bytes_per_token_per_gpu * cfg.block_size
        worker = WorkerSpec(num_gpu, int(cfg.worker_swap_space_gib * 2**30 // bytes_per_block), cfg.block_size)
        workers = (worker,) * cfg.num_workers
        if cfg.disaggregated:
            workers = (replace(worker, role="prefill"),) * cfg.prefill_workers + (
                replace(worker, role="decode"),
            ) * cfg.decode_workers
        return cluster_spec(
            cfg, workers, self.cost_model, self.max_model_len, length_source, decode_router=cfg.decode_router
        )

    # ------------------------------------------------------------------ requests
    def _make_request(self, tr: TraceRequest) -> Request:
        prompt = max(1, tr.prompt_tokens)
        room = max(1, self.max_model_len - prompt)
        max_tokens = min(room, self.config.max_tokens) if self.config.max_tokens is not None else room
        true_out = max(1, min(tr.output_tokens, max_tokens))
        ids = list(tr.prompt_token_ids) if tr.prompt_token_ids is not None else None
        request = Request(
            tr.request_id,
            arrival_time=float(tr.arrival_s or 0.0),
            num_prompt_tokens=None if ids else prompt,
            prompt_token_ids=ids or None,
            prefix_source=self._prefix_source(tr),
            sampling=SamplingParams(max_tokens=max_tokens),
            slo=tr.slo or NO_SLO,
            priority=tr.priority,
            tenant=tr.tenant,
            eos_token_ids=frozenset((SIM_EOS,)),
            true_output_tokens=true_out,
        )
        self.truth[tr.request_id] = true_out
        return request

    def _prefix_source(self, tr: TraceRequest) -> PrefixSource | None:
        """What names the request's blocks for prefix caching: the trace's block hashes, its
        token ids (with the reference answer's ids for the generated tokens), or nothing
        (None: blocks unique to the request, which the scheduler then never looks up)."""
        if not tr.prefix_hash_ids and not tr.prompt_token_ids:
            return None  # NOTE: the reference answer names blocks only after the prompt's ids
        per = int(self.workload.metadata.get("prefix_block_tokens", 512))
        return PrefixSource(tr.prefix_hash_ids, per, tr.output_token_ids)

    # ------------------------------------------------------------------ the loop
    def run(self) -> SimRun:
        arrivals = sorted(self.workload.requests, key=lambda r: (r.arrival_s or 0.0, r.request_id))
        cluster = self.cluster
        events: list[tuple[float, int, int]] = []  # (completion time, seq, worker)
        moving: list[tuple[float, int, KVTransferResult]] = []  # (answer time, seq, KV transfer's answer)
        # per worker, steps planned and not completed, oldest (the running one) first:
        # (result, when its CPU work is done, its model time)
        inflight: dict[int, deque[tuple[StepResult, float, float]]] = {w: deque() for w in cluster.schedulers}
        depth = {w: 2 if cluster.overlaps(w) else 1 for w in cluster.schedulers}
        cpu_free = dict.fromkeys(cluster.schedulers, 0.0)
        seq = 0
        i = 0
        now = 0.0
        bar = _progress(len(arrivals), self.config)
        arrival_times = [float(r.arrival_s or 0.0) for r in arrivals] + [math.inf]
        executors, hides_overhead = self.executors, self.config.overlap_hides_overhead
        wakes = cluster.asks_for_wakeups()
        while True:
            next_arrival = arrival_times[i]
            next_done = events[0][0] if events else math.inf
            next_moved = moving[0][0] if moving else math.inf
            next_wake = (
                self._next_wakeup(now, [w for w, q in inflight.items() if len(q) < depth[w]]) if wakes else math.inf
            )
            upcoming = min(next_arrival, next_done, next_moved, next_wake)
            if upcoming == math.inf:
                break  # NOTE: `now` keeps the last event's time for the leftover sweep below
            now = upcoming
            if next_done <= now:
                _, _, w = heapq.heappop(events)
                queue = inflight[w]
                cluster.complete_step(w, queue.popleft()[0], now)
                if queue:  # the step planned ahead starts now, or when its CPU work is done
                    _, ready, model_s = queue[0]
                    heapq.heappush(events, (max(now, ready) + model_s, seq, w))
                    seq += 1
            elif next_moved <= now:
                cluster.complete_transfer(heapq.heappop(moving)[2], now)
            elif next_arrival <= now:
                if cluster.submit(self._make_request(arrivals[i]), now) is not None and bar is not None:
                    bar.update(1)
                i += 1
            cluster.release_held(now)
            for w in cluster.schedulers:
                queue = inflight[w]
                while len(queue) < depth[w] and cluster.has_work(w):
                    plan = cluster.plan_step(w, now)
                    if plan is None:
                        break
                    executor = executors[w]
                    result = executor.execute(plan)
                    cpu = executor.last_overhead_s if hides_overhead else 0.0
                    cpu_free[w] = max(now, cpu_free[w]) + cpu
                    queue.append((result, cpu_free[w], result.total_s - cpu))
                    if len(queue) == 1:  # the worker was idle: CPU work, then the step
                        heapq.heappush(events, (now + result.total_s, seq, w))
                        seq += 1
            for transfer in cluster.pop_transfers():
                done, answer = self.transfers.start(transfer, now)
                heapq.heappush(moving, (done, seq, answer))
                seq += 1
            ended = cluster.pop_ended()
            if bar is not None and ended:
                bar.update(len(ended))
        if bar is not None:
            bar.close()
        cluster.reject_leftovers(now)
        cluster.pop_ended()
        return self._report()

    def _next_wakeup(self, now: float, free: list[int]) -> float:
        """`free`: workers that may take a plan now (fewer steps in flight than they may hold)."""
        due = self.cluster.next_wakeup(now, free)
        return due if due is not None and due > now else math.inf

    def _report(self) -> SimRun:
        cm = self.cost_model
        config = {
            **asdict(self.config),
            "model": cm.model.name,
            "hardware": cm.hardware.name,
            "tensor_parallel": cm.model.tensor_parallel,
            "cost_model": cm.name,
            "max_model_len": self.max_model_len,
            "num_gpu_blocks": self.spec.workers[0].num_gpu_blocks,
            "length_source": self.spec.length_source.name,
            "num_gpus": len(self.spec.workers) * cm.model.tensor_parallel,
        }
        config.pop("progress", None)
        details = self.metrics.details()
        # per worker (keyed by its id): what each worker's policy counted about its own
        # decisions; workers whose policy keeps no counters are left out
        details["policy_stats"] = {
            str(w): stats for w, s in self.cluster.schedulers.items() if (stats := s.policy.stats_report())
        }
        details["router_stats"] = self.cluster.router.stats_report()
        if isinstance(self.cluster, DisaggCluster):
            link = self.link
            details["disagg"] = {
                "prefill_workers": len(self.cluster.prefill_pool),
                "decode_workers": len(self.cluster.decode_pool),
                "network": {"name": link.name, "bandwidth_GBps": link.bandwidth_bps / 1e9, "latency_s": link.latency_s},
                **self.cluster.transfers.summary(),
            }
        return SimRun(
            policy=self.config.policy,
            workload=self.workload.name,
            config=config,
            metrics=self.metrics.summary(),
            details=details,
        )


def _progress(total: int, config: SimConfig) -> Any:
    if not config.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=f"simulate {config.policy}", unit="req", leave=False)


def simulate(
    config: SimConfig, workload: Workload, cost_model: CostModel, length_source: LengthSource | None = None
) -> SimRun:
    return Simulation(config, workload, cost_model, length_source).run()
