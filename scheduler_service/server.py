"""The scheduler's gRPC face: `sluice.v1.GenerationService` over a LiveScheduler.

    Generate(GenerateRequest) --LiveScheduler.submit--> RequestStream
        INVALID_ARGUMENT (field named) | RESOURCE_EXHAUSTED + RetryInfo (queue full)
        | UNAVAILABLE (no healthy worker)
    <-- GenerateResponse per batch of new tokens (ids + text delta) ... last: finish reason,
        usage, timings; a cancelled or expired call aborts the request in `finally`
    Abort(ids) --LiveScheduler.abort--> idempotent
    GetServerInfo / GetStats: read the cluster, KV managers and metrics, change nothing

Standard health: `""` is liveness (SERVING while the process serves), the GenerationService
name is readiness (SERVING while at least one worker steps). Reflection lists both. The
streaming handler is an async generator so OpenTelemetry's aio interceptor can wrap it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Sequence
from importlib.metadata import PackageNotFoundError, version

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status

from scheduler_service.core.preemption import RejectReason
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.sampling import InvalidRequestError
from scheduler_service.live.service import LiveScheduler, Rejected
from scheduler_service.live.stream import Chunk
from scheduler_service.plan_codec import SERVER_OPTIONS
from sluice.common import telemetry
from sluice.v1 import common_pb2, generation_pb2, generation_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME: str = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
ERROR_DOMAIN = "sluice.dev"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: common_pb2.FINISH_REASON_STOP,
    RequestStatus.FINISHED_LENGTH: common_pb2.FINISH_REASON_LENGTH,
    RequestStatus.FINISHED_ABORTED: common_pb2.FINISH_REASON_ABORT,
    RequestStatus.FINISHED_TIMEOUT: common_pb2.FINISH_REASON_TIMEOUT,
    RequestStatus.FINISHED_REJECTED: common_pb2.FINISH_REASON_REJECTED,
    RequestStatus.FINISHED_ERROR: common_pb2.FINISH_REASON_ERROR,
}


def sluice_version() -> str:
    try:
        return version("sluice")
    except PackageNotFoundError:
        return "0+unknown"


# ---------------------------------------------------------------- final message


def slo_met(request: Request) -> bool:
    """The request-level rule of MetricsRecorder: TTFT, mean gap (DistServe's TPOT) and JCT."""
    if request.status not in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
        return False
    times, slo = request.token_times, request.slo
    ttft = times[0] - request.arrival_time
    jct = times[-1] - request.arrival_time
    mean_gap = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
    return (
        (slo.ttft_s is None or ttft <= slo.ttft_s)
        and (slo.tbt_s is None or mean_gap is None or mean_gap <= slo.tbt_s)
        and (slo.jct_s is None or jct <= slo.jct_s)
    )


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


def queue_full_status(message: str, retry_after_s: float) -> grpc.Status:
    """RESOURCE_EXHAUSTED with RetryInfo and ErrorInfo details: gRPC itself answers
    RESOURCE_EXHAUSTED for oversized messages, so clients need the details to tell
    backpressure (retry later) from a request that will never fit."""
    retry = any_pb2.Any()
    retry.Pack(error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(nanos=int(retry_after_s * 1e9))))
    info = any_pb2.Any()
    info.Pack(error_details_pb2.ErrorInfo(reason="QUEUE_FULL", domain=ERROR_DOMAIN))
    status = status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message=message, details=[retry, info])
    return rpc_status.to_status(status)


async def abort_rejected(context: grpc.aio.ServicerContext, exc: Rejected, retry_after_s: float) -> None:
    if exc.reason is RejectReason.QUEUE_FULL:
        await context.abort_with_status(queue_full_status(str(exc), retry_after_s))
    if exc.reason is RejectReason.NO_WORKER:
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
    if exc.reason in (RejectReason.DUPLICATE_ID, RejectReason.PROMPT_TOO_LONG):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))


# ---------------------------------------------------------------- the service


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, live: LiveScheduler) -> None:
        self.live = live

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        try:
            stream = self.live.submit(request)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Rejected as exc:
            await abort_rejected(context, exc, self.live.config.retry_after_s)
        rid = stream.request.request_id
        ended = False
        try:
            async for chunk in stream.messages():
                if chunk.final is None:
                    yield generation_pb2.GenerateResponse(request_id=rid, token_ids=chunk.token_ids, text=chunk.text)
                else:
                    ended = True
                    yield final_response(chunk)
        finally:
            # NOTE: a client cancel or deadline arrives here as CancelledError (or
            # GeneratorExit); the request's blocks are freed now, the worker's at its next step.
            if not ended:
                self.live.abort(rid, "client cancelled or deadline exceeded")

    async def Abort(
        self, request: generation_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.AbortResponse:
        aborted = [rid for rid in request.request_ids if self.live.abort(rid, "aborted by Abort")]
        return generation_pb2.AbortResponse(aborted_ids=aborted)

    async def GetServerInfo(
        self, request: generation_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.GetServerInfoResponse:
        live = self.live
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
            max_waiting=live.config.max_waiting,
            block_size=live.block_size,
            workers=workers,
        )

    async def GetStats(
        self, request: generation_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.GetStatsResponse:
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
    live: LiveScheduler, port: int, *, host: str = "127.0.0.1", health_servicer: health.aio.HealthServicer | None = None
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """An unstarted aio server with the generation, health and reflection services over a
    started LiveScheduler; port 0 picks one. Readiness follows the workers' health."""
    health_servicer = health_servicer or health.aio.HealthServicer()
    interceptors = telemetry.grpc_server_interceptors() if telemetry.tracing_enabled() else None
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(GenerationServicer(live), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind {host}:{port}")

    def on_health(healthy: bool) -> None:
        asyncio.get_running_loop().create_task(health_servicer.set(SERVICE_NAME, _SERVING if healthy else _NOT_SERVING))

    live.on_health = on_health
    return server, bound, health_servicer


async def start_health(live: LiveScheduler, health_servicer: health.aio.HealthServicer) -> None:
    await health_servicer.set("", _SERVING)
    await health_servicer.set(SERVICE_NAME, _SERVING if live.is_healthy else _NOT_SERVING)


async def shutdown(
    server: grpc.aio.Server,
    health_servicer: health.aio.HealthServicer,
    live: LiveScheduler,
    grace_s: float = 5.0,
    drain_s: float = 0.5,
) -> None:
    """Health first (balancers stop sending), then in-flight streams get grace_s, then the loops stop."""
    await health_servicer.enter_graceful_shutdown()
    await asyncio.sleep(drain_s)
    await server.stop(grace_s)
    await live.close()


class SchedulerServer:
    """The whole scheduler in-process: workers dialled, loops running, gRPC serving."""

    def __init__(self, live: LiveScheduler, server: grpc.aio.Server, port: int, health_servicer) -> None:
        self.live = live
        self.server = server
        self.port = port
        self.health = health_servicer

    @classmethod
    async def start(cls, live: LiveScheduler, port: int = 0, *, host: str = "127.0.0.1") -> SchedulerServer:
        await live.start()
        server, bound, health_servicer = build_server(live, port, host=host)
        await start_health(live, health_servicer)
        await server.start()
        return cls(live, server, bound, health_servicer)

    async def stop(self, grace_s: float = 5.0, drain_s: float = 0.5) -> None:
        await shutdown(self.server, self.health, self.live, grace_s, drain_s)


def worker_addresses(values: Sequence[str]) -> list[str]:
    """`--worker host:port` values (comma-separated lists allowed)."""
    return [a.strip() for v in values for a in v.split(",") if a.strip()]
