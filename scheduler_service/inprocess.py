"""The Generation API called inside the scheduler's process: what the OpenAI HTTP front of
`sluice serve` / `sluice scheduler --http-port` uses instead of a gRPC hop to itself.

    InProcessLink.generate(GenerateRequest, timeout, metadata) -> InProcessCall
        read(): the first read admits the request (LiveScheduler.submit, as GenerationServicer
            does), then one GenerateResponse per RequestStream message, grpc.aio.EOF after
            the last; every failure is the grpc.aio.AioRpcError the gRPC servicer's status
            would give a remote caller (the same code, message and google.rpc details)
        cancel(): the request is aborted (its KV freed at once), and a read under way raises
            asyncio.CancelledError, as for a cancelled gRPC call
        timeout: past it the request is aborted and the read raises DEADLINE_EXCEEDED
        metadata: a W3C traceparent in it parents the scheduler's request span
    InProcessLink.info() / readiness(): GetServerInfo and the readiness health, read directly

Why not a gRPC channel to our own port: per streamed token that hop costs the scheduler a
protobuf encode and an HTTP/2 frame, and the HTTP front a frame and a decode on the same
event loop, which on the measured machine was as much CPU per token as the scheduler's own
work (docs/results/openai_api.md). The call object mirrors the part of grpc.aio's call that
the HTTP front uses (read, cancel), so the front runs the same code over either link.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import NoReturn

import grpc
from google.rpc import code_pb2
from opentelemetry import context as otel_context
from opentelemetry import propagate

from scheduler_service.live.service import LiveScheduler, Rejected
from scheduler_service.live.stream import Chunk, RequestStream
from scheduler_service.server import (
    ending_code,
    ending_status,
    final_response,
    invalid_argument_status,
    rejected_status,
    server_info,
)
from sluice.common.security import ANONYMOUS
from sluice.contract.sampling import InvalidRequestError
from sluice.v1 import generation_pb2

CANCELLED = "client cancelled or deadline exceeded"  # the abort message of the gRPC servicer


def rpc_error(status: grpc.Status) -> grpc.aio.AioRpcError:
    """The error a gRPC client would see for `status` (its rich details in the trailing metadata)."""
    trailing = grpc.aio.Metadata(*status.trailing_metadata) if status.trailing_metadata else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(status.code, grpc.aio.Metadata(), trailing, status.details)


def _code_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class InProcessCall:
    """One Generate call in-process (see the module docstring)."""

    def __init__(
        self,
        live: LiveScheduler,
        request: generation_pb2.GenerateRequest,
        owner: str,
        timeout: float | None,
        metadata: Sequence[tuple[str, str]],
    ) -> None:
        self._live = live
        self._request = request
        self._owner = owner
        self._metadata = metadata
        self._rid = ""
        self._stream: RequestStream | None = None
        self._messages: AsyncIterator[Chunk] | None = None
        self._pending: grpc.aio.AioRpcError | None = None  # raised by the read after the last message
        self._ended = False
        self._cancelled = False
        self._expired = False
        self._timer: asyncio.TimerHandle | None = None
        if timeout is not None:
            self._timer = asyncio.get_running_loop().call_later(timeout, self._expire)

    async def read(self) -> generation_pb2.GenerateResponse | object:
        """The next message; grpc.aio.EOF after the last one."""
        if self._messages is None:
            if self._ended:
                return self._end()
            await self._admit()
            assert self._messages is not None
        if self._ended:
            return self._end()
        chunk = await anext(self._messages)
        if self._cancelled or self._expired:
            return self._end()
        if chunk.final is None:
            return generation_pb2.GenerateResponse(request_id=self._rid, token_ids=chunk.token_ids, text=chunk.text)
        self._finished()
        assert self._stream is not None
        code = ending_code(chunk.final, self._stream)
        if code == code_pb2.OK:
            return final_response(chunk)
        self._pending = rpc_error(ending_status(chunk.final, code))
        if chunk.token_ids or chunk.text:
            return generation_pb2.GenerateResponse(request_id=self._rid, token_ids=chunk.token_ids, text=chunk.text)
        return self._end()

    def cancel(self) -> bool:
        """Aborts the request (a no-op once it ended); a read under way raises CancelledError."""
        if self._ended:
            return False
        self._cancelled = True
        self._finished()
        if self._rid:
            self._live.abort(self._rid, CANCELLED)  # the stream's end wakes a read under way
        return True

    # ------------------------------------------------ inside

    async def _admit(self) -> None:
        live = self._live
        if not live.started:
            self._fail(_code_error(grpc.StatusCode.UNAVAILABLE, f"the scheduler is starting: {live.waiting_for}"))
        token = None
        if self._metadata:
            # NOTE: as the gRPC server's tracing interceptor does: the caller's context is current
            # while the request is admitted, so its request span joins the caller's trace
            token = otel_context.attach(propagate.extract(dict(self._metadata)))
        try:
            stream = await live.submit(self._request, owner=self._owner)
        except InvalidRequestError as exc:
            self._fail(rpc_error(invalid_argument_status(exc)))
        except Rejected as exc:
            self._fail(rpc_error(rejected_status(exc, live.config.retry_after_s)))
        finally:
            if token is not None:
                otel_context.detach(token)
        self._stream = stream
        self._rid = stream.request.request_id
        self._messages = stream.messages()
        if self._cancelled or self._expired:  # while the prompt was tokenized
            live.abort(self._rid, CANCELLED)

    def _fail(self, error: grpc.aio.AioRpcError) -> NoReturn:
        self._finished()
        raise error

    def _finished(self) -> None:
        self._ended = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _end(self) -> object:
        if self._cancelled:
            raise asyncio.CancelledError
        if self._expired:
            raise _code_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        if self._pending is not None:
            error, self._pending = self._pending, None
            raise error
        return grpc.aio.EOF

    def _expire(self) -> None:
        self._timer = None
        if self._ended:
            return
        self._expired = True
        self._ended = True
        if self._rid:
            self._live.abort(self._rid, CANCELLED)


class InProcessLink:
    """The scheduler's Generation API for the HTTP front in its own process. `owner`: the
    identity the requests are made with (who may Abort them over gRPC), the gateway's key's
    as when the front runs as its own process."""

    target = "in-process"
    metadata: tuple[tuple[str, str], ...] = ()

    def __init__(self, live: LiveScheduler, owner: str = ANONYMOUS) -> None:
        self.live = live
        self.owner = owner

    def generate(
        self,
        request: generation_pb2.GenerateRequest,
        *,
        timeout: float | None = None,
        metadata: Sequence[tuple[str, str]] = (),
    ) -> InProcessCall:
        return InProcessCall(self.live, request, self.owner, timeout, metadata)

    async def info(self, timeout_s: float = 5.0) -> generation_pb2.GetServerInfoResponse:
        if not self.live.started:
            raise _code_error(grpc.StatusCode.UNAVAILABLE, f"the scheduler is starting: {self.live.waiting_for}")
        return server_info(self.live)

    async def readiness(self, timeout_s: float = 2.0) -> str:
        return "serving" if self.live.started and self.live.is_healthy else "not_serving"

    async def close(self) -> None:
        return None
