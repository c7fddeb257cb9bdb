"""FinishedFilter: overlapped scheduling's drop of requests that finished one step earlier.

A plan made ahead (`follows_step_id` = N) still schedules every request that was running when
it was made, including those that the token they sampled in step N finishes: the scheduler
learns of it only from answer N. The worker already knows: it sampled that token. So before
running step N+1 it leaves out each request whose step-N token ends it, by the scheduler's own
rules (an EOS token unless ignored, a stop token id, both only from min_tokens on; max_tokens;
the context length), and answers without a token for it. The scheduler ends such a request
when it reads answer N and discards any token of it from N+1 (`Scheduler._void`), so nothing
finished is computed or streamed twice; a stop string, an abort or a context limit the
scheduler sets lower than the worker's are found only there, and such an extra token is
computed and discarded.

The rules here never end a request the scheduler would not: the EOS ids and the context
length are the worker's own (the scheduler takes its EOS ids from the worker's Info and its
context length is at most the worker's), and the sampling parameters are the request's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Protocol

from sluice.contract.plan import StepPlan
from sluice.contract.sampling import SamplingParams


class _Entry(Protocol):
    num_tokens: int


class FinishedFilter:
    """One Execute stream's view: each request's prompt length and sampling, the last step's tokens."""

    def __init__(self, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._requests: dict[str, tuple[int, SamplingParams]] = {}  # id -> (prompt tokens, sampling)
        self._last_step = 0
        self._last_sampled: Mapping[str, int] = {}
        self.num_dropped = 0

    def observe_plan(self, plan: StepPlan) -> None:
        requests = self._requests
        for rid in plan.release_ids:
            requests.pop(rid, None)
        for new in plan.new_requests:
            requests[new.request_id] = (new.num_tokens - new.num_output_tokens, new.sampling)

    def observe_result(self, step_id: int, sampled: Mapping[str, int]) -> None:
        self._last_step, self._last_sampled = step_id, sampled

    def filter(self, plan: StepPlan, entries: Mapping[str, _Entry]) -> StepPlan:
        """The plan without the requests its predecessor finished (the same plan when none)."""
        if not plan.follows_step_id or plan.follows_step_id != self._last_step:
            return plan
        sampled = self._last_sampled
        drop = [
            rid
            for rid in plan.num_scheduled_tokens
            if (token := sampled.get(rid)) is not None and self._finished(rid, token, entries)
        ]
        if not drop:
            return plan
        self.num_dropped += len(drop)
        gone = set(drop)
        kept = {rid: n for rid, n in plan.num_scheduled_tokens.items() if rid not in gone}
        return replace(plan, num_scheduled_tokens=kept, sample_ids=plan.sample_ids - gone)

    def _finished(self, rid: str, token: int, entries: Mapping[str, _Entry]) -> bool:
        known = self._requests.get(rid)
        entry = entries.get(rid)
        if known is None or entry is None:
            return False
        prompt, sp = known
        n = entry.num_tokens - prompt  # output tokens, the one sampled in the previous step included
        if n >= sp.min_tokens and ((token in self.eos_token_ids and not sp.ignore_eos) or token in sp.stop_token_ids):
            return True
        return n >= sp.max_tokens or entry.num_tokens >= self.max_model_len
