"""The physical KV cache: ALISE int8 quantization error bound, swap round trips (fp32
exact, int8 within lambda / 2 per channel), bytes moved, and int8 swaps inside the engine."""

from __future__ import annotations

import pytest
import torch
from worker_harness import int8_swap_round_trip, make_engine

from kvstore.paged import KVCacheSpec, PagedKVCache, dequantize_int8, quantize_int8

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype=torch.float32)


def filled_cache(spec: KVCacheSpec = SPEC, num_gpu: int = 8, num_cpu: int = 8) -> PagedKVCache:
    cache = PagedKVCache(spec, num_gpu, num_cpu, torch.device("cpu"))
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(0)).to(spec.dtype) * 3)
    return cache


def test_int8_round_trip_error_is_at_most_half_a_step_per_channel() -> None:
    x = torch.randn(5, 16, 4, 8, generator=torch.Generator().manual_seed(1)) * 4 + 1.5
    codes, lam, z = quantize_int8(x, dim=1)
    assert codes.dtype == torch.uint8
    err = (dequantize_int8(codes, lam, z, torch.float32) - x).abs()
    assert bool((err <= lam / 2 + 1e-6).all())
    assert lam.shape == (5, 1, 4, 8)  # one scale per channel, shared by the block's tokens


@pytest.mark.parametrize("value", [0.0, 2.5, -7.25])
def test_int8_encodes_a_constant_channel_exactly(value: float) -> None:
    x = torch.full((16, 3), value)
    codes, lam, z = quantize_int8(x, dim=0)
    assert torch.allclose(dequantize_int8(codes, lam, z, torch.float32), x, atol=1e-6)


def test_fp32_swap_round_trip_is_bit_exact_and_counts_bytes() -> None:
    cache = filled_cache()
    before = cache.kv[:, :, [1, 4, 5]].clone()
    assert cache.swap_out([1, 4, 5], [6, 2, 3], int8=False) == 3 * SPEC.bytes_per_block
    cache.kv.zero_()
    assert cache.swap_in([6, 2, 3], [0, 7, 2]) == 3 * SPEC.bytes_per_block
    assert torch.equal(cache.kv[:, :, [0, 7, 2]], before)


def test_int8_swap_round_trip_is_within_the_bound_and_moves_fewer_bytes() -> None:
    cache = filled_cache()
    before = cache.kv[:, :, [2, 3]].clone()
    moved = cache.swap_out([2, 3], [0, 1], int8=True)
    assert moved == 2 * SPEC.int8_bytes_per_block < 2 * SPEC.bytes_per_block
    assert cache.swap_in([0, 1], [5, 6]) == moved
    after = cache.kv[:, :, [5, 6]]
    span = before.amax(dim=3, keepdim=True) - before.amin(dim=3, keepdim=True)  # per (layer, K/V, block, head, dim)
    assert bool(((after - before).abs() <= span / 255 / 2 + 1e-5).all())


def test_copy_duplicates_gpu_blocks() -> None:
    cache = filled_cache()
    cache.copy([0, 1], [6, 7])
    assert torch.equal(cache.kv[:, :, [6, 7]], cache.kv[:, :, [0, 1]])


def test_int8_needs_room_in_a_16_bit_block() -> None:
    assert KVCacheSpec(2, 2, 8, 16, torch.bfloat16).supports_int8
    assert not KVCacheSpec(2, 2, 8, 4, torch.bfloat16).supports_int8


def test_engine_int8_swap_keeps_kv_close_and_tokens_mostly_equal() -> None:
    """Measured on tiny-llama: dequantized KV within lambda / 2 per channel; greedy tokens
    after an int8 round trip agree with the exact reference on at least 75% of positions."""
    engine = make_engine("tiny-llama", num_gpu_blocks=32, num_cpu_blocks=32, block_size=16)
    max_err, agree, total = int8_swap_round_trip(engine, bound_slack=1e-5)
    print(f"int8 swap: max |dequantized KV - KV| = {max_err:.4f}; greedy token agreement {agree}/{total}")
    assert max_err < 0.05, f"max |dequantized KV - KV| = {max_err}"
    assert agree / total >= 0.75, f"token agreement after int8 swap: {agree}/{total}"
