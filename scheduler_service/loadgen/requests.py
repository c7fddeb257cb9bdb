"""The bench's requests: one `BenchRequest` per trace request, sized to the server's context,
and the `RequestRecord` the client fills while it runs (send time, the arrival time of every
token, finish reason, the server's timings, the gRPC error)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler_service.core.slo import SLOSpec
    from scheduler_service.workloads import Workload
    from sluice.common.client import Timings

PROMPT_TOKEN_BASE = 1000  # synthetic prompt ids cycle through [1000, 2000): valid in every vocabulary we serve
PROMPT_TOKEN_SPAN = 1000
PROMPT_SOURCES = ("auto", "tokens", "text")


@dataclass(frozen=True, slots=True)
class BenchRequest:
    request_id: str
    arrival_s: float | None  # offset from the start of the run; None in closed-loop mode
    prompt: str | tuple[int, ...]
    num_prompt_tokens: int  # the trace's count (the server's tokenizer decides for text prompts)
    max_tokens: int  # oracle: the trace's output length; else the context left (both clipped to --max-tokens)
    slo: SLOSpec
    priority: int = 0
    tenant: str = ""
    ignore_eos: bool = False  # True only with oracle lengths: the request runs to exactly max_tokens


@dataclass(slots=True)
class RequestRecord:
    request: BenchRequest
    sent_s: float = 0.0  # seconds since the run started
    end_s: float = 0.0
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    timings: Timings | None = None
    error_code: str = ""  # gRPC status name when the call failed
    message: str = ""


def synthetic_prompt(num_tokens: int, offset: int) -> tuple[int, ...]:
    """Token ids of a given length; `offset` varies them between requests (no shared prefixes)."""
    return tuple(PROMPT_TOKEN_BASE + (offset * 7919 + i * 31) % PROMPT_TOKEN_SPAN for i in range(num_tokens))


def prepare_requests(
    workload: Workload,
    max_model_len: int,
    *,
    max_tokens: int | None = None,
    prompt_source: str = "auto",
    oracle_lengths: bool = False,
) -> list[BenchRequest]:
    """One BenchRequest per trace request: the prompt clipped to leave room for one output
    token; `max_tokens` the context left (and at most `max_tokens`), or with `oracle_lengths`
    the trace's true output length under the same caps, run with `ignore_eos`. Text prompts
    are used when the trace has them (`auto`, `text`) and they are not longer than the context."""
    from scheduler_service.core.slo import NO_SLO

    if prompt_source not in PROMPT_SOURCES:
        raise ValueError(f"prompt_source must be one of {PROMPT_SOURCES}, got {prompt_source!r}")
    out = []
    for i, tr in enumerate(workload.requests):
        prompt_len = min(max(1, tr.prompt_tokens), max_model_len - 1)
        room = max_model_len - prompt_len
        cap = min(room, max_tokens or room)
        num_out = max(1, min(tr.output_tokens, cap)) if oracle_lengths else max(1, cap)
        prompt: str | tuple[int, ...]
        if prompt_source != "tokens" and tr.prompt_text and tr.prompt_tokens == prompt_len:
            prompt = tr.prompt_text
        elif prompt_source == "text":
            raise ValueError(f"request {tr.request_id!r} has no prompt text that fits {max_model_len} tokens")
        else:
            prompt = synthetic_prompt(prompt_len, i)
        out.append(
            BenchRequest(
                request_id=f"bench-{i}-{tr.request_id}",
                arrival_s=tr.arrival_s,
                prompt=prompt,
                num_prompt_tokens=prompt_len,
                max_tokens=num_out,
                slo=tr.slo or NO_SLO,
                priority=tr.priority,
                tenant=tr.tenant,
                ignore_eos=oracle_lengths,
            )
        )
    return out
