"""CUDA paths: swaps on their own stream with pinned host memory, int8 on the device, and
greedy parity of the paged engine against the dense reference (fp32 on the GPU)."""

from __future__ import annotations

import pytest
import torch
from worker_harness import MiniScheduler, budget_schedule, dense_greedy, random_prompt

from kvstore.paged import KVCacheSpec, PagedKVCache
from worker_service.engine import EngineConfig, LLMEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_swap_round_trip_on_the_swap_stream_is_exact_and_overlaps_nothing_unsafe() -> None:
    spec = KVCacheSpec(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16, dtype=torch.bfloat16)
    cache = PagedKVCache(spec, 16, 16, torch.device("cuda"))
    assert cache.cpu.is_pinned()
    cache.kv.normal_()
    before = cache.kv[:, :, [3, 4, 9]].clone()
    with cache.swapping():
        cache.swap_out([3, 4, 9], [0, 1, 5], int8=False)
    cache.kv[:, :, [3, 4, 9]] = 0  # the forward pass may reuse freed blocks at once
    with cache.swapping():
        cache.swap_in([0, 1, 5], [10, 11, 12])
    torch.cuda.synchronize()
    assert torch.equal(cache.kv[:, :, [10, 11, 12]], before)
    assert cache.last_swap_seconds() >= 0.0


def test_int8_swap_on_cuda_stays_within_half_a_step() -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=4, head_dim=64, block_size=16, dtype=torch.bfloat16)
    cache = PagedKVCache(spec, 8, 8, torch.device("cuda"))
    cache.kv.normal_()
    before = cache.kv[:, :, [1, 2]].float().clone()
    with cache.swapping():
        cache.swap_out([1, 2], [6, 7], int8=True)
        cache.swap_in([6, 7], [4, 5])
    torch.cuda.synchronize()
    span = before.amax(dim=3, keepdim=True) - before.amin(dim=3, keepdim=True)
    err = (cache.kv[:, :, [4, 5]].float() - before).abs()
    assert bool((err <= span / 510 + 2e-2).all())  # plus bf16 rounding of the dequantized value


def test_paged_engine_matches_dense_greedy_on_cuda() -> None:
    engine = LLMEngine(EngineConfig(model="tiny-llama", device="cuda", dtype="float32", block_size=4))
    engine.init_kv_cache(64, 16)
    prompts = {f"g{i}": random_prompt(5 + 6 * i, seed=70 + i) for i in range(3)}
    sched = MiniScheduler(engine)
    for rid, p in prompts.items():
        sched.add(rid, p)
    for step in range(40):
        active = [r for r in prompts if len(sched.outputs(r)) < 8]
        if not active:
            break
        sched.step(budget_schedule(sched, active, 7, (4, 3, 5), step))
    for rid, p in prompts.items():
        ref = dense_greedy(engine.model, p, 8)
        assert sched.outputs(rid)[:8] == ref
