"""The worker's gRPC face: `sluice.v1.WorkerService` over one `LLMEngine`.

    scheduler --ExecuteRequest--> plan_from_proto --> StepPlan --EngineRunner.step--> engine.execute
    scheduler <-ExecuteResponse-- result_to_proto <-- StepResult <---------------------'

Every servicer method is thin: proto -> domain object -> engine -> proto. `EngineRunner`
serializes engine calls (they never interleave, even when two streams are open) and picks
where a step runs: on the event loop when it is predicted short, on the engine thread when
it is not, so health checks are still answered during a long CPU prefill.

A plan that fails to decode or that the engine rejects (`StepPlanError`) is answered with
`ExecuteResponse.error` and the stream carries on; any other exception means the engine
state may be half-applied, so the engine is marked failed: that step is answered INTERNAL,
later ones UNAVAILABLE, and both health services report NOT_SERVING, which tells the
scheduler to re-queue the worker's requests elsewhere.

Warmup sizes the KV cache (measured, or exactly `num_gpu_blocks_override` blocks), builds
it and runs one real step; request fields left at zero take the worker's flags
(`WarmupDefaults`). Warming up again starts from a clean slate: held requests are forgotten.

Standard gRPC health: `""` is liveness, `sluice.v1.WorkerService` is readiness (SERVING
only once Warmup has built the KV cache). Reflection lists both services.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TypeVar

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.trace import StatusCode

from scheduler_service.core.plan import CachedRequestData, NewRequestData, StepPlan, StepResult
from scheduler_service.core.sampling import InvalidRequestError, SamplingParams
from scheduler_service.plan_codec import SERVER_OPTIONS, PlanReceiver, error_result, result_to_proto
from sluice.common.telemetry import (
    TraceparentTable,
    grpc_server_interceptors,
    setup_tracing,
    shutdown_tracing,
    step_span,
    tracing_enabled,
)
from sluice.v1 import worker_pb2, worker_pb2_grpc
from worker_service.engine import EngineConfig, LLMEngine, StepPlanError

log = logging.getLogger(__name__)

SERVICE_NAME: str = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name
SAMPLING_METHODS = ("greedy", "temperature", "top_k", "top_p", "min_p", "seed")
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_WARMUP_REQUEST_ID = "__sluice_warmup__"

T = TypeVar("T")


def _sluice_version() -> str:
    try:
        return version("sluice")
    except PackageNotFoundError:
        return "0+unknown"


@dataclass(frozen=True, slots=True)
class WarmupDefaults:
    """What the worker uses where a WarmupRequest leaves a field at zero (its flags)."""

    gpu_memory_utilization: float = 0.9
    swap_space_gib: float = 4.0
    max_num_batched_tokens: int = 2048
    num_gpu_blocks: int | None = None  # skip measuring: exactly this many blocks


@dataclass(frozen=True, slots=True)
class WarmupParams:
    gpu_memory_utilization: float
    swap_space_gib: float
    max_num_batched_tokens: int
    num_gpu_blocks: int | None


def warmup_params(request: worker_pb2.WarmupRequest, defaults: WarmupDefaults) -> WarmupParams:
    """Merges a WarmupRequest over the worker's defaults; raises InvalidRequestError naming the field."""
    util = request.gpu_memory_utilization or defaults.gpu_memory_utilization
    if not 0.0 < util <= 1.0:
        raise InvalidRequestError("gpu_memory_utilization", f"must be in (0, 1], got {util}")
    if request.swap_space_gib < 0.0:
        raise InvalidRequestError("swap_space_gib", f"must be >= 0, got {request.swap_space_gib}")
    blocks = request.num_gpu_blocks_override if request.HasField("num_gpu_blocks_override") else None
    if blocks == 0:
        raise InvalidRequestError("num_gpu_blocks_override", "must be >= 1")
    return WarmupParams(
        gpu_memory_utilization=util,
        swap_space_gib=request.swap_space_gib or defaults.swap_space_gib,
        max_num_batched_tokens=request.max_num_batched_tokens or defaults.max_num_batched_tokens,
        num_gpu_blocks=blocks if blocks is not None else defaults.num_gpu_blocks,
    )


# Steps predicted to take at most this long run on the event loop (see EngineRunner).
INLINE_STEP_S = 0.05


class EngineRunner:
    """The engine, the lock that serializes calls into it, and whether it is usable.

    NOTE: a step predicted to end within INLINE_STEP_S runs on the event loop itself. The
    hop to a thread and back costs about 85 us (two cross-thread wake-ups), which was a
    third of the worker's whole handling of a 256-sequence step, and during a step the loop
    has nothing to do but answer health probes, which then wait one short step at most.
    The prediction is the last step's seconds per scheduled token times this step's tokens;
    it over-estimates steps that grow (a step's fixed cost is spread over fewer tokens), so
    a doubtful step goes to the thread. With no history yet (the first step of a session)
    and for Warmup's measurement, the engine thread runs it.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-engine")
        self._lock = asyncio.Lock()
        self._seconds_per_token: float | None = None
        self._busy: Future[Any] | None = None
        self.inline_steps = 0
        self.thread_steps = 0
        self.warmed_up = False
        self.failure = ""  # why the engine stopped being usable; empty while it works

    @property
    def ready(self) -> bool:
        return self.warmed_up and not self.failure

    @property
    def not_ready_reason(self) -> str:
        if self.failure:
            return f"engine failed: {self.failure}"
        return "" if self.warmed_up else "worker is not warmed up: call Warmup first"

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the engine thread, after any engine call in progress."""
        async with self._lock:
            await self._thread_done()
            return await self._on_thread(fn, *args)

    async def call_inline(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the event loop (cheap bookkeeping), after any engine call in progress."""
        async with self._lock:
            await self._thread_done()
            return fn(*args)

    def predicts_inline(self, num_tokens: int) -> bool:
        per_token = self._seconds_per_token
        return per_token is not None and per_token * num_tokens <= INLINE_STEP_S

    async def step(self, plan: StepPlan) -> StepResult:
        num_tokens = max(plan.total_num_scheduled_tokens, 1)
        async with self._lock:
            await self._thread_done()
            start = time.perf_counter()
            if self.predicts_inline(num_tokens):
                self.inline_steps += 1
                result = self.engine.execute(plan)
            else:
                self.thread_steps += 1
                result = await self._on_thread(self.engine.execute, plan)
            self._seconds_per_token = (time.perf_counter() - start) / num_tokens
        return result

    async def _on_thread(self, fn: Callable[..., T], *args: Any) -> T:
        # NOTE: shielded: a caller that stops waiting (its stream was cancelled) must not
        # cancel a call the thread may already be running; `_thread_done` waits for it.
        self._busy = self._thread.submit(fn, *args)
        return await asyncio.shield(asyncio.wrap_future(self._busy))

    async def _thread_done(self) -> None:
        """Waits until the thread is idle: a cancelled caller released the lock, not the engine."""
        busy = self._busy
        if busy is not None and not busy.done():
            with contextlib.suppress(Exception):  # its own caller was the one to hear of a failure
                await asyncio.shield(asyncio.wrap_future(busy))

    def forget_history(self) -> None:
        """After Warmup: a new KV cache (and maybe a new batch shape), so no prediction yet."""
        self._seconds_per_token = None


def _warm_plan(engine: LLMEngine) -> StepPlan:
    """A one-request, one-block step that runs every stage once (first-call costs paid here)."""
    n = min(engine.info.block_size, 8)
    request = NewRequestData(
        request_id=_WARMUP_REQUEST_ID,
        prompt_token_ids=tuple(range(1, n + 1)),
        num_tokens=n,
        sampling=SamplingParams(temperature=0.0, max_tokens=1),
        block_ids=(0,),
    )
    return StepPlan(
        step_id=0,
        worker_id=0,
        new_requests=(request,),
        cached_requests=CachedRequestData(),
        num_scheduled_tokens={_WARMUP_REQUEST_ID: n},
        sample_ids=frozenset({_WARMUP_REQUEST_ID}),
    )


def build_kv_cache(engine: LLMEngine, params: WarmupParams) -> tuple[int, int, int]:
    """Runs in the engine thread: sizes and allocates the KV cache, then runs one warm step.

    Returns (num_gpu_blocks, num_cpu_blocks, peak_activation_bytes).
    """
    if params.num_gpu_blocks is not None:
        num_gpu = params.num_gpu_blocks
        num_cpu = int(params.swap_space_gib * 2**30) // engine.info.bytes_per_block
        peak = 0
    else:
        cap = engine.measure_kv_capacity(
            params.gpu_memory_utilization, params.swap_space_gib, params.max_num_batched_tokens
        )
        num_gpu, num_cpu, peak = cap.num_gpu_blocks, cap.num_cpu_blocks, cap.peak_activation_bytes
    if num_gpu < 1:
        raise MemoryError("no accelerator memory is left for even one KV block")
    engine.init_kv_cache(num_gpu, num_cpu)
    engine.execute(_warm_plan(engine))
    engine.release([_WARMUP_REQUEST_ID])
    return num_gpu, num_cpu, peak


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    """Thin RPC handlers over an EngineRunner; readiness goes to the standard health service."""

    def __init__(
        self, runner: EngineRunner, health_servicer: health.aio.HealthServicer, worker_id: int, defaults: WarmupDefaults
    ) -> None:
        self.runner = runner
        self.health = health_servicer
        self.worker_id = worker_id
        self.defaults = defaults
        self.traceparents = TraceparentTable()  # request id -> W3C traceparent, while tracing

    async def Info(self, request: worker_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> worker_pb2.InfoResponse:
        info = self.runner.engine.info
        return worker_pb2.InfoResponse(
            worker_id=str(self.worker_id),
            model=info.model,
            model_family=info.family,
            dtype=info.dtype,
            device=info.device,
            block_size=info.block_size,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            eos_token_ids=info.eos_token_ids,
            capabilities=worker_pb2.WorkerCapabilities(
                chunked_prefill=True,
                swap=True,
                int8_swap=self.runner.engine.spec.supports_int8,
                async_swap=info.device.startswith("cuda"),  # D2H copies on their own stream
                role=worker_pb2.WORKER_ROLE_MIXED,
                sampling=SAMPLING_METHODS,
            ),
            version=_sluice_version(),
            warmed_up=self.runner.warmed_up,
        )

    async def Warmup(
        self, request: worker_pb2.WarmupRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WarmupResponse:
        try:
            params = warmup_params(request, self.defaults)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        engine = self.runner.engine
        if engine.num_requests:
            # NOTE: a scheduler that warms a worker up again (after its own restart) starts
            # from a clean slate; whatever the worker held belongs to the previous session.
            log.warning("warmup forgets the %d requests the worker holds", engine.num_requests)
        self.traceparents.clear()
        self.runner.warmed_up = False
        await self._publish_readiness()
        start = time.perf_counter()
        try:
            num_gpu, num_cpu, peak = await self.runner.call(build_kv_cache, engine, params)
        except MemoryError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"KV cache does not fit: {exc}")
        except Exception as exc:
            log.exception("warmup failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"warmup failed: {type(exc).__name__}: {exc}")
        self.runner.forget_history()
        self.runner.warmed_up = True
        await self._publish_readiness()
        log.info("warmed up: %d GPU blocks, %d CPU blocks", num_gpu, num_cpu)
        return worker_pb2.WarmupResponse(
            num_gpu_blocks=num_gpu,
            num_cpu_blocks=num_cpu,
            block_size=engine.info.block_size,
            bytes_per_block=engine.info.bytes_per_block,
            warmup_s=time.perf_counter() - start,
            peak_activation_bytes=peak,
        )

    async def Execute(
        self, request_iterator: AsyncIterator[worker_pb2.ExecuteRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.ExecuteResponse]:
        # NOTE: an async generator (not context.write) so OpenTelemetry's aio interceptor
        # can wrap this handler later (opentelemetry-python-contrib #3066).
        receiver = PlanReceiver(self.worker_id)
        async for msg in request_iterator:
            yield await self._step(msg, receiver)

    async def Release(
        self, request: worker_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReleaseResponse:
        released = await self.runner.call_inline(self.runner.engine.release, list(request.request_ids))
        self.traceparents.forget(released)
        return worker_pb2.ReleaseResponse(released_ids=released)

    async def Health(
        self, request: worker_pb2.HealthRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.HealthResponse:
        return worker_pb2.HealthResponse(
            serving=self.runner.ready,
            message=self.runner.not_ready_reason,
            num_requests=self.runner.engine.num_requests,
        )

    async def _step(self, msg: worker_pb2.ExecuteRequest, receiver: PlanReceiver) -> worker_pb2.ExecuteResponse:
        received = time.perf_counter()
        if not self.runner.ready:
            receiver.forget()
            return result_to_proto(error_result(msg.step_id, "UNAVAILABLE", self.runner.not_ready_reason))
        try:
            plan = receiver.decode(msg)
        except (ValueError, TypeError) as exc:  # InvalidRequestError names the field; others come from the dataclasses
            return result_to_proto(error_result(msg.step_id, "INVALID_ARGUMENT", str(exc)))
        result = await self._execute_traced(plan)
        if result.error is None:
            result = replace(result, total_s=time.perf_counter() - received)
        return receiver.encode(result)

    async def _execute_traced(self, plan: StepPlan) -> StepResult:
        """The step inside a span linked to the spans of the requests it advances (sluice.common.telemetry);
        without tracing set up, just the step."""
        if not tracing_enabled():
            return await self._execute(plan)
        self.traceparents.update(((r.request_id, r.traceparent) for r in plan.new_requests), plan.release_ids)
        with step_span(self.worker_id, plan.step_id, self.traceparents.lookup(plan.num_scheduled_tokens)) as span:
            span.set_attribute("sluice.step.num_tokens", plan.total_num_scheduled_tokens)
            result = await self._execute(plan)
            if result.error is not None:
                span.set_status(StatusCode.ERROR, f"{result.error.code}: {result.error.message}")
            return result

    async def _execute(self, plan: StepPlan) -> StepResult:
        try:
            return await self.runner.step(plan)
        except StepPlanError as exc:
            return error_result(plan.step_id, exc.code, exc.message, exc.request_id or "")
        except Exception as exc:
            log.exception("engine failed at step %d", plan.step_id)
            self.runner.failure = f"step {plan.step_id}: {type(exc).__name__}: {exc}"
            await self._publish_readiness()
            return error_result(plan.step_id, "INTERNAL", self.runner.failure)

    async def _publish_readiness(self) -> None:
        await self.health.set(SERVICE_NAME, _SERVING if self.runner.ready else _NOT_SERVING)
        if self.runner.failure:
            # NOTE: only a restart brings a failed engine back, so liveness fails too and an
            # orchestrator restarts the process instead of keeping a zombie worker.
            await self.health.set("", _NOT_SERVING)


def build_server(
    engine: LLMEngine,
    port: int,
    *,
    host: str = "127.0.0.1",
    worker_id: int = 0,
    defaults: WarmupDefaults | None = None,
    health_servicer: health.aio.HealthServicer | None = None,
    runner: EngineRunner | None = None,
) -> tuple[grpc.aio.Server, int]:
    """An unstarted aio server with the worker, health and reflection services; port 0 picks one.

    `runner`: one already wrapping `engine` (whoever passes it can read its step counts)."""
    health_servicer = health_servicer or health.aio.HealthServicer()
    runner = runner or EngineRunner(engine)
    if runner.engine is not engine:
        raise ValueError("runner wraps a different engine")
    servicer = WorkerServicer(runner, health_servicer, worker_id, defaults or WarmupDefaults())
    # NOTE: the OpenTelemetry interceptor only when tracing is set up (it costs an extra
    # async-generator hop per streamed message); step spans link to requests either way.
    server = grpc.aio.server(
        options=SERVER_OPTIONS, interceptors=grpc_server_interceptors() if tracing_enabled() else None
    )
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound_port = server.add_insecure_port(f"{host}:{port}")
    if bound_port == 0:
        raise OSError(f"could not bind {host}:{port}")
    return server, bound_port


async def start_health(health_servicer: health.aio.HealthServicer) -> None:
    """Liveness SERVING now, readiness NOT_SERVING until Warmup."""
    await health_servicer.set("", _SERVING)
    await health_servicer.set(SERVICE_NAME, _NOT_SERVING)


async def shutdown(
    server: grpc.aio.Server, health_servicer: health.aio.HealthServicer, grace_s: float = 5.0, drain_s: float = 0.5
) -> None:
    """Health first (balancers stop sending), a moment to notice, then in-flight streams get grace_s."""
    await health_servicer.enter_graceful_shutdown()
    await asyncio.sleep(drain_s)
    await server.stop(grace_s)


async def serve(
    config: EngineConfig,
    port: int,
    *,
    host: str = "0.0.0.0",
    worker_id: int = 0,
    defaults: WarmupDefaults | None = None,
    grace_s: float = 5.0,
    engine_factory: Callable[[EngineConfig], Any] = LLMEngine,
) -> None:
    """Loads the model (or the engine `engine_factory` builds), serves until SIGINT or SIGTERM,
    then shuts down gracefully."""
    setup_tracing("sluice-worker")
    engine = await asyncio.to_thread(engine_factory, config)
    health_servicer = health.aio.HealthServicer()
    server, bound_port = build_server(
        engine, port, host=host, worker_id=worker_id, defaults=defaults, health_servicer=health_servicer
    )
    await start_health(health_servicer)
    await server.start()
    info = engine.info
    print(
        f"sluice worker {worker_id} listening on {host}:{bound_port} ({info.model}, {info.dtype}, {info.device})",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print("sluice worker shutting down", flush=True)
    await shutdown(server, health_servicer, grace_s)
    shutdown_tracing()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sluice worker", description="Serve one model engine over gRPC.")
    p.add_argument("--model", default="tiny-llama", help="model name or checkpoint folder")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy", "safetensors"))
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=50061)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--swap-space-gib", type=float, default=4.0)
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="use this many KV blocks instead of measuring")
    p.add_argument("--worker-id", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads on CPU (0: torch's default)")
    p.add_argument(
        "--engine",
        default="torch",
        choices=("torch", "echo", "none"),
        help="torch: run the model; echo (or none): check plans and answer synthetic tokens at once (load tests)",
    )
    p.add_argument("--echo-step-ms", type=float, default=0.0, help="with --engine echo: sleep this long per step")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads:
        # NOTE: on a CPU shared with other processes, fewer OpenMP threads than cores avoids
        # barrier stalls that made the same steps up to 40x slower (docs/RESULTS.md, worker section).
        torch.set_num_threads(args.threads)
    config = EngineConfig(
        model=args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        seed=args.seed,
    )
    defaults = WarmupDefaults(
        gpu_memory_utilization=args.gpu_memory_utilization,
        swap_space_gib=args.swap_space_gib,
        num_gpu_blocks=args.num_gpu_blocks,
    )
    log.info("worker config: %s; warmup defaults: %s", config, defaults)
    factory: Callable[[EngineConfig], Any] = LLMEngine
    if args.engine in ("echo", "none"):
        from worker_service.echo_engine import EchoEngine

        factory = partial(EchoEngine, step_time_s=args.echo_step_ms / 1e3)
    asyncio.run(
        serve(config, args.port, host=args.host, worker_id=args.worker_id, defaults=defaults, engine_factory=factory)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
