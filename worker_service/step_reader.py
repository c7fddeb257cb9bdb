"""StepReader: the worker's end of an Execute stream, read one message ahead.

    reader task:  stream.read -> PlanReceiver.decode -> queue (at most AHEAD decoded steps)
    Execute:      for each Incoming: run it (or answer its error), answer in order

With overlapped scheduling the scheduler sends plan N+1 while the worker runs step N. Reading
and decoding it then, instead of after N's answer, takes the proto parsing and plan decoding
of N+1 off the time between two steps; with the step on the engine thread (see
EngineRunner.step) that work runs while the device computes. Plans are decoded in stream
order, so a message that names the previous step's ids by reference still decodes. Each
Incoming keeps its own sampling order, so its answer can be encoded after later ones were
decoded.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from sluice.contract.plan import StepPlan
from sluice.contract.plan_codec import PlanReceiver, step_order
from sluice.v1 import worker_pb2

AHEAD = 2  # decoded steps waiting at most (the scheduler keeps at most two on the stream)


@dataclass(slots=True)
class Incoming:
    msg: worker_pb2.ExecuteRequest
    plan: StepPlan | None  # None: the message did not decode (`error` says why)
    error: str = ""
    order: list[str] | None = None  # the plan's sampling requests in scheduled order


class StepReader:
    def __init__(self, requests: AsyncIterator[worker_pb2.ExecuteRequest], receiver: PlanReceiver) -> None:
        self._requests = requests
        self._receiver = receiver
        self._queue: asyncio.Queue[Incoming | BaseException | None] = asyncio.Queue(maxsize=AHEAD)
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for msg in self._requests:
                await self._queue.put(self._decode(msg))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the stream failed: Execute re-raises it in order
            await self._queue.put(exc)
            return
        await self._queue.put(None)

    def _decode(self, msg: worker_pb2.ExecuteRequest) -> Incoming:
        try:
            plan = self._receiver.decode(msg)
        except (ValueError, TypeError) as exc:  # InvalidRequestError names the field
            return Incoming(msg, None, str(exc))
        return Incoming(msg, plan, order=step_order(plan))

    def __aiter__(self) -> StepReader:
        return self

    async def __anext__(self) -> Incoming:
        item = await self._queue.get()
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
