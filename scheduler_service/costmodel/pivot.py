"""Pivot forward size (AccelGen, section 4.2): where a cost model's throughput saturates.

Data flow: for forward sizes S = step, 2 step, ..., max_tokens the cost model prices a batch
of S prefill tokens; throughput is S / iteration_time. The pivot S_pf is the smallest S whose
throughput is at least `threshold` (95%) of the maximum over the grid, and T_pf its
iteration time. AccelGen's token budget is then `S_b = S_pf x SLO_min / T_pf` (Eq. 6).

The probe batch is S tokens split into prompt chunks of at most `seq_len` tokens with no cached
prefix: forward size is what the linear layers see, and fixed-length chunks keep the
attention share per token constant, so the curve measures GEMM saturation and fixed costs
rather than the quadratic growth of one ever-longer prompt.
"""

from __future__ import annotations

from scheduler_service.costmodel.base import CostModel
from sluice.contract.profile import BatchShape


def probe_shape(num_tokens: int, seq_len: int = 512) -> BatchShape:
    """A prefill-only batch of `num_tokens` tokens in chunks of at most `seq_len`."""
    full, rest = divmod(num_tokens, seq_len)
    chunks = [(seq_len, 0)] * full + ([(rest, 0)] if rest else [])
    return BatchShape(prefill_chunks=chunks)


def throughput_curve(
    cost_model: CostModel, max_tokens: int = 8192, step: int = 16, seq_len: int = 512
) -> list[tuple[int, float, float]]:
    """(forward size, iteration seconds, tokens/s) for S = step .. max_tokens."""
    curve = []
    for size in range(step, max_tokens + 1, step):
        seconds = cost_model.iteration_time(probe_shape(size, seq_len))
        curve.append((size, seconds, size / seconds))
    return curve


def pivot_forward_size(
    cost_model: CostModel, max_tokens: int = 8192, threshold: float = 0.95, step: int = 16, seq_len: int = 512
) -> tuple[int, float]:
    """(S_pf, T_pf): the smallest forward size reaching `threshold` of the peak throughput."""
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    curve = throughput_curve(cost_model, max_tokens, step, seq_len)
    if not curve:
        raise ValueError(f"max_tokens ({max_tokens}) must be at least step ({step})")
    best = max(tps for _, _, tps in curve)
    return next((size, seconds) for size, seconds, tps in curve if tps >= threshold * best)
