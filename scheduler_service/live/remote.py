"""RemoteWorker: the live executor, one worker over gRPC (the simulator's is SimulatedExecutor).

    connect():      Info (model, limits, EOS) -> Warmup (KV capacity in blocks) -> Health
                    -> open the Execute stream
    execute(plan):  PlanSender.encode -> stream.write -> stream.read (step timeout) -> PlanSender.decode
    close():        cancel the stream, close the channel

One step is in flight per stream, answered in order. A transport error, a closed stream, a
step timeout, an undecodable answer or an engine that reports itself unusable raises
`WorkerLost`; the live loop then marks the worker down and dials it again later with a new
session (Warmup wipes whatever the worker held, so both sides start from empty).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc

from scheduler_service.core.plan import StepPlan, StepResult
from scheduler_service.plan_codec import CHANNEL_OPTIONS, PlanSender
from sluice.v1 import worker_pb2, worker_pb2_grpc

# Step errors after which the worker's engine cannot go on (the worker's server answers
# every later step the same way); a plan error (INVALID_ARGUMENT) is the core's to handle.
FATAL_STEP_CODES = frozenset({"UNAVAILABLE", "INTERNAL", "FAILED_PRECONDITION"})


class WorkerLost(Exception):
    """The worker cannot execute steps on this session any more."""


@dataclass(frozen=True, slots=True)
class WorkerCapacity:
    """What Info and Warmup told us; fixed for the worker's KVCacheManager."""

    model: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    role: str


@dataclass(frozen=True, slots=True)
class WarmupOptions:
    num_gpu_blocks: int | None = None
    swap_space_gib: float = 0.0
    gpu_memory_utilization: float = 0.0
    max_num_batched_tokens: int = 0
    max_num_seqs: int = 0

    def to_proto(self) -> worker_pb2.WarmupRequest:
        return worker_pb2.WarmupRequest(
            gpu_memory_utilization=self.gpu_memory_utilization,
            swap_space_gib=self.swap_space_gib,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            num_gpu_blocks_override=self.num_gpu_blocks,
        )


_ROLES = {worker_pb2.WORKER_ROLE_PREFILL: "prefill", worker_pb2.WORKER_ROLE_DECODE: "decode"}


class RemoteWorker:
    def __init__(self, worker_id: int, address: str, step_timeout_s: float) -> None:
        self.worker_id = worker_id
        self.address = address
        self.step_timeout_s = step_timeout_s
        self._channel: grpc.aio.Channel | None = None
        self._call: grpc.aio.StreamStreamCall | None = None
        self._sender = PlanSender()

    async def connect(self, options: WarmupOptions, timeout_s: float, *, wait: bool = True) -> WorkerCapacity:
        """Dials the worker, warms it up (its KV cache is rebuilt empty) and opens the step stream.

        `wait`: wait up to timeout_s for the worker to come up (start-up); a reconnect
        attempt instead fails fast and the loop's own backoff decides when to try again."""
        await self.close()
        self._channel = grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        stub = worker_pb2_grpc.WorkerServiceStub(self._channel)
        try:
            info = await stub.Info(worker_pb2.InfoRequest(), timeout=timeout_s, wait_for_ready=wait)
            warm = await stub.Warmup(options.to_proto(), timeout=timeout_s)
            health = await stub.Health(worker_pb2.HealthRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            await self.close()
            raise WorkerLost(f"worker {self.address}: {exc.code().name}: {exc.details()}") from exc
        if not health.serving:
            await self.close()
            raise WorkerLost(f"worker {self.address} is not serving after warmup: {health.message}")
        self._call = stub.Execute()
        self._sender = PlanSender()
        return WorkerCapacity(
            model=info.model,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            eos_token_ids=tuple(info.eos_token_ids),
            block_size=warm.block_size,
            num_gpu_blocks=warm.num_gpu_blocks,
            num_cpu_blocks=warm.num_cpu_blocks,
            role=_ROLES.get(info.capabilities.role, "mixed"),
        )

    async def execute(self, plan: StepPlan) -> StepResult:
        if self._call is None:
            raise WorkerLost(f"worker {self.address} is not connected")
        try:
            # NOTE: one deadline for the round trip, without wait_for's extra task per await
            # (cheaper per step, and it cannot swallow a cancellation).
            async with asyncio.timeout(self.step_timeout_s):
                await self._call.write(self._sender.encode(plan))
                response = await self._call.read()
        except TimeoutError as exc:
            raise WorkerLost(f"worker {self.address}: step {plan.step_id} took over {self.step_timeout_s} s") from exc
        except (grpc.RpcError, grpc.aio.BaseError, asyncio.InvalidStateError) as exc:
            raise WorkerLost(f"worker {self.address}: step stream failed: {_describe(exc)}") from exc
        if response is grpc.aio.EOF:
            raise WorkerLost(f"worker {self.address} closed the step stream")
        try:
            result = self._sender.decode(response, plan)
        except ValueError as exc:
            why = f"answered step {plan.step_id} with a malformed result: {exc}"
            raise WorkerLost(f"worker {self.address} {why}") from exc
        if result.error is not None and result.error.code in FATAL_STEP_CODES:
            raise WorkerLost(f"worker {self.address}: {result.error.code}: {result.error.message}")
        return result

    async def close(self) -> None:
        call, self._call = self._call, None
        channel, self._channel = self._channel, None
        if call is not None:
            call.cancel()
        if channel is not None:
            await channel.close(grace=None)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"
