"""AccelGen's KV arithmetic (seed 000, sections 4.4 and 5): what a request's blocks must
cover, what still fits, and whom KV pressure preempts.

Data flow: the policy asks before scheduling a request: `cover_tokens` (the whole prompt at
the first chunk, as vLLM, which AccelGen runs on, allocates; or only what this chunk
reaches), `fits_with_watermark` for a new admission, `kv_fit` to cut a running prefill's
chunk to the free KV rather than preempt, and `kv_victim` when a running request needs a
block and none is free: the running request, not in this batch, with the largest T_r.
"""

from __future__ import annotations

from kvstore.accounting import KVCacheManager
from scheduler_service.core.request import Request
from scheduler_service.core.step_builder import StepBuilder


def watermark_blocks(kv: KVCacheManager, share: float) -> int:
    return int(share * kv.gpu.num_blocks)


def cover_tokens(req: Request, n: int, whole_prompt: bool) -> int:
    """Tokens its blocks must hold if it advances by n now."""
    if whole_prompt and req.is_prefill:
        return req.prefill_len
    return req.num_computed_tokens + n


def kv_fit(kv: KVCacheManager, req: Request, share: float) -> int:
    """Tokens `req` can still advance within its blocks plus the free KV above the watermark."""
    free = max(0, kv.gpu.num_available() - watermark_blocks(kv, share))
    return kv.capacity(req.request_id) + free * kv.block_size - req.num_computed_tokens


def fits_with_watermark(kv: KVCacheManager, req: Request, cover: int, share: float, committed: int = 0) -> bool:
    """Its new blocks for `cover` tokens fit above the watermark, `committed` blocks aside."""
    need = kv.num_new_blocks(req.request_id, cover)
    return need + committed <= kv.gpu.num_available() - watermark_blocks(kv, share)


def prompt_rest_blocks(kv: KVCacheManager, running: dict[str, Request], req: Request | None = None) -> int:
    """Blocks the running prompts (and `req`, about to start) still need to finish their
    prefill under per-chunk allocation.

    Why: with blocks taken chunk by chunk, an admission test on the first chunk alone lets in
    more prompts than the KV can finish; each later chunk then needs a block none is free for,
    preempts another half-done prompt (recompute: its chunks are lost), which is re-admitted
    the next step on its first chunk again: a livelock (throughput fell ~40%, four preemptions
    per request). Counting the rest of every started prompt as committed at admission keeps
    the allocation per chunk (D_m of Algorithm 2) while never admitting a prompt that cannot
    be finished."""
    rest = 0
    for other in running.values():
        if other.is_prefill:
            rest += max(0, kv.num_blocks_for(other.prefill_len) - len(kv.gpu_tables.get(other.request_id, ())))
    if req is not None and req.request_id not in running:
        rest += kv.num_blocks_for(req.prefill_len)
    return rest


def kv_victim(step: StepBuilder, req: Request, by_deadline: bool) -> Request | None:
    """The running request, not in this batch, with the largest T_r above `req`'s (FCFS:
    the newest, as vLLM); None when `req` itself should give way."""
    scheduled = step.scheduled
    others = [o for o in step.running.values() if o is not req and o.request_id not in scheduled]
    if not others:
        return None
    if not by_deadline:
        return others[-1]
    victim = max(others, key=lambda o: o.policy_state.deadline)
    return victim if victim.policy_state.deadline > req.policy_state.deadline else None
