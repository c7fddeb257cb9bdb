"""written_behind: the next answer is made while the one before is being written, in order,
one ahead at most, errors after the answers before them, and closing stops the maker."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from worker_service.write_behind import written_behind


async def test_next_answer_is_made_while_the_previous_is_written() -> None:
    made: list[int] = []

    async def answers() -> AsyncIterator[int]:
        for i in range(5):
            made.append(i)
            yield i

    got: list[int] = []
    async with contextlib.aclosing(written_behind(answers())) as stream:
        async for item in stream:
            got.append(item)
            # the write of `item`: the loop runs other tasks meanwhile
            for _ in range(5):
                await asyncio.sleep(0)
            # the next answer is already made, and only the next: one ahead at most
            assert made == list(range(min(item + 2, 5)))
    assert got == list(range(5))


async def test_an_error_comes_after_the_answers_before_it() -> None:
    async def answers() -> AsyncIterator[int]:
        yield 1
        yield 2
        raise ValueError("stream broke")

    got: list[int] = []
    with pytest.raises(ValueError, match="stream broke"):
        async for item in written_behind(answers()):
            got.append(item)
    assert got == [1, 2]


async def test_closing_stops_the_maker_and_closes_its_generator() -> None:
    closed = asyncio.Event()
    steps = 0

    async def answers() -> AsyncIterator[int]:
        nonlocal steps
        try:
            while True:
                steps += 1
                yield steps
        finally:
            closed.set()

    stream = written_behind(answers())
    assert await anext(stream) == 1
    await stream.aclose()
    assert closed.is_set()
    made = steps
    for _ in range(5):
        await asyncio.sleep(0)
    assert steps == made <= 2  # nothing made after the close, and at most one ahead before it
