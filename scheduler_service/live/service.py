"""LiveScheduler: the simulator's Cluster over real workers, fed by clients.

    start():   RemoteWorker.connect per worker (Info, Warmup) -> one KVCacheManager, Scheduler
               and policy per worker, one Router, one Cluster (the simulator's _build_cluster)
               -> one WorkerLoop task per worker
    submit():  intake.build_request -> duplicate id / healthy worker / queue bound
               -> RequestStream registered -> Cluster.submit -> wake the loops
    loops:     deliver(tokens): streams get ids and text; a stop string -> Scheduler.finish
               settle(finished): Cluster.after_step (router books, re-routing) -> final messages
    abort():   Scheduler.abort (blocks free now, the worker is told next step) -> final message
    failures:  worker_lost -> Cluster.mark_down (recompute on the others); worker_back -> mark_up

One event loop owns all of this; nothing here blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict

from kvstore.accounting import KVAccounting
from scheduler_service import policies  # noqa: F401  (registers the policies)
from scheduler_service.core.cluster import Cluster
from scheduler_service.core.policy import PolicyContext, build_policy
from scheduler_service.core.preemption import RejectReason
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.sampling import InvalidRequestError
from scheduler_service.core.scheduler import Scheduler, SchedulerConfig
from scheduler_service.live.config import LiveConfig
from scheduler_service.live.intake import Limits, build_request
from scheduler_service.live.loop import WorkerLoop
from scheduler_service.live.observe import LiveMetrics
from scheduler_service.live.remote import RemoteWorker, WarmupOptions, WorkerCapacity, WorkerLost
from scheduler_service.live.stream import RequestStream
from scheduler_service.router import RouterContext, build_router
from sluice.common.prom import ServingMetrics
from sluice.v1 import generation_pb2

log = logging.getLogger(__name__)


class Rejected(Exception):
    """Admission refused for a reason of the live state (queue full, no worker, duplicate)."""

    def __init__(self, reason: RejectReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def load_tokenizer(model: str, path: str | None) -> object | None:
    """The worker's own tokenizer file (worker_service.tokenizer is torch-free), or None when
    the `tokenizers` package or the file is missing: then only token-id prompts are served."""
    try:
        from worker_service.tokenizer import Tokenizer
    except ImportError as exc:
        log.warning("no tokenizer (%s): text prompts will be refused", exc)
        return None
    try:
        return Tokenizer(path) if path else Tokenizer.for_model(model)
    except (FileNotFoundError, OSError, ValueError) as exc:
        log.warning("no tokenizer for %s (%s): text prompts will be refused", model, exc)
        return None


class LiveScheduler:
    def __init__(
        self,
        addresses: Sequence[str],
        config: LiveConfig | None = None,
        serving: ServingMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not addresses:
            raise ValueError("the scheduler needs at least one worker address")
        self.addresses = list(addresses)
        self.config = config or LiveConfig()
        self.serving = serving
        self.clock = clock
        self.streams: dict[str, RequestStream] = {}
        self.loops: dict[int, WorkerLoop] = {}
        self.on_health: Callable[[bool], None] | None = None
        self._tasks: list[asyncio.Task] = []
        self.closing = False
        self.started_at = 0.0
        self.num_tokens_out = 0

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        cfg = self.config
        remotes = [RemoteWorker(w, addr, cfg.step_timeout_s) for w, addr in enumerate(self.addresses)]
        options = WarmupOptions(
            cfg.num_gpu_blocks,
            cfg.swap_space_gib,
            cfg.gpu_memory_utilization,
            cfg.max_num_batched_tokens,
            cfg.max_num_seqs,
        )
        try:
            caps = await asyncio.gather(*(r.connect(options, cfg.connect_timeout_s) for r in remotes))
        except WorkerLost:
            await asyncio.gather(*(r.close() for r in remotes))
            raise
        self._check_alike(caps)
        first = caps[0]
        self.model = first.model
        self.block_size = first.block_size
        self.max_model_len = min([c.max_model_len for c in caps] + [cfg.max_model_len or first.max_model_len])
        self.metrics = LiveMetrics(self.model, cfg.policy, self.serving)
        self.cluster = self._build_cluster(caps)
        self.limits = Limits(
            max_model_len=self.max_model_len,
            max_kv_tokens=min(c.num_gpu_blocks for c in caps) * self.block_size,
            vocab_size=first.vocab_size,
            default_max_tokens=cfg.default_max_tokens,
            eos_token_ids=frozenset(first.eos_token_ids),
        )
        self.tokenizer = load_tokenizer(self.model, cfg.tokenizer)
        for remote, cap in zip(remotes, caps, strict=True):
            self.loops[remote.worker_id] = WorkerLoop(self, remote, cap, self.cluster.schedulers[remote.worker_id])
        self.started_at = self.clock()
        self._tasks = [asyncio.create_task(loop.run(), name=f"sluice-worker-{w}") for w, loop in self.loops.items()]
        log.info("live scheduler config: %s; workers: %s", asdict(cfg), [asdict(c) for c in caps])

    @staticmethod
    def _check_alike(caps: Sequence[WorkerCapacity]) -> None:
        shapes = {(c.model, c.block_size, c.vocab_size) for c in caps}
        if len(shapes) > 1:
            raise ValueError(f"workers serve different models or block sizes: {sorted(shapes)}")

    def _build_cluster(self, caps: Sequence[WorkerCapacity]) -> Cluster:
        cfg = self.config
        sched_cfg = SchedulerConfig(
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            max_waiting=cfg.max_waiting,
            queue_timeout_s=cfg.queue_timeout_s,
        )
        kv = KVAccounting()
        schedulers = []
        for w, cap in enumerate(caps):
            ctx = PolicyContext(
                worker_id=w,
                block_size=cap.block_size,
                num_gpu_blocks=cap.num_gpu_blocks,
                num_cpu_blocks=cap.num_cpu_blocks,
                max_model_len=self.max_model_len,
                max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
            )
            manager = kv.add_worker(w, cap.num_gpu_blocks, cap.num_cpu_blocks, cap.block_size)
            schedulers.append(Scheduler(w, manager, build_policy(cfg.policy, ctx), sched_cfg, self.metrics))
        self.kv = kv
        smallest = min(c.num_gpu_blocks for c in caps)
        router_ctx = RouterContext(self.block_size, smallest, self.max_model_len, cfg.max_num_seqs)
        return Cluster(schedulers, build_router(cfg.router, router_ctx), self.metrics)

    async def close(self) -> None:
        """Stops the loops; unfinished requests end as aborted so their clients hear of it."""
        self.closing = True
        for loop in self.loops.values():
            loop.wake.set()
        pending = set(self._tasks)
        # NOTE: Python 3.11's wait_for can swallow a cancellation that lands as its inner
        # await completes (a step result arriving); the loops also check `closing`, and we
        # cancel again until every task has really ended.
        while pending:
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=0.1)
        self._tasks = []
        for rid in list(self.streams):
            self.abort(rid, "server shutting down")
        await asyncio.gather(*(loop.remote.close() for loop in self.loops.values()))

    # ------------------------------------------------------------------ intake
    def submit(self, msg: generation_pb2.GenerateRequest) -> RequestStream:
        """Admits one request; raises InvalidRequestError (bad input) or Rejected (live state)."""
        now = self.clock()
        request = build_request(msg, self.limits, self.tokenizer, now)
        rid = request.request_id
        if rid in self.streams:
            raise InvalidRequestError("request_id", f"{rid!r} is already in use by a live request")
        if not any(self.cluster.healthy.values()):
            raise Rejected(RejectReason.NO_WORKER, "no healthy worker")
        if self.num_waiting >= self.config.max_waiting:
            self.metrics.on_reject(request, RejectReason.QUEUE_FULL, now)
            raise Rejected(RejectReason.QUEUE_FULL, f"the waiting queue is full ({self.config.max_waiting} requests)")
        self.metrics.start_trace(request)
        stream = RequestStream(request, self._detokenizer(request), request.sampling.stop)
        self.streams[rid] = stream
        reason = self.cluster.submit(request, now)
        if reason is not None:
            del self.streams[rid]
            self.cluster.rejected = [r for r in self.cluster.rejected if r is not request]
            raise Rejected(reason, request.finish_message or str(reason))
        self.cluster.release_held(now)
        self.wake_all()
        return stream

    def _detokenizer(self, request: Request) -> object | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.detokenizer(request.prompt_token_ids or (), request.sampling.skip_special_tokens)

    def abort(self, request_id: str, message: str = "aborted") -> bool:
        """Ends a live request (idempotent): its KV is free at once, the worker is told next step."""
        stream = self.streams.get(request_id)
        if stream is None:
            return False
        now = self.clock()
        request = stream.request
        sched = self.cluster.schedulers.get(request.worker_id) if request.worker_id is not None else None
        if sched is not None and sched.abort(request_id, now):
            request.finish_message = message
            self.settle(sched.worker_id, sched.pop_finished(), now)
            self.loops[sched.worker_id].wake.set()  # the release goes to the worker with the next plan
            return True
        if request in self.cluster.router.held:
            self.cluster.router.held.remove(request)
            request.status = RequestStatus.FINISHED_ABORTED
            request.finish_time = now
            self.metrics.on_finish(request, now)
        request.finish_message = message
        self._close_stream(request)
        return True

    # ------------------------------------------------------------------ called by the loops
    def deliver(self, tokens: Sequence[tuple[Request, int]], now: float) -> None:
        metrics = self.metrics
        self.num_tokens_out += len(tokens)
        for request, token in tokens:
            stream = self.streams.get(request.request_id)
            if stream is None:
                continue
            if request.num_output_tokens == 1:
                metrics.on_first_token(request)
            if stream.push(token) and not request.status.is_finished:
                sched = self.cluster.schedulers[request.worker_id]
                sched.finish(request.request_id, RequestStatus.FINISHED_STOPPED, now, "stop string")

    def settle(self, worker_id: int, finished: Sequence[Request], now: float) -> None:
        """Finished requests leave the router's books and their clients get the last message;
        requests a policy handed back are placed again (possibly on another worker)."""
        rerouted = bool(self.cluster.schedulers[worker_id].returned)
        if finished or rerouted:
            self.cluster.after_step(worker_id, list(finished), now)
        for request in finished:
            self._close_stream(request)
        self._drain_rejected()
        if rerouted:
            self.wake_all()
        if self.serving is not None:
            self._update_gauges()

    def worker_lost(self, worker_id: int, now: float) -> None:
        moved = self.cluster.mark_down(worker_id, now)
        log.warning("worker %d down: %d requests re-queued on the others", worker_id, len(moved))
        for request in moved:
            trace = self.metrics.traces.get(request.request_id)
            if trace is not None:
                trace.event("worker_lost", {"worker_id": worker_id})
                trace.phase("queue")
        self._drain_rejected()
        self.wake_all()
        self._publish_health()

    def worker_back(self, worker_id: int) -> None:
        self.cluster.mark_up(worker_id)
        self.cluster.release_held(self.clock())
        self.wake_all()
        self._publish_health()

    def wake_all(self) -> None:
        for loop in self.loops.values():
            loop.wake.set()

    def _close_stream(self, request: Request) -> None:
        stream = self.streams.pop(request.request_id, None)
        if stream is not None:
            stream.finish(request)

    def _drain_rejected(self) -> None:
        """Requests the cluster refused on re-routing (no healthy worker left) end for their clients."""
        rejected, self.cluster.rejected = self.cluster.rejected, []
        for request in rejected:
            self._close_stream(request)

    def _publish_health(self) -> None:
        if self.on_health is not None:
            self.on_health(self.is_healthy)

    def _update_gauges(self) -> None:
        assert self.serving is not None
        scheds = self.cluster.schedulers.values()
        self.serving.set_running(sum(len(s.running) for s in scheds))
        self.serving.set_waiting(self.num_waiting)
        total = sum(s.kv.gpu.num_blocks for s in scheds)
        self.serving.set_kv_usage(sum(s.kv.gpu.num_used for s in scheds) / total if total else 0.0)

    # ------------------------------------------------------------------ queries
    @property
    def is_healthy(self) -> bool:
        return any(self.cluster.healthy.values())

    @property
    def num_waiting(self) -> int:
        return sum(len(s.waiting) for s in self.cluster.schedulers.values()) + len(self.cluster.router.held)

    def throughput_tok_s(self) -> float:
        elapsed = self.clock() - self.started_at
        return self.num_tokens_out / elapsed if elapsed > 0 else 0.0
