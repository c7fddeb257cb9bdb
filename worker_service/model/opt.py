"""OPT decoder on flattened tokens.

    input_ids [T] -> embed_tokens (-> project_in) + embed_positions[positions + 2]
                  -> N x (LayerNorm -> MHA with biases -> + residual
                          LayerNorm -> fc1 -> ReLU -> fc2 -> + residual)
                  -> final LayerNorm (-> project_out) -> hidden [T, word_embed_proj_dim]

`do_layer_norm_before=False` (opt-350m) moves each LayerNorm after its residual add. OPT's
learned position table starts at index 2 (two rows kept from fairseq's padding scheme), so
position p reads row p + 2.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from worker_service.model.attention import Attention
from worker_service.model.base import CausalLM, fused_slices
from worker_service.model.config import ModelConfig

POSITION_OFFSET = 2
Block = Callable[[torch.Tensor], torch.Tensor]


class OPTAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        hidden = config.hidden_size
        self.qkv_proj = nn.Linear(hidden, 3 * hidden, bias=config.enable_bias)
        self.out_proj = nn.Linear(hidden, hidden, bias=config.enable_bias)

    def forward(self, h: torch.Tensor, attn: Attention) -> torch.Tensor:
        q, k, v = (t.view(-1, self.num_heads, self.head_dim) for t in self.qkv_proj(h).chunk(3, dim=-1))
        return self.out_proj(attn(self.layer_idx, q, k, v).reshape(h.shape[0], -1))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        affine = config.layer_norm_elementwise_affine
        self.pre_norm = config.do_layer_norm_before
        self.self_attn = OPTAttention(config, layer_idx)
        self.self_attn_layer_norm = nn.LayerNorm(config.hidden_size, elementwise_affine=affine)
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.enable_bias)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.enable_bias)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, elementwise_affine=affine)

    def forward(self, h: torch.Tensor, attn: Attention) -> torch.Tensor:
        h = self._residual(h, self.self_attn_layer_norm, lambda x: self.self_attn(x, attn))
        return self._residual(h, self.final_layer_norm, lambda x: self.fc2(torch.relu(self.fc1(x))))

    def _residual(self, h: torch.Tensor, norm: nn.Module, block: Block) -> torch.Tensor:
        if self.pre_norm:
            return h + block(norm(h))
        return norm(h + block(h))


class OPTDecoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        proj = config.word_embed_proj_dim
        self.embed_tokens = nn.Embedding(config.vocab_size, proj)
        self.embed_positions = nn.Embedding(config.max_position_embeddings + POSITION_OFFSET, config.hidden_size)
        self.project_in = nn.Linear(proj, config.hidden_size, bias=False) if proj != config.hidden_size else None
        self.project_out = nn.Linear(config.hidden_size, proj, bias=False) if proj != config.hidden_size else None
        has_final = config.do_layer_norm_before and not config.remove_final_layer_norm
        affine = config.layer_norm_elementwise_affine
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, elementwise_affine=affine) if has_final else None
        self.layers = nn.ModuleList(OPTDecoderLayer(config, i) for i in range(config.num_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Attention) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        if self.project_in is not None:
            h = self.project_in(h)
        h = h + self.embed_positions(positions + POSITION_OFFSET)
        for layer in self.layers:
            h = layer(h, attn)
        if self.final_layer_norm is not None:
            h = self.final_layer_norm(h)
        return h if self.project_out is None else self.project_out(h)


class OPTModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config)


class OPTForCausalLM(CausalLM):
    stacked_params = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
    )

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.model = OPTModel(config)
        self.lm_head = nn.Linear(config.word_embed_proj_dim, config.vocab_size, bias=False)
        hidden = config.hidden_size
        self._qkv = fused_slices({"q": hidden, "k": hidden, "v": hidden})
        self.tie_weights()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Attention) -> torch.Tensor:
        return self.model.decoder(input_ids, positions, attn)

    def embed_weight(self) -> nn.Parameter:
        return self.model.decoder.embed_tokens.weight

    def normalize_name(self, name: str) -> str:
        # NOTE: the original facebook/opt checkpoints name tensors `decoder.*` with no `model.` prefix.
        return "model." + name if name.startswith("decoder.") else name

    def shard_slice(self, fused_name: str, shard: str) -> slice:
        return self._qkv[shard]
