"""The attention seam between the model layers and the KV cache.

Every model runs on flattened tokens: `q [T, num_heads, head_dim]`, `k, v [T, num_kv_heads,
head_dim]`, rows of several sequences concatenated without padding. A layer calls
`attn(layer_idx, q, k, v)` and gets `[T, num_heads, head_dim]` back; what happens in
between (writing a paged KV cache through a slot_mapping, reading a block table) belongs
to the `Attention` object the caller passed in:

    kvstore.paged.PagedAttention   the engine's path: cached prefix + new chunk, per step
    DenseAttention                 no cache: each sequence is complete, plain causal attention
                                   (the reference for tests and the activation probe)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from kvstore.paged import causal_chunk


class Attention(Protocol):
    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class DenseAttention:
    """Causal attention over complete sequences laid end to end (lengths `seq_lens`)."""

    def __init__(self, seq_lens: Sequence[int]) -> None:
        self.seq_lens = list(seq_lens)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        start = 0
        for n in self.seq_lens:
            out[start : start + n] = causal_chunk(q[start : start + n], k[start : start + n], v[start : start + n])
            start += n
        return out
