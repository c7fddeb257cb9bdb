"""A Generate whose TTFT SLO admission cannot meet is refused with RESOURCE_EXHAUSTED and the
ErrorInfo reason SLO_UNMEETABLE (real gRPC, echo worker), which the client reads back; gRPC's
own RESOURCE_EXHAUSTED carries no reason."""

from __future__ import annotations

import grpc
import pytest

from sluice.common.client import error_reason
from sluice.v1 import common_pb2, generation_pb2
from sluice_bench.fault_harness import EchoWorker, stack

GENERATE = "/sluice.v1.GenerationService/Generate"


def request(rid: str, ttft_ms: float | None = None) -> bytes:
    r = generation_pb2.GenerateRequest(
        request_id=rid, text="hello world " * 5, sampling_params=common_pb2.SamplingParams(max_tokens=8)
    )
    if ttft_ms is not None:
        r.slo.ttft_ms = ttft_ms
    return r.SerializeToString()


async def test_an_unmeetable_ttft_slo_is_refused_with_its_reason_and_the_client_reads_it() -> None:
    worker = await EchoWorker.start(0)
    try:
        async with stack([worker.address]) as s:
            for i in range(20):  # the worker's measured speed: admission judges from it
                call = s.channel.unary_stream(GENERATE)(request(f"warm{i}"), metadata=s.metadata, timeout=30)
                assert [m async for m in call], "a request without an SLO is served"
            try:
                call = s.channel.unary_stream(GENERATE)(request("tight", 0.001), metadata=s.metadata, timeout=30)
                answered = [m async for m in call]
                raise AssertionError(f"a 1 us TTFT SLO was admitted: {len(answered)} messages")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                assert error_reason(exc) == "SLO_UNMEETABLE"
            with pytest.raises(grpc.aio.AioRpcError) as raised:  # past the server's message size limit
                await s.channel.unary_unary("/sluice.v1.GenerationService/GetStats")(
                    b"\x00" * (64 * 2**20), metadata=s.metadata, timeout=30
                )
            assert raised.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert error_reason(raised.value) is None  # gRPC's own refusal carries no reason
            left = await s.wait_idle()
    finally:
        await worker.stop()
    assert left == 0
