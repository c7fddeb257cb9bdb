"""Model and GPU presets: the published dimensions every cost model prices with.

Data flow: the CLI or the simulator names a model (`"llama-2-7b"`, or `"llama-2-70b@tp4"`)
and a GPU (`"a100-80g"`); `get_model` / `get_hardware` return the frozen `ModelSpec` /
`HardwareSpec` of `base.py`, which the cost models and KV accounting read.

Sources of the numbers:
- models: the public Hugging Face `config.json` of each checkpoint (OPT: Zhang et al. 2022,
  Table 1; Llama 2: Touvron et al. 2023, Table 1; Llama 3 and 3.1, Mistral 7B, Yi-34B,
  CodeLlama, Qwen-72B: their model cards). Vocabulary sizes are the real tokenizer sizes;
  `max_model_len` is each checkpoint's own context (`max_position_embeddings`): 2,048 OPT,
  4,096 Llama 2 and Yi-34B, 8,192 Llama 3, 16,384 CodeLlama, 32,768 Mistral 7B and Qwen-72B,
  131,072 Llama 3.1.
- GPUs: NVIDIA data sheets for dense (non-sparse) fp16/bf16 tensor-core FLOP/s, HBM/GDDR
  bandwidth and memory (`mem_bytes` is what `nvidia-smi` reports, e.g. 80 GiB on A100 80GB).
  `pcie_bandwidth` is the achievable host<->device copy rate in one direction from pinned
  memory (about 12 GB/s on gen3 x16, 25 GB/s on gen4, 50 GB/s on gen5), not the link's
  nominal rate. `interconnect_bandwidth` is the NVLink bandwidth in one direction
  (half the bidirectional figure NVIDIA quotes).
"""

from __future__ import annotations

from dataclasses import replace

from scheduler_service.costmodel.base import HardwareSpec
from sluice.contract.profile import ModelSpec

GiB = 2**30
GB = 1e9
TFLOPS = 1e12


def _opt(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    # OPT: plain 2-matrix ReLU MLP of width 4 x hidden, multi-head attention, 2048 positions.
    return ModelSpec(name, layers, hidden, heads, heads, 4 * hidden, 50272, 2048, gated_mlp=False)


MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        _opt("opt-2.7b", 32, 2560, 32),
        _opt("opt-6.7b", 32, 4096, 32),
        _opt("opt-13b", 40, 5120, 40),
        _opt("opt-175b", 96, 12288, 96),
        ModelSpec("llama-2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
        ModelSpec("llama-2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
        ModelSpec("llama-2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
        ModelSpec("llama-3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
        ModelSpec("llama-3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
        # Llama 3.1: Llama 3's dimensions with RoPE scaling to a 131,072-token context.
        ModelSpec("llama-3.1-8b", 32, 4096, 32, 8, 14336, 128256, 131072),
        ModelSpec("llama-3.1-70b", 80, 8192, 64, 8, 28672, 128256, 131072),
        ModelSpec("llama-3.1-405b", 126, 16384, 128, 8, 53248, 128256, 131072),
        ModelSpec("mistral-7b", 32, 4096, 32, 8, 14336, 32000, 32768),
        ModelSpec("codellama-34b", 48, 8192, 64, 8, 22016, 32000, 16384),
        ModelSpec("yi-34b", 60, 7168, 56, 8, 20480, 64000, 4096),
        # NOTE: Qwen's config says intermediate_size 49152 for its two MLP matrices together;
        # one matrix is 24576 wide, which is what a gated-MLP ModelSpec means.
        ModelSpec("qwen-72b", 80, 8192, 64, 64, 24576, 152064, 32768),
    )
}

HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    h.name: h
    for h in (
        HardwareSpec("a100-80g", 312 * TFLOPS, 2039 * GB, 80 * GiB, 25 * GB, 300 * GB),
        HardwareSpec("h100-80g", 989 * TFLOPS, 3350 * GB, 79.6 * GiB, 50 * GB, 450 * GB),
        HardwareSpec("h200", 989 * TFLOPS, 4800 * GB, 140.4 * GiB, 50 * GB, 450 * GB),
        # A40: PCIe gen4 card; its NVLink bridge joins pairs at 112.5 GB/s bidirectional.
        HardwareSpec("a40", 149.7 * TFLOPS, 696 * GB, 45 * GiB, 25 * GB, 56.25 * GB),
        HardwareSpec("v100-32g", 125 * TFLOPS, 900 * GB, 32 * GiB, 12 * GB, 150 * GB),
    )
}


def _split_tp(name: str, tensor_parallel: int) -> tuple[str, int]:
    """`"llama-2-70b@tp4"` -> ("llama-2-70b", 4); a suffix overrides the argument."""
    base, sep, suffix = name.partition("@")
    if not sep:
        return name, tensor_parallel
    if not suffix.lower().startswith("tp") or not suffix[2:].isdigit():
        raise ValueError(f"bad model suffix {suffix!r} in {name!r}; expected e.g. '{base}@tp2'")
    return base, int(suffix[2:])


def get_model(name: str, tensor_parallel: int = 1) -> ModelSpec:
    """The preset `name` (case-insensitive), sharded over `tensor_parallel` GPUs."""
    base, tp = _split_tp(name.strip().lower(), tensor_parallel)
    if base not in MODEL_PRESETS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(MODEL_PRESETS))}")
    spec = MODEL_PRESETS[base]
    # NOTE: KV heads may be fewer than TP (Llama-2-70B at TP 16): each GPU then keeps a replica.
    kv_splits = spec.num_kv_heads % tp == 0 or tp % spec.num_kv_heads == 0
    if tp < 1 or spec.num_heads % tp or not kv_splits:
        raise ValueError(f"{base} ({spec.num_heads} heads, {spec.num_kv_heads} KV heads) cannot be split over TP={tp}")
    return replace(spec, tensor_parallel=tp)


def get_hardware(name: str) -> HardwareSpec:
    """The GPU preset `name` (case-insensitive)."""
    key = name.strip().lower()
    if key not in HARDWARE_PRESETS:
        raise KeyError(f"unknown hardware {name!r}; known: {', '.join(sorted(HARDWARE_PRESETS))}")
    return HARDWARE_PRESETS[key]
