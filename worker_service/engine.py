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

import torch

from kvstore.paged import KVCacheSpec, PagedAttention, PagedKVCache, SeqChunk, build_metadata
from scheduler_service.core.plan import KVMove, KVMoveKind, NewRequestData, StepPlan, StepResult
from scheduler_service.core.sampling import SamplingParams
from worker_service.model import DenseAttention, load_model, resolve_config, resolve_dtype
from worker_service.model.dummy import is_preset
from worker_service.plan_check import PlanBook, StepPlanError
from worker_service.sampler import Sampler, SamplingRow
from worker_service.tokenizer import Tokenizer

# Longest single sequence in the activation probe: keeps its attention matrix realistic.
PROBE_SEQ_LEN = 512


@dataclass
class EngineConfig:
    model: str = "tiny-llama"  # dummy preset name, or a local directory with config.json (+ safetensors)
    load_format: str = "auto"  # "auto" (safetensors if the directory has them), "dummy", "safetensors"
    dtype: str = "auto"  # auto = float32 on cpu, bfloat16 on cuda; or float32/float16/bfloat16
    device: str = "cpu"  # "cpu" or "cuda" / "cuda:N"
    block_size: int = 16
    seed: int = 0  # dummy-weight seed (and the seed of unseeded sampling)
    max_model_len: int | None = None  # default from config.json / preset
    tokenizer: str | None = None  # tokenizer.json; default: the model dir's, else the demo MiniLM one


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


@dataclass(frozen=True)
class KVCapacity:
    num_gpu_blocks: int
    num_cpu_blocks: int
    bytes_per_block: int
    peak_activation_bytes: int


@dataclass
class RequestState:
    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    num_output_tokens: int
    sampling: SamplingParams
    block_table: list[int] = field(default_factory=list)
    cpu_block_ids: list[int] = field(default_factory=list)  # where its KV sits while swapped out
    generator: torch.Generator | None = None


class LLMEngine:
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
        self.cache: PagedKVCache | None = None
        self.requests: dict[str, RequestState] = {}
        self.book = PlanBook(config.block_size, self.max_model_len, self.model_config.vocab_size)

    # -- public API ----------------------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        c = self.model_config
        return EngineInfo(
            model=self.config.model,
            family=c.family,
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            block_size=self.config.block_size,
            max_model_len=self.max_model_len,
            vocab_size=c.vocab_size,
            eos_token_ids=tuple(self.eos_token_ids),
            num_layers=c.num_layers,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            bytes_per_block=self.spec.bytes_per_block,
        )

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
        self.cache = None
        self.requests.clear()
        self.cache = PagedKVCache(self.spec, num_gpu_blocks, num_cpu_blocks, self.device)
        self.book.reset(num_gpu_blocks, num_cpu_blocks)

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
        t_start = time.perf_counter()
        if self.cache is None and (plan.num_scheduled_tokens or plan.kv_moves or plan.new_requests):
            raise StepPlanError("the KV cache is not initialised (run Warmup first)", code="FAILED_PRECONDITION")
        staged = self.book.check(plan)
        self.release(plan.release_ids)
        self._admit(plan.new_requests)
        swap_s, swap_bytes = self._apply_moves(plan.kv_moves)
        self.book.commit(staged)
        for rid, entry in staged.states.items():
            self.requests[rid].block_table = list(entry.gpu)
            self.requests[rid].cpu_block_ids = list(entry.cpu)
        t_prepare = time.perf_counter()
        sampled, forward_s, prep2_s, sample_s = self._run_batch(plan)
        self.book.advance(plan, sampled)
        total_s = self._sync_time() - t_start
        if plan.kv_moves and self.device.type == "cuda":
            # NOTE: host time only issues the copies; the blocking part is the GPU time
            # between the swap stream's start and its ready event (known after the sync).
            swap_s = self._cache.last_swap_seconds()
        return StepResult(
            step_id=plan.step_id,
            sampled_token_ids=sampled,
            total_s=total_s,
            forward_s=forward_s,
            swap_s=swap_s,
            sample_s=sample_s,
            prepare_s=max(0.0, t_prepare - t_start - swap_s) + prep2_s,
            swap_bytes=swap_bytes,
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

    def _apply_moves(self, moves: Iterable[KVMove]) -> tuple[float, int]:
        moves = list(moves)
        if not moves:
            return 0.0, 0
        start, moved, cache = time.perf_counter(), 0, self._cache
        with cache.swapping():
            for m in moves:
                if m.kind is KVMoveKind.SWAP_OUT:
                    moved += cache.swap_out(m.src_block_ids, m.dst_block_ids, m.int8)
                elif m.kind is KVMoveKind.SWAP_IN:
                    moved += cache.swap_in(m.src_block_ids, m.dst_block_ids)
                else:
                    moved += cache.copy(m.src_block_ids, m.dst_block_ids)
        return time.perf_counter() - start, moved

    def _run_batch(self, plan: StepPlan) -> tuple[dict[str, int], float, float, float]:
        """Forward over every scheduled token, then sampling; returns (tokens, forward_s,
        prepare_s, sample_s)."""
        if not plan.num_scheduled_tokens:
            return {}, 0.0, 0.0, 0.0
        t0 = time.perf_counter()
        order = list(plan.num_scheduled_tokens.items())
        input_ids, positions, attn, sample_rows, sample_ids = self._prepare_inputs(order, plan.sample_ids)
        t1 = self._sync_time()
        hidden = self.model(input_ids, positions, attn)
        logits = self.model.compute_logits(hidden[sample_rows]) if sample_ids else None
        t2 = self._sync_time()
        for rid, n in order:
            self.requests[rid].num_computed_tokens += n
        sampled: dict[str, int] = {}
        if logits is not None:
            tokens = self.sampler(logits, [self._sampling_row(rid) for rid in sample_ids])
            for rid, token in zip(sample_ids, tokens, strict=True):
                state = self.requests[rid]
                state.token_ids.append(token)
                state.num_output_tokens += 1
                sampled[rid] = token
        t3 = self._sync_time()
        return sampled, t2 - t1, t1 - t0, t3 - t2

    def _prepare_inputs(
        self, order: list[tuple[str, int]], sample_ids: frozenset[str]
    ) -> tuple[torch.Tensor, torch.Tensor, PagedAttention, torch.Tensor, list[str]]:
        ids: list[int] = []
        positions: list[int] = []
        chunks: list[SeqChunk] = []
        rows: list[int] = []
        sampled: list[str] = []
        for rid, n in order:
            state = self.requests[rid]
            start = state.num_computed_tokens
            ids.extend(state.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            chunks.append(SeqChunk(start, n, state.block_table))
            if rid in sample_ids:
                rows.append(len(ids) - 1)
                sampled.append(rid)
        metadata = build_metadata(chunks, self.config.block_size, self.device)

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        return tensor(ids), tensor(positions), PagedAttention(self._cache, metadata), tensor(rows), sampled

    def _sampling_row(self, rid: str) -> SamplingRow:
        s = self.requests[rid]
        return SamplingRow(s.sampling, s.token_ids, s.num_output_tokens, s.generator)

    def _sync_time(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

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
