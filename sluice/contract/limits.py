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


def token_budget(max_num_batched_tokens: int | None, max_model_len: int) -> int:
    """The step token budget: the one given, else the default raised to the context length."""
    if max_num_batched_tokens is not None:
        return max_num_batched_tokens
    return max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_model_len)
