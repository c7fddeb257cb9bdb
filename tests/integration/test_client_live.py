"""The asyncio client and `sluice bench` against the real scheduler (LiveScheduler +
SchedulerServer in-process) over a real worker server running the echo engine: streaming
with token ids and text deltas, final usage and timings, cancellation by breaking out of
the stream (KV freed), Abort by id, INVALID_ARGUMENT, server info and stats, and a bench
run (closed and open loop) whose JSON counts every request with its exact length."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from scheduler_service.live.config import LiveConfig
from scheduler_service.live.service import LiveScheduler
from scheduler_service.loadgen.load import run_requests
from scheduler_service.loadgen.measure import summarize
from scheduler_service.loadgen.requests import prepare_requests
from scheduler_service.server import SchedulerServer
from scheduler_service.workloads import apply_arrivals, load_trace
from sluice.common.client import SluiceClient
from worker_service.echo_engine import ECHO_FIRST_TOKEN, EchoEngine
from worker_service.engine import EngineConfig
from worker_service.server import build_server

NUM_GPU_BLOCKS = 1024


@pytest.fixture(scope="module")
async def client() -> AsyncIterator[SluiceClient]:
    worker = build_server(EchoEngine(EngineConfig()), 0)
    await worker.start(ready=False)
    port = worker.port
    live = LiveScheduler(
        [f"127.0.0.1:{port}"], LiveConfig(num_gpu_blocks=NUM_GPU_BLOCKS, max_num_seqs=32, max_num_batched_tokens=2048)
    )
    scheduler = await SchedulerServer.start(live, 0)
    async with SluiceClient(f"127.0.0.1:{scheduler.port}") as c:
        await c.wait_ready()
        yield c
    await scheduler.stop(grace_s=1.0, drain_s=0.0)
    await worker.server.stop(None)


async def wait_idle(client: SluiceClient, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        stats = await client.stats()
        worker = stats.workers[0]
        if stats.num_running == 0 and stats.num_waiting == 0 and worker.gpu_blocks_used == 0:
            return
        assert asyncio.get_running_loop().time() < deadline, f"not idle: {stats}"
        await asyncio.sleep(0.02)


async def test_generate_streams_token_ids_and_text_then_usage_and_timings(client: SluiceClient) -> None:
    chunks = [c async for c in client.generate("hello world", max_tokens=6, ttft_ms=5000, request_id="g1")]
    tokens = [t for c in chunks for t in c.token_ids]
    assert len(tokens) == 6 and tokens[0] >= ECHO_FIRST_TOKEN
    assert all(c.request_id == "g1" for c in chunks)
    assert [c.is_last for c in chunks].count(True) == 1 and chunks[-1].is_last
    last = chunks[-1]
    assert (last.finish_reason, last.completion_tokens) == ("length", 6)
    assert last.prompt_tokens > 0
    assert last.timings is not None and last.timings.slo_met and 0 < last.timings.ttft_s <= last.timings.jct_s
    assert "".join(c.text for c in chunks).strip(), "text deltas decode the tokens"
    times = [c.received_s for c in chunks]
    assert times == sorted(times)


async def test_complete_accepts_token_ids(client: SluiceClient) -> None:
    done = await client.complete([1000, 1001, 1002], max_tokens=20, ignore_eos=True)
    assert (done.finish_reason, len(done.token_ids), done.completion_tokens) == ("length", 20, 20)


async def test_breaking_out_of_the_stream_cancels_and_frees_the_kv(client: SluiceClient) -> None:
    seen = 0
    async for chunk in client.generate(list(range(1000, 1100)), max_tokens=1500, ignore_eos=True):
        seen += len(chunk.token_ids)
        if seen >= 3:
            break
    await wait_idle(client)


async def test_abort_by_id_ends_the_stream_with_abort(client: SluiceClient) -> None:
    async def consume() -> list:
        return [c async for c in client.generate([1000] * 10, max_tokens=1500, ignore_eos=True, request_id="ab1")]

    task = asyncio.create_task(consume())
    for _ in range(200):
        if (await client.stats()).num_running:
            break
        await asyncio.sleep(0.01)
    assert await client.abort(["ab1", "never-existed"]) == ["ab1"]
    chunks = await asyncio.wait_for(task, 5.0)
    assert chunks[-1].finish_reason == "abort"
    assert await client.abort(["ab1"]) == [], "idempotent"
    await wait_idle(client)


async def test_bad_input_is_invalid_argument_naming_the_field(client: SluiceClient) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.complete("", max_tokens=4)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt" in info.value.details()


async def test_server_info_describes_policy_model_and_workers(client: SluiceClient) -> None:
    info = await client.server_info()
    assert (info.policy, info.model, info.max_model_len) == ("vllm", "tiny-llama", 2048)
    assert [w.num_gpu_blocks for w in info.workers] == [NUM_GPU_BLOCKS] and info.workers[0].healthy


async def test_bench_closed_and_open_loop_count_every_request_with_its_length(client: SluiceClient) -> None:
    workload = load_trace("azure-conv", num_requests=24)
    requests = prepare_requests(workload, 2048, max_tokens=8, prompt_source="tokens", oracle_lengths=True)
    records = await run_requests(client, requests, concurrency=6, progress=False)
    assert [len(r.token_times) for r in records] == [r.max_tokens for r in requests], [
        (r.error_code, r.finish_reason, r.message) for r in records if not r.token_times
    ]
    assert all(r.finish_reason == "length" and not r.error_code for r in records)
    run = summarize(records, policy="vllm", workload=workload.name)
    assert (run.metrics["num_finished"], run.metrics["num_requests"]) == (24, 24)
    assert run.metrics["throughput_tok_s"] > 0 and run.metrics["ttft_s"]["p50"] > 0

    timed = prepare_requests(
        apply_arrivals(workload, "poisson", rate=200.0, seed=1), 2048, max_tokens=4, oracle_lengths=True
    )
    records = await run_requests(client, timed, progress=False)
    sent = [r.sent_s for r in sorted(records, key=lambda r: r.request.arrival_s)]
    arrivals = sorted(r.arrival_s for r in timed)
    assert all(s >= a - 1e-3 for s, a in zip(sent, arrivals, strict=True)), "nothing is sent before its arrival"
    assert summarize(records, policy="vllm", workload="w").metrics["num_finished"] == 24
    await wait_idle(client)
