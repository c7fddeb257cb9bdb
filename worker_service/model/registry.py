"""Model families by name: one line per family (the config's `family` picks the class)."""

from __future__ import annotations

from worker_service.model.base import CausalLM
from worker_service.model.config import ModelConfig
from worker_service.model.llama import LlamaForCausalLM
from worker_service.model.opt import OPTForCausalLM

MODEL_FAMILIES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "opt": OPTForCausalLM,
}


def model_class(config: ModelConfig) -> type[CausalLM]:
    try:
        return MODEL_FAMILIES[config.family]
    except KeyError:
        raise ValueError(f"unknown model family {config.family!r}; known: {sorted(MODEL_FAMILIES)}") from None
