"""Model families (llama, opt), their configs, and weight loading (safetensors or dummy)."""

from worker_service.model.attention import Attention, DenseAttention
from worker_service.model.base import CausalLM
from worker_service.model.config import ModelConfig, from_hf_dict, load_config
from worker_service.model.loader import build_model, load_model, resolve_config, resolve_dtype
from worker_service.model.registry import MODEL_FAMILIES

__all__ = [
    "MODEL_FAMILIES",
    "Attention",
    "CausalLM",
    "DenseAttention",
    "ModelConfig",
    "build_model",
    "from_hf_dict",
    "load_config",
    "load_model",
    "resolve_config",
    "resolve_dtype",
]
