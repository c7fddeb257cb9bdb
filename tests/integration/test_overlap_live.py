"""Overlapped scheduling live: a real tiny-llama worker over gRPC, greedy, the same requests
with overlap on and off (`--no-overlap`). Every stream must carry the same tokens, text and
finish reason, with stop strings, client cancellations and preemptions under KV pressure in
the mix, and nothing may stay held on the scheduler's books or the worker's.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

import grpc
import pytest

from sluice.common.paths import data_file, open_text
from sluice.common.tokenizer import Tokenizer
from sluice.v1 import common_pb2, generation_pb2
from tests.integration.test_scheduler_live import Worker, engine, ids_of, run_alone, scheduler, start_worker, text_of
from worker_service.engine import LLMEngine

NUM = 16
CANCEL_AFTER = {3: 2, 8: 5, 12: 1}  # request index -> tokens received before the client cancels


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.demo()


@pytest.fixture(scope="module")
def prompts(tokenizer: Tokenizer) -> list[str]:
    """Real instructions (CodeAlpaca), short and long."""
    with open_text(data_file("prompts/codealpaca_code_alpaca_2k.json")) as f:
        rows = json.load(f)
    texts = [f"{r['instruction']} {r['input']}".strip() for r in rows[:200]]
    return [t for t in texts if 4 <= len(tokenizer.encode(t)) <= 120][:NUM]


@pytest.fixture(scope="module")
def reference() -> LLMEngine:
    eng = engine()
    eng.init_kv_cache(64, 0)
    return eng


@pytest.fixture(scope="module")
async def worker() -> Worker:
    w = await start_worker(0)
    yield w
    await w.server.stop(None)


def stop_strings(prompts: Sequence[str], tokenizer: Tokenizer, reference: LLMEngine) -> dict[int, str]:
    """Stop strings for prompts 1, 5 and 9, cut from what the engine alone generates, so they do occur."""
    stops = {}
    for i in (1, 5, 9):
        ids = tokenizer.encode(prompts[i])
        full = tokenizer.decode(ids + run_alone(reference, ids, 12))[len(tokenizer.decode(ids)) :]
        stops[i] = full.split()[2]
    return stops


async def run_mix(client, prompts: Sequence[str], stops: dict[int, str]) -> dict[int, tuple[list[int], str, int]]:
    """Every request at once; returns (token ids, text, finish reason) per request index."""

    async def one(i: int, prompt: str) -> tuple[list[int], str, int]:
        stop = [stops[i]] if i in stops else []
        sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=6 + (i * 5) % 19, stop=stop)
        call = client.stub.Generate(
            generation_pb2.GenerateRequest(request_id=f"r{i}", text=prompt, sampling_params=sampling)
        )
        messages: list[generation_pb2.GenerateResponse] = []
        limit = CANCEL_AFTER.get(i)
        async for message in call:
            messages.append(message)
            if limit is not None and len(ids_of(messages)) >= limit:
                call.cancel()
                break
        finish = messages[-1].finish_reason if limit is None else -1
        return ids_of(messages), text_of(messages), finish

    results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)), return_exceptions=True)
    out = {}
    for i, r in enumerate(results):
        if isinstance(r, BaseException):
            assert isinstance(r, grpc.aio.AioRpcError | asyncio.CancelledError), r
            continue
        out[i] = r
    return out


async def test_overlap_gives_the_tokens_of_no_overlap_with_stops_cancels_and_preemptions(
    worker: Worker, prompts: list[str], tokenizer: Tokenizer, reference: LLMEngine
) -> None:
    chosen = prompts[:NUM]
    stops = stop_strings(chosen, tokenizer, reference)
    runs = {}
    for overlap in (False, True):
        # NOTE: 20 blocks of 16 tokens for 16 requests of up to ~140 tokens: preemptions happen.
        async with scheduler([worker.address], overlap=overlap, num_gpu_blocks=20, max_waiting=64) as client:
            runs[overlap] = await run_mix(client, chosen, stops)
            stats = await client.wait_until_idle()
            loop = client.server.live.loops[0]
            assert stats.num_preemptions > 0, "KV pressure preempted requests"
            if overlap:
                assert loop.pipeline.num_ahead > 0, "plans went out while a step was in flight"
            else:
                assert loop.pipeline.num_ahead == 0
        await asyncio.sleep(0.1)
        assert await worker.held_requests() == 0, "the worker was told to release every request"
    assert_same_streams(runs[False], runs[True])
    base = runs[False]
    for i in stops:
        assert base[i][2] == common_pb2.FINISH_REASON_STOP
        assert stops[i] not in base[i][1]


def assert_same_streams(base: dict, over: dict) -> None:
    """Every request streamed the same tokens, text and ending with overlap as without; a
    cancelled stream carries what came before the cancel, never a token after it."""
    for i in range(NUM):
        if i in CANCEL_AFTER:
            assert over[i][0] == base[i][0][: len(over[i][0])]
            continue
        assert over[i] == base[i], f"request {i} differs with overlap"


@pytest.mark.parametrize("policy", ["fastserve", "alise", "econoserve", "accelgen", "scls:batch_size=8,slice_len=6"])
async def test_every_policy_overlaps_live_with_the_tokens_of_no_overlap(
    policy: str, worker: Worker, prompts: list[str], tokenizer: Tokenizer, reference: LLMEngine
) -> None:
    """The policies whose bookkeeping waits for a step's answer (core/overlap.py and the audit
    in docs/ARCHITECTURE.md) stream the tokens, text and finish reasons of `--no-overlap` live,
    with stop strings and cancellations in the mix (SCLS with slices short enough to end)."""
    chosen = prompts[:NUM]
    stops = stop_strings(chosen, tokenizer, reference)
    runs = {}
    for overlap in (False, True):
        async with scheduler([worker.address], policy=policy, overlap=overlap, max_waiting=64) as client:
            runs[overlap] = await run_mix(client, chosen, stops)
            await client.wait_until_idle()
            assert (client.server.live.loops[0].pipeline.num_ahead > 0) == overlap
        await asyncio.sleep(0.1)
        assert await worker.held_requests() == 0, "the worker was told to release every request"
    assert_same_streams(runs[False], runs[True])
