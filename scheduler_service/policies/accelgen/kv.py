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


def fits_with_watermark(kv: KVCacheManager, req: Request, cover: int, share: float) -> bool:
    need = kv.num_new_blocks(req.request_id, cover)
    return need <= kv.gpu.num_available() - watermark_blocks(kv, share)


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
