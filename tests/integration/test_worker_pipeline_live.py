"""The worker's engine pipeline live: a real tiny-llama worker over gRPC that launches step N+1
before collecting step N (`--worker-pipeline on`; on a CPU `auto` leaves it off), driven by
the overlapped scheduler, gives every stream the tokens, text and finish reason of a worker
without it under a scheduler without overlap: stop strings, client cancellations and
preemptions under KV pressure in the mix; nothing stays held on either side."""

from __future__ import annotations

import asyncio

import pytest

from sluice.common.tokenizer import Tokenizer
from sluice.v1 import common_pb2
from tests.integration import test_overlap_live as overlap_live
from tests.integration.test_scheduler_live import Worker, engine, scheduler
from worker_service.engine import LLMEngine
from worker_service.server import EngineRunner, WorkerServerOptions
from worker_service.server import build_server as build_worker_server

CANCEL_AFTER, NUM, run_mix = overlap_live.CANCEL_AFTER, overlap_live.NUM, overlap_live.run_mix
# the same prompts (CodeAlpaca), tokenizer and reference engine as the overlap test
prompts, tokenizer, reference = overlap_live.prompts, overlap_live.tokenizer, overlap_live.reference


async def start(pipeline: str) -> tuple[Worker, EngineRunner]:
    eng = engine()
    runner = EngineRunner(eng, pipeline, step_spans=False)  # untraced even after another module set up tracing
    server = build_worker_server(eng, 0, runner=runner, options=WorkerServerOptions(pipeline=pipeline))
    await server.start(ready=False)
    return Worker(eng, server.server, server.port), runner


@pytest.fixture(scope="module")
async def workers() -> dict[str, tuple[Worker, EngineRunner]]:
    ws = {"off": await start("off"), "on": await start("on")}
    yield ws
    for w, _ in ws.values():
        await w.server.stop(None)


async def test_pipelined_worker_gives_the_tokens_of_one_step_at_a_time(
    workers: dict[str, tuple[Worker, EngineRunner]], prompts: list[str], tokenizer: Tokenizer, reference: LLMEngine
) -> None:
    assert workers["on"][1].pipelines and not workers["off"][1].pipelines
    chosen = prompts[:NUM]
    stops = overlap_live.stop_strings(chosen, tokenizer, reference)
    runs = {}
    for pipeline, overlap in (("off", False), ("on", True)):
        worker = workers[pipeline][0]
        async with scheduler([worker.address], overlap=overlap, num_gpu_blocks=20, max_waiting=64) as client:
            runs[pipeline] = await run_mix(client, chosen, stops)
            stats = await client.wait_until_idle()
            assert stats.num_preemptions > 0, "KV pressure preempted requests"
        await asyncio.sleep(0.1)
        assert await worker.held_requests() == 0, "the worker was told to release every request"
        assert not worker.engine._uncollected, "every launched token came back"
    assert workers["on"][1].launched_ahead > 0, "steps were launched before the one before was collected"
    assert workers["off"][1].launched_ahead == 0
    base, over = runs["off"], runs["on"]
    for i in range(NUM):
        if i in CANCEL_AFTER:
            assert over[i][0] == base[i][0][: len(over[i][0])]
            continue
        assert over[i] == base[i], f"request {i} differs with the worker's pipeline"
    for i in stops:
        assert base[i][2] == common_pb2.FINISH_REASON_STOP
