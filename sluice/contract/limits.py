"""The serving limits every component defaults to, defined once (the simulator, the live
scheduler, `sluice serve` and the worker's Warmup all read these).

vLLM's defaults: up to 256 sequences per step; a token budget of 8192 per step, raised to the
model's context length when that is longer, so that a whole prompt always fits one step of a
policy that does not chunk prefills (otherwise prompts between the budget and the context
length would pass validation and never be schedulable).
"""

from __future__ import annotations

DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_BLOCK_SIZE = 16
# Requests waiting for admission across a cluster's workers, and offline-class requests queued
# behind online work, before new ones are refused.
DEFAULT_MAX_WAITING = 256
DEFAULT_MAX_OFFLINE_WAITING = 4096
# A worker's own memory defaults (vLLM's): the share of accelerator memory it may use in all,
# and the host memory it keeps for swapped-out KV.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_SWAP_SPACE_GIB = 4.0


def token_budget(max_num_batched_tokens: int | None, max_model_len: int) -> int:
    """The step token budget: the one given, else the default raised to the context length."""
    if max_num_batched_tokens is not None:
        return max_num_batched_tokens
    return max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_model_len)
