"""SCLS's two estimators (seed 002, sections 4.2 and 4.3): how long a static batch's slice
takes, and whether its KV fits.

Why: slicing the generation into S-token pieces makes a batch's serving time and memory
predictable, which is what the adaptive batcher and the max-min offloader feed on.

Serving time (Eq. 1 to 4), N rows padded to the batch input length L, S iterations:

    T_serve(N, L, S) = T_prefill(N, L) + sum_{l=1..S} tau(L + l, N)
    T_prefill(N, L)  = p1*N*L + p2*N + p3*L + p4
    tau(l, N)        = d1*N*l + d2*N + d3*l + d4

The sum has a closed form (`serve_time`), so one estimate is O(1) and a numpy vector of
group sizes costs one expression (the batcher's inner loop). The p's and d's are
least-squares fits (numpy lstsq) to latencies the cost model prices for padded static
batches (`fit_from_cost_model`), the simulator's stand-in for the paper's profiling of
a worker; `fit` takes any measured samples (a worker profile).

Memory (Eq. 5, 7, 9): `M_kv = (L + S) * N * Delta <= zeta * M_ava`. Delta cancels when
both sides are counted in tokens; the padded row length is rounded up to whole KV
blocks because a paged engine allocates blocks, so a batch the check admits always gets
its blocks (NOTE: the paper counts bytes of a contiguous cache; rounding only makes the
check stricter by less than one block per row).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from scheduler_service.costmodel.base import CostModel
from sluice.contract.profile import BatchShape

_FIT_BATCHES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
_FIT_LENGTHS = (16, 64, 128, 256, 512, 768, 1024, 1536, 2048)


def _design(n: np.ndarray, length: np.ndarray) -> np.ndarray:
    return np.stack([n * length, n, length, np.ones_like(n)], axis=1)


@dataclass(frozen=True, slots=True)
class ServingTimeEstimator:
    """T_serve of a static batch; p = (p1..p4) for the prefill, d = (d1..d4) per decode."""

    p: tuple[float, float, float, float]
    d: tuple[float, float, float, float]

    def prefill_time(self, n: float, length: float) -> float:
        p1, p2, p3, p4 = self.p
        return p1 * n * length + p2 * n + p3 * length + p4

    def decode_time(self, context: float, n: float) -> float:
        d1, d2, d3, d4 = self.d
        return d1 * n * context + d2 * n + d3 * context + d4

    def serve_time(self, n: float | np.ndarray, length: float, slice_len: int) -> float | np.ndarray:
        """T_serve(N, L, S); `n` may be a numpy array of batch sizes."""
        d1, d2, d3, d4 = self.d
        s = float(slice_len)
        context_sum = s * length + s * (s + 1) / 2  # sum over l = 1..S of (L + l)
        decode = d1 * n * context_sum + d2 * n * s + d3 * context_sum + d4 * s
        p1, p2, p3, p4 = self.p
        return p1 * n * length + p2 * n + p3 * length + p4 + decode

    def serve_time_varlen(
        self, n: float | np.ndarray, length_sum: float | np.ndarray, longest: float, slice_len: int
    ) -> float | np.ndarray:
        """T_serve of a batch whose rows are not padded (ours, an engine with variable-length
        attention): the per-row terms N x L of Eq. 3 and 4 become the sum of the rows' own
        lengths, the per-batch length terms stay at the longest row. Equals `serve_time` when
        every row is `longest` long; `n` and `length_sum` may be numpy arrays."""
        d1, d2, d3, d4 = self.d
        s = float(slice_len)
        steps = s * (s + 1) / 2  # sum over l = 1..S of l
        decode = d1 * (s * length_sum + n * steps) + d2 * n * s + d3 * (s * longest + steps) + d4 * s
        p1, p2, p3, p4 = self.p
        return p1 * length_sum + p2 * n + p3 * longest + p4 + decode

    @classmethod
    def fit(
        cls,
        prefill: Sequence[tuple[int, int, float]],
        decode: Sequence[tuple[int, int, float]],
    ) -> ServingTimeEstimator:
        """Least squares over (N, L, seconds) prefill samples and (N, context, seconds) decode samples."""
        return cls(_lstsq(prefill), _lstsq(decode))

    @classmethod
    def fit_from_cost_model(
        cls, cost_model: CostModel, max_len: int = 2048, max_batch: int = 64
    ) -> ServingTimeEstimator:
        """Fits to the cost model's price of padded prefills and decodes over a grid of batch
        sizes and lengths up to `max_len` tokens and `max_batch` rows. `max_batch` must be the
        largest batch the batcher forms: a fit over smaller batches under-prices the large
        ones (-21% to -28% at 256 rows when fitted up to 64), and the DP then favours them."""
        batches = [b for b in _FIT_BATCHES if b <= max_batch] or [1]
        lengths = [x for x in _FIT_LENGTHS if x <= max_len] or [max_len]
        prefill, decode = [], []
        for n in batches:
            for length in lengths:
                prefill.append((n, length, cost_model.iteration_time(BatchShape(prefill_chunks=[(length, 0)] * n))))
                decode.append((n, length, cost_model.decode_time(n, length)))
        return cls.fit(prefill, decode)


def _lstsq(samples: Sequence[tuple[int, int, float]]) -> tuple[float, float, float, float]:
    if len(samples) < 4:
        raise ValueError(f"fitting 4 coefficients needs at least 4 samples, got {len(samples)}")
    a = np.asarray(samples, dtype=np.float64)
    coef, *_ = np.linalg.lstsq(_design(a[:, 0], a[:, 1]), a[:, 2], rcond=None)
    return (float(coef[0]), float(coef[1]), float(coef[2]), float(coef[3]))


def deepspeed_max_rows(length: int, slice_len: int) -> int:
    """The paper's Algorithm 2 (DeepSpeed-Inference OOM judgment, profiled on an A100 80GB
    with Llama-2-13B): at most 12 rows when L + S > 1,024, 22 when > 512, else 28."""
    total = length + slice_len
    if total > 1024:
        return 12
    if total > 512:
        return 22
    return 28


@dataclass(frozen=True, slots=True)
class MemoryEstimator:
    """The OOM check of Eq. 9 in tokens: N rows of (L + S) tokens, rounded up to blocks,
    within zeta of the worker's KV capacity. `deepspeed`: the rows are also capped by the
    paper's DeepSpeed rule (its Algorithm 2), which is what the paper's DS-SCLS ran with."""

    capacity_tokens: int  # M_ava / Delta: the worker's KV cache in tokens
    block_size: int = 16
    zeta: float = 0.9
    deepspeed: bool = False

    def row_tokens(self, length: int, slice_len: int) -> int:
        bs = self.block_size
        return -(-(length + slice_len) // bs) * bs

    def row_tokens_array(self, lengths: np.ndarray, slice_len: int) -> np.ndarray:
        bs = self.block_size
        return -(-(lengths + slice_len) // bs) * bs

    @property
    def limit_tokens(self) -> float:
        """zeta x the capacity: the most KV tokens one batch may plan to use."""
        return self.zeta * self.capacity_tokens

    def max_batch(self, length: int, slice_len: int) -> int:
        """N_max of Eq. 8 (0 when even one row does not fit), within the DeepSpeed rule if set."""
        n = int(self.zeta * self.capacity_tokens) // self.row_tokens(length, slice_len)
        return min(n, deepspeed_max_rows(length, slice_len)) if self.deepspeed else n

    def fits(self, n: int, length: int, slice_len: int) -> bool:
        if self.deepspeed and n > deepspeed_max_rows(length, slice_len):
            return False
        return n * self.row_tokens(length, slice_len) <= self.zeta * self.capacity_tokens
