"""The plug-in asks Sluice's length predictor over real gRPC for requests that bring no
predicted length, applies the answer at a later step (schedule() never waits for it), and
reports the finished length back (Observe), so the predictor's history learns vLLM's outputs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

pytest.importorskip("vllm")

from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

from predictor_service.engine import EngineConfig as PredictorEngineConfig
from predictor_service.engine import PredictorEngine
from predictor_service.server import start_server as start_predictor
from sluice_bench.vllm_plugin_harness import build_scheduler, make_request, step
from sluice_vllm.scheduler import SluiceScheduler

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # the session trains the tiny predictor first
PROMPT = list(range(3000, 3040))  # token ids of the demo vocabulary (the predictor decodes them)


@pytest.fixture
async def predictor(tiny_predictor) -> AsyncIterator[tuple[str, PredictorEngine]]:
    engine = PredictorEngine(tiny_predictor.with_new_history(), PredictorEngineConfig())
    server = await start_predictor(engine, "127.0.0.1", 0)
    yield f"127.0.0.1:{server.port}", engine
    await server.stop(grace_s=0.5, drain_s=0.0)
    await engine.close()


async def test_predictions_are_applied_later_and_finished_lengths_observed(
    predictor: tuple[str, PredictorEngine],
) -> None:
    address, engine = predictor
    env = {"SLUICE_VLLM_POLICY": "alise", "SLUICE_VLLM_PREDICTOR": address, "SLUICE_VLLM_PREDICTOR_TIMEOUT_MS": "5000"}
    s = build_scheduler(SluiceScheduler, env=env, max_num_seqs=1)
    history_before = len(engine.predictor.history)
    busy = make_request("busy", 40, 30, predicted_tokens=1)  # ranked first: holds the one seat
    # stops on its own at its first token (the harness samples token 5): a natural length, which
    # the predictor learns (a length cut at max_tokens is only a lower bound, not learned)
    asked = Request("asked", PROMPT, SamplingParams(max_tokens=6, stop_token_ids=[5]), None)
    s.add_request(busy)
    s.add_request(asked)
    assert s._sluice_jobs["asked"].predicted == 6  # the fallback (max_tokens) until the answer comes
    started = time.perf_counter()
    step(s)
    assert time.perf_counter() - started < 0.5  # never waits on the predictor
    deadline = time.monotonic() + 20
    while s.sluice_counters["predictions_applied"] == 0:
        assert time.monotonic() < deadline, dict(s._sluice_predictor.counters)
        await asyncio.sleep(0.05)  # the predictor answers on this loop
        step(s)
    predicted = s._sluice_jobs["asked"].predicted
    assert predicted >= 1 and s._sluice_predictor.counters["predict_answered"] == 1
    while s.requests:
        step(s)
        await asyncio.sleep(0)
    deadline = time.monotonic() + 20
    assert s._sluice_jobs == {} and s.sluice_counters["finished"] == 2
    while len(engine.predictor.history) < history_before + 1:  # "asked" learned; "busy" (cut) not
        assert time.monotonic() < deadline, "no Observe reached the predictor"
        await asyncio.sleep(0.05)
    assert s._sluice_predictor.counters["observed"] == 2
    s.shutdown()
