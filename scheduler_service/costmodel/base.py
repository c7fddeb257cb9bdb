"""The cost-model contract: the shape of one batch in, seconds out.

A `BatchShape` (defined with the profile file in `sluice.contract.profile`, since the worker's
profiler writes it too) is what a worker does in one step: prefill chunks (tokens, cached
prefix each), decodes (one token each over their contexts) and KV swap bytes. The simulator
builds it from a StepPlan; `sluice profile` measures it on a real worker; every cost model
prices it. Model and hardware presets give the dimensions the models need.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from sluice.common.registry import Registry
from sluice.contract.profile import BatchShape, ModelSpec


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
