"""The worker's gRPC face: `sluice.v1.WorkerService` over one `Engine` (worker_service/engine_contract.py).

    scheduler --ExecuteRequest--> plan_from_proto --> StepPlan --EngineRunner.step--> engine.execute
    scheduler <-ExecuteResponse-- result_to_proto <-- StepResult <---------------------'

Every servicer method is thin: proto -> domain object -> engine -> proto. `EngineRunner`
serializes engine calls (they never interleave, even when two streams are open) and picks
where a step runs: on the event loop when it is predicted short, on the engine thread when
it is not, so health checks are still answered during a long CPU prefill.

Where the device computes apart from the host CPU (CUDA, the echo engine's async device), an
Execute stream runs through the engine pipeline instead (worker_service/step_pipeline.py): step
N+1 is launched (`engine.launch`) before step N is collected (`engine.collect`), so the worker's
own per-step work runs while the device computes; `--worker-pipeline off` turns it off.

A plan that fails to decode or that the engine rejects (`StepPlanError`) is answered with
`ExecuteResponse.error` and the stream carries on; any other exception means the engine
state may be half-applied, so the engine is marked failed: that step is answered INTERNAL,
later ones UNAVAILABLE, and both health services report NOT_SERVING, which tells the
scheduler to re-queue the worker's requests elsewhere.

Warmup sizes the KV cache (measured, or exactly `num_gpu_blocks_override` blocks), builds
it and runs one real step; request fields left at zero take the worker's flags
(`WarmupDefaults`). Warming up again starts from a clean slate: held requests are forgotten.

A worker serves one scheduler (worker_service/lease.py): Warmup grants a lease and answers
its session id; Execute and Release must carry it as `x-sluice-session` metadata (refused
FAILED_PRECONDITION without one, PERMISSION_DENIED with another), and a Warmup from anyone
else is refused while the lease is live. Every step renews it, so does a Health call that
carries it (the scheduler's idle probes).

Standard gRPC health: `""` is liveness, `sluice.v1.WorkerService` is readiness (SERVING
only once Warmup has built the KV cache). Reflection lists both services.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health
from opentelemetry.trace import StatusCode

from sluice.common.config import opt
from sluice.common.grpc_server import KEEPALIVE, NOT_SERVING, SERVING, GrpcServer, Keepalive
from sluice.common.prom import WorkerMetrics, start_metrics_server
from sluice.common.security import PLAINTEXT, ClientSecurity, ServerSecurity
from sluice.common.telemetry import TraceparentTable, setup_tracing, shutdown_tracing, step_span, tracing_enabled
from sluice.common.version import sluice_version
from sluice.contract.limits import DEFAULT_GPU_MEMORY_UTILIZATION, DEFAULT_SWAP_SPACE_GIB, token_budget
from sluice.contract.plan import CachedRequestData, NewRequestData, StepPlan, StepResult
from sluice.contract.plan_codec import PlanReceiver, error_result, result_to_proto
from sluice.contract.sampling import InvalidRequestError, SamplingParams
from sluice.v1 import worker_pb2, worker_pb2_grpc
from worker_service.engine_contract import Engine, EngineConfig
from worker_service.engines import engine_class
from worker_service.finished_filter import FinishedFilter
from worker_service.kv_transfer import KVTransferHandler, TransferRefused, add_read_kv_handler, token_of
from worker_service.lease import DEFAULT_LEASE_TTL_S, LEASE_LEFT_KEY, Lease, LeaseError, holder_of, session_of
from worker_service.plan_check import StepPlanError
from worker_service.step_pipeline import EnginePipeline, void_step
from worker_service.step_reader import Incoming, StepReader

log = logging.getLogger(__name__)

SERVICE_NAME: str = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name
SAMPLING_METHODS = ("greedy", "temperature", "top_k", "top_p", "min_p", "seed")
_WARMUP_REQUEST_ID = "__sluice_warmup__"

T = TypeVar("T")


@dataclass
class WarmupDefaults:
    """What the worker uses where a WarmupRequest leaves a field at zero (its flags)."""

    gpu_memory_utilization: float = opt(
        DEFAULT_GPU_MEMORY_UTILIZATION, "share of accelerator memory the worker may use in all"
    )
    swap_space_gib: float = opt(DEFAULT_SWAP_SPACE_GIB, "host swap space in GiB")
    max_num_batched_tokens: int | None = opt(
        None, "tokens of the activation probe; none: max(8192, the model's context length)"
    )
    num_gpu_blocks: int | None = opt(None, "use exactly this many KV blocks instead of measuring")
    role: str = opt(
        "mixed", "prefill, decode or mixed: this worker's part in a disaggregated deployment (announced in Info)"
    )


ROLES = {
    "mixed": worker_pb2.WORKER_ROLE_MIXED,
    "prefill": worker_pb2.WORKER_ROLE_PREFILL,
    "decode": worker_pb2.WORKER_ROLE_DECODE,
}


def role_value(name: str) -> int:
    """The WorkerRole of a configured role name; ValueError naming the field otherwise."""
    if name not in ROLES:
        raise ValueError(f"role: must be one of {', '.join(ROLES)}, got {name!r}")
    return ROLES[name]


@dataclass(frozen=True, slots=True)
class WarmupParams:
    gpu_memory_utilization: float
    swap_space_gib: float
    max_num_batched_tokens: int
    num_gpu_blocks: int | None


# NOTE: a probe of more tokens than this would take minutes on a CPU and may not fit any
# device; no model Sluice serves needs a larger step.
MAX_WARMUP_BATCHED_TOKENS = 2**20


@dataclass(frozen=True, slots=True)
class MemoryLimits:
    """What a Warmup may ask for: the KV cache must fit the device, swap space the host."""

    bytes_per_block: int
    device_bytes: float
    host_bytes: float


def host_memory_bytes() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def warmup_params(
    request: worker_pb2.WarmupRequest, defaults: WarmupDefaults, max_model_len: int, memory: MemoryLimits | None = None
) -> WarmupParams:
    """Merges a WarmupRequest over the worker's defaults; raises InvalidRequestError naming the field."""
    util = request.gpu_memory_utilization or defaults.gpu_memory_utilization
    if not 0.0 < util <= 1.0:
        raise InvalidRequestError("gpu_memory_utilization", f"must be in (0, 1], got {util}")
    if not 0.0 <= request.swap_space_gib < math.inf:
        raise InvalidRequestError("swap_space_gib", f"must be >= 0 and finite, got {request.swap_space_gib}")
    if request.max_num_batched_tokens > MAX_WARMUP_BATCHED_TOKENS:
        raise InvalidRequestError(
            "max_num_batched_tokens", f"must be <= {MAX_WARMUP_BATCHED_TOKENS}, got {request.max_num_batched_tokens}"
        )
    blocks = request.num_gpu_blocks_override if request.HasField("num_gpu_blocks_override") else None
    if blocks == 0:
        raise InvalidRequestError("num_gpu_blocks_override", "must be >= 1")
    params = WarmupParams(
        gpu_memory_utilization=util,
        swap_space_gib=request.swap_space_gib or defaults.swap_space_gib,
        max_num_batched_tokens=request.max_num_batched_tokens
        or token_budget(defaults.max_num_batched_tokens, max_model_len),
        num_gpu_blocks=blocks if blocks is not None else defaults.num_gpu_blocks,
    )
    if memory is not None:
        _check_memory(params, memory)
    return params


def _check_memory(params: WarmupParams, memory: MemoryLimits) -> None:
    if params.num_gpu_blocks is not None and params.num_gpu_blocks * memory.bytes_per_block > memory.device_bytes:
        raise InvalidRequestError(
            "num_gpu_blocks_override",
            f"{params.num_gpu_blocks} blocks of {memory.bytes_per_block} bytes exceed the device's "
            f"{memory.device_bytes / 2**30:.1f} GiB",
        )
    if params.swap_space_gib * 2**30 > memory.host_bytes:
        raise InvalidRequestError(
            "swap_space_gib",
            f"{params.swap_space_gib:g} GiB exceeds the host's {memory.host_bytes / 2**30:.1f} GiB of memory",
        )


# Steps predicted to take at most this long run on the event loop (see EngineRunner).
INLINE_STEP_S = 0.05
# A step planned ahead (overlap) on an accelerator predicted to take at least this long runs on
# the thread, so the next plan is decoded meanwhile; a shorter one leaves nothing to overlap.
OVERLAP_THREAD_S = 0.002
# The worker's engine pipeline (worker_service/step_pipeline.py): auto runs it where the device
# computes apart from the host CPU (CUDA, the echo engine's async device); on a CPU engine there
# is nothing to hide a step's host work behind.
PIPELINE_MODES = ("auto", "on", "off")


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

    def __init__(self, engine: Engine, pipeline: str = "auto", step_spans: bool | None = None) -> None:
        """`step_spans`: whether steps are traced, a span per call into the engine (which keeps the
        pipeline off); None: whenever tracing is set up in this process. The tracer provider is
        process-wide and cannot be taken down, so a worker embedded beside traced code (a test
        process, a benchmark) says False to pipeline its steps untraced."""
        if pipeline not in PIPELINE_MODES:
            raise ValueError(f"worker_pipeline must be one of {', '.join(PIPELINE_MODES)}, got {pipeline!r}")
        self.engine = engine
        self.pipeline = pipeline
        self.step_spans = step_spans
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-engine")
        self._lock = asyncio.Lock()
        self._seconds_per_token: float | None = None
        self._busy: Future[Any] | None = None
        self.inline_steps = 0
        self.thread_steps = 0
        self.launched_ahead = 0  # pipelined steps launched while the one before was not collected
        self.warmed_up = False
        self.failure = ""  # why the engine stopped being usable; empty while it works
        # NOTE: only an accelerator computes apart from the host CPU; on a CPU engine the thread
        # would compete with the loop for the same cores (measured: half the decode rate).
        self.accelerated = not str(engine.info.device).startswith("cpu")

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

    def predicts_inline(self, num_tokens: int, planned_ahead: bool = False) -> bool:
        per_token = self._seconds_per_token
        if per_token is None:
            return False
        predicted = per_token * num_tokens
        overlap_on_thread = planned_ahead and self.accelerated and predicted >= OVERLAP_THREAD_S
        return predicted <= INLINE_STEP_S and not overlap_on_thread

    async def step(self, plan: StepPlan) -> StepResult:
        num_tokens = max(plan.total_num_scheduled_tokens, 1)
        async with self._lock:
            await self._thread_done()
            start = time.perf_counter()
            # NOTE: a long step planned ahead (overlapped scheduling) runs on the thread: the next
            # plan arrives during it, and the loop reads and decodes it meanwhile (StepReader).
            if self.predicts_inline(num_tokens, planned_ahead=bool(plan.follows_step_id)):
                self.inline_steps += 1
                result = self.engine.execute(plan)
            else:
                self.thread_steps += 1
                result = await self._on_thread(self.engine.execute, plan)
            self._seconds_per_token = (time.perf_counter() - start) / num_tokens
            device_s = self.engine.async_device_s
            if device_s:
                # An engine whose device runs apart from the CPU (the echo engine emulating one):
                # the step ends when the device does, and the loop is free meanwhile.
                await asyncio.sleep(device_s)
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

    @property
    def traces_steps(self) -> bool:
        return tracing_enabled() if self.step_spans is None else self.step_spans

    @property
    def pipelines(self) -> bool:
        """Whether Execute streams run through the engine pipeline. NOTE: not while tracing: a
        step's span wraps one call into the engine, and a pipelined step is two."""
        if self.pipeline == "off" or self.traces_steps:
            return False
        async_device = self.accelerated or bool(self.engine.async_device_s)
        return self.pipeline == "on" or async_device

    async def launch(self, plan: StepPlan) -> Any:
        """The step's host work and its device work queued (the engine's `launch`), on the loop."""
        async with self._lock:
            await self._thread_done()
            return self.engine.launch(plan)

    async def device_done(self, launched: Any) -> None:
        """Returns once a launched step's device work is done, the loop free meanwhile."""
        end = launched.device_end
        if end is not None:
            delay = end - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        elif self.accelerated:
            await asyncio.to_thread(launched.wait)

    async def collect(self, launched: Any) -> StepResult:
        async with self._lock:
            await self._thread_done()
            return self.engine.collect(launched)

    def forget_history(self) -> None:
        """After Warmup: a new KV cache (and maybe a new batch shape), so no prediction yet."""
        self._seconds_per_token = None


def _warm_plan(engine: Engine) -> StepPlan:
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


def build_kv_cache(engine: Engine, params: WarmupParams) -> tuple[int, int, int]:
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
    engine.warm_up()
    engine.execute(_warm_plan(engine))
    engine.release([_WARMUP_REQUEST_ID])
    return num_gpu, num_cpu, peak


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    """Thin RPC handlers over an EngineRunner; readiness goes to the standard health service."""

    def __init__(
        self,
        runner: EngineRunner,
        health_servicer: health.aio.HealthServicer,
        worker_id: int,
        defaults: WarmupDefaults,
        lease: Lease | None = None,
        metrics: WorkerMetrics | None = None,
        peer_security: ClientSecurity = PLAINTEXT,
    ) -> None:
        self.runner = runner
        self.kv = KVTransferHandler(runner, peer_security)  # worker-to-worker KV (worker_service/kv_transfer.py)
        self.configured_role = role_value(defaults.role)  # its --role: what Info announces between sessions
        self.role = self.configured_role
        self.metrics = metrics
        self.health = health_servicer
        self.worker_id = worker_id
        self.defaults = defaults
        self.lease = lease or Lease()
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
                int8_swap=info.supports_int8,
                async_swap=info.device.startswith("cuda"),  # D2H copies on their own stream
                # NOTE: the role of the live session only: a scheduler reading Info before its own
                # Warmup must not take a role an earlier session asked for as this worker's; it
                # reads the worker's configured role (--role) instead.
                role=self.role if self.lease.live() else self.configured_role,
                sampling=SAMPLING_METHODS,
            ),
            version=sluice_version(),
            warmed_up=self.runner.warmed_up,
            model_dimensions=worker_pb2.ModelDimensions(
                num_layers=info.num_layers,
                hidden_size=info.hidden_size,
                num_heads=info.num_heads,
                num_kv_heads=info.num_kv_heads,
                intermediate_size=info.intermediate_size,
                gated_mlp=info.family.startswith("llama"),
                dtype_bytes=info.dtype_bytes,
            ),
            hardware=await self._hardware(),
        )

    async def _hardware(self) -> worker_pb2.HardwareDescription:
        # NOTE: measured once per process (a matrix product and a copy); off the event loop so
        # health probes are answered meanwhile.
        hw = await asyncio.to_thread(lambda: self.runner.engine.hardware)
        return worker_pb2.HardwareDescription(
            preset=hw.preset,
            name=hw.name,
            peak_flops=hw.peak_flops,
            memory_bandwidth=hw.memory_bandwidth,
            memory_bytes=hw.memory_bytes,
            host_link_bandwidth=hw.host_link_bandwidth,
        )

    async def _memory_limits(self) -> MemoryLimits:
        hw = await asyncio.to_thread(lambda: self.runner.engine.hardware)
        return MemoryLimits(self.runner.engine.info.bytes_per_block, hw.memory_bytes, host_memory_bytes())

    async def Warmup(
        self, request: worker_pb2.WarmupRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WarmupResponse:
        engine = self.runner.engine
        try:
            params = warmup_params(request, self.defaults, engine.info.max_model_len, await self._memory_limits())
            metadata = context.invocation_metadata()
            session = self.lease.grant(session_of(metadata), holder_of(metadata))
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except LeaseError as exc:
            self._count_refusal()
            if exc.left_s is not None:
                context.set_trailing_metadata(((LEASE_LEFT_KEY, f"{exc.left_s:.3f}"),))
            await context.abort(grpc.StatusCode[exc.code], exc.message)
        if engine.num_requests:
            # NOTE: the lease holder warming up again (after its stream broke) starts from a
            # clean slate; whatever the worker held belongs to the previous session.
            log.warning("warmup forgets the %d requests the worker holds", engine.num_requests)
        self.traceparents.clear()
        self.kv.reset()
        self.role = request.role or self.configured_role
        self.runner.warmed_up = False
        await self._publish_readiness()
        start = time.perf_counter()
        try:
            num_gpu, num_cpu, peak = await self.runner.call(build_kv_cache, engine, params)
        except MemoryError as exc:
            self.lease.clear()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"KV cache does not fit: {exc}")
        except Exception as exc:
            self.lease.clear()
            log.exception("warmup failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"warmup failed: {type(exc).__name__}: {exc}")
        self.runner.forget_history()
        self.runner.warmed_up = True
        await self._publish_readiness()
        log.info("warmed up: %d GPU blocks, %d CPU blocks; lease granted", num_gpu, num_cpu)
        return worker_pb2.WarmupResponse(
            num_gpu_blocks=num_gpu,
            num_cpu_blocks=num_cpu,
            block_size=engine.info.block_size,
            bytes_per_block=engine.info.bytes_per_block,
            warmup_s=time.perf_counter() - start,
            peak_activation_bytes=peak,
            session_id=session,
            lease_ttl_s=self.lease.ttl_s,
        )

    async def _check_lease(self, context: grpc.aio.ServicerContext, session: str | None) -> None:
        try:
            self.lease.check(session)
        except LeaseError as exc:
            self._count_refusal()
            await context.abort(grpc.StatusCode[exc.code], exc.message)

    def _count_refusal(self) -> None:
        if self.metrics is not None:
            self.metrics.refusals.inc()

    async def Execute(
        self, request_iterator: AsyncIterator[worker_pb2.ExecuteRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.ExecuteResponse]:
        # NOTE: an async generator (not context.write) so OpenTelemetry's aio interceptor
        # can wrap this handler later (opentelemetry-python-contrib #3066).
        session = session_of(context.invocation_metadata())
        await self._check_lease(context, session)
        reader = StepReader(request_iterator, PlanReceiver(self.worker_id))
        info = self.runner.engine.info
        finished = FinishedFilter(frozenset(info.eos_token_ids), info.max_model_len)
        try:
            if self.runner.pipelines:
                pipeline = EnginePipeline(
                    self.runner,
                    finished,
                    lambda: self._check_lease(context, session),
                    self._fail_engine,
                    self._count_step,
                )
                # NOTE: closed here, not whenever the loop finalizes it: a stream that ends early
                # must have its launched steps collected before the next stream's steps launch.
                async with contextlib.aclosing(pipeline.run(reader)) as responses:
                    async for response in responses:
                        yield response
                        self.lease.renew_if_holder(session)
                return
            failed = 0  # the last step on this stream that failed or was void
            async for incoming in reader:
                # NOTE: checked per step, not only at the stream's start: a later Warmup (the lease
                # lapsed and another scheduler took the worker) ends this session's stream.
                await self._check_lease(context, session)
                msg = incoming.msg
                if failed and msg.follows_step_id == failed:
                    response = void_step(msg)
                    finished.observe_result(0, {})
                else:
                    response = await self._step(incoming, finished)
                if response.HasField("error"):
                    failed = msg.step_id
                yield response
                self.lease.renew_if_holder(session)
        finally:
            await reader.close()

    async def Release(
        self, request: worker_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ReleaseResponse:
        await self._check_lease(context, session_of(context.invocation_metadata()))
        released = await self.runner.call_inline(self.runner.engine.release, list(request.request_ids))
        self.traceparents.forget(released)
        if request.end_lease:
            self.lease.clear()
            log.info("the scheduler gave up its lease")
        return worker_pb2.ReleaseResponse(released_ids=released)

    async def Health(
        self, request: worker_pb2.HealthRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.HealthResponse:
        holder = self.lease.renew_if_holder(session_of(context.invocation_metadata()))
        return worker_pb2.HealthResponse(
            serving=self.runner.ready,
            message=self.runner.not_ready_reason,
            num_requests=self.runner.engine.num_requests,
            leased=self.lease.live(),
            lease_holder=holder,
        )

    async def OfferKv(
        self, request: worker_pb2.OfferKvRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.OfferKvResponse:
        await self._check_lease(context, session_of(context.invocation_metadata()))
        try:
            return self.kv.offer(request)
        except TransferRefused as exc:
            await context.abort(grpc.StatusCode[exc.code], exc.message)

    async def PullKv(
        self, request: worker_pb2.PullKvRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PullKvResponse:
        await self._check_lease(context, session_of(context.invocation_metadata()))
        try:
            return await self.kv.pull(request, context.time_remaining())
        except TransferRefused as exc:
            await context.abort(grpc.StatusCode[exc.code], exc.message)

    async def ReadKv(
        self, request: worker_pb2.ReadKvRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        # NOTE: no lease: the one-time token OfferKv minted is the capability (kv_transfer.py);
        # yields serialized ReadKvResponse messages (add_read_kv_handler registers the method).
        try:
            chunks = await self.kv.read(token_of(context.invocation_metadata()), request.blocks_per_chunk)
        except TransferRefused as exc:
            await context.abort(grpc.StatusCode[exc.code], exc.message)
        try:
            async for chunk in chunks:
                yield chunk
        except TransferRefused as exc:  # the worker was warmed up again meanwhile
            await context.abort(grpc.StatusCode[exc.code], exc.message)

    async def _step(self, incoming: Incoming, finished: FinishedFilter) -> worker_pb2.ExecuteResponse:
        received = time.perf_counter()
        msg, plan = incoming.msg, incoming.plan
        if not self.runner.ready:
            return result_to_proto(error_result(msg.step_id, "UNAVAILABLE", self.runner.not_ready_reason))
        if plan is None:  # InvalidRequestError names the field; others come from the dataclasses
            finished.observe_result(0, {})
            return result_to_proto(error_result(msg.step_id, "INVALID_ARGUMENT", incoming.error))
        # NOTE: overlap: requests the previous step finished are left out (their answer then
        # names its tokens by id, since it no longer samples exactly the plan's requests).
        plan = finished.filter(plan, self.runner.engine.book.entries)
        finished.observe_plan(plan)
        result = await self._execute_traced(plan)
        finished.observe_result(plan.step_id if result.error is None else 0, result.sampled_token_ids)
        if result.error is None:
            result = replace(result, total_s=time.perf_counter() - received)
        self._count_step(plan, result)
        return result_to_proto(result, incoming.order)

    def _count_step(self, plan: StepPlan, result: StepResult) -> None:
        if self.metrics is not None:
            code = result.error.code if result.error is not None else None
            self.metrics.on_step(result.total_s, plan.total_num_scheduled_tokens, code, self.runner.engine.num_requests)

    async def _execute_traced(self, plan: StepPlan) -> StepResult:
        """The step inside a span linked to the spans of the requests it advances (sluice.common.telemetry);
        without tracing set up, just the step."""
        if not self.runner.traces_steps:
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
            return await self._fail_engine(plan.step_id, exc)

    async def _fail_engine(self, step_id: int, exc: Exception) -> StepResult:
        """The engine raised what a bad plan does not: its state may be half applied."""
        self.runner.failure = f"step {step_id}: {type(exc).__name__}: {exc}"
        await self._publish_readiness()
        return error_result(step_id, "INTERNAL", self.runner.failure)

    async def _publish_readiness(self) -> None:
        await self.health.set(SERVICE_NAME, SERVING if self.runner.ready else NOT_SERVING)
        if self.metrics is not None:
            self.metrics.ready.set(1.0 if self.runner.ready else 0.0)
        if self.runner.failure:
            # NOTE: only a restart brings a failed engine back, so liveness fails too and an
            # orchestrator restarts the process instead of keeping a zombie worker.
            await self.health.set("", NOT_SERVING)


@dataclass(frozen=True)
class WorkerServerOptions:
    """How the worker's gRPC server is exposed (the engine's settings are EngineConfig's)."""

    security: ServerSecurity = field(default_factory=ServerSecurity)
    health_port: int | None = None
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S
    keepalive: Keepalive = KEEPALIVE
    peer_security: ClientSecurity = PLAINTEXT  # how this worker dials a peer's ReadKv
    pipeline: str = "auto"  # the engine pipeline: auto, on or off (PIPELINE_MODES)


def _add_worker_servicer(servicer: WorkerServicer, server: grpc.aio.Server) -> None:
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    add_read_kv_handler(server, servicer.ReadKv)


def build_server(
    engine: Engine,
    port: int,
    *,
    host: str = "127.0.0.1",
    worker_id: int = 0,
    defaults: WarmupDefaults | None = None,
    runner: EngineRunner | None = None,
    options: WorkerServerOptions | None = None,
    metrics: WorkerMetrics | None = None,
) -> GrpcServer:
    """An unstarted server with the worker, health and reflection services; port 0 picks one.

    `runner`: one already wrapping `engine` (whoever passes it can read its step counts)."""
    options = options or WorkerServerOptions()
    health_servicer = health.aio.HealthServicer()
    runner = runner or EngineRunner(engine, options.pipeline)
    if runner.engine is not engine:
        raise ValueError("runner wraps a different engine")
    lease = Lease(options.lease_ttl_s)
    servicer = WorkerServicer(
        runner, health_servicer, worker_id, defaults or WarmupDefaults(), lease, metrics, options.peer_security
    )
    return GrpcServer.build(
        SERVICE_NAME,
        lambda server: _add_worker_servicer(servicer, server),
        host,
        port,
        health_servicer=health_servicer,
        security=options.security,
        health_port=options.health_port,
        keepalive=options.keepalive,
    )


async def serve(
    config: EngineConfig,
    port: int,
    *,
    host: str = "127.0.0.1",
    worker_id: int = 0,
    defaults: WarmupDefaults | None = None,
    grace_s: float = 5.0,
    engine_factory: Callable[[EngineConfig], Engine] | None = None,
    options: WorkerServerOptions | None = None,
    metrics_port: int | None = None,
) -> None:
    """Loads the model (or the engine `engine_factory` builds), serves until SIGINT or SIGTERM,
    then shuts down gracefully. Readiness stays NOT_SERVING until a scheduler's Warmup."""
    setup_tracing("sluice-worker")
    engine = await asyncio.to_thread(engine_factory or engine_class("torch"), config)
    info = engine.info
    metrics = None
    if metrics_port is not None:
        metrics = WorkerMetrics(info.model, str(worker_id))
        bound = start_metrics_server(metrics_port, metrics, host)
        print(f"sluice worker {worker_id} metrics on http://{host}:{bound}/metrics", flush=True)
    server = build_server(
        engine, port, host=host, worker_id=worker_id, defaults=defaults, options=options, metrics=metrics
    )
    await server.start(ready=False)
    extra = f"; health on {host}:{server.health_port}" if server.health_port is not None else ""
    print(
        f"sluice worker {worker_id} listening on {host}:{server.port} ({info.model}, {info.dtype}, {info.device}; "
        f"{server.security.describe()}{extra})",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print("sluice worker shutting down", flush=True)
    await server.stop(grace_s)
    shutdown_tracing()
