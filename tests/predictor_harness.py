"""Helpers of the predictor tests: a tiny trained model, TCP stand-ins for a dead Redis, engines."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from pathlib import Path

from predictor_service.train import TrainConfig, train

REDIS_URL = "redis://127.0.0.1:6379/0"
TEST_PREFIX = "sluice-test-predictor"
# NOTE: the bundled subsets (data/), so the tests run in a clone with nothing beside it.
BUNDLED_SOURCES = (
    "prompts/sharegpt_v3_conversations_2k_first_turns.jsonl.gz",
    "prompts/alpaca_eval_outputs_2models.jsonl.gz",
)
TINY_CONFIG = {"sources": BUNDLED_SOURCES, "limit_per_source": 500, "epochs": 25, "patience": 25, "progress": False}


def train_tiny_predictor(out: Path) -> Path:
    train(out, TrainConfig(**TINY_CONFIG, seed_history_per_model={"*": 20}))
    return out


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def silent_server() -> AsyncIterator[int]:
    """Accepts TCP connections and never answers: a stopped or hung peer."""
    held: list[asyncio.StreamWriter] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for w in held:
            w.close()


class RedisProxy:
    """A TCP proxy to the real Redis that the test can stop and start on the same port."""

    def __init__(self, port: int, target: tuple[str, int] = ("127.0.0.1", 6379)) -> None:
        self.port = port
        self.target = target
        self._server: asyncio.base_events.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port, reuse_address=True)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for w in self._writers:
            w.close()
        self._writers.clear()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self._writers += [writer, up_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


async def delete_test_keys(prefix: str) -> None:
    import redis.asyncio as redis

    client = redis.Redis.from_url(REDIS_URL)
    try:
        keys = [k async for k in client.scan_iter(match=f"{prefix}*")]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()
