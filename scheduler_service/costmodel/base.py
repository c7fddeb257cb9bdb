"""The cost-model contract: the shape of one batch in, seconds out.

A `BatchShape` is what a worker does in one step: prefill chunks (tokens, cached prefix
each), decodes (one token each over their contexts) and KV swap bytes. The simulator
builds it from a StepPlan; `sluice profile` measures it on a real worker; every cost model
prices it. Model and hardware presets give the dimensions the models need.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from scheduler_service.registry import Registry


@dataclass(slots=True)
class BatchShape:
    prefill_chunks: list[tuple[int, int]] = field(default_factory=list)  # (new tokens, cached prefix)
    num_decodes: int = 0
    decode_context_sum: int = 0  # sum of context lengths (KV tokens read) over decodes
    decode_context_max: int = 0
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c for c, _ in self.prefill_chunks)

    @property
    def num_tokens(self) -> int:
        """Forward size: every prefill token plus one per decode."""
        return self.num_prefill_tokens + self.num_decodes

    @property
    def num_seqs(self) -> int:
        return len(self.prefill_chunks) + self.num_decodes

    def add_decode(self, context_len: int) -> None:
        self.num_decodes += 1
        self.decode_context_sum += context_len
        if context_len > self.decode_context_max:
            self.decode_context_max = context_len

    def to_dict(self) -> dict:
        return {
            "prefill_chunks": [list(c) for c in self.prefill_chunks],
            "num_decodes": self.num_decodes,
            "decode_context_sum": self.decode_context_sum,
            "decode_context_max": self.decode_context_max,
            "swap_out_bytes": self.swap_out_bytes,
            "swap_in_bytes": self.swap_in_bytes,
        }

    @classmethod
    def from_dict(cls, d: dict) -> BatchShape:
        return cls(
            prefill_chunks=[(int(a), int(b)) for a, b in d.get("prefill_chunks", [])],
            num_decodes=int(d.get("num_decodes", 0)),
            decode_context_sum=int(d.get("decode_context_sum", 0)),
            decode_context_max=int(d.get("decode_context_max", 0)),
            swap_out_bytes=int(d.get("swap_out_bytes", 0)),
            swap_in_bytes=int(d.get("swap_in_bytes", 0)),
        )


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Transformer dimensions (whole model; tensor parallelism divides per GPU)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_model_len: int
    gated_mlp: bool = True  # SwiGLU (llama family) vs plain 2-matrix MLP (OPT)
    tensor_parallel: int = 1
    dtype_bytes: int = 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_params(self) -> int:
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attn = h * h * 2 + h * kv * 2
        mlp = h * self.intermediate_size * (3 if self.gated_mlp else 2)
        return self.num_layers * (attn + mlp) + 2 * self.vocab_size * h

    @property
    def weight_bytes_per_gpu(self) -> int:
        return self.num_params * self.dtype_bytes // self.tensor_parallel

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token across all layers, whole model."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_bytes_per_token_per_gpu(self) -> int:
        # NOTE: with fewer KV heads than GPUs each GPU keeps a full copy of one head.
        heads = max(1, self.num_kv_heads // self.tensor_parallel)
        return 2 * self.num_layers * heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class HardwareSpec:
    name: str
    peak_flops: float  # dense fp16/bf16 FLOP/s of one GPU
    mem_bandwidth: float  # bytes/s of one GPU
    mem_bytes: float  # one GPU's memory
    pcie_bandwidth: float  # host <-> device bytes/s, one direction, achievable
    interconnect_bandwidth: float = 0.0  # GPU <-> GPU bytes/s for tensor-parallel all-reduce


class CostModel(ABC):
    """Prices one step. Pure: no clock, no I/O after construction."""

    name: str = "abstract"

    def __init__(self, model: ModelSpec, hardware: HardwareSpec) -> None:
        self.model = model
        self.hardware = hardware

    @abstractmethod
    def iteration_time(self, shape: BatchShape) -> float:
        """Seconds one step with this shape takes."""

    def swap_time(self, num_bytes: int) -> float:
        return num_bytes / self.hardware.pcie_bandwidth if num_bytes else 0.0

    def prefill_time(self, num_tokens: int, prefix: int = 0) -> float:
        return self.iteration_time(BatchShape(prefill_chunks=[(num_tokens, prefix)]))

    def decode_time(self, batch_size: int, context_len: int) -> float:
        return self.iteration_time(
            BatchShape(
                num_decodes=batch_size, decode_context_sum=batch_size * context_len, decode_context_max=context_len
            )
        )

    def num_kv_blocks(self, block_size: int, gpu_memory_utilization: float = 0.9, kv_gb: float | None = None) -> int:
        """KV blocks per GPU: an explicit KV size, or what memory minus weights leaves."""
        if kv_gb is not None:
            kv_bytes = kv_gb * 2**30
        else:
            kv_bytes = self.hardware.mem_bytes * gpu_memory_utilization - self.model.weight_bytes_per_gpu
            # NOTE: activations and the CUDA context take a few percent; vLLM profiles them,
            # we keep 5% of the GPU's memory aside instead.
            kv_bytes -= 0.05 * self.hardware.mem_bytes
        if kv_bytes <= 0:
            raise ValueError(
                f"{self.model.name} does not fit on {self.hardware.name} with TP={self.model.tensor_parallel}"
            )
        return int(kv_bytes // (self.model.kv_bytes_per_token_per_gpu * block_size))


COST_MODELS: Registry[type[CostModel]] = Registry("cost model")
