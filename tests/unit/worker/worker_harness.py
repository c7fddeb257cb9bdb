"""Test helpers for the worker engine: a dense no-cache reference decoder, and a miniature
scheduler that fabricates StepPlans with the real KV accounting (kvstore.accounting), so the
engine sees block ids exactly as the live scheduler hands them out."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pytest
import torch

from kvstore.accounting import KVCacheManager
from sluice.contract.plan import CachedRequestData, KVMove, KVMoveKind, NewRequestData, StepPlan, StepResult
from sluice.contract.sampling import SamplingParams
from worker_service.engine import EngineConfig, LLMEngine
from worker_service.model import CausalLM, DenseAttention

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


def make_engine(
    model: str = "tiny-llama",
    num_gpu_blocks: int = 64,
    num_cpu_blocks: int = 32,
    block_size: int = 4,
    seed: int = 0,
    device: str = "cpu",
    dtype: str = "float32",
    **config: object,
) -> LLMEngine:
    config = dict(model=model, block_size=block_size, seed=seed, device=device, dtype=dtype, **config)
    engine = LLMEngine(EngineConfig(**config))  # type: ignore[arg-type]
    engine.init_kv_cache(num_gpu_blocks, num_cpu_blocks)
    return engine


def device_params(models: Sequence[str]) -> list:
    """(model, device) pytest params: every model on the CPU, and on CUDA (marked gpu, skipped without it)."""
    on_cuda = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
    return [pytest.param((m, "cpu"), id=f"{m}-cpu") for m in models] + [
        pytest.param((m, "cuda"), id=f"{m}-cuda", marks=on_cuda) for m in models
    ]


def random_prompt(n: int, seed: int, vocab: int = 30522) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1000, vocab, (n,), generator=gen).tolist()


@torch.inference_mode()
def dense_logits(model: CausalLM, tokens: Sequence[int], last_only: bool = False) -> torch.Tensor:
    """Logits of every position (or the last), recomputing the whole sequence with no KV cache."""
    ids = torch.tensor(list(tokens), device=next(model.parameters()).device)
    positions = torch.arange(len(tokens), device=ids.device)
    hidden = model(ids, positions, DenseAttention([len(tokens)]))
    return model.compute_logits(hidden[-1:] if last_only else hidden)


def dense_greedy(model: CausalLM, prompt: Sequence[int], num_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(int(dense_logits(model, tokens, last_only=True)[-1].argmax()))
    return tokens[len(prompt) :]


class MiniScheduler:
    """Owns block ids (KVCacheManager) and request progress; builds one plan per `step`."""

    def __init__(self, engine: LLMEngine) -> None:
        cache = engine.cache
        assert cache is not None
        self.engine = engine
        self.kv = KVCacheManager(cache.num_gpu_blocks, cache.num_cpu_blocks, engine.config.block_size)
        self.tokens: dict[str, list[int]] = {}
        self.num_prompt: dict[str, int] = {}
        self.computed: dict[str, int] = {}
        self.sampling: dict[str, SamplingParams] = {}
        self.on_worker: set[str] = set()
        self.resumed: set[str] = set()
        self.releases: list[str] = []
        self.moves: list[KVMove] = []
        self.step_id = 0

    def add(self, rid: str, prompt: Sequence[int], sampling: SamplingParams = GREEDY) -> None:
        self.tokens[rid], self.num_prompt[rid], self.computed[rid] = list(prompt), len(prompt), 0
        self.sampling[rid] = sampling

    def outputs(self, rid: str) -> list[int]:
        return self.tokens[rid][self.num_prompt[rid] :]

    def remaining_prefill(self, rid: str) -> int:
        return len(self.tokens[rid]) - self.computed[rid]

    def swap_out(self, rid: str, int8: bool = False) -> None:
        pairs = self.kv.swap_out(rid)
        assert pairs
        gpu, cpu = zip(*pairs, strict=True)
        self.moves.append(KVMove(KVMoveKind.SWAP_OUT, rid, tuple(gpu), tuple(cpu), int8))

    def swap_in(self, rid: str) -> None:
        pairs = self.kv.swap_in(rid)
        assert pairs
        cpu, gpu = zip(*pairs, strict=True)
        self.moves.append(KVMove(KVMoveKind.SWAP_IN, rid, tuple(cpu), tuple(gpu)))
        self.resumed.add(rid)

    def preempt_recompute(self, rid: str) -> None:
        self.kv.free(rid)
        self.computed[rid] = 0
        self.on_worker.discard(rid)
        self.releases.append(rid)

    def finish(self, rid: str) -> None:
        self.kv.free(rid)
        self.on_worker.discard(rid)
        self.releases.append(rid)

    def build(self, schedule: dict[str, int]) -> StepPlan:
        """The plan for `schedule` (request id -> tokens this step); allocates blocks."""
        new: list[NewRequestData] = []
        cached: dict[str, tuple[tuple[int, ...], bool]] = {}
        for rid, n in schedule.items():
            added = self.kv.allocate(rid, self.computed[rid] + n)
            assert added is not None, "test pool too small"
            if rid not in self.on_worker:
                new.append(self._new_request(rid))
            elif rid not in self.resumed:
                cached[rid] = (tuple(added), False)
        for rid in self.resumed:
            cached[rid] = (tuple(self.kv.gpu_tables[rid]), True)
        sample = frozenset(rid for rid, n in schedule.items() if self.computed[rid] + n == len(self.tokens[rid]))
        plan = StepPlan(
            step_id=self.step_id,
            worker_id=0,
            new_requests=tuple(new),
            cached_requests=CachedRequestData(
                request_ids=tuple(cached),
                new_block_ids=tuple(b for b, _ in cached.values()),
                resumed=tuple(r for _, r in cached.values()),
                num_computed_tokens=tuple(self.computed[rid] for rid in cached),
            ),
            num_scheduled_tokens=dict(schedule),
            sample_ids=sample,
            release_ids=tuple(self.releases),
            kv_moves=tuple(self.moves),
        )
        return plan

    def step(self, schedule: dict[str, int]) -> StepResult:
        plan = self.build(schedule)
        result = self.engine.execute(plan)
        self.commit(plan, result)
        return result

    def commit(self, plan: StepPlan, result: StepResult) -> None:
        self.releases, self.moves, self.resumed = [], [], set()
        self.step_id += 1
        for rid, n in plan.num_scheduled_tokens.items():
            self.on_worker.add(rid)
            self.computed[rid] += n
        for rid, token in result.sampled_token_ids.items():
            self.tokens[rid].append(token)

    def _new_request(self, rid: str) -> NewRequestData:
        tokens = tuple(self.tokens[rid])
        return NewRequestData(
            request_id=rid,
            prompt_token_ids=tokens,
            num_tokens=len(tokens),
            sampling=self.sampling[rid],
            block_ids=tuple(self.kv.gpu_tables[rid]),
            num_computed_tokens=self.computed[rid],
            num_output_tokens=len(tokens) - self.num_prompt[rid],
        )


def budget_schedule(
    sched: MiniScheduler, active: Iterable[str], budget: int, chunk_sizes: Sequence[int], step: int
) -> dict[str, int]:
    """Sarathi-style: decodes first (1 token each), then prefill chunks of varying sizes."""
    out: dict[str, int] = {}
    pending = []
    for rid in active:
        if sched.remaining_prefill(rid) == 1 and sched.computed[rid] > 0:
            out[rid] = 1
        else:
            pending.append(rid)
    left = budget - len(out)
    for i, rid in enumerate(pending):
        n = min(sched.remaining_prefill(rid), left, chunk_sizes[(step + i) % len(chunk_sizes)])
        if n > 0:
            out[rid] = n
            left -= n
    return out


def int8_swap_round_trip(engine: LLMEngine, bound_slack: float) -> tuple[float, int, int]:
    """Three prompts prefilled, swapped out as int8 and back in, then decoded greedily.

    Asserts every dequantized KV value is within lambda / 2 of the original (plus
    `bound_slack` for the cache dtype's rounding) and that the step reported the int8 bytes;
    returns (max |dequantized - original| over real tokens, greedy tokens equal to the exact
    reference, tokens compared)."""
    cache = engine.cache
    assert cache is not None
    prompts = {f"q{i}": random_prompt(20 + 7 * i, seed=40 + i) for i in range(3)}
    sched = MiniScheduler(engine)
    for rid, p in prompts.items():
        sched.add(rid, p)
    sched.step({rid: len(p) for rid, p in prompts.items()})
    tables = {rid: list(sched.kv.gpu_tables[rid]) for rid in prompts}
    before = {rid: cache.kv[:, :, tables[rid]].float().clone() for rid in prompts}
    for rid in prompts:
        sched.swap_out(rid, int8=True)
    result = sched.step({})
    assert result.swap_bytes == sum(len(t) for t in tables.values()) * engine.spec.int8_bytes_per_block
    for rid in prompts:
        sched.swap_in(rid)
    sched.step({})
    max_err = 0.0
    for rid, p in prompts.items():
        after = cache.kv[:, :, sched.kv.gpu_tables[rid]].float()
        span = before[rid].amax(dim=3, keepdim=True) - before[rid].amin(dim=3, keepdim=True)
        err = (after - before[rid]).abs()
        assert bool((err <= span / 510 + bound_slack).all())
        tokens = err.reshape(err.shape[0], 2, -1, *err.shape[-2:])[:, :, : len(p)]  # slots holding real tokens
        max_err = max(max_err, float(tokens.max()))
    while any(len(sched.outputs(r)) < 8 for r in prompts):
        sched.step({r: 1 for r in prompts})
    agree = [
        a == b
        for rid, p in prompts.items()
        for a, b in zip(sched.outputs(rid)[:8], dense_greedy(engine.model, p, 8), strict=True)
    ]
    return max_err, sum(agree), len(agree)
