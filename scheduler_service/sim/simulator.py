"""The discrete-event simulator: a trace's requests arrive on a virtual clock, a router
places them, and each worker runs the scheduling core with a SimulatedExecutor.

    arrivals (trace or Poisson) ──> Cluster.submit ──> Scheduler (per worker)
    idle worker with work: plan = schedule(now); result = executor.execute(plan)
                           completion event at now + result.total_s
    completion: on_step_result(result, t); finished requests leave; next step starts

Only virtual time advances; the wall time of `schedule()` is measured as the scheduling
overhead. Every request ends: finished, rejected with a reason, or (if a policy can never
place it) rejected as unschedulable at the end.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvstore.accounting import KVAccounting
from scheduler_service import policies  # noqa: F401  (registers the policies)
from scheduler_service.core.cluster import Cluster
from scheduler_service.core.metrics import MetricsRecorder
from scheduler_service.core.policy import PolicyContext, build_policy
from scheduler_service.core.preemption import RejectReason
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.sampling import SamplingParams
from scheduler_service.core.scheduler import Scheduler, SchedulerConfig
from scheduler_service.core.slo import NO_SLO
from scheduler_service.costmodel.base import CostModel
from scheduler_service.router import RouterContext, build_router
from scheduler_service.sim.executor import SIM_EOS, SimulatedExecutor
from scheduler_service.sim.workloads.base import TraceRequest, Workload

LENGTH_SOURCES = ("oracle", "noisy_oracle", "max_tokens", "predictor")


@dataclass
class SimConfig:
    policy: str = "vllm"  # name[:key=value,...]
    num_workers: int = 1
    router: str = "round_robin"
    block_size: int = 16
    kv_gb: float | None = None  # KV memory per worker; None: what memory minus weights leaves
    gpu_memory_utilization: float = 0.9
    swap_space_gb: float = 16.0  # CPU swap space per worker
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: max(8192, max_model_len)
    max_model_len: int | None = None  # None: the model's
    max_tokens: int | None = None  # cap of every request's max_tokens (default: context left)
    length_source: str = "max_tokens"
    length_error: float = 0.2  # relative std of the noisy oracle
    queue_timeout_s: float | None = None
    max_waiting: int = 1_000_000
    overlap_swap: bool = False
    # CPU time of the serving stack per step outside the model (scheduling, transport,
    # streaming), as Vidur's optional CPU overheads: step_overhead_s + seq_overhead_s x seqs.
    step_overhead_s: float = 0.0
    seq_overhead_s: float = 0.0
    int8_swap: bool = False
    seed: int = 0
    progress: bool = False


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


class Simulation:
    def __init__(self, config: SimConfig, workload: Workload, cost_model: CostModel) -> None:
        if config.length_source not in LENGTH_SOURCES:
            raise ValueError(f"length_source must be one of {LENGTH_SOURCES}, got {config.length_source!r}")
        if config.length_source == "predictor":
            raise ValueError("length_source 'predictor' needs the predictor service; use oracle or noisy_oracle")
        if not workload.has_arrivals:
            raise ValueError(f"workload {workload.name!r} has no arrival times: give a rate")
        self.config = config
        self.workload = workload
        self.cost_model = cost_model
        self.max_model_len = config.max_model_len or cost_model.model.max_model_len
        self.metrics = MetricsRecorder()
        self.truth: dict[str, int] = {}
        self._rng = np.random.default_rng(config.seed)
        self.cluster = self._build_cluster()
        bytes_per_block = cost_model.model.kv_bytes_per_token_per_gpu * config.block_size
        self.executors = {
            w: SimulatedExecutor(
                cost_model,
                bytes_per_block,
                self.truth,
                config.overlap_swap,
                overhead=(config.step_overhead_s, config.seq_overhead_s),
            )
            for w in self.cluster.schedulers
        }

    def _build_cluster(self) -> Cluster:
        cfg = self.config
        num_gpu = self.cost_model.num_kv_blocks(cfg.block_size, cfg.gpu_memory_utilization, cfg.kv_gb)
        bytes_per_block = self.cost_model.model.kv_bytes_per_token_per_gpu * cfg.block_size
        num_cpu = int(cfg.swap_space_gb * 2**30 // bytes_per_block)
        max_batched = cfg.max_num_batched_tokens or max(8192, self.max_model_len)
        kv = KVAccounting()
        schedulers = []
        for w in range(cfg.num_workers):
            ctx = PolicyContext(
                worker_id=w,
                block_size=cfg.block_size,
                num_gpu_blocks=num_gpu,
                num_cpu_blocks=num_cpu,
                max_model_len=self.max_model_len,
                max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=max_batched,
                cost_model=self.cost_model,
                extras={"int8_swap": cfg.int8_swap, **self._slo_extras()},
            )
            sched_cfg = SchedulerConfig(
                max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=max_batched,
                max_model_len=self.max_model_len,
                max_waiting=cfg.max_waiting,
                queue_timeout_s=cfg.queue_timeout_s,
            )
            manager = kv.add_worker(w, num_gpu, num_cpu, cfg.block_size)
            schedulers.append(Scheduler(w, manager, build_policy(cfg.policy, ctx), sched_cfg, self.metrics))
        self.kv = kv
        router_ctx = RouterContext(cfg.block_size, num_gpu, self.max_model_len, cfg.max_num_seqs, self.cost_model)
        return Cluster(schedulers, build_router(cfg.router, router_ctx), self.metrics)

    def _slo_extras(self) -> dict[str, float]:
        tbt = [r.slo.tbt_s for r in self.workload.requests if r.slo is not None and r.slo.tbt_s is not None]
        return {"tbt_slo_s": float(np.median(tbt))} if tbt else {}

    # ------------------------------------------------------------------ requests
    def _make_request(self, tr: TraceRequest) -> Request:
        prompt = max(1, tr.prompt_tokens)
        room = max(1, self.max_model_len - prompt)
        max_tokens = min(room, self.config.max_tokens) if self.config.max_tokens else room
        true_out = max(1, min(tr.output_tokens, max_tokens))
        request = Request(
            tr.request_id,
            arrival_time=float(tr.arrival_s or 0.0),
            num_prompt_tokens=prompt,
            sampling=SamplingParams(max_tokens=max_tokens),
            slo=tr.slo or NO_SLO,
            priority=tr.priority,
            tenant=tr.tenant,
            eos_token_ids=frozenset((SIM_EOS,)),
            predicted_output_tokens=self._predict(true_out, max_tokens),
            length_source=self.config.length_source,
            true_output_tokens=true_out,
        )
        self.truth[tr.request_id] = true_out
        return request

    def _predict(self, true_out: int, max_tokens: int) -> int | None:
        source = self.config.length_source
        if source == "oracle":
            return true_out
        if source == "noisy_oracle":
            noisy = true_out * (1.0 + self._rng.normal(0.0, self.config.length_error))
            return int(min(max_tokens, max(1, round(noisy))))
        return None

    # ------------------------------------------------------------------ the loop
    def run(self) -> SimRun:
        arrivals = sorted(self.workload.requests, key=lambda r: (r.arrival_s or 0.0, r.request_id))
        events: list[tuple[float, int, int]] = []  # (completion time, seq, worker)
        busy: dict[int, bool] = dict.fromkeys(self.cluster.schedulers, False)
        results: dict[int, Any] = {}
        seq = 0
        i = 0
        now = 0.0
        bar = _progress(len(arrivals), self.config)
        while True:
            next_arrival = float(arrivals[i].arrival_s or 0.0) if i < len(arrivals) else math.inf
            next_done = events[0][0] if events else math.inf
            next_wake = self._next_wakeup(now, busy)
            upcoming = min(next_arrival, next_done, next_wake)
            if upcoming == math.inf:
                break  # NOTE: `now` keeps the last event's time for the leftover sweep below
            now = upcoming
            if next_done <= now:
                _, _, w = heapq.heappop(events)
                busy[w] = False
                out = self.cluster.schedulers[w].on_step_result(results.pop(w), now)
                self.cluster.after_step(w, out.finished, now)
                if bar is not None and out.finished:
                    bar.update(sum(1 for r in out.finished if r.status.is_finished))
            elif next_arrival <= now:
                reason = self.cluster.submit(self._make_request(arrivals[i]), now)
                i += 1
                if bar is not None and reason is not None:
                    bar.update(1)
            self.cluster.release_held(now)
            for w, s in self.cluster.schedulers.items():
                if not busy[w] and s.has_work:
                    seq = self._start_step(w, now, events, results, busy, seq, bar)
        if bar is not None:
            bar.close()
        self._reject_leftovers(now)
        return self._report()

    def _start_step(self, w: int, now: float, events: list, results: dict, busy: dict, seq: int, bar: Any) -> int:
        sched = self.cluster.schedulers[w]
        t0 = time.perf_counter()
        plan = sched.schedule(now)
        self.metrics.on_schedule_overhead(time.perf_counter() - t0)
        finished = sched.pop_finished()
        if finished or sched.returned:  # NOTE: requests a policy handed back go to the router now
            self.cluster.after_step(w, finished, now)
            if bar is not None:
                bar.update(len(finished))
        if plan.is_empty:
            sched.on_step_result(self.executors[w].execute(plan), now)
            return seq
        result = self.executors[w].execute(plan)
        results[w] = result
        busy[w] = True
        heapq.heappush(events, (now + result.total_s, seq, w))
        return seq + 1

    def _next_wakeup(self, now: float, busy: dict[int, bool]) -> float:
        times = [self.cluster.router.next_release(now)]
        times += [s.policy.next_wakeup(now) for w, s in self.cluster.schedulers.items() if not busy[w]]
        future = [t for t in times if t is not None and t > now]
        return min(future) if future else math.inf

    def _reject_leftovers(self, now: float) -> None:
        """Requests no policy could ever place (e.g. more KV than a worker has) end as
        rejected, so every request of the trace is accounted for."""
        for sched in self.cluster.schedulers.values():
            for rid in list(sched.requests):
                sched.finish(rid, RequestStatus.FINISHED_REJECTED, now, "unschedulable: never fit this worker")
            sched.pop_finished()
        for request in self.cluster.router.held:
            request.status = RequestStatus.FINISHED_REJECTED
            self.metrics.on_reject(request, RejectReason.UNSCHEDULABLE, now)
        self.cluster.router.held.clear()

    def _report(self) -> SimRun:
        cm = self.cost_model
        config = {
            **asdict(self.config),
            "model": cm.model.name,
            "hardware": cm.hardware.name,
            "tensor_parallel": cm.model.tensor_parallel,
            "cost_model": cm.name,
            "max_model_len": self.max_model_len,
            "num_gpu_blocks": next(iter(self.kv.workers.values())).gpu.num_blocks,
        }
        config.pop("progress", None)
        return SimRun(
            policy=self.config.policy,
            workload=self.workload.name,
            config=config,
            metrics=self.metrics.summary(),
            details=self.metrics.details(),
        )


def _progress(total: int, config: SimConfig) -> Any:
    if not config.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=f"simulate {config.policy}", unit="req", leave=False)


def simulate(config: SimConfig, workload: Workload, cost_model: CostModel) -> SimRun:
    return Simulation(config, workload, cost_model).run()
