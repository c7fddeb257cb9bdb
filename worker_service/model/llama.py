"""Llama (and Mistral-shaped) decoder on flattened tokens.

    input_ids [T] -> embed_tokens -> N x (RMSNorm -> GQA attention with rotary -> + residual
                                          RMSNorm -> SwiGLU MLP -> + residual)
                  -> RMSNorm -> hidden [T, hidden_size]

Positions are absolute per sequence (num_computed_tokens + offset in the chunk), so rotary
embeddings are right for a prefill chunk that continues a cached prefix. Parameter names
mirror Hugging Face's except the fused `qkv_proj` and `gate_up_proj`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from worker_service.model.attention import Attention
from worker_service.model.base import CausalLM, fused_slices
from worker_service.model.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: normalise in float32 and cast back before the weight, as the reference does,
        # so bf16 checkpoints give the same numbers as transformers.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope scaling {kind!r} (supported: default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotates the two halves of each head (the Hugging Face layout, not interleaved pairs)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        self._cos_sin: torch.Tensor | None = None

    def cos_sin(self, device: torch.device) -> torch.Tensor:
        # NOTE: built lazily on first use so meta-device construction of big dummy models is free.
        if self._cos_sin is None or self._cos_sin.device != device:
            inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)
            freqs = torch.arange(self.max_positions, device=device, dtype=torch.float32)[:, None] * inv_freq[None]
            self._cos_sin = torch.stack((freqs.cos(), freqs.sin()))
        return self._cos_sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos_sin = self.cos_sin(q.device)[:, positions].to(q.dtype)[:, :, None, :]
        return _rotate(q, cos_sin[0], cos_sin[1]), _rotate(k, cos_sin[0], cos_sin[1])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.attention_bias)
        self.rotary = rotary

    def forward(self, positions: torch.Tensor, h: torch.Tensor, attn: Attention) -> torch.Tensor:
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        out = attn(self.layer_idx, q, k, v.view(-1, self.num_kv_heads, self.head_dim))
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, attn: Attention) -> torch.Tensor:
        h = h + self.self_attn(positions, self.input_layernorm(h), attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, rotary) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Attention) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(positions, h, attn)
        return self.norm(h)


class LlamaForCausalLM(CausalLM):
    stacked_params = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", "gate"),
        ("gate_up_proj", "up_proj", "up"),
    )

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        if config.activation != "silu":
            raise ValueError(f"llama family expects hidden_act silu, got {config.activation!r}")
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._shards = {
            "qkv_proj": fused_slices({"q": config.q_size, "k": config.kv_size, "v": config.kv_size}),
            "gate_up_proj": fused_slices({"gate": config.intermediate_size, "up": config.intermediate_size}),
        }
        self.tie_weights()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Attention) -> torch.Tensor:
        return self.model(input_ids, positions, attn)

    def embed_weight(self) -> nn.Parameter:
        return self.model.embed_tokens.weight

    def shard_slice(self, fused_name: str, shard: str) -> slice:
        return self._shards[fused_name.split(".")[-2]][shard]
