"""PlanWriter: what one worker has been told, and the plans that tell it more.

The worker keeps a persistent batch (vLLM v1, TGI): a request is sent once in full
(`NewRequestData`), then only as a diff of new block ids when its table grows, or whole again
(`resumed`) when its table was replaced (swap-in, lending, shrinking). This class is the
scheduler's mirror of that state:

    knows(rid)            the worker holds the request (it has been sent in full)
    replace_table(rid)    the next plan sends the request's whole table
    forget(rid)           the worker must drop it: released in the next plan if it was known
    write(...)            one StepPlan from the step's decisions; updates the mirror
    reset() / clear()     the worker's state is unreliable (release all) / gone (nothing to release)

It holds no requests and decides nothing; the Scheduler owns the request sets and the policy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

from scheduler_service.core.request import Request
from sluice.contract.plan import CachedRequestData, KVMove, NewRequestData, StepPlan, new_request_data


class PlanWriter:
    def __init__(self, worker_id: int) -> None:
        self.worker_id = worker_id
        self.step_id = 0
        self._known: set[str] = set()  # requests the worker holds
        self._sent_blocks: dict[str, int] = {}  # blocks of each table the worker has been sent
        self._table_replaced: set[str] = set()  # tables to send whole next time
        self._pending_releases: list[str] = []

    def knows(self, request_id: str) -> bool:
        return request_id in self._known

    @property
    def known_ids(self) -> AbstractSet[str]:
        """Every request the worker holds (`knows` of many at once); read it, never change it."""
        return self._known

    @property
    def has_pending_releases(self) -> bool:
        return bool(self._pending_releases)

    def replace_table(self, request_id: str) -> None:
        self._table_replaced.add(request_id)

    def forget(self, request_id: str) -> None:
        """The worker must drop the request (its blocks are already free on the scheduler)."""
        self._sent_blocks.pop(request_id, None)
        self._table_replaced.discard(request_id)
        if request_id in self._known:
            self._known.discard(request_id)
            self._pending_releases.append(request_id)

    def reset(self) -> None:
        """The worker's state is unreliable: everything it holds is released next plan."""
        self._pending_releases = sorted(set(self._pending_releases) | self._known)
        self._known.clear()
        self._sent_blocks.clear()
        self._table_replaced.clear()

    def release_again(self, request_ids: list[str]) -> None:
        """Releases sent in plans the worker did not apply (failed or void) go out again."""
        pending = self._pending_releases
        pending.extend(rid for rid in request_ids if rid not in pending and rid not in self._known)

    def clear(self) -> None:
        """The worker is gone: nothing to tell it."""
        self._known.clear()
        self._sent_blocks.clear()
        self._table_replaced.clear()
        self._pending_releases.clear()

    def write(
        self,
        scheduled: Mapping[str, int],
        running: Mapping[str, Request],
        tables: Mapping[str, list[int]],
        kv_moves: Sequence[KVMove],
        token_budget: int,
        metadata: Mapping[str, Any],
        follows_step_id: int = 0,
    ) -> StepPlan:
        """The plan of one step: `scheduled` (request id -> tokens, batch order) over the
        running requests and their GPU block tables; `follows_step_id`: the step in flight it
        was planned ahead of (overlap), 0 when none."""
        new: list[NewRequestData] = []
        ids: list[str] = []
        blocks: list[tuple[int, ...]] = []
        resumed: list[bool] = []
        computed: list[int] = []
        sample: list[str] = []
        known, sent, replaced = self._known, self._sent_blocks, self._table_replaced
        get_sent = sent.get
        for rid, n in scheduled.items():
            req = running[rid]
            table = tables[rid]
            size = len(table)
            # NOTE: `sent` holds exactly the known requests (added, forgotten and cleared with
            # `known`): one lookup answers both
            was = get_sent(rid)
            if was is None:
                new.append(_new_request_data(req, table))
                known.add(rid)
                replaced.discard(rid)
                sent[rid] = size
            elif replaced and rid in replaced:
                replaced.discard(rid)
                ids.append(rid)
                blocks.append(tuple(table))
                resumed.append(True)
                computed.append(req.num_computed_tokens)
                sent[rid] = size
            elif size > was:
                # NOTE: only requests whose table grew are listed: a 256-decode step whose
                # blocks did not change sends no per-request diff at all.
                ids.append(rid)
                blocks.append(tuple(table[was:]))
                resumed.append(False)
                computed.append(req.num_computed_tokens)
                sent[rid] = size
            elif size < was:
                sent[rid] = size
            if req.num_computed_tokens + n >= req.num_prompt_tokens + req.num_output_tokens:
                sample.append(rid)
        self.step_id += 1
        releases = tuple(self._pending_releases)
        self._pending_releases.clear()
        return StepPlan(
            step_id=self.step_id,
            worker_id=self.worker_id,
            new_requests=tuple(new),
            cached_requests=CachedRequestData(tuple(ids), tuple(blocks), tuple(resumed), tuple(computed)),
            num_scheduled_tokens=scheduled,
            sample_ids=frozenset(sample),
            release_ids=releases,
            kv_moves=tuple(kv_moves),
            token_budget=token_budget,
            metadata=metadata,
            follows_step_id=follows_step_id,
        )


def _new_request_data(req: Request, table: list[int]) -> NewRequestData:
    token_ids = tuple(req.all_token_ids()) if req.prompt_token_ids is not None else ()
    # NOTE: every field, in order, through the contract's cheaper builder: a queue policy admits
    # a dozen requests a step
    return new_request_data(
        req.request_id,
        token_ids,
        req.num_tokens,
        req.sampling,
        tuple(table),
        req.num_computed_tokens,
        req.num_output_tokens,
        req.traceparent,
    )
