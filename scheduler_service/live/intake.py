"""A client's GenerateRequest -> a core Request, or InvalidRequestError naming the field.

    check_request(msg, limits)    sizes and ranges, before any work: request_id, tenant, labels,
                                  prompt bytes or ids, stop strings and ids, top_k, priority,
                                  SLO class and values (ms)
    (the caller tokenizes a text prompt off the event loop: Tokenizer.encode_unlocked)
    build_request(msg, ids, ...)  request_id (the field, else x-request-id, else a fresh id)
                                  sampling: plan_codec.sampling_from_proto (ranges); max_tokens
                                      defaulted to what fits
                                  slo: milliseconds -> SLOSpec seconds
                                  limits: prompt + max_tokens within the model's context and
                                      one worker's KV cache

One rule decides how long a prompt may be (`Limits.max_prompt_tokens`, what GetServerInfo
advertises): it must leave room for one output token in the model's context and in one
worker's KV cache. Duplicate ids and a full queue depend on live state, so LiveScheduler
checks those.
"""

from __future__ import annotations

import math
import re
import uuid
from dataclasses import dataclass, replace

from scheduler_service.core.request import Request
from scheduler_service.core.slo import NO_SLO, SLOClass, SLOSpec
from sluice.contract.plan_codec import sampling_from_proto
from sluice.contract.sampling import InvalidRequestError, SamplingParams
from sluice.v1 import common_pb2, generation_pb2

_SLO_CLASSES = {common_pb2.SLO_CLASS_ONLINE: SLOClass.ONLINE, common_pb2.SLO_CLASS_OFFLINE: SLOClass.OFFLINE}
_SLO_FIELDS = ("ttft_ms", "tbt_ms", "jct_ms")

# The fixed size limits of a GenerateRequest (stated in the proto comments).
MAX_ID_BYTES = 256
MAX_TENANT_BYTES = 256
MAX_LABELS = 32
MAX_LABEL_VALUE_BYTES = 256
MAX_STOP_STRINGS = 16
MAX_STOP_BYTES = 256
MAX_STOP_TOKEN_IDS = 64
PRIORITY_RANGE = (-1000, 1000)
MAX_ABORT_IDS = 1024
# NOTE: prompt text is checked in bytes before tokenizing; 32 bytes per token of context is
# far above any tokenizer's average (about 4 for English, 3 per CJK character) and keeps an
# 8 MB prompt from reaching the tokenizer of a 2k-context model.
PROMPT_BYTES_PER_TOKEN = 32
_LABEL_KEY = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
# NOTE: printable ASCII only: the id travels in `x-request-id` metadata, whose values gRPC
# allows only in that range (a non-ASCII id failed the call at its initial metadata).
_PRINTABLE = re.compile(r"[\x20-\x7e]*")


@dataclass(frozen=True, slots=True)
class Limits:
    max_model_len: int  # prompt + output, tokens
    max_kv_tokens: int  # tokens one worker's whole KV cache holds
    vocab_size: int
    default_max_tokens: int
    eos_token_ids: frozenset[int]
    max_prompt_bytes: int = 0  # 0: PROMPT_BYTES_PER_TOKEN x the longest prompt served

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt: one output token must still fit the context and a worker's KV."""
        return min(self.max_model_len, self.max_kv_tokens) - 1

    @property
    def prompt_bytes(self) -> int:
        """The longest text prompt in bytes: the configured one, else 32 bytes per token of the
        longest prompt served, which a worker's KV cache bounds as well as the context (a
        128k-context model on 512 blocks of 16 served 4 MiB texts that could never fit)."""
        return self.max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * (self.max_prompt_tokens + 1)


def check_id(value: str, name: str) -> None:
    size = len(value.encode())
    if size > MAX_ID_BYTES:
        raise InvalidRequestError(name, f"is {size} bytes; the limit is {MAX_ID_BYTES}")
    if not _PRINTABLE.fullmatch(value):
        raise InvalidRequestError(name, "must be printable ASCII (it travels in gRPC metadata)")


def check_request(msg: generation_pb2.GenerateRequest, limits: Limits) -> None:
    """Everything that can be judged without tokenizing (cheap: sizes before contents)."""
    check_id(msg.request_id, "request_id")
    _check_prompt(msg, limits)
    _check_tags(msg)
    _check_sampling_sizes(msg.sampling_params, limits)
    _check_slo(msg)


def _check_prompt(msg: generation_pb2.GenerateRequest, limits: Limits) -> None:
    kind = msg.WhichOneof("prompt")
    if kind == "text":
        size = len(msg.text.encode())
        if size > limits.prompt_bytes:
            raise InvalidRequestError("text", f"the prompt is {size} bytes; the limit is {limits.prompt_bytes}")
        if not msg.text:
            raise InvalidRequestError("text", "the prompt must not be empty")
    elif kind == "token_ids":
        ids = msg.token_ids.ids
        if not ids:
            raise InvalidRequestError("token_ids.ids", "the prompt must not be empty")
        if len(ids) > limits.max_prompt_tokens:
            raise InvalidRequestError(
                "token_ids.ids", f"the prompt has {len(ids)} tokens; the limit is {limits.max_prompt_tokens}"
            )
        bad = next((t for t in ids if t >= limits.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError("token_ids.ids", f"id {bad} is outside the vocabulary [0, {limits.vocab_size})")
    else:
        raise InvalidRequestError("prompt", "give the prompt as text or token_ids")


def _check_tags(msg: generation_pb2.GenerateRequest) -> None:
    tenant = len(msg.tenant.encode())
    if tenant > MAX_TENANT_BYTES:
        raise InvalidRequestError("tenant", f"is {tenant} bytes; the limit is {MAX_TENANT_BYTES}")
    if len(msg.labels) > MAX_LABELS:
        raise InvalidRequestError("labels", f"has {len(msg.labels)} entries; the limit is {MAX_LABELS}")
    for key, value in msg.labels.items():
        if not _LABEL_KEY.fullmatch(key):
            raise InvalidRequestError("labels", f"key {key[:64]!r} must be 1 to 64 characters from [A-Za-z0-9_.-]")
        if len(value.encode()) > MAX_LABEL_VALUE_BYTES:
            raise InvalidRequestError(f"labels[{key}]", f"the value is over {MAX_LABEL_VALUE_BYTES} bytes")
    low, high = PRIORITY_RANGE
    if not low <= msg.priority <= high:
        raise InvalidRequestError("priority", f"must be in [{low}, {high}], got {msg.priority}")


def _check_sampling_sizes(sp: common_pb2.SamplingParams, limits: Limits) -> None:
    if len(sp.stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError(
            "sampling_params.stop", f"has {len(sp.stop)} strings; the limit is {MAX_STOP_STRINGS}"
        )
    for i, stop in enumerate(sp.stop):
        if len(stop.encode()) > MAX_STOP_BYTES:
            raise InvalidRequestError(f"sampling_params.stop[{i}]", f"is over {MAX_STOP_BYTES} bytes")
    if len(sp.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(
            "sampling_params.stop_token_ids", f"has {len(sp.stop_token_ids)} ids; the limit is {MAX_STOP_TOKEN_IDS}"
        )
    bad = next((t for t in sp.stop_token_ids if t >= limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(
            "sampling_params.stop_token_ids", f"id {bad} is outside the vocabulary [0, {limits.vocab_size})"
        )
    if sp.HasField("top_k") and sp.top_k > limits.vocab_size:
        raise InvalidRequestError(
            "sampling_params.top_k", f"must be at most the vocabulary size {limits.vocab_size}, got {sp.top_k}"
        )


def _check_slo(msg: generation_pb2.GenerateRequest) -> None:
    if not msg.HasField("slo"):
        return
    s = msg.slo
    if s.slo_class not in common_pb2.SloClass.values():
        raise InvalidRequestError(
            "slo.slo_class", f"unknown value {s.slo_class}; use ONLINE, OFFLINE or leave it unset"
        )
    for name in _SLO_FIELDS:
        if s.HasField(name):
            value = getattr(s, name)
            if not (value > 0.0 and math.isfinite(value)):
                raise InvalidRequestError(
                    f"slo.{name}", f"must be a finite number of milliseconds > 0, got {value!r} ms"
                )


def build_request(
    msg: generation_pb2.GenerateRequest,
    limits: Limits,
    prompt_ids: list[int],
    now: float,
    request_id: str = "",
) -> Request:
    """A checked message (`check_request`) and its prompt's token ids -> a core Request."""
    prompt_field = "text" if msg.WhichOneof("prompt") == "text" else "token_ids.ids"
    if not prompt_ids:
        raise InvalidRequestError(prompt_field, "the prompt has no tokens")
    sampling = _sampling(msg, len(prompt_ids), prompt_field, limits)
    predicted = msg.predicted_output_tokens or None
    return Request(
        request_id or msg.request_id or uuid.uuid4().hex,
        arrival_time=now,
        prompt_token_ids=prompt_ids,
        sampling=sampling,
        slo=slo_of(msg),
        priority=msg.priority,
        tenant=msg.tenant,
        eos_token_ids=limits.eos_token_ids,
        predicted_output_tokens=min(predicted, sampling.max_tokens) if predicted else None,
        length_source="client" if predicted else "max_tokens",
        prompt_text=msg.text if prompt_field == "text" else None,
    )


def _sampling(
    msg: generation_pb2.GenerateRequest, num_prompt: int, prompt_field: str, limits: Limits
) -> SamplingParams:
    if num_prompt > limits.max_prompt_tokens:
        raise InvalidRequestError(
            prompt_field, f"the prompt has {num_prompt} tokens; the limit is {limits.max_prompt_tokens}"
        )
    limit = min(limits.max_model_len, limits.max_kv_tokens)
    params = sampling_from_proto(msg.sampling_params)
    if not msg.sampling_params.HasField("max_tokens"):
        params = replace(params, max_tokens=min(limits.default_max_tokens, limit - num_prompt))
        params.validate()
    total = num_prompt + params.max_tokens
    if total > limits.max_model_len:
        raise InvalidRequestError(
            "sampling_params.max_tokens",
            f"prompt ({num_prompt}) + max_tokens ({params.max_tokens}) = {total} exceeds the model's "
            f"limit of {limits.max_model_len} tokens",
        )
    if total > limits.max_kv_tokens:
        raise InvalidRequestError(
            "sampling_params.max_tokens",
            f"prompt ({num_prompt}) + max_tokens ({params.max_tokens}) = {total} exceeds a worker's "
            f"KV cache of {limits.max_kv_tokens} tokens",
        )
    return params


def slo_of(msg: generation_pb2.GenerateRequest) -> SLOSpec:
    if not msg.HasField("slo"):
        return NO_SLO
    s = msg.slo

    def seconds(name: str) -> float | None:
        return getattr(s, name) / 1e3 if s.HasField(name) else None

    return SLOSpec(seconds("ttft_ms"), seconds("tbt_ms"), seconds("jct_ms"), _SLO_CLASSES.get(s.slo_class))
