"""The worker's engine pipeline: step N+1 is launched before step N is collected.

    launch N+1   decode was done by StepReader; check and apply the plan, build the inputs, queue
                 the forward pass and the sampler (the device still runs N; N's tokens are
                 N+1's inputs by reference, on the device)
    collect N    N's tokens back on the host, the finished filter, the answer encoded and sent
                 (the device runs N+1 meanwhile)

So the worker's own per-step CPU work (plan check, bookkeeping, building inputs, answering)
runs while the device computes, as vLLM's async scheduling and SGLang's overlap scheduler do,
instead of between two device steps. It pays only where the device computes apart from the
host CPU (CUDA, where kernels run in stream order; the echo engine's emulated async device);
`EngineRunner.pipelines` decides (`--worker-pipeline auto|on|off`).

At most DEPTH steps are launched and not collected. With one launched, the loop waits for
whichever comes first: the next plan (launched at once) or the device finishing the launched
step (collected and answered). Answers go out in step order.

Correctness: a request the step before ends by count is left out before launch; one it ends
by token is computed and its token taken out of the answer (FinishedFilter). A plan that
fails its checks changes nothing and voids the plan made after it (`follows_step_id`), as in
the one-step-at-a-time loop; an engine failure at collect fails the engine (every later step
UNAVAILABLE, or void when it follows the failed one). Launched steps still queued when the
stream ends are collected and their answers dropped, so the engine's books stay whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from sluice.contract.plan import StepPlan, StepResult
from sluice.contract.plan_codec import error_result, result_to_proto
from sluice.v1 import worker_pb2
from worker_service.engine_contract import Engine
from worker_service.finished_filter import FinishedFilter
from worker_service.plan_check import StepPlanError
from worker_service.step_reader import Incoming, StepReader

log = logging.getLogger(__name__)

DEPTH = 2  # steps launched and not collected at most: the one the device runs and the next


class PipelineRunner(Protocol):
    """What the pipeline needs of the EngineRunner (worker_service/server.py)."""

    engine: Engine
    failure: str
    launched_ahead: int

    @property
    def ready(self) -> bool: ...

    @property
    def not_ready_reason(self) -> str: ...

    async def launch(self, plan: StepPlan) -> Any: ...

    async def device_done(self, launched: Any) -> None: ...

    async def collect(self, launched: Any) -> StepResult: ...


@dataclass(slots=True)
class Slot:
    """One step on its way through the pipeline, in stream order."""

    incoming: Incoming
    received: float
    plan: StepPlan | None = None
    launched: Any = None  # the engine's handle while launched; None once answered or never run
    answer: worker_pb2.ExecuteResponse | None = None  # made without running (refused, void)


class EnginePipeline:
    """One Execute stream's steps through the engine, launched ahead (see the module docstring)."""

    def __init__(
        self,
        runner: PipelineRunner,
        finished: FinishedFilter,
        check_lease: Callable[[], Awaitable[None]],
        on_failure: Callable[[int, Exception], Awaitable[StepResult]],
        on_result: Callable[[StepPlan, StepResult], None],
    ) -> None:
        self.runner = runner
        self.finished = finished
        self._check_lease = check_lease
        self._on_failure = on_failure
        self._on_result = on_result
        self.failed = 0  # the last step on this stream that failed or was void
        self._last_collected = 0.0  # perf_counter when the last step was collected
        self._slots: deque[Slot] = deque()

    @property
    def _num_launched(self) -> int:
        return sum(s.launched is not None for s in self._slots)

    async def run(self, reader: StepReader) -> AsyncIterator[worker_pb2.ExecuteResponse]:
        slots = self._slots
        next_msg: asyncio.Future[Incoming] | None = None
        ended = False
        try:
            while not ended or slots:
                head = slots[0] if slots else None
                if head is not None and head.launched is None:
                    slots.popleft()
                    yield self._answered(head)
                    continue
                if not ended and self._num_launched < DEPTH:
                    # NOTE: one read of the stream pending at a time, kept across turns.
                    next_msg = next_msg or asyncio.ensure_future(reader.__anext__())
                    if head is not None and not next_msg.done():
                        device = asyncio.ensure_future(self.runner.device_done(head.launched))
                        await asyncio.wait((next_msg, device), return_when=asyncio.FIRST_COMPLETED)
                        if not next_msg.done():
                            slots.popleft()
                            yield await self._collect(head)
                            continue
                        device.cancel()
                    got, next_msg = next_msg, None
                    try:
                        incoming = await got
                    except StopAsyncIteration:
                        ended = True
                        continue
                    await self._check_lease()
                    await self._launch(incoming)
                    continue
                assert head is not None
                await self.runner.device_done(head.launched)
                slots.popleft()
                yield await self._collect(head)
        finally:
            if next_msg is not None:
                next_msg.cancel()
                with contextlib.suppress(BaseException):
                    await next_msg
            await self._drain()

    async def _launch(self, incoming: Incoming) -> None:
        received = time.perf_counter()
        msg, plan = incoming.msg, incoming.plan
        slot = Slot(incoming, received)
        self._slots.append(slot)
        finished = self.finished
        if self.failed and msg.follows_step_id == self.failed:
            slot.answer = void_step(msg)
        elif not self.runner.ready:
            slot.answer = result_to_proto(error_result(msg.step_id, "UNAVAILABLE", self.runner.not_ready_reason))
        elif plan is None:
            slot.answer = result_to_proto(error_result(msg.step_id, "INVALID_ARGUMENT", incoming.error))
        if slot.answer is not None:
            self.failed = msg.step_id
            finished.launch_failed()
            return
        assert plan is not None
        plan = finished.filter_launch(plan, self.runner.engine.book.entries)
        finished.observe_plan(plan)
        ahead = self._num_launched > 0
        try:
            slot.launched = await self.runner.launch(plan)
        except StepPlanError as exc:
            result = error_result(plan.step_id, exc.code, exc.message, exc.request_id or "")
        except Exception as exc:
            log.exception("engine failed at step %d", plan.step_id)
            result = await self._on_failure(plan.step_id, exc)
        else:
            slot.plan = plan
            finished.launched(plan)
            self.runner.launched_ahead += ahead
            return
        self.failed = msg.step_id
        finished.launch_failed()
        self._on_result(plan, result)
        slot.answer = result_to_proto(result, incoming.order)

    async def _collect(self, slot: Slot) -> worker_pb2.ExecuteResponse:
        launched, slot.launched = slot.launched, None
        msg, plan = slot.incoming.msg, slot.plan
        assert plan is not None
        if self.failed and msg.follows_step_id == self.failed:
            return void_step(msg)  # launched before the step it follows failed at its collect
        if not self.runner.ready:
            self.failed = msg.step_id
            return result_to_proto(error_result(msg.step_id, "UNAVAILABLE", self.runner.not_ready_reason))
        try:
            result = await self.runner.collect(launched)
        except Exception as exc:
            log.exception("engine failed at step %d", plan.step_id)
            result = await self._on_failure(plan.step_id, exc)
            self.failed = msg.step_id
        else:
            sampled = self.finished.collected(plan.step_id, result.sampled_token_ids, self.runner.engine.book.entries)
            # NOTE: the step's own time: from when it could start (received, and the step before
            # collected) to its collection; from its launch it would also count the wait behind
            # the step before, and summed steps (a worker's busy time) would count twice.
            now = time.perf_counter()
            total_s = now - max(slot.received, self._last_collected)
            self._last_collected = now
            result = StepResult(
                step_id=result.step_id,
                sampled_token_ids=sampled,
                total_s=total_s,
                forward_s=result.forward_s,
                swap_s=result.swap_s,
                sample_s=result.sample_s,
                prepare_s=result.prepare_s,
                swap_bytes=result.swap_bytes,
            )
        self._on_result(plan, result)
        return result_to_proto(result, slot.incoming.order)

    def _answered(self, slot: Slot) -> worker_pb2.ExecuteResponse:
        assert slot.answer is not None
        return slot.answer

    async def _drain(self) -> None:
        """The stream ended with steps launched: collect them (their answers go nowhere), so the
        engine holds no step half done."""
        while self._slots:
            slot = self._slots.popleft()
            if slot.launched is None or not self.runner.ready:
                continue
            with contextlib.suppress(Exception):
                await self.runner.device_done(slot.launched)
                await self.runner.collect(slot.launched)
        self.finished.forget_pipeline()


def void_step(msg: worker_pb2.ExecuteRequest) -> worker_pb2.ExecuteResponse:
    """Overlapped scheduling: a step planned while the step it follows was in flight, and that
    step failed. Its plan assumed what the failed step would have done, so nothing of it runs
    (it was still decoded, so the stream's next step may name the same ids by reference)."""
    why = f"void: planned after step {msg.follows_step_id}, which failed"
    return result_to_proto(error_result(msg.step_id, "CANCELLED", why))
