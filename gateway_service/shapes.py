"""The JSON of OpenAI's responses: streamed chunks (server-sent events) and whole answers.

    Shapes(kind, id, model, created, include_usage)
        .event(index, text, finish_reason, first)   one `data: {...}\\n\\n` SSE event of a choice
        .usage_event(usage)                         the last event with stream_options.include_usage
        .whole(texts, finish_reasons, usage)        the non-streaming answer
    DONE, error_event(ApiError)

Chunks are formatted from fixed prefixes and suffixes around the JSON-escaped text: one
chunk per scheduler message, so this is the gateway's per-token work (measured in
benchmarks/gateway_overhead.py). A chat choice's first chunk carries `role: assistant`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from json.encoder import encode_basestring  # type: ignore[attr-defined]
from typing import Any

from gateway_service.errors import ApiError

DONE = b"data: [DONE]\n\n"
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
_string = encode_basestring  # what _dumps makes of a str, without its type checks (per token)


def usage_of(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def error_event(error: ApiError) -> bytes:
    return b"data: " + _dumps(error.body()).encode() + b"\n\n"


class Shapes:
    def __init__(self, kind: str, response_id: str, model: str, created: int, include_usage: bool) -> None:
        self.kind = kind
        self.id = response_id
        self.model = model
        self.created = created
        self.include_usage = include_usage
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        self._head = (
            f'data: {{"id":{_dumps(response_id)},"object":"{obj}","created":{created},'
            f'"model":{_dumps(model)},"choices":[{{"index":'
        )
        self._tail = "}]" + (',"usage":null' if include_usage else "") + "}\n\n"

    def event(self, index: int, text: str, finish_reason: str | None, first: bool) -> bytes:
        finish = "null" if finish_reason is None else f'"{finish_reason}"'
        if self.kind == "chat":
            role = '"role":"assistant",' if first else ""
            content = f'"content":{_string(text)}' if (text or first) else ""
            body = f'{index},"delta":{{{role}{content}}},"logprobs":null,"finish_reason":{finish}'
        else:
            body = f'{index},"text":{_string(text)},"logprobs":null,"finish_reason":{finish}'
        return (self._head + body + self._tail).encode()

    def usage_event(self, usage: dict[str, int]) -> bytes:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        chunk = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": []}
        chunk["usage"] = usage
        return b"data: " + _dumps(chunk).encode() + b"\n\n"

    def whole(self, texts: Sequence[str], finish_reasons: Sequence[str], usage: dict[str, int]) -> dict[str, Any]:
        if self.kind == "chat":
            choices = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": reason,
                }
                for i, (text, reason) in enumerate(zip(texts, finish_reasons, strict=True))
            ]
            obj = "chat.completion"
        else:
            choices = [
                {"index": i, "text": text, "logprobs": None, "finish_reason": reason}
                for i, (text, reason) in enumerate(zip(texts, finish_reasons, strict=True))
            ]
            obj = "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
        }


def dumps(value: Any) -> bytes:
    return _dumps(value).encode()
