"""How `sls` forms a static batch when its long-context options (ours) are on.

Why: on long-context traces a FCFS batch of fixed size pads every row to the batch's
longest prompt (a 40k-token prompt among seven 5k ones makes eight 40k prefills, their
quadratic attention included) and holds every row until the longest answer. Two options,
both off by default (the paper's SLS takes the FCFS head as it comes):

    group_window   the batch is the oldest waiting request (the anchor: nothing starves)
                   plus the requests among the oldest `group_window` closest to it in log
                   prompt length and log predicted output length, so rows are padded to a
                   similar length and finish at a similar iteration
    max_pad_share  a request joins only while the batch's padded prefill, priced by the
                   cost model, stays within (1 + max_pad_share) x the same rows' prefill at
                   their own lengths; with group_window 0 the batch then ends at the first
                   FCFS request that would pass the bound (it heads the next batch)

Both are pure functions of the requests (no I/O) so the policy's decisions can be tested
without a scheduler.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from scheduler_service.core.request import Request
from scheduler_service.costmodel.base import CostModel
from sluice.contract.profile import BatchShape


def padded_prefill_ratio(lengths: Sequence[int], cost_model: CostModel | None) -> float:
    """Padded prefill cost / unpadded cost of rows of these prompt lengths: time priced by the
    cost model (attention over the padded length included); tokens without a cost model."""
    if not lengths:
        return 1.0
    longest = max(lengths)
    if cost_model is None:
        return longest * len(lengths) / max(1, sum(lengths))
    padded = cost_model.iteration_time(BatchShape(prefill_chunks=[(longest, 0)] * len(lengths)))
    own = cost_model.iteration_time(BatchShape(prefill_chunks=[(n, 0) for n in lengths]))
    return padded / own if own > 0 else 1.0


def within_pad_bound(lengths: Sequence[int], max_pad_share: float, cost_model: CostModel | None) -> bool:
    """True when padding these rows to the longest costs at most (1 + max_pad_share) x their
    own prefill; max_pad_share <= 0 means no bound (the paper's SLS)."""
    if max_pad_share <= 0 or len(lengths) < 2:
        return True
    return padded_prefill_ratio(lengths, cost_model) <= 1.0 + max_pad_share + 1e-12


def _key(req: Request) -> tuple[float, float]:
    return math.log1p(req.num_tokens), math.log1p(req.remaining_output_estimate)


def grouped_candidates(waiting: Sequence[Request], window: int, by_prompt: bool = True) -> list[Request]:
    """The anchor (the oldest waiting request), then the others of the oldest `window` in
    ascending distance to it: |d log prompt| + |d log predicted output| (FCFS among ties);
    `by_prompt` False leaves the prompt out (rows that are not padded cost their own length
    wherever they go). window <= 0: the waiting queue in FCFS order (the paper)."""
    if window <= 0 or len(waiting) < 2:
        return list(waiting)
    head = list(waiting[:window])
    anchor, rest = head[0], head[1:]
    a_len, a_out = _key(anchor)

    def distance(req: Request) -> float:
        n, o = _key(req)
        return (abs(n - a_len) if by_prompt else 0.0) + abs(o - a_out)

    return [anchor, *sorted(rest, key=distance)]
