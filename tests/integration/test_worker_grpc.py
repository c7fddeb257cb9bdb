"""The worker over real gRPC (an in-process aio server on a free port): Info, Warmup and
readiness, step plans that produce exactly the tokens a direct engine produces, malformed
plans answered with a named error while the stream and the other requests carry on,
Release, reflection and graceful shutdown."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from harness import LeasedStub

from sluice.common.grpc_server import CHANNEL_OPTIONS, GrpcServer
from sluice.contract.plan import CachedRequestData, KVMove, KVMoveKind, NewRequestData, StepPlan, StepResult
from sluice.contract.plan_codec import PlanSender, plan_to_proto, result_from_proto
from sluice.contract.sampling import SamplingParams
from sluice.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from worker_service.engine import EngineConfig, LLMEngine
from worker_service.server import SERVICE_NAME, WarmupParams, build_kv_cache, build_server

NUM_GPU_BLOCKS = 32
SWAP_GIB = 0.001  # 65 CPU blocks of the tiny model
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=64, ignore_eos=True)
PROMPT_A = tuple(range(1000, 1040))  # 40 tokens: prefilled in chunks of 16, 16, 8
PROMPT_B = tuple(range(2000, 2010))


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny-llama", load_format="dummy", seed=0))


@pytest.fixture(scope="module")
def reference() -> LLMEngine:
    """A second engine with the same weights, driven directly: the expected tokens."""
    return LLMEngine(EngineConfig(model="tiny-llama", load_format="dummy", seed=0))


class Worker:
    """Client side of one in-process worker server; after `warmup` its stub carries the lease."""

    def __init__(self, channel: grpc.aio.Channel, server: GrpcServer):
        self.raw = worker_pb2_grpc.WorkerServiceStub(channel)
        self.stub: worker_pb2_grpc.WorkerServiceStub | LeasedStub = self.raw
        self.health = health_pb2_grpc.HealthStub(channel)
        self.reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        self.server = server

    async def warmup(self, **fields: float) -> worker_pb2.WarmupResponse:
        request = worker_pb2.WarmupRequest(
            **{"num_gpu_blocks_override": NUM_GPU_BLOCKS, "swap_space_gib": SWAP_GIB, **fields}
        )
        warm = await self.stub.Warmup(request)
        self.stub = LeasedStub(self.raw, warm.session_id)
        return warm

    async def readiness(self, service: str = SERVICE_NAME) -> int:
        return (await self.health.Check(health_pb2.HealthCheckRequest(service=service))).status


@pytest.fixture
async def worker(engine: LLMEngine) -> AsyncIterator[Worker]:
    server = build_server(engine, 0, worker_id=3)
    await server.start(ready=False)
    port = server.port
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as channel:
        yield Worker(channel, server)
    await server.server.stop(None)


class StepStream:
    """One Execute stream: write a plan, read its answer (one step in flight), as the
    scheduler's RemoteWorker does (a PlanSender leaves out repeated scheduled ids)."""

    def __init__(self, stub: worker_pb2_grpc.WorkerServiceStub) -> None:
        self.call = stub.Execute()
        self.sender = PlanSender()
        self.sent: list[worker_pb2.ExecuteRequest] = []
        self.answers: list[worker_pb2.ExecuteResponse] = []

    async def _round_trip(self, msg: worker_pb2.ExecuteRequest) -> worker_pb2.ExecuteResponse:
        self.sent.append(msg)
        await self.call.write(msg)
        response = await self.call.read()
        assert response is not grpc.aio.EOF, "the worker closed the step stream"
        self.answers.append(response)
        return response

    async def send(self, msg: worker_pb2.ExecuteRequest) -> StepResult:
        """A hand-made message; the sender forgets what it sent (the next step lists its ids)."""
        self.sender = PlanSender()
        return result_from_proto(await self._round_trip(msg))

    async def step(self, plan: StepPlan) -> StepResult:
        return self.sender.decode(await self._round_trip(self.sender.encode(plan)), plan)

    async def close(self) -> None:
        await self.call.done_writing()
        assert await self.call.read() is grpc.aio.EOF
        assert await self.call.code() == grpc.StatusCode.OK


def plan(
    step_id: int,
    scheduled: Mapping[str, int],
    sample: Sequence[str] = (),
    new: Sequence[NewRequestData] = (),
    cached: CachedRequestData | None = None,
    moves: Sequence[KVMove] = (),
    release: Sequence[str] = (),
) -> StepPlan:
    return StepPlan(
        step_id=step_id,
        worker_id=3,
        new_requests=tuple(new),
        cached_requests=cached or CachedRequestData(),
        num_scheduled_tokens=dict(scheduled),
        sample_ids=frozenset(sample),
        release_ids=tuple(release),
        kv_moves=tuple(moves),
    )


def new_request(rid: str, prompt: tuple[int, ...], blocks: tuple[int, ...], sampling: SamplingParams) -> NewRequestData:
    return NewRequestData(rid, prompt, len(prompt), sampling, blocks)


def opening_plans() -> list[StepPlan]:
    """Request a (greedy) prefilled in three chunks; b (seeded sampling) joins in step 2."""
    a = new_request("a", PROMPT_A, (0, 1, 2), GREEDY)
    b = new_request("b", PROMPT_B, (4, 5), SEEDED)
    return [
        plan(1, {"a": 16}, new=[a]),
        plan(2, {"a": 16, "b": 10}, sample=["b"], new=[b]),
        plan(3, {"a": 8, "b": 1}, sample=["a", "b"]),
    ]


def decode_plans(first_step: int, count: int, computed_a: int = 40) -> Iterator[StepPlan]:
    """Both decode; a's fourth block arrives (cached diff) when its 48-token table is full."""
    for i in range(count):
        step = first_step + i
        cached = None
        if computed_a + i == 48:
            cached = CachedRequestData(("a",), ((6,),), (False,), (48,))
        yield plan(step, {"a": 1, "b": 1}, sample=["a", "b"], cached=cached)


def swap_plans(first_step: int, computed_b: int) -> list[StepPlan]:
    """b is swapped out (int8) while a decodes alone, then swapped into new blocks and resumed."""
    out = KVMove(KVMoveKind.SWAP_OUT, "b", (4, 5), (10, 11), int8=True)
    back = KVMove(KVMoveKind.SWAP_IN, "b", (10, 11), (8, 9), int8=True)
    resumed = CachedRequestData(("b",), ((8, 9),), (True,), (computed_b,))
    return [
        plan(first_step, {"a": 1}, sample=["a"], moves=[out]),
        plan(first_step + 1, {"a": 1, "b": 1}, sample=["a", "b"], cached=resumed, moves=[back]),
    ]


def warm_reference(reference: LLMEngine) -> None:
    build_kv_cache(reference, WarmupParams(0.9, SWAP_GIB, 2048, NUM_GPU_BLOCKS))


async def test_info_describes_the_engine_before_warmup(worker: Worker, engine: LLMEngine) -> None:
    info = await worker.stub.Info(worker_pb2.InfoRequest())
    assert info.worker_id == "3"
    assert (info.model, info.model_family, info.dtype, info.device) == ("tiny-llama", "llama", "float32", "cpu")
    assert info.block_size == 16
    assert info.vocab_size == engine.info.vocab_size
    assert list(info.eos_token_ids) == list(engine.info.eos_token_ids)
    assert info.capabilities.chunked_prefill and info.capabilities.int8_swap
    assert info.capabilities.role == worker_pb2.WORKER_ROLE_MIXED
    assert not info.warmed_up


async def test_readiness_flips_to_serving_only_after_warmup(worker: Worker, engine: LLMEngine) -> None:
    assert await worker.readiness("") == health_pb2.HealthCheckResponse.SERVING
    assert await worker.readiness() == health_pb2.HealthCheckResponse.NOT_SERVING
    before = await worker.stub.Health(worker_pb2.HealthRequest())
    assert not before.serving and "Warmup" in before.message

    warm = await worker.warmup()

    assert warm.num_gpu_blocks == NUM_GPU_BLOCKS
    assert warm.num_cpu_blocks == int(SWAP_GIB * 2**30) // engine.info.bytes_per_block
    assert (warm.block_size, warm.bytes_per_block) == (16, engine.info.bytes_per_block)
    assert warm.warmup_s > 0
    assert await worker.readiness() == health_pb2.HealthCheckResponse.SERVING
    after = await worker.stub.Health(worker_pb2.HealthRequest())
    assert after.serving and after.num_requests == 0, "the warm-up request is released"
    assert (await worker.stub.Info(worker_pb2.InfoRequest())).warmed_up


async def test_warmup_without_override_measures_capacity(worker: Worker, engine: LLMEngine) -> None:
    warm = await worker.stub.Warmup(
        worker_pb2.WarmupRequest(gpu_memory_utilization=0.005, swap_space_gib=SWAP_GIB, max_num_batched_tokens=256)
    )
    assert warm.session_id and warm.lease_ttl_s > 0
    assert warm.num_gpu_blocks > 0
    assert warm.peak_activation_bytes > 0
    assert engine.cache is not None and engine.cache.num_gpu_blocks == warm.num_gpu_blocks


async def test_warmup_rejects_a_bad_memory_share_naming_the_field(worker: Worker) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await worker.stub.Warmup(worker_pb2.WarmupRequest(gpu_memory_utilization=1.5))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "gpu_memory_utilization" in info.value.details()


async def test_a_step_before_warmup_is_refused_for_want_of_a_lease(worker: Worker) -> None:
    stream = StepStream(worker.stub)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stream.step(opening_plans()[0])
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "Warmup" in info.value.details()


async def test_plans_over_grpc_sample_the_same_tokens_as_the_engine_directly(
    worker: Worker, reference: LLMEngine
) -> None:
    await worker.warmup()
    warm_reference(reference)
    plans = [*opening_plans(), *decode_plans(4, 10), *swap_plans(14, computed_b=21), *decode_plans(16, 3, 52)]
    stream = StepStream(worker.stub)

    for p in plans:
        got = await stream.step(p)
        want = reference.execute(p)
        assert got.error is None, got.error
        assert got.step_id == p.step_id
        assert got.sampled_token_ids == want.sampled_token_ids, f"step {p.step_id}"
        assert got.total_s >= got.forward_s > 0

    assert got.sampled_token_ids.keys() == {"a", "b"}
    # Steady decode steps left their ids out, and every answer came in step order.
    repeated = [m.step_id for m in stream.sent if m.same_scheduled_ids]
    assert repeated == [*range(3, 14), 16, 17, 18]  # step 3 schedules a and b, as step 2 did
    assert all(not m.scheduled_ids for m in stream.sent if m.same_scheduled_ids)
    assert not any(r.sampled_ids for r in stream.answers)
    await stream.close()


async def test_repeated_ids_without_a_previous_step_are_refused_naming_the_field(worker: Worker) -> None:
    await worker.warmup()
    stream = StepStream(worker.stub)
    first, second, third = opening_plans()
    orphan = plan_to_proto(first, same_scheduled_ids=True)
    bad = await stream.send(orphan)
    assert bad.error is not None and bad.error.code == "INVALID_ARGUMENT"
    assert "same_scheduled_ids" in bad.error.message
    for p in (first, second, third):
        assert (await stream.step(p)).error is None, f"step {p.step_id} after the refused one"
    both = plan_to_proto(next(decode_plans(4, 1)), same_scheduled_ids=True)
    both.scheduled_ids.extend(["a", "b"])
    bad = await stream.send(both)
    assert bad.error is not None and "scheduled_ids: must be empty" in bad.error.message
    await stream.close()


async def test_kv_moves_report_swap_bytes(worker: Worker, reference: LLMEngine) -> None:
    await worker.warmup()
    stream = StepStream(worker.stub)
    for p in [*opening_plans(), *decode_plans(4, 2)]:
        await stream.step(p)
    swap_out = await stream.step(swap_plans(6, computed_b=13)[0])
    assert swap_out.error is None
    assert swap_out.swap_bytes > 0 and swap_out.swap_s > 0
    await stream.close()


def malformed_plans() -> list[tuple[str, worker_pb2.ExecuteRequest, str, str, str]]:
    """(what, message, request at fault, text the error must contain, code). A block another
    request holds is ABORTED: the plan is well formed, the states diverged."""
    ghost = plan(90, {"ghost": 1}, sample=["ghost"])
    out_of_range = plan(91, {"c": 4}, sample=["c"], new=[new_request("c", (5, 6, 7, 8), (999,), GREEDY)])
    duplicate = plan(92, {"d": 4}, sample=["d"], new=[new_request("d", (5, 6, 7, 8), (0,), GREEDY)])
    uneven = worker_pb2.ExecuteRequest(step_id=93, scheduled_ids=["a", "b"], num_scheduled_tokens=[1], sample=[1, 1])
    bad_sampling = plan_to_proto(plan(94, {"e": 2}, sample=["e"], new=[new_request("e", (5, 6), (20,), GREEDY)]))
    bad_sampling.new_requests[0].sampling_params.CopyFrom(common_pb2.SamplingParams(top_p=0.0))
    return [
        ("unknown request", plan_to_proto(ghost), "ghost", "unknown", "INVALID_ARGUMENT"),
        ("block id out of range", plan_to_proto(out_of_range), "c", "GPU block 999 out of range", "INVALID_ARGUMENT"),
        ("block owned by another request", plan_to_proto(duplicate), "d", "given to both 'a' and 'd'", "ABORTED"),
        ("uneven columns", uneven, "", "num_scheduled_tokens", "INVALID_ARGUMENT"),
        ("bad sampling parameters", bad_sampling, "", "new_requests[e].sampling_params.top_p", "INVALID_ARGUMENT"),
    ]


async def test_malformed_plans_get_named_errors_and_other_requests_keep_decoding(
    worker: Worker, reference: LLMEngine
) -> None:
    await worker.warmup()
    warm_reference(reference)
    stream = StepStream(worker.stub)
    for p in opening_plans():
        assert (await stream.step(p)).sampled_token_ids == reference.execute(p).sampled_token_ids
    good = decode_plans(4, len(malformed_plans()))

    for what, msg, request_id, text, code in malformed_plans():
        bad = await stream.send(msg)
        assert bad.error is not None, what
        assert bad.error.code == code, what
        assert text in bad.error.message, f"{what}: {bad.error.message}"
        assert bad.error.request_id == request_id, what
        assert bad.step_id == msg.step_id and not bad.sampled_token_ids
        p = next(good)
        assert (await stream.step(p)).sampled_token_ids == reference.execute(p).sampled_token_ids, f"after {what}"

    assert (await worker.stub.Health(worker_pb2.HealthRequest())).num_requests == 2, "nothing half-admitted"
    assert await worker.readiness() == health_pb2.HealthCheckResponse.SERVING
    await stream.close()


async def test_the_stream_survives_a_bad_step(worker: Worker) -> None:
    await worker.warmup()
    stream = StepStream(worker.stub)
    first, second, _ = opening_plans()
    bad = await stream.step(plan(1, {"a": 16}))  # a is not sent as new: unknown to the worker
    assert bad.error is not None and bad.error.request_id == "a"
    ok = await stream.step(first)
    assert ok.error is None and ok.step_id == 1
    assert (await stream.step(second)).sampled_token_ids.keys() == {"b"}
    await stream.close()


async def test_release_forgets_requests_and_frees_their_blocks(worker: Worker) -> None:
    await worker.warmup()
    stream = StepStream(worker.stub)
    for p in opening_plans():
        await stream.step(p)

    released = await worker.stub.Release(worker_pb2.ReleaseRequest(request_ids=["a", "never-seen"]))

    assert list(released.released_ids) == ["a"]
    assert (await worker.stub.Health(worker_pb2.HealthRequest())).num_requests == 1
    gone = await stream.step(plan(4, {"a": 1}, sample=["a"]))
    assert gone.error is not None and gone.error.request_id == "a"
    reuse = await stream.step(plan(5, {"c": 4}, sample=["c"], new=[new_request("c", (5, 6, 7, 8), (0,), GREEDY)]))
    assert reuse.error is None and reuse.sampled_token_ids.keys() == {"c"}, "a's blocks are free again"
    await stream.close()


async def test_release_ids_in_a_plan_free_blocks_for_the_same_step(worker: Worker) -> None:
    await worker.warmup()
    stream = StepStream(worker.stub)
    for p in opening_plans():
        await stream.step(p)
    takeover = plan(4, {"c": 4}, sample=["c"], new=[new_request("c", (5, 6, 7, 8), (0,), GREEDY)], release=["a"])
    result = await stream.step(takeover)
    assert result.error is None and result.sampled_token_ids.keys() == {"c"}
    await stream.close()


async def test_reflection_lists_the_worker_and_health_services(worker: Worker) -> None:
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    call = worker.reflection.ServerReflectionInfo(iter([request]))
    response = await call.read()
    names = {s.name for s in response.list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names


async def test_graceful_shutdown_reports_not_serving_then_stops(worker: Worker) -> None:
    await worker.warmup()
    await worker.server.health.enter_graceful_shutdown()
    assert await worker.readiness() == health_pb2.HealthCheckResponse.NOT_SERVING
    assert await worker.readiness("") == health_pb2.HealthCheckResponse.NOT_SERVING
    await worker.server.stop(grace_s=0.5, drain_s=0.0)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await worker.stub.Info(worker_pb2.InfoRequest(), timeout=2)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_an_engine_that_fails_mid_step_turns_not_serving_and_says_why() -> None:
    """Fault injection on a dedicated engine: its model is gone after Warmup, so the next
    forward raises inside the engine, as a device error would."""
    broken = LLMEngine(EngineConfig(model="tiny-llama", load_format="dummy", seed=0))
    server = build_server(broken, 0)
    await server.start(ready=False)
    port = server.port
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as channel:
        worker = Worker(channel, server)
        await worker.warmup()
        broken.model = None
        stream = StepStream(worker.stub)

        failed = await stream.step(opening_plans()[0])
        after = await stream.step(opening_plans()[1])

        assert failed.error is not None and failed.error.code == "INTERNAL"
        assert "step 1" in failed.error.message and "TypeError" in failed.error.message
        assert after.error is not None and after.error.code == "UNAVAILABLE"
        assert "engine failed" in after.error.message
        assert await worker.readiness() == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await worker.readiness("") == health_pb2.HealthCheckResponse.NOT_SERVING
        status = await worker.stub.Health(worker_pb2.HealthRequest())
        assert not status.serving and "TypeError" in status.message
        await stream.close()
    await server.server.stop(None)


async def test_plans_sent_ahead_run_in_order_and_one_after_a_failed_step_is_void(
    worker: Worker, reference: LLMEngine
) -> None:
    """Overlapped scheduling: plan N+1 is on the stream before the answer to N is read; when
    N fails, N+1 (planned on N's outcome) is answered CANCELLED and nothing of it runs."""
    from dataclasses import replace

    await worker.warmup()
    warm_reference(reference)
    call = worker.stub.Execute()
    sender = PlanSender()
    first, second, third = opening_plans()
    pipelined = [first, replace(second, follows_step_id=1), replace(third, follows_step_id=2)]
    for p in pipelined:
        await call.write(sender.encode(p))
    for p in pipelined:
        answer = sender.decode(await call.read(), p)
        assert answer.sampled_token_ids == reference.execute(p).sampled_token_ids

    bad = plan(4, {"zz": 1}, sample=["zz"])  # unknown request: the step fails, nothing changes
    after_bad = replace(next(decode_plans(5, 1)), follows_step_id=4)
    independent = next(decode_plans(5, 1))  # the same decode, planned after the failure was known
    independent = replace(independent, step_id=6)
    for p in (bad, after_bad, independent):
        await call.write(sender.encode(p))
    failed = sender.decode(await call.read(), bad)
    assert failed.error is not None and failed.error.code == "INVALID_ARGUMENT"
    void = sender.decode(await call.read(), after_bad)
    assert void.error is not None and void.error.code == "CANCELLED" and "void" in void.error.message
    ran = sender.decode(await call.read(), independent)
    assert ran.error is None
    # the void step did not advance a or b: the next decode is the reference's fifth step
    assert ran.sampled_token_ids == reference.execute(replace(independent, step_id=5)).sampled_token_ids
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF


async def test_a_step_planned_ahead_leaves_out_a_request_its_predecessor_finished(worker: Worker) -> None:
    """c reaches max_tokens (1) in step 1; step 2 was planned before the scheduler knew, so it
    still schedules c: the worker leaves c out and answers a's token only, naming it by id."""
    from dataclasses import replace

    await worker.warmup()
    stream = StepStream(worker.stub)
    short = SamplingParams(temperature=0.0, max_tokens=1)
    a = new_request("a", PROMPT_B, (0,), GREEDY)
    c = new_request("c", PROMPT_B, (1,), short)
    first = await stream.step(plan(1, {"a": 10, "c": 10}, sample=["a", "c"], new=[a, c]))
    assert first.sampled_token_ids.keys() == {"a", "c"}
    ahead = replace(plan(2, {"a": 1, "c": 1}, sample=["a", "c"]), follows_step_id=1)
    second = await stream.step(ahead)
    assert second.error is None
    assert second.sampled_token_ids.keys() == {"a"}, "c finished at step 1: no extra token computed"
    # the scheduler then releases c, and a goes on
    third = await stream.step(plan(3, {"a": 1}, sample=["a"], release=["c"]))
    assert third.sampled_token_ids.keys() == {"a"}
    assert (await worker.stub.Health(worker_pb2.HealthRequest())).num_requests == 1
    await stream.close()
