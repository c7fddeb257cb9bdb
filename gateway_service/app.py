"""The OpenAI HTTP API as a Starlette app over the scheduler's gRPC Generate stream.

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
        aborts the requests and frees their KV, as for any gRPC client that cancels
    GET /v1/models, /v1/models/{id}   the scheduler's model and the served names (Bearer key)
    GET /health                       200 when the scheduler has a worker ready, else 503 (no key)
    GET /metrics                      the gateway's Prometheus metrics (Bearer key)

Errors are OpenAI's JSON (errors.py); unknown routes are 404 and wrong methods 405 in the
same shape. The gateway holds one gRPC channel to the scheduler (HTTP/2: every request is a
stream on it) and learns the model and limits from GetServerInfo at the first request that
needs them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

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

T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was complete."""


# ---------------------------------------------------------------- the scheduler


class SchedulerLink:
    """One gRPC channel to the scheduler, and what GetServerInfo said of it (once it answered)."""

    def __init__(self, target: str, security: ClientSecurity) -> None:
        self.target = target
        self.channel = security.channel(target, options=CHANNEL_OPTIONS)
        self.stub = generation_pb2_grpc.GenerationServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.metadata: tuple[tuple[str, str], ...] = security.metadata
        self._info: generation_pb2.GetServerInfoResponse | None = None

    async def info(self, timeout_s: float = 5.0) -> generation_pb2.GetServerInfoResponse:
        if self._info is None:
            try:
                self._info = await self.stub.GetServerInfo(
                    generation_pb2.GetServerInfoRequest(), timeout=timeout_s, metadata=self.metadata or None
                )
            except grpc.aio.AioRpcError as exc:
                error = from_rpc_error(exc)
                raise ApiError(
                    error.status, f"the scheduler at {self.target}: {error.message}", code=error.code
                ) from None
        return self._info

    async def readiness(self, timeout_s: float = 2.0) -> str:
        """The scheduler's readiness: serving (a worker steps), not_serving, or unreachable."""
        try:
            reply = await self.health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return "unreachable"
        return "serving" if reply.status == health_pb2.HealthCheckResponse.SERVING else "not_serving"

    async def close(self) -> None:
        await self.channel.close()


# ---------------------------------------------------------------- streams of choices


async def merged(calls: Sequence[Any]) -> AsyncIterator[tuple[int, generation_pb2.GenerateResponse]]:
    """(choice index, message) from every call as they come; the first gRPC error is raised.
    Closing the iterator (or cancelling the task that reads it) cancels every call."""
    if len(calls) == 1:
        call = calls[0]
        try:
            async for msg in call:
                yield 0, msg
        finally:
            call.cancel()  # a no-op once the stream ended; otherwise the scheduler aborts the request
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, call: Any) -> None:
        try:
            async for msg in call:
                queue.put_nowait((i, msg))
            queue.put_nowait((i, None))
        except grpc.aio.AioRpcError as exc:
            queue.put_nowait((i, exc))

    tasks = [asyncio.create_task(pump(i, c)) for i, c in enumerate(calls)]
    try:
        left = len(calls)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for call in calls:
            call.cancel()
        for task in tasks:
            task.cancel()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """`work`'s result, unless the client disconnects first: then `work` is cancelled (its
    gRPC calls with it) and ClientGone raised."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise ClientGone
    return task.result()


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
    def __init__(self, cfg: GatewayConfig, metrics: GatewayMetrics | None = None) -> None:
        self.cfg = cfg
        keys = split_keys(cfg.api_key)
        self.api_keys = ApiKeys(keys) if keys else None
        self.metrics = metrics or GatewayMetrics()
        self.link: SchedulerLink | None = None
        self.created = int(time.time())
        self._template: ChatTemplate | None = None
        if cfg.chat_template:
            ChatTemplate.load("", cfg.chat_template)  # a bad template fails at start, not per request
        self.tracer = trace.get_tracer("sluice.gateway")

    # ------------------------------------------------ plumbing

    async def open(self) -> None:
        self.link = SchedulerLink(self.cfg.scheduler, self.cfg.scheduler_security())

    async def close(self) -> None:
        if self.link is not None:
            await self.link.close()

    def _link(self) -> SchedulerLink:
        assert self.link is not None, "the gateway is not open"
        return self.link

    def authorize(self, request: Request) -> None:
        if self.api_keys is None:
            return
        header = request.headers.get("authorization")
        problem = self.api_keys.check((("authorization", header),) if header is not None else ())
        if problem is not None:
            message = "missing API key: send `Authorization: Bearer <key>`" if header is None else problem
            raise ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def body(self, request: Request) -> Any:
        length = request.headers.get("content-length")
        limit = self.cfg.max_body_bytes
        if length is not None and length.isdigit() and int(length) > limit:
            raise ApiError(413, f"the request body is {length} bytes; the limit is {limit}", code="body_too_large")
        raw = bytearray()
        async for part in request.stream():
            raw += part
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

    def trace_metadata(self, request: Request, route: str) -> tuple[Any, tuple[tuple[str, str], ...]]:
        """(the gateway's span or None, the W3C trace headers for the scheduler): the client's
        traceparent continues through a span of the gateway when it traces, else as it came."""
        traced = tracing_enabled()
        if not traced and "traceparent" not in request.headers:
            return None, ()
        context = propagate.extract(request.headers)
        span = None
        if traced:
            span = self.tracer.start_span(f"POST {route}", context=context, kind=trace.SpanKind.SERVER)
            context = trace.set_span_in_context(span, context)
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=context)
        return span, tuple(carrier.items())

    # ------------------------------------------------ routes

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def _generate(self, request: Request, kind: str) -> Response:
        arrival = time.perf_counter()
        route = request.url.path
        span = None
        try:
            self.authorize(request)
            body = await self.body(request)
            link = self._link()
            info = await link.info()
            parsed = parse_chat(body, self.chat_template(info)) if kind == "chat" else parse_completion(body)
            model = self.model_name(parsed.model, info)
            rid = parsed.request_id or request.headers.get("x-request-id") or uuid.uuid4().hex
            span, trace_headers = self.trace_metadata(request, route)
            metadata = (*link.metadata, *trace_headers)
            timeout = self.cfg.request_timeout_s
            calls = [link.stub.Generate(r, timeout=timeout, metadata=metadata) for r in parsed.requests(rid)]
            self.metrics.prepare.observe(time.perf_counter() - arrival)
        except ApiError as error:
            return self._error(route, error, span)
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        shapes = Shapes(kind, prefix + rid, model, int(time.time()), parsed.include_usage)
        gen = Generation(parsed, shapes, route, arrival, span, len(parsed.prompts))
        events = merged(calls)
        self.metrics.running.inc()
        try:
            if parsed.stream:
                first = await until_disconnected(request.receive, anext(events))
                return EventStream(self._sse(gen, first, events), {"x-request-id": rid, "cache-control": "no-cache"})
            answer = await until_disconnected(request.receive, self._collect(gen, events))
            self._done(gen, 200)
            return Response(dumps(answer), media_type="application/json", headers={"x-request-id": rid})
        except grpc.aio.AioRpcError as exc:
            await events.aclose()
            return self._failed(gen, from_rpc_error(exc, parsed.aliases))
        except StopAsyncIteration:  # the stream ended with no message at all
            return self._failed(gen, ApiError(502, "the scheduler's stream ended without a message"))
        except ClientGone:
            await events.aclose()
            self.metrics.disconnects.inc()
            self._done(gen, CLIENT_GONE)
            return Response(status_code=CLIENT_GONE)
        except BaseException:
            await events.aclose()
            self._done(gen, 500)
            raise

    def _failed(self, gen: Generation, error: ApiError) -> Response:
        self._done(gen, error.status)
        return error_response(error)

    async def _collect(self, gen: Generation, events: AsyncIterator[tuple[int, Any]]) -> dict[str, Any]:
        async for index, msg in events:
            if msg.text:
                gen.texts[index].append(msg.text)
            gen.take(index, msg)
        texts = ["".join(t) for t in gen.texts]
        return gen.shapes.whole(texts, [f or "error" for f in gen.finish], gen.usage())

    async def _sse(
        self, gen: Generation, first: tuple[int, Any], events: AsyncIterator[tuple[int, Any]]
    ) -> AsyncIterator[tuple[bytes, bool]]:
        """(bytes, more) per write: one event per scheduler message; the last write ends the body."""
        shapes, status = gen.shapes, CLIENT_GONE
        try:
            # NOTE: the last choice's last event, the usage event and [DONE] go out in one write
            event = self._event(gen, *first)
            if not gen.finished:
                yield event, True
                event = b""
            self.metrics.ttft.labels(gen.route).observe(time.perf_counter() - gen.arrival)
            async for index, msg in events:
                event = self._event(gen, index, msg)
                if not gen.finished:
                    yield event, True
                    event = b""
            usage = shapes.usage_event(gen.usage()) if gen.parsed.include_usage else b""
            status = 200
            yield event + usage + DONE, False
        except grpc.aio.AioRpcError as exc:
            error = from_rpc_error(exc, gen.parsed.aliases)
            status = error.status
            yield error_event(error), False
        finally:
            await events.aclose()  # the client left (cancelled) or the stream ended: calls cancelled
            if status == CLIENT_GONE:
                self.metrics.disconnects.inc()
            self._done(gen, status)

    def _event(self, gen: Generation, index: int, msg: generation_pb2.GenerateResponse) -> bytes:
        reason = gen.take(index, msg)
        first = index not in gen.started
        if first:
            gen.started.add(index)
        return gen.shapes.event(index, msg.text, reason, first)

    def _done(self, gen: Generation, status: int) -> None:
        self.metrics.running.dec()
        self.metrics.tokens.inc(gen.num_tokens)
        self.metrics.duration.labels(gen.route).observe(time.perf_counter() - gen.arrival)
        self.metrics.requests.labels(gen.route, str(status)).inc()
        if gen.span is not None:
            gen.span.set_attribute("http.response.status_code", status)
            gen.span.end()

    def _error(self, route: str, error: ApiError, span: Any = None) -> Response:
        self.metrics.requests.labels(route, str(error.status)).inc()
        if span is not None:
            span.set_attribute("http.response.status_code", error.status)
            span.end()
        return error_response(error)

    async def models(self, request: Request) -> Response:
        try:
            self.authorize(request)
            info = await self._link().info()
        except ApiError as error:
            return self._error("/v1/models", error)
        cards = [self._card(name, info) for name in self.model_names(info)]
        wanted = request.path_params.get("model")
        if wanted is None:
            return JSONResponse({"object": "list", "data": cards})
        for card in cards:
            if card["id"] == wanted:
                return JSONResponse(card)
        return self._error(
            "/v1/models", ApiError(404, f"model {wanted!r} does not exist here", param="model", code="model_not_found")
        )

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
            self.authorize(request)
        except ApiError as error:
            return error_response(error)
        return Response(self.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")


class EventStream(Response):
    """A `text/event-stream` answer written as its events come, each in one write (the last
    with the end of the chunked body). The client disconnecting cancels the stream, whose
    generator then cancels its gRPC calls. NOTE: in place of Starlette's StreamingResponse,
    whose anyio task group showed 1.2 ms of self time per request in a cProfile of the
    saturation load (docs/results/openai_api.md)."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[tuple[bytes, bool]], headers: dict[str, str]) -> None:
        self.body_iterator = body
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self._stream(send))
        watch = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({stream, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not stream.done():
                stream.cancel()  # the client left: the generator's finally cancels the calls
                with contextlib.suppress(asyncio.CancelledError):
                    await stream
        if not stream.cancelled():
            stream.result()

    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        more = True
        async for data, more in self.body_iterator:
            await send({"type": "http.response.body", "body": data, "more_body": more})
        if more:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def error_response(error: ApiError) -> Response:
    return Response(dumps(error.body()), status_code=error.status, media_type="application/json", headers=error.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = "not_found" if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405 else None
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return error_response(ApiError(exc.status_code, message, code=code, headers=exc.headers))


def build_app(gateway: Gateway) -> Starlette:
    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gateway.open()  # NOTE: the gRPC channel is made on the server's own event loop
        try:
            yield
        finally:
            await gateway.close()

    routes = [
        Route("/v1/completions", gateway.completions, methods=["POST"]),
        Route("/v1/chat/completions", gateway.chat_completions, methods=["POST"]),
        Route("/v1/models", gateway.models, methods=["GET"]),
        Route("/v1/models/{model:path}", gateway.models, methods=["GET"]),
        Route("/health", gateway.health, methods=["GET"]),
        Route("/metrics", gateway.prometheus, methods=["GET"]),
    ]
    handlers: dict[Any, Callable] = {HTTPException: _http_error}
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)
