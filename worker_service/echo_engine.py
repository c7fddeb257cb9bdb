"""An engine-free worker engine for load tests: checks every plan, runs no model.

    WorkerServicer --StepPlan--> EchoEngine.execute: validate (all or nothing) -> apply
        tables, computed tokens and KV moves as bookkeeping -> synthetic token per sample id

`sluice worker --engine echo` serves it behind the real gRPC worker (health, Warmup,
Execute, Release), so the scheduler, the wire and the worker's own plan decoding are
measured without a forward pass: what is left of a step is the system's overhead. It is
an `Engine` (worker_service/engine_contract.py) with no KV cache (`cache` is None: KV
transfers are refused).

Plans are checked by the same `PlanBook` as the torch engine's (worker_service/plan_check.py),
so a plan this worker accepts is one the real worker accepts. Sampled tokens are fixed
common word pieces cycling with the position, never an EOS id, so requests run to their
max_tokens. `step_time_s` optionally sleeps to mimic a device step; with `async_device` that
time is not slept in `execute` but awaited by the server after it (`async_device_s`), as a
GPU's kernels run while its host CPU is free: what overlapped scheduling relies on. `launch`
and `collect` split a step as the torch engine's do (the worker's pipeline): a step launched
while the one before still runs on the emulated device starts when that one ends.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from sluice.contract.plan import StepPlan, StepResult
from worker_service.engine_contract import EngineConfig, EngineInfo, KVCapacity
from worker_service.hardware import HardwareInfo, describe_hardware
from worker_service.model import resolve_config
from worker_service.plan_check import BookEntry, PlanBook, StepPlanError

ECHO_FIRST_TOKEN = 1996  # "the" in the MiniLM vocabulary of the tiny presets; ids above are common words
ECHO_CYCLE = 1000
ECHO_GPU_BLOCKS = 65536  # blocks reported when Warmup asks the echo engine to measure


@dataclass(frozen=True, slots=True)
class EchoSpec:
    bytes_per_block: int
    supports_int8: bool = True


@dataclass(slots=True)
class EchoLaunched:
    """A launched echo step (EchoEngine.launch); its tokens count as back at `device_end`."""

    step_id: int
    started: float
    sampled: dict[str, int]
    swap_bytes: int
    device_end: float | None  # perf_counter when its emulated device time ends; None: none

    def wait(self) -> None:
        """Nothing to wait for on a host: the server awaits `device_end`."""


class EchoEngine:
    """Bookkeeping of an LLMEngine without the model; see the module docstring."""

    cache = None  # no KV: transfers are refused

    def __init__(
        self, config: EngineConfig, step_time_s: float = 0.0, async_device: bool = False, token_time_s: float = 0.0
    ) -> None:
        """`step_time_s` + `token_time_s` x the tokens a step schedules: its emulated device time
        (a step's cost grows with its batch, as a model's does; the overload benchmark's speed)."""
        self.config = config
        self.model_config = resolve_config(config.model)
        c = self.model_config
        self.max_model_len = config.max_model_len or c.max_position_embeddings
        self.spec = EchoSpec(bytes_per_block=2 * c.num_layers * c.num_kv_heads * c.head_dim * config.block_size * 2)
        self.step_time_s = step_time_s
        self.token_time_s = token_time_s  # NOTE: slept with the step (not with async_device)
        self.async_device_s = step_time_s if async_device else 0.0
        self._device_free = 0.0  # perf_counter when the emulated device finishes what is queued
        self.book = PlanBook(config.block_size, self.max_model_len, c.vocab_size)
        eos = set(c.eos_token_ids)
        vocab = c.vocab_size
        self._cycle = [
            t % vocab for t in range(ECHO_FIRST_TOKEN, ECHO_FIRST_TOKEN + ECHO_CYCLE) if t % vocab not in eos
        ]

    # -- the Engine contract -----------------------------------------------------------
    @property
    def info(self) -> EngineInfo:
        return EngineInfo.describe(
            self.config,
            self.model_config,
            family=f"{self.model_config.family} (echo)",
            dtype="none",
            dtype_bytes=2,
            device="cpu",
            max_model_len=self.max_model_len,
            eos_token_ids=self.model_config.eos_token_ids,
            bytes_per_block=self.spec.bytes_per_block,
            supports_int8=self.spec.supports_int8,
        )

    @property
    def hardware(self) -> HardwareInfo:
        """The CPU it answers on (the scheduler's cost model needs some hardware to price with)."""
        return describe_hardware(torch.device("cpu"), torch.float32)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    def measure_kv_capacity(
        self, gpu_memory_utilization: float, swap_space_gib: float, max_num_batched_tokens: int
    ) -> KVCapacity:
        cpu = int(swap_space_gib * 2**30) // self.spec.bytes_per_block
        return KVCapacity(ECHO_GPU_BLOCKS, cpu, self.spec.bytes_per_block, 0)

    @property
    def requests(self) -> dict[str, BookEntry]:
        return self.book.entries

    @property
    def gpu_owner(self) -> dict[int, str]:
        return self.book.gpu_owner

    @property
    def cpu_owner(self) -> dict[int, str]:
        return self.book.cpu_owner

    def init_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        if num_gpu_blocks < 1 or num_cpu_blocks < 0:
            raise ValueError(f"need >= 1 GPU block and >= 0 CPU blocks, got {num_gpu_blocks}, {num_cpu_blocks}")
        self.book.reset(num_gpu_blocks, num_cpu_blocks)

    def warm_up(self) -> None:
        """Nothing to compile or capture."""

    def release(self, request_ids: Iterable[str]) -> list[str]:
        return self.book.release(request_ids)

    def execute(self, plan: StepPlan) -> StepResult:
        return self.collect(self.launch(plan))

    def launch(self, plan: StepPlan) -> EchoLaunched:
        """The plan checked and applied and its tokens drawn; with `async_device` its device
        time is queued behind the step before's, as a GPU stream runs kernels in order."""
        start = time.perf_counter()
        if not self.book.num_gpu_blocks and (plan.num_scheduled_tokens or plan.new_requests or plan.kv_moves):
            raise StepPlanError("the KV cache is not initialised (run Warmup first)", code="FAILED_PRECONDITION")
        staged = self.book.check(plan)
        self.book.release(plan.release_ids)
        self.book.commit(staged)
        sampled = self._sample(plan)
        self.book.advance(plan, sampled)
        device_end = None
        if self.async_device_s:
            begin = max(time.perf_counter(), self._device_free)
            device_end = self._device_free = begin + self.async_device_s
        elif device_s := self.step_time_s + self.token_time_s * sum(plan.num_scheduled_tokens.values()):
            time.sleep(device_s)
        return EchoLaunched(plan.step_id, start, sampled, staged.moved_blocks * self.spec.bytes_per_block, device_end)

    def collect(self, launched: EchoLaunched) -> StepResult:
        return StepResult(
            step_id=launched.step_id,
            sampled_token_ids=launched.sampled,
            total_s=time.perf_counter() - launched.started,
            swap_bytes=launched.swap_bytes,
        )

    def _sample(self, plan: StepPlan) -> dict[str, int]:
        entries, cycle = self.book.entries, self._cycle
        return {rid: cycle[entries[rid].num_tokens % len(cycle)] for rid in plan.sample_ids}
