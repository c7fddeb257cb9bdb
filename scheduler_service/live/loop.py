"""WorkerLoop: the iteration loop of one worker, an asyncio task (the live twin of the
simulator's step start / completion event pair: the same Cluster calls).

    wait until the worker has work (arrival, abort, re-routed request: `wake` is set);
        while idle, probe the worker every probe interval (Health with the session: renews
        its lease, notices a dead worker or a lost stream before a request needs it)
    now = monotonic(); plan = Cluster.plan_step(worker, now)   schedule() wall time -> metrics
    nothing to run: sleep until the next event or policy wake-up
    result = RemoteWorker.execute(plan)                        one step in flight
    out = Cluster.complete_step(worker, result, now)           tokens -> streams, ended -> clients
    WorkerLost (stream broken, probe failed, state diverged):
        warm the worker up again at once with our session (Warmup wipes it): when that
        works, the requests it held recompute on it (never counted as down);
        when it does not, Cluster.mark_down (requests recompute elsewhere, or end UNAVAILABLE
        when no worker is left), then reconnect with backoff
    retire() (the worker left the discovered set): the loop ends between two steps, never
        with a step's tokens undelivered; its host then removes the worker (discovery.py)

Everything between two awaits is synchronous, so a client's abort or a stop string never
interleaves with a half-applied step.

With overlap (the default, for `overlap_safe` policies) the loop keeps one step in flight
ahead of the answers: `StepPipeline` (live/pipeline.py) plans and sends step N+1 before it
reads the answer to N.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

from scheduler_service.cluster import Cluster
from scheduler_service.core.request import Request
from scheduler_service.live.config import LiveConfig
from scheduler_service.live.observe import LiveMetrics
from scheduler_service.live.pipeline import StepPipeline
from scheduler_service.live.remote import RemoteWorker, WarmupOptions, WorkerCapacity, WorkerDiverged, WorkerLost
from sluice.contract.plan import StepPlan
from sluice.contract.profile import BatchShape


class LoopHost(Protocol):
    """What a WorkerLoop needs of the LiveScheduler that runs it.

    NOTE: a Protocol rather than the LiveScheduler class, which creates the loops: the loop
    module then does not import the service that imports it."""

    cluster: Cluster
    config: LiveConfig
    clock: Callable[[], float]
    closing: bool
    metrics: LiveMetrics

    async def deliver(self, tokens: Sequence[tuple[Request, int]], now: float) -> None: ...

    def settle(self) -> None: ...

    def worker_lost(self, worker_id: int, now: float) -> None: ...

    def worker_back(self, worker_id: int) -> None: ...

    def worker_reset(self, worker_id: int) -> None: ...

    def observe_step(self, worker_id: int, plan: StepPlan, seconds: float, seen_s: float) -> None: ...


log = logging.getLogger(__name__)

# Seconds a probe (and the at-once re-Warmup after a loss) may take before the worker counts as lost.
PROBE_TIMEOUT_S = 5.0


class WorkerLoop:
    def __init__(self, live: LoopHost, remote: RemoteWorker, capacity: WorkerCapacity) -> None:
        self.live = live
        self.remote = remote
        self.capacity = capacity
        self.worker_id = remote.worker_id
        self.wake = asyncio.Event()
        self.redial = asyncio.Event()  # set: a reconnect dials now (the worker was restarted)
        self._stepping: tuple[StepPlan, float] | None = None  # the plan `_step` awaits, and since when
        self.connected = True
        self.num_steps = 0
        self.num_resyncs = 0  # sessions re-established without the worker counting as down
        # (sequences, wall seconds of the whole step here, seconds the worker reported, the
        # step's BatchShape when `record_step_shapes`): what the simulator's CPU-overhead
        # model is calibrated from.
        self.step_log: deque[tuple[int, float, float, BatchShape | None]] = deque(maxlen=100_000)
        self.last_error = ""
        self._backoff_s = live.config.reconnect_min_s
        self._diverged = False  # a divergence was healed and no step has succeeded since
        self._last_contact = live.clock()
        self.retiring = False  # set by retire(): end between two steps
        self.pipeline = StepPipeline(self)
        # The worker's sessions: bumped when a loss begins and when it is resolved (warmed up
        # again, or marked down), so a KV transfer that spans either is known to be void
        # (live/transfers.py). `next_progress` wakes on every answered step and every bump.
        self.epoch = 0
        self._progress = asyncio.Event()

    async def next_progress(self) -> None:
        """Until the worker answers a step or its session changes."""
        await self._progress.wait()

    def _progressed(self) -> None:
        self._progress.set()
        self._progress = asyncio.Event()

    def _new_epoch(self) -> None:
        self.epoch += 1
        self._progressed()

    def retire(self) -> None:
        """Asks the loop to end after the steps in flight (if any) have been delivered."""
        self.retiring = True
        self.wake.set()

    @property
    def probe_interval_s(self) -> float:
        """The configured interval, and at most a quarter of the worker's lease."""
        ttl = self.capacity.lease_ttl_s
        return min(self.live.config.probe_interval_s, ttl / 4) if ttl > 0 else self.live.config.probe_interval_s

    async def run(self) -> None:
        while not self.live.closing and (not self.retiring or self.pipeline.num_in_flight):
            if not self.connected:
                await self._reconnect()
                continue
            try:
                if not self.pipeline.num_in_flight:
                    await self._wait_for_work()
                # NOTE: a retiring loop plans nothing more but delivers the steps still in flight.
                if self.live.closing or (self.retiring and not self.pipeline.num_in_flight):
                    return
                if self.live.cluster.overlaps(self.worker_id):
                    await self.pipeline.turn()
                else:
                    await self._step()
            except WorkerDiverged as exc:
                await self._diverge(exc)
            except WorkerLost as exc:
                await self._lose(str(exc))
            except Exception as exc:
                # NOTE: a bug must not leave this worker's clients waiting forever on a dead
                # task: its requests recompute elsewhere and the worker starts a new session.
                log.exception("worker %d loop failed", self.worker_id)
                await self._lose(f"loop error: {type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ stepping
    async def _wait_for_work(self) -> None:
        while not self.live.cluster.has_work(self.worker_id) and not self.live.closing and not self.retiring:
            self.wake.clear()
            await self._sleep()
            if self.retiring:
                return
            if self.live.clock() - self._last_contact >= self.probe_interval_s and not self.live.closing:
                await self.remote.probe(PROBE_TIMEOUT_S)
                self._last_contact = self.live.clock()

    async def _sleep(self) -> None:
        """Until `wake` is set, the policy's (or router's) next wake-up time, or the next probe."""
        now = self.live.clock()
        due = self.live.cluster.next_wakeup(now, (self.worker_id,))
        probe = self._last_contact + self.probe_interval_s
        due = probe if due is None else min(due, probe)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wake.wait(), timeout=max(0.0, due - now))

    async def _step(self) -> None:
        live, cluster, w = self.live, self.live.cluster, self.worker_id
        started = time.perf_counter()
        now = live.clock()
        cluster.release_held(now)
        plan = cluster.plan_step(w, now)
        live.settle()
        if plan is None:
            # NOTE: nothing can run (e.g. a policy holds requests back): sleep until something changes.
            self.wake.clear()
            await self._sleep()
            return
        shape = self.note_scheduled(plan)
        self._stepping = (plan, time.perf_counter())
        try:
            result = await self.remote.execute(plan)
        finally:
            self._stepping = None
        now = live.clock()
        self.on_contact(now)
        out = cluster.complete_step(w, result, now)
        self.num_steps += 1
        await live.deliver(out.tokens, now)
        live.settle()
        took = time.perf_counter() - started
        live.observe_step(w, plan, result.total_s, took)
        self.step_log.append((len(plan.num_scheduled_tokens), took, result.total_s, shape))

    def in_flight_tokens(self) -> tuple[tuple[int, float], ...]:
        """(scheduled tokens, seconds since it could start) of each step sent and not answered,
        oldest first (admission's estimate); a step planned ahead has not started (0 s)."""
        now = time.perf_counter()
        if self._stepping is not None:
            plan, since = self._stepping
            return ((sum(plan.num_scheduled_tokens.values()), now - since),)
        return self.pipeline.in_flight(now)

    def note_scheduled(self, plan: StepPlan) -> BatchShape | None:
        """Metrics of a plan about to be sent; its BatchShape when the step log keeps them."""
        live = self.live
        running = live.cluster.schedulers[self.worker_id].running
        committed = live.cluster.overlaps(self.worker_id)  # the counts already include this step
        for rid, n in plan.num_scheduled_tokens.items():
            req = running[rid]
            live.metrics.on_scheduled(req, req.num_computed_tokens - n < req.prefill_len if committed else None)
        if not live.config.record_step_shapes:
            return None
        return step_shape(plan, running, committed=committed)

    def on_contact(self, now: float) -> None:
        """The worker answered a step."""
        self._last_contact = now
        self._diverged = False
        self._progressed()  # NOTE: its waiters run after this step's answer has been applied

    async def sleep_until_due(self) -> None:
        await self._sleep()

    # ------------------------------------------------------------------ failures
    async def _diverge(self, exc: WorkerDiverged) -> None:
        """The worker refused a step because it holds state our plans do not know of (e.g. a
        foreign client's blocks). Warming it up again wipes that state; if it happens again
        before any step succeeds, our own plans are at fault, and the core's rule applies
        (the request the worker named ends with an error, the others recompute)."""
        if self._diverged:
            log.error("worker %d diverged again right after a resync: %s", self.worker_id, exc)
            self.live.cluster.complete_step(self.worker_id, exc.result, self.live.clock())
            self.live.settle()
            return
        self._diverged = True
        await self._lose(str(exc))

    async def _lose(self, why: str) -> None:
        log.warning("worker %d: %s; warming it up again", self.worker_id, why)
        self.last_error = why
        self._new_epoch()
        await self.remote.close()
        self.pipeline.clear()
        if await self._resume():
            self.num_resyncs += 1
            log.info("worker %d at %s: new session; its requests recompute on it", self.worker_id, self.remote.address)
            self.live.worker_reset(self.worker_id)
            self._new_epoch()
            return
        self._diverged = False
        self.connected = False
        self.live.worker_lost(self.worker_id, self.live.clock())
        self._new_epoch()

    def _warmup_options(self) -> WarmupOptions:
        cfg = self.live.config
        return WarmupOptions(
            num_gpu_blocks=self.capacity.num_gpu_blocks,  # the KVCacheManager's size is fixed for the session
            swap_space_gib=cfg.swap_space_gib,
            max_num_batched_tokens=cfg.max_num_batched_tokens or 0,
            max_num_seqs=cfg.max_num_seqs,
        )

    async def _resume(self) -> bool:
        """One quick attempt at a new session; False when the worker cannot be had now."""
        try:
            back = await self.remote.connect(self._warmup_options(), PROBE_TIMEOUT_S, wait=False)
        except WorkerLost as exc:
            self.last_error = str(exc)
            return False
        if not self._same_shape(back):
            await self.remote.close()
            return False
        self._last_contact = self.live.clock()
        return True

    def _same_shape(self, back: WorkerCapacity) -> bool:
        cap = self.capacity
        shape = (cap.model, cap.block_size, cap.num_cpu_blocks, cap.role)
        if (back.model, back.block_size, back.num_cpu_blocks, back.role) == shape:
            return True
        # NOTE: a worker's role fixes its pool in a disaggregated cluster; one that comes back
        # with another role (restarted with a different --role) is not the same worker.
        self.last_error = f"worker came back with a different model, KV shape or role: {back}"
        log.error("worker %d: %s", self.worker_id, self.last_error)
        return False

    async def _reconnect(self) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.redial.wait(), self._backoff_s)  # readdress cuts the backoff short
        self.redial.clear()
        cfg = self.live.config
        try:
            back = await self.remote.connect(self._warmup_options(), min(cfg.connect_timeout_s, 5.0), wait=False)
        except WorkerLost as exc:
            if exc.code == "FAILED_PRECONDITION" and str(exc) != self.last_error:
                # NOTE: logged once per new answer: someone else holds the worker's lease
                log.error("worker %d at %s: cannot take it back: %s", self.worker_id, self.remote.address, exc)
            self.last_error = str(exc)
            self._backoff_s = min(2 * self._backoff_s, cfg.reconnect_max_s)
            return
        if not self._same_shape(back):
            await self.remote.close()
            self._backoff_s = cfg.reconnect_max_s
            return
        log.warning("worker %d at %s is back", self.worker_id, self.remote.address)
        self._new_epoch()
        self.connected = True
        self.last_error = ""
        self._backoff_s = cfg.reconnect_min_s
        self._last_contact = self.live.clock()
        self.live.metrics.on_reconnect(self.worker_id)
        self.live.worker_back(self.worker_id)


def step_shape(plan: StepPlan, running: dict[str, Request], *, committed: bool = False) -> BatchShape:
    """What the worker computes in this step, as a cost model prices it (the simulated
    executor derives the same shape from its own state). `committed`: the requests' counts
    already include this step (overlap commits a plan when it is made)."""
    shape = BatchShape()
    for rid, n in plan.num_scheduled_tokens.items():
        computed = running[rid].num_computed_tokens - (n if committed else 0)
        if n == 1 and computed > 0:
            shape.add_decode(computed + 1)
        else:
            shape.prefill_chunks.append((n, computed))
    return shape
