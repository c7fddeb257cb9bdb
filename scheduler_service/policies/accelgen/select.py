"""AccelGen's multi-resource choice (seed 000, section 4.4, Algorithm 2, lines 7-12).

Data flow: the policy hands over candidates, each a demand point (D_c tokens of compute,
D_m tokens of new KV) -> `nearest` answers the one closest, in Euclidean distance, to the
free point (A_c, A_m) among those that fit (D_c <= A_c and D_m <= A_m) -> the policy adds
it, the free point shrinks, and it asks again until nothing fits.

Decodes are all (1, 0) or (1, block): instead of one point per decode they are kept in
one group per D_m, so a step with 256 decodes and a few prompts costs O(prompts) per
pick rather than O(candidates). The squared distance is compared (same argmin). A group
holds plain (D_c, entry, request) triples; a `Candidate` is made only for the decode a pick
returns (a step's window is every running request: 256 objects a step, where the policy
drains most groups without one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from scheduler_service.core.request import Request

if TYPE_CHECKING:
    from scheduler_service.policies.accelgen.queue import IndexEntry


@dataclass(slots=True)
class Candidate:
    request: Request
    entry: IndexEntry  # its heap entry, restored if it is not picked
    tokens: int  # D_c
    kv_tokens: int  # D_m


DecodePoint = tuple[int, "IndexEntry", Request]  # a decode's (D_c, its heap entry, request) in its D_m group


@dataclass(slots=True)
class CandidateSet:
    """Prompt (and chunk) candidates one by one; decodes grouped by D_m."""

    prompts: list[Candidate] = field(default_factory=list)
    decodes: dict[int, list[DecodePoint]] = field(default_factory=dict)

    def add(self, c: Candidate, is_decode: bool) -> None:
        if is_decode:
            self.decodes.setdefault(c.kv_tokens, []).append((c.tokens, c.entry, c.request))
        else:
            self.prompts.append(c)

    def leftovers(self) -> list[IndexEntry]:
        """The heap entries of every candidate not picked."""
        return [c.entry for c in self.prompts] + [d[1] for group in self.decodes.values() for d in group]

    def nearest(self, a_c: int, a_m: int) -> tuple[Candidate | None, bool]:
        """(closest fitting candidate or None, whether any prompt candidate fits). The
        candidate is removed from the set."""
        best_d = math.inf
        best_i = -1
        for i, c in enumerate(self.prompts):
            if c.tokens <= a_c and c.kv_tokens <= a_m:
                d = (a_c - c.tokens) ** 2 + (a_m - c.kv_tokens) ** 2
                if d < best_d:
                    best_d, best_i = d, i
        prompt_fits = best_i >= 0
        best_group = None
        if a_c >= 1:
            for d_m, group in self.decodes.items():
                if group and d_m <= a_m:
                    d = (a_c - 1) ** 2 + (a_m - d_m) ** 2
                    if d < best_d:
                        best_d, best_group = d, d_m
        if best_group is not None:
            tokens, entry, request = self.decodes[best_group].pop()
            return Candidate(request, entry, tokens, best_group), prompt_fits
        if prompt_fits:
            return self.prompts.pop(best_i), True
        return None, False
