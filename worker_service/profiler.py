"""Measure our own worker's step times as a WorkerProfile (`sluice profile`, services/profile.py).

    ProfileGrid -> grid points -> PlanDriver builds real StepPlans -> engine.execute (timed)
        -> StepSample (BatchShape, median seconds) / SwapSample (direction, bytes, int8)
        -> WorkerProfile (the command saves it and fits the cost model to it)

Every measurement drives the engine with the same `StepPlan`s the scheduler sends, so the
profile prices what a live step costs: plan checks, input building, forward, sampling.
Setup steps (prefilling the contexts that decodes then read) run untimed; with
`declare_context` (the default on CUDA) they are skipped: requests arrive with their context
already counted as computed, so its blocks hold whatever was there. Attention reads every
cached position whatever its value, so step times do not change, and an 8B model's grid
then needs seconds instead of the minutes its prefills would take. Each grid point
runs `warmup` times untimed, then `repeats` times; its sample is the median. The driver
owns block ids as the scheduler does (free lists), giving each request blocks for its
whole planned length up front. A point that does not fit (KV blocks, max_model_len) is
skipped and reported, so one grid serves a tiny CPU model and a 7B model on a GPU.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import torch
from tqdm import tqdm

from sluice.contract.plan import CachedRequestData, KVMove, KVMoveKind, NewRequestData, StepPlan, StepResult
from sluice.contract.profile import BatchShape, ModelSpec, StepSample, SwapSample, WorkerProfile
from sluice.contract.sampling import SamplingParams
from worker_service.engine_contract import Engine
from worker_service.plan_check import StepPlanError

# NOTE: sampling is part of a step's cost (a softmax and a draw over the vocabulary cost as
# much as a tiny model's forward): profile with what the served requests use. "random" is
# the API's default (temperature 1.0).
# Unseeded, as served requests come (a seed gives each request its own generator: one
# random-number launch per row instead of one for the batch).
SAMPLING = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True),
    "random": SamplingParams(temperature=1.0, max_tokens=1 << 20, ignore_eos=True),
}
_MAX_SETUP_TOKENS = 2048  # setup prefills run in steps no larger than a live step


@dataclass(frozen=True, slots=True)
class ProfileGrid:
    prefill: tuple[tuple[int, int], ...]  # (chunk tokens, cached prefix)
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    mixed: tuple[tuple[int, int, int], ...]  # (prefill chunk, decodes, decode context)
    swap_blocks: tuple[int, ...]
    repeats: int = 5
    warmup: int = 2

    @property
    def slack(self) -> int:
        """Tokens a decoding request grows by while one grid point is measured."""
        return self.warmup + self.repeats + 1

    def max_blocks(self, block_size: int) -> int:
        """GPU blocks the largest grid point holds at once."""
        decode = max(b * _blocks(c + self.slack, block_size) for b in self.decode_batches for c in self.decode_contexts)
        mixed = max(
            (d * _blocks(c + self.slack, block_size) + _blocks(p, block_size) for p, d, c in self.mixed), default=0
        )
        prefill = max(_blocks(c + p, block_size) for c, p in self.prefill)
        return max(decode, mixed, prefill, max(self.swap_blocks))


QUICK_GRID = ProfileGrid(
    prefill=((16, 0), (64, 0), (128, 0), (256, 0), (512, 0), (64, 256), (256, 512), (128, 1024)),
    decode_batches=(1, 4, 16, 64),
    decode_contexts=(64, 256, 1024),
    mixed=((64, 8, 128), (256, 16, 64), (128, 32, 512), (512, 4, 256)),
    swap_blocks=(4, 32, 128),
    repeats=3,
    warmup=1,
)
# Real shapes on a GPU (an 8B model at 8k context): what does not fit the memory or the
# model's length is skipped.
GPU_GRID = ProfileGrid(
    prefill=tuple((c, p) for c in (64, 128, 256, 512, 1024, 2048, 4096) for p in (0, 512, 2048, 6144)),
    decode_batches=(1, 2, 4, 8, 16, 32, 64, 128, 256),
    decode_contexts=(512, 1024, 2048, 4096, 8192),
    mixed=tuple((c, d, x) for c in (256, 1024) for d in (8, 32, 128) for x in (512, 2048)),
    swap_blocks=(16, 128, 512),
)
FULL_GRID = ProfileGrid(
    prefill=tuple((c, p) for c in (16, 64, 128, 256, 512, 1024, 2048) for p in (0, 512, 1536)),
    decode_batches=(1, 2, 4, 8, 16, 32, 64, 128, 256),
    decode_contexts=(128, 512, 1024, 1900),
    mixed=tuple((c, d, x) for c in (128, 512) for d in (4, 16, 64) for x in (256, 1024)),
    swap_blocks=(1, 8, 64, 256),
)


def _blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class StepFailed(RuntimeError):
    """The engine answered a profile step with an error."""


class PlanDriver:
    """Builds StepPlans for synthetic requests and runs them; owns the block ids."""

    def __init__(
        self,
        engine: Engine,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        sampling: str = "random",
        declare_context: bool = False,
    ) -> None:
        self.engine = engine
        self.declare_context = declare_context
        self.sampling = SAMPLING[sampling]
        self.block_size = engine.info.block_size
        self.num_gpu_blocks, self.num_cpu_blocks = num_gpu_blocks, num_cpu_blocks
        engine.init_kv_cache(num_gpu_blocks, num_cpu_blocks)
        self.free_gpu: list[int] = list(range(num_gpu_blocks))
        self.free_cpu: list[int] = list(range(num_cpu_blocks))
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self._step_id = 0
        self._num_created = 0

    def take(self, pool: list[int], n: int) -> list[int]:
        if n > len(pool):
            raise MemoryError(f"needs {n} blocks, {len(pool)} free")
        taken = pool[:n]
        del pool[:n]
        return taken

    def new_request(self, num_tokens: int, reserve_tokens: int, computed: int = 0) -> NewRequestData:
        rid = f"profile-{self._num_created}"
        self._num_created += 1
        vocab = self.engine.info.vocab_size
        # NOTE: content does not change timings, only counts do; ids skip 0..2 (specials).
        prompt = tuple(3 + (i * 7919) % (vocab - 3) for i in range(num_tokens))
        self.tables[rid] = self.take(self.free_gpu, _blocks(reserve_tokens, self.block_size))
        self.computed[rid] = computed
        return NewRequestData(rid, prompt, num_tokens, self.sampling, tuple(self.tables[rid]), computed)

    def release(self, rids: Sequence[str]) -> None:
        self.engine.release(list(rids))
        for rid in rids:
            self.free_gpu.extend(self.tables.pop(rid))
            del self.computed[rid]

    def reset(self) -> None:
        """Forgets every request (after a grid point that did not fit)."""
        self.release(list(self.tables))
        self.free_gpu, self.free_cpu = list(range(self.num_gpu_blocks)), list(range(self.num_cpu_blocks))

    def step(
        self,
        scheduled: dict[str, int],
        new: Sequence[NewRequestData] = (),
        sample: frozenset[str] | None = None,
        moves: Sequence[KVMove] = (),
        cached: CachedRequestData | None = None,
    ) -> tuple[float, StepResult]:
        """Runs one plan; returns (wall seconds of engine.execute, its result)."""
        self._step_id += 1
        plan = StepPlan(
            step_id=self._step_id,
            worker_id=0,
            new_requests=tuple(new),
            cached_requests=cached or CachedRequestData(),
            num_scheduled_tokens=scheduled,
            sample_ids=frozenset(scheduled) if sample is None else sample,
            kv_moves=tuple(moves),
        )
        start = time.perf_counter()
        result = self.engine.execute(plan)
        elapsed = time.perf_counter() - start
        if result.error is not None:
            raise StepFailed(f"step {plan.step_id}: {result.error.message}")
        for rid, n in scheduled.items():
            self.computed[rid] += n
        return elapsed, result

    def prefill(self, count: int, prompt_len: int, context: int, reserve_tokens: int) -> list[str]:
        """`count` requests of `prompt_len` tokens with `context` of them computed (untimed).

        A request whose whole prompt is computed samples, so it is ready to decode."""
        if self.declare_context:
            return self._declare(count, prompt_len, context, reserve_tokens)
        requests = [self.new_request(prompt_len, reserve_tokens) for _ in range(count)]
        unsent = {r.request_id: r for r in requests}
        while any(self.computed[r.request_id] < context for r in requests):
            scheduled: dict[str, int] = {}
            budget = _MAX_SETUP_TOKENS
            for r in requests:
                n = min(context - self.computed[r.request_id], budget)
                if n > 0:
                    scheduled[r.request_id] = n
                    budget -= n
            done = frozenset(rid for rid, n in scheduled.items() if self.computed[rid] + n == prompt_len)
            self.step(scheduled, new=[unsent.pop(rid) for rid in scheduled if rid in unsent], sample=done)
        return [r.request_id for r in requests]

    def _declare(self, count: int, prompt_len: int, context: int, reserve_tokens: int) -> list[str]:
        """As `prefill`, with the context declared computed: one setup step that only admits.

        A fully computed prompt comes with one more token, the one its last prefill step
        would have sampled."""
        num_tokens = prompt_len + 1 if context == prompt_len else prompt_len
        requests = [self.new_request(num_tokens, reserve_tokens, computed=context) for _ in range(count)]
        self.step({}, new=requests)
        return [r.request_id for r in requests]


def _timed(grid: ProfileGrid, run: Callable[[], float]) -> list[float]:
    for _ in range(grid.warmup):
        run()
    return [run() for _ in range(grid.repeats)]


def _decode_shape(driver: PlanDriver, rids: Sequence[str], grid: ProfileGrid, shape: BatchShape) -> BatchShape:
    # Contexts grew during the timed steps; record the one of the median step.
    for rid in rids:
        shape.add_decode(driver.computed[rid] - (grid.repeats + 1) // 2)
    return shape


def profile_prefill(driver: PlanDriver, grid: ProfileGrid, chunk: int, prefix: int) -> list[StepSample]:
    def run() -> float:
        if prefix:
            (rid,) = driver.prefill(1, prefix + chunk, prefix, prefix + chunk)
            elapsed, _ = driver.step({rid: chunk})
        else:
            request = driver.new_request(chunk, chunk)
            rid = request.request_id
            elapsed, _ = driver.step({rid: chunk}, new=[request])
        driver.release([rid])
        return elapsed

    times = _timed(grid, run)
    return [StepSample(BatchShape(prefill_chunks=[(chunk, prefix)]), statistics.median(times), times)]


def profile_decode(driver: PlanDriver, grid: ProfileGrid, batch: int, context: int) -> list[StepSample]:
    rids = driver.prefill(batch, context, context, context + grid.slack)
    times = _timed(grid, lambda: driver.step(dict.fromkeys(rids, 1))[0])
    shape = _decode_shape(driver, rids, grid, BatchShape())
    driver.release(rids)
    return [StepSample(shape, statistics.median(times), times)]


def profile_mixed(driver: PlanDriver, grid: ProfileGrid, chunk: int, decodes: int, context: int) -> list[StepSample]:
    rids = driver.prefill(decodes, context, context, context + grid.slack)

    def run() -> float:
        request = driver.new_request(chunk, chunk)
        elapsed, _ = driver.step({request.request_id: chunk, **dict.fromkeys(rids, 1)}, new=[request])
        driver.release([request.request_id])
        return elapsed

    times = _timed(grid, run)
    shape = _decode_shape(driver, rids, grid, BatchShape(prefill_chunks=[(chunk, 0)]))
    driver.release(rids)
    return [StepSample(shape, statistics.median(times), times)]


def profile_swap(driver: PlanDriver, grid: ProfileGrid, num_blocks: int, int8: bool) -> list[SwapSample]:
    """One request's blocks swapped out and back in, in steps that do nothing else."""
    tokens = num_blocks * driver.block_size
    (rid,) = driver.prefill(1, tokens, tokens, tokens)
    gpu = tuple(driver.tables[rid])
    runs: dict[str, list[tuple[float, int]]] = {"out": [], "in": []}
    for _ in range(grid.warmup + grid.repeats):
        cpu = tuple(driver.take(driver.free_cpu, num_blocks))
        elapsed, result = driver.step({}, moves=[KVMove(KVMoveKind.SWAP_OUT, rid, gpu, cpu, int8)])
        runs["out"].append((elapsed, result.swap_bytes))
        back = CachedRequestData((rid,), (gpu,), (True,), (driver.computed[rid],))
        elapsed, result = driver.step({}, moves=[KVMove(KVMoveKind.SWAP_IN, rid, cpu, gpu, int8)], cached=back)
        runs["in"].append((elapsed, result.swap_bytes))
        driver.free_cpu.extend(cpu)
    driver.release([rid])
    return [
        SwapSample(
            direction=direction,
            num_blocks=num_blocks,
            bytes=samples[-1][1],
            time_s=statistics.median(t for t, _ in samples[grid.warmup :]),
            int8=int8,
        )
        for direction, samples in runs.items()
    ]


GridPoint = tuple[str, Callable[[PlanDriver, ProfileGrid], list]]


def grid_points(grid: ProfileGrid) -> Iterator[GridPoint]:
    for chunk, prefix in grid.prefill:
        yield f"prefill {chunk}+{prefix}", lambda d, g, c=chunk, p=prefix: profile_prefill(d, g, c, p)
    for batch in grid.decode_batches:
        for ctx in grid.decode_contexts:
            yield f"decode {batch}x{ctx}", lambda d, g, b=batch, c=ctx: profile_decode(d, g, b, c)
    for chunk, decodes, ctx in grid.mixed:
        yield f"mixed {chunk}+{decodes}x{ctx}", lambda d, g, c=chunk, n=decodes, x=ctx: profile_mixed(d, g, c, n, x)
    for num_blocks in grid.swap_blocks:
        for int8 in (False, True):
            label = f"swap {num_blocks} blocks{' int8' if int8 else ''}"
            yield label, lambda d, g, n=num_blocks, q=int8: profile_swap(d, g, n, q)


def model_spec(engine: Engine) -> ModelSpec:
    info = engine.info
    return ModelSpec(
        name=info.model,
        num_layers=info.num_layers,
        hidden_size=info.hidden_size,
        num_heads=info.num_heads,
        num_kv_heads=info.num_kv_heads,
        intermediate_size=info.intermediate_size,
        vocab_size=info.vocab_size,
        max_model_len=info.max_model_len,
        gated_mlp=info.family.startswith("llama"),
        dtype_bytes=info.dtype_bytes,
    )


def device_name(engine: Engine) -> str:
    device = engine.info.device
    if device.startswith("cuda"):
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return device


def kv_capacity(engine: Engine, grid: ProfileGrid, gpu_memory_utilization: float) -> tuple[int, int]:
    """As many blocks as the largest grid point needs, or as many as fit."""
    block_size = engine.info.block_size
    wanted_gpu, wanted_cpu = grid.max_blocks(block_size), max(grid.swap_blocks)
    swap_gib = wanted_cpu * engine.info.bytes_per_block / 2**30
    fits = engine.measure_kv_capacity(gpu_memory_utilization, swap_gib, _MAX_SETUP_TOKENS)
    return max(1, min(wanted_gpu, fits.num_gpu_blocks)), wanted_cpu


def run_profile(
    engine: Engine,
    grid: ProfileGrid,
    gpu_memory_utilization: float = 0.9,
    progress: bool = True,
    sampling: str = "random",
    declare_context: bool | None = None,
) -> tuple[WorkerProfile, list[str]]:
    """Measures every grid point; returns the profile and the labels of skipped points.

    `declare_context`: skip setup prefills (None: on CUDA only)."""
    declare = engine.info.device.startswith("cuda") if declare_context is None else declare_context
    blocks = kv_capacity(engine, grid, gpu_memory_utilization)
    driver = PlanDriver(engine, *blocks, sampling=sampling, declare_context=declare)
    profile = WorkerProfile(
        model=model_spec(engine),
        device=device_name(engine),
        dtype=engine.info.dtype,
        block_size=engine.info.block_size,
        created=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    )
    skipped: list[str] = []
    points = list(grid_points(grid))
    bar = tqdm(points, desc="profile", unit="point", disable=not progress)
    for label, measure in bar:
        bar.set_postfix_str(label)
        try:
            samples = measure(driver, grid)
        except (MemoryError, StepFailed, StepPlanError) as exc:
            skipped.append(f"{label}: {exc}")
            driver.reset()
            continue
        target = profile.swaps if label.startswith("swap") else profile.steps
        target.extend(samples)
    return profile, skipped
