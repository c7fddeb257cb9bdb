"""Limits up front and one status rule. Every oversized or out-of-range field is refused with
INVALID_ARGUMENT naming it (message and google.rpc.BadRequest) before any work; the prompt
limit GetServerInfo advertises is the one intake applies; a huge text prompt is tokenized off
the event loop while other streams and health go on; x-request-id comes back in the initial
metadata (so a queued request can be aborted) and is honoured when sent; a request that fails
ends with a non-OK status (UNAVAILABLE when the last worker is gone, DEADLINE_EXCEEDED at the
queue timeout), never with a REJECTED final message and OK."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from sluice.v1 import common_pb2, generation_pb2
from sluice_bench.fault_harness import EchoWorker, Stack, prompt, sampling, stack

VOCAB = 30522  # the tiny presets' vocabulary (the MiniLM tokenizer's)
HI = {"text": "hi"}

BAD = [
    ({"request_id": "r" * 257, **HI}, "request_id"),
    ({"request_id": "bad\nid", **HI}, "request_id"),
    ({"tenant": "t" * 300, **HI}, "tenant"),
    ({"labels": {f"k{i}": "v" for i in range(33)}, **HI}, "labels"),
    ({"labels": {"bad key!": "v"}, **HI}, "labels"),
    ({"labels": {"k": "v" * 300}, **HI}, "labels[k]"),
    ({"priority": 5000, **HI}, "priority"),
    ({"slo": common_pb2.SloSpec(slo_class=7), **HI}, "slo.slo_class"),
    ({"slo": common_pb2.SloSpec(ttft_ms=-5), **HI}, "slo.ttft_ms"),
    ({"slo": common_pb2.SloSpec(tbt_ms=float("nan")), **HI}, "slo.tbt_ms"),
    ({"sampling_params": common_pb2.SamplingParams(stop=["s"] * 17), **HI}, "sampling_params.stop"),
    ({"sampling_params": common_pb2.SamplingParams(stop=["s" * 257]), **HI}, "sampling_params.stop[0]"),
    ({"sampling_params": common_pb2.SamplingParams(stop_token_ids=[5] * 65), **HI}, "sampling_params.stop_token_ids"),
    ({"sampling_params": common_pb2.SamplingParams(stop_token_ids=[VOCAB]), **HI}, "sampling_params.stop_token_ids"),
    ({"sampling_params": common_pb2.SamplingParams(top_k=2**32 - 1), **HI}, "sampling_params.top_k"),
    ({"text": "x" * 70_000}, "text"),
    ({"token_ids": common_pb2.TokenIds(ids=[7] * 1024)}, "token_ids.ids"),
]


@pytest.fixture(scope="module")
async def worker() -> EchoWorker:
    w = await EchoWorker.start(0, step_time_s=0.002)
    yield w
    await w.stop()


async def test_every_oversized_or_out_of_range_field_is_refused_up_front_naming_it(worker: EchoWorker) -> None:
    async with stack([worker.address]) as s:
        for fields, name in BAD:
            call = s.stub.Generate(generation_pb2.GenerateRequest(**fields))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.read()
            status = await rpc_status.aio.from_call(call)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
            assert info.value.details().startswith(f"{name}:"), (name, info.value.details())
            bad = error_details_pb2.BadRequest()
            assert status is not None and status.details[0].Unpack(bad), name
            assert bad.field_violations[0].field == name
        ttft = await s.generate(text="hi", slo=common_pb2.SloSpec(ttft_ms=-5))
        assert "got -5.0 ms" in ttft.details, "SLOs go in as ms and are reported in ms"
        assert await s.wait_idle() == 0


async def test_the_advertised_prompt_limit_is_the_one_applied(worker: EchoWorker) -> None:
    # NOTE: the review's case: a step budget below the context length used to admit prompts
    # that then ended REJECTED inside an OK stream.
    async with stack([worker.address], max_num_batched_tokens=512, num_gpu_blocks=128) as s:
        info = await s.stub.GetServerInfo(generation_pb2.GetServerInfoRequest())
        longest = await s.generate(token_ids=prompt(0, info.max_prompt_tokens), sampling_params=sampling(1))
        too_long = await s.generate(token_ids=prompt(0, info.max_prompt_tokens + 1), sampling_params=sampling(1))
        default = s.stub.Generate(generation_pb2.GenerateRequest(token_ids=prompt(1, 500)))
        applied = dict(await default.initial_metadata())["x-max-tokens"]
        rest = await s.collect(default)
    assert (info.max_model_len, info.max_prompt_tokens) == (512, 511)
    assert (info.default_max_tokens, info.max_prompt_bytes, info.vocab_size) == (256, 32 * 512, VOCAB)
    assert longest.ok and len(longest.tokens) == 1
    assert too_long.code == grpc.StatusCode.INVALID_ARGUMENT and too_long.details.startswith("token_ids.ids:")
    assert applied == "12" and rest.ok and len(rest.tokens) == 12, "unset max_tokens: the context left"


async def test_an_8_mb_prompt_is_refused_by_its_size_before_tokenizing(worker: EchoWorker) -> None:
    async with stack([worker.address]) as s:
        ending = await s.generate(text="x" * 8 * 2**20, sampling_params=sampling(4))
        assert s.live.num_tokenizing == 0
    assert ending.code == grpc.StatusCode.INVALID_ARGUMENT
    # 32 bytes per token of the longest prompt served: 64 blocks of 16 hold 1024 tokens
    assert ending.details == "text: the prompt is 8388608 bytes; the limit is 32768"


async def test_two_huge_text_prompts_cannot_starve_a_short_text_prompt_behind_them(worker: EchoWorker) -> None:
    # NOTE: the probe's case: two 8 MB prompts held both encoder threads and a short text
    # request waited 14.9 s for its TTFT; huge prompts now have a lane of their own
    text = "the quick brown fox jumps over the lazy dog " * 50_000  # 2.2 MB each
    async with stack([worker.address], max_prompt_bytes=4 * 2**20) as s:
        big = [asyncio.ensure_future(s.generate(text=text, sampling_params=sampling(4))) for _ in range(2)]
        for _ in range(1000):
            if s.live.num_tokenizing == 2:
                break
            await asyncio.sleep(0.005)
        assert s.live.num_tokenizing == 2
        small = await s.generate(text="a short question", sampling_params=sampling(4))
        still = s.live.num_tokenizing
        endings = await asyncio.gather(*big)
    assert small.ok and len(small.tokens) == 4
    assert still >= 1, "the short text prompt was served while the huge ones were still being tokenized"
    assert all(e.code == grpc.StatusCode.INVALID_ARGUMENT for e in endings)  # too long for the context


def test_the_default_prompt_byte_limit_follows_the_longest_prompt_a_worker_can_hold() -> None:
    from scheduler_service.live.intake import Limits

    # a 128k context on 512 blocks of 16 tokens: 8192 tokens fit, so 32 x 8192 bytes, not 4 MiB
    limits = Limits(131072, 512 * 16, VOCAB, 256, frozenset())
    assert limits.prompt_bytes == 32 * 8192


async def test_a_huge_text_prompt_is_tokenized_while_other_streams_and_health_go_on(worker: EchoWorker) -> None:
    text = "the quick brown fox jumps over the lazy dog " * 50_000  # 2.2 MB
    async with stack([worker.address], max_prompt_bytes=4 * 2**20) as s:
        big = asyncio.ensure_future(s.generate(text=text, sampling_params=sampling(4)))
        for _ in range(1000):
            if s.live.num_tokenizing:
                break
            await asyncio.sleep(0.005)
        assert s.live.num_tokenizing == 1
        health = await health_pb2_grpc.HealthStub(s.channel).Check(health_pb2.HealthCheckRequest(service=""))
        small = await s.generate(token_ids=prompt(0), sampling_params=sampling(16))
        still = s.live.num_tokenizing
        ending = await big
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert small.ok and len(small.tokens) == 16
    assert still == 1, "health and a whole other request were served while the prompt was being tokenized"
    assert ending.code == grpc.StatusCode.INVALID_ARGUMENT and ending.details.startswith("text:")


@pytest.fixture(scope="module")
async def slow_worker() -> EchoWorker:
    w = await EchoWorker.start(1, step_time_s=0.1)
    yield w
    await w.stop()


def hog(s: Stack) -> asyncio.Future:
    """A request that holds all 4 KV blocks for 5 steps of 0.1 s: the next one waits."""
    return asyncio.ensure_future(s.generate(token_ids=prompt(0, 60), sampling_params=sampling(4)))


async def test_request_ids_travel_in_metadata_and_a_queued_request_can_be_aborted(slow_worker: EchoWorker) -> None:
    async with stack([slow_worker.address], num_gpu_blocks=4) as s:
        first = hog(s)
        while not s.live.streams:
            await asyncio.sleep(0.005)
        queued = s.stub.Generate(generation_pb2.GenerateRequest(token_ids=prompt(1), sampling_params=sampling(40)))
        made = dict(await queued.initial_metadata())["x-request-id"]
        assert made in s.live.streams and (await s.stats()).num_waiting == 1, "still queued: no token yet"
        aborted = await s.stub.Abort(generation_pb2.AbortRequest(request_ids=[made]))
        ending = await s.collect(queued)
        named = s.stub.Generate(
            generation_pb2.GenerateRequest(token_ids=prompt(2), sampling_params=sampling(2)),
            metadata=(("x-request-id", "from-header"),),
        )
        echoed = dict(await named.initial_metadata())["x-request-id"]
        named_ending = await s.collect(named)
        clash = await s.generate(request_id="a", token_ids=prompt(3), sampling_params=sampling(2))
        await first
    assert list(aborted.aborted_ids) == [made]
    assert ending.ok and ending.finish_reason == common_pb2.FINISH_REASON_ABORT and not ending.tokens
    assert echoed == "from-header" and named_ending.request_id == "from-header"
    assert clash.ok


async def test_requests_in_flight_when_the_last_worker_dies_end_unavailable_not_ok(
    caplog: pytest.LogCaptureFixture,
) -> None:
    worker = await EchoWorker.start(0, step_time_s=0.01)
    async with stack([worker.address], reconnect_min_s=5.0) as s:
        calls = [
            asyncio.ensure_future(s.generate(token_ids=prompt(i), sampling_params=sampling(200))) for i in range(3)
        ]
        while s.live.loops[0].num_steps < 3:
            await asyncio.sleep(0.005)
        await worker.stop()
        endings = await asyncio.wait_for(asyncio.gather(*calls), timeout=30)
        refused = await s.generate(token_ids=prompt(9), sampling_params=sampling(2))
        assert await s.wait_idle() == 0
    for e in endings:
        assert e.code == grpc.StatusCode.UNAVAILABLE, (e.code, e.details)
        assert e.detail_types == ("google.rpc.ErrorInfo",)
        assert e.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED, "no REJECTED final message"
    assert refused.code == grpc.StatusCode.UNAVAILABLE
    lines = [r.getMessage() for r in caplog.records if "down" in r.getMessage()]
    assert lines and "no worker is left: 3 requests end UNAVAILABLE" in lines[-1]
    assert not any("re-queued" in line for line in lines)


async def test_a_request_that_times_out_in_the_queue_ends_deadline_exceeded(slow_worker: EchoWorker) -> None:
    async with stack([slow_worker.address], num_gpu_blocks=4, queue_timeout_s=0.2) as s:
        first = hog(s)
        while not s.live.streams:
            await asyncio.sleep(0.005)
        late = await s.generate(token_ids=prompt(1), sampling_params=sampling(40))
        assert (await first).ok
    assert late.code == grpc.StatusCode.DEADLINE_EXCEEDED and late.detail_types == ("google.rpc.ErrorInfo",)
