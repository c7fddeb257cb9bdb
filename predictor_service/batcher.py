"""Micro-batching: prompts that arrive close together are encoded in one onnxruntime call.

    submit(item) --queue--> worker task: take the first item, then everything that arrives
    within `window_s` or while the previous batch ran (up to `max_batch`) --run_batch in one
    thread--> results --> each caller's future

The blocking call runs in a single worker thread, so the event loop keeps answering gRPC (and
health) while a batch encodes. NOTE: a lone request waits at most `window_s` (1 ms by default)
for company; under load, requests that queue behind a running batch are taken together
without any extra wait, which is where batching pays (one call of 16 prompts costs far less
than 16 calls of one).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class MicroBatcher(Generic[T, R]):
    def __init__(
        self,
        run_batch: Callable[[list[T]], Sequence[R]],
        *,
        window_s: float = 0.001,
        max_batch: int = 32,
        on_batch: Callable[[int], None] | None = None,
    ) -> None:
        self.run_batch = run_batch
        self.window_s = window_s
        self.max_batch = max_batch
        self.on_batch = on_batch or (lambda n: None)
        self._queue: asyncio.Queue[tuple[T, asyncio.Future[R]]] = asyncio.Queue()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="predictor-batch")
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="predictor-batcher")

    async def submit(self, item: T) -> R:
        self.start()
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        await self._queue.put((item, future))
        return await future

    async def submit_many(self, items: Sequence[T]) -> list[R]:
        return list(await asyncio.gather(*(self.submit(i) for i in items)))

    async def _collect(self) -> list[tuple[T, asyncio.Future[R]]]:
        batch = [await self._queue.get()]
        deadline = asyncio.get_running_loop().time() + self.window_s
        while len(batch) < self.max_batch:
            if not self._queue.empty():
                batch.append(self._queue.get_nowait())
                continue
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(self._queue.get(), remaining))
            except TimeoutError:
                break
        return batch

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._collect()
            live = [(item, fut) for item, fut in batch if not fut.done()]
            if not live:
                continue
            self.on_batch(len(live))
            try:
                results = await loop.run_in_executor(self._executor, self.run_batch, [i for i, _ in live])
            except Exception as exc:  # the callers get the error; the loop lives on
                for _, fut in live:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            for (_, fut), result in zip(live, results, strict=True):
                if not fut.done():
                    fut.set_result(result)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._executor.shutdown(wait=False, cancel_futures=True)
