"""A plan's KV moves (swap out, swap in, copy) applied to a paged cache: one loop for every
engine that keeps its KV in a `PagedKVCache` (ours, and the view over vLLM's tensors)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from kvstore.paged import PagedKVCache
from sluice.contract.plan import KVMove, KVMoveKind


def apply_kv_moves(
    cache: PagedKVCache,
    moves: Iterable[KVMove],
    sync: Callable[[], None] | None = None,
    defer_copies: bool = False,
) -> tuple[float, int]:
    """Runs the moves in plan order inside one swapping section; returns (seconds, bytes moved).
    `sync` waits for the device before the clock stops (CUDA copies are asynchronous);
    `defer_copies` leaves the swap-outs' device-to-host copies to `cache.flush_swaps()`."""
    moves = list(moves)
    if not moves:
        return 0.0, 0
    start, moved = time.perf_counter(), 0
    with cache.swapping(defer_copies):
        for m in moves:
            if m.kind is KVMoveKind.SWAP_OUT:
                moved += cache.swap_out(m.src_block_ids, m.dst_block_ids, m.int8)
            elif m.kind is KVMoveKind.SWAP_IN:
                moved += cache.swap_in(m.src_block_ids, m.dst_block_ids)
            else:
                moved += cache.copy(m.src_block_ids, m.dst_block_ids)
    if sync is not None:
        sync()
    return time.perf_counter() - start, moved
