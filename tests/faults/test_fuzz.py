"""Property-based fuzzing (hypothesis) of every request message of the Generation and Worker
APIs, each generated from its descriptor (values past every range: negative, huge, NaN,
unknown enum numbers, control characters, long strings and lists) and as raw bytes: no crash,
and every answer OK or INVALID_ARGUMENT (a step's own error INVALID_ARGUMENT; a Generate whose
SLO admission cannot meet at the measured speed may also be refused as designed:
RESOURCE_EXHAUSTED with the ErrorInfo reason SLO_UNMEETABLE). The worker's
Execute also gets plans near the valid region, which reach the engine and its sampler: the
torch engine runs them. A small, deterministic version; benchmarks/fault_suite.py runs more."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluice_bench.fault_harness import EchoWorker, fuzz_generation_api, fuzz_worker_api, stack
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
