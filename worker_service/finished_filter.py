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

With the worker's own pipeline (worker_service/step_pipeline.py) step N+1 is launched before
step N's tokens are back on the host, so only the rules that need no token value (max_tokens,
the context length) can leave a request out before it runs (`filter_launch`); a request that
N's token ends by EOS or a stop token id is computed in N+1 and its token there is taken out of
N+1's answer (`collected`), so the answer, and what the scheduler streams, are the same.

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
        # the worker's pipeline: (step id, its sampling requests) of the launched steps not
        # collected yet, oldest first; requests to take out of a step's answer, by step id
        self._launched: list[tuple[int, frozenset[str]]] = []
        self._drop_from: dict[int, set[str]] = {}
        self._launched_last = 0
        self._launched_samples: frozenset[str] = frozenset()

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
        return self._without(plan, drop)

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

    # -- the worker's pipeline: a step launched before the one it follows is collected ----

    def filter_launch(self, plan: StepPlan, entries: Mapping[str, _Entry]) -> StepPlan:
        """The plan without the requests the step it follows ends: by every rule when that
        step is collected already, else by count (max_tokens, the context length), what is
        known before its tokens are back."""
        if plan.follows_step_id and plan.follows_step_id == self._last_step:
            return self.filter(plan, entries)
        if not plan.follows_step_id or plan.follows_step_id != self._launched_last:
            return plan
        before = self._launched_samples
        drop = [rid for rid in plan.num_scheduled_tokens if rid in before and self._ends_by_count(rid, entries)]
        return self._without(plan, drop)

    def launched(self, plan: StepPlan) -> None:
        self._launched_last, self._launched_samples = plan.step_id, plan.sample_ids
        self._launched.append((plan.step_id, plan.sample_ids))

    def launch_failed(self) -> None:
        """The last plan did not run: a plan following it drops nothing."""
        self._launched_last, self._launched_samples = 0, frozenset()
        self.observe_result(0, {})

    def collected(self, step_id: int, sampled: dict[str, int], entries: Mapping[str, _Entry]) -> dict[str, int]:
        """A collected step's tokens, less those of requests the step before ended by token;
        notes which requests this step's tokens end, to take them out of the next step's."""
        while self._launched and self._launched[0][0] != step_id:
            self._launched.pop(0)  # a step answered without being collected (void, failed)
        if self._launched:
            self._launched.pop(0)
        drop = self._drop_from.pop(step_id, None)
        if drop:
            sampled = {rid: t for rid, t in sampled.items() if rid not in drop}
            self.num_dropped += len(drop)
        self.observe_result(step_id, sampled)
        if not self._launched:
            return sampled
        next_step, next_samples = self._launched[0]
        requests, eos = self._requests, self.eos_token_ids
        for rid, token in sampled.items():
            known = requests.get(rid)
            if known is None or not ((token in eos and not known[1].ignore_eos) or token in known[1].stop_token_ids):
                continue
            entry = entries.get(rid)
            if entry is None or rid not in next_samples:
                continue
            n = entry.num_tokens - known[0] - 1  # output tokens up to this step's (the next one's is counted)
            if n >= known[1].min_tokens:
                self._drop_from.setdefault(next_step, set()).add(rid)
        return sampled

    def forget_pipeline(self) -> None:
        self._launched.clear()
        self._drop_from.clear()
        self.launch_failed()
        self.observe_result(0, {})

    def _ends_by_count(self, rid: str, entries: Mapping[str, _Entry]) -> bool:
        known = self._requests.get(rid)
        entry = entries.get(rid)
        if known is None or entry is None:
            return False
        return entry.num_tokens - known[0] >= known[1].max_tokens or entry.num_tokens >= self.max_model_len

    def _without(self, plan: StepPlan, drop: list[str]) -> StepPlan:
        if not drop:
            return plan
        self.num_dropped += len(drop)
        gone = set(drop)
        kept = {rid: n for rid, n in plan.num_scheduled_tokens.items() if rid not in gone}
        return replace(plan, num_scheduled_tokens=kept, sample_ids=plan.sample_ids - gone)
