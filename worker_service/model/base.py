"""What every model family shares: the causal-LM interface the engine calls and the
checkpoint-name mapping the loader feeds.

    engine:  hidden = model(input_ids [T], positions [T], attn)      # flattened tokens
             logits = model.compute_logits(hidden[sample_rows])     # only rows that sample
    loader:  model.load_weights(iter of (hf_name, tensor))

Families fuse projections that Hugging Face keeps apart (q/k/v into `qkv_proj`, gate/up into
`gate_up_proj`) so a layer runs one matmul instead of three; `stacked_params` says which
checkpoint tensor fills which slice of which fused parameter.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from worker_service.model.config import ModelConfig

# (fused parameter fragment, checkpoint fragment, shard name)
StackedParam = tuple[str, str, str]


class CausalLM(nn.Module):
    stacked_params: tuple[StackedParam, ...] = ()
    # Checkpoint tensors with no parameter here (recomputed buffers).
    ignored_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def shard_slice(self, fused_name: str, shard: str) -> slice:
        """Rows of a fused parameter that the checkpoint shard `shard` fills."""
        raise KeyError(f"{type(self).__name__} has no shard {shard!r} in {fused_name}")

    def normalize_name(self, name: str) -> str:
        return name

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_weight()

    def embed_weight(self) -> nn.Parameter:
        raise TypeError(f"{type(self).__name__} must define embed_weight")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies checkpoint tensors into parameters; returns the parameter names filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for raw_name, tensor in weights:
            name = self.normalize_name(raw_name)
            if name.endswith(self.ignored_suffixes):
                continue
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                continue
            target, rows = self._target_of(name)
            if target not in params:
                raise KeyError(f"checkpoint tensor {raw_name!r} has no parameter in {type(self).__name__}")
            param = params[target]
            dst = param.data if rows is None else param.data[rows]
            if dst.shape != tensor.shape:
                raise ValueError(f"{raw_name}: checkpoint shape {tuple(tensor.shape)} != parameter {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(target)
        return loaded

    def _target_of(self, name: str) -> tuple[str, slice | None]:
        for fused, part, shard in self.stacked_params:
            if part in name:
                target = name.replace(part, fused)
                return target, self.shard_slice(target, shard)
        return name, None


def fused_slices(sizes: dict[str, int]) -> dict[str, slice]:
    """Consecutive row ranges, e.g. {"q": 64, "k": 32, "v": 32} -> q[0:64] k[64:96] v[96:128]."""
    out: dict[str, slice] = {}
    start = 0
    for shard, n in sizes.items():
        out[shard] = slice(start, start + n)
        start += n
    return out
