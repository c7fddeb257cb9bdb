"""Overlapped stepping for a WorkerLoop: one step in flight ahead of the answers.

    turn:  plan N+1 and send it while the worker runs N   (Cluster.plan_step commits it: core/overlap.py)
           read answer N, apply it, stream its tokens     (the worker already runs N+1)

So `schedule()`, the plan's encoding, the write and the answer's handling all happen while
the worker computes; the worker finds the next plan waiting on its stream when a step ends,
and its only idle time per step is decoding that plan. A step with nothing in flight before
it (the first after idle) is sent and the next one planned before its answer is awaited.

A void answer (a step planned after one that failed: the core reset the worker and no
longer holds it in flight) is read and dropped. Policies that are not `overlap_safe`, and
`--no-overlap`, keep the one-step-at-a-time loop (`WorkerLoop._step`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

from scheduler_service.cluster import Cluster
from scheduler_service.core.request import Request
from scheduler_service.live.remote import RemoteWorker
from sluice.contract.plan import StepPlan
from sluice.contract.profile import BatchShape


class PipelineService(Protocol):
    """What the pipeline needs of the live scheduler (a part of the loop's LoopHost)."""

    cluster: Cluster
    clock: Callable[[], float]

    async def deliver(self, tokens: Sequence[tuple[Request, int]], now: float) -> None: ...

    def settle(self) -> None: ...

    def observe_step(self, worker_id: int, plan: StepPlan, seconds: float, seen_s: float) -> None: ...


class PipelinedLoop(Protocol):
    """What the pipeline needs of the WorkerLoop that owns it (named here, so this module does
    not import the loop module that imports it)."""

    worker_id: int
    remote: RemoteWorker
    retiring: bool
    wake: asyncio.Event
    num_steps: int
    step_log: deque[tuple[int, float, float, BatchShape | None]]

    @property
    def live(self) -> PipelineService: ...

    def note_scheduled(self, plan: StepPlan) -> BatchShape | None: ...

    async def sleep_until_due(self) -> None: ...

    def on_contact(self, now: float) -> None: ...


AHEAD = 2  # steps on the stream at most: the one the worker runs and the one planned ahead of it


class StepPipeline:
    """The WorkerLoop's steps on the stream: (plan, its shape, when it was sent), oldest first."""

    def __init__(self, loop: PipelinedLoop) -> None:
        self.loop = loop
        self.sent: deque[tuple[StepPlan, BatchShape | None, float]] = deque()
        self._last_answer = 0.0  # perf_counter of the last answer applied
        self.num_ahead = 0  # plans sent while another step was in flight

    def in_flight(self, now: float) -> tuple[tuple[int, float], ...]:
        """(scheduled tokens, seconds since it could start) of each step on the stream: the
        oldest runs since it was sent or the answer before it was applied; the others wait."""
        steps = []
        for i, (plan, _, sent_at) in enumerate(self.sent):
            running = now - max(sent_at, self._last_answer) if i == 0 else 0.0
            steps.append((sum(plan.num_scheduled_tokens.values()), running))
        return tuple(steps)

    @property
    def num_in_flight(self) -> int:
        return len(self.sent)

    def clear(self) -> None:
        """The stream is gone (the worker was lost or warmed up again)."""
        self.sent.clear()

    async def turn(self) -> None:
        loop = self.loop
        live, cluster, w = loop.live, loop.live.cluster, loop.worker_id
        planned = False
        if len(self.sent) < AHEAD and cluster.has_work(w) and not loop.retiring:
            now = live.clock()
            cluster.release_held(now)
            plan = cluster.plan_step(w, now)
            live.settle()
            if plan is not None:
                shape = loop.note_scheduled(plan)
                await loop.remote.send(plan)
                self.num_ahead += bool(self.sent)
                self.sent.append((plan, shape, time.perf_counter()))
                planned = True
        if not self.sent:
            # NOTE: nothing can run (e.g. a policy holds requests back): sleep until something changes.
            loop.wake.clear()
            await loop.sleep_until_due()
            return
        if planned and len(self.sent) == 1:
            return  # the worker was idle: plan the next step before waiting for this one
        await self._answer()

    async def _answer(self) -> None:
        loop = self.loop
        live, cluster, w = loop.live, loop.live.cluster, loop.worker_id
        plan, shape, sent_at = self.sent.popleft()
        result = await loop.remote.receive()
        now = live.clock()
        loop.on_contact(now)
        if not cluster.is_in_flight(w, result.step_id):
            return  # void: planned on a step that failed, which reset the worker's state
        out = cluster.complete_step(w, result, now)
        loop.num_steps += 1
        await live.deliver(out.tokens, now)
        live.settle()
        done = time.perf_counter()
        # NOTE: the step's visible time: from when it could start (sent, and the previous answer
        # applied) to its own answer applied; with the stream kept full this is the step period.
        visible = done - max(sent_at, self._last_answer)
        self._last_answer = done
        live.observe_step(w, plan, result.total_s, visible)
        loop.step_log.append((len(plan.num_scheduled_tokens), visible, result.total_s, shape))
