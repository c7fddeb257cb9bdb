"""Model configuration: one dataclass for every family, parsed from a Hugging Face config.json.

    config.json --(from_hf_dict)--> ModelConfig --(registry.get_family)--> model class

Only the fields our families read are kept; anything else in config.json is ignored.
`model_type` picks the family; `mistral` is Llama-shaped (sliding window aside), so it maps
to the llama family.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

# NOTE: families whose checkpoints share another family's layout and weight names.
_FAMILY_ALIASES = {"mistral": "llama", "llama": "llama", "opt": "opt"}


@dataclass(frozen=True)
class ModelConfig:
    family: str  # "llama" or "opt"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    # llama
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    attention_bias: bool = False
    mlp_bias: bool = False
    # opt
    do_layer_norm_before: bool = True
    word_embed_proj_dim: int = 0
    enable_bias: bool = True
    layer_norm_elementwise_affine: bool = True
    remove_final_layer_norm: bool = False
    activation: str = "silu"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def family_of(model_type: str) -> str:
    try:
        return _FAMILY_ALIASES[model_type]
    except KeyError:
        raise ValueError(f"unsupported model_type {model_type!r}; known: {sorted(_FAMILY_ALIASES)}") from None


def _eos_ids(raw: Any) -> tuple[int, ...]:
    if raw is None:
        return ()
    return tuple(int(x) for x in raw) if isinstance(raw, list | tuple) else (int(raw),)


def _rope(d: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    # NOTE: transformers >= 5 nests rope settings in `rope_parameters`; older files keep
    # `rope_theta` and `rope_scaling` at the top level. Accept both.
    params = dict(d.get("rope_parameters") or {})
    scaling = dict(d.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", d.get("rope_theta", 10000.0)))
    scaling.update(params)
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = {}
    return theta, scaling


def _llama_from_hf(d: dict[str, Any], family: str) -> ModelConfig:
    heads = int(d["num_attention_heads"])
    theta, scaling = _rope(d)
    return ModelConfig(
        family=family,
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_layers=int(d["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
        max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
        eos_token_ids=_eos_ids(d.get("eos_token_id")),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        attention_bias=bool(d.get("attention_bias", False)),
        mlp_bias=bool(d.get("mlp_bias", False)),
        activation=str(d.get("hidden_act", "silu")),
    )


def _opt_from_hf(d: dict[str, Any], family: str) -> ModelConfig:
    heads = int(d["num_attention_heads"])
    hidden = int(d["hidden_size"])
    return ModelConfig(
        family=family,
        vocab_size=int(d["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(d["ffn_dim"]),
        num_layers=int(d["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
        eos_token_ids=_eos_ids(d.get("eos_token_id")),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        do_layer_norm_before=bool(d.get("do_layer_norm_before", True)),
        word_embed_proj_dim=int(d.get("word_embed_proj_dim") or hidden),
        enable_bias=bool(d.get("enable_bias", True)),
        layer_norm_elementwise_affine=bool(d.get("layer_norm_elementwise_affine", True)),
        remove_final_layer_norm=bool(d.get("_remove_final_layer_norm", False)),
        activation=str(d.get("activation_function", "relu")),
    )


def from_hf_dict(d: dict[str, Any]) -> ModelConfig:
    family = family_of(str(d.get("model_type", "")))
    return _llama_from_hf(d, family) if family == "llama" else _opt_from_hf(d, family)


def load_config(model_dir: str | Path) -> ModelConfig:
    root = Path(model_dir)
    config = from_hf_dict(json.loads((root / "config.json").read_text()))
    # NOTE: chat checkpoints list extra end tokens (e.g. <|eot_id|>) only in generation_config.json.
    gen_path = root / "generation_config.json"
    if gen_path.exists():
        extra = _eos_ids(json.loads(gen_path.read_text()).get("eos_token_id"))
        merged = config.eos_token_ids + tuple(t for t in extra if t not in config.eos_token_ids)
        config = replace(config, eos_token_ids=merged)
    return config
