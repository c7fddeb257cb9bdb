"""HeadJoiningTransport over a real loopback connection: a response head is written with the
bytes that follow it (one write), goes out by itself at the loop's next pass when nothing
follows, is sent before a close, and every other write goes out at once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from gateway_service.http_protocol import HeadJoiningTransport

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
CHUNK = b'1a\r\ndata: {"text":"hello"}\n\n\r\n'


class CountedTransport:
    """The server's real transport, with the writes it was given kept in order."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))
        self.transport.write(data)

    def __getattr__(self, name: str):
        return getattr(self.transport, name)


@dataclass
class Link:
    server: HeadJoiningTransport
    counted: CountedTransport
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    async def read_exactly(self, n: int) -> bytes:
        return await asyncio.wait_for(self.reader.readexactly(n), 5)


@pytest.fixture
async def link() -> AsyncIterator[Link]:
    loop = asyncio.get_running_loop()
    made: asyncio.Future[tuple[HeadJoiningTransport, CountedTransport]] = loop.create_future()

    class Server(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            assert isinstance(transport, asyncio.Transport)
            counted = CountedTransport(transport)
            made.set_result((HeadJoiningTransport(counted, loop), counted))  # type: ignore[arg-type]

    server = await loop.create_server(Server, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    joined, counted = await asyncio.wait_for(made, 5)
    yield Link(joined, counted, reader, writer)
    writer.close()
    joined.close()
    server.close()
    await server.wait_closed()


async def test_a_head_and_the_body_written_after_it_go_out_in_one_write(link: Link) -> None:
    link.server.write(HEAD)
    assert link.counted.writes == []  # held: the body's first bytes come next
    link.server.write(CHUNK)
    assert link.counted.writes == [HEAD + CHUNK]
    assert await link.read_exactly(len(HEAD + CHUNK)) == HEAD + CHUNK


async def test_a_head_with_nothing_after_it_goes_out_at_the_loops_next_pass(link: Link) -> None:
    link.server.write(HEAD)
    await asyncio.sleep(0)
    assert link.counted.writes == [HEAD]
    assert await link.read_exactly(len(HEAD)) == HEAD
    link.server.write(CHUNK)  # a later write is not joined to a head already sent
    assert link.counted.writes == [HEAD, CHUNK]


async def test_a_held_head_is_sent_before_the_connection_closes(link: Link) -> None:
    link.server.write(HEAD)
    link.server.close()
    assert await asyncio.wait_for(link.reader.read(), 5) == HEAD  # then EOF


async def test_body_bytes_go_out_at_once_and_the_rest_is_the_real_transports(link: Link) -> None:
    link.server.write(CHUNK)
    link.server.write(CHUNK)
    assert link.counted.writes == [CHUNK, CHUNK]
    assert await link.read_exactly(2 * len(CHUNK)) == CHUNK + CHUNK
    assert link.server.get_extra_info("peername") == link.writer.get_extra_info("sockname")
    assert not link.server.is_closing()
