"""OpenAI's error JSON, and the scheduler's gRPC statuses as HTTP statuses.

ApiError(status, message, param, code) --body()--> {"error": {"message", "type", "param", "code"}}
from_rpc_error(AioRpcError) -> ApiError:
    INVALID_ARGUMENT     400  param: the OpenAI field behind the BadRequest field the scheduler named
    RESOURCE_EXHAUSTED   429 + Retry-After (whole seconds, at least 1) when RetryInfo says
                         "retry later" (queue full); 400 without it (the request can never fit)
    UNAVAILABLE          503  no worker up, the scheduler unreachable or shutting down
    DEADLINE_EXCEEDED    504  the scheduler's queue timeout (or the gateway's request timeout)
    INTERNAL             500  a worker failed on the request
    UNAUTHENTICATED, PERMISSION_DENIED, others: 502 (the gateway's own key or TLS to the
                         scheduler is wrong: the client's request was not at fault)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from sluice.common.client import retry_after_s

# The OpenAI names of the scheduler's request fields (google.rpc.BadRequest field names).
_FIELDS = {
    "text": "prompt",
    "token_ids": "prompt",
    "prompt": "prompt",
    "tenant": "user",
    "slo.ttft_ms": "ttft_ms",
    "slo.tbt_ms": "tbt_ms",
    "slo.jct_ms": "jct_ms",
    "slo.slo_class": "slo_class",
}

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "server_error",
    504: "server_error",
}


class ApiError(Exception):
    """An HTTP error answered with OpenAI's error JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }


def invalid(param: str, message: str) -> ApiError:
    """400 naming the field: the message starts with it, as the scheduler's do."""
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


def openai_field(field: str, aliases: Mapping[str, str]) -> str:
    """The request field a client sent for the scheduler's `field` (`sampling_params.top_p`
    is `top_p`; `text` is `prompt`, or `messages` for a chat)."""
    name = field.removeprefix("sampling_params.").split("[", 1)[0]
    if name.split(".", 1)[0] in ("text", "token_ids", "prompt"):  # `token_ids.ids` too
        name = "prompt"
    name = _FIELDS.get(name, name)
    return aliases.get(name, name)


def _bad_request_field(error: grpc.aio.AioRpcError) -> str | None:
    status = rpc_status.from_call(error)
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            if bad.field_violations:
                return bad.field_violations[0].field
    return None


def from_rpc_error(error: grpc.aio.AioRpcError, aliases: Mapping[str, str] | None = None) -> ApiError:
    """The HTTP error for a failed Generate call; `aliases` rename fields for this request
    (`prompt` -> `messages` for a chat, `max_tokens` -> `max_completion_tokens`)."""
    code = error.code()
    message = error.details() or code.name.lower()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field = _bad_request_field(error)
        if field is None:
            return ApiError(400, message, code="invalid_value")
        param = openai_field(field, aliases or {})
        if message.startswith(f"{field}:"):
            message = f"{param}:{message[len(field) + 1 :]}"
        return ApiError(400, message, param=param, code="invalid_value")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        delay = retry_after_s(error)
        if delay is None:
            return ApiError(400, message, code="request_too_large")
        retry = str(max(1, math.ceil(delay)))
        return ApiError(429, message, code="rate_limit_exceeded", headers={"Retry-After": retry})
    if code == grpc.StatusCode.UNAVAILABLE:
        return ApiError(503, message, code="service_unavailable")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ApiError(504, message, code="timeout")
    if code == grpc.StatusCode.INTERNAL:
        return ApiError(500, message, code="server_error")
    return ApiError(502, f"the scheduler answered {code.name}: {message}", code="bad_gateway")
