"""OpenTelemetry tracing for Sluice: set-up from `OTEL_*`, request spans, worker step spans.

    client --Generate (traceparent in gRPC metadata)--> scheduler: grpc server span
        RequestTrace: request span "text_completion <model>" (child of the server span)
            phase spans: queue -> prefill -> decode (-> queue again after a preemption ...)
            events: preemption {mode, reason}, swap {direction, ...}
        NewRequestData.traceparent = RequestTrace.traceparent()  (once, with the plan)
    worker: step_span(worker_id, step_id, traceparents) -> one span per step, a root span
            LINKED to the request spans of every request the step advanced

Why links and not parents for steps: one step serves up to hundreds of requests from
different traces, and the Execute stream it runs in lives as long as the worker session;
a step is batch work, which OpenTelemetry models as a span with links to its causes.

`setup_tracing` installs the SDK tracer provider once per process. With no exporter (no
`OTEL_EXPORTER_OTLP_*ENDPOINT`, `OTEL_TRACES_EXPORTER` unset or `none`) it installs
nothing: every span is then the API's non-recording span and costs a few hundred
nanoseconds, `traceparent()` is "" and workers skip step spans. Attribute keys follow the
GenAI semantic conventions (plus vLLM's `gen_ai.latency.*`); ours are under `sluice.*`.
Prompt and completion text are never recorded (`_FORBIDDEN_KEYS` are dropped).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Status, StatusCode, TraceFlags

log = logging.getLogger(__name__)

TRACER_NAME = "sluice"
PHASES = ("queue", "prefill", "decode")
DEFAULT_OPERATION = "text_completion"
DEFAULT_MAX_LINKS = 1024  # a step may serve 256+ requests; the SDK's default keeps only 128 links

# Short names accepted in RequestTrace attributes -> semantic-convention keys. Keys that
# already contain a dot pass through unchanged; other short names go under "sluice.".
ATTRIBUTE_ALIASES: Mapping[str, str] = {
    "operation": "gen_ai.operation.name",
    "model": "gen_ai.request.model",
    "max_tokens": "gen_ai.request.max_tokens",
    "temperature": "gen_ai.request.temperature",
    "top_p": "gen_ai.request.top_p",
    "top_k": "gen_ai.request.top_k",
    "seed": "gen_ai.request.seed",
    "input_tokens": "gen_ai.usage.input_tokens",
    "prompt_tokens": "gen_ai.usage.input_tokens",
    "output_tokens": "gen_ai.usage.output_tokens",
    "completion_tokens": "gen_ai.usage.output_tokens",
    "finish_reason": "gen_ai.response.finish_reasons",
    "finish_reasons": "gen_ai.response.finish_reasons",
    "time_in_queue": "gen_ai.latency.time_in_queue",
    "queue_s": "gen_ai.latency.time_in_queue",
    "time_to_first_token": "gen_ai.latency.time_to_first_token",
    "ttft_s": "gen_ai.latency.time_to_first_token",
    "e2e": "gen_ai.latency.e2e",
    "e2e_s": "gen_ai.latency.e2e",
    "jct_s": "gen_ai.latency.e2e",
    "policy": "sluice.policy",
    "slo_ttft_ms": "sluice.slo.ttft_ms",
    "slo_tbt_ms": "sluice.slo.tbt_ms",
    "slo_jct_ms": "sluice.slo.jct_ms",
    "slo_class": "sluice.slo.class",
    "predicted_length": "sluice.predicted_length",
    "length_source": "sluice.predicted_length.source",
    "preemptions": "sluice.preemptions",
}
_FORBIDDEN_KEYS = frozenset(
    {"prompt", "text", "prompt_text", "gen_ai.prompt", "gen_ai.completion", "gen_ai.input.messages"}
    | {"gen_ai.output.messages", "sluice.prompt", "sluice.text", "sluice.prompt_text"}
)

_lock = threading.Lock()
_provider: Any = None  # the SDK TracerProvider this module installed, once per process
_exporters: set[int] = set()  # ids of exporters given to setup_tracing, each added once


# ---------------------------------------------------------------- set-up


def _env_exporter_names() -> list[str]:
    names = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if names:
        return [n.strip() for n in names.split(",") if n.strip() and n.strip() != "none"]
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return ["otlp"] if endpoint else []


def _env_exporter(name: str) -> Any:
    """An exporter for one `OTEL_TRACES_EXPORTER` name; each reads its own OTEL_* settings."""
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if name != "otlp":
        raise ValueError(f"OTEL_TRACES_EXPORTER={name!r} is not supported: use otlp, console or none")
    protocol = os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    )
    if protocol.startswith("http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        return HttpExporter()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def _sdk_disabled() -> bool:
    return os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def _make_provider(service_name: str) -> Any:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import SpanLimits, TracerProvider

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or service_name})
    max_links = None if "OTEL_SPAN_LINK_COUNT_LIMIT" in os.environ else DEFAULT_MAX_LINKS
    provider = TracerProvider(resource=resource, span_limits=SpanLimits(max_links=max_links))
    trace.set_tracer_provider(provider)
    return provider


def setup_tracing(service_name: str, exporter: Any = None) -> None:
    """Installs the SDK tracer provider (once per process) and its span processors.

    `exporter` given (tests: `InMemorySpanExporter`): exported synchronously through a
    SimpleSpanProcessor; each distinct exporter is added once, so several test modules can
    each bring their own. Otherwise the exporters named by the standard environment
    (`OTEL_TRACES_EXPORTER`, or OTLP when `OTEL_EXPORTER_OTLP_ENDPOINT` is set) go through a
    BatchSpanProcessor (configured by `OTEL_BSP_*`); with none named, nothing is installed.
    Idempotent: a second call with the same arguments changes nothing.
    """
    global _provider
    if _sdk_disabled():
        return
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    with _lock:
        if exporter is not None:
            if id(exporter) in _exporters:
                return
            _provider = _provider or _make_provider(service_name)
            _provider.add_span_processor(SimpleSpanProcessor(exporter))
            _exporters.add(id(exporter))
            return
        if _provider is not None:
            return
        names = _env_exporter_names()
        if not names:
            return
        _provider = _make_provider(service_name)
        for name in names:
            _provider.add_span_processor(BatchSpanProcessor(_env_exporter(name)))
        log.info("tracing %s to %s", service_name, ", ".join(names))


def tracing_enabled() -> bool:
    """Whether setup_tracing installed a provider (spans are recorded and exported)."""
    return _provider is not None


def shutdown_tracing() -> None:
    """Flushes and stops the span processors (services call it on shutdown)."""
    if _provider is not None:
        _provider.shutdown()


def _tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


# ---------------------------------------------------------------- attributes


def _attribute_value(key: str, value: Any) -> Any:
    if key == "gen_ai.response.finish_reasons":
        return [str(value)] if isinstance(value, str) or not isinstance(value, Iterable) else [str(v) for v in value]
    if isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Iterable):
        return [v if isinstance(v, bool | int | float | str) else str(v) for v in value]
    return str(value)


def normalize_attributes(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """Maps short names to semantic-convention keys, drops None values and any prompt or
    completion text, and turns other values into OpenTelemetry attribute types."""
    out: dict[str, Any] = {}
    for raw_key, value in attributes.items():
        if value is None:
            continue
        key = ATTRIBUTE_ALIASES.get(raw_key, raw_key if "." in raw_key else f"sluice.{raw_key}")
        if raw_key in _FORBIDDEN_KEYS or key in _FORBIDDEN_KEYS:
            continue
        out[key] = _attribute_value(key, value)
    return out


def _ns(wall_s: float | None) -> int:
    return time.time_ns() if wall_s is None else int(wall_s * 1e9)


# ---------------------------------------------------------------- request spans


class RequestTrace:
    """The span of one request on the scheduler, with one child span per phase.

    Created when the request is admitted, in the context of the Generate handler (so it is a
    child of the gRPC server span, itself a child of the client's span). The live loop calls
    `phase` as the request moves (queue -> prefill -> decode; back to queue when preempted),
    `event` for preemptions and swaps, and `finish` once; later calls after `finish` do
    nothing. Times are wall-clock seconds (`time.time()`), default now.
    """

    __slots__ = ("_finished", "_first_run_ns", "_phase", "_phase_name", "_span", "_start_ns", "request_id")

    def __init__(self, request_id: str, attributes: Mapping[str, Any], now_wall: float | None = None) -> None:
        self.request_id = request_id
        attrs = {"gen_ai.operation.name": DEFAULT_OPERATION, **normalize_attributes(attributes)}
        attrs["gen_ai.request.id"] = request_id
        model = attrs.get("gen_ai.request.model")
        name = f"{attrs['gen_ai.operation.name']} {model}" if model else str(attrs["gen_ai.operation.name"])
        self._start_ns = _ns(now_wall)
        self._span: Span = _tracer().start_span(
            name, kind=SpanKind.INTERNAL, attributes=attrs, start_time=self._start_ns
        )
        self._phase: Span | None = None
        self._phase_name = ""
        self._first_run_ns: int | None = None
        self._finished = False

    @property
    def span(self) -> Span:
        return self._span

    @property
    def current_phase(self) -> str:
        return self._phase_name

    def phase(self, name: str, now_wall: float | None = None) -> None:
        """Closes the open phase span and opens `name` ("queue", "prefill" or "decode")."""
        if name not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {name!r}")
        if self._finished or name == self._phase_name:
            return
        at = _ns(now_wall)
        if self._phase is not None:
            self._phase.end(end_time=at)
        if name != "queue" and self._first_run_ns is None:
            self._first_run_ns = at
        parent = trace.set_span_in_context(self._span)
        self._phase = _tracer().start_span(name, context=parent, start_time=at)
        self._phase_name = name

    def event(self, name: str, attributes: Mapping[str, Any], now_wall: float | None = None) -> None:
        """An event on the request span: "preemption" {mode, reason}, "swap" {direction, blocks}."""
        if not self._finished:
            self._span.add_event(name, normalize_event(attributes), timestamp=_ns(now_wall))

    def traceparent(self) -> str:
        """The W3C traceparent of the request span; "" when tracing is not set up."""
        ctx = self._span.get_span_context()
        if not ctx.is_valid:
            return ""
        return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"

    def finish(self, attributes: Mapping[str, Any], error: str | None = None, now_wall: float | None = None) -> None:
        """Sets the final attributes (usage, finish reason, latencies) and ends every span.

        `gen_ai.latency.e2e` and `.time_in_queue` are filled from the span's own times when
        the caller does not give them; `error` marks the span ERROR with that description."""
        if self._finished:
            return
        self._finished = True
        at = _ns(now_wall)
        attrs = normalize_attributes(attributes)
        attrs.setdefault("gen_ai.latency.e2e", (at - self._start_ns) / 1e9)
        if self._first_run_ns is not None:
            attrs.setdefault("gen_ai.latency.time_in_queue", (self._first_run_ns - self._start_ns) / 1e9)
        self._span.set_attributes(attrs)
        if self._phase is not None:
            self._phase.end(end_time=at)
            self._phase, self._phase_name = None, ""
        if error is not None:
            self._span.set_status(Status(StatusCode.ERROR, error))
        self._span.end(end_time=at)


def normalize_event(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """Event attributes keep their short names ("mode", "reason"): they are scoped by the event."""
    return {k: _attribute_value(k, v) for k, v in attributes.items() if v is not None and k not in _FORBIDDEN_KEYS}


# ---------------------------------------------------------------- worker step spans


@functools.lru_cache(maxsize=8192)
def parse_traceparent(traceparent: str) -> SpanContext | None:
    """A remote SpanContext from a W3C traceparent ("00-<trace>-<span>-<flags>"), or None.

    NOTE: cached, and parsed by hand: a step links every request it serves, and the
    propagator's regex costs ~5 us per header, which at 256 requests is a quarter of the
    overhead budget of a 20 ms step."""
    parts = traceparent.split("-")
    if len(parts) < 4 or len(parts[1]) != 32 or len(parts[2]) != 16 or parts[0] == "ff":
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3][:2], 16)
    except ValueError:
        return None
    if trace_id == 0 or span_id == 0:
        return None
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags))


def step_links(traceparents: Iterable[str]) -> list[Link]:
    seen: set[str] = set()
    links = []
    for tp in traceparents:
        if tp and tp not in seen:
            seen.add(tp)
            ctx = parse_traceparent(tp)
            if ctx is not None:
                links.append(Link(ctx))
    return links


@contextlib.contextmanager
def step_span(worker_id: str | int, step_id: int, traceparents: Iterable[str]) -> Iterator[Span]:
    """Worker side: a span for one step, linked to the request spans it served.

    A root span (see the module docstring); when tracing is not set up it yields the
    non-recording INVALID_SPAN without parsing anything. An exception inside marks the span
    ERROR and propagates."""
    if _provider is None:
        yield trace.INVALID_SPAN
        return
    attributes = {"sluice.worker_id": str(worker_id), "sluice.step_id": step_id}
    links = step_links(traceparents)
    attributes["sluice.step.num_linked_requests"] = len(links)
    with _tracer().start_as_current_span(
        "sluice.step", context=otel_context.Context(), kind=SpanKind.INTERNAL, attributes=attributes, links=links
    ) as span:
        yield span


# ---------------------------------------------------------------- gRPC instrumentation


def grpc_server_interceptors() -> list[Any]:
    """Interceptors for `grpc.aio.server(interceptors=...)`: a server span per RPC whose
    parent is the caller's context from the W3C `traceparent` metadata.

    NOTE: the aio server interceptor wraps streaming handlers with `async for`, so every
    server-streaming handler must be an async generator (`yield`); handlers that use
    `await context.write()` fail with UNKNOWN (opentelemetry-python-contrib #3066)."""
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor()]


def grpc_client_interceptors() -> list[Any]:
    """Interceptors for one `grpc.aio.insecure_channel(..., interceptors=...)`: a client span
    per RPC and the current context injected into the call's metadata."""
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return list(aio_client_interceptors())


_client_instrumentor: Any = None


def instrument_grpc_client() -> None:
    """Instruments every `grpc.aio` channel created from now on in this process (idempotent).

    Channels made before this call are not instrumented; give those
    `grpc_client_interceptors()` instead."""
    global _client_instrumentor
    with _lock:
        if _client_instrumentor is not None:
            return
        from opentelemetry.instrumentation.grpc import GrpcAioInstrumentorClient

        _client_instrumentor = GrpcAioInstrumentorClient()
        _client_instrumentor.instrument()


class TraceparentTable:
    """Worker side: the traceparent of each request the worker holds.

    A request's traceparent travels once, in the plan that first sends it (NewRequestData);
    later plans name it by id only, so the worker keeps the mapping until the request is
    released, and looks up the ids of each step for `step_span`."""

    def __init__(self) -> None:
        self._by_id: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def update(self, new: Iterable[tuple[str, str]], released: Iterable[str] = ()) -> None:
        """Forgets `released` ids first (a plan releases before it admits), then records `new`."""
        self.forget(released)
        for request_id, traceparent in new:
            if traceparent:
                self._by_id[request_id] = traceparent
            else:
                self._by_id.pop(request_id, None)

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._by_id.pop(request_id, None)

    def clear(self) -> None:
        self._by_id.clear()

    def lookup(self, request_ids: Iterable[str]) -> list[str]:
        by_id = self._by_id
        return [tp for tp in map(by_id.get, request_ids) if tp]
