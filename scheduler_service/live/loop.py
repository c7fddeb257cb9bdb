"""WorkerLoop: the iteration loop of one worker, an asyncio task (the live twin of the
simulator's `_start_step` / completion event pair).

    wait until the scheduler has work (arrival, abort, re-routed request: `wake` is set)
    now = monotonic(); plan = Scheduler.schedule(now)         schedule() wall time -> metrics
    empty plan: answered locally, sleep until the next event or policy wake-up
    result = RemoteWorker.execute(plan)                        one step in flight
    out = Scheduler.on_step_result(result, now)                tokens -> streams, finished -> clients
    WorkerLost: Cluster.mark_down (requests recompute elsewhere), then reconnect with backoff

Everything between two awaits is synchronous, so a client's abort or a stop string never
interleaves with a half-applied step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import TYPE_CHECKING

from scheduler_service.core.plan import StepPlan, StepResult
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.costmodel.base import BatchShape
from scheduler_service.live.remote import RemoteWorker, WarmupOptions, WorkerCapacity, WorkerLost

if TYPE_CHECKING:
    from scheduler_service.live.service import LiveScheduler

log = logging.getLogger(__name__)


class WorkerLoop:
    def __init__(
        self, live: LiveScheduler, remote: RemoteWorker, capacity: WorkerCapacity, scheduler: Scheduler
    ) -> None:
        self.live = live
        self.remote = remote
        self.capacity = capacity
        self.scheduler = scheduler
        self.worker_id = scheduler.worker_id
        self.wake = asyncio.Event()
        self.connected = True
        self.num_steps = 0
        # (sequences, wall seconds of the whole step here, seconds the worker reported, the
        # step's BatchShape when `record_step_shapes`): what the simulator's CPU-overhead
        # model is calibrated from.
        self.step_log: deque[tuple[int, float, float, BatchShape | None]] = deque(maxlen=100_000)
        self.last_error = ""
        self._backoff_s = live.config.reconnect_min_s

    async def run(self) -> None:
        while not self.live.closing:
            if not self.connected:
                await self._reconnect()
                continue
            await self._wait_for_work()
            if self.live.closing:
                return
            try:
                await self._step()
            except WorkerLost as exc:
                await self._lose(str(exc))
            except Exception as exc:
                # NOTE: a bug must not leave this worker's clients waiting forever on a dead
                # task: its requests recompute elsewhere and the worker starts a new session.
                log.exception("worker %d loop failed", self.worker_id)
                await self._lose(f"loop error: {type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ stepping
    async def _wait_for_work(self) -> None:
        while not self.scheduler.has_work and not self.live.closing:
            self.wake.clear()
            await self._sleep()

    async def _sleep(self) -> None:
        """Until `wake` is set or the policy's (or router's) next wake-up time."""
        now = self.live.clock()
        times = [self.scheduler.policy.next_wakeup(now), self.live.cluster.router.next_release(now)]
        due = [t - now for t in times if t is not None]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wake.wait(), timeout=max(0.0, min(due)) if due else None)

    async def _step(self) -> None:
        live, sched = self.live, self.scheduler
        started = time.perf_counter()
        now = live.clock()
        live.cluster.release_held(now)
        start = time.perf_counter()
        plan = sched.schedule(now)
        live.metrics.on_schedule_overhead(time.perf_counter() - start)
        live.settle(self.worker_id, sched.pop_finished(), now)
        if plan.is_empty:
            # NOTE: nothing can run (e.g. a policy holds requests back); the core still
            # expects an answer, and the loop sleeps until something changes.
            sched.on_step_result(StepResult(plan.step_id, {}, 0.0), now)
            self.wake.clear()
            await self._sleep()
            return
        running = sched.running
        for rid in plan.num_scheduled_tokens:
            live.metrics.on_scheduled(running[rid])
        shape = step_shape(plan, running) if live.config.record_step_shapes else None
        result = await self.remote.execute(plan)
        now = live.clock()
        out = sched.on_step_result(result, now)
        self.num_steps += 1
        live.deliver(out.tokens, now)
        live.settle(self.worker_id, out.finished + sched.pop_finished(), now)
        self.step_log.append((len(plan.num_scheduled_tokens), time.perf_counter() - started, result.total_s, shape))

    # ------------------------------------------------------------------ failures
    async def _lose(self, why: str) -> None:
        log.warning("worker %d lost: %s", self.worker_id, why)
        self.connected = False
        self.last_error = why
        await self.remote.close()
        self.live.worker_lost(self.worker_id, self.live.clock())

    async def _reconnect(self) -> None:
        await asyncio.sleep(self._backoff_s)
        cfg = self.live.config
        cap = self.capacity
        options = WarmupOptions(
            num_gpu_blocks=cap.num_gpu_blocks,  # the KVCacheManager's size is fixed for the session
            swap_space_gib=cfg.swap_space_gib,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_num_seqs=cfg.max_num_seqs,
        )
        try:
            back = await self.remote.connect(options, min(cfg.connect_timeout_s, 5.0), wait=False)
        except WorkerLost as exc:
            self.last_error = str(exc)
            self._backoff_s = min(2 * self._backoff_s, cfg.reconnect_max_s)
            return
        if (back.model, back.block_size, back.num_cpu_blocks) != (cap.model, cap.block_size, cap.num_cpu_blocks):
            self.last_error = f"worker came back with a different model or KV shape: {back}"
            log.error("worker %d: %s", self.worker_id, self.last_error)
            await self.remote.close()
            self._backoff_s = cfg.reconnect_max_s
            return
        log.info("worker %d at %s is back", self.worker_id, self.remote.address)
        self.connected = True
        self.last_error = ""
        self._backoff_s = cfg.reconnect_min_s
        self.live.worker_back(self.worker_id)


def step_shape(plan: StepPlan, running: dict[str, Request]) -> BatchShape:
    """What the worker computes in this step, as a cost model prices it (the simulated
    executor derives the same shape from its own state)."""
    shape = BatchShape()
    for rid, n in plan.num_scheduled_tokens.items():
        computed = running[rid].num_computed_tokens
        if n == 1 and computed > 0:
            shape.add_decode(computed + 1)
        else:
            shape.prefill_chunks.append((n, computed))
    return shape
