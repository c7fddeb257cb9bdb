"""The live scheduler over real gRPC: in-process workers (tiny-llama, dummy weights) and an
in-process scheduler server, driven through GenerationService like any client.

Token streams are checked against a standalone LLMEngine running each prompt alone
(greedy), KV leaks through GetStats and the workers' own Health, backpressure through the
RetryInfo detail, and failover by stopping a worker's server mid-run.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
import pytest
import torch
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from scheduler_service.live.config import LiveConfig
from scheduler_service.live.service import LiveScheduler
from scheduler_service.server import SERVICE_NAME, SchedulerServer
from sluice.common.grpc_server import CHANNEL_OPTIONS
from sluice.common.paths import data_file, open_text
from sluice.common.tokenizer import Tokenizer
from sluice.contract.plan import CachedRequestData, NewRequestData, StepPlan
from sluice.contract.sampling import SamplingParams
from sluice.v1 import common_pb2, generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from worker_service.engine import EngineConfig, LLMEngine
from worker_service.server import build_server as build_worker_server

# NOTE: several engines share two cores with other jobs; one intra-op thread each avoids
# OpenMP barrier stalls that make steps many times slower.
torch.set_num_threads(1)

BLOCK = 16
GREEDY = common_pb2.SamplingParams(temperature=0.0)


def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny-llama", load_format="dummy", seed=0))


@dataclass
class Worker:
    engine: LLMEngine
    server: grpc.aio.Server
    port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def held_requests(self) -> int:
        async with grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS) as channel:
            health_reply = await worker_pb2_grpc.WorkerServiceStub(channel).Health(worker_pb2.HealthRequest())
        return health_reply.num_requests


async def start_worker(worker_id: int, port: int = 0, eng: LLMEngine | None = None) -> Worker:
    eng = eng or engine()
    server = build_worker_server(eng, port, worker_id=worker_id)
    await server.start(ready=False)
    bound = server.port
    return Worker(eng, server.server, bound)


@pytest.fixture(scope="module")
async def workers() -> AsyncIterator[list[Worker]]:
    ws = [await start_worker(0), await start_worker(1)]
    yield ws
    for w in ws:
        await w.server.stop(None)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.demo()


@pytest.fixture(scope="module")
def prompts(tokenizer: Tokenizer) -> list[str]:
    """Real instructions (CodeAlpaca), short and long."""
    with open_text(data_file("prompts/codealpaca_code_alpaca_2k.json")) as f:
        rows = json.load(f)
    texts = [f"{r['instruction']} {r['input']}".strip() for r in rows[:200]]
    return [t for t in texts if 4 <= len(tokenizer.encode(t)) <= 120][:50]


@pytest.fixture(scope="module")
def reference() -> LLMEngine:
    eng = engine()
    eng.init_kv_cache(64, 0)
    return eng


def run_alone(eng: LLMEngine, prompt: Sequence[int], max_tokens: int) -> list[int]:
    """The engine with nothing else in its batch: the tokens a request must get (greedy)."""
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    blocks = tuple(range(math.ceil((len(prompt) + max_tokens) / BLOCK)))
    new = NewRequestData("ref", tuple(prompt), len(prompt), sampling, blocks)
    out: list[int] = []
    computed, step = 0, 0
    while True:
        step += 1
        first = step == 1
        n = len(prompt) if first else 1
        cached = CachedRequestData() if first else CachedRequestData(("ref",), ((),), (False,), (computed,))
        plan = StepPlan(step, 0, (new,) if first else (), cached, {"ref": n}, frozenset({"ref"}))
        token = eng.execute(plan).sampled_token_ids["ref"]
        computed += n
        out.append(token)
        if token in eng.eos_token_ids or len(out) >= max_tokens:
            eng.release(["ref"])
            return out


class Client:
    def __init__(self, channel: grpc.aio.Channel, server: SchedulerServer) -> None:
        self.stub = generation_pb2_grpc.GenerationServiceStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)
        self.reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        self.server = server

    async def generate(self, **fields) -> list[generation_pb2.GenerateResponse]:
        return [m async for m in self.stub.Generate(generation_pb2.GenerateRequest(**fields))]

    async def stats(self) -> generation_pb2.GetStatsResponse:
        return await self.stub.GetStats(generation_pb2.GetStatsRequest())

    async def wait_until_idle(self, timeout_s: float = 10.0) -> generation_pb2.GetStatsResponse:
        """Until no request is held and no KV block is owned, on the scheduler's books."""
        for _ in range(int(timeout_s / 0.02)):
            stats = await self.stats()
            used = sum(w.gpu_blocks_used + w.cpu_blocks_used for w in stats.workers)
            if used == 0 and stats.num_running == stats.num_waiting == stats.num_swapped == 0:
                return stats
            await asyncio.sleep(0.02)
        raise AssertionError(f"KV or requests still held: {stats}")


@asynccontextmanager
async def scheduler(addresses: Sequence[str], **config) -> AsyncIterator[Client]:
    cfg = LiveConfig(**{"num_gpu_blocks": 64, "swap_space_gib": 0.001, **config})
    server = await SchedulerServer.start(LiveScheduler(addresses, cfg))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield Client(channel, server)
    finally:
        await server.stop(grace_s=1.0, drain_s=0.0)


def text_of(messages: Sequence[generation_pb2.GenerateResponse]) -> str:
    return "".join(m.text for m in messages)


def ids_of(messages: Sequence[generation_pb2.GenerateResponse]) -> list[int]:
    return [t for m in messages for t in m.token_ids]


async def read_rest(call: grpc.aio.UnaryStreamCall) -> list[generation_pb2.GenerateResponse]:
    out = []
    while (message := await call.read()) is not grpc.aio.EOF:
        out.append(message)
    return out


def slo_for(i: int) -> common_pb2.SloSpec:
    """Mixed classes: tight online, relaxed online, offline with a deadline, none."""
    kinds = (
        common_pb2.SloSpec(ttft_ms=500, tbt_ms=100, slo_class=common_pb2.SLO_CLASS_ONLINE),
        common_pb2.SloSpec(ttft_ms=5000, tbt_ms=1000),
        common_pb2.SloSpec(jct_ms=20000, slo_class=common_pb2.SLO_CLASS_OFFLINE),
        common_pb2.SloSpec(),
    )
    return kinds[i % len(kinds)]


# ---------------------------------------------------------------- generation


@pytest.mark.parametrize("policy", ["vllm", "sarathi:budget=64"])
async def test_fifty_concurrent_streams_get_exactly_the_tokens_of_the_engine_alone(
    policy: str, workers: list[Worker], prompts: list[str], tokenizer: Tokenizer, reference: LLMEngine
) -> None:
    max_tokens = [4 + (i * 7) % 21 for i in range(len(prompts))]
    expected = [run_alone(reference, tokenizer.encode(p), n) for p, n in zip(prompts, max_tokens, strict=True)]
    # NOTE: admission off: this checks every stream's tokens under concurrency; SLO-aware
    # admission would (rightly) refuse part of a burst of 50 on two CPU workers
    async with scheduler([w.address for w in workers], policy=policy, admission="off") as client:
        results = await asyncio.gather(
            *(
                client.generate(
                    request_id=f"r{i}",
                    text=p,
                    sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=n),
                    slo=slo_for(i),
                    priority=i % 3,
                )
                for i, (p, n) in enumerate(zip(prompts, max_tokens, strict=True))
            )
        )
        stats = await client.wait_until_idle()

    for i, messages in enumerate(results):
        final = messages[-1]
        assert all(m.request_id == f"r{i}" for m in messages)
        assert ids_of(messages) == expected[i], f"request {i} diverged from the engine alone"
        prompt_ids = tokenizer.encode(prompts[i])
        whole, head = tokenizer.decode(prompt_ids + expected[i]), tokenizer.decode(prompt_ids)
        assert text_of(messages) == whole[len(head) :], "the text deltas add up to the continuation's text"
        assert final.usage.completion_tokens == len(expected[i])
        assert final.usage.prompt_tokens == len(tokenizer.encode(prompts[i]))
        assert final.finish_reason in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP)
        assert 0 < final.timings.ttft_s <= final.timings.jct_s
        assert final.timings.queue_s >= 0 and final.timings.max_tbt_s >= final.timings.mean_tbt_s
    assert stats.num_finished == len(prompts) and stats.num_rejected == 0
    assert all(w.num_steps > 0 for w in stats.workers), "the round-robin router used both workers"
    assert 0.0 <= stats.slo_attainment_req <= 1.0 and stats.throughput_tok_s > 0


async def test_a_stop_string_ends_the_request_and_is_not_sent(
    workers: list[Worker], prompts: list[str], tokenizer: Tokenizer, reference: LLMEngine
) -> None:
    prompt = prompts[0]
    prompt_ids = tokenizer.encode(prompt)
    full = tokenizer.decode(prompt_ids + run_alone(reference, prompt_ids, 16))[len(tokenizer.decode(prompt_ids)) :]
    stop = full.split()[3]
    async with scheduler([w.address for w in workers]) as client:
        sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=16, stop=[stop])
        messages = await client.generate(text=prompt, sampling_params=sampling)
        await client.wait_until_idle()
    assert messages[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert text_of(messages) == full[: full.index(stop)]
    assert messages[-1].usage.completion_tokens < 16


# ---------------------------------------------------------------- cancellation


async def test_cancelling_mid_stream_frees_the_request_kv(workers: list[Worker], prompts: list[str]) -> None:
    async with scheduler([w.address for w in workers]) as client:
        call = client.stub.Generate(
            generation_pb2.GenerateRequest(text=prompts[1], sampling_params=common_pb2.SamplingParams(max_tokens=900))
        )
        received = 0
        async for message in call:
            received += len(message.token_ids)
            if received >= 3:
                break
        assert (await client.stats()).workers[0].gpu_blocks_used > 0
        call.cancel()
        stats = await client.wait_until_idle()
        assert sum(w.gpu_blocks_used for w in stats.workers) == 0
        await asyncio.sleep(0.1)
        assert [await w.held_requests() for w in workers] == [0, 0], "the workers were told to release it"


async def test_cancelling_during_a_long_chunked_prefill_frees_the_request_kv(workers: list[Worker]) -> None:
    prompt = list(range(1000, 1900))  # 900 tokens in chunks of 16: about 57 steps before a first token
    async with scheduler([workers[0].address], policy="sarathi:budget=16") as client:
        call = client.stub.Generate(
            generation_pb2.GenerateRequest(
                token_ids=common_pb2.TokenIds(ids=prompt), sampling_params=common_pb2.SamplingParams(max_tokens=8)
            )
        )
        for _ in range(500):
            stats = await client.stats()
            if stats.workers[0].num_steps >= 3:
                break
            await asyncio.sleep(0.005)
        assert stats.workers[0].gpu_blocks_used == math.ceil(900 / BLOCK), "blocks for the whole prompt are held"
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call.read()
        stats = await client.wait_until_idle()
        assert stats.workers[0].num_steps < 57, "cancelled before the prefill finished"
        await asyncio.sleep(0.1)
        assert await workers[0].held_requests() == 0


async def test_abort_by_id_ends_the_stream_and_is_idempotent(workers: list[Worker], prompts: list[str]) -> None:
    async with scheduler([w.address for w in workers]) as client:
        call = client.stub.Generate(
            generation_pb2.GenerateRequest(
                request_id="long-one", text=prompts[2], sampling_params=common_pb2.SamplingParams(max_tokens=900)
            )
        )
        first = await call.read()
        first_abort = await client.stub.Abort(generation_pb2.AbortRequest(request_ids=["long-one", "unknown"]))
        again = await client.stub.Abort(generation_pb2.AbortRequest(request_ids=["long-one"]))
        rest = await read_rest(call)
        await client.wait_until_idle()
    assert list(first_abort.aborted_ids) == ["long-one"] and list(again.aborted_ids) == []
    assert rest[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert rest[-1].usage.completion_tokens == len(first.token_ids) + len(ids_of(rest))


# ---------------------------------------------------------------- validation and backpressure

BAD_INPUTS = [
    ({"text": ""}, "text"),
    ({"token_ids": common_pb2.TokenIds(ids=[])}, "token_ids.ids"),
    ({}, "prompt"),
    ({"token_ids": common_pb2.TokenIds(ids=[5, 99_999])}, "token_ids.ids"),
    ({"text": "hi", "sampling_params": common_pb2.SamplingParams(top_p=0.0)}, "sampling_params.top_p"),
    ({"text": "hi", "sampling_params": common_pb2.SamplingParams(temperature=-1)}, "sampling_params.temperature"),
    ({"text": "hi", "sampling_params": common_pb2.SamplingParams(n=2)}, "sampling_params.n"),
    ({"text": "hi", "sampling_params": common_pb2.SamplingParams(max_tokens=2048)}, "sampling_params.max_tokens"),
    ({"token_ids": common_pb2.TokenIds(ids=[7] * 2048)}, "token_ids.ids"),
    ({"text": "hi", "slo": common_pb2.SloSpec(ttft_ms=-5)}, "slo.ttft_ms"),
    ({"text": "hi", "slo": common_pb2.SloSpec(jct_ms=0)}, "slo.jct_ms"),
]


async def test_bad_input_is_invalid_argument_naming_the_field(workers: list[Worker]) -> None:
    async with scheduler([w.address for w in workers], num_gpu_blocks=200) as client:
        for fields, name in BAD_INPUTS:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.generate(**fields)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, fields
            assert info.value.details().startswith(f"{name}:"), (fields, info.value.details())
        call = client.stub.Generate(generation_pb2.GenerateRequest(request_id="same", text="hello there"))
        await call.read()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.generate(request_id="same", text="hello again")
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("request_id:")
        call.cancel()
        await client.wait_until_idle()


async def test_a_prompt_larger_than_a_worker_kv_cache_is_refused_up_front(workers: list[Worker]) -> None:
    async with scheduler([w.address for w in workers], num_gpu_blocks=8) as client:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.generate(token_ids=common_pb2.TokenIds(ids=[7] * 100), sampling_params={"max_tokens": 40})
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("sampling_params.max_tokens:") and "KV cache" in info.value.details()


async def test_a_flood_beyond_the_queue_bound_is_refused_with_retry_info_while_admitted_ones_finish(
    workers: list[Worker], prompts: list[str]
) -> None:
    # 16 blocks per worker hold about four of these requests each; the rest wait, up to 6.
    async with scheduler([w.address for w in workers], num_gpu_blocks=16, max_waiting=6) as client:

        async def one(i: int) -> list[generation_pb2.GenerateResponse] | grpc.aio.AioRpcError:
            call = client.stub.Generate(
                generation_pb2.GenerateRequest(
                    token_ids=common_pb2.TokenIds(ids=list(range(100 + i, 140 + i))),
                    sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                )
            )
            try:
                return [m async for m in call]
            except grpc.aio.AioRpcError as exc:
                status = await rpc_status.aio.from_call(call)
                exc.rich_status = status  # type: ignore[attr-defined]
                return exc

        outcomes = await asyncio.gather(*(one(i) for i in range(40)))
        stats = await client.wait_until_idle()

    refused = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
    served = [o for o in outcomes if not isinstance(o, grpc.aio.AioRpcError)]
    assert refused and served
    assert len(served) >= 6, "at least the queue bound was admitted"
    for exc in refused:
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        details = {d.type_url.rsplit("/", 1)[-1]: d for d in exc.rich_status.details}
        retry = error_details_pb2.RetryInfo()
        assert details["google.rpc.RetryInfo"].Unpack(retry) and retry.retry_delay.nanos > 0
    for messages in served:
        assert len(ids_of(messages)) == 12 and messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert stats.num_rejected == len(refused) and stats.num_finished == len(served)


# ---------------------------------------------------------------- failures


async def test_a_worker_that_dies_mid_run_leaves_every_request_finished_on_the_other(
    prompts: list[str], tokenizer: Tokenizer, reference: LLMEngine
) -> None:
    doomed, survivor = await start_worker(0), await start_worker(1)
    max_tokens = 40
    expected = [run_alone(reference, tokenizer.encode(p), max_tokens) for p in prompts[:16]]
    try:
        async with scheduler([doomed.address, survivor.address], num_gpu_blocks=128) as client:
            calls = [
                client.generate(
                    text=p, sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens)
                )
                for p in prompts[:16]
            ]
            tasks = [asyncio.ensure_future(c) for c in calls]
            for _ in range(500):
                steps_before = (await client.stats()).workers[0].num_steps
                if steps_before >= 5:
                    break
                await asyncio.sleep(0.005)
            await doomed.server.stop(None)
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
            info = await client.stub.GetServerInfo(generation_pb2.GetServerInfoRequest())
            stats = await client.wait_until_idle()
            assert [w.healthy for w in info.workers] == [False, True]
            assert stats.workers[1].num_steps > 0

            # The same port comes back with a fresh engine: the worker is dialled again.
            revived = await start_worker(0, doomed.port, doomed.engine)
            for _ in range(200):
                info = await client.stub.GetServerInfo(generation_pb2.GetServerInfoRequest())
                if info.workers[0].healthy:
                    break
                await asyncio.sleep(0.05)
            assert info.workers[0].healthy, "the worker was reconnected and marked up"
            again = await client.generate(text=prompts[0], sampling_params={"temperature": 0.0, "max_tokens": 40})
            await revived.server.stop(None)
    finally:
        await survivor.server.stop(None)
        await doomed.server.stop(None)
    for messages, want in zip(results, expected, strict=True):
        assert ids_of(messages) == want, "recomputed on the survivor, the stream carries on unchanged"
        assert messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert steps_before < max_tokens, "the doomed worker's requests were unfinished when it died"
    assert ids_of(again) == expected[0]


# ---------------------------------------------------------------- standard services


async def test_health_reflection_and_server_info(workers: list[Worker]) -> None:
    async with scheduler([w.address for w in workers], policy="sarathi:budget=64", max_waiting=32) as client:
        ready = await client.health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        live = await client.health.Check(health_pb2.HealthCheckRequest(service=""))
        info = await client.stub.GetServerInfo(generation_pb2.GetServerInfoRequest())

        async def requests() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
            yield reflection_pb2.ServerReflectionRequest(list_services="")

        listing = [r async for r in client.reflection.ServerReflectionInfo(requests())]
    assert ready.status == live.status == health_pb2.HealthCheckResponse.SERVING
    names = {s.name for s in listing[0].list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names
    assert (info.policy, info.router, info.model) == ("sarathi:budget=64", "round_robin", "tiny-llama")
    assert (info.max_model_len, info.max_waiting, info.block_size) == (2048, 32, BLOCK)
    assert [(w.healthy, w.num_gpu_blocks, w.role) for w in info.workers] == [(True, 64, "mixed")] * 2


@pytest.mark.parametrize("prefix_caching", [True, False])
async def test_requests_sharing_a_system_prompt_reuse_its_kv_and_get_the_tokens_of_the_engine_alone(
    prefix_caching: bool, workers: list[Worker], prompts: list[str], tokenizer: Tokenizer, reference: LLMEngine
) -> None:
    system = tokenizer.encode(" ".join(prompts[:6]))[:64]  # 4 full blocks shared by every request
    questions = [tokenizer.encode(p)[:20] for p in prompts[6:12]]
    expected = [run_alone(reference, system + q, 6) for q in questions]
    async with scheduler([workers[0].address], prefix_caching=prefix_caching, policy="vllm") as client:
        first = await client.generate(
            request_id="warm",
            token_ids=common_pb2.TokenIds(ids=system + questions[0]),
            sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=6),
        )
        assert ids_of(first) == expected[0]
        results = await asyncio.gather(
            *(
                client.generate(
                    request_id=f"s{i}",
                    token_ids=common_pb2.TokenIds(ids=system + q),
                    sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=6),
                )
                for i, q in enumerate(questions)
            )
        )
        assert [ids_of(r) for r in results] == expected
        metrics = client.server.live.metrics
        hit = metrics.prefix_hit_tokens
        assert hit >= (64 * len(questions) if prefix_caching else 0) and (hit > 0) == prefix_caching
        await client.wait_until_idle()
