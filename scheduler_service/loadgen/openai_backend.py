"""`sluice bench --backend openai`: the bench's requests sent to any OpenAI-compatible server
(`sluice serve --http-port`, `sluice gateway`, `vllm serve`, SGLang, TGI ...).

    OpenAIBench(base_url, api_key, model)
        .describe()          GET /v1/models -> the model (the first, unless named) and its
                             max_model_len where the server lists one (vLLM and Sluice do)
        .send(record, t0)    POST /v1/completions, stream, stream_options.include_usage:
                             each SSE chunk with a choice is one token at its arrival time
                             (or as many as it names with vLLM's return_token_ids, asked for
                             with token_ids=True);
                             tokens the final usage counts beyond the chunks (a server that
                             sends several tokens in one chunk) get the last chunk's time,
                             so the first and last token times, and the mean gap, are exact

A request carries what the gRPC bench sends, in the API's fields: the prompt (text, or token
ids), max_tokens, `user` for the tenant, and only where set (other servers may refuse them):
`ignore_eos` (oracle lengths; vLLM and Sluice accept it), `priority`, and the SLOs
(`ttft_ms`, `tbt_ms`, `jct_ms`, Sluice's own fields). An HTTP error is recorded under the
gRPC status name it stands for (429 RESOURCE_EXHAUSTED, 504 DEADLINE_EXCEEDED, ...), so
rejections and timeouts count in the metrics exactly as over gRPC.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scheduler_service.loadgen.requests import RequestRecord

HTTP_TO_GRPC = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    413: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}
# The `code` of an error event sent after the first token (Sluice's gateway; vLLM sends others).
_ERROR_CODES = {
    "timeout": "DEADLINE_EXCEEDED",
    "service_unavailable": "UNAVAILABLE",
    "rate_limit_exceeded": "RESOURCE_EXHAUSTED",
}


def grpc_code(status: int) -> str:
    return HTTP_TO_GRPC.get(status, "INTERNAL" if status >= 500 else "UNKNOWN")


def _error_message(raw: bytes) -> str:
    try:
        error = json.loads(raw).get("error", {})
        return str(error.get("message", "")) if isinstance(error, dict) else str(error)
    except (ValueError, AttributeError):
        return raw.decode(errors="replace")[:500]


KEEPALIVE_S = 3.0  # seconds an idle connection is kept for the next request


class OpenAIBench:
    """An aiohttp session to one OpenAI-compatible server (connections kept alive)."""

    def __init__(
        self, base_url: str, api_key: str | None = None, model: str | None = None, token_ids: bool = False
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        # vLLM's `return_token_ids`: each chunk names its tokens, so a server without a tokenizer
        # (empty text) still reports every token; sent only when asked (OpenAI refuses unknown fields)
        self.token_ids = token_ids
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.session: Any = None

    async def __aenter__(self) -> OpenAIBench:
        import aiohttp

        # NOTE: no connection limit: an open-loop run may have every request in flight at once.
        # Idle connections are dropped before the server's keep-alive ends (uvicorn's, vLLM's
        # and the gateway's: 5 s): reusing one the server is closing fails the request with
        # "Server disconnected" (seen after a phase that left the HTTP connections idle).
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
        self.session = aiohttp.ClientSession(connector=connector, headers=self.headers)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.session.close()

    async def describe(self, max_model_len: int | None = None) -> tuple[str, int]:
        """(model, max_model_len): the named model (else the server's first) and its context,
        from the model card where the server lists it, else `max_model_len`."""
        async with self.session.get(self.base_url + "/models") as resp:
            if resp.status != 200:
                detail = _error_message(await resp.read())
                raise ValueError(f"GET {self.base_url}/models answered {resp.status}: {detail}")
            cards = (await resp.json())["data"]
        if not cards:
            raise ValueError(f"{self.base_url}/models lists no model")
        card = next((c for c in cards if c["id"] == self.model), None) if self.model else cards[0]
        if card is None:
            raise ValueError(f"model {self.model!r} is not served at {self.base_url} ({[c['id'] for c in cards]})")
        self.model = card["id"]
        context = card.get("max_model_len") or max_model_len
        if not context:
            raise ValueError(f"{self.base_url} does not say the context length of {self.model!r}: give --max-model-len")
        return str(self.model), int(context)

    def body(self, record: RequestRecord) -> dict[str, Any]:
        r = record.request
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": r.prompt if isinstance(r.prompt, str) else list(r.prompt),
            "max_tokens": r.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if r.tenant:
            body["user"] = r.tenant
        if r.ignore_eos:
            body["ignore_eos"] = True
        if self.token_ids:
            body["return_token_ids"] = True
        if r.priority:
            body["priority"] = r.priority
        for name, value in (("ttft_ms", r.slo.ttft_s), ("tbt_ms", r.slo.tbt_s), ("jct_ms", r.slo.jct_s)):
            if value is not None:
                body[name] = value * 1e3
        return body

    async def send(self, record: RequestRecord, t0: float, timeout: float | None) -> None:
        record.sent_s = time.perf_counter() - t0
        try:
            async with asyncio.timeout(timeout):
                await self._stream(record, t0)
        except TimeoutError:
            record.error_code, record.message = "DEADLINE_EXCEEDED", f"no answer within {timeout} s"
        except OSError as exc:  # aiohttp.ClientError is an OSError too
            record.error_code, record.message = "UNAVAILABLE", str(exc) or type(exc).__name__
        finally:
            record.end_s = time.perf_counter() - t0

    async def _stream(self, record: RequestRecord, t0: float) -> None:
        async with self.session.post(self.base_url + "/completions", json=self.body(record)) as resp:
            if resp.status != 200:
                record.error_code, record.message = grpc_code(resp.status), _error_message(await resp.read())
                return
            chunks = 0
            usage: dict[str, int] | None = None
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                now = time.perf_counter() - t0
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    error = event["error"] or {}
                    record.error_code = _ERROR_CODES.get(error.get("code"), "INTERNAL")
                    record.message = str(error.get("message", ""))
                    return
                usage = event.get("usage") or usage
                for choice in event.get("choices") or ():
                    # a chunk's tokens: those it names (return_token_ids), else one per chunk with text
                    count = len(choice.get("token_ids") or ()) or (1 if choice.get("text") else 0)
                    chunks += count
                    record.token_times.extend([now] * count)
                    if choice.get("finish_reason"):
                        record.finish_reason = choice["finish_reason"]
            if usage:
                record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                extra = int(usage.get("completion_tokens") or 0) - chunks
                if extra > 0 and record.token_times:
                    record.token_times.extend([record.token_times[-1]] * extra)
