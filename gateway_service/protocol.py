"""OpenAI request bodies -> the scheduler's GenerateRequests (pure: no I/O).

    parse_completion(body)            POST /v1/completions
    parse_chat(body, template)        POST /v1/chat/completions (messages rendered to one prompt)
        -> Parsed: the prompts, n, stream and usage options, and the GenerateRequest options
    Parsed.requests(base_id) -> one GenerateRequest per choice (prompt i, sample j: choice
        index i * n + j), ids `base_id` or `base_id-k` when there are several

Each field is checked for its type here (400 naming it); ranges are the scheduler's to check
(it names its own field, which errors.py turns back into the client's name). Fields the
scheduler cannot honour answer 400 naming them instead of being dropped silently: `logprobs`
and `top_logprobs` (the stream carries no log-probabilities), `echo`, `suffix`, `best_of`
other than n, `logit_bias`, tools and function calls, and a `response_format` other than
text. Unknown fields are ignored, as OpenAI does.

Sluice's own fields ride in the same body (the `openai` client's `extra_body`): `ttft_ms`,
`tbt_ms`, `jct_ms` (SLOs in milliseconds), `slo_class` (online or offline), `priority` (lower
is served first), `predicted_output_tokens` (the client's estimate of the output length), and
vLLM's `ignore_eos`, `min_tokens`, `min_p`, `repetition_penalty`, `stop_token_ids`,
`skip_special_tokens`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway_service.chat import ChatTemplate, TemplateFailed
from gateway_service.errors import invalid
from sluice.common.client import build_request
from sluice.v1 import common_pb2, generation_pb2

MAX_CHOICES = 128  # prompts x n of one HTTP request (each is a request of its own to the scheduler)
# NOTE: OpenAI's default for /v1/completions (vLLM's too); a chat without max_tokens gets the
# scheduler's default_max_tokens, capped by the context left after its prompt.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
SLO_CLASSES = ("online", "offline")

Prompt = str | list[int]


@dataclass
class Parsed:
    kind: str  # "completion" or "chat"
    model: str | None
    prompts: list[Prompt]
    n: int
    stream: bool
    include_usage: bool
    options: dict[str, Any]  # keyword arguments of build_request, and sampling_extra (more SamplingParams)
    aliases: dict[str, str] = field(default_factory=dict)  # scheduler field -> this request's name
    request_id: str = ""

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def requests(self, base_id: str) -> list[generation_pb2.GenerateRequest]:
        many = self.num_choices > 1
        options = dict(self.options)
        extra = common_pb2.SamplingParams(**options.pop("sampling_extra", {}))
        out = []
        for i, prompt in enumerate(self.prompts):
            for j in range(self.n):
                index = i * self.n + j
                rid = f"{base_id}-{index}" if many else base_id
                request = build_request(prompt, request_id=rid, **options)
                request.sampling_params.MergeFrom(extra)
                out.append(request)
        return out


# ---------------------------------------------------------------- field checks


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise invalid(name, f"must be a number, got {type(value).__name__}")
    return float(value)


# The integer fields' ranges on the wire (protobuf uint32, int32, uint64): a value past them
# cannot be sent at all, so it is a 400 here; the scheduler checks the ranges that matter inside.
UINT32_MAX = 2**32 - 1
INT32 = (-(2**31), 2**31 - 1)
UINT64_MAX = 2**64 - 1


def _integer(body: dict, name: str, minimum: int | None = None, maximum: int = UINT32_MAX) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise invalid(name, f"must be an integer, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise invalid(name, f"must be >= {minimum}, got {value}")
    if value > maximum:
        raise invalid(name, f"must be <= {maximum}, got {value}")
    return value


def _boolean(body: dict, name: str) -> bool | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise invalid(name, f"must be true or false, got {type(value).__name__}")
    return value


def _string(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise invalid(name, f"must be a string, got {type(value).__name__}")
    return value


def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return list(value)
    raise invalid("stop", "must be a string or a list of strings")


_INTS = {int}


def _token_list(value: Any) -> bool:
    # NOTE: by exact type, not _is_int per id: JSON gives exact ints (and bool is a type of its
    # own), and this loop over a long prompt was the costliest step of parsing a request; the
    # range in C too (a negative id, or one past uint32, could not be sent)
    return isinstance(value, list) and set(map(type, value)) == _INTS and min(value) >= 0 and max(value) <= UINT32_MAX


def _prompts(body: dict) -> list[Prompt]:
    if "prompt" not in body or body["prompt"] is None:
        raise invalid("prompt", "is required")
    value = body["prompt"]
    if isinstance(value, str):
        return [value]
    if _token_list(value):
        return [list(value)]
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return list(value)
        if all(_token_list(p) for p in value):
            return [list(p) for p in value]
    raise invalid(
        "prompt",
        "must be a string, a list of strings, a list of token ids or a list of lists of token ids (none empty)",
    )


def _unsupported(body: dict, kind: str) -> None:
    """400 for the OpenAI fields whose meaning the scheduler cannot deliver."""
    no_logprobs = "the scheduler's stream carries no log-probabilities"
    if kind == "completion" and body.get("logprobs") is not None:
        raise invalid("logprobs", f"is not supported: {no_logprobs}")
    if kind == "chat" and body.get("logprobs"):
        raise invalid("logprobs", f"is not supported: {no_logprobs}")
    if body.get("top_logprobs") is not None:
        raise invalid("top_logprobs", f"is not supported: {no_logprobs}")
    if body.get("echo"):
        raise invalid("echo", "is not supported")
    if body.get("suffix") is not None:
        raise invalid("suffix", "is not supported")
    if body.get("logit_bias"):
        raise invalid("logit_bias", "is not supported")
    for name in ("tools", "functions"):
        if body.get(name):
            raise invalid(name, "is not supported: Sluice serves text generation without tool calls")
    if body.get("tool_choice") not in (None, "none"):
        raise invalid("tool_choice", "is not supported")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise invalid("response_format", 'only {"type": "text"} is supported')


def _common(body: dict, kind: str, max_tokens_default: int | None) -> tuple[dict[str, Any], dict[str, str]]:
    """build_request options from the fields both endpoints share, and the field aliases."""
    aliases: dict[str, str] = {}
    max_tokens = _integer(body, "max_completion_tokens", minimum=1)
    if max_tokens is not None:
        aliases["max_tokens"] = "max_completion_tokens"
    else:
        max_tokens = _integer(body, "max_tokens", minimum=1)
        if max_tokens is None:
            max_tokens = max_tokens_default
    top_k = _integer(body, "top_k", minimum=INT32[0])
    slo_class = _string(body, "slo_class")
    if slo_class is not None and slo_class not in SLO_CLASSES:
        raise invalid("slo_class", f"must be one of {', '.join(SLO_CLASSES)}, got {slo_class!r}")
    stop_token_ids = body.get("stop_token_ids") or []
    if not (isinstance(stop_token_ids, list) and all(_is_int(t) and 0 <= t <= UINT32_MAX for t in stop_token_ids)):
        raise invalid("stop_token_ids", f"must be a list of token ids (0 to {UINT32_MAX})")
    options: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": _number(body, "temperature"),
        "top_p": _number(body, "top_p"),
        # NOTE: vLLM's -1 (and 0) mean "all tokens", as an unset top_k does here
        "top_k": None if top_k is not None and top_k <= 0 else top_k,
        "seed": _integer(body, "seed", minimum=0, maximum=UINT64_MAX),
        "stop": _stop(body),
        "ignore_eos": bool(_boolean(body, "ignore_eos")),
        "ttft_ms": _number(body, "ttft_ms"),
        "tbt_ms": _number(body, "tbt_ms"),
        "jct_ms": _number(body, "jct_ms"),
        "slo_class": slo_class,
        "priority": _integer(body, "priority", minimum=INT32[0], maximum=INT32[1]) or 0,
        "tenant": _string(body, "user") or "",
        "predicted_output_tokens": _integer(body, "predicted_output_tokens", minimum=0) or 0,
    }
    extra = {
        "min_p": _number(body, "min_p"),
        "min_tokens": _integer(body, "min_tokens", minimum=0),
        "presence_penalty": _number(body, "presence_penalty"),
        "frequency_penalty": _number(body, "frequency_penalty"),
        "repetition_penalty": _number(body, "repetition_penalty"),
        "skip_special_tokens": _boolean(body, "skip_special_tokens"),
        "stop_token_ids": list(stop_token_ids),
    }
    options["sampling_extra"] = {k: v for k, v in extra.items() if v not in (None, [])}
    return options, aliases


def _stream_options(body: dict) -> tuple[bool, bool]:
    stream = bool(_boolean(body, "stream"))
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise invalid("stream_options", "is only allowed with stream: true")
    if not isinstance(opts, dict):
        raise invalid("stream_options", "must be an object")
    include = opts.get("include_usage", False)
    if not isinstance(include, bool):
        raise invalid("stream_options.include_usage", "must be true or false")
    return stream, include


def _n(body: dict, num_prompts: int) -> int:
    n = _integer(body, "n", minimum=1) or 1
    best_of = _integer(body, "best_of", minimum=1)
    if best_of is not None and best_of != n:
        raise invalid("best_of", "is not supported (other than equal to n): every sample is returned")
    if n * num_prompts > MAX_CHOICES:
        raise invalid("n", f"{n} choices for each of {num_prompts} prompts: at most {MAX_CHOICES} in all")
    return n


def _parse(body: Any, kind: str, prompts: Callable[[dict], list[Prompt]], default_max: int | None) -> Parsed:
    if not isinstance(body, dict):
        raise invalid("body", "must be a JSON object")
    model = _string(body, "model")
    _unsupported(body, kind)
    found = prompts(body)
    options, aliases = _common(body, kind, default_max)
    stream, include_usage = _stream_options(body)
    n = _n(body, len(found))
    if kind == "chat":
        aliases["prompt"] = "messages"
    request_id = _string(body, "request_id") or ""
    return Parsed(kind, model, found, n, stream, include_usage, options, aliases, request_id)


def parse_completion(body: Any) -> Parsed:
    return _parse(body, "completion", _prompts, COMPLETIONS_DEFAULT_MAX_TOKENS)


def _content(value: Any, where: str) -> str:
    """A message's content as text: a string, or the text parts of a list of parts."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for k, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(f"{where}[{k}]", 'only text parts ({"type": "text", "text": ...}) are supported')
            texts.append(part["text"])
        return "\n".join(texts)
    raise invalid(where, "must be a string or a list of text parts")


def messages_of(body: dict) -> list[dict[str, Any]]:
    value = body.get("messages")
    if not isinstance(value, list) or not value:
        raise invalid("messages", "is required: a non-empty list of {role, content} objects")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise invalid(f"messages[{i}]", "must be an object with role and content")
        role = message.get("role")
        if role not in ROLES:
            raise invalid(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        item = {"role": role, "content": _content(message.get("content"), f"messages[{i}].content")}
        if isinstance(message.get("name"), str):
            item["name"] = message["name"]
        out.append(item)
    return out


def parse_chat(body: Any, template: ChatTemplate) -> Parsed:
    def render(b: dict) -> list[Prompt]:
        messages = messages_of(b)
        try:
            return [template.render(messages)]
        except TemplateFailed as exc:
            raise invalid("messages", str(exc)) from None

    return _parse(body, "chat", render, None)
