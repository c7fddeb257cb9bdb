"""Property-based fuzzing (hypothesis) of every request message of the Generation and Worker
APIs, each generated from its descriptor (values past every range: negative, huge, NaN,
unknown enum numbers, control characters, long strings and lists) and as raw bytes: no crash,
and every answer OK or INVALID_ARGUMENT (a step's own error INVALID_ARGUMENT; a Generate whose
SLO admission cannot meet at the measured speed may also be refused as designed:
RESOURCE_EXHAUSTED with the ErrorInfo reason SLO_UNMEETABLE). The worker's
Execute also gets plans near the valid region, which reach the engine and its sampler: the
torch engine runs them. The OpenAI HTTP API served in the scheduler's process gets JSON bodies
(valid ones with fields past their ranges, any JSON, raw bytes): a 4xx or the answer, never a
5xx. A small, deterministic version; benchmarks/fault_suite.py runs more."""

from __future__ import annotations

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway_service.app import Gateway
from gateway_service.config import GatewayConfig
from gateway_service.server import GatewayServer
from scheduler_service.inprocess import InProcessLink
from sluice_bench.fault_harness import EchoWorker, fuzz_generation_api, fuzz_openai_api, fuzz_worker_api, stack
from worker_service.engine import EngineConfig, LLMEngine
from worker_service.server import build_server

EXAMPLES = 25


async def test_the_generation_api_answers_every_message_ok_or_invalid_argument(
    caplog: pytest.LogCaptureFixture,
) -> None:
    worker = await EchoWorker.start(0)
    try:
        async with stack([worker.address]) as s:
            report = await fuzz_generation_api(s, EXAMPLES)
            health = await health_pb2_grpc.HealthStub(s.channel).Check(health_pb2.HealthCheckRequest(service=""))
            left = await s.wait_idle()
    finally:
        await worker.stop()
    assert report.unexpected == []
    assert report.total >= 4 * EXAMPLES and report.count("INVALID_ARGUMENT") > 0
    assert health.status == health_pb2.HealthCheckResponse.SERVING and left == 0
    assert not [r for r in caplog.records if r.exc_info], "no traceback logged"


async def test_the_openai_api_in_the_schedulers_process_answers_every_body_with_the_answer_or_a_client_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Served from the scheduler's own process, a bad HTTP body must cost no more than over gRPC:
    a 4xx in OpenAI's error JSON (never a 5xx or a cut stream), nothing held afterwards, and the
    scheduler still answering."""
    worker = await EchoWorker.start(0)
    try:
        async with stack([worker.address], num_gpu_blocks=256) as s:
            cfg = GatewayConfig(port=0)
            front = await GatewayServer.start(cfg, Gateway(cfg, link=InProcessLink(s.live)))
            try:
                report = await fuzz_openai_api(f"http://127.0.0.1:{front.port}", 8 * EXAMPLES)
                async with httpx.AsyncClient(timeout=30) as http:
                    after = await http.post(
                        f"http://127.0.0.1:{front.port}/v1/completions", json={"prompt": "still here", "max_tokens": 2}
                    )
            finally:
                await front.stop()
            left = await s.wait_idle()
    finally:
        await worker.stop()
    assert report.unexpected == []
    assert report.count("200") > 0 and report.count("400") > 0, report.answers
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 2
    assert left == 0, "no request or KV block held after the fuzzing"
    assert not [r for r in caplog.records if r.exc_info], "no traceback logged"


async def test_the_worker_api_answers_every_message_ok_or_invalid_argument_and_keeps_serving() -> None:
    worker = await EchoWorker.start(0)
    try:
        report, unwell = await fuzz_worker_api(
            worker.address, EXAMPLES, methods=("Info", "Warmup", "Execute", "Release", "Health")
        )
    finally:
        await worker.stop()
    assert report.unexpected == []
    assert report.answers["Execute"]["OK"] > 0, "some plans were valid and ran"
    assert report.answers["Execute"]["INVALID_ARGUMENT"] > 0
    assert unwell == ""


async def test_random_plans_never_break_the_torch_engine() -> None:
    engine = LLMEngine(EngineConfig(model="tiny-llama", load_format="dummy", seed=0))
    server = build_server(engine, 0)
    await server.start(ready=False)
    try:
        report, unwell = await fuzz_worker_api(f"127.0.0.1:{server.port}", 2 * EXAMPLES, methods=("Execute",))
    finally:
        await server.server.stop(None)
    assert report.unexpected == []
    assert report.answers["Execute"]["OK"] > 0
    assert unwell == "", "the engine never failed (a failure turns the worker NOT_SERVING)"


def test_status_codes_are_compared_by_name() -> None:
    assert grpc.StatusCode.INVALID_ARGUMENT.name == "INVALID_ARGUMENT"
