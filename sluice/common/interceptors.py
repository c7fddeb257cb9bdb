"""The server interceptor every Sluice service runs first: API keys, and malformed messages.

    RPC --> GuardInterceptor.intercept_service(method, metadata)
              API keys configured and the call has none or a wrong one (standard health
              excepted: orchestrator probes carry no key):
                  a handler of the same kind that answers UNAUTHENTICATED (body never parsed)
              otherwise the service's handler, wrapped so a request that does not parse
                  answers INVALID_ARGUMENT naming the message type, with no traceback logged
        --> (the OpenTelemetry interceptor, when tracing is on) --> the servicer

NOTE: gRPC's Python server turns an exception in a request deserializer into UNKNOWN with
the exception text and logs a full traceback per call (measured: one per malformed call).
The tolerant deserializer returns a marker instead, and the wrapper answers it. The wrapper
relays streamed messages through one async generator (gRPC picks the calling convention by
the function's type, so a plain function returning the inner generator is not an option);
that costs about a microsecond per message.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import grpc

from sluice.common.security import ApiKeys, client_role

HEALTH_PREFIX = "/grpc.health.v1.Health/"


class Malformed:
    """What a request that failed to parse becomes (the servicer never sees one)."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


def _type_name(deserializer: Callable[[bytes], Any]) -> str:
    owner = getattr(deserializer, "__self__", None)
    descriptor = getattr(owner, "DESCRIPTOR", None)
    return getattr(descriptor, "full_name", "request message")


def tolerant(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    name = _type_name(deserializer)

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # protobuf's DecodeError, or anything a custom parser raises
            return Malformed(f"the request is not a valid {name}: {exc or type(exc).__name__}")

    return parse


async def _refuse(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
    await context.abort(code, message)


async def _result(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def _relay(result: Any) -> AsyncIterator[Any]:
    """The messages of a streaming handler's result, whichever convention it follows."""
    if inspect.isasyncgen(result):
        async for message in result:
            yield message
    elif inspect.isawaitable(result):  # a handler that writes with context.write
        await result
    else:
        for message in result:
            yield message


async def _checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, Malformed):
            await _refuse(context, grpc.StatusCode.INVALID_ARGUMENT, request.message)
        yield request


async def _check_role(context: grpc.aio.ServicerContext, roles: tuple[str, ...]) -> None:
    if not roles:
        return
    role = client_role(context)
    if role not in roles:
        shown = repr(role) if role else "none"
        await _refuse(
            context,
            grpc.StatusCode.PERMISSION_DENIED,
            f"client certificate role {shown} may not call this service (tls_client_roles: {', '.join(roles)})",
        )


def guarded(handler: grpc.RpcMethodHandler, roles: tuple[str, ...] = ()) -> grpc.RpcMethodHandler:
    """The same handler, answering INVALID_ARGUMENT for requests that do not parse and, with
    `roles`, PERMISSION_DENIED to a client certificate of another role."""
    parse = tolerant(handler.request_deserializer) if handler.request_deserializer is not None else None
    out = handler.response_serializer
    if handler.unary_unary:
        inner_uu = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await _check_role(context, roles)
            if isinstance(request, Malformed):
                await _refuse(context, grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return await _result(inner_uu(request, context))

        return grpc.unary_unary_rpc_method_handler(unary_unary, parse, out)
    if handler.unary_stream:
        inner_us = handler.unary_stream

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await _check_role(context, roles)
            if isinstance(request, Malformed):
                await _refuse(context, grpc.StatusCode.INVALID_ARGUMENT, request.message)
            async for message in _relay(inner_us(request, context)):
                yield message

        return grpc.unary_stream_rpc_method_handler(unary_stream, parse, out)
    if handler.stream_unary:
        inner_su = handler.stream_unary

        async def stream_unary(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            await _check_role(context, roles)
            return await _result(inner_su(_checked(requests, context), context))

        return grpc.stream_unary_rpc_method_handler(stream_unary, parse, out)
    inner_ss = handler.stream_stream

    async def stream_stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await _check_role(context, roles)
        async for message in _relay(inner_ss(_checked(requests, context), context)):
            yield message

    return grpc.stream_stream_rpc_method_handler(stream_stream, parse, out)


def refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind that answers `code` without reading the request."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _refuse(context, code, message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await _refuse(context, code, message)
        yield None  # pragma: no cover (abort raised above)

    raw = bytes  # never parsed: a refused caller's bytes are not our concern
    out = handler.response_serializer
    if handler.response_streaming:
        maker = (
            grpc.stream_stream_rpc_method_handler if handler.request_streaming else grpc.unary_stream_rpc_method_handler
        )
        return maker(streaming, raw, out)
    maker = grpc.stream_unary_rpc_method_handler if handler.request_streaming else grpc.unary_unary_rpc_method_handler
    return maker(unary, raw, out)


class GuardInterceptor(grpc.aio.ServerInterceptor):
    def __init__(
        self,
        api_keys: ApiKeys | None = None,
        open_prefixes: Iterable[str] = (HEALTH_PREFIX,),
        client_roles: tuple[str, ...] = (),
    ) -> None:
        """`client_roles`: under mutual TLS, the client certificate roles (subject OU) that may
        call anything but health; others are answered PERMISSION_DENIED naming their role."""
        self.api_keys = api_keys
        self.open_prefixes = tuple(open_prefixes)
        self.client_roles = client_roles

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None:
            return None
        if self.api_keys is not None and not details.method.startswith(self.open_prefixes):
            why = self.api_keys.check(details.invocation_metadata)
            if why is not None:
                return refusing(handler, grpc.StatusCode.UNAUTHENTICATED, why)
        roles = self.client_roles if not details.method.startswith(self.open_prefixes) else ()
        if handler.request_deserializer is None and not roles:
            return handler
        return guarded(handler, roles)
