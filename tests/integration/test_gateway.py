"""The OpenAI HTTP gateway over real HTTP on loopback, in front of the real scheduler
(LiveScheduler + SchedulerServer in-process) and a real worker server running the echo engine:
the official `openai` client (sync and async, streaming and not, completions and chat, Sluice's
own fields through `extra_body`), the SSE framing byte for byte, the API key on every route but
/health, TLS, a client that leaves mid-stream (its KV freed), the caller's traceparent in the
scheduler's spans, and every error status provoked for real (400 naming the field, 401, 404,
413, 429 with Retry-After, 503, 504). Each runs over both of the gateway's links to the
scheduler: its gRPC API (`sluice gateway`) and its in-process API (the HTTP front of
`sluice serve`), which must answer alike."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway_service.app import Gateway
from gateway_service.config import GatewayConfig
from gateway_service.server import GatewayServer
from scheduler_service.inprocess import InProcessLink
from scheduler_service.live.config import LiveConfig
from scheduler_service.live.service import LiveScheduler
from scheduler_service.server import SchedulerServer
from sluice.common.client import SluiceClient
from sluice.common.healthcheck import EXIT_NOT_SERVING, EXIT_SERVING, check_http
from sluice.common.security import ApiKeys, ClientSecurity, ServerSecurity, key_identity
from sluice.common.telemetry import setup_tracing
from worker_service.echo_engine import EchoEngine
from worker_service.engine import EngineConfig
from worker_service.server import build_server

KEY = "sk-gateway-test"
MODEL = "tiny-llama"
AUTH = {"Authorization": f"Bearer {KEY}"}
LINKS = ["grpc", "in-process"]  # how the gateway reaches the scheduler


@dataclass
class Stack:
    base: str  # http://127.0.0.1:PORT
    grpc: SluiceClient  # the scheduler, over gRPC, for its stats and the reference streams
    gateway: GatewayServer
    spans: InMemorySpanExporter

    @property
    def v1(self) -> str:
        return self.base + "/v1"


async def start_stack(
    live_config: LiveConfig, gateway: GatewayConfig, step_time_s: float = 0.0, link: str = "grpc"
) -> tuple[Stack, list]:
    worker = build_server(EchoEngine(EngineConfig(), step_time_s=step_time_s), 0)
    await worker.start(ready=False)
    live = LiveScheduler([f"127.0.0.1:{worker.port}"], live_config)
    security = ServerSecurity(api_keys=ApiKeys((KEY,)))
    scheduler = await SchedulerServer.start(live, 0, security=security)
    gateway.scheduler = f"127.0.0.1:{scheduler.port}"
    # NOTE: in-process, the requests are the gateway key's, as when the gateway presents it over gRPC
    front = Gateway(gateway, link=InProcessLink(live, key_identity(KEY))) if link == "in-process" else None
    gw = await GatewayServer.start(gateway, front)
    client = SluiceClient(f"127.0.0.1:{scheduler.port}", security=ClientSecurity(api_key=KEY))
    await client.wait_ready()
    stack = Stack(f"http://127.0.0.1:{gw.port}", client, gw, InMemorySpanExporter())
    return stack, [worker, scheduler, gw, client]


async def stop_stack(parts: list) -> None:
    worker, scheduler, gw, client = parts
    await gw.stop()
    await client.close()
    await scheduler.stop(grace_s=1.0, drain_s=0.0)
    await worker.server.stop(None)


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    setup_tracing("sluice-test", exporter=exporter)  # before the servers: their interceptors trace
    return exporter


@pytest.fixture(scope="module", params=LINKS)
async def stack(exporter: InMemorySpanExporter, request: pytest.FixtureRequest) -> AsyncIterator[Stack]:
    cfg = LiveConfig(num_gpu_blocks=1024, max_num_seqs=32, max_num_batched_tokens=2048)
    gateway = GatewayConfig(port=0, api_key=KEY, served_model_name=["sluice-chat"])
    s, parts = await start_stack(cfg, gateway, link=request.param)
    s.spans = exporter
    yield s
    await stop_stack(parts)


async def wait_idle(client: SluiceClient, timeout_s: float = 5.0) -> None:
    """0 waiting, 0 running and 0 KV blocks in use on the scheduler (its GetStats)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        stats = await client.stats()
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.workers[0].gpu_blocks_used == 0:
            return
        assert asyncio.get_running_loop().time() < deadline, f"not idle: {stats}"
        await asyncio.sleep(0.02)


async def reference(stack: Stack, prompt: str | list[int], max_tokens: int, **options) -> tuple[list[str], int]:
    """The text deltas and prompt tokens of the same request over gRPC (the echo engine's
    tokens depend only on the position, so both paths produce the same text)."""
    chunks = [c async for c in stack.grpc.generate(prompt, max_tokens=max_tokens, **options)]
    return [c.text for c in chunks], chunks[-1].prompt_tokens


# ---------------------------------------------------------------- the openai client


async def test_sync_openai_client_completions_and_chat_streaming_and_not(stack: Stack) -> None:
    deltas, prompt_tokens = await reference(stack, "Say something", 8)

    def run() -> tuple:
        client = openai.OpenAI(base_url=stack.v1, api_key=KEY)
        whole = client.completions.create(model=MODEL, prompt="Say something", max_tokens=8)
        streamed = list(client.completions.create(model=MODEL, prompt="Say something", max_tokens=8, stream=True))
        chat = client.chat.completions.create(
            model="sluice-chat", messages=[{"role": "user", "content": "Hi there"}], max_completion_tokens=6
        )
        chat_stream = list(
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi there"}], max_tokens=6, stream=True
            )
        )
        return whole, streamed, chat, chat_stream

    whole, streamed, chat, chat_stream = await asyncio.to_thread(run)
    assert whole.choices[0].text == "".join(deltas)
    assert (whole.choices[0].finish_reason, whole.usage.completion_tokens) == ("length", 8)
    assert whole.usage.prompt_tokens == prompt_tokens and whole.usage.total_tokens == prompt_tokens + 8
    assert whole.id.startswith("cmpl-") and whole.object == "text_completion" and whole.model == MODEL
    assert [c.choices[0].text for c in streamed] == deltas
    assert [c.choices[0].finish_reason for c in streamed] == [None] * (len(deltas) - 1) + ["length"]
    # the chat prompt is the default template's transcript (the tiny model has no template)
    chat_deltas, chat_prompt_tokens = await reference(stack, "user: Hi there\nassistant:", 6)
    assert chat.model == "sluice-chat" and chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == "".join(chat_deltas)
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (chat_prompt_tokens, 6)
    assert chat_stream[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chat_stream[1:])
    assert "".join(c.choices[0].delta.content or "" for c in chat_stream) == "".join(chat_deltas)
    assert chat_stream[-1].choices[0].finish_reason == "length"
    await wait_idle(stack.grpc)


async def test_async_openai_client_with_usage_n_prompt_lists_token_ids_and_sluice_fields(stack: Stack) -> None:
    client = openai.AsyncOpenAI(base_url=stack.v1, api_key=KEY)
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        ],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
        seed=7,
        temperature=0.0,
        user="tenant-a",
        extra_body={
            "ttft_ms": 5000,
            "tbt_ms": 500,
            "slo_class": "offline",
            "priority": 3,
            "predicted_output_tokens": 4,
        },
    )
    chunks = [c async for c in stream]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])
    # the Sluice fields reached the scheduler: its request span carries them
    rid = chunks[0].id.removeprefix("chatcmpl-")
    span = next(s for s in stack.spans.get_finished_spans() if s.attributes.get("gen_ai.request.id") == rid)
    attrs = span.attributes
    assert (attrs["sluice.priority"], attrs["sluice.slo.class"], attrs["gen_ai.request.seed"]) == (3, "offline", 7)
    assert attrs["sluice.slo.ttft_s"] == pytest.approx(5.0) and attrs["sluice.predicted_output_tokens"] == 4

    # n samples of each of two prompts: choice i * n + j, usage counting each prompt once
    many = await client.completions.create(model=MODEL, prompt=["one two", "three four five"], n=2, max_tokens=3)
    assert sorted(c.index for c in many.choices) == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" and c.text for c in many.choices)
    _, p1 = await reference(stack, "one two", 1)
    _, p2 = await reference(stack, "three four five", 1)
    assert (many.usage.prompt_tokens, many.usage.completion_tokens) == (p1 + p2, 12)
    streamed = await client.completions.create(model=MODEL, prompt=[[1000, 1001, 1002]] * 2, max_tokens=4, stream=True)
    by_choice: dict[int, list[str]] = {}
    texts: dict[int, str] = {}
    async for chunk in streamed:
        choice = chunk.choices[0]
        by_choice.setdefault(choice.index, []).append(choice.finish_reason or "")
        texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert sorted(by_choice) == [0, 1] and all(v[-1] == "length" for v in by_choice.values())
    # the choices' events that leave in one write are whole events, each choice's text complete and in order
    deltas, _ = await reference(stack, [1000, 1001, 1002], 4)
    assert texts == {0: "".join(deltas), 1: "".join(deltas)}
    await wait_idle(stack.grpc)


async def test_stop_strings_end_the_choice_with_stop_before_the_string(stack: Stack) -> None:
    deltas, _ = await reference(stack, "count", 10)
    word = deltas[5].strip()
    client = openai.AsyncOpenAI(base_url=stack.v1, api_key=KEY)
    done = await client.completions.create(model=MODEL, prompt="count", max_tokens=10, stop=[word])
    assert done.choices[0].finish_reason == "stop"
    assert word not in done.choices[0].text and "".join(deltas).startswith(done.choices[0].text.rstrip())


async def test_models_lists_the_served_names_and_the_scheduler_model(stack: Stack) -> None:
    client = openai.AsyncOpenAI(base_url=stack.v1, api_key=KEY)
    models = await client.models.list()
    assert [m.id for m in models.data] == ["sluice-chat", MODEL]
    assert (await client.models.retrieve(MODEL)).id == MODEL
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("gpt-4")


# ---------------------------------------------------------------- the wire


async def test_sse_framing_byte_for_byte(stack: Stack) -> None:
    deltas, _ = await reference(stack, "frame me", 4)
    body = {"model": MODEL, "prompt": "frame me", "max_tokens": 4, "stream": True, "request_id": "sse-1"}
    async with httpx.AsyncClient() as http:
        resp = await http.post(stack.v1 + "/completions", json=body, headers=AUTH)
        chat = await http.post(
            stack.v1 + "/chat/completions",
            json={
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
                "request_id": "sse-2",
                "model": MODEL,
            },
            headers=AUTH,
        )
    assert resp.status_code == 200 and resp.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert resp.headers["x-request-id"] == "sse-1"
    created = json.loads(resp.content.split(b"\n\n")[0][len(b"data: ") :])["created"]
    expected = b"".join(
        b'data: {"id":"cmpl-sse-1","object":"text_completion","created":%d,"model":"tiny-llama","choices":'
        b'[{"index":0,"text":%s,"logprobs":null,"finish_reason":%s}]}\n\n'
        % (created, json.dumps(text).encode(), b'"length"' if i == len(deltas) - 1 else b"null")
        for i, text in enumerate(deltas)
    )
    assert resp.content == expected + b"data: [DONE]\n\n"

    chat_deltas, prompt_tokens = await reference(stack, "user: x\nassistant:", 2)
    created = json.loads(chat.content.split(b"\n\n")[0][len(b"data: ") :])["created"]
    head = b'data: {"id":"chatcmpl-sse-2","object":"chat.completion.chunk","created":%d,"model":"tiny-llama",' % created
    first = head + (
        b'"choices":[{"index":0,"delta":{"role":"assistant","content":%s},"logprobs":null,"finish_reason":null}],'
        b'"usage":null}\n\n'
    )
    last = head + (
        b'"choices":[{"index":0,"delta":{"content":%s},"logprobs":null,"finish_reason":"length"}],"usage":null}\n\n'
    )
    usage = (
        b'data: {"id":"chatcmpl-sse-2","object":"chat.completion.chunk","created":%d,"model":"tiny-llama",'
        b'"choices":[],"usage":{"prompt_tokens":%d,"completion_tokens":2,"total_tokens":%d}}\n\n'
        % (created, prompt_tokens, prompt_tokens + 2)
    )
    words = [json.dumps(t).encode() for t in chat_deltas]
    assert chat.content == first % words[0] + last % words[1] + usage + b"data: [DONE]\n\n"


@pytest.fixture(params=LINKS)
async def slow_stack(request: pytest.FixtureRequest) -> AsyncIterator[Stack]:
    """A stack whose echo worker takes 5 ms a step: a 1500-token request is still generating
    seconds later, however slowly a busy machine lets the client read."""
    cfg = LiveConfig(num_gpu_blocks=1024, max_num_seqs=32, max_num_batched_tokens=2048)
    s, parts = await start_stack(cfg, GatewayConfig(port=0, api_key=KEY), step_time_s=0.005, link=request.param)
    yield s
    await stop_stack(parts)


async def test_a_client_leaving_mid_stream_aborts_its_request_and_frees_its_kv(slow_stack: Stack) -> None:
    stack = slow_stack
    body = {"prompt": [1000] * 100, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    async with (
        httpx.AsyncClient() as http,
        http.stream("POST", stack.v1 + "/completions", json=body, headers=AUTH) as resp,
    ):
        assert resp.status_code == 200
        seen = 0
        # NOTE: the iterator is held until the client leaves: an abandoned one is closed by the
        # event loop's async-generator finalizer, which closes the connection at once, before
        # the stats below were read (the test then saw the request already aborted)
        lines = resp.aiter_lines()
        async for line in lines:
            seen += line.startswith("data: ")
            if seen == 3:
                break
        stats = await stack.grpc.stats()
        assert stats.num_running == 1 and stats.workers[0].gpu_blocks_used > 0, "generating when it leaves"
    await wait_idle(stack.grpc)  # 0 waiting, 0 running, 0 blocks
    # a non-streaming client that leaves while it waits is aborted too
    async with httpx.AsyncClient(timeout=httpx.Timeout(0.3)) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post(stack.v1 + "/completions", json={**body, "stream": False}, headers=AUTH)
    await wait_idle(stack.grpc)
    async with httpx.AsyncClient() as http:
        metrics = (await http.get(stack.base + "/metrics", headers=AUTH)).text
    assert "sluice_gateway_client_disconnects_total 2.0" in metrics


async def test_the_callers_traceparent_continues_into_the_scheduler_spans(stack: Stack) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    headers = {**AUTH, "traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
    body = {"messages": [{"role": "user", "content": "trace me"}], "max_tokens": 2, "request_id": "traced-1"}
    async with httpx.AsyncClient() as http:
        resp = await http.post(stack.v1 + "/chat/completions", json=body, headers=headers)
    assert resp.status_code == 200
    spans = [s for s in stack.spans.get_finished_spans() if f"{s.context.trace_id:032x}" == trace_id]
    gateway = next(s for s in spans if s.name == "POST /v1/chat/completions")
    assert f"{gateway.parent.span_id:016x}" == "00f067aa0ba902b7", "the gateway's span is the caller's child"
    request = next(s for s in spans if s.attributes.get("gen_ai.request.id") == "traced-1")
    assert request.name == f"text_completion {MODEL}", "the scheduler's request span is in the caller's trace"


# ---------------------------------------------------------------- security


async def test_the_api_key_is_required_on_every_route_but_health(stack: Stack) -> None:
    routes = [
        ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
        ("GET", "/v1/models", None),
        ("GET", f"/v1/models/{MODEL}", None),
        ("GET", "/metrics", None),
    ]
    async with httpx.AsyncClient() as http:
        for method, path, body in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY + "x"}):
                resp = await http.request(method, stack.base + path, json=body, headers=headers)
                assert resp.status_code == 401, (path, headers)
                error = resp.json()["error"]
                assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
            assert (await http.request(method, stack.base + path, json=body, headers=AUTH)).status_code == 200, path
        health = await http.get(stack.base + "/health")
    assert health.status_code == 200 and health.json() == {"status": "ok", "scheduler": "serving"}
    # the image's health check: the Python probe with --http on $SLUICE_PORT
    port = str(stack.gateway.port)
    assert (await asyncio.to_thread(check_http, port, "/health"))[0] == EXIT_SERVING
    with pytest.raises(openai.AuthenticationError):
        await openai.AsyncOpenAI(base_url=stack.v1, api_key="wrong").models.list()


async def test_tls_serves_https_verified_by_the_ca(stack: Stack, tmp_path: Path) -> None:
    from sluice.common.certs import write_dev_pki

    certs = write_dev_pki(tmp_path, ["gateway"])
    cert, key = certs["gateway"]
    cfg = GatewayConfig(port=0, scheduler=stack.gateway.gateway.cfg.scheduler, api_key=KEY)
    cfg.tls_cert, cfg.tls_key = str(cert), str(key)
    gw = await GatewayServer.start(cfg)
    try:
        async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=tmp_path / "ca.crt")) as https:
            resp = await https.post(
                f"https://127.0.0.1:{gw.port}/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=AUTH
            )
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 2
        async with httpx.AsyncClient() as plain:
            with pytest.raises(httpx.HTTPError):
                await plain.get(f"http://127.0.0.1:{gw.port}/health")
    finally:
        await gw.stop()


# ---------------------------------------------------------------- errors


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/completions", {"max_tokens": 2}, "prompt"),
        ("/completions", {"prompt": []}, "prompt"),
        ("/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
        ("/completions", {"prompt": "x", "top_p": 5.0}, "top_p"),  # the scheduler's range check
        ("/completions", {"prompt": "x", "max_tokens": 100000}, "max_tokens"),
        ("/completions", {"prompt": "x", "logprobs": 2}, "logprobs"),
        ("/completions", {"prompt": "x", "echo": True}, "echo"),
        ("/completions", {"prompt": "x", "n": 1000}, "n"),
        ("/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ("/completions", {"prompt": "x", "priority": 5000}, "priority"),
        ("/completions", {"prompt": "x", "slo_class": "urgent"}, "slo_class"),
        ("/completions", {"prompt": "x", "user": "u" * 300}, "user"),
        ("/completions", {"prompt": [10**9]}, "prompt"),
        ("/completions", {"prompt": [1, True]}, "prompt"),  # JSON true is no token id
        # past the wire's integer ranges (found by tests/faults/test_fuzz.py: these were a 500)
        ("/completions", {"prompt": "x", "max_tokens": -2}, "max_tokens"),
        ("/completions", {"prompt": [5, -1]}, "prompt"),
        ("/completions", {"prompt": "x", "seed": 2**64}, "seed"),
        ("/completions", {"prompt": "x", "priority": 2**40}, "priority"),
        ("/completions", {"prompt": "x", "top_k": 2**32}, "top_k"),
        ("/completions", {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
        ("/chat/completions", {"messages": []}, "messages"),
        ("/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ("/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs"),
        (
            "/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            "tools",
        ),
        (
            "/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
            "max_completion_tokens",
        ),
    ],
)
async def test_bad_fields_are_400_naming_the_field(stack: Stack, path: str, body: dict, param: str) -> None:
    async with httpx.AsyncClient() as http:
        for stream in (False, True) if "stream_options" not in body else (False,):
            resp = await http.post(stack.v1 + path, json={**body, "stream": stream}, headers=AUTH)
            error = _error(resp, 400)
            assert error["param"] == param and error["message"].startswith(param), error
            assert error["type"] == "invalid_request_error"


async def test_unknown_model_route_and_method_are_404_and_405_and_bodies_are_checked(stack: Stack) -> None:
    async with httpx.AsyncClient() as http:
        error = _error(
            await http.post(stack.v1 + "/completions", json={"model": "gpt-4", "prompt": "x"}, headers=AUTH), 404
        )
        assert (error["param"], error["code"]) == ("model", "model_not_found")
        assert _error(await http.get(stack.v1 + "/engines", headers=AUTH), 404)["code"] == "not_found"
        assert _error(await http.get(stack.v1 + "/completions", headers=AUTH), 405)["code"] == "method_not_allowed"
        bad = await http.post(stack.v1 + "/completions", content=b"{not json", headers=AUTH)
        assert _error(bad, 400)["param"] == "body"
        huge = await http.post(stack.v1 + "/completions", content=b" " * (17 * 2**20), headers=AUTH)
        assert _error(huge, 413)["code"] == "body_too_large"
    with pytest.raises(openai.NotFoundError):
        await openai.AsyncOpenAI(base_url=stack.v1, api_key=KEY).completions.create(model="gpt-4", prompt="x")


@pytest.mark.parametrize("link", LINKS)
async def test_queue_full_is_429_with_retry_after_queue_timeout_504_and_no_worker_503(link: str) -> None:
    """One sequence at a time, one waiting, a 1.5 s queue timeout, slow echo steps; then the
    worker goes, mid-stream."""
    cfg = LiveConfig(num_gpu_blocks=256, max_num_seqs=1, max_waiting=1, queue_timeout_s=1.5, retry_after_s=0.2)
    stack, parts = await start_stack(cfg, GatewayConfig(port=0, api_key=KEY), step_time_s=0.01, link=link)
    try:
        async with httpx.AsyncClient(timeout=30) as http:
            url = stack.v1 + "/completions"
            body = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True}
            running = asyncio.create_task(http.post(url, json={**body, "stream": True}, headers=AUTH))
            while (await stack.grpc.stats()).num_running < 1:
                await asyncio.sleep(0.01)
            waiting = asyncio.create_task(http.post(url, json={**body, "stream": True}, headers=AUTH))
            while (await stack.grpc.stats()).num_waiting < 1:
                await asyncio.sleep(0.01)
            for stream in (False, True):
                full = await http.post(url, json={**body, "stream": stream}, headers=AUTH)
                error = _error(full, 429)
                assert full.headers["retry-after"] == "1" and error["code"] == "rate_limit_exceeded"
            client = openai.AsyncOpenAI(base_url=stack.v1, api_key=KEY, max_retries=0)
            with pytest.raises(openai.RateLimitError):
                await client.completions.create(model=MODEL, prompt="x", max_tokens=2)
            timed_out = await asyncio.wait_for(waiting, 10)
            assert _error(timed_out, 504)["code"] == "timeout"
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running
            await wait_idle(stack.grpc)

            # a stream cut after its first tokens (the only worker goes) ends with an error
            # event and no [DONE]
            worker = parts[0]
            lines = []
            async with http.stream("POST", url, json={**body, "stream": True}, headers=AUTH) as cut:
                assert cut.status_code == 200
                async for line in cut.aiter_lines():
                    lines.append(line)
                    if len(lines) == 4:
                        await worker.server.stop(None)
            events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
            assert "[DONE]" not in events and len(events) >= 2
            error = json.loads(events[-1])["error"]
            assert (error["code"], error["type"]) == ("service_unavailable", "server_error"), error
            while (await http.get(stack.base + "/health")).status_code != 503:
                await asyncio.sleep(0.05)
            code, line = await asyncio.to_thread(check_http, str(stack.gateway.port), "/health")
            assert code == EXIT_NOT_SERVING and "503" in line
            gone = await http.post(url, json={"prompt": "x", "max_tokens": 2}, headers=AUTH)
            assert _error(gone, 503)["code"] == "service_unavailable"
    finally:
        await stop_stack(parts)


# ---------------------------------------------------------------- sluice bench --backend openai


async def test_bench_openai_backend_counts_every_request_with_its_length_as_the_grpc_bench(stack: Stack) -> None:
    from scheduler_service.loadgen.load import run_requests
    from scheduler_service.loadgen.measure import summarize
    from scheduler_service.loadgen.openai_backend import OpenAIBench
    from scheduler_service.loadgen.requests import prepare_requests
    from scheduler_service.workloads import apply_arrivals, load_trace

    workload = load_trace("azure-conv", num_requests=16)
    async with OpenAIBench(stack.v1, KEY) as client:
        assert await client.describe() == ("sluice-chat", 2048), "the first listed model and its context"
        requests = prepare_requests(workload, 2048, max_tokens=8, prompt_source="tokens", oracle_lengths=True)
        records = await run_requests(client, requests, concurrency=4, progress=False)
        assert [len(r.token_times) for r in records] == [r.max_tokens for r in requests]
        assert all(r.finish_reason == "length" and not r.error_code and r.prompt_tokens for r in records)
        run = summarize(records, policy="openai-api", workload=workload.name)
        assert (run.metrics["num_finished"], run.metrics["num_requests"]) == (16, 16)
        assert run.metrics["ttft_s"]["p50"] > 0 and run.metrics["throughput_tok_s"] > 0

        timed = prepare_requests(apply_arrivals(workload, "poisson", rate=100.0, seed=1), 2048, max_tokens=4)
        records = await run_requests(client, timed, progress=False)
        sent = sorted(r.sent_s for r in records)
        assert all(s >= a - 1e-3 for s, a in zip(sent, sorted(r.arrival_s for r in timed), strict=True))
        assert summarize(records, policy="openai-api", workload="w").metrics["num_finished"] == 16

    async with OpenAIBench(stack.v1, "wrong") as client:
        client.model = MODEL
        record = (await run_requests(client, requests[:1], concurrency=1, progress=False))[0]
    assert (record.error_code, record.token_times) == ("UNAUTHENTICATED", [])
    await wait_idle(stack.grpc)


async def test_the_bench_command_with_the_openai_backend_writes_the_metrics_json(stack: Stack, tmp_path: Path) -> None:
    from services.cli import main

    out = tmp_path / "bench.json"
    argv = ["bench", "--backend", "openai", "--base-url", stack.v1, "--model", MODEL, "--api-key", KEY]
    argv += ["--trace", "azure-conv", "--num-requests", "8", "--concurrency", "4", "--max-tokens", "4"]
    argv += ["--oracle-lengths", "--no-progress", "--json", str(out)]
    assert await asyncio.to_thread(main, argv) == 0
    run = json.loads(out.read_text())
    assert (run["config"]["backend"], run["config"]["model"], run["config"]["max_model_len"]) == ("openai", MODEL, 2048)
    assert (run["metrics"]["num_requests"], run["metrics"]["num_finished"]) == (8, 8)
    assert run["details"]["client"]["finish_reasons"] == {"length": 8}
    with pytest.raises(SystemExit):
        await asyncio.to_thread(main, ["bench", "--backend", "openai", "--trace", "azure-conv", "--base-url"])
