"""The Triton paged-attention kernels against attention recomputed in float64 on gathered KV:
random block tables (shuffled, so no sequence's blocks are contiguous), contexts that end
mid-page, grouped and plain multi-head attention, float32 / bfloat16 / float16 caches,
decode rows scattered in the batch, and prefill chunks over a cached prefix."""

from __future__ import annotations

import pytest
import torch

from kvstore import paged_kernels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not paged_kernels.available(), reason="needs a CUDA device and Triton"),
]

PAGE = 16
# Relative error bounds (||out - ref|| / ||ref||): fp32 FMAs, then 16-bit inputs (METHOD: 1e-3..1e-2).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def random_cache(num_blocks: int, heads: int, dim: int, dtype: torch.dtype, device: str, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (num_blocks, PAGE, heads, dim)
    k = torch.randn(shape, generator=gen, device=device).to(dtype)
    v = torch.randn(shape, generator=gen, device=device).to(dtype)
    return k, v


def random_tables(contexts: list[int], num_blocks: int, seed: int) -> list[list[int]]:
    """Disjoint, shuffled block ids for each context."""
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, start = [], 0
    for ctx in contexts:
        n = -(-ctx // PAGE)
        tables.append(order[start : start + n])
        start += n
    return tables


def padded(tables: list[list[int]], device: str) -> torch.Tensor:
    width = max(len(t) for t in tables)
    rows = [t + [0] * (width - len(t)) for t in tables]
    return torch.tensor(rows, dtype=torch.int32, device=device)


def reference(q: torch.Tensor, k_cache, v_cache, table: list[int], positions: range) -> torch.Tensor:
    """float64 attention of q [n, Hq, D] (at absolute `positions`) over the table's first keys."""
    ctx = positions[-1] + 1
    keys = k_cache[table].reshape(-1, *k_cache.shape[2:])[:ctx].double()
    values = v_cache[table].reshape(-1, *v_cache.shape[2:])[:ctx].double()
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) / q.shape[-1] ** 0.5
    allowed = torch.arange(ctx, device=q.device)[None, :] <= torch.tensor(list(positions), device=q.device)[:, None]
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(8, 2, 128), (4, 4, 64)])
def test_decode_kernel_matches_float64_attention(dtype, heads, kv_heads, dim, device: str = "cuda") -> None:
    contexts = [1, 15, 16, 17, 300, 1100, 2500]
    k_cache, v_cache = random_cache(512, kv_heads, dim, dtype, device, seed=1)
    tables = random_tables(contexts, 512, seed=2)
    # Decode rows sit among other rows of the step (e.g. after a prefill chunk).
    rows = torch.tensor([3 + 2 * i for i in range(len(contexts))], dtype=torch.int32, device=device)
    q = torch.randn(3 + 2 * len(contexts), heads, dim, device=device).to(dtype)
    out = torch.full_like(q, float("nan"))
    lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    launch = paged_kernels.decode_launch(padded(tables, device), lens, rows, max(contexts), kv_heads)
    paged_kernels.paged_decode(q, k_cache, v_cache, launch, out)
    for i, ctx in enumerate(contexts):
        row = int(rows[i])
        ref = reference(q[row : row + 1], k_cache, v_cache, tables[i], range(ctx - 1, ctx))
        assert rel_error(out[row : row + 1], ref) < TOLERANCE[dtype], (ctx, rel_error(out[row : row + 1], ref))
    untouched = torch.ones(len(q), dtype=torch.bool, device=device)
    untouched[rows.long()] = False
    assert bool(out[untouched].isnan().all()), "the kernel wrote rows it does not own"


@pytest.mark.parametrize("split", [256, 2048])
def test_decode_kernel_is_right_for_any_split(split: int, device: str = "cuda") -> None:
    """A CUDA graph fixes the split per batch size; every split gives the same answer."""
    contexts = [700, 3000, 5, 9000]  # 9000 tokens: 36 partials at split 256, several merge rounds
    k_cache, v_cache = random_cache(1000, 2, 128, torch.float16, device, seed=3)
    tables = random_tables(contexts, 1000, seed=4)
    q = torch.randn(len(contexts), 8, 128, device=device).to(torch.float16)
    out = torch.empty_like(q)
    lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    launch = paged_kernels.DecodeLaunch(padded(tables, device), lens, None, max(contexts), split)
    paged_kernels.paged_decode(q, k_cache, v_cache, launch, out)
    for i, ctx in enumerate(contexts):
        ref = reference(q[i : i + 1], k_cache, v_cache, tables[i], range(ctx - 1, ctx))
        assert rel_error(out[i : i + 1], ref) < TOLERANCE[torch.float16]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(8, 2, 128), (4, 4, 64)])
def test_prefill_kernel_over_a_cached_prefix_matches_float64(dtype, heads, kv_heads, dim, device: str = "cuda") -> None:
    # (cached prefix, chunk): no prefix, prefixes ending mid-page, a chunk shorter than a tile, a long one
    chunks = [(0, 37), (5, 64), (200, 3), (1000, 300), (16, 129)]
    contexts = [p + n for p, n in chunks]
    k_cache, v_cache = random_cache(512, kv_heads, dim, dtype, device, seed=5)
    tables = random_tables(contexts, 512, seed=6)
    total = sum(n for _, n in chunks)
    q = torch.randn(total + 2, heads, dim, device=device).to(dtype)  # two rows belong to decodes
    out = torch.full_like(q, float("nan"))
    rows = [2 + sum(n for _, n in chunks[:i]) for i in range(len(chunks))]
    launch = paged_kernels.prefill_launch(
        [(row, prefix, n) for row, (prefix, n) in zip(rows, chunks, strict=True)], padded(tables, device)
    )
    paged_kernels.paged_prefill(q, k_cache, v_cache, launch, out)
    for row, (prefix, n), table in zip(rows, chunks, tables, strict=True):
        ref = reference(q[row : row + n], k_cache, v_cache, table, range(prefix, prefix + n))
        err = rel_error(out[row : row + n], ref)
        assert err < TOLERANCE[dtype], (prefix, n, err)
    assert bool(out[:2].isnan().all()), "the kernel wrote rows it does not own"
