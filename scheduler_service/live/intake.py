"""A client's GenerateRequest -> a core Request, or InvalidRequestError naming the field.

    request_id     empty -> a fresh id
    text           tokenized with the model's tokenizer (the same file the worker loads)
    token_ids      used as given (checked against the vocabulary)
    sampling       plan_codec.sampling_from_proto (ranges); max_tokens defaulted to what fits
    slo            milliseconds -> SLOSpec seconds; SLOSpec.validate (positive)
    limits         prompt + max_tokens within the model's context and one worker's KV cache

Duplicate ids and a full queue depend on live state, so LiveScheduler checks those.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from scheduler_service.core.request import Request
from scheduler_service.core.sampling import InvalidRequestError, SamplingParams
from scheduler_service.core.slo import NO_SLO, SLOClass, SLOSpec
from scheduler_service.plan_codec import sampling_from_proto
from sluice.v1 import common_pb2, generation_pb2

if TYPE_CHECKING:
    from worker_service.tokenizer import Tokenizer

_SLO_CLASSES = {common_pb2.SLO_CLASS_ONLINE: SLOClass.ONLINE, common_pb2.SLO_CLASS_OFFLINE: SLOClass.OFFLINE}


@dataclass(frozen=True, slots=True)
class Limits:
    max_model_len: int  # prompt + output, tokens
    max_kv_tokens: int  # tokens one worker's whole KV cache holds
    vocab_size: int
    default_max_tokens: int
    eos_token_ids: frozenset[int]


def build_request(
    msg: generation_pb2.GenerateRequest, limits: Limits, tokenizer: Tokenizer | None, now: float
) -> Request:
    prompt_ids, prompt_field, text = _prompt(msg, limits, tokenizer)
    sampling = _sampling(msg, len(prompt_ids), prompt_field, limits)
    slo = _slo(msg)
    predicted = msg.predicted_output_tokens or None
    return Request(
        msg.request_id or uuid.uuid4().hex,
        arrival_time=now,
        prompt_token_ids=prompt_ids,
        sampling=sampling,
        slo=slo,
        priority=msg.priority,
        tenant=msg.tenant,
        eos_token_ids=limits.eos_token_ids,
        predicted_output_tokens=min(predicted, sampling.max_tokens) if predicted else None,
        length_source="client" if predicted else "max_tokens",
        prompt_text=text,
    )


def _prompt(
    msg: generation_pb2.GenerateRequest, limits: Limits, tokenizer: Tokenizer | None
) -> tuple[list[int], str, str | None]:
    kind = msg.WhichOneof("prompt")
    if kind == "text":
        if not msg.text:
            raise InvalidRequestError("text", "the prompt must not be empty")
        if tokenizer is None:
            raise InvalidRequestError("text", "this server has no tokenizer for its model; send token_ids instead")
        ids = tokenizer.encode(msg.text)
        if not ids:
            raise InvalidRequestError("text", "the prompt has no tokens")
        return ids, "text", msg.text
    if kind == "token_ids":
        ids = list(msg.token_ids.ids)
        if not ids:
            raise InvalidRequestError("token_ids.ids", "the prompt must not be empty")
        bad = next((t for t in ids if t >= limits.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError("token_ids.ids", f"id {bad} is outside the vocabulary [0, {limits.vocab_size})")
        return ids, "token_ids.ids", None
    raise InvalidRequestError("prompt", "give the prompt as text or token_ids")


def _sampling(
    msg: generation_pb2.GenerateRequest, num_prompt: int, prompt_field: str, limits: Limits
) -> SamplingParams:
    limit = min(limits.max_model_len, limits.max_kv_tokens)
    if num_prompt >= limit:
        raise InvalidRequestError(prompt_field, f"the prompt has {num_prompt} tokens; the limit is {limit - 1}")
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


def _slo(msg: generation_pb2.GenerateRequest) -> SLOSpec:
    if not msg.HasField("slo"):
        return NO_SLO
    s = msg.slo

    def seconds(name: str) -> float | None:
        return getattr(s, name) / 1e3 if s.HasField(name) else None

    spec = SLOSpec(seconds("ttft_ms"), seconds("tbt_ms"), seconds("jct_ms"), _SLO_CLASSES.get(s.slo_class))
    spec.validate("slo")
    return spec
