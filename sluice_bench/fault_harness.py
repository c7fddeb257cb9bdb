"""The pieces the fault suite (tests/faults/) and its benchmark (benchmarks/fault_suite.py) are
built from: real gRPC servers on loopback, in this process or as `sluice worker` processes.

    EchoWorker.start(...)            an in-process worker serving the engine-free echo engine
    spawn_worker_process(...)        a `sluice worker --engine echo` process (SIGKILL-able)
    Stack.start(addresses, ...)      an in-process scheduler over those workers + a client channel
    Stack.generate / collect         one request's stream, its tokens, its ending (status or reason)
    Stack.idle_kv()                  KV blocks and requests still held, on the scheduler's books

The scenarios themselves (`scenario_*`) take their sizes as arguments: the tests run small but
real versions, the benchmark the heavy ones, and both report the same figures.
"""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_status import rpc_status

from scheduler_service.live.config import LiveConfig
from scheduler_service.live.service import LiveScheduler
from scheduler_service.server import SchedulerServer
from services.child import start_listening
from sluice.common.client import error_reason
from sluice.common.grpc_server import KEEPALIVE, GrpcServer, Keepalive
from sluice.common.prom import ServingMetrics
from sluice.common.security import PLAINTEXT, ClientSecurity, ServerSecurity
from sluice.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from worker_service.echo_engine import EchoEngine
from worker_service.engine import EngineConfig
from worker_service.server import WorkerServerOptions, build_server

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- workers


@dataclass
class EchoWorker:
    """An in-process worker over the echo engine (plans checked exactly as the torch worker
    checks them, tokens synthetic)."""

    engine: EchoEngine
    server: GrpcServer

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    @classmethod
    async def start(
        cls,
        worker_id: int = 0,
        *,
        port: int = 0,
        step_time_s: float = 0.0,
        options: WorkerServerOptions | None = None,
        engine: EchoEngine | None = None,
    ) -> EchoWorker:
        engine = engine or EchoEngine(EngineConfig(model="tiny-llama"), step_time_s=step_time_s)
        server = build_server(engine, port, worker_id=worker_id, options=options)
        await server.start(ready=False)
        return cls(engine, server)

    async def stop(self) -> None:
        await self.server.server.stop(None)


@dataclass
class WorkerProcess:
    process: subprocess.Popen
    address: str

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def kill(self) -> None:
        """SIGKILL: no goodbye, as a crash or the OOM killer ends a process."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


async def spawn_worker_process(
    worker_id: int = 0,
    *,
    port: int = 0,
    step_ms: float = 0.0,
    extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> WorkerProcess:
    """A `sluice worker --engine echo` process on loopback; returns once it listens. `env`:
    variables added to its environment (e.g. SLUICE_API_KEY, as `sluice serve` passes it)."""
    cmd = [sys.executable, "-m", "services.cli", "worker", "--engine", "echo", "--model", "tiny-llama"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--worker-id", str(worker_id), "--threads", "1"]
    cmd += ["--echo-step-ms", str(step_ms), *extra]
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_") or k == "SLUICE_DATA_DIR"}
    environment.update(env or {})
    # NOTE: started from a helper thread, so not tied to it by the kernel (die_with_us): the
    # tests and the suite stop their workers themselves
    process, address = await asyncio.to_thread(start_listening, cmd, env=environment, cwd=ROOT, die_with_us=False)
    return WorkerProcess(process, address)


# ---------------------------------------------------------------- the scheduler


@dataclass
class Ending:
    """How one Generate call ended: its tokens, and a final finish reason or a status."""

    tokens: list[int] = field(default_factory=list)
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""
    detail_types: tuple[str, ...] = ()
    request_id: str = ""
    slo_met: bool = False

    @property
    def ok(self) -> bool:
        return self.code == grpc.StatusCode.OK


@dataclass
class Stack:
    server: SchedulerServer
    channel: grpc.aio.Channel
    metadata: tuple[tuple[str, str], ...] = ()

    @property
    def stub(self) -> generation_pb2_grpc.GenerationServiceStub:
        return generation_pb2_grpc.GenerationServiceStub(self.channel)

    @property
    def live(self) -> LiveScheduler:
        return self.server.live

    async def collect(self, call: grpc.aio.UnaryStreamCall) -> Ending:
        ending = Ending()
        try:
            while (message := await call.read()) is not grpc.aio.EOF:
                ending.tokens += message.token_ids
                ending.request_id = message.request_id
                if message.finish_reason:
                    ending.finish_reason = message.finish_reason
                    ending.slo_met = message.timings.slo_met
        except asyncio.CancelledError:
            if not call.cancelled():
                raise
            ending.code = grpc.StatusCode.CANCELLED  # cancelled by this client
        except grpc.aio.AioRpcError as exc:
            ending.code, ending.details = exc.code(), exc.details() or ""
            status = await rpc_status.aio.from_call(call)
            if status is not None:
                ending.detail_types = tuple(d.type_url.rsplit("/", 1)[-1] for d in status.details)
        return ending

    async def generate(self, **fields: object) -> Ending:
        call = self.stub.Generate(generation_pb2.GenerateRequest(**fields), metadata=self.metadata)
        return await self.collect(call)

    async def stats(self) -> generation_pb2.GetStatsResponse:
        return await self.stub.GetStats(generation_pb2.GetStatsRequest(), metadata=self.metadata)

    async def held(self) -> int:
        """KV blocks owned plus requests held, on the scheduler's books (0 when idle)."""
        s = await self.stats()
        blocks = sum(w.gpu_blocks_used + w.cpu_blocks_used for w in s.workers)
        return blocks + s.num_running + s.num_waiting + s.num_swapped

    async def wait_idle(self, timeout_s: float = 20.0) -> int:
        """Waits until nothing is held; returns what is left when the time is up."""
        left = await self.held()
        for _ in range(int(timeout_s / 0.05)):
            if left == 0:
                return 0
            await asyncio.sleep(0.05)
            left = await self.held()
        return left


@asynccontextmanager
async def stack(
    addresses: Sequence[str],
    *,
    security: ServerSecurity | None = None,
    client: ClientSecurity = PLAINTEXT,
    worker_client: ClientSecurity = PLAINTEXT,
    keepalive: Keepalive = KEEPALIVE,
    serving: ServingMetrics | None = None,
    **config: object,
) -> AsyncIterator[Stack]:
    """A scheduler over `addresses` (64 KV blocks per worker unless given) and a client channel."""
    cfg = LiveConfig(**{"num_gpu_blocks": 64, "swap_space_gib": 0.001, **config})  # type: ignore[arg-type]
    live = LiveScheduler(addresses, cfg, serving, security=worker_client, keepalive=keepalive)
    server = await SchedulerServer.start(live, security=security, keepalive=keepalive)
    try:
        async with client.channel(f"127.0.0.1:{server.port}", keepalive.channel_options()) as channel:
            yield Stack(server, channel, client.metadata)
    finally:
        await server.stop(grace_s=1.0, drain_s=0.0)


def prompt(i: int, n: int = 24) -> common_pb2.TokenIds:
    return common_pb2.TokenIds(ids=[1000 + (i * 7 + k) % 20000 for k in range(n)])


def sampling(max_tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def rss_mb() -> float:
    """This process's resident memory now, in MB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def metric(serving: ServingMetrics, name: str, **labels: str) -> float:
    for family in serving.registry.collect():
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(f"{name} {labels}")


# ---------------------------------------------------------------- fuzzing


def message_strategy(cls: type, depth: int = 0) -> Any:
    """Any message of type `cls`: every field, by its descriptor, with values that reach past
    every range (negative, huge, NaN, unknown enum numbers, control characters, long strings,
    long lists), and nested messages to a few levels."""
    from google.protobuf.descriptor import FieldDescriptor as F
    from hypothesis import strategies as st

    descriptor = cls.DESCRIPTOR

    def scalar(field: Any) -> Any:
        if field.type == F.TYPE_MESSAGE:
            return message_strategy(field.message_type._concrete_class, depth + 1) if depth < 3 else st.none()
        if field.type == F.TYPE_ENUM:
            return st.integers(-3, 12)
        if field.type in (F.TYPE_UINT32, F.TYPE_FIXED32):
            return st.one_of(st.integers(0, 40), st.integers(0, 2**32 - 1))
        if field.type in (F.TYPE_UINT64, F.TYPE_FIXED64):
            return st.one_of(st.integers(0, 40), st.integers(0, 2**64 - 1))
        if field.type in (F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32):
            return st.integers(-(2**31), 2**31 - 1)
        if field.type in (F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64):
            return st.integers(-(2**63), 2**63 - 1)
        if field.type in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
            return st.one_of(st.floats(-10, 10), st.floats(allow_nan=True, allow_infinity=True, width=32))
        if field.type == F.TYPE_BOOL:
            return st.booleans()
        if field.type == F.TYPE_BYTES:
            return st.binary(max_size=64)
        return st.one_of(st.text(max_size=12), st.text(max_size=400), st.just("x" * 300))

    def field_values(field: Any) -> Any:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            return st.dictionaries(scalar(key), scalar(value), max_size=40)
        if field.is_repeated:
            return st.lists(scalar(field), max_size=20 if depth else 80)
        return scalar(field)

    chosen = {f.name: st.one_of(st.none(), field_values(f)) for f in descriptor.fields}
    return st.fixed_dictionaries(chosen).map(lambda values: _build(cls, values))


def _build(cls: type, values: dict[str, Any]) -> Any:
    msg = cls()
    for name, value in values.items():
        if value is None:
            continue
        field = getattr(msg, name)
        if isinstance(value, dict):
            field.update(value)
        elif isinstance(value, list):
            if value and hasattr(value[0], "SerializeToString"):
                field.extend(v for v in value if v is not None)
            else:
                field.extend(value)
        elif hasattr(value, "SerializeToString"):
            field.CopyFrom(value)
        else:
            setattr(msg, name, value)
    return msg


def plausible_generates() -> Any:
    """Generate requests near the valid region (short prompts, sampling and SLOs in or just
    past their ranges), so fuzzing reaches admission, scheduling and the stream."""
    from hypothesis import strategies as st

    sampling_values = st.builds(
        common_pb2.SamplingParams,
        temperature=st.one_of(st.none(), st.floats(-1, 101, width=32)),
        top_p=st.one_of(st.none(), st.floats(0, 1.25, width=32)),
        top_k=st.one_of(st.none(), st.integers(0, 40000)),
        max_tokens=st.one_of(st.none(), st.integers(0, 40)),
        min_tokens=st.one_of(st.none(), st.integers(0, 50)),
        stop=st.lists(st.text(max_size=5), max_size=3),
        seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
        n=st.one_of(st.none(), st.integers(0, 2)),
    )
    slo = st.builds(
        common_pb2.SloSpec,
        ttft_ms=st.one_of(st.none(), st.floats(-10, 5000)),
        tbt_ms=st.one_of(st.none(), st.floats(allow_nan=True)),
        slo_class=st.integers(-1, 3),
    )
    prompt_fields = st.one_of(
        st.fixed_dictionaries({"text": st.text(min_size=0, max_size=200)}),
        st.fixed_dictionaries(
            {"token_ids": st.lists(st.integers(0, 31000), max_size=60).map(lambda ids: common_pb2.TokenIds(ids=ids))}
        ),
    )
    return st.builds(
        lambda p, sp, sl, pr, rid: generation_pb2.GenerateRequest(
            **p, sampling_params=sp, slo=sl, priority=pr, request_id=rid
        ),
        prompt_fields,
        sampling_values,
        slo,
        st.integers(-2000, 2000),
        st.text(alphabet=st.characters(max_codepoint=0x7F), max_size=20),
    )


def plausible_plans() -> Any:
    """Step plans near the valid region (small ids, blocks and counts), so fuzzing reaches the
    engine and its sampler, not only the first check."""
    from hypothesis import strategies as st

    from sluice.v1 import worker_pb2

    sampling_values = st.builds(
        common_pb2.SamplingParams,
        temperature=st.one_of(st.none(), st.floats(0, 100), st.floats(allow_nan=True, width=32)),
        top_p=st.one_of(st.none(), st.floats(0, 1, width=32)),
        top_k=st.one_of(st.none(), st.integers(0, 2**32 - 1)),
        min_p=st.one_of(st.none(), st.floats(0, 1, width=32)),
        max_tokens=st.one_of(st.none(), st.integers(0, 64)),
        seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
        repetition_penalty=st.one_of(st.none(), st.floats(0, 12, width=32)),
        presence_penalty=st.one_of(st.none(), st.floats(-3, 3, width=32)),
        frequency_penalty=st.one_of(st.none(), st.floats(-3, 3, width=32)),
        stop_token_ids=st.lists(st.integers(0, 40000), max_size=3),
    )
    new = st.builds(
        worker_pb2.NewRequest,
        request_id=st.sampled_from(["a", "b", "c", ""]),
        prompt_token_ids=st.lists(st.integers(0, 31000), min_size=0, max_size=40),
        sampling_params=sampling_values,
        block_ids=st.lists(st.integers(0, 70), max_size=4),
        num_computed_tokens=st.integers(0, 50),
    )
    return st.builds(
        lambda news, counts, samples, step: worker_pb2.ExecuteRequest(
            step_id=step,
            new_requests=news,
            scheduled_ids=[n.request_id for n in news],
            num_scheduled_tokens=counts[: len(news)],
            sample=samples[: len(news)],
        ),
        st.lists(new, max_size=3),
        st.lists(st.integers(0, 60), min_size=3, max_size=3),
        st.lists(st.booleans(), min_size=3, max_size=3),
        st.integers(0, 2**64 - 1),
    )


@dataclass
class FuzzReport:
    """Answers by method and status code ("OK", "INVALID_ARGUMENT", ...; a step's own error
    counts by its StepError code)."""

    answers: dict[str, Counter] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)

    def add(self, method: str, code: str, allowed: Sequence[str], example: object) -> None:
        self.answers.setdefault(method, Counter())[code] += 1
        if code not in allowed:
            self.unexpected.append(f"{method}: {code} for {str(example)[:300]!r}")

    @property
    def total(self) -> int:
        return sum(sum(c.values()) for c in self.answers.values())

    def count(self, code: str) -> int:
        return sum(c[code] for c in self.answers.values())


def run_examples(
    loop: asyncio.AbstractEventLoop, strategy: Any, send: Any, examples: int, seed: int | None = None
) -> None:
    """Feeds `examples` values of `strategy` to the coroutine function `send`, on `loop` (this
    runs on a thread: hypothesis is synchronous, the servers live on the loop)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as seeded

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=seed is None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(strategy)
    def check(value: Any) -> None:
        asyncio.run_coroutine_threadsafe(send(value), loop).result(120)

    (seeded(seed)(check) if seed is not None else check)()


_GENERATION_METHODS = ("Generate", "Abort", "GetServerInfo", "GetStats")
_OK_OR_INVALID = ("OK", "INVALID_ARGUMENT")
_GENERATE_ANSWERS = (*_OK_OR_INVALID, "SLO_UNMEETABLE")


async def fuzz_generation_api(s: Stack, examples: int, seed: int | None = None) -> FuzzReport:
    """Every request message of the Generation API, generated and as raw bytes; an answer must
    be OK or INVALID_ARGUMENT. A Generate that is accepted is cancelled after its first message."""
    from hypothesis import strategies as st

    report = FuzzReport()
    loop = asyncio.get_running_loop()
    types = {
        "Generate": generation_pb2.GenerateRequest,
        "Abort": generation_pb2.AbortRequest,
        "GetServerInfo": generation_pb2.GetServerInfoRequest,
        "GetStats": generation_pb2.GetStatsRequest,
    }

    async def send(pair: tuple[str, bytes, object]) -> None:
        method, data, example = pair
        path = f"/sluice.v1.GenerationService/{method}"
        try:
            if method == "Generate":
                call = s.channel.unary_stream(path)(data, metadata=s.metadata, timeout=30)
                await call.read()
                call.cancel()
            else:
                await s.channel.unary_unary(path)(data, metadata=s.metadata, timeout=30)
            code = "OK"
        except grpc.aio.AioRpcError as exc:
            code = exc.code().name
            if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and error_reason(exc) == "SLO_UNMEETABLE":
                # NOTE: a valid request whose SLO (say a TTFT of 1 ms) admission cannot meet at
                # the measured speed is refused by design; gRPC's own RESOURCE_EXHAUSTED (an
                # oversized message) and a full queue carry no such reason and stay unexpected
                code = "SLO_UNMEETABLE"
        report.add(method, code, _GENERATE_ANSWERS if method == "Generate" else _OK_OR_INVALID, example)

    def pairs(method: str) -> Any:
        messages = message_strategy(types[method])
        if method == "Generate":
            messages = st.one_of(messages, plausible_generates())
        generated = messages.map(lambda m: (method, m.SerializeToString(), m))
        raw = st.binary(max_size=200).map(lambda b: (method, b, b))
        return st.one_of(generated, raw)

    for method in _GENERATION_METHODS:
        await asyncio.to_thread(run_examples, loop, pairs(method), send, examples, seed)
    return report


# ---------------------------------------------------------------- the OpenAI HTTP API

# Statuses a generation route may answer a fuzzed body with: the answer, a 400 naming the field,
# a 404 for an unknown model, a 413 for a body over the limit, and the 429 of a request whose
# SLOs admission cannot meet at the measured speed (a 1 ms TTFT, say). Never a 5xx.
_HTTP_ANSWERS = (200, 400, 404, 413, 429)
OPENAI_ROUTES = ("/v1/completions", "/v1/chat/completions")


def openai_bodies() -> Any:
    """(route, body bytes, example) for the generation routes: JSON objects with the fields
    clients send, each either near its valid range or any JSON value; any JSON value as the
    whole body; and raw bytes."""
    import json

    from hypothesis import strategies as st

    scalar = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**40), 2**40),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=20),
    )
    anything = st.recursive(
        scalar,
        lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
        max_leaves=8,
    )
    # the edges of the wire's integer types and of the fields' ranges, where parsing breaks
    edges = st.sampled_from([-(2**63), -(2**31) - 1, -2, -1, 0, 1, 2**31, 2**32, 2**63, 2**64])

    ids = st.lists(st.integers(0, 40000) | edges, max_size=8)
    message = st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool", "robot"]) | anything},
        optional={
            "content": st.text(max_size=30)
            | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)}), max_size=2)
            | anything,
            "name": anything,
        },
    )

    def ints(low: int, high: int) -> Any:
        return st.integers(low, high) | edges | anything

    def near(low: float, high: float) -> Any:
        return st.floats(low, high) | st.integers(int(low) - 2, int(high) + 2) | anything

    fields = {
        "model": st.sampled_from(["tiny-llama", "", "gpt-4"]) | anything,
        "prompt": st.one_of(
            st.text(max_size=40), st.lists(st.text(max_size=10), max_size=3), ids, st.lists(ids, max_size=2), anything
        ),
        "messages": st.lists(message, max_size=3) | anything,
        "max_tokens": ints(1, 3000),
        "max_completion_tokens": ints(1, 3000),
        "temperature": near(-1, 3),
        "top_p": near(-0.5, 1.5),
        "top_k": ints(-1, 100),
        "seed": ints(0, 2**32),
        "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=5) | anything,
        "n": ints(1, 4),
        "stream": st.booleans() | anything,
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | anything}) | anything,
        "logprobs": st.booleans() | st.integers(-1, 3) | anything,
        "user": st.text(max_size=300) | anything,
        "priority": ints(-5000, 5000),
        "ttft_ms": near(0, 10_000),
        "tbt_ms": near(0, 1_000),
        "jct_ms": near(0, 100_000),
        "slo_class": st.sampled_from(["online", "offline", "batch"]) | anything,
        "predicted_output_tokens": ints(0, 5000),
        "ignore_eos": st.booleans() | anything,
        "min_tokens": ints(0, 100),
        "request_id": st.text(max_size=80) | anything,
    }
    # a valid request (a prompt and messages both: each route reads its own) with one or two
    # fields drawn as above, so the fields past the first check get reached as well
    valid = st.fixed_dictionaries(
        {
            "prompt": st.text(min_size=1, max_size=20),
            "messages": st.just([{"role": "user", "content": "hi"}]),
            "max_tokens": st.integers(1, 16),
            "stream": st.booleans(),
        }
    )
    extra = st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=2, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({name: fields[name] for name in names})
    )
    nearly = st.tuples(valid, extra).map(lambda t: {**t[0], **t[1]})
    dumped = st.one_of(nearly, nearly, st.fixed_dictionaries({}, optional=fields)).map(
        lambda d: (json.dumps(d).encode(), d)
    )
    whole = anything.map(lambda v: (json.dumps(v).encode(), v))
    raw = st.binary(max_size=120).map(lambda b: (b, b))
    route = st.sampled_from(OPENAI_ROUTES)
    return st.tuples(route, st.one_of(dumped, whole, raw)).map(lambda t: (t[0], *t[1]))


async def fuzz_openai_api(base_url: str, examples: int, seed: int | None = None) -> FuzzReport:
    """POSTs generated bodies to the generation routes at `base_url` (http://host:port); every
    answer must be one of _HTTP_ANSWERS with OpenAI's error JSON, and a 200 stream must end
    with `data: [DONE]` or an error event that is not the server's own fault."""
    import json

    import httpx

    report = FuzzReport()
    loop = asyncio.get_running_loop()
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:

        async def send(item: tuple[str, bytes, object]) -> None:
            route, body, example = item
            headers = {"content-type": "application/json"}
            resp = await http.post(route, content=body, headers=headers)
            code = str(resp.status_code)
            if resp.status_code != 200:
                error = resp.json().get("error", {}) if resp.headers.get("content-type") == "application/json" else {}
                if not {"message", "type", "param", "code"} <= set(error):
                    code += " without OpenAI's error JSON"
            elif resp.headers.get("content-type", "").startswith("text/event-stream"):
                events = [e.removeprefix("data: ") for e in resp.text.split("\n\n") if e.startswith("data: ")]
                last = events[-1] if events else ""
                if last != "[DONE]" and json.loads(last or "{}").get("error", {}).get("type") in (None, "server_error"):
                    code += f" stream ending with {last[:120]!r}"
            allowed = [str(c) for c in _HTTP_ANSWERS]
            report.add(route, code, allowed, example)

        await asyncio.to_thread(run_examples, loop, openai_bodies(), send, examples, seed)
    return report


@dataclass
class LeaseHolder:
    """The fuzzer holds the worker's lease like a scheduler; a Warmup renews the session."""

    channel: grpc.aio.Channel
    session: str = ""
    warmup: bytes = b""

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("x-sluice-session", self.session),)

    async def rewarm(self) -> None:
        from sluice.v1 import worker_pb2

        call = self.channel.unary_unary(
            "/sluice.v1.WorkerService/Warmup", response_deserializer=worker_pb2.WarmupResponse.FromString
        )
        warm = await call(self.warmup, metadata=self.metadata if self.session else (), timeout=60)
        self.session = warm.session_id


async def fuzz_worker_api(
    address: str, examples: int, *, methods: Sequence[str], plausible: bool = True, seed: int | None = None
) -> tuple[FuzzReport, str]:
    """Every request message of the Worker API in `methods`, generated and as raw bytes, with the
    lease held; an RPC must answer OK or INVALID_ARGUMENT and a step's own error, if any, must be
    INVALID_ARGUMENT. After an accepted step (or a Release that ended the lease) the worker is
    warmed up again, so every example starts from an empty worker. Returns the report and the
    worker's Health message at the end (empty while it serves)."""
    from hypothesis import strategies as st

    from sluice.v1 import worker_pb2

    report = FuzzReport()
    loop = asyncio.get_running_loop()
    types = {
        "Info": worker_pb2.InfoRequest,
        "Warmup": worker_pb2.WarmupRequest,
        "Execute": worker_pb2.ExecuteRequest,
        "Release": worker_pb2.ReleaseRequest,
        "Health": worker_pb2.HealthRequest,
    }
    async with grpc.aio.insecure_channel(address) as channel:
        holder = LeaseHolder(
            channel,
            warmup=worker_pb2.WarmupRequest(num_gpu_blocks_override=64, swap_space_gib=0.001).SerializeToString(),
        )
        await holder.rewarm()

        async def send(pair: tuple[str, bytes, object]) -> None:
            method, data, example = pair
            code, dirty = await _worker_call(channel, holder, method, data)
            report.add(method, code, _OK_OR_INVALID, example)
            if dirty:
                await holder.rewarm()

        for method in methods:
            generated = message_strategy(types[method])
            if method == "Execute" and plausible:
                generated = st.one_of(generated, plausible_plans())
            strategy = st.one_of(
                generated.map(lambda m, method=method: (method, m.SerializeToString(), m)),
                st.binary(max_size=200).map(lambda b, method=method: (method, b, b)),
            )
            await asyncio.to_thread(run_examples, loop, strategy, send, examples, seed)
        stub = channel.unary_unary(
            "/sluice.v1.WorkerService/Health", response_deserializer=worker_pb2.HealthResponse.FromString
        )
        health = await stub(b"", timeout=10)
    return report, "" if health.serving else health.message or "not serving"


async def _worker_call(channel: grpc.aio.Channel, holder: LeaseHolder, method: str, data: bytes) -> tuple[str, bool]:
    """(the answer's code, whether the worker must be warmed up again)."""
    from sluice.v1 import worker_pb2

    path = f"/sluice.v1.WorkerService/{method}"
    try:
        if method == "Execute":
            call = channel.stream_stream(path, response_deserializer=worker_pb2.ExecuteResponse.FromString)(
                metadata=holder.metadata, timeout=60
            )
            await call.write(data)
            answer = await call.read()
            call.cancel()
            error = answer.error.code if answer.HasField("error") else ""
            return error or "OK", not error
        deserialize = {"Warmup": worker_pb2.WarmupResponse.FromString}.get(method)
        answer = await channel.unary_unary(path, response_deserializer=deserialize)(
            data, metadata=holder.metadata, timeout=60
        )
        if method == "Warmup":
            holder.session = answer.session_id
        return "OK", method == "Release" and worker_pb2.ReleaseRequest.FromString(data).end_lease
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, False


# ---------------------------------------------------------------- scenarios


async def _wait(predicate: Any, timeout_s: float, step_s: float = 0.02) -> bool:
    for _ in range(int(timeout_s / step_s)):
        if predicate():
            return True
        await asyncio.sleep(step_s)
    return bool(predicate())


async def scenario_sigkill_under_load(num_requests: int, max_tokens: int, step_ms: float = 2.0) -> dict[str, Any]:
    """Two worker processes; one is SIGKILLed while every request is in flight. Every request
    must still finish with all its tokens (recomputed on the survivor)."""
    procs = [await spawn_worker_process(w, step_ms=step_ms) for w in range(2)]
    try:
        async with stack([p.address for p in procs], num_gpu_blocks=512, max_waiting=num_requests) as s:
            calls = [
                asyncio.ensure_future(s.generate(token_ids=prompt(i), sampling_params=sampling(max_tokens)))
                for i in range(num_requests)
            ]
            await _wait(lambda: s.live.loops[0].num_steps >= 5, 60)
            procs[0].kill()
            endings = await asyncio.wait_for(asyncio.gather(*calls), timeout=600)
            left = await s.wait_idle()
    finally:
        for p in procs:
            p.stop()
    complete = sum(e.ok and len(e.tokens) == max_tokens for e in endings)
    return {
        "requests": num_requests,
        "finished_complete": complete,
        "lost": num_requests - complete,
        "held_after": left,
    }


async def scenario_all_killed_then_one_back(num_requests: int, max_tokens: int, step_ms: float = 2.0) -> dict[str, Any]:
    """Both worker processes SIGKILLed under load: requests in flight end UNAVAILABLE (never OK
    with a REJECTED final message), new ones are refused UNAVAILABLE; one worker started again
    on its port is taken back and serves every request after it."""
    procs = [await spawn_worker_process(w, step_ms=step_ms) for w in range(2)]
    try:
        async with stack([p.address for p in procs], max_waiting=num_requests, reconnect_max_s=0.5) as s:
            calls = [
                asyncio.ensure_future(s.generate(token_ids=prompt(i), sampling_params=sampling(max_tokens)))
                for i in range(num_requests)
            ]
            await _wait(lambda: all(loop.num_steps >= 3 for loop in s.live.loops.values()), 60)
            for p in procs:
                p.kill()
            in_flight = await asyncio.wait_for(asyncio.gather(*calls), timeout=120)
            refused = await s.generate(token_ids=prompt(0), sampling_params=sampling(4))
            loop = asyncio.get_running_loop()
            started = loop.time()
            procs[0] = await spawn_worker_process(0, port=procs[0].port, step_ms=step_ms)
            back = await _wait(lambda: s.live.cluster.healthy[0], 60)
            readmitted_s = loop.time() - started
            after = await asyncio.gather(
                *(s.generate(token_ids=prompt(i), sampling_params=sampling(max_tokens)) for i in range(num_requests))
            )
            left = await s.wait_idle()
    finally:
        for p in procs:
            p.stop()
    codes = Counter(e.code.name for e in in_flight)
    return {
        "in_flight": num_requests,
        "in_flight_codes": dict(codes),
        "rejected_final_with_ok": sum(e.ok and e.finish_reason == common_pb2.FINISH_REASON_REJECTED for e in in_flight),
        "new_request_while_none": refused.code.name,
        "readmitted": back,
        "readmitted_s": round(readmitted_s, 2),
        "after": sum(e.ok and len(e.tokens) == max_tokens for e in after),
        "held_after": left,
    }


async def scenario_random_cancellations(
    num_requests: int, concurrency: int, seed: int = 0, step_s: float = 0.001
) -> dict[str, Any]:
    """Requests with random lengths, each cancelled by its client, aborted by id, or left to
    finish, at random moments (before admission, during prefill or decode). Afterwards no KV
    block and no request may be held, by the scheduler or by the workers."""
    import random

    rng = random.Random(seed)
    workers = [await EchoWorker.start(w, step_time_s=step_s) for w in range(2)]
    fates: Counter = Counter()
    try:
        async with stack([w.address for w in workers], num_gpu_blocks=128, max_waiting=num_requests) as s:
            gate = asyncio.Semaphore(concurrency)

            async def one(i: int) -> None:
                fate = rng.choice(("cancel", "abort", "finish"))
                delay = rng.choice((0.0, rng.uniform(0, 0.05), rng.uniform(0.05, 0.3)))
                request = generation_pb2.GenerateRequest(
                    request_id=f"c{i}",
                    token_ids=prompt(i, rng.randint(1, 200)),
                    sampling_params=sampling(rng.randint(1, 64)),
                )
                async with gate:
                    call = s.stub.Generate(request, metadata=s.metadata)
                    if fate != "finish":
                        await asyncio.sleep(delay)
                        if fate == "cancel":
                            call.cancel()
                        else:
                            await s.stub.Abort(generation_pb2.AbortRequest(request_ids=[f"c{i}"]), metadata=s.metadata)
                    ending = await s.collect(call)
                fates[f"{fate}:{ending.code.name}"] += 1

            await asyncio.gather(*(one(i) for i in range(num_requests)))
            left = await s.wait_idle()
            await asyncio.sleep(0.2)  # the workers hear of the last releases with the next step
            for loop in s.live.loops.values():
                loop.wake.set()
            await asyncio.sleep(0.2)
            worker_held = [w.engine.num_requests for w in workers]
            worker_blocks = [len(w.engine.gpu_owner) for w in workers]
    finally:
        for w in workers:
            await w.stop()
    return {
        "requests": num_requests,
        "outcomes": dict(sorted(fates.items())),
        "scheduler_held_after": left,
        "worker_requests_after": worker_held,
        "worker_blocks_after": worker_blocks,
    }


async def _burst(s: Stack, count: int, max_tokens: int, slo: common_pb2.SloSpec, offset: int) -> list[Ending]:
    return await asyncio.gather(
        *(s.generate(token_ids=prompt(offset + i), sampling_params=sampling(max_tokens), slo=slo) for i in range(count))
    )


def _attainment(endings: Sequence[Ending]) -> float:
    served = [e for e in endings if e.ok]
    return sum(e.slo_met for e in served) / len(served) if served else 0.0


async def scenario_overload(
    capacity: int,
    factor: int = 10,
    max_tokens: int = 16,
    step_s: float = 0.01,
    slo_ms: tuple[float, float] = (1500, 250),
    compare_unbounded: bool = False,
) -> dict[str, Any]:
    """`capacity` requests at once (the waiting queue's bound), then `factor` times as many: the
    admitted requests keep their SLO attainment, the rest are refused RESOURCE_EXHAUSTED with
    RetryInfo, and memory stays bounded. `compare_unbounded`: the same burst against a queue
    that admits all of it, for the attainment it would have had."""
    slo = common_pb2.SloSpec(ttft_ms=slo_ms[0], tbt_ms=slo_ms[1])
    peak = [rss_mb()]
    stop = asyncio.Event()

    async def sample_memory() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_mb())
            await asyncio.sleep(0.05)

    async def run(max_waiting: int, rounds: tuple[int, ...]) -> tuple[list[list[Ending]], int, float]:
        workers = [await EchoWorker.start(w, step_time_s=step_s) for w in range(2)]
        try:
            async with stack([w.address for w in workers], num_gpu_blocks=32, max_waiting=max_waiting) as s:
                results, before = [], rss_mb()
                for i, count in enumerate(rounds):
                    if i == len(rounds) - 1:
                        before = rss_mb()
                    results.append(await _burst(s, count, max_tokens, slo, 10_000 * i))
                return results, await s.wait_idle(), before
        finally:
            for w in workers:
                await w.stop()

    sampler = asyncio.ensure_future(sample_memory())
    try:
        (base, burst), left, before = await run(capacity, (capacity, factor * capacity))
    finally:
        stop.set()
        await sampler
    after = rss_mb()
    figures = {
        "capacity": capacity,
        "burst": factor * capacity,
        "base_codes": dict(Counter(e.code.name for e in base)),
        "burst_codes": dict(Counter(e.code.name for e in burst)),
        "refused_with_retry_info": sum("google.rpc.RetryInfo" in e.detail_types for e in burst),
        "admitted_complete": sum(e.ok and len(e.tokens) == max_tokens for e in burst),
        "slo_ms": list(slo_ms),
        "slo_attainment_base": round(_attainment(base), 3),
        "slo_attainment_admitted_in_burst": round(_attainment(burst), 3),
        "rss_mb": {"before": round(before), "peak": round(peak[0]), "after": round(after)},
        "held_after": left,
    }
    if compare_unbounded:
        (unbounded,), _, _ = await run(factor * capacity, (factor * capacity,))
        figures["slo_attainment_if_all_admitted"] = round(_attainment(unbounded), 3)
    return figures


async def scenario_idle_then_serve(
    idle_s: float, keepalive: Keepalive = KEEPALIVE, requests: int = 4
) -> dict[str, Any]:
    """Two workers idle for `idle_s` (probes left at their interval), then `requests` at once:
    every one must be served, with no worker session lost while idle."""
    from worker_service.server import WorkerServerOptions

    workers = [await EchoWorker.start(w, options=WorkerServerOptions(keepalive=keepalive)) for w in range(2)]
    try:
        async with stack([w.address for w in workers], keepalive=keepalive) as s:
            first = await s.generate(token_ids=prompt(0), sampling_params=sampling(4))
            await asyncio.sleep(idle_s)
            after = await asyncio.gather(
                *(s.generate(token_ids=prompt(i), sampling_params=sampling(8)) for i in range(requests))
            )
            resyncs = [loop.num_resyncs for loop in s.live.loops.values()]
            down = [not loop.connected for loop in s.live.loops.values()]
    finally:
        for w in workers:
            await w.stop()
    return {
        "idle_s": idle_s,
        "client_ping_s": keepalive.client_time_s,
        "first": first.code.name,
        "after_idle_ok": sum(e.ok and len(e.tokens) == 8 for e in after),
        "after_idle": requests,
        "sessions_lost_while_idle": sum(resyncs),
        "workers_down": sum(down),
    }


async def scenario_refusals(count: int) -> dict[str, Any]:
    """Calls without a key (or a wrong one) on a keyed scheduler, and a foreign client's
    Warmup, Release and Execute on its leased worker, while a request streams: every one
    refused, the request untouched."""
    from sluice.common.security import SecurityConfig
    from sluice.v1 import worker_pb2, worker_pb2_grpc

    worker = await EchoWorker.start(0, step_time_s=0.005)
    codes: Counter = Counter()
    security = ServerSecurity.from_config(SecurityConfig(api_key="the-key"))
    try:
        async with stack([worker.address], security=security) as s:
            s.metadata = (("authorization", "Bearer the-key"),)
            victim = asyncio.ensure_future(s.generate(token_ids=prompt(0), sampling_params=sampling(400)))
            await _wait(lambda: worker.engine.num_requests > 0, 30)
            stub = generation_pb2_grpc.GenerationServiceStub(s.channel)
            async with grpc.aio.insecure_channel(worker.address) as channel:
                wstub = worker_pb2_grpc.WorkerServiceStub(channel)
                for i in range(count):
                    key = () if i % 2 else (("authorization", "Bearer wrong"),)
                    calls = (
                        stub.GetStats(generation_pb2.GetStatsRequest(), metadata=key),
                        wstub.Warmup(worker_pb2.WarmupRequest(num_gpu_blocks_override=8)),
                        wstub.Release(
                            worker_pb2.ReleaseRequest(request_ids=["x"]), metadata=(("x-sluice-session", f"g{i}"),)
                        ),
                    )
                    for name, call in zip(("unauthenticated", "foreign_warmup", "foreign_release"), calls, strict=True):
                        try:
                            await call
                            codes[f"{name}:OK"] += 1
                        except grpc.aio.AioRpcError as exc:
                            codes[f"{name}:{exc.code().name}"] += 1
            ending = await victim
    finally:
        await worker.stop()
    return {
        "attempts": 3 * count,
        "answers": dict(sorted(codes.items())),
        "victim": f"{ending.code.name}, {len(ending.tokens)} tokens",
    }


async def scenario_big_prompt(megabytes: float) -> dict[str, Any]:
    """An oversized text prompt (the byte limit raised so that it reaches the tokenizer) while
    health probes and short requests keep coming: how long tokenizing took, the slowest probe
    and the slowest short request meanwhile."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    text = ("the quick brown fox jumps over the lazy dog " * int(megabytes * 2**20 / 44 + 1))[: int(megabytes * 2**20)]
    worker = await EchoWorker.start(0)
    probes: list[float] = []
    shorts: list[float] = []
    try:
        async with stack([worker.address], max_prompt_bytes=len(text) + 1) as s:
            loop = asyncio.get_running_loop()
            started = loop.time()
            big = asyncio.ensure_future(s.generate(text=text, sampling_params=sampling(4)))
            await _wait(lambda: s.live.num_tokenizing > 0, 10, 0.001)
            health = health_pb2_grpc.HealthStub(s.channel)
            while s.live.num_tokenizing and not big.done():
                t = loop.time()
                await health.Check(health_pb2.HealthCheckRequest(service=""))
                probes.append(loop.time() - t)
                t = loop.time()
                short = await s.generate(token_ids=prompt(len(shorts)), sampling_params=sampling(4))
                if short.ok:
                    shorts.append(loop.time() - t)
                await asyncio.sleep(0.01)
            ending = await big
            elapsed = loop.time() - started
    finally:
        await worker.stop()
    return {
        "prompt_mb": megabytes,
        "tokenize_and_refuse_s": round(elapsed, 2),
        "big_prompt": f"{ending.code.name}: {ending.details[:80]}",
        "health_probes_meanwhile": len(probes),
        "health_max_ms": round(1e3 * max(probes, default=0.0), 1),
        "short_requests_served_meanwhile": len(shorts),
        "short_request_max_ms": round(1e3 * max(shorts, default=0.0), 1),
    }
