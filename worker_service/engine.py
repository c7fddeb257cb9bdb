"""The worker's engine: executes one StepPlan at a time on a model and a paged KV cache.

    execute(plan):
        validate the whole plan against the persistent batch  (StepPlanError, nothing changed)
        release ids                     -> forget requests (their blocks are the scheduler's again)
        new requests / cached diffs     -> persistent batch: token ids, num_computed_tokens, block_table
        KV moves, in order              -> PagedKVCache.swap_out / swap_in / copy
        flatten scheduled tokens        -> input_ids [T], positions [T], slot_mapping, block tables
        one forward pass                -> hidden [T, H]; logits only for rows that sample
        sampler                         -> one token per plan.sample_ids; appended to the request
        -> StepResult with measured prepare / swap / forward / sample seconds

The forward pass attends through one of two paths (`EngineConfig.attention`):

    torch    kvstore.paged.PagedAttention: gathers blocks, SDPA (CPU; the CUDA baseline)
    triton   kvstore.kernel_attention: Triton kernels read the blocks in place (CUDA default);
             a step of one-token chunks replays a CUDA graph of the layers (cuda_graphs.py)

On CUDA a step waits for the device once, when the sampled tokens come back: metadata goes
over in non-blocking copies and the timings are CUDA events read after that wait.

The persistent batch is `requests`: request id -> `RequestState`. A request's known tokens
are its prompt plus every token sampled here (or, after a recompute preemption, resent in
`prompt_token_ids`); `num_computed_tokens` of them have KV in the cache. A plan advances a
request by `num_scheduled_tokens[rid]` tokens: a prefill chunk or a decode, the same thing.
The scheduler owns every block id; this engine only checks that the ids it is given are
sane, because a wrong id would silently corrupt another request's KV.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvstore import paged_kernels
from kvstore.kernel_attention import KernelPagedAttention, build_kernel_metadata, decode_columns, to_device
from kvstore.paged import KVCacheSpec, PagedAttention, PagedKVCache, SeqChunk, build_metadata
from sluice.common.tokenizer import Tokenizer
from sluice.contract.plan import NewRequestData, StepPlan, StepResult
from sluice.contract.sampling import SamplingParams
from worker_service.cuda_graphs import DecodeGraphs
from worker_service.engine_contract import EngineConfig, EngineInfo, KVCapacity
from worker_service.hardware import HardwareInfo, describe_hardware
from worker_service.kv_moves import apply_kv_moves
from worker_service.model import Attention, DenseAttention, load_model, resolve_config, resolve_dtype
from worker_service.model.dummy import is_preset
from worker_service.plan_check import PlanBook, StepPlanError

__all__ = ["EngineConfig", "EngineInfo", "KVCapacity", "LLMEngine", "StepPlanError"]
from worker_service.sampler import Sampler, SamplingRow, needs_penalties
from worker_service.step_clock import StepClock

# Longest single sequence in the activation probe: keeps its attention matrix realistic.
PROBE_SEQ_LEN = 512


@dataclass
class RequestState:
    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    num_output_tokens: int
    sampling: SamplingParams
    block_table: list[int] = field(default_factory=list)
    # block_table as int32, what the kernels' metadata is built from (derived, so not compared)
    block_array: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32), compare=False, repr=False)
    cpu_block_ids: list[int] = field(default_factory=list)  # where its KV sits while swapped out
    generator: torch.Generator | None = None
    # tokens sampled for it and not back on the host yet, oldest first: (the launched step, its row
    # among that step's tokens); they follow `token_ids`
    pending: list[tuple[Launched, int]] = field(default_factory=list, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class HostBatch:
    """One step's scheduled tokens flattened on the host."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    chunks: list[SeqChunk]
    sample_rows: list[int]  # rows of the tokens that sample
    sample_ids: list[str]  # their requests, in the same order
    # rows whose token the step before sampled and has not brought back yet: (rows, tokens) on the device
    fill: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(slots=True)
class Launched:
    """A step whose device work is queued (LLMEngine.launch) and not collected yet."""

    step_id: int
    started: float  # perf_counter when its launch began
    clock: StepClock
    sample_ids: list[str]  # the requests that sample, in the tokens' order
    tokens: torch.Tensor | None  # on the device: the next step's inputs refer to it
    host: torch.Tensor | None = None  # the same tokens copied back (queued right behind the sampler)
    values: list[int] | None = None  # once back on the host
    states: list[RequestState] = field(default_factory=list)  # the requests that sample, as launched
    prepare_s: float = 0.0
    swap_s: float | None = None  # None: the swap's GPU time is read once the step is done
    swap_bytes: int = 0
    device_end: float | None = None  # (the echo engine's emulated device only)

    def wait(self) -> None:
        """Blocks until the step's device work is done (at once on a CPU)."""
        self.clock.wait()


class LLMEngine:
    """Our torch engine (an `Engine`, worker_service/engine_contract.py)."""

    async_device_s = 0.0  # a real device: the server waits on the launched step's handle

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model_config = resolve_config(config.model)
        self.model = load_model(config.model, config.load_format, self.dtype, self.device, config.seed)
        self.max_model_len = self._max_model_len(config.max_model_len)
        self._tokenizer = self._load_tokenizer()
        self.eos_token_ids = self.model_config.eos_token_ids or self._tokenizer.eos_token_ids
        self.spec = KVCacheSpec(
            num_layers=self.model_config.num_layers,
            num_kv_heads=self.model_config.num_kv_heads,
            head_dim=self.model_config.head_dim,
            block_size=config.block_size,
            dtype=self.dtype,
        )
        self.sampler = Sampler(self.eos_token_ids, self.device, config.seed)
        self.attention = self._attention_backend(config.attention)
        self.cache: PagedKVCache | None = None
        self.graphs: DecodeGraphs | None = None
        self.requests: dict[str, RequestState] = {}
        self._uncollected: list[Launched] = []  # launched steps whose tokens are not back, oldest first
        self._last: Launched | None = None  # the last step launched and not collected
        self.book = PlanBook(config.block_size, self.max_model_len, self.model_config.vocab_size)

    # -- public API ----------------------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        return EngineInfo.describe(
            self.config,
            self.model_config,
            family=self.model_config.family,
            dtype=str(self.dtype).removeprefix("torch."),
            dtype_bytes=self.dtype.itemsize,
            device=str(self.device),
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            bytes_per_block=self.spec.bytes_per_block,
            supports_int8=self.spec.supports_int8,
        )

    @property
    def hardware(self) -> HardwareInfo:
        """What this engine's device can do (measured once per process)."""
        return describe_hardware(self.device, self.dtype)

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    def init_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """(Re)creates the cache; any request held is forgotten, since its KV is gone."""
        if num_gpu_blocks < 1 or num_cpu_blocks < 0:
            raise ValueError(f"need >= 1 GPU block and >= 0 CPU blocks, got {num_gpu_blocks}, {num_cpu_blocks}")
        self.cache = self.graphs = None
        self.requests.clear()
        self._uncollected.clear()
        self._last = None
        self.cache = PagedKVCache(self.spec, num_gpu_blocks, num_cpu_blocks, self.device)
        self.book.reset(num_gpu_blocks, num_cpu_blocks)
        self.configure_attention(self.config.attention, self.config.cuda_graphs)

    def configure_attention(self, attention: str, cuda_graphs: bool) -> None:
        """Switches the attention path (and decode graphs) of a live engine; requests are kept."""
        self.attention = self._attention_backend(attention)
        self.config.attention, self.config.cuda_graphs = attention, cuda_graphs
        self.graphs = None
        if self.cache is not None and self.attention == "triton" and cuda_graphs:
            self.graphs = DecodeGraphs(self.model, self.cache, self.max_model_len, self.config.max_graph_batch)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compiles the attention kernels and captures every decode graph now (CUDA), so the
        first live steps of each shape pay for neither. (In inference mode, as `execute`: a
        graph captured with autograd on would keep activations for a backward pass.)"""
        if self.attention != "triton":
            return
        k_cache, v_cache = self._cache.layer(0)
        paged_kernels.precompile(k_cache, v_cache, self.model_config.num_heads, self._cache.pad_block)
        if self.graphs is not None:
            self.graphs.capture_all()

    def measure_kv_capacity(
        self, gpu_memory_utilization: float, swap_space_gib: float, max_num_batched_tokens: int
    ) -> KVCapacity:
        """Blocks that fit in `gpu_memory_utilization` of the device once the weights and the
        activations of a max_num_batched_tokens forward pass are accounted for."""
        peak = self._probe_activation_bytes(max_num_batched_tokens)
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        budget = int(self._device_memory_bytes() * gpu_memory_utilization) - weights - peak
        per_block = self.spec.bytes_per_block
        return KVCapacity(
            num_gpu_blocks=max(0, budget // per_block),
            num_cpu_blocks=int(swap_space_gib * 2**30) // per_block,
            bytes_per_block=per_block,
            peak_activation_bytes=peak,
        )

    def release(self, request_ids: Iterable[str]) -> list[str]:
        released = self.book.release(request_ids)
        for rid in released:
            del self.requests[rid]
        return released

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        return self.collect(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> Launched:
        """Everything of a step up to its device work being queued: the plan checked and applied,
        the inputs built, the forward pass and the sampler launched. The sampled tokens stay on
        the device (`collect` brings them back); the counts advance now, so the next plan can
        be checked and launched before this step's tokens are known (the worker's pipeline:
        worker_service/step_pipeline.py). A token still on the device is the input of the next
        step by reference: its row is filled on the device from this step's token tensor."""
        t_start = time.perf_counter()
        if self.cache is None and (plan.num_scheduled_tokens or plan.kv_moves or plan.new_requests):
            raise StepPlanError("the KV cache is not initialised (run Warmup first)", code="FAILED_PRECONDITION")
        staged = self.book.check(plan)
        self.release(plan.release_ids)
        self._admit(plan.new_requests)
        cuda = self.device.type == "cuda"
        if plan.kv_moves and cuda and self._last is not None and self._last.swap_s is None:
            # NOTE: the cache times one swap at a time; read the previous step's before this
            # one's moves record over it (it waits only when two steps in a row swap).
            self._last.clock.wait()
            self._last.swap_s = self._cache.last_swap_seconds()
        swap_s, swap_bytes = apply_kv_moves(self._cache, plan.kv_moves, defer_copies=cuda)
        self.book.commit(staged)
        for rid, entry in staged.states.items():
            state = self.requests[rid]
            state.block_table, state.cpu_block_ids = list(entry.gpu), list(entry.cpu)
            state.block_array = np.asarray(entry.gpu, dtype=np.int32)
        t_prepare = time.perf_counter()
        try:
            launched = self._launch_batch(plan, t_start)
        finally:
            if plan.kv_moves:
                # NOTE: a step with no tokens (or one that failed) flushes here; a no-op when its
                # forward already issued them (see PagedKVCache.swapping).
                self._cache.flush_swaps()
        launched.swap_bytes = swap_bytes
        launched.prepare_s = max(0.0, t_prepare - t_start - swap_s)
        launched.swap_s = None if plan.kv_moves and cuda else swap_s
        self.book.advance(plan, launched.sample_ids)
        self._last = launched
        return launched

    @torch.inference_mode()
    def collect(self, launched: Launched) -> StepResult:
        """Waits for a launched step's device work and answers it (its tokens appended to
        their requests). Steps are collected in the order they were launched."""
        tokens = self._resolve(launched)
        clock = launched.clock
        clock.wait()
        sampled = dict(zip(launched.sample_ids, tokens, strict=True))
        forward_s = sample_s = prep2_s = 0.0
        if "sampled" in clock.host:
            forward_s, sample_s = clock.seconds("prepared", "forward"), clock.seconds("forward", "sampled")
            prep2_s = clock.host_seconds("prepared")
        swap_s = launched.swap_s
        if swap_s is None:
            # NOTE: host time only issues the copies; the blocking part is the GPU time
            # between the swap stream's start and its ready event (known after the wait).
            swap_s = launched.swap_s = self._cache.last_swap_seconds()
        if self._last is launched:
            self._last = None
        return StepResult(
            step_id=launched.step_id,
            sampled_token_ids=sampled,
            total_s=time.perf_counter() - launched.started,
            forward_s=forward_s,
            swap_s=swap_s,
            sample_s=sample_s,
            prepare_s=launched.prepare_s + prep2_s,
            swap_bytes=launched.swap_bytes,
        )

    # -- applying a plan -------------------------------------------------------------------

    @property
    def _cache(self) -> PagedKVCache:
        if self.cache is None:
            raise StepPlanError("the KV cache is not initialised (run Warmup first)", code="FAILED_PRECONDITION")
        return self.cache

    def _admit(self, new_requests: Iterable[NewRequestData]) -> None:
        for new in new_requests:
            seed = new.sampling.seed
            self.requests[new.request_id] = RequestState(
                request_id=new.request_id,
                token_ids=list(new.prompt_token_ids),
                num_computed_tokens=new.num_computed_tokens,
                num_output_tokens=new.num_output_tokens,
                sampling=new.sampling,
                generator=None if seed is None else self.sampler.make_generator(seed),
            )

    def _launch_batch(self, plan: StepPlan, started: float) -> Launched:
        """Forward over every scheduled token, then the sampler, queued on the device."""
        clock = StepClock(self.device)
        if not plan.num_scheduled_tokens:
            clock.mark("queued")  # behind the plan's KV moves: `collect` waits for them
            return Launched(plan.step_id, started, clock, [], None)
        order = list(plan.num_scheduled_tokens.items())
        batch = self._host_batch(order, plan.sample_ids)
        # NOTE: uploaded before the forward: a copy queued behind the forward's kernels waits
        # for them, and the swap's device-to-host copies issued below would queue behind it.
        rows = to_device(np.asarray(batch.sample_rows, dtype=np.int64), self.device) if batch.sample_ids else None
        clock.mark("prepared")
        hidden = self._forward(batch)
        if plan.kv_moves:
            # NOTE: the swap-outs' device-to-host copies go now, after every input copy of the
            # step and before the copies that wait for its forward (the sampled tokens coming
            # back): the copy engine runs copies in the order they were issued, so issued
            # later they would wait for the forward, issued earlier they hold up its inputs.
            self._cache.flush_swaps()
        logits = None
        if rows is not None:
            logits = self.model.compute_logits(hidden[rows])
        clock.mark("forward")
        for rid, n in order:
            self.requests[rid].num_computed_tokens += n
        tokens = host = None
        if logits is not None:
            if self._uncollected and any(needs_penalties(self.requests[r].sampling) for r in batch.sample_ids):
                # NOTE: penalties read every earlier token's value: the steps before must be back.
                for step in list(self._uncollected):
                    self._resolve(step)
            tokens = self.sampler.sample(logits, [self._sampling_row(rid) for rid in batch.sample_ids])
            # NOTE: the copy back is queued now, right behind the sampler: queued after the next
            # step's kernels, it would wait for them too.
            host = tokens.to("cpu", non_blocking=True) if self.device.type == "cuda" else tokens
        clock.mark("sampled")
        states = [self.requests[rid] for rid in batch.sample_ids]
        launched = Launched(plan.step_id, started, clock, batch.sample_ids, tokens, host, states=states)
        for i, state in enumerate(states):
            state.num_output_tokens += 1
            state.pending.append((launched, i))
        if tokens is not None:
            self._uncollected.append(launched)
        return launched

    def _resolve(self, launched: Launched) -> list[int]:
        """The step's tokens on the host, appended to the requests still holding them (one
        released, or released and sent again, meanwhile is left alone)."""
        if launched.values is not None:
            return launched.values
        if launched.host is None:
            launched.values = []
            return launched.values
        launched.clock.wait()
        values = launched.host.tolist()
        requests = self.requests
        for rid, state, token in zip(launched.sample_ids, launched.states, values, strict=True):
            # steps resolve in launch order, so this step's token is the oldest pending one
            if state.pending and state.pending[0][0] is launched:
                del state.pending[0]
                if requests.get(rid) is state:
                    state.token_ids.append(token)
        if launched in self._uncollected:  # (not after a new KV cache forgot every step)
            self._uncollected.remove(launched)
        launched.values = values
        return values

    def _host_batch(self, order: list[tuple[str, int]], sample_ids: frozenset[str]) -> HostBatch:
        ids: list[int] = []
        positions: list[np.ndarray] = []
        chunks: list[SeqChunk] = []
        rows: list[int] = []
        sampled: list[str] = []
        fills: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}  # by source step: (tokens, rows, indices)
        kernels = self.attention == "triton"
        for rid, n in order:
            state = self.requests[rid]
            start = state.num_computed_tokens
            known = state.token_ids[start : start + n]
            ids.extend(known)
            if len(known) < n:
                # The last inputs are tokens steps before sampled, still on the device: by reference.
                first = start + len(known) - len(state.token_ids)
                if first < 0 or first + n - len(known) > len(state.pending):
                    # NOTE: the book counts uncollected tokens as known and checked this plan, so
                    # this is the engine's own state gone wrong (the plan is applied by now).
                    raise RuntimeError(f"request {rid!r}: inputs [{start}, {start + n}) past its tokens")
                for step, index in state.pending[first : first + n - len(known)]:
                    assert step.tokens is not None
                    fill = fills.setdefault(id(step), (step.tokens, [], []))
                    fill[1].append(len(ids))
                    fill[2].append(index)
                    ids.append(0)
            positions.append(np.arange(start, start + n, dtype=np.int64))
            chunks.append(SeqChunk(start, n, state.block_array if kernels else state.block_table))
            if rid in sample_ids:
                rows.append(len(ids) - 1)
                sampled.append(rid)
        fill = None
        if fills:
            dev = self.device
            all_rows = np.asarray([r for _, rs, _ in fills.values() for r in rs], dtype=np.int64)
            values = [src[to_device(np.asarray(idx, dtype=np.int64), dev)] for src, _, idx in fills.values()]
            fill = (to_device(all_rows, dev), values[0] if len(values) == 1 else torch.cat(values))
        return HostBatch(np.asarray(ids, dtype=np.int64), np.concatenate(positions), chunks, rows, sampled, fill)

    def _forward(self, batch: HostBatch) -> torch.Tensor:
        block_size = self.config.block_size
        graphs = self.graphs
        if graphs is not None and len(batch.chunks) <= graphs.max_batch and len(batch.input_ids) == len(batch.chunks):
            tables, lens, slots = decode_columns(batch.chunks, block_size)
            return graphs.run(batch.input_ids, batch.positions, slots, tables, lens, batch.fill)
        attn: Attention
        if self.attention == "triton":
            meta = build_kernel_metadata(batch.chunks, block_size, self.device, self.spec.num_kv_heads)
            attn = KernelPagedAttention(self._cache, meta)
        else:
            attn = PagedAttention(self._cache, build_metadata(batch.chunks, block_size, self.device))
        input_ids = to_device(batch.input_ids, self.device)
        if batch.fill is not None:
            input_ids[batch.fill[0]] = batch.fill[1]
        return self.model(input_ids, to_device(batch.positions, self.device), attn)

    def _sampling_row(self, rid: str) -> SamplingRow:
        s = self.requests[rid]
        return SamplingRow(s.sampling, s.token_ids, s.num_output_tokens, s.generator)

    def _attention_backend(self, requested: str) -> str:
        if requested not in ("auto", "torch", "triton"):
            raise ValueError(f"unknown attention {requested!r}; use auto, torch, triton")
        cuda = self.device.type == "cuda"
        if requested == "triton" and not (cuda and paged_kernels.available()):
            raise ValueError("attention 'triton' needs a CUDA device and Triton")
        if requested == "auto":
            return "triton" if cuda and paged_kernels.available() else "torch"
        return requested

    # -- setup -------------------------------------------------------------------------------

    def _max_model_len(self, requested: int | None) -> int:
        limit = self.model_config.max_position_embeddings
        if requested is None:
            return limit
        if not 0 < requested <= limit:
            raise ValueError(f"max_model_len {requested} must be in [1, {limit}] for {self.config.model}")
        return requested

    def _load_tokenizer(self) -> Tokenizer:
        if self.config.tokenizer is None and is_preset(self.config.model):
            return Tokenizer.demo()
        return Tokenizer.for_model(self.config.model, self.config.tokenizer, self.model_config.eos_token_ids)

    def _device_memory_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.get_device_properties(self.device).total_memory
        return _meminfo_bytes("MemAvailable")

    @torch.inference_mode()
    def _probe_activation_bytes(self, num_tokens: int) -> int:
        """Runs a forward pass over `num_tokens` tokens (cut into sequences of at most
        PROBE_SEQ_LEN) and returns its peak activation memory."""
        seq_lens = [min(PROBE_SEQ_LEN, num_tokens - s) for s in range(0, num_tokens, PROBE_SEQ_LEN)]
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in seq_lens])
        with self._peak_memory() as peak:
            hidden = self.model(ids, positions, DenseAttention(seq_lens))
            self.model.compute_logits(hidden[-len(seq_lens) :])
        return peak[0] if peak else self._estimate_activation_bytes(num_tokens)

    @contextmanager
    def _peak_memory(self) -> Iterator[list[int]]:
        """Yields a list that holds the peak bytes allocated inside the block (CUDA only)."""
        result: list[int] = []
        if self.device.type != "cuda":
            yield result
            return
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        yield result
        torch.cuda.synchronize(self.device)
        result.append(torch.cuda.max_memory_allocated(self.device) - base)

    def _estimate_activation_bytes(self, num_tokens: int) -> int:
        # NOTE: CPU has no allocator statistics; count the widest tensors a layer holds at
        # once (hidden and residual, fused qkv, the doubled MLP input) per token.
        c = self.model_config
        per_token = 2 * c.hidden_size + c.q_size + 2 * c.kv_size + 3 * c.intermediate_size
        return num_tokens * per_token * torch.finfo(self.dtype).bits // 8


def _meminfo_bytes(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name == key:
            return int(rest.split()[0]) * 1024
    raise KeyError(f"{key} not in /proc/meminfo")
