"""Answers written behind the engine: step N+1 runs while step N's answer is still being written.

A gRPC aio handler that yields a message is resumed only once gRPC reports the message's write
done, and that report comes back through gRPC's poller thread and the event loop. On a CPU
engine the step itself runs on the loop (EngineRunner.step), so the worker computed nothing
during that wait although the next plan was already read and decoded (StepReader): on
tiny-llama with vLLM's runner the wait was a median 0.37 ms (mean 0.71 ms) beside a median
7.6 ms step, on two busy cores.

`written_behind` runs the answering generator in a task of its own. The handler takes each
answer and yields it (gRPC starts the write then, in the same turn of the loop); meanwhile the
task goes on to the next step. The task waits until its answer is taken before making the
next one, so at most one answer is made and not yet taken (the stream's flow control still
holds the worker back, one answer later), and an answer is never held back behind a later
step: the step after it starts only once its write has started.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(slots=True)
class _Ended:
    error: Exception | None = None  # what the answering generator raised; None: it finished


@dataclass(slots=True)
class _Answer(Generic[T]):
    item: T


async def written_behind(answers: AsyncIterator[T]) -> AsyncIterator[T]:
    """`answers`' items in order, `answers` running one item ahead in its own task (see the
    module docstring). An exception it raises is raised here after the items before it;
    closing this generator cancels the task (and closes `answers`) and waits for it."""
    ready: asyncio.Queue[_Answer[T] | _Ended] = asyncio.Queue(maxsize=1)
    taken = asyncio.Event()

    async def produce() -> None:
        try:
            async with contextlib.aclosing(answers):  # type: ignore[type-var]
                async for item in answers:
                    taken.clear()
                    await ready.put(_Answer(item))
                    await taken.wait()
        except Exception as exc:  # re-raised by the handler, in order (a lease abort, a failed read)
            await ready.put(_Ended(exc))
            return
        await ready.put(_Ended())

    task = asyncio.create_task(produce())
    try:
        while True:
            got = await ready.get()
            if isinstance(got, _Ended):
                if got.error is not None:
                    raise got.error
                return
            # NOTE: set before the yield, so the task runs again only after this turn of the loop,
            # in which gRPC starts writing the answer.
            taken.set()
            yield got.item
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
