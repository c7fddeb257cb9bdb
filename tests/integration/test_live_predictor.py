"""The live scheduler asks the length predictor over real gRPC: answers are applied to requests
that are still live (never awaited on their way in), finished requests are observed so the
predictor's history learns, and a missing predictor costs no request (the fallback counter says
why). Echo workers stand in for models (steps of 50 ms), the predictor is the tiny trained one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from predictor_harness import closed_port

from predictor_service.engine import EngineConfig as PredictorEngineConfig
from predictor_service.engine import PredictorEngine
from predictor_service.server import start_server as start_predictor
from scheduler_service.live.config import LiveConfig
from scheduler_service.live.service import LiveScheduler
from scheduler_service.server import SchedulerServer
from sluice.common.client import SluiceClient
from sluice.common.prom import ServingMetrics
from sluice.common.tokenizer import Tokenizer
from worker_service.echo_engine import ECHO_FIRST_TOKEN, EchoEngine
from worker_service.engine import EngineConfig
from worker_service.server import build_server

# Token-id prompts of the demo vocabulary (the predictor decodes them with the same tokenizer).
PROMPTS = [list(range(3000 + 50 * i, 3000 + 50 * i + n)) for i, n in enumerate((5, 8, 11, 22))]
STOP_AFTER = 8  # each request stops on its own after this many tokens (a stop string)


def stop_word(prompt: list[int]) -> str:
    """The echo engine answers token ECHO_FIRST_TOKEN + len(prompt) + i as its i-th token: the
    word of the STOP_AFTER-th one ends the request naturally, as EOS would (the prompt lengths
    are chosen so that it is a whole word that no earlier word of the answer contains)."""
    return Tokenizer.demo().decode([ECHO_FIRST_TOKEN + len(prompt) + STOP_AFTER - 1]).strip()


@pytest.fixture(scope="module")
async def worker_address() -> AsyncIterator[str]:
    server = build_server(EchoEngine(EngineConfig(), step_time_s=0.05), 0)
    await server.start(ready=False)
    yield f"127.0.0.1:{server.port}"
    await server.server.stop(None)


@pytest.fixture(scope="module")
async def predictor(tiny_predictor) -> AsyncIterator[tuple[str, PredictorEngine]]:
    engine = PredictorEngine(tiny_predictor.with_new_history(), PredictorEngineConfig())
    server = await start_predictor(engine, "127.0.0.1", 0)
    yield f"127.0.0.1:{server.port}", engine
    await server.stop(grace_s=0.5, drain_s=0.0)
    await engine.close()


async def serve(worker: str, predictor: str, serving: ServingMetrics) -> SchedulerServer:
    config = LiveConfig(num_gpu_blocks=512, predictor=predictor, predictor_timeout_ms=2000.0)
    return await SchedulerServer.start(LiveScheduler([worker], config, serving), 0)


async def test_live_requests_get_the_predictors_lengths_and_teach_it_their_true_ones(
    worker_address: str, predictor: tuple[str, PredictorEngine]
) -> None:
    target, engine = predictor
    history_before = len(engine.predictor.history)
    serving = ServingMetrics("tiny-llama")
    server = await serve(worker_address, target, serving)
    try:
        async with SluiceClient(f"127.0.0.1:{server.port}") as client:
            done = await asyncio.gather(
                *(client.complete(p, max_tokens=40, stop=[stop_word(p)], ignore_eos=True) for p in PROMPTS)
            )
        link = server.live.predictor
        assert link is not None
        for _ in range(100):  # observations travel in the background
            if len(engine.predictor.history) > history_before:
                break
            await asyncio.sleep(0.05)
    finally:
        await server.stop(grace_s=1.0, drain_s=0.0)
    assert [d.finish_reason for d in done] == ["stop"] * len(PROMPTS), "ended naturally: the history learns"
    assert link.num_applied == len(PROMPTS), "every answer came while its request was live"
    assert len(engine.predictor.history) == history_before + len(PROMPTS)
    labels = {"model_name": "tiny-llama"}
    errors = serving.registry.get_sample_value("sluice_length_prediction_error_tokens_count", labels)
    assert errors == len(PROMPTS), "each prediction's error is recorded when its request ends"


async def test_without_a_predictor_requests_fall_back_and_the_counter_says_why(worker_address: str) -> None:
    serving = ServingMetrics("tiny-llama")
    server = await serve(worker_address, f"127.0.0.1:{closed_port()}", serving)
    try:
        async with SluiceClient(f"127.0.0.1:{server.port}") as client:
            done = await asyncio.gather(*(client.complete(p, max_tokens=8, ignore_eos=True) for p in PROMPTS))
        for _ in range(100):
            fallbacks = serving.registry.get_sample_value(
                "sluice_predictor_fallbacks_total", {"model_name": "tiny-llama", "reason": "unavailable"}
            )
            if fallbacks == len(PROMPTS):
                break
            await asyncio.sleep(0.05)
    finally:
        await server.stop(grace_s=1.0, drain_s=0.0)
    assert [len(d.token_ids) for d in done] == [8] * len(PROMPTS)
    assert fallbacks == len(PROMPTS)
