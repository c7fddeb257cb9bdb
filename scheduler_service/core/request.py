"""The scheduler's view of one request: tokens, state, SLOs and the timestamps metrics need.

Like vLLM v1 there is no prefill or decode phase in the scheduler's arithmetic: a request
has `num_tokens` (prompt + generated) and `num_computed_tokens` (tokens whose KV exists);
a step advances it by `num_scheduled_tokens`. The status says where it sits (queue,
batch, preempted, finished); the phase (PREFILLING / DECODING) is kept for metrics and
for policies that treat prompts and generation differently.
"""

from __future__ import annotations

from array import array
from enum import IntEnum
from typing import Any

from scheduler_service.core.prefix import PrefixSource
from scheduler_service.core.slo import NO_SLO, SLOSpec
from sluice.contract.sampling import SamplingParams


class RequestStatus(IntEnum):
    """Ordered: everything from FINISHED_STOPPED on is finished."""

    WAITING = 0
    PREFILLING = 1
    DECODING = 2
    PREEMPTED_RECOMPUTE = 3  # back in the waiting queue, KV dropped
    PREEMPTED_SWAPPED = 4  # KV in CPU swap space
    PREEMPTED_KEPT = 5  # KV kept on the GPU, not scheduled
    FINISHED_STOPPED = 6
    FINISHED_LENGTH = 7
    FINISHED_ABORTED = 8
    FINISHED_TIMEOUT = 9
    FINISHED_REJECTED = 10
    FINISHED_ERROR = 11

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def is_running(self) -> bool:
        return self is RequestStatus.PREFILLING or self is RequestStatus.DECODING

    @property
    def is_waiting(self) -> bool:
        return self is RequestStatus.WAITING or self is RequestStatus.PREEMPTED_RECOMPUTE

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_TIMEOUT: "timeout",
    RequestStatus.FINISHED_REJECTED: "rejected",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """Mutable request state; only the core changes status and token counts."""

    __slots__ = (
        "arrival_time",
        "block_hashes",
        "cache_due",
        "eos_token_ids",
        "finish_message",
        "finish_time",
        "first_scheduled_time",
        "first_token_time",
        "length_source",
        "max_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_output_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "output_token_ids",
        "policy_state",
        "predicted_output_tokens",
        "prefill_len",
        "prefix_salt",
        "prefix_source",
        "priority",
        "prompt_text",
        "prompt_token_ids",
        "queue_enter_time",
        "queue_time",
        "request_id",
        "sampling",
        "slo",
        "status",
        "tenant",
        "token_times",
        "traceparent",
        "true_output_tokens",
        "worker_id",
    )

    def __init__(
        self,
        request_id: str,
        *,
        arrival_time: float,
        num_prompt_tokens: int | None = None,
        prompt_token_ids: list[int] | None = None,
        sampling: SamplingParams | None = None,
        slo: SLOSpec = NO_SLO,
        priority: int = 0,
        tenant: str = "",
        eos_token_ids: frozenset[int] = frozenset(),
        predicted_output_tokens: int | None = None,
        length_source: str = "max_tokens",
        true_output_tokens: int | None = None,
        prompt_text: str | None = None,
        prefix_source: PrefixSource | None = None,
    ) -> None:
        if num_prompt_tokens is None:
            if prompt_token_ids is None:
                raise ValueError("a request needs prompt_token_ids or num_prompt_tokens")
            num_prompt_tokens = len(prompt_token_ids)
        self.request_id = request_id
        self.arrival_time = arrival_time
        self.prompt_token_ids = prompt_token_ids
        self.prompt_text = prompt_text
        self.num_prompt_tokens = num_prompt_tokens
        self.sampling = sampling or SamplingParams()
        self.max_tokens = self.sampling.max_tokens
        self.slo = slo
        self.priority = priority
        self.tenant = tenant
        self.eos_token_ids = eos_token_ids
        self.predicted_output_tokens = predicted_output_tokens
        self.length_source = length_source
        # NOTE: simulator-only ground truth; the core never reads it, only the simulated
        # executor (to emit EOS) and the oracle length source do.
        self.true_output_tokens = true_output_tokens
        self.output_token_ids: list[int] = []
        self.num_output_tokens = 0
        self.num_computed_tokens = 0
        self.prefill_len = num_prompt_tokens
        self.status = RequestStatus.WAITING
        self.worker_id: int | None = None
        self.queue_enter_time = arrival_time
        self.queue_time = 0.0
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.finish_message = ""
        self.token_times = array("d")
        self.num_preemptions = 0
        self.traceparent = ""
        self.policy_state: Any = None
        # Prefix caching (core/prefix.py): what names its blocks when its ids do not (simulation),
        # the chained hashes of its full blocks (computed lazily), and the tokens its last
        # admission found cached.
        self.prefix_source = prefix_source
        self.prefix_salt: int | None = None
        self.block_hashes: list[int] | None = None
        self.num_cached_tokens = 0
        # computed tokens at which its next shareable block is full (0: check at its next step)
        self.cache_due = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """Still computing the tokens known at (re)admission: the prompt, plus the
        generated tokens after a recompute preemption."""
        return self.num_computed_tokens < self.prefill_len

    @property
    def num_prefill_remaining(self) -> int:
        return max(0, self.prefill_len - self.num_computed_tokens)

    @property
    def remaining_output_estimate(self) -> int:
        """Predicted tokens still to generate (at least 1 while unfinished)."""
        predicted = self.predicted_output_tokens if self.predicted_output_tokens is not None else self.max_tokens
        return max(1, predicted - self.num_output_tokens)

    @property
    def deadline(self) -> float | None:
        return None if self.slo.jct_s is None else self.arrival_time + self.slo.jct_s

    def all_token_ids(self) -> list[int]:
        return list(self.prompt_token_ids or ()) + self.output_token_ids

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
