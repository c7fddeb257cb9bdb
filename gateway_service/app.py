"""The OpenAI HTTP API as an ASGI app over the scheduler's gRPC Generate stream: the two
generation routes served by the gateway directly (GatewayApp), the rest by Starlette.

    POST /v1/completions, POST /v1/chat/completions
        Bearer key (401) -> body (413 / 400) -> protocol.parse_* (400 naming the field)
        -> model name (404) -> one Generate call per choice, with the caller's traceparent
        and the gateway's own key in the metadata
        stream: wait for each choice's... first message before answering, so every failure
            before the first token (400, 429 + Retry-After, 503, 504) is a real HTTP status;
            then `data: {chunk}` per scheduler message, the usage chunk when asked, `data: [DONE]`;
            a failure after the first token is an `data: {"error": ...}` event and no [DONE]
        else: the whole answer as JSON, or the error's status
        the client leaving (before or during the answer) cancels the gRPC calls: the scheduler
        aborts the requests and frees their KV, as for any gRPC client that cancels (one task
        per request watches the connection: Departure)
    GET /v1/models, /v1/models/{id}   the scheduler's model and the served names (Bearer key)
    GET /health                       200 when the scheduler has a worker ready, else 503 (no key)
    GET /metrics                      the gateway's Prometheus metrics (Bearer key)

Errors are OpenAI's JSON (errors.py); unknown routes are 404 and wrong methods 405 in the
same shape. The gateway reaches the scheduler through a SchedulerLink: one gRPC channel
(HTTP/2: every request is a stream on it; `sluice gateway`), or the scheduler's API called in
its own process (the link `sluice serve` hands it); it learns the model and limits from
GetServerInfo at the first request that needs them.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import propagate, trace
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway_service.chat import ChatTemplate
from gateway_service.config import GatewayConfig
from gateway_service.errors import ApiError, from_rpc_error, invalid
from gateway_service.metrics import GatewayMetrics
from gateway_service.protocol import Parsed, parse_chat, parse_completion
from gateway_service.shapes import DONE, Shapes, dumps, error_event, usage_of
from sluice.common.grpc_server import CHANNEL_OPTIONS
from sluice.common.security import ApiKeys, ClientSecurity, split_keys
from sluice.common.telemetry import tracing_enabled
from sluice.v1 import common_pb2, generation_pb2, generation_pb2_grpc

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}
CLIENT_GONE = 499  # nginx's code for a client that closed the connection (only counted, never sent)


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was complete."""


# ---------------------------------------------------------------- the scheduler


class SchedulerLink(Protocol):
    """What the gateway needs of the scheduler: GrpcSchedulerLink (a channel to its gRPC API,
    `sluice gateway`) or the scheduler's in-process API (scheduler_service/inprocess.py, the
    HTTP front of `sluice serve`). Failures are grpc.aio.AioRpcError either way."""

    target: str
    metadata: tuple[tuple[str, str], ...]

    def generate(self, request: generation_pb2.GenerateRequest, *, timeout: float | None, metadata: Any) -> Any:
        """A Generate call: `read()` (a message, or grpc.aio.EOF after the last) and `cancel()`."""
        ...

    async def info(self, timeout_s: float = 5.0) -> generation_pb2.GetServerInfoResponse: ...

    async def readiness(self, timeout_s: float = 2.0) -> str:
        """serving (a worker steps), not_serving, or unreachable."""
        ...

    async def close(self) -> None: ...


class GrpcSchedulerLink:
    """One gRPC channel to the scheduler (HTTP/2: every request is a stream on it)."""

    def __init__(self, target: str, security: ClientSecurity) -> None:
        self.target = target
        self.channel = security.channel(target, options=CHANNEL_OPTIONS)
        self.stub = generation_pb2_grpc.GenerationServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.metadata: tuple[tuple[str, str], ...] = security.metadata

    def generate(self, request: generation_pb2.GenerateRequest, *, timeout: float | None, metadata: Any) -> Any:
        return self.stub.Generate(request, timeout=timeout, metadata=metadata)

    async def info(self, timeout_s: float = 5.0) -> generation_pb2.GetServerInfoResponse:
        return await self.stub.GetServerInfo(
            generation_pb2.GetServerInfoRequest(), timeout=timeout_s, metadata=self.metadata or None
        )

    async def readiness(self, timeout_s: float = 2.0) -> str:
        try:
            reply = await self.health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return "unreachable"
        return "serving" if reply.status == health_pb2.HealthCheckResponse.SERVING else "not_serving"

    async def close(self) -> None:
        await self.channel.close()


# ---------------------------------------------------------------- streams of choices


class Choices:
    """The messages of a request's Generate calls, (choice index, message) as they come; the
    first gRPC error is raised. `cancel` cancels every call (the scheduler aborts the requests):
    a read under way raises asyncio.CancelledError.
    NOTE: one call (the usual request) is read with call.read(), no task and no queue."""

    def __init__(self, calls: Sequence[Any]) -> None:
        self.calls = calls
        self._queue: asyncio.Queue[tuple[int, Any]] | None = None
        self._tasks: list[asyncio.Task] = []
        self._left = len(calls)
        self._failure: BaseException | None = None  # met by queued(), raised by the next next()
        if len(calls) > 1:
            self._queue = asyncio.Queue()
            self._tasks = [asyncio.create_task(self._pump(i, c)) for i, c in enumerate(calls)]

    async def _pump(self, i: int, call: Any) -> None:
        assert self._queue is not None
        try:
            while (msg := await call.read()) is not grpc.aio.EOF:
                self._queue.put_nowait((i, msg))
            self._queue.put_nowait((i, None))
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
            self._queue.put_nowait((i, exc))

    async def next(self) -> tuple[int, generation_pb2.GenerateResponse] | None:
        """The next message of any choice, None once every stream ended."""
        if self._queue is None:
            msg = await self.calls[0].read()  # raises the call's error at its end
            return None if msg is grpc.aio.EOF else (0, msg)
        if self._failure is not None:
            raise self._failure
        while self._left:
            i, item = await self._queue.get()
            if item is None:
                self._left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                return i, item
        return None

    def queued(self) -> list[tuple[int, generation_pb2.GenerateResponse]]:
        """The messages of any choice that are here already (nothing waited for), up to an
        error, which the next next() raises."""
        out: list[tuple[int, generation_pb2.GenerateResponse]] = []
        queue = self._queue
        while queue is not None and self._failure is None and not queue.empty():
            i, item = queue.get_nowait()
            if item is None:
                self._left -= 1
            elif isinstance(item, BaseException):
                self._failure = item
            else:
                out.append((i, item))
        return out

    def cancel(self) -> None:
        """A no-op for a call that ended; otherwise the scheduler aborts its request."""
        for call in self.calls:
            call.cancel()
        for task in self._tasks:
            task.cancel()
        if self._queue is not None:
            self._queue.put_nowait((-1, asyncio.CancelledError()))  # wakes a next() that waits


class Departure:
    """Watches the client while its answer is made (one task per request): when it
    disconnects, the request's calls are cancelled, so the read the answer waits on raises
    asyncio.CancelledError with `gone` set."""

    def __init__(self, receive: Receive, choices: Choices) -> None:
        self.gone = False
        self._task = asyncio.ensure_future(self._watch(receive, choices))

    async def _watch(self, receive: Receive, choices: Choices) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        choices.cancel()

    def stop(self) -> None:
        self._task.cancel()


# ---------------------------------------------------------------- one generation request


@dataclass
class Generation:
    """The state of one HTTP generation request across its choices."""

    parsed: Parsed
    shapes: Shapes
    route: str
    arrival: float
    span: Any
    num_prompts: int
    texts: list[list[str]] = field(default_factory=list)
    finish: list[str | None] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    completion_tokens: list[int] = field(default_factory=list)
    started: set[int] = field(default_factory=set)
    num_tokens: int = 0
    num_finished: int = 0
    answering: bool = False  # its HTTP answer has started

    def __post_init__(self) -> None:
        k = self.parsed.num_choices
        self.texts = [[] for _ in range(k)]
        self.finish = [None] * k
        self.prompt_tokens = [0] * k
        self.completion_tokens = [0] * k

    def take(self, index: int, msg: generation_pb2.GenerateResponse) -> str | None:
        """Records a message; returns its finish reason when it is the choice's last."""
        self.num_tokens += len(msg.token_ids)
        reason = FINISH_REASONS.get(msg.finish_reason)
        if reason is not None or msg.finish_reason:
            reason = reason or "error"
            self.num_finished += 1
            self.finish[index] = reason
            self.prompt_tokens[index] = msg.usage.prompt_tokens
            self.completion_tokens[index] = msg.usage.completion_tokens
        return reason

    @property
    def finished(self) -> bool:
        """Every choice has had its last message."""
        return self.num_finished == len(self.finish)

    def usage(self) -> dict[str, int]:
        # NOTE: a prompt sampled n times counts once, as OpenAI counts it
        n = self.parsed.n
        prompt = sum(self.prompt_tokens[i * n] for i in range(self.num_prompts))
        return usage_of(prompt, sum(self.completion_tokens))


# ---------------------------------------------------------------- the gateway


class Gateway:
    """The OpenAI API over `link`; without one, over a gRPC channel to cfg.scheduler (made at open)."""

    def __init__(
        self, cfg: GatewayConfig, metrics: GatewayMetrics | None = None, link: SchedulerLink | None = None
    ) -> None:
        self.cfg = cfg
        keys = split_keys(cfg.api_key)
        self.api_keys = ApiKeys(keys) if keys else None
        self.metrics = metrics or GatewayMetrics()
        self.link: SchedulerLink | None = link
        self._info: generation_pb2.GetServerInfoResponse | None = None
        self.created = int(time.time())
        self._template: ChatTemplate | None = None
        if cfg.chat_template:
            ChatTemplate.load("", cfg.chat_template)  # a bad template fails at start, not per request
        self.tracer = trace.get_tracer("sluice.gateway")

    # ------------------------------------------------ plumbing

    async def open(self) -> None:
        if self.link is None:
            self.link = GrpcSchedulerLink(self.cfg.scheduler, self.cfg.scheduler_security())

    async def close(self) -> None:
        if self.link is not None:
            await self.link.close()

    def _link(self) -> SchedulerLink:
        assert self.link is not None, "the gateway is not open"
        return self.link

    async def info(self) -> generation_pb2.GetServerInfoResponse:
        """The scheduler's model and limits, asked once (ApiError while it cannot answer)."""
        if self._info is None:
            link = self._link()
            try:
                self._info = await link.info()
            except grpc.aio.AioRpcError as exc:
                error = from_rpc_error(exc)
                raise ApiError(
                    error.status, f"the scheduler at {link.target}: {error.message}", code=error.code
                ) from None
        return self._info

    def authorize(self, headers: Mapping[str, str]) -> None:
        if self.api_keys is None:
            return
        header = headers.get("authorization")
        problem = self.api_keys.check((("authorization", header),) if header is not None else ())
        if problem is not None:
            message = "missing API key: send `Authorization: Bearer <key>`" if header is None else problem
            raise ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def body(self, headers: Mapping[str, str], receive: Receive) -> Any:
        length = headers.get("content-length")
        limit = self.cfg.max_body_bytes
        if length is not None and length.isdigit() and int(length) > limit:
            raise ApiError(413, f"the request body is {length} bytes; the limit is {limit}", code="body_too_large")
        message = await receive()
        raw: bytes | bytearray = message.get("body", b"")
        if message.get("more_body", False):
            raw = bytearray(raw)
        while message.get("more_body", False):
            message = await receive()
            raw += message.get("body", b"")
            if len(raw) > limit:
                raise ApiError(413, f"the request body is over {limit} bytes", code="body_too_large")
        if message["type"] == "http.disconnect":
            raise ClientGone
        if len(raw) > limit:
            raise ApiError(413, f"the request body is over {limit} bytes", code="body_too_large")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise invalid("body", f"is not valid JSON: {exc}") from None

    def model_names(self, info: generation_pb2.GetServerInfoResponse) -> list[str]:
        return list(dict.fromkeys([*self.cfg.served_model_name, info.model]))

    def model_name(self, asked: str | None, info: generation_pb2.GetServerInfoResponse) -> str:
        names = self.model_names(info)
        if asked is None or asked == "":
            return names[0]
        if asked not in names:
            raise ApiError(
                404,
                f"model {asked!r} does not exist here; this server serves {', '.join(map(repr, names))}",
                param="model",
                code="model_not_found",
            )
        return asked

    def chat_template(self, info: generation_pb2.GetServerInfoResponse) -> ChatTemplate:
        if self._template is None:
            self._template = ChatTemplate.load(info.model, self.cfg.chat_template)
        return self._template

    def trace_metadata(self, headers: Mapping[str, str], route: str) -> tuple[Any, tuple[tuple[str, str], ...]]:
        """(the gateway's span or None, the W3C trace headers for the scheduler): the client's
        traceparent continues through a span of the gateway when it traces, else as it came."""
        traced = tracing_enabled()
        if not traced and "traceparent" not in headers:
            return None, ()
        context = propagate.extract(headers)
        span = None
        if traced:
            span = self.tracer.start_span(f"POST {route}", context=context, kind=trace.SpanKind.SERVER)
            context = trace.set_span_in_context(span, context)
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=context)
        return span, tuple(carrier.items())

    # ------------------------------------------------ generation (ASGI: see GatewayApp)

    async def generate(self, scope: Scope, receive: Receive, send: Send, kind: str) -> None:
        """POST /v1/completions ("completion") or /v1/chat/completions ("chat")."""
        arrival = time.perf_counter()
        route = scope["path"]
        headers = header_dict(scope)
        span = None
        calls: list[Any] = []
        try:
            self.authorize(headers)
            body = await self.body(headers, receive)
            info = await self.info()
            link = self._link()
            parsed = parse_chat(body, self.chat_template(info)) if kind == "chat" else parse_completion(body)
            model = self.model_name(parsed.model, info)
            rid = parsed.request_id or headers.get("x-request-id") or uuid.uuid4().hex
            span, trace_headers = self.trace_metadata(headers, route)
            metadata = (*link.metadata, *trace_headers) if trace_headers else link.metadata
            timeout = self.cfg.request_timeout_s
            calls = [link.generate(r, timeout=timeout, metadata=metadata) for r in parsed.requests(rid)]
            self.metrics.prepare.observe(time.perf_counter() - arrival)
        except ApiError as error:
            self._error(route, error, span)
            await send_error(send, error)
            return
        except ClientGone:
            self.metrics.request_done(route, CLIENT_GONE)
            return
        except Exception:
            # NOTE: as Starlette's ServerErrorMiddleware: a 500, then the error to the server's log
            for call in calls:
                call.cancel()
            self._error(route, ApiError(500, "internal error of the gateway"), span)
            await send_error(send, ApiError(500, "internal error of the gateway", code="server_error"))
            raise
        shapes = Shapes(
            kind, ("chatcmpl-" if kind == "chat" else "cmpl-") + rid, model, int(time.time()), parsed.include_usage
        )
        gen = Generation(parsed, shapes, route, arrival, span, len(parsed.prompts))
        choices = Choices(calls)
        departure = Departure(receive, choices)
        self.metrics.running.inc()
        status = 500
        try:
            if parsed.stream:
                status = await self._stream(gen, choices, send, rid)
            else:
                status = await self._whole(gen, choices, send, rid)
        except asyncio.CancelledError:
            if not departure.gone:
                raise  # the server stops
            status = CLIENT_GONE
            self.metrics.disconnects.inc()
        except Exception:
            if not gen.answering:  # nothing sent yet: a 500, then the error to the server's log
                await send_error(send, ApiError(500, "internal error of the gateway", code="server_error"))
            raise
        finally:
            departure.stop()
            choices.cancel()  # a no-op for calls that ended
            self._done(gen, status)

    async def _whole(self, gen: Generation, choices: Choices, send: Send, rid: str) -> int:
        """The non-streaming answer: every message collected, then the JSON (or the error)."""
        try:
            while (item := await choices.next()) is not None:
                index, msg = item
                if msg.text:
                    gen.texts[index].append(msg.text)
                gen.take(index, msg)
        except grpc.aio.AioRpcError as exc:
            return await self._failed(gen, send, from_rpc_error(exc, gen.parsed.aliases))
        texts = ["".join(t) for t in gen.texts]
        answer = gen.shapes.whole(texts, [f or "error" for f in gen.finish], gen.usage())
        gen.answering = True
        await send_bytes(send, 200, dumps(answer), JSON_TYPE, [(b"x-request-id", rid.encode())])
        return 200

    async def _stream(self, gen: Generation, choices: Choices, send: Send, rid: str) -> int:
        """Server-sent events, one per scheduler message, one write per message or per batch of
        the choices' messages that came together (the last with the end of the body). The first
        message is awaited before the answer starts, so every failure before it is a real HTTP
        status; a failure after it is an error event and no [DONE]."""
        try:
            first = await choices.next()
        except grpc.aio.AioRpcError as exc:
            return await self._failed(gen, send, from_rpc_error(exc, gen.parsed.aliases))
        if first is None:  # the stream ended with no message at all
            return await self._failed(gen, send, ApiError(502, "the scheduler's stream ended without a message"))
        headers = [(b"x-request-id", rid.encode()), *EVENT_STREAM_HEADERS]
        gen.answering = True
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        # NOTE: the last choice's last event, the usage event and [DONE] go out in one write
        event = self._event(gen, *first)
        if not gen.finished:
            await send({"type": "http.response.body", "body": event, "more_body": True})
            event = b""
        self.metrics.ttft_of(gen.route).observe(time.perf_counter() - gen.arrival)
        try:
            if len(choices.calls) == 1:
                event = await self._stream_one(gen, choices.calls[0], send, event)
            else:
                while (item := await choices.next()) is not None:
                    # NOTE: the choices' messages that came together go out in one write
                    event = b"".join([self._event(gen, *item), *(self._event(gen, *m) for m in choices.queued())])
                    if not gen.finished:
                        await send({"type": "http.response.body", "body": event, "more_body": True})
                        event = b""
        except grpc.aio.AioRpcError as exc:
            error = from_rpc_error(exc, gen.parsed.aliases)
            await send({"type": "http.response.body", "body": error_event(error), "more_body": False})
            return error.status
        usage = gen.shapes.usage_event(gen.usage()) if gen.parsed.include_usage else b""
        await send({"type": "http.response.body", "body": event + usage + DONE, "more_body": False})
        return 200

    @staticmethod
    async def _stream_one(gen: Generation, call: Any, send: Send, event: bytes) -> bytes:
        """The rest of a one-choice stream after its first message (the usual request): one
        event per message, read from the call itself; returns the last event, not yet sent.
        NOTE: this loop is the gateway's per-token work, so it calls no more than it must."""
        read, take, shape = call.read, gen.take, gen.shapes.event
        while (msg := await read()) is not grpc.aio.EOF:  # raises the call's error at its end
            event = shape(0, msg.text, take(0, msg), False)
            if not gen.finished:
                await send({"type": "http.response.body", "body": event, "more_body": True})
                event = b""
        return event

    async def _failed(self, gen: Generation, send: Send, error: ApiError) -> int:
        gen.answering = True
        await send_error(send, error)
        return error.status

    def _event(self, gen: Generation, index: int, msg: generation_pb2.GenerateResponse) -> bytes:
        reason = gen.take(index, msg)
        first = index not in gen.started
        if first:
            gen.started.add(index)
        return gen.shapes.event(index, msg.text, reason, first)

    def _done(self, gen: Generation, status: int) -> None:
        self.metrics.running.dec()
        self.metrics.tokens.inc(gen.num_tokens)
        self.metrics.duration_of(gen.route).observe(time.perf_counter() - gen.arrival)
        self.metrics.request_done(gen.route, status)
        if gen.span is not None:
            gen.span.set_attribute("http.response.status_code", status)
            gen.span.end()

    def _error(self, route: str, error: ApiError, span: Any = None) -> None:
        self.metrics.request_done(route, error.status)
        if span is not None:
            span.set_attribute("http.response.status_code", error.status)
            span.end()

    # ------------------------------------------------ the other routes (Starlette)

    async def models(self, request: Request) -> Response:
        try:
            self.authorize(request.headers)
            info = await self.info()
        except ApiError as error:
            self._error("/v1/models", error)
            return error_response(error)
        cards = [self._card(name, info) for name in self.model_names(info)]
        wanted = request.path_params.get("model")
        if wanted is None:
            return JSONResponse({"object": "list", "data": cards})
        for card in cards:
            if card["id"] == wanted:
                return JSONResponse(card)
        error = ApiError(404, f"model {wanted!r} does not exist here", param="model", code="model_not_found")
        self._error("/v1/models", error)
        return error_response(error)

    def _card(self, name: str, info: generation_pb2.GetServerInfoResponse) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "sluice",
            "root": info.model,
            "max_model_len": info.max_model_len,
        }

    async def health(self, request: Request) -> Response:
        state = await self._link().readiness()
        return JSONResponse(
            {"status": "ok" if state == "serving" else state, "scheduler": state}, 200 if state == "serving" else 503
        )

    async def prometheus(self, request: Request) -> Response:
        try:
            self.authorize(request.headers)
        except ApiError as error:
            return error_response(error)
        return Response(self.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")


JSON_TYPE = b"application/json"
EVENT_STREAM_HEADERS = ((b"cache-control", b"no-cache"), (b"content-type", b"text/event-stream; charset=utf-8"))


def header_dict(scope: Scope) -> dict[str, str]:
    """The request's headers by lower-case name (HTTP servers give them lower-case in ASGI);
    of a repeated header, the first."""
    out: dict[str, str] = {}
    for name, value in scope["headers"]:
        out.setdefault(name.decode("latin-1"), value.decode("latin-1"))
    return out


async def send_bytes(
    send: Send, status: int, body: bytes, media_type: bytes, headers: Sequence[tuple[bytes, bytes]]
) -> None:
    """A whole answer in one write after its head."""
    head = [*headers, (b"content-length", str(len(body)).encode()), (b"content-type", media_type)]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(send: Send, error: ApiError) -> None:
    headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in error.headers.items()]
    await send_bytes(send, error.status, dumps(error.body()), JSON_TYPE, headers)


def error_response(error: ApiError) -> Response:
    return Response(dumps(error.body()), status_code=error.status, media_type="application/json", headers=error.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = "not_found" if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405 else None
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return error_response(ApiError(exc.status_code, message, code=code, headers=exc.headers))


class GenerationRoute:
    """A generation route as an ASGI endpoint of the Starlette app (where GET on it is a 405)."""

    def __init__(self, gateway: Gateway, kind: str) -> None:
        self.gateway = gateway
        self.kind = kind

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.gateway.generate(scope, receive, send, self.kind)


GENERATION_ROUTES = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}


class GatewayApp:
    """The ASGI app: POST to a generation route goes straight to the gateway; everything else
    (lifespan, the other routes, 404 and 405) to Starlette.
    NOTE: Starlette's request, router and two middleware layers (each wrapping every `send`,
    so every streamed token) cost more per request than the gateway's own preparation
    (docs/results/openai_api.md)."""

    def __init__(self, gateway: Gateway, starlette: Starlette) -> None:
        self.gateway = gateway
        self.starlette = starlette

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            kind = GENERATION_ROUTES.get(scope["path"])
            if kind is not None:
                await self.gateway.generate(scope, receive, send, kind)
                return
        await self.starlette(scope, receive, send)


def build_app(gateway: Gateway) -> GatewayApp:
    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gateway.open()  # NOTE: the gRPC channel is made on the server's own event loop
        try:
            yield
        finally:
            await gateway.close()

    routes = [
        Route("/v1/completions", GenerationRoute(gateway, "completion"), methods=["POST"]),
        Route("/v1/chat/completions", GenerationRoute(gateway, "chat"), methods=["POST"]),
        Route("/v1/models", gateway.models, methods=["GET"]),
        Route("/v1/models/{model:path}", gateway.models, methods=["GET"]),
        Route("/health", gateway.health, methods=["GET"]),
        Route("/metrics", gateway.prometheus, methods=["GET"]),
    ]
    handlers: dict[Any, Callable] = {HTTPException: _http_error}
    return GatewayApp(gateway, Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers))
