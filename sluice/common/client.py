"""An asyncio client of the scheduler's `sluice.v1.GenerationService`.

    SluiceClient.generate(prompt, ...) --GenerateRequest--> scheduler
        <-- GenerateResponse stream: token ids + text delta per message; the last one carries
            finish reason, usage and timings --> GenerationChunk per message (async iterator)
    abort(ids) / server_info() / stats(): unary calls

Breaking out of `generate` (or cancelling the task) cancels the RPC, which the scheduler
sees as a client cancellation and frees the request's KV at its next step. `timeout` is the
gRPC deadline of the whole stream. Channel keepalive notices a dead scheduler in seconds.
Errors are `grpc.aio.AioRpcError`; `retry_after_s(error)` reads the server's RetryInfo from
a RESOURCE_EXHAUSTED answer. `security` (sluice.common.security.ClientSecurity) dials over TLS
(mutual with a client certificate) and sends the API key as a bearer token; the `sluice
generate` and `sluice bench` flags for it come from `security.add_client_security_arguments`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from sluice.common.grpc_server import KEEPALIVE
from sluice.common.security import PLAINTEXT, ClientSecurity
from sluice.v1 import common_pb2, generation_pb2, generation_pb2_grpc

# The servers' own keepalive, so the client never pings more often than they permit.
DEFAULT_CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = KEEPALIVE.channel_options()


_FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_TIMEOUT: "timeout",
    common_pb2.FINISH_REASON_REJECTED: "rejected",
    common_pb2.FINISH_REASON_ERROR: "error",
}
_SLO_CLASSES = {"online": common_pb2.SLO_CLASS_ONLINE, "offline": common_pb2.SLO_CLASS_OFFLINE}


@dataclass(frozen=True, slots=True)
class Timings:
    """The server's timings of a finished request (seconds)."""

    queue_s: float
    ttft_s: float
    jct_s: float
    mean_tbt_s: float
    max_tbt_s: float
    num_preemptions: int
    slo_met: bool


@dataclass(frozen=True, slots=True)
class GenerationChunk:
    """One stream message; `finish_reason`, usage and `timings` are set on the last only."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    received_s: float  # time.perf_counter() when the client read the message
    finish_reason: str | None = None  # stop, length, abort, timeout, rejected, error
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timings: Timings | None = None
    message: str = ""  # detail of error, timeout and rejected endings

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class Completion:
    """A whole generation, as `SluiceClient.complete` collects it."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    timings: Timings | None
    message: str


def _chunk(msg: generation_pb2.GenerateResponse, received_s: float) -> GenerationChunk:
    reason = _FINISH_REASONS.get(msg.finish_reason)
    if reason is None:
        return GenerationChunk(msg.request_id, tuple(msg.token_ids), msg.text, received_s)
    t = msg.timings
    timings = (
        Timings(t.queue_s, t.ttft_s, t.jct_s, t.mean_tbt_s, t.max_tbt_s, t.num_preemptions, t.slo_met)
        if msg.HasField("timings")
        else None
    )
    return GenerationChunk(
        msg.request_id,
        tuple(msg.token_ids),
        msg.text,
        received_s,
        reason,
        msg.usage.prompt_tokens,
        msg.usage.completion_tokens,
        timings,
        msg.message,
    )


def build_request(
    prompt: str | Sequence[int],
    *,
    request_id: str = "",
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
    ttft_ms: float | None = None,
    tbt_ms: float | None = None,
    jct_ms: float | None = None,
    slo_class: str | None = None,
    priority: int = 0,
    tenant: str = "",
    predicted_output_tokens: int = 0,
    labels: Mapping[str, str] | None = None,
) -> generation_pb2.GenerateRequest:
    """The GenerateRequest for a text prompt or a list of token ids; unset options are left
    unset so the server applies its defaults."""
    sampling: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "seed": seed,
    }
    slo: dict[str, Any] = {"ttft_ms": ttft_ms, "tbt_ms": tbt_ms, "jct_ms": jct_ms}
    if slo_class is not None:
        slo["slo_class"] = _SLO_CLASSES[slo_class]
    request = generation_pb2.GenerateRequest(
        request_id=request_id or uuid.uuid4().hex,
        sampling_params=common_pb2.SamplingParams(
            stop=list(stop), ignore_eos=ignore_eos, **{k: v for k, v in sampling.items() if v is not None}
        ),
        slo=common_pb2.SloSpec(**{k: v for k, v in slo.items() if v is not None}),
        priority=priority,
        tenant=tenant,
        predicted_output_tokens=predicted_output_tokens,
        labels=dict(labels or {}),
    )
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return request


def _detail(error: grpc.aio.AioRpcError, kind: type) -> object | None:
    """The first google.rpc detail of type `kind` an answer carries, if any."""
    status = rpc_status.from_call(error)
    for detail in status.details if status is not None else ():
        if detail.Is(kind.DESCRIPTOR):
            message = kind()
            detail.Unpack(message)
            return message
    return None


def retry_after_s(error: grpc.aio.AioRpcError) -> float | None:
    """The delay a RESOURCE_EXHAUSTED answer's google.rpc.RetryInfo asks for, if it has one."""
    info = _detail(error, error_details_pb2.RetryInfo)
    return None if info is None else info.retry_delay.seconds + info.retry_delay.nanos / 1e9  # type: ignore[attr-defined]


def error_reason(error: grpc.aio.AioRpcError) -> str | None:
    """The google.rpc.ErrorInfo reason of an answer (QUEUE_FULL, SLO_UNMEETABLE, ...), if it has one."""
    info = _detail(error, error_details_pb2.ErrorInfo)
    return None if info is None else info.reason  # type: ignore[attr-defined]


class SluiceClient:
    """One channel to a scheduler. Use as `async with SluiceClient("host:port") as client:`."""

    def __init__(
        self,
        target: str,
        *,
        options: Sequence[tuple[str, Any]] = DEFAULT_CHANNEL_OPTIONS,
        interceptors: Sequence[Any] | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        security: ClientSecurity = PLAINTEXT,
    ) -> None:
        self.target = target
        self.security = security
        if security.tls is None:
            self.channel = grpc.aio.insecure_channel(target, options=list(options), interceptors=interceptors)
        else:
            credentials = security.tls.channel_credentials()
            self.channel = grpc.aio.secure_channel(
                target, credentials, options=list(options), interceptors=interceptors
            )
        self.stub = generation_pb2_grpc.GenerationServiceStub(self.channel)
        self.metadata = (*security.metadata, *metadata)

    async def __aenter__(self) -> SluiceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def wait_ready(self, timeout: float = 10.0) -> None:
        """Waits until the channel connects (raises TimeoutError after `timeout` seconds)."""
        await asyncio.wait_for(self.channel.channel_ready(), timeout)

    async def generate(
        self, prompt: str | Sequence[int], *, timeout: float | None = None, **options: Any
    ) -> AsyncIterator[GenerationChunk]:
        """Streams the generation of `prompt`; options are those of `build_request`."""
        async for chunk in self.generate_request(build_request(prompt, **options), timeout=timeout):
            yield chunk

    async def generate_request(
        self, request: generation_pb2.GenerateRequest, *, timeout: float | None = None
    ) -> AsyncIterator[GenerationChunk]:
        """Streams a prepared GenerateRequest (bench builds them ahead of the clock)."""
        call = self.stub.Generate(request, timeout=timeout, metadata=self.metadata or None)
        try:
            async for msg in call:
                yield _chunk(msg, time.perf_counter())
        finally:
            call.cancel()  # no-op once the stream ended; otherwise the server frees the request

    async def complete(
        self, prompt: str | Sequence[int], *, timeout: float | None = None, **options: Any
    ) -> Completion:
        """The whole generation at once."""
        ids: list[int] = []
        text: list[str] = []
        last: GenerationChunk | None = None
        async for chunk in self.generate(prompt, timeout=timeout, **options):
            ids.extend(chunk.token_ids)
            text.append(chunk.text)
            last = chunk
        if last is None or last.finish_reason is None:
            raise RuntimeError("the stream ended without a final message")
        return Completion(
            last.request_id,
            tuple(ids),
            "".join(text),
            last.finish_reason,
            last.prompt_tokens,
            last.completion_tokens,
            last.timings,
            last.message,
        )

    async def abort(self, request_ids: Sequence[str], *, timeout: float | None = 5.0) -> list[str]:
        """Aborts requests by id; returns the ids that were live (idempotent)."""
        response = await self.stub.Abort(
            generation_pb2.AbortRequest(request_ids=list(request_ids)), timeout=timeout, metadata=self.metadata or None
        )
        return list(response.aborted_ids)

    async def server_info(self, *, timeout: float | None = 5.0) -> generation_pb2.GetServerInfoResponse:
        return await self.stub.GetServerInfo(
            generation_pb2.GetServerInfoRequest(), timeout=timeout, metadata=self.metadata or None
        )

    async def stats(self, *, timeout: float | None = 5.0) -> generation_pb2.GetStatsResponse:
        return await self.stub.GetStats(
            generation_pb2.GetStatsRequest(), timeout=timeout, metadata=self.metadata or None
        )
