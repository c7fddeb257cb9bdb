"""SCLS's adaptive batcher and max-min offloader (seed 002, sections 4.4 and 4.5), plus the
tag through which the router tells a worker's `scls` policy which requests form a batch.

Data flow: the `scls` router drains its pool -> `dp_batches` (Algorithm 1) splits the
requests, sorted by input length, into contiguous groups minimising the total estimated
serving time under the memory check -> `MaxMinOffloader.assign` places the groups, longest
estimate first, on the least loaded worker -> the router stamps every member with a
`SliceTag` (batch id, slice length) in `request.policy_state` before placing it, and the
worker's policy starts the members sharing a batch id together as one static batch.

The DP is Eq. 10, `T[i] = min_j T[j-1] + T_serve(i-j+1, L_i, S)`. Its inner loop over group
sizes stops at the memory limit N_max(L_i) (Eq. 8; the paper's `while not OOM` loop does
the same) and at the worker's sequence limit, so it costs O(n * B) with B = the largest
feasible batch, not O(n^2); each row of the DP is one numpy expression over group sizes.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from scheduler_service.policies.scls.estimator import MemoryEstimator, ServingTimeEstimator


@dataclass(slots=True)
class SliceTag:
    """`request.policy_state` of an SCLS request. The router sets `batch_id` and `slice_len`
    before each placement (None: the worker forms batches itself); the policy counts slices."""

    batch_id: int | None = None
    slice_len: int | None = None
    num_slices: int = 0
    pad_tokens: int = 0  # padding added to this request over all its slices
    slice_end: int = 0  # keep_kv: the token count at which the current slice ends


def slice_tag(request_state: object) -> SliceTag:
    return request_state if isinstance(request_state, SliceTag) else SliceTag()


@dataclass(slots=True)
class PlannedBatch:
    members: list[int]  # indices into the batcher's input
    padded_len: int  # the batch input length L (its longest member)
    est_s: float  # T_serve(N, L, S)
    batch_id: int = -1
    worker_id: int = -1
    remaining: int = field(default=0)  # members still on the worker (the router's books)


def dp_batches(
    lengths: Sequence[int],
    slice_len: int,
    estimator: ServingTimeEstimator,
    memory: MemoryEstimator | None,
    max_batch: int,
    varlen: bool = False,
) -> list[PlannedBatch]:
    """Algorithm 1: the partition of the requests (sorted by length) into contiguous groups
    with the least total T_serve; a group of more than one request must pass the memory
    check and hold at most `max_batch` rows. Batches come back in ascending length order.
    `varlen` (ours): rows are not padded, so a group costs its rows' own lengths
    (`serve_time_varlen`) and its KV is the sum of its rows' own (L + S), within zeta of
    the cache."""
    n = len(lengths)
    if n == 0:
        return []
    order = np.argsort(np.asarray(lengths, dtype=np.int64), kind="stable")
    sorted_len = np.asarray(lengths, dtype=np.int64)[order]
    cum_len = np.concatenate(([0], np.cumsum(sorted_len)))
    cum_rows = None
    if varlen and memory is not None:
        cum_rows = np.concatenate(([0], np.cumsum(memory.row_tokens_array(sorted_len, slice_len))))
    best = np.zeros(n + 1)
    split = np.zeros(n + 1, dtype=np.int64)
    for i in range(1, n + 1):
        length = int(sorted_len[i - 1])
        if cum_rows is not None:
            cap = min(i, max_batch)
            sizes = np.arange(1, max(cap, 1) + 1)
            fits = cum_rows[i] - cum_rows[i - sizes] <= memory.limit_tokens  # type: ignore[union-attr]
            fits[0] = True  # a lone request is always a batch (as in the paper's check)
            sizes = sizes[fits]
        else:
            cap = min(i, max_batch, memory.max_batch(length, slice_len) if memory is not None else i)
            sizes = np.arange(1, max(cap, 1) + 1)
        group_len = cum_len[i] - cum_len[i - sizes]
        cost = best[i - sizes] + _group_time(estimator, sizes, group_len, length, slice_len, varlen)
        k = int(np.argmin(cost))
        best[i] = cost[k]
        split[i] = i - int(sizes[k])
    batches: list[PlannedBatch] = []
    i = n
    while i > 0:
        j = int(split[i])
        length = int(sorted_len[i - 1])
        est = float(_group_time(estimator, i - j, cum_len[i] - cum_len[j], length, slice_len, varlen))
        batches.append(PlannedBatch([int(x) for x in order[j:i]], length, est))
        i = j
    batches.reverse()
    return batches


def _group_time(
    estimator: ServingTimeEstimator,
    sizes: int | np.ndarray,
    length_sum: int | np.ndarray,
    longest: int,
    slice_len: int,
    varlen: bool,
) -> float | np.ndarray:
    if varlen:
        return estimator.serve_time_varlen(sizes, length_sum, longest, slice_len)
    return estimator.serve_time(sizes, longest, slice_len)


def total_serve_time(batches: Sequence[PlannedBatch]) -> float:
    return sum(b.est_s for b in batches)


class MaxMinOffloader:
    """Section 4.5: the longest batch goes to the least loaded worker, load += T_serve;
    a worker's load drops by a batch's estimate when that batch ends (`finish`)."""

    def __init__(self) -> None:
        self.load: dict[int, float] = {}
        self.num_assigned: dict[int, int] = {}

    def assign(self, estimates: Sequence[float], workers: Sequence[int]) -> list[int]:
        """The worker of each estimate (same order), placing them longest first. Equal loads
        (idle workers) go to the worker given the fewest batches so far, so an idle cluster
        does not pile every batch on the lowest worker id."""
        if not workers:
            raise ValueError("max-min offloading needs at least one worker")
        assigned = self.num_assigned
        heap = [(self.load.get(w, 0.0), assigned.get(w, 0), w) for w in workers]
        heapq.heapify(heap)
        out = [0] * len(estimates)
        for idx in sorted(range(len(estimates)), key=lambda k: -estimates[k]):
            load, n, w = heapq.heappop(heap)
            out[idx] = w
            load += estimates[idx]
            self.load[w] = load
            assigned[w] = n + 1
            heapq.heappush(heap, (load, n + 1, w))
        return out

    def charge(self, worker: int, est_s: float) -> None:
        self.load[worker] = self.load.get(worker, 0.0) + est_s

    def finish(self, worker: int, est_s: float) -> None:
        self.load[worker] = self.load.get(worker, 0.0) - est_s

    def min_load(self, workers: Sequence[int]) -> float:
        return max(0.0, min((self.load.get(w, 0.0) for w in workers), default=0.0))
