"""Model construction and weight loading.

    model name/dir --resolve_config--> ModelConfig --build_model (meta device)--> CausalLM
        --to_empty(device, dtype)--> load_safetensors(dir) | init_dummy_weights(seed)

Checkpoints are Hugging Face safetensors: one `model.safetensors`, or shards listed in
`model.safetensors.index.json`. Tensors stream one at a time from the files (memory
mapped) into the parameters, so peak host memory stays near one tensor, not the model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from worker_service.model.base import CausalLM
from worker_service.model.config import ModelConfig, load_config
from worker_service.model.dummy import init_dummy_weights, is_preset, preset_config
from worker_service.model.registry import model_class

INDEX_FILE = "model.safetensors.index.json"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, {', '.join(DTYPES)}") from None


def resolve_config(model: str) -> ModelConfig:
    """A dummy preset by name, else a directory holding a Hugging Face config.json."""
    return preset_config(model) if is_preset(model) else load_config(model)


def safetensors_files(model_dir: str | Path) -> list[Path]:
    root = Path(model_dir)
    index = root / INDEX_FILE
    if index.exists():
        with index.open() as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        return [root / name for name in sorted(set(weight_map.values()))]
    return sorted(root.glob("*.safetensors"))


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def choose_load_format(model: str, load_format: str) -> str:
    if load_format != "auto":
        if load_format not in ("dummy", "safetensors"):
            raise ValueError(f"unknown load_format {load_format!r}; use auto, dummy, safetensors")
        return load_format
    if is_preset(model):
        return "dummy"
    return "safetensors" if safetensors_files(model) else "dummy"


def build_model(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """Allocates (uninitialised) parameters directly on `device` at `dtype`."""
    with torch.device("meta"):
        model = model_class(config)(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()
    return model.eval()


@torch.no_grad()
def load_model(
    model: str,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> CausalLM:
    config = resolve_config(model)
    net = build_model(config, dtype, device)
    if choose_load_format(model, load_format) == "dummy":
        init_dummy_weights(net, seed)
        return net
    files = safetensors_files(model)
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model}")
    loaded = net.load_weights(iter_safetensors(files))
    missing = {name for name, _ in net.named_parameters()} - loaded
    if missing:
        raise ValueError(f"checkpoint {model} lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    return net
