"""The scheduler's gRPC face: `sluice.v1.GenerationService` over a LiveScheduler.

    Generate(GenerateRequest) --LiveScheduler.submit (caller's identity, x-request-id)--> RequestStream
        INVALID_ARGUMENT + BadRequest (field named) | RESOURCE_EXHAUSTED + RetryInfo (queue full)
        | UNAVAILABLE (no healthy worker)
    --> initial metadata: x-request-id, x-max-tokens
    <-- GenerateResponse per batch of new tokens (ids + text delta) ... last: finish reason
        STOP / LENGTH / ABORT, usage, timings; a request that failed instead ends with the
        status of its ending (`ending_status`) and an ErrorInfo detail; a cancelled or expired
        call aborts the request in `finally`
    Abort(ids) --LiveScheduler.abort--> idempotent; the requests' owner only (PERMISSION_DENIED)
    GetServerInfo / GetStats: read the cluster, KV managers and metrics, change nothing

One status rule: a request that fails ends with a non-OK status, never with a final message
and OK: UNAVAILABLE when no worker is left (or the server shuts down), RESOURCE_EXHAUSTED for
capacity (with RetryInfo when a retry may succeed), INVALID_ARGUMENT for the request itself,
DEADLINE_EXCEEDED for the queue timeout, INTERNAL when a worker failed on it.

Standard health: `""` is liveness (SERVING while the process serves), the GenerationService
name is readiness (SERVING while at least one worker steps). Reflection lists both. The
streaming handler is an async generator so OpenTelemetry's aio interceptor can wrap it.
"""

from __future__ import annotations

import itertools
import logging
import socket
from collections.abc import AsyncIterator, Sequence

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from scheduler_service.core.preemption import RejectReason
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.slo import judge_slo
from scheduler_service.live.intake import MAX_ABORT_IDS, check_id
from scheduler_service.live.service import LiveScheduler, NotOwner, Rejected
from scheduler_service.live.stream import Chunk, RequestStream
from sluice.common.grpc_server import KEEPALIVE, GrpcServer, Keepalive
from sluice.common.security import ServerSecurity
from sluice.common.version import sluice_version
from sluice.contract.sampling import InvalidRequestError
from sluice.v1 import common_pb2, generation_pb2, generation_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME: str = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
ERROR_DOMAIN = "sluice.dev"
REQUEST_ID_KEY = "x-request-id"
MAX_TOKENS_KEY = "x-max-tokens"
# NOTE: the Generation API takes prompts, not plans: 16 MiB lets a prompt of any size up to it
# reach the byte check (INVALID_ARGUMENT naming `text`) instead of gRPC's own RESOURCE_EXHAUSTED.
MAX_REQUEST_BYTES = 16 * 2**20

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: common_pb2.FINISH_REASON_STOP,
    RequestStatus.FINISHED_LENGTH: common_pb2.FINISH_REASON_LENGTH,
    RequestStatus.FINISHED_ABORTED: common_pb2.FINISH_REASON_ABORT,
    RequestStatus.FINISHED_TIMEOUT: common_pb2.FINISH_REASON_TIMEOUT,
    RequestStatus.FINISHED_REJECTED: common_pb2.FINISH_REASON_REJECTED,
    RequestStatus.FINISHED_ERROR: common_pb2.FINISH_REASON_ERROR,
}


# ---------------------------------------------------------------- final message


def slo_met(request: Request) -> bool:
    """The request-level rule of the simulator's metrics (core/slo.py); a request that ended
    without completing missed its SLOs."""
    if request.status not in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
        return False
    return judge_slo(request.slo, request.arrival_time, request.token_times).met


def request_timings(request: Request) -> common_pb2.RequestTimings:
    times = request.token_times
    timings = common_pb2.RequestTimings(
        queue_s=request.queue_time, num_preemptions=request.num_preemptions, slo_met=slo_met(request)
    )
    if times:
        timings.ttft_s = times[0] - request.arrival_time
        timings.jct_s = times[-1] - request.arrival_time
    if len(times) > 1:
        gaps = [b - a for a, b in itertools.pairwise(times)]
        timings.mean_tbt_s = sum(gaps) / len(gaps)
        timings.max_tbt_s = max(gaps)
    return timings


def final_response(chunk: Chunk) -> generation_pb2.GenerateResponse:
    request = chunk.final
    assert request is not None
    completed = request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
    return generation_pb2.GenerateResponse(
        request_id=request.request_id,
        token_ids=chunk.token_ids,
        text=chunk.text,
        finish_reason=_FINISH_REASONS.get(request.status, common_pb2.FINISH_REASON_ERROR),
        usage=common_pb2.Usage(prompt_tokens=request.num_prompt_tokens, completion_tokens=request.num_output_tokens),
        timings=request_timings(request),
        message="" if completed else request.finish_message,
    )


# ---------------------------------------------------------------- errors


def _packed(*details: object) -> list[any_pb2.Any]:
    out = []
    for detail in details:
        packed = any_pb2.Any()
        packed.Pack(detail)
        out.append(packed)
    return out


def _status(code: int, message: str, *details: object) -> grpc.Status:
    return rpc_status.to_status(status_pb2.Status(code=code, message=message, details=_packed(*details)))


def queue_full_status(message: str, retry_after_s: float, reason: str = "QUEUE_FULL") -> grpc.Status:
    """RESOURCE_EXHAUSTED with RetryInfo and ErrorInfo details: gRPC itself answers
    RESOURCE_EXHAUSTED for oversized messages, so clients need the details to tell
    backpressure (retry later) from a request that will never fit. `reason`: QUEUE_FULL, or
    SLO_UNMEETABLE (admission: its SLOs would be missed under the load there is now), or
    OFFLINE_QUEUE_FULL (an offline-class request beyond the offline queue's bound)."""
    retry = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(nanos=int(retry_after_s * 1e9)))
    info = error_details_pb2.ErrorInfo(reason=reason, domain=ERROR_DOMAIN)
    return _status(code_pb2.RESOURCE_EXHAUSTED, message, retry, info)


def invalid_argument_status(exc: InvalidRequestError) -> grpc.Status:
    """INVALID_ARGUMENT with a google.rpc.BadRequest naming the field (the message starts with it too)."""
    description = str(exc).removeprefix(f"{exc.field}: ")
    violation = error_details_pb2.BadRequest.FieldViolation(field=exc.field, description=description)
    return _status(code_pb2.INVALID_ARGUMENT, str(exc), error_details_pb2.BadRequest(field_violations=[violation]))


def rejected_status(exc: Rejected, retry_after_s: float) -> grpc.Status:
    """The status of a request refused at admission (`LiveScheduler.submit` raised Rejected)."""
    if exc.reason is RejectReason.QUEUE_FULL:
        return queue_full_status(str(exc), retry_after_s)
    if exc.reason is RejectReason.SLO_UNMEETABLE:
        return queue_full_status(str(exc), retry_after_s, "SLO_UNMEETABLE")
    if exc.reason is RejectReason.OFFLINE_QUEUE_FULL:
        return queue_full_status(str(exc), retry_after_s, "OFFLINE_QUEUE_FULL")
    if exc.reason is RejectReason.NO_WORKER:
        return _status(code_pb2.UNAVAILABLE, str(exc))
    if exc.reason in (RejectReason.DUPLICATE_ID, RejectReason.PROMPT_TOO_LONG, RejectReason.EXCEEDS_KV_CAPACITY):
        field = "request_id" if exc.reason is RejectReason.DUPLICATE_ID else "prompt"
        return invalid_argument_status(InvalidRequestError(field, str(exc)))
    return _status(code_pb2.RESOURCE_EXHAUSTED, str(exc))


# How a request that was accepted and then failed ends: by status, then by the reject reason
# that starts its finish message ("no_worker", "prompt_too_long: ...").
_REJECTED_CODES: dict[str, int] = {
    RejectReason.NO_WORKER: code_pb2.UNAVAILABLE,
    RejectReason.QUEUE_FULL: code_pb2.RESOURCE_EXHAUSTED,
    RejectReason.UNSCHEDULABLE: code_pb2.RESOURCE_EXHAUSTED,
    RejectReason.SLO_UNMEETABLE: code_pb2.RESOURCE_EXHAUSTED,
    RejectReason.OFFLINE_QUEUE_FULL: code_pb2.RESOURCE_EXHAUSTED,
    RejectReason.PROMPT_TOO_LONG: code_pb2.INVALID_ARGUMENT,
    RejectReason.EXCEEDS_KV_CAPACITY: code_pb2.INVALID_ARGUMENT,
    RejectReason.DUPLICATE_ID: code_pb2.INVALID_ARGUMENT,
}


def ending_code(request: Request, stream: RequestStream) -> int:
    """The status code of a request's ending; OK for the endings a final message reports."""
    status = request.status
    if stream.unavailable:
        return code_pb2.UNAVAILABLE
    if status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED):
        return code_pb2.OK
    if status is RequestStatus.FINISHED_TIMEOUT:
        return code_pb2.DEADLINE_EXCEEDED
    if status is RequestStatus.FINISHED_REJECTED:
        reason = request.finish_message.split(":", 1)[0].strip()
        return _REJECTED_CODES.get(reason, code_pb2.RESOURCE_EXHAUSTED)
    return code_pb2.INTERNAL


def ending_status(request: Request, code: int) -> grpc.Status:
    """A failed request's status: its message, an ErrorInfo naming its FinishReason and usage."""
    reason = common_pb2.FinishReason.Name(_FINISH_REASONS.get(request.status, common_pb2.FINISH_REASON_ERROR))
    info = error_details_pb2.ErrorInfo(
        reason=reason.removeprefix("FINISH_REASON_"),
        domain=ERROR_DOMAIN,
        metadata={
            "request_id": request.request_id,
            "finish_reason": reason,
            "prompt_tokens": str(request.num_prompt_tokens),
            "completion_tokens": str(request.num_output_tokens),
        },
    )
    message = request.finish_message or request.status.name.lower()
    return _status(code, message, info)


def server_info(live: LiveScheduler) -> generation_pb2.GetServerInfoResponse:
    """GetServerInfo's answer: the version, policy, model, limits and workers of a started scheduler."""
    workers = [
        generation_pb2.WorkerDescription(
            worker_id=str(w),
            address=loop.remote.address,
            healthy=live.cluster.healthy[w],
            num_gpu_blocks=loop.capacity.num_gpu_blocks,
            num_cpu_blocks=loop.capacity.num_cpu_blocks,
            role=loop.capacity.role,
        )
        for w, loop in live.loops.items()
    ]
    return generation_pb2.GetServerInfoResponse(
        version=sluice_version(),
        policy=live.config.policy,
        router=live.config.router,
        model=live.model,
        max_model_len=live.max_model_len,
        max_waiting=live.config.max_waiting or 0,  # 0: no bound
        block_size=live.block_size,
        workers=workers,
        max_prompt_tokens=live.limits.max_prompt_tokens,
        default_max_tokens=live.config.default_max_tokens,
        max_prompt_bytes=live.limits.prompt_bytes,
        vocab_size=live.limits.vocab_size,
    )


# ---------------------------------------------------------------- the service


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, live: LiveScheduler, security: ServerSecurity | None = None) -> None:
        self.live = live
        self.security = security or ServerSecurity()

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        stream = await self._admit(request, context)
        rid = stream.request.request_id
        ended = False
        try:
            await context.send_initial_metadata(
                ((REQUEST_ID_KEY, rid), (MAX_TOKENS_KEY, str(stream.request.sampling.max_tokens)))
            )
            async for chunk in stream.messages():
                if chunk.final is None:
                    yield generation_pb2.GenerateResponse(request_id=rid, token_ids=chunk.token_ids, text=chunk.text)
                    continue
                ended = True
                code = ending_code(chunk.final, stream)
                if code == code_pb2.OK:
                    yield final_response(chunk)
                    return
                if chunk.token_ids or chunk.text:
                    yield generation_pb2.GenerateResponse(request_id=rid, token_ids=chunk.token_ids, text=chunk.text)
                await context.abort_with_status(ending_status(chunk.final, code))
        finally:
            # NOTE: a client cancel or deadline arrives here as CancelledError (or
            # GeneratorExit); the request's blocks are freed now, the worker's at its next step.
            if not ended:
                self.live.abort(rid, "client cancelled or deadline exceeded")

    async def _require_started(self, context: grpc.aio.ServicerContext) -> None:
        if not self.live.started:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the scheduler is starting: {self.live.waiting_for}")

    async def _admit(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> RequestStream:
        await self._require_started(context)
        header = dict(context.invocation_metadata() or ()).get(REQUEST_ID_KEY, "")
        try:
            if header and request.request_id and header != request.request_id:
                raise InvalidRequestError("request_id", f"differs from the {REQUEST_ID_KEY} metadata")
            owner = self.security.identity(context)
            return await self.live.submit(request, owner=owner, request_id=str(header))
        except InvalidRequestError as exc:
            await context.abort_with_status(invalid_argument_status(exc))
        except Rejected as exc:
            await context.abort_with_status(rejected_status(exc, self.live.config.retry_after_s))
        raise AssertionError("unreachable: abort raises")

    async def Abort(
        self, request: generation_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.AbortResponse:
        ids = list(request.request_ids)
        try:
            if len(ids) > MAX_ABORT_IDS:
                raise InvalidRequestError("request_ids", f"has {len(ids)} ids; the limit is {MAX_ABORT_IDS}")
            for i, rid in enumerate(ids):
                check_id(rid, f"request_ids[{i}]")
        except InvalidRequestError as exc:
            await context.abort_with_status(invalid_argument_status(exc))
        owner = self.security.identity(context)
        try:
            self.live.check_owner(ids, owner)
        except NotOwner as exc:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED, f"request_ids: {exc.args[0]!r} belongs to another caller"
            )
        aborted = [rid for rid in ids if self.live.abort(rid, "aborted by Abort", owner=owner)]
        return generation_pb2.AbortResponse(aborted_ids=aborted)

    async def GetServerInfo(
        self, request: generation_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.GetServerInfoResponse:
        await self._require_started(context)
        return server_info(self.live)

    async def GetStats(
        self, request: generation_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.GetStatsResponse:
        await self._require_started(context)
        live = self.live
        metrics = live.metrics
        workers = []
        for w, sched in live.cluster.schedulers.items():
            kv = sched.kv
            workers.append(
                generation_pb2.WorkerStats(
                    worker_id=str(w),
                    healthy=live.cluster.healthy[w],
                    num_running=len(sched.running),
                    num_waiting=len(sched.waiting),
                    num_swapped=len(sched.swapped),
                    gpu_blocks_total=kv.gpu.num_blocks,
                    gpu_blocks_used=kv.gpu.num_used,
                    cpu_blocks_total=kv.cpu.num_blocks,
                    cpu_blocks_used=kv.cpu.num_used,
                    num_steps=live.loops[w].num_steps,
                )
            )
        return generation_pb2.GetStatsResponse(
            num_waiting=live.num_waiting,
            num_running=sum(s.num_running for s in workers),
            num_swapped=sum(s.num_swapped for s in workers),
            num_finished=metrics.num_finished,
            num_rejected=sum(metrics.rejected.values()),
            num_preemptions=sum(metrics.preemptions.values()),
            throughput_tok_s=live.throughput_tok_s(),
            slo_attainment_req=metrics.req_met / metrics.req_judged if metrics.req_judged else 0.0,
            workers=workers,
        )


# ---------------------------------------------------------------- server


def build_server(
    live: LiveScheduler,
    port: int,
    *,
    host: str = "127.0.0.1",
    security: ServerSecurity | None = None,
    health_port: int | None = None,
    keepalive: Keepalive = KEEPALIVE,
) -> GrpcServer:
    """An unstarted server with the generation, health and reflection services over a
    started LiveScheduler; port 0 picks one. Readiness follows the workers' health."""
    security = security or ServerSecurity()
    servicer = GenerationServicer(live, security)
    server = GrpcServer.build(
        SERVICE_NAME,
        lambda s: generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, s),
        host,
        port,
        security=security,
        health_port=health_port,
        keepalive=keepalive,
        max_receive_bytes=MAX_REQUEST_BYTES,
    )
    live.on_health = server.set_ready_soon
    return server


class SchedulerServer:
    """The whole scheduler in-process: workers dialled, loops running, gRPC serving."""

    def __init__(self, live: LiveScheduler, grpc_server: GrpcServer) -> None:
        self.live = live
        self.grpc = grpc_server
        self.server = grpc_server.server
        self.port = grpc_server.port
        self.health = grpc_server.health

    @classmethod
    async def start(
        cls,
        live: LiveScheduler,
        port: int = 0,
        *,
        host: str = "127.0.0.1",
        security: ServerSecurity | None = None,
        health_port: int | None = None,
        keepalive: Keepalive = KEEPALIVE,
    ) -> SchedulerServer:
        # NOTE: the port answers (health, and UNAVAILABLE naming what it waits for) before the
        # workers are had: a restarted scheduler may wait for a lease, and says so. The name
        # the workers' leases record is the host and this port, which no other live scheduler
        # can bind meanwhile (grpc_server: SO_REUSEPORT off).
        server = build_server(live, port, host=host, security=security, health_port=health_port, keepalive=keepalive)
        await server.start(ready=False)
        live.name = live.name or f"{socket.gethostname()}:{server.port}"
        try:
            await live.start()
        except BaseException:
            await server.stop(0.0, 0.0)
            raise
        await server.set_ready(live.is_healthy)
        return cls(live, server)

    async def stop(self, grace_s: float = 5.0, drain_s: float = 0.5) -> None:
        """Health first (balancers stop sending), then in-flight streams get grace_s, then the loops stop."""
        await self.grpc.stop(grace_s, drain_s)
        await self.live.close()


def worker_addresses(values: Sequence[str]) -> list[str]:
    """`--worker host:port` values (comma-separated lists allowed)."""
    return [a.strip() for v in values for a in v.split(",") if a.strip()]
