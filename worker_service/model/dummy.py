"""`--load-format dummy`: random weights with real shapes, no checkpoint needed.

Presets go from tiny models that run a demo on a laptop CPU (vocabulary = the MiniLM
tokenizer's 30522 word pieces, so sampled ids decode to real text) up to the shapes of
real models, for profiling and capacity planning on a GPU. Weights are created on the
meta device and materialised straight on the target device (`loader.build_model`), so a
7B preset costs one allocation and one random fill, never a CPU copy.
"""

from __future__ import annotations

import torch
from torch import nn

from worker_service.model.config import ModelConfig

MINILM_VOCAB_SIZE = 30522
MINILM_SEP_ID = 102  # [SEP] ends a MiniLM sequence: the tiny presets' end-of-sequence token

PRESETS: dict[str, ModelConfig] = {
    "tiny-llama": ModelConfig(
        family="llama", vocab_size=MINILM_VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=2048, eos_token_ids=(MINILM_SEP_ID,),
    ),
    "tiny-opt": ModelConfig(
        family="opt", vocab_size=MINILM_VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_layers=2,
        num_heads=4, num_kv_heads=4, head_dim=32, max_position_embeddings=2048, eos_token_ids=(MINILM_SEP_ID,),
        tie_word_embeddings=True, word_embed_proj_dim=128, activation="relu",
    ),
    "opt-125m": ModelConfig(
        family="opt", vocab_size=50272, hidden_size=768, intermediate_size=3072, num_layers=12, num_heads=12,
        num_kv_heads=12, head_dim=64, max_position_embeddings=2048, eos_token_ids=(2,), tie_word_embeddings=True,
        word_embed_proj_dim=768, activation="relu",
    ),
    "opt-6.7b": ModelConfig(
        family="opt", vocab_size=50272, hidden_size=4096, intermediate_size=16384, num_layers=32, num_heads=32,
        num_kv_heads=32, head_dim=128, max_position_embeddings=2048, eos_token_ids=(2,), tie_word_embeddings=True,
        word_embed_proj_dim=4096, activation="relu",
    ),
    "opt-13b": ModelConfig(
        family="opt", vocab_size=50272, hidden_size=5120, intermediate_size=20480, num_layers=40, num_heads=40,
        num_kv_heads=40, head_dim=128, max_position_embeddings=2048, eos_token_ids=(2,), tie_word_embeddings=True,
        word_embed_proj_dim=5120, activation="relu",
    ),
    "llama-2-7b": ModelConfig(
        family="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
        num_kv_heads=32, head_dim=128, max_position_embeddings=4096, eos_token_ids=(2,), rms_norm_eps=1e-5,
    ),
    "llama-3-8b": ModelConfig(
        family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, max_position_embeddings=8192, eos_token_ids=(128001,), rms_norm_eps=1e-5,
        rope_theta=500000.0,
    ),
}  # fmt: skip


def preset_config(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown dummy model {name!r}; presets: {sorted(PRESETS)}") from None


def is_preset(name: str) -> bool:
    return name in PRESETS


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Normal(0, std) matrices and embeddings, unit norm scales, zero biases: the usual
    initialisation, which keeps activations in range so greedy decoding is well defined."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            param.zero_()
        elif param.dim() == 1:
            param.fill_(1.0)
        else:
            param.normal_(0.0, std, generator=gen)
