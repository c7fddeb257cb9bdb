"""Traces end to end: a request span with its phases, GenAI attributes and events, and the
worker's step spans linked to it across a real gRPC boundary (an in-process worker server
with the tiny model, plans carrying the request's traceparent), with the caller's context
carried in gRPC metadata by the OpenTelemetry aio interceptors."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from harness import LeasedStub
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sluice.common.grpc_server import CHANNEL_OPTIONS
from sluice.common.telemetry import (
    RequestTrace,
    TraceparentTable,
    grpc_client_interceptors,
    parse_traceparent,
    setup_tracing,
    step_span,
    tracing_enabled,
)
from sluice.contract.plan import CachedRequestData, NewRequestData, StepPlan
from sluice.contract.plan_codec import plan_to_proto, result_from_proto
from sluice.contract.sampling import SamplingParams
from sluice.v1 import worker_pb2, worker_pb2_grpc
from worker_service.engine import EngineConfig, LLMEngine
from worker_service.server import build_server

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = tuple(range(1000, 1020))  # 20 tokens: two blocks of 16


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    setup_tracing("sluice-test", exporter=exporter)
    setup_tracing("sluice-test", exporter=exporter)  # idempotent: spans are not exported twice
    return exporter


@pytest.fixture
def spans(exporter: InMemorySpanExporter) -> InMemorySpanExporter:
    exporter.clear()
    return exporter


def by_name(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def test_request_span_has_its_phases_genai_attributes_and_events(spans: InMemorySpanExporter) -> None:
    rt = RequestTrace(
        "req-1",
        {
            "model": "tiny-llama",
            "max_tokens": 8,
            "temperature": 0.0,
            "top_p": 1.0,
            "seed": 7,
            "input_tokens": 20,
            "policy": "sarathi",
            "slo_ttft_ms": 500.0,
            "predicted_length": 8,
            "prompt": "never recorded",
        },
        now_wall=100.0,
    )
    rt.phase("queue", 100.0)
    rt.phase("prefill", 100.5)
    rt.event("preemption", {"mode": "recompute", "reason": "kv_pressure"}, now_wall=100.6)
    rt.phase("queue", 100.6)
    rt.phase("prefill", 100.7)
    rt.phase("decode", 100.8)
    rt.finish({"output_tokens": 8, "finish_reasons": "length", "ttft_s": 0.8, "preemptions": 1}, now_wall=101.0)
    rt.finish({"output_tokens": 99}, error="a second finish is ignored")

    finished = spans.get_finished_spans()
    (request,) = by_name(finished, "text_completion tiny-llama")
    attrs = dict(request.attributes)
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert attrs["gen_ai.request.model"] == "tiny-llama"
    assert attrs["gen_ai.request.max_tokens"] == 8
    assert attrs["gen_ai.request.seed"] == 7
    assert attrs["gen_ai.usage.input_tokens"] == 20
    assert attrs["gen_ai.usage.output_tokens"] == 8
    assert attrs["gen_ai.response.finish_reasons"] == ("length",)
    assert attrs["gen_ai.latency.time_to_first_token"] == 0.8
    assert attrs["gen_ai.latency.e2e"] == pytest.approx(1.0)
    assert attrs["gen_ai.latency.time_in_queue"] == pytest.approx(0.5), "arrival to first scheduled"
    assert attrs["sluice.policy"] == "sarathi"
    assert attrs["sluice.slo.ttft_ms"] == 500.0
    assert attrs["sluice.predicted_length"] == 8
    assert attrs["sluice.preemptions"] == 1
    assert not any(v == "never recorded" for v in attrs.values()), "prompt text must never reach a span"
    assert request.status.is_ok
    (event,) = request.events
    assert (event.name, dict(event.attributes)) == ("preemption", {"mode": "recompute", "reason": "kv_pressure"})

    phases = sorted((s for s in finished if s.name in ("queue", "prefill", "decode")), key=lambda s: s.start_time)
    assert [s.name for s in phases] == ["queue", "prefill", "queue", "prefill", "decode"]
    assert all(s.parent.span_id == request.context.span_id for s in phases)
    assert all(s.context.trace_id == request.context.trace_id for s in phases)
    assert [s.start_time for s in phases[1:]] == [s.end_time for s in phases[:-1]], "phases tile the request"
    assert phases[-1].end_time == request.end_time == 101_000_000_000


def test_failed_request_span_is_an_error_and_traceparent_is_w3c(spans: InMemorySpanExporter) -> None:
    rt = RequestTrace("req-2", {"model": "m"})
    header = rt.traceparent()
    version, trace_id, span_id, flags = header.split("-")
    assert (version, len(trace_id), len(span_id), len(flags)) == ("00", 32, 16, 2)
    assert int(flags, 16) & 1, "sampled"
    parsed = parse_traceparent(header)
    assert parsed is not None and parsed.span_id == rt.span.get_span_context().span_id
    rt.finish({}, error="worker lost")
    (span,) = by_name(spans.get_finished_spans(), "text_completion m")
    assert span.status.status_code is trace.StatusCode.ERROR and span.status.description == "worker lost"
    with pytest.raises(ValueError, match="phase"):
        RequestTrace("req-3", {}).phase("thinking")


@pytest.mark.parametrize(
    "bad", ["", "00-abc", "00-" + "0" * 32 + "-" + "1" * 16 + "-01", "ff-" + "a" * 32 + "-" + "b" * 16]
)
def test_malformed_traceparents_are_ignored(bad: str) -> None:
    assert parse_traceparent(bad) is None


def test_traceparent_table_keeps_ids_until_release() -> None:
    table = TraceparentTable()
    table.update([("a", "tp-a"), ("b", "tp-b"), ("c", "")])
    assert table.lookup(["a", "b", "c", "x"]) == ["tp-a", "tp-b"]
    table.update([("c", "tp-c")], released=["a"])
    assert table.lookup(["a", "b", "c"]) == ["tp-b", "tp-c"] and len(table) == 2


def test_step_span_links_every_distinct_request(spans: InMemorySpanExporter) -> None:
    traces = [RequestTrace(f"r{i}", {}) for i in range(300)]
    parents = [t.traceparent() for t in traces]
    with step_span(2, 41, parents + parents[:5] + ["", "garbage"]):
        ...  # the step itself does nothing: only its span and links are under test
    (step,) = by_name(spans.get_finished_spans(), "sluice.step")
    assert step.parent is None, "a step is a root span: it serves many traces"
    assert len(step.links) == 300, "all of them, past the SDK's default limit of 128"
    assert {link.context.span_id for link in step.links} == {t.span.get_span_context().span_id for t in traces}
    assert dict(step.attributes)["sluice.step_id"] == 41


# ---------------------------------------------------------------- across gRPC


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny-llama", load_format="dummy", seed=0))


@pytest.fixture
async def stub(exporter: InMemorySpanExporter, engine: LLMEngine) -> AsyncIterator[LeasedStub]:
    assert tracing_enabled()
    server = build_server(engine, 0, worker_id=5)
    await server.start(ready=False)
    port = server.port
    channel = grpc.aio.insecure_channel(
        f"127.0.0.1:{port}", options=CHANNEL_OPTIONS, interceptors=grpc_client_interceptors()
    )
    async with channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        warm = await stub.Warmup(worker_pb2.WarmupRequest(num_gpu_blocks_override=16, swap_space_gib=0.001))
        yield LeasedStub(stub, warm.session_id)
    await server.server.stop(None)


def step_plan(step_id: int, scheduled: dict[str, int], sample: tuple[str, ...], new=(), cached=None) -> StepPlan:
    return StepPlan(
        step_id=step_id,
        worker_id=5,
        new_requests=tuple(new),
        cached_requests=cached or CachedRequestData(),
        num_scheduled_tokens=scheduled,
        sample_ids=frozenset(sample),
    )


async def test_worker_step_spans_link_to_the_request_span_across_grpc(
    spans: InMemorySpanExporter, stub: LeasedStub
) -> None:
    tracer = trace.get_tracer("test")
    rt = RequestTrace("traced", {"model": "tiny-llama", "max_tokens": 8})
    rt.phase("prefill")
    new = [
        NewRequestData("traced", PROMPT, len(PROMPT), GREEDY, (0, 1), traceparent=rt.traceparent()),
        NewRequestData("untraced", PROMPT, len(PROMPT), GREEDY, (2, 3)),
    ]
    plans = [
        step_plan(1, {"traced": 16, "untraced": 20}, ("untraced",), new=new),
        step_plan(2, {"traced": 4, "untraced": 1}, ("traced", "untraced")),
        step_plan(3, {"untraced": 1}, ("untraced",)),
    ]
    spans.clear()
    with tracer.start_as_current_span("scheduler-session") as session:
        call = stub.Execute()
        for p in plans:
            await call.write(plan_to_proto(p))
            result = result_from_proto(await call.read(), p)
            assert result.error is None, result.error
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
    rt.phase("decode")
    rt.finish({"output_tokens": 1})

    finished = spans.get_finished_spans()
    steps = sorted(by_name(finished, "sluice.step"), key=lambda s: dict(s.attributes)["sluice.step_id"])
    assert [dict(s.attributes)["sluice.step_id"] for s in steps] == [1, 2, 3]
    request_ctx = rt.span.get_span_context()
    for s in steps[:2]:
        (link,) = s.links
        assert (link.context.trace_id, link.context.span_id) == (request_ctx.trace_id, request_ctx.span_id)
        assert dict(s.attributes)["sluice.worker_id"] == "5"
    assert not steps[2].links, "the traced request is not in step 3"
    assert dict(steps[0].attributes)["sluice.step.num_tokens"] == 36

    # The caller's context crossed the gRPC boundary in metadata: the worker's Execute
    # server span is a child of the client span, which is a child of the session span.
    (server_span,) = [s for s in finished if s.name.endswith("WorkerService/Execute") and s.kind.name == "SERVER"]
    (client_span,) = [s for s in finished if s.name.endswith("WorkerService/Execute") and s.kind.name == "CLIENT"]
    assert client_span.parent.span_id == session.get_span_context().span_id
    assert server_span.parent.span_id == client_span.context.span_id
    assert server_span.context.trace_id == session.get_span_context().trace_id


async def test_released_requests_stop_being_linked(spans: InMemorySpanExporter, stub: LeasedStub) -> None:
    rt = RequestTrace("short", {})
    new = NewRequestData("short", PROMPT[:4], 4, GREEDY, (0,), traceparent=rt.traceparent())
    release = StepPlan(
        step_id=2,
        worker_id=5,
        new_requests=(NewRequestData("other", PROMPT[:4], 4, GREEDY, (1,)),),
        cached_requests=CachedRequestData(),
        num_scheduled_tokens={"other": 4},
        sample_ids=frozenset({"other"}),
        release_ids=("short",),
    )
    call = stub.Execute()
    for p in (step_plan(1, {"short": 4}, ("short",), new=[new]), release):
        await call.write(plan_to_proto(p))
        assert result_from_proto(await call.read(), p).error is None
    await call.done_writing()
    await call.read()
    rt.finish({})
    steps = sorted(by_name(spans.get_finished_spans(), "sluice.step"), key=lambda s: s.start_time)
    assert [len(s.links) for s in steps] == [1, 0]


async def test_one_trace_runs_from_the_client_through_the_scheduler_to_the_worker(spans: InMemorySpanExporter) -> None:
    from scheduler_service.live.config import LiveConfig
    from scheduler_service.live.service import LiveScheduler
    from scheduler_service.server import SchedulerServer
    from sluice.common.client import SluiceClient
    from worker_service.echo_engine import EchoEngine

    worker = build_server(EchoEngine(EngineConfig()), 0, worker_id=0)
    await worker.start(ready=False)
    port = worker.port
    live = LiveScheduler([f"127.0.0.1:{port}"], LiveConfig(num_gpu_blocks=64, max_num_batched_tokens=2048))
    scheduler = await SchedulerServer.start(live, 0)
    spans.clear()
    try:
        async with SluiceClient(f"127.0.0.1:{scheduler.port}", interceptors=grpc_client_interceptors()) as client:
            with trace.get_tracer("test").start_as_current_span("user") as user:
                done = await client.complete([1000] * 40, max_tokens=5, ignore_eos=True, request_id="chain")
        assert done.completion_tokens == 5
    finally:
        await scheduler.stop(grace_s=1.0, drain_s=0.0)
        await worker.server.stop(None)

    finished = spans.get_finished_spans()
    (request,) = [s for s in finished if dict(s.attributes or {}).get("gen_ai.request.id") == "chain"]
    attrs = dict(request.attributes)
    assert attrs["gen_ai.usage.output_tokens"] == 5 and attrs["gen_ai.response.finish_reasons"] == ("length",)
    assert attrs["gen_ai.request.max_tokens"] == 5 and attrs["sluice.policy"] == "vllm"
    assert request.context.trace_id == user.get_span_context().trace_id, "the client's trace continues"
    by_id = {s.context.span_id: s for s in finished}
    chain = []
    span = request
    while span.parent is not None and span.parent.span_id in by_id:
        span = by_id[span.parent.span_id]
        chain.append((span.name, span.kind.name))
    assert chain[-1][0] == "user"
    assert ("/sluice.v1.GenerationService/Generate", "SERVER") in chain
    assert ("/sluice.v1.GenerationService/Generate", "CLIENT") in chain
    phases = {s.name for s in finished if s.parent is not None and s.parent.span_id == request.context.span_id}
    assert {"queue", "prefill", "decode"} <= phases
    linked = [
        s
        for s in by_name(finished, "sluice.step")
        if any(link.context.span_id == request.context.span_id for link in s.links)
    ]
    assert len(linked) >= 5, "the prefill step and every decode step link to the request"
