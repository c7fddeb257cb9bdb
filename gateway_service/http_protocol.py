"""uvicorn's httptools protocol with a response's head and its first body bytes in one write.

uvicorn writes the status line and headers (`http.response.start`) to the socket at once, and
the body in a write of its own. For a streamed answer the gateway sends the head only when the
first token is there, so the two writes come back to back: two system calls, and on loopback
the first one wakes the client for the head alone, often before the gateway gets to write the
token it waits for (docs/results/openai_api.md measures the difference).

HeadJoiningTransport holds a write that is a response head and sends it with the next write
(the body's first bytes), or at the event loop's next pass when no write follows in the same
callback: a head is never held past the code that wrote it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_STATUS_LINE_START = b"HTTP/1.1 "
_HEAD_END = b"\r\n\r\n"


class HeadJoiningTransport:
    """A transport (every other method is the wrapped one's) whose head writes wait for the next write."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._head: bytes | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        head = self._head
        if head is not None:
            self._head = None
            self._transport.write(head + data)
        elif data[:9] == _STATUS_LINE_START and data[-4:] == _HEAD_END:
            # NOTE: a 100 Continue is a head too: it goes out at the next pass, with nothing to join
            self._head = bytes(data)
            self._loop.call_soon(self.flush)
        else:
            self._transport.write(data)

    def flush(self) -> None:
        head, self._head = self._head, None
        if head is not None and not self._transport.is_closing():
            self._transport.write(head)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class GatewayHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol over a HeadJoiningTransport (uvicorn.Config(http=...))."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(HeadJoiningTransport(transport, self.loop))  # type: ignore[arg-type]
