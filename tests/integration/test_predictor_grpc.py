"""The PredictorService over real gRPC (in-process aio server on port 0) and the asyncio client."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from predictor_harness import closed_port, silent_server

from predictor_service.engine import EngineConfig, PredictorEngine
from predictor_service.server import SERVICE_NAME, start_server
from sluice.common.predictor_client import PredictorClient
from sluice.v1 import common_pb2, predictor_pb2, predictor_pb2_grpc

PROMPT = "Explain how a transformer language model generates text, step by step."


@pytest.fixture(scope="module")
async def served(tiny_predictor) -> AsyncIterator[tuple[str, PredictorEngine]]:
    engine = PredictorEngine(tiny_predictor.with_new_history(), EngineConfig())
    server = await start_server(engine, "127.0.0.1", 0)
    yield f"127.0.0.1:{server.port}", engine
    await server.stop(grace_s=0.5, drain_s=0.0)
    await engine.close()


async def test_health_reports_the_service_serving(served) -> None:
    target, _ = served
    async with grpc.aio.insecure_channel(target) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_serving_means_warmed_up_so_the_first_prediction_pays_no_loading(served) -> None:
    # the scheduler gives each prediction a deadline of a few ms: a predictor that said SERVING
    # and then loaded its served tokenizer on the first token-id prompt missed all of them
    _, engine = served
    assert engine.tokenizer_loaded


async def test_predict_and_batch_answer_distributions_then_the_cache(served) -> None:
    target, _ = served
    async with PredictorClient(target) as client:
        first = await client.predict("r1", PROMPT, "chatgpt-sharegpt", 0, timeout_s=5.0)
        again = await client.predict("r2", PROMPT, "chatgpt-sharegpt", 0, timeout_s=5.0)
        capped = await client.predict("r3", PROMPT, "chatgpt-sharegpt", 7, timeout_s=5.0)
        batch = await client.predict_batch(
            [
                ("b0", "Say hi.", "tiny-llama", 0),
                ("b1", [2023, 2003, 1037, 3231], "tiny-llama", 0),
                ("b2", PROMPT, "chatgpt-sharegpt", 0),
            ],
            timeout_s=5.0,
        )
    assert first is not None and again is not None and capped is not None and batch is not None
    assert first.source in ("head", "blend", "retrieval") and again.source == "cache"
    assert again.tokens == first.tokens and again.quantiles == first.quantiles
    assert capped.tokens <= 7 and capped.p90 <= 7
    assert [p.tokens for p in batch][2] == first.tokens, "batch answers keep the request order"
    assert all(p.p10 <= p.p50 <= p.p90 for p in batch)


@pytest.mark.parametrize(
    ("request_msg", "field"),
    [
        (predictor_pb2.PredictRequest(request_id="x", text="   "), "text"),
        (predictor_pb2.PredictRequest(request_id="x"), "prompt"),
        (
            predictor_pb2.PredictRequest(request_id="x", token_ids=common_pb2.TokenIds(ids=[10, 99_999_999])),
            "token_ids",
        ),
    ],
)
async def test_bad_input_is_invalid_argument_naming_the_field(served, request_msg, field) -> None:
    target, _ = served
    async with grpc.aio.insecure_channel(target) as channel:
        stub = predictor_pb2_grpc.PredictorServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Predict(request_msg, timeout=5.0)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()
        batch = predictor_pb2.PredictBatchRequest(requests=[predictor_pb2.PredictRequest(text="fine"), request_msg])
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.PredictBatch(batch, timeout=5.0)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "requests[1]." in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Observe(predictor_pb2.ObserveRequest(text="hello", true_output_tokens=0), timeout=5.0)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "true_output_tokens" in err.value.details()
        ok = await stub.Predict(predictor_pb2.PredictRequest(request_id="ok", text="still serving"), timeout=5.0)
    assert ok.predicted_output_tokens > 0, "a bad request never takes the service down"


async def test_observe_over_grpc_improves_the_next_prediction(served) -> None:
    target, engine = served
    prompt = "Translate the following paragraph into French and then explain every grammatical choice you made."
    async with PredictorClient(target) as client:
        before = await client.predict("o1", prompt, "tiny-llama", 0, timeout_s=5.0)
        assert before is not None
        truth = 1200 if before.tokens < 500 else 15
        size = len(engine.predictor.history)
        client.observe("o1", prompt, "tiny-llama", truth, finished_naturally=True)
        client.observe("o2", prompt, "tiny-llama", 5, finished_naturally=False)  # truncated: not learned
        await client.drain()
        after = await client.predict("o3", prompt, "tiny-llama", 0, timeout_s=5.0)
    assert len(engine.predictor.history) == size + 1
    assert after is not None and after.source != "cache", "Observe drops the stale cache entry"
    assert abs(after.tokens - truth) < abs(before.tokens - truth)


async def test_client_returns_none_quickly_when_the_predictor_is_unreachable() -> None:
    async with silent_server() as port, PredictorClient(f"127.0.0.1:{port}") as client:
        t0 = time.perf_counter()
        hung = await client.predict("t", "hello", "m", 0, timeout_s=0.05)
        hung_s = time.perf_counter() - t0
        client.observe("t", "hello", "m", 10)  # returns at once, never raises
    async with PredictorClient(f"127.0.0.1:{closed_port()}") as client:
        t0 = time.perf_counter()
        refused = await client.predict("t", "hello", "m", 0, timeout_s=0.05)
        refused_s = time.perf_counter() - t0
    assert hung is None and refused is None
    # NOTE: generous bounds (shared machine); the point is "the deadline, not a TCP timeout".
    assert hung_s < 1.0 and refused_s < 1.0, (hung_s, refused_s)
