"""The Engine contract: what the worker server, the step pipeline, KV transfers and the
profiler use of an engine, and nothing else.

    WorkerServicer.Info      -> engine.info, engine.hardware
    WorkerServicer.Warmup    -> engine.measure_kv_capacity, init_kv_cache, warm_up, execute, release
    Execute (one at a time)  -> engine.execute(StepPlan) -> StepResult
    Execute (pipelined)      -> engine.launch(plan) -> handle; handle.wait / device_end; engine.collect(handle)
    FinishedFilter, metrics  -> engine.book (the PlanBook of what the scheduler told it), num_requests
    Release                  -> engine.release(ids)
    OfferKv / PullKv / ReadKv-> engine.cache (a KVBlocks: export and import whole blocks), or None
    sluice profile           -> info, measure_kv_capacity, init_kv_cache, execute, release

Engines (worker_service/engines.py registers them by name): `torch` (ours, worker_service/engine.py),
`echo` (bookkeeping only, worker_service/echo_engine.py) and `vllm` (vLLM's model runner executing
our plans, worker_service/vllm_engine.py). Every engine checks plans with the one PlanBook
(worker_service/plan_check.py), so a plan one engine accepts, every engine accepts; an engine
answers with what it computed, never decides what to compute.

This module imports neither torch nor vLLM: the scheduler-side tools and the registry read it
on a box without them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from sluice.common.config import opt
from sluice.contract.limits import DEFAULT_BLOCK_SIZE
from sluice.contract.plan import StepPlan, StepResult

if TYPE_CHECKING:  # for the annotations only (torch stays out of this module)
    from worker_service.hardware import HardwareInfo
    from worker_service.model.config import ModelConfig
    from worker_service.plan_check import PlanBook


@dataclass
class EngineConfig:
    model: str = opt("tiny-llama", "dummy preset name, or a local directory with config.json (+ safetensors)")
    load_format: str = opt("auto", "auto (safetensors if the directory has them), dummy or safetensors")
    dtype: str = opt("auto", "auto (float32 on cpu, bfloat16 on cuda), float32, float16 or bfloat16")
    device: str = opt("cpu", "cpu, cuda or cuda:N")
    block_size: int = opt(DEFAULT_BLOCK_SIZE, "KV block size in tokens")
    seed: int = opt(0, "dummy-weight seed (and the seed of unseeded sampling)")
    max_model_len: int | None = opt(None, "context length; none: from config.json or the preset")
    tokenizer: str | None = opt(None, "tokenizer.json; none: the model folder's, else the demo MiniLM one")
    attention: str = opt("auto", "auto (triton on CUDA when Triton imports, torch elsewhere), torch or triton")
    cuda_graphs: bool = opt(True, "replay decode steps as CUDA graphs (triton attention only)")
    max_graph_batch: int = opt(256, "largest decode batch captured as a CUDA graph")
    vllm_compile: bool = opt(
        True, "vllm engine: vLLM compiles its model (slower start, faster steps); --no-vllm-compile: eager"
    )


@dataclass(frozen=True)
class EngineInfo:
    model: str
    family: str
    dtype: str
    device: str
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    bytes_per_block: int  # one block across all layers, K and V, at the cache dtype
    hidden_size: int
    num_heads: int
    intermediate_size: int
    dtype_bytes: int
    supports_int8: bool = False  # swapped (and transferred) KV can be int8-compressed

    @classmethod
    def describe(
        cls,
        config: EngineConfig,
        model: ModelConfig,
        *,
        family: str,
        dtype: str,
        dtype_bytes: int,
        device: str,
        max_model_len: int,
        eos_token_ids: Iterable[int],
        bytes_per_block: int,
        supports_int8: bool = False,
    ) -> EngineInfo:
        """The description of an engine serving `model` as `config` says (engines differ only in
        the keyword arguments)."""
        return cls(
            model=config.model,
            family=family,
            dtype=dtype,
            device=device,
            block_size=config.block_size,
            max_model_len=max_model_len,
            vocab_size=model.vocab_size,
            eos_token_ids=tuple(eos_token_ids),
            num_layers=model.num_layers,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            bytes_per_block=bytes_per_block,
            hidden_size=model.hidden_size,
            num_heads=model.num_heads,
            intermediate_size=model.intermediate_size,
            dtype_bytes=dtype_bytes,
            supports_int8=supports_int8,
        )


@dataclass(frozen=True)
class KVCapacity:
    num_gpu_blocks: int
    num_cpu_blocks: int
    bytes_per_block: int
    peak_activation_bytes: int


class KVSpec(Protocol):
    """The block geometry KV transfers read."""

    @property
    def bytes_per_block(self) -> int: ...

    @property
    def supports_int8(self) -> bool: ...


class KVBlocks(Protocol):
    """An engine's KV cache as KV transfers see it: whole blocks out and in, in the swap format
    (kvstore.paged.PagedKVCache; the vLLM engine's view over vLLM's tensors)."""

    @property
    def spec(self) -> KVSpec: ...

    @property
    def num_gpu_blocks(self) -> int: ...

    def transfer_bytes_per_block(self, int8: bool) -> int: ...

    def export_blocks(self, gpu_ids: Sequence[int], int8: bool) -> bytes: ...

    def import_blocks(self, gpu_ids: Sequence[int], packed: Any, int8: bool) -> None: ...


class LaunchedStep(Protocol):
    """An engine's handle on a launched step (`Engine.launch`), until `Engine.collect` answers it."""

    @property
    def device_end(self) -> float | None:
        """perf_counter at which an emulated device finishes the step (the echo engine); None:
        `wait` blocks until the real device is done."""
        ...

    def wait(self) -> None: ...


@runtime_checkable
class Engine(Protocol):
    """Executes StepPlans exactly (see the module docstring for who calls what)."""

    @property
    def info(self) -> EngineInfo: ...

    @property
    def hardware(self) -> HardwareInfo: ...

    @property
    def num_requests(self) -> int: ...

    @property
    def book(self) -> PlanBook: ...

    @property
    def cache(self) -> KVBlocks | None:
        """The KV cache KV transfers read and write; None before Warmup or with no KV (echo)."""
        ...

    @property
    def async_device_s(self) -> float:
        """Seconds of an emulated device step the server awaits off the CPU (echo); 0 otherwise."""
        ...

    def measure_kv_capacity(
        self, gpu_memory_utilization: float, swap_space_gib: float, max_num_batched_tokens: int
    ) -> KVCapacity: ...

    def init_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """(Re)creates the KV cache; every request held is forgotten."""
        ...

    def warm_up(self) -> None: ...

    def release(self, request_ids: Iterable[str]) -> list[str]: ...

    def execute(self, plan: StepPlan) -> StepResult: ...

    def launch(self, plan: StepPlan) -> LaunchedStep: ...

    def collect(self, launched: Any) -> StepResult: ...
