"""RemoteWorker: the live executor, one worker over gRPC (the simulator's is SimulatedExecutor).

    connect():      Info (model, limits, EOS) -> Warmup (KV capacity in blocks; the worker's
                    lease: a session id) -> Health -> open the Execute stream with the session
    execute(plan):  PlanSender.encode -> stream.write -> stream.read (step timeout) -> PlanSender.decode
    send(plan) / receive():  the same, split: overlap writes plan N+1 before reading answer N
    probe():        Health with the session (renews the lease; says whether we still hold it)
    close():        cancel the stream, close the channel

One step is in flight per stream, answered in order. A transport error, a closed stream, a
step timeout, an undecodable answer or an engine that reports itself unusable raises
`WorkerLost`; a step the worker refuses because its state diverged from ours (ABORTED: e.g. a
foreign client's blocks) raises `WorkerDiverged`. The live loop then warms the worker up
again at once with the session it holds (Warmup wipes whatever the worker held, so both sides
start from empty), and only when that fails marks the worker down.

Every call carries the scheduler's credentials (ClientSecurity: TLS, mutual when configured,
and the workers' API key) and, after Warmup, the `x-sluice-session` metadata.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from scheduler_service.costmodel.base import HardwareSpec
from scheduler_service.costmodel.presets import HARDWARE_PRESETS
from sluice.common.grpc_server import CHANNEL_OPTIONS
from sluice.common.security import PLAINTEXT, ClientSecurity, explain_unavailable
from sluice.contract.plan import StepPlan, StepResult
from sluice.contract.plan_codec import PlanSender
from sluice.contract.profile import ModelSpec
from sluice.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

# Step errors after which the worker's engine cannot go on (the worker's server answers
# every later step the same way); a plan error (INVALID_ARGUMENT) is the core's to handle.
FATAL_STEP_CODES = frozenset({"UNAVAILABLE", "INTERNAL", "FAILED_PRECONDITION"})


SESSION_KEY = "x-sluice-session"  # the worker's lease (worker_service/lease.py)


HOLDER_KEY = "x-sluice-scheduler"  # our name, sent with Warmup (the worker's lease records it)
LEASE_LEFT_KEY = "x-sluice-lease-left-s"  # a refused Warmup's trailing metadata
LEASE_RECHECK_S = 6.0  # a live holder renews at least every lease_ttl_s / 4 (5 s at the default 20 s)


class WorkerLost(Exception):
    """The worker cannot execute steps on this session any more; `code` is the gRPC status
    name when the worker answered one (FAILED_PRECONDITION: leased to another scheduler);
    `lease_left_s` how long that lease lives unless renewed (when the worker said)."""

    def __init__(self, message: str, code: str = "", lease_left_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.lease_left_s = lease_left_s


class LeaseHeld(WorkerLost):
    """The worker is leased to a scheduler that is alive (it renewed the lease while we waited),
    or whose lease outlasts our connect timeout: a rival, not our own previous incarnation."""


class WorkerDiverged(WorkerLost):
    """The worker refused a step because it holds state our plans do not account for."""

    def __init__(self, message: str, result: StepResult) -> None:
        super().__init__(message, "ABORTED")
        self.result = result


class TransferFailed(Exception):
    """A KV transfer call failed (the worker refused it, did not answer, or is not connected);
    the request's prefill is then recomputed on the decode side."""


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
    model_spec: ModelSpec  # the model's dimensions, for the cost model
    hardware: HardwareSpec  # the worker's device (a preset it recognised, else what it measured)
    int8_swap: bool = False  # the worker can int8-compress swapped KV
    lease_ttl_s: float = 0.0  # the worker's lease lapses this long after our last call (0: no lease)


@dataclass(frozen=True, slots=True)
class WarmupOptions:
    num_gpu_blocks: int | None = None
    swap_space_gib: float | None = None  # None: the worker's own
    gpu_memory_utilization: float | None = None  # None: the worker's own
    max_num_batched_tokens: int = 0
    max_num_seqs: int = 0

    def to_proto(self) -> worker_pb2.WarmupRequest:
        return worker_pb2.WarmupRequest(
            # NOTE: 0 in the message is "not set": the worker uses its own
            gpu_memory_utilization=self.gpu_memory_utilization or 0.0,
            swap_space_gib=self.swap_space_gib or 0.0,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            num_gpu_blocks_override=self.num_gpu_blocks,
        )


_ROLES = {worker_pb2.WORKER_ROLE_PREFILL: "prefill", worker_pb2.WORKER_ROLE_DECODE: "decode"}


class RemoteWorker:
    def __init__(
        self,
        worker_id: int,
        address: str,
        step_timeout_s: float,
        *,
        security: ClientSecurity = PLAINTEXT,
        channel_options: tuple[tuple[str, int], ...] = CHANNEL_OPTIONS,
        holder: str = "",
        on_wait: Callable[[str], None] | None = None,
    ) -> None:
        """`holder`: our name for the worker's lease (host:port we serve on); `on_wait` hears
        what a start waits for (the lease of a worker, and for how long)."""
        self.worker_id = worker_id
        self.holder = holder
        self.on_wait = on_wait
        self.address = address
        self.step_timeout_s = step_timeout_s
        self.security = security
        self.channel_options = channel_options
        self.session: str | None = None  # the lease's session id, once Warmup granted one
        self._channel: grpc.aio.Channel | None = None
        self._call: grpc.aio.StreamStreamCall | None = None
        self._sender = PlanSender()
        self._sent: deque[StepPlan] = deque()  # plans on the stream not answered yet, oldest first

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        session = ((SESSION_KEY, self.session),) if self.session else ()
        return (*self.security.metadata, *session)

    async def connect(self, options: WarmupOptions, timeout_s: float, *, wait: bool = True) -> WorkerCapacity:
        """Dials the worker, warms it up (its KV cache is rebuilt empty; the lease is ours, or
        renewed with a new session when we held it) and opens the step stream.

        `wait`: wait up to timeout_s for the worker to come up (start-up); a reconnect
        attempt instead fails fast and the loop's own backoff decides when to try again."""
        await self.close()
        self._channel = self.security.channel(self.address, self.channel_options)
        stub = worker_pb2_grpc.WorkerServiceStub(self._channel)
        try:
            info = await stub.Info(
                worker_pb2.InfoRequest(), timeout=timeout_s, wait_for_ready=wait, metadata=self.security.metadata
            )
            warmup = options.to_proto()
            # NOTE: the session keeps the role the worker announced (its --role, or the role of
            # our own session when we warm it up again), so Info says the same while we hold it.
            warmup.role = info.capabilities.role
            holder = ((HOLDER_KEY, self.holder),) if self.holder else ()
            warm = await stub.Warmup(warmup, timeout=timeout_s, metadata=(*self.metadata, *holder))
            self.session = warm.session_id or None
            health = await stub.Health(worker_pb2.HealthRequest(), timeout=timeout_s, metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            await self.close()
            code, details = exc.code().name, exc.details() or ""
            if code == "UNAVAILABLE":
                details = explain_unavailable(details, self.security)
            raise WorkerLost(f"worker {self.address}: {code}: {details}", code, _lease_left(exc)) from exc
        if not health.serving:
            await self.close()
            raise WorkerLost(f"worker {self.address} is not serving after warmup: {health.message}")
        self._call = stub.Execute(metadata=self.metadata)
        self._sender = PlanSender()
        self._sent.clear()
        return capacity_from_proto(info, warm)

    async def connect_patiently(self, options: WarmupOptions, timeout_s: float) -> WorkerCapacity:
        """`connect`, retried while the worker is leased to a scheduler that has stopped calling
        (e.g. our own previous incarnation on another port), up to timeout_s in all: it says
        in the log what it waits for and how long, and takes the worker the moment the lease
        lapses. A holder that renews the lease meanwhile is alive: LeaseHeld at once (one line
        naming the worker and the lease's time left), as when the lease outlasts timeout_s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        expires: float | None = None  # when the lease we wait for lapses, as the worker last said
        while True:
            try:
                return await self.connect(options, max(0.1, deadline - loop.time()))
            except LeaseHeld:
                raise
            except WorkerLost as exc:
                if exc.code != "FAILED_PRECONDITION":
                    raise
                left = exc.lease_left_s
                if left is None:  # NOTE: a worker that does not say: poll, as before
                    if loop.time() + 1.0 > deadline:
                        raise
                    await asyncio.sleep(1.0)
                    continue
                now = loop.time()
                renewed = expires is not None and now + left > expires + 0.5
                if renewed or now + left > deadline:
                    why = (
                        "its holder renewed it while we waited"
                        if renewed
                        else f"beyond connect_timeout_s {timeout_s:g}"
                    )
                    raise LeaseHeld(f"{exc} [{why}]", exc.code, left) from None
                if expires is None:
                    what = f"the lease of worker {self.address} to lapse (in {left:.1f} s)"
                    log.warning("waiting for %s: %s", what, exc)
                    if self.on_wait is not None:
                        self.on_wait(what)
                expires = now + left
                await asyncio.sleep(min(left + 0.05, LEASE_RECHECK_S))

    async def execute(self, plan: StepPlan) -> StepResult:
        if self._call is None:
            raise WorkerLost(f"worker {self.address} is not connected")
        try:
            # NOTE: one deadline for the round trip, without wait_for's extra task per await
            # (cheaper per step, and it cannot swallow a cancellation).
            async with asyncio.timeout(self.step_timeout_s):
                await self._call.write(self._sender.encode(plan))
                response = await self._call.read()
        except STREAM_FAILURES as exc:
            raise self._lost(exc, f"step {plan.step_id} took over {self.step_timeout_s} s") from exc
        return await self._result(response, plan)

    # Overlapped scheduling: `send` puts a plan on the stream without waiting for its answer,
    # so the next plan can follow while the worker runs this one; `receive` reads the oldest
    # answer (the stream answers in order).
    @property
    def num_in_flight(self) -> int:
        return len(self._sent)

    async def send(self, plan: StepPlan) -> None:
        if self._call is None:
            raise WorkerLost(f"worker {self.address} is not connected")
        try:
            async with asyncio.timeout(self.step_timeout_s):
                await self._call.write(self._sender.encode(plan))
        except STREAM_FAILURES as exc:
            raise self._lost(exc, f"step {plan.step_id} could not be sent in time") from exc
        self._sent.append(plan)

    async def receive(self) -> StepResult:
        """The answer to the oldest plan sent; the step timeout counts from now, and the worker
        runs at most two steps of ours in that time."""
        if self._call is None or not self._sent:
            raise WorkerLost(f"worker {self.address}: no step in flight to answer")
        plan = self._sent.popleft()
        try:
            async with asyncio.timeout(self.step_timeout_s):
                response = await self._call.read()
        except STREAM_FAILURES as exc:
            raise self._lost(exc, f"step {plan.step_id} took over {self.step_timeout_s} s") from exc
        return await self._result(response, plan)

    def _lost(self, exc: BaseException, late: str) -> WorkerLost:
        """What a failed operation on the step stream means: the worker is lost (`late`: what a
        missed deadline says). A cancellation of our own task is re-raised, not translated."""
        if isinstance(exc, TimeoutError):
            return WorkerLost(f"worker {self.address}: {late}")
        if isinstance(exc, asyncio.CancelledError):
            _raise_if_we_are_cancelled()
            return WorkerLost(f"worker {self.address}: the step stream was cancelled")
        return WorkerLost(f"worker {self.address}: step stream failed: {_describe(exc)}")

    async def _result(self, response: object, plan: StepPlan) -> StepResult:
        if response is grpc.aio.EOF:
            raise WorkerLost(f"worker {self.address} closed the step stream: {await self._ending()}")
        try:
            result = self._sender.decode(response, plan)  # type: ignore[arg-type]
        except ValueError as exc:
            why = f"answered step {plan.step_id} with a malformed result: {exc}"
            raise WorkerLost(f"worker {self.address} {why}") from exc
        if result.error is not None:
            if result.error.code == "ABORTED":
                raise WorkerDiverged(f"worker {self.address}: state diverged: {result.error.message}", result)
            if result.error.code in FATAL_STEP_CODES:
                raise WorkerLost(f"worker {self.address}: {result.error.code}: {result.error.message}")
        return result

    async def _ending(self) -> str:
        call = self._call
        if call is None:
            return "no stream"
        try:
            return f"{(await call.code()).name}: {await call.details()}"
        except (grpc.RpcError, grpc.aio.BaseError, asyncio.CancelledError):
            return "unknown status"

    async def probe(self, timeout_s: float) -> None:
        """Health with the session: renews the lease. WorkerLost when the worker does not
        answer, stopped serving, our lease is gone (the worker restarted, or another
        scheduler took it) or our step stream has ended."""
        if self._channel is None or self._call is None:
            raise WorkerLost(f"worker {self.address} is not connected")
        if self._call.done():
            raise WorkerLost(f"worker {self.address}: the step stream ended: {await self._ending()}")
        stub = worker_pb2_grpc.WorkerServiceStub(self._channel)
        try:
            health = await stub.Health(worker_pb2.HealthRequest(), timeout=timeout_s, metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            raise WorkerLost(f"worker {self.address}: probe failed: {exc.code().name}: {exc.details()}") from exc
        if not health.serving:
            raise WorkerLost(f"worker {self.address} stopped serving: {health.message}")
        if self.session and not health.lease_holder:
            raise WorkerLost(f"worker {self.address}: our lease is gone (the worker restarted or was taken over)")

    # Disaggregated prefill and decode: the KV transfer calls (worker_service/kv_transfer.py), on
    # the channel of the step stream and with its session; live/transfers.py drives them.
    async def offer_kv(self, request: worker_pb2.OfferKvRequest, timeout_s: float) -> worker_pb2.OfferKvResponse:
        """OfferKv on this (prefill) worker: the one-time token of the blocks' KV."""
        return await self._unary("OfferKv", request, timeout_s)

    async def pull_kv(self, request: worker_pb2.PullKvRequest, timeout_s: float) -> worker_pb2.PullKvResponse:
        """PullKv on this (decode) worker: it reads the offered KV from its peer into its blocks."""
        return await self._unary("PullKv", request, timeout_s)

    async def _unary(self, method: str, request: object, timeout_s: float) -> object:
        if self._channel is None:
            raise TransferFailed(f"worker {self.address} is not connected")
        rpc = getattr(worker_pb2_grpc.WorkerServiceStub(self._channel), method)
        try:
            return await rpc(request, timeout=timeout_s, metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            raise TransferFailed(f"worker {self.address}: {method}: {exc.code().name}: {exc.details()}") from exc
        except asyncio.CancelledError as exc:
            _raise_if_we_are_cancelled()  # else the call was cancelled under us: the channel closed
            raise TransferFailed(f"worker {self.address}: {method} was cancelled (the channel closed)") from exc
        except (grpc.RpcError, grpc.aio.BaseError, asyncio.InvalidStateError) as exc:
            raise TransferFailed(f"worker {self.address}: {method}: {_describe(exc)}") from exc

    async def end_lease(self, timeout_s: float = 1.0) -> None:
        """Gives the worker's lease up (at shutdown), so another scheduler need not wait for it
        to lapse; a worker that does not answer keeps it until then."""
        if self._channel is None or not self.session:
            return
        stub = worker_pb2_grpc.WorkerServiceStub(self._channel)
        with contextlib.suppress(grpc.aio.AioRpcError):
            await stub.Release(worker_pb2.ReleaseRequest(end_lease=True), timeout=timeout_s, metadata=self.metadata)
        self.session = None

    async def close(self) -> None:
        self._sent.clear()
        call, self._call = self._call, None
        channel, self._channel = self._channel, None
        if call is not None:
            call.cancel()
        if channel is not None:
            await channel.close(grace=None)


def capacity_from_proto(info: worker_pb2.InfoResponse, warm: worker_pb2.WarmupResponse) -> WorkerCapacity:
    return WorkerCapacity(
        model=info.model,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        eos_token_ids=tuple(info.eos_token_ids),
        block_size=warm.block_size,
        num_gpu_blocks=warm.num_gpu_blocks,
        num_cpu_blocks=warm.num_cpu_blocks,
        role=_ROLES.get(info.capabilities.role, "mixed"),
        model_spec=model_spec_from_proto(info),
        hardware=hardware_from_proto(info.hardware),
        int8_swap=info.capabilities.int8_swap,
        lease_ttl_s=warm.lease_ttl_s,
    )


def model_spec_from_proto(info: worker_pb2.InfoResponse) -> ModelSpec:
    dims = info.model_dimensions
    return ModelSpec(
        name=info.model,
        num_layers=dims.num_layers,
        hidden_size=dims.hidden_size,
        num_heads=dims.num_heads,
        num_kv_heads=dims.num_kv_heads,
        intermediate_size=dims.intermediate_size,
        vocab_size=info.vocab_size,
        max_model_len=info.max_model_len,
        gated_mlp=dims.gated_mlp,
        dtype_bytes=dims.dtype_bytes or 2,
    )


def hardware_from_proto(hw: worker_pb2.HardwareDescription) -> HardwareSpec:
    """The preset the worker recognised, else the figures it measured on its device."""
    if hw.preset in HARDWARE_PRESETS:
        return HARDWARE_PRESETS[hw.preset]
    name = hw.name or "unknown device"
    return HardwareSpec(name, hw.peak_flops, hw.memory_bandwidth, hw.memory_bytes, hw.host_link_bandwidth)


# Failures of a read or write on the step stream (RemoteWorker._lost says what each means).
STREAM_FAILURES = (TimeoutError, grpc.RpcError, grpc.aio.BaseError, asyncio.InvalidStateError, asyncio.CancelledError)


def _raise_if_we_are_cancelled() -> None:
    """A CancelledError out of a stream read is the stream's (cancelled under us: the worker is
    lost for this session) unless our own task is being cancelled, which must go on."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def _lease_left(exc: grpc.aio.AioRpcError) -> float | None:
    for key, value in exc.trailing_metadata() or ():
        if key == LEASE_LEFT_KEY:
            try:
                return float(value)
            except ValueError:
                return None
    return None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"
