"""Operator-profile cost model ("profile"): Vidur's measured GPU kernel times, looked up per batch.

Data flow (construction, once): `profiles/vidur/...` CSVs (found by `sluice.common.paths`, plain or
gzipped) -> per-operator medians ->
lookup tables in seconds for the whole model (layers x per-layer time). Per call
(`iteration_time`): a handful of table reads, no numpy, a few microseconds.

The pricing follows Vidur's "anchor" method (Agrawal et al., MLSys 2024, section 4; restated in
`profiles/README.md`, "How Vidur turns these into an iteration time"), with lookup plus linear
interpolation where Vidur fits random forests:

    non-attention  sum of the mlp.csv operators (norms, QKV, rope, output projection, MLP,
                   residual add; not the embedding) at the batch's total tokens rounded up to 8,
                   interpolated between measured token counts, x layers
    decode attn    legacy A100 attention.csv at (decode batch size, mean context rounded up to 64)
    prefill attn   all chunks merged into one: chunk sqrt(sum c^2), prefix sum of prefixes
                   (each rounded up to 64); measured grid where measured, a least-squares fit
                   `a + b c + d c^2 + e c p + f p` of the same file beyond it
    GQA            +10% on each attention kind when more than one request uses it (as Vidur)
    all-reduce     TP > 1: two per layer of tokens x hidden x 2 bytes from
                   network/<gpu>_dgx/all_reduce.csv, each + 0.02 ms launch (as Vidur)
    LM head        not in the profiles: priced with the analytic roofline (analytic.py)
    overhead       the profiles are kernel time only; the same fixed per-step overhead as
                   the analytic model is added, so the two kinds price the same things
    swaps          bytes / PCIe bandwidth (base class)

Approximations we add (not upstream's), all explicit:
- Attention comes from one legacy file (A100, 32 query / 4 KV heads per GPU, head dim 128).
  Decode attention is memory bound, so its time above the launch floor (the smallest measured
  kernel) is scaled by KV heads per GPU x head dim / (4 x 128); prefill is compute bound and
  scaled by query heads per GPU x head dim / (32 x 128). On H100 decode is further scaled by the
  HBM bandwidth ratio (2.04 / 3.35 TB/s) and prefill by the fp16 peak ratio (312 / 989 TFLOP/s).
- Presets without their own profile use a profiled model whose layers have the same or nearly
  the same matmul shapes (`PROFILE_SOURCES`), scaled by the ratio of per-layer weight counts:
  per-layer GEMM time is proportional to weights in both the weight-read and compute regimes.
  Ratios outside [0.5, 2] are refused (opt-175b: use the analytic model).
- Measured grids are made monotone by a suffix minimum: cuBLAS picks tiles per shape, so raw
  times jump (H100 Llama-2-70B TP4: 35 ms at 400 tokens, 30 ms at 512), but a batch of n tokens
  can always be padded to any m > n (as CUDA-graph capture sizes are), so the time at n is the
  smallest measured at or above n. More work then never prices cheaper. Beyond the measured token range (4096,
  or 32768 for Llama-3 files) time is extrapolated linearly from the last 1024 measured tokens.
"""

from __future__ import annotations

import csv
import hashlib
import math
import os
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import numpy as np

from scheduler_service.costmodel.analytic import Efficiency, layer_weight_params, lm_head_roofline
from scheduler_service.costmodel.base import COST_MODELS, CostModel, HardwareSpec
from scheduler_service.costmodel.presets import get_hardware
from sluice.common.paths import cache_dir, data_file, find_data_file, open_text
from sluice.contract.profile import BatchShape, ModelSpec

GPU_FOLDERS = {"a100-80g": "a100", "h100-80g": "h100"}
NETWORK_NODES = {"a100-80g": "a100_dgx", "h100-80g": "h100_dgx"}

# Preset -> profiled models to borrow from, in order of preference (first one that exists for
# the GPU and TP degree wins). Comments give the per-layer weight ratio (target / source).
PROFILE_SOURCES: dict[str, tuple[str, ...]] = {
    "llama-2-7b": ("meta-llama/Llama-2-7b-hf",),
    "llama-2-13b": ("internlm/internlm-20b",),  # identical layer shapes (5120 / 13824 / 40 heads), 1.00
    "llama-2-70b": ("meta-llama/Llama-2-70b-hf",),
    "llama-3-8b": ("meta-llama/Meta-Llama-3-8B", "meta-llama/Llama-2-7b-hf"),  # H100: Llama-2-7B x 1.08
    "llama-3-70b": ("meta-llama/Meta-Llama-3-70B", "meta-llama/Llama-2-70b-hf"),  # identical layers
    "mistral-7b": ("meta-llama/Meta-Llama-3-8B", "meta-llama/Llama-2-7b-hf"),  # identical layers to Llama-3-8B
    "codellama-34b": ("codellama/CodeLlama-34b-Instruct-hf",),
    "yi-34b": ("codellama/CodeLlama-34b-Instruct-hf",),  # 0.81, GQA 8 KV heads in both
    "qwen-72b": ("Qwen/Qwen-72B",),
    "opt-2.7b": ("microsoft/phi-2",),  # identical matmul shapes (2560 / 10240, ungated), TP 1 only
    "opt-6.7b": ("meta-llama/Llama-2-7b-hf",),  # 0.99
    "opt-13b": ("internlm/internlm-20b",),  # 0.99
}
MAX_WEIGHT_RATIO = 2.0

PROFILES_DIR = Path("profiles/vidur")  # in the data folders; files below are relative to it
LEGACY_ATTENTION = Path("legacy/e2d00e9/a100/attention.csv")
LEGACY_Q_WIDTH = 32 * 128  # query heads per GPU x head dim in the legacy file (64 heads, TP 2)
LEGACY_KV_WIDTH = 4 * 128
TOKEN_STEP = 8  # Vidur rounds total tokens up to a multiple of 8
CONTEXT_STEP = 64  # and contexts and prefixes up to a multiple of 64
CHUNK_STEP = 16
GQA_PENALTY = 1.10
ALLREDUCE_LAUNCH_MS = 0.02
MS = 1e-3


def _float(row: dict[str, str], key: str) -> float:
    value = row.get(key) or ""
    return float(value) if value else 0.0


def _suffix_min(values: np.ndarray, axis: int = -1) -> np.ndarray:
    """Each entry lowered to the smallest value at or after it along `axis`."""
    flipped = np.flip(values, axis=axis)
    return np.flip(np.minimum.accumulate(flipped, axis=axis), axis=axis)


@dataclass(frozen=True, slots=True)
class OpsProfile:
    """One profiled model's non-attention time per layer (ms) by token count, per TP degree."""

    spec: ModelSpec
    by_tp: dict[int, tuple[np.ndarray, np.ndarray]]  # tp -> (tokens, ms per layer), sorted


@lru_cache(maxsize=32)
def load_ops_profile(path: Path) -> OpsProfile:
    """Parse one mlp.csv: sum the median of every operator but the embedding, average repeats."""
    with open_text(path) as f:
        rows = list(csv.DictReader(f))
    ops = [k for k in rows[0] if k.startswith("time_stats.") and k.endswith(".median") and ".emb." not in k]
    sums: dict[int, dict[int, list[float]]] = {}
    for row in rows:
        tp, tokens = int(row["num_tensor_parallel_workers"]), int(row["num_tokens"])
        sums.setdefault(tp, {}).setdefault(tokens, []).append(sum(_float(row, k) for k in ops))
    by_tp = {}
    for tp, per_tokens in sums.items():
        tokens = np.array(sorted(per_tokens), dtype=float)
        by_tp[tp] = (tokens, np.array([np.mean(per_tokens[int(t)]) for t in tokens]))
    first = rows[0]
    spec = ModelSpec(
        name=path.parent.name,
        num_layers=1,
        hidden_size=int(first["n_embd"]),
        num_heads=int(first["n_head"]),
        num_kv_heads=int(first["n_kv_head"]),
        intermediate_size=int(first["n_expanded_embd"]),
        vocab_size=int(first["vocab_size"]),
        max_model_len=0,
        gated_mlp=first["use_gated_mlp"] == "True",
    )
    return OpsProfile(spec, by_tp)


def token_table(tokens: np.ndarray, values: np.ndarray, step: int) -> tuple[list[float], float]:
    """Values at 0, step, 2 step, ... up to the largest measured count; slope to extrapolate."""
    grid = np.arange(0, tokens[-1] + step, step, dtype=float)
    table = _suffix_min(np.interp(grid, tokens, values))
    table[0] = 0.0
    tail = tokens >= tokens[-1] - 1024
    slope = (values[tail][-1] - values[tail][0]) / max(tokens[tail][-1] - tokens[tail][0], 1.0)
    return table.tolist(), float(slope)


class TokenLookup:
    """f(tokens) from a table at multiples of `step`, linear beyond it. Rounds tokens up."""

    def __init__(self, table: list[float], slope: float, step: int) -> None:
        self.table, self.slope, self.step = table, slope, step
        self.last = len(table) - 1

    def __call__(self, num_tokens: int) -> float:
        i = -(-num_tokens // self.step)
        if i <= self.last:
            return self.table[i]
        return self.table[self.last] + (num_tokens - self.last * self.step) * self.slope


@dataclass(frozen=True, slots=True)
class AttentionGrid:
    """Legacy A100 attention medians in ms per layer, on regular grids.

    decode[b - 1][k]: batch b (1..128) at context k x 64 (k = 0..64);
    prefill[i][j]: prefix i x 64 (i = 0..64), chunk j x 16 (j = 0..256);
    prefill_fit: (a, b, d, e, f) of a + b c + d c^2 + e c p + f p, for beyond the grid.
    """

    decode: np.ndarray
    prefill: np.ndarray
    prefill_fit: np.ndarray
    decode_floor: float
    prefill_floor: float


def _decode_grid(batch: list[int], context: list[int], ms: list[float]) -> np.ndarray:
    cells: dict[tuple[int, int], list[float]] = {}
    for key, t in zip(zip(batch, context, strict=True), ms, strict=True):
        cells.setdefault(key, []).append(t)
    batches = sorted({b for b, _ in cells})
    contexts = np.array(sorted({c for _, c in cells}), dtype=float)
    grid = np.arange(0, 4096 + CONTEXT_STEP, CONTEXT_STEP, dtype=float)
    table = np.empty((len(batches), len(grid)))
    missing = [np.nan]
    for i, b in enumerate(batches):
        # NOTE: np.mean of one value is that value; it is called only where a cell was measured twice.
        row = [cells.get((b, int(c)), missing) for c in contexts]
        times = np.array([v[0] if len(v) == 1 else np.mean(v) for v in row])
        known = ~np.isnan(times)
        table[i] = np.interp(grid, contexts[known], times[known])
    return _suffix_min(_suffix_min(table, axis=1), axis=0)


def _prefill_fit(chunk: np.ndarray, prefix: np.ndarray, ms: np.ndarray) -> np.ndarray:
    # NOTE: weighted by 1/t so that small kernels (most of a serving trace) fit as well as big ones.
    features = np.stack([np.ones_like(chunk), chunk, chunk**2, chunk * prefix, prefix], axis=1)
    coef, *_ = np.linalg.lstsq(features / ms[:, None], np.ones_like(ms), rcond=None)
    return coef


def _prefill_grid(prefix: list[int], chunk: list[int], ms: list[float], fit: np.ndarray) -> np.ndarray:
    cells = dict(zip(zip(prefix, chunk, strict=True), ms, strict=True))
    prefixes = np.array(sorted({p for p, _ in cells}), dtype=float)
    chunks = np.array(sorted({c for _, c in cells}), dtype=float)
    full = np.array([[cells.get((int(p), int(c)), _fit_ms(fit, c, p)) for c in chunks] for p in prefixes])
    chunk_grid = np.arange(0, 4096 + CHUNK_STEP, CHUNK_STEP, dtype=float)
    prefix_grid = np.arange(0, 4096 + CONTEXT_STEP, CONTEXT_STEP, dtype=float)
    by_chunk = np.array([np.interp(chunk_grid, chunks, row) for row in full])
    table = np.array([np.interp(prefix_grid, prefixes, col) for col in by_chunk.T]).T
    return _suffix_min(_suffix_min(table, axis=1), axis=0)


def _fit_ms(fit: np.ndarray, chunk: float, prefix: float) -> float:
    a, b, d, e, f = fit
    return float(a + b * chunk + d * chunk * chunk + e * chunk * prefix + f * prefix)


_ATTENTION_COLUMNS = (
    "is_prefill",
    "batch_size",
    "kv_cache_size",
    "prefill_chunk_size",
    "time_stats.attn_decode.median",
    "time_stats.attn_prefill.median",
)


# Bumped whenever the derivation below changes: grids kept in the cache by an earlier one are
# then never read.
_GRID_FORMAT = 1


@lru_cache(maxsize=2)
def load_attention_grid(path: Path) -> AttentionGrid:
    """The attention grid of a profile file, derived once per file content and kept in the cache
    folder (`sluice.common.paths.cache_dir`): parsing and fitting the file took a twentieth of a
    1,000-request simulation; reading the kept grid takes under a millisecond."""
    key = hashlib.sha256(path.read_bytes()).hexdigest()[:24]
    try:
        kept = cache_dir("costmodel") / f"attention-grid-v{_GRID_FORMAT}-{key}.npz"
    except OSError:
        kept = None  # NOTE: no writable cache folder: derive every time
    if kept is not None and kept.is_file():
        try:
            with np.load(kept) as z:
                floors = z["floors"]
                return AttentionGrid(z["decode"], z["prefill"], z["prefill_fit"], float(floors[0]), float(floors[1]))
        except (OSError, KeyError, ValueError, IndexError):
            pass  # NOTE: a damaged file is made again
    grid = derive_attention_grid(path)
    if kept is not None:
        tmp = kept.with_suffix(f".{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                np.savez(
                    f,
                    decode=grid.decode,
                    prefill=grid.prefill,
                    prefill_fit=grid.prefill_fit,
                    floors=np.array([grid.decode_floor, grid.prefill_floor]),
                )
            os.replace(tmp, kept)  # NOTE: whole or absent, whoever reads it at the same time
        except OSError:
            tmp.unlink(missing_ok=True)
    return grid


def derive_attention_grid(path: Path) -> AttentionGrid:
    # NOTE: read as columns (csv.reader, six of its 32 columns): a DictReader per row was most of
    # a short simulation's start-up.
    with open_text(path) as f:
        reader = csv.reader(f)
        header = next(reader)
        at = [header.index(name) for name in _ATTENTION_COLUMNS]
        cols: list[list[str]] = [[] for _ in at]
        for row in reader:
            for col, i in zip(cols, at, strict=True):
                col.append(row[i])
    is_prefill, batch, kv, chunk_size, decode_ms, prefill_ms = cols
    pre = [flag == "True" for flag in is_prefill]
    dec_rows = [i for i, p in enumerate(pre) if not p]
    pre_rows = [i for i, p in enumerate(pre) if p]
    prefix = [int(kv[i]) for i in pre_rows]
    chunk = [int(chunk_size[i]) for i in pre_rows]
    ms = [float(prefill_ms[i]) for i in pre_rows]
    ms_array = np.array(ms)
    fit = _prefill_fit(np.array(chunk, dtype=float), np.array(prefix, dtype=float), ms_array)
    dec_ms = [float(decode_ms[i]) for i in dec_rows]
    decode = _decode_grid([int(batch[i]) for i in dec_rows], [int(kv[i]) for i in dec_rows], dec_ms)
    return AttentionGrid(decode, _prefill_grid(prefix, chunk, ms, fit), fit, min(dec_ms), float(ms_array.min()))


@lru_cache(maxsize=16)
def load_allreduce(path: Path, num_workers: int) -> tuple[np.ndarray, np.ndarray]:
    """(message bytes, median ms) of intra-node all-reduces over `num_workers` GPUs."""
    with open_text(path) as f:
        rows = [r for r in csv.DictReader(f) if int(r["num_workers"]) == int(r["devices_per_node"]) == num_workers]
    if not rows:
        raise ValueError(f"{path} has no all-reduce over {num_workers} GPUs of one node")
    per_size: dict[int, list[float]] = {}
    for r in rows:
        per_size.setdefault(int(r["size"]), []).append(float(r["time_stats.all_reduce.median"]))
    sizes = np.array(sorted(per_size), dtype=float)
    return sizes, np.array([np.mean(per_size[int(s)]) for s in sizes])


def find_profile(relpath: Path, root: Path | None) -> Path | None:
    """A profile file under `root` (Vidur's profiling layout) when given, else in the data folders."""
    return find_data_file(relpath, [root]) if root is not None else find_data_file(PROFILES_DIR / relpath)


def need_profile(relpath: Path, root: Path | None) -> Path:
    """`find_profile`, or a one-line error saying where the file was looked for."""
    return data_file(relpath, [root]) if root is not None else data_file(PROFILES_DIR / relpath)


def resolve_source(model: ModelSpec, gpu: str, root: Path | None) -> tuple[Path, float]:
    """(mlp.csv to use, per-layer weight ratio target / source) for a preset model, or ValueError."""
    base = model.name.partition("@")[0]
    if base not in PROFILE_SOURCES:
        raise ValueError(
            f"no operator profile close to {model.name!r}; profiled presets: {', '.join(sorted(PROFILE_SOURCES))}"
            " (use the analytic cost model for others)"
        )
    for folder in PROFILE_SOURCES[base]:
        path = find_profile(Path("compute", gpu, folder, "mlp.csv"), root)
        if path is None:
            continue
        source = load_ops_profile(path)
        if model.tensor_parallel not in source.by_tp:
            continue
        ratio = layer_weight_params(model) / layer_weight_params(
            replace(source.spec, tensor_parallel=model.tensor_parallel)
        )
        if not 1 / MAX_WEIGHT_RATIO <= ratio <= MAX_WEIGHT_RATIO:
            raise ValueError(f"{folder} is too far from {model.name} (per-layer weight ratio {ratio:.2f})")
        return path, ratio
    raise ValueError(f"no {gpu} profile of {' or '.join(PROFILE_SOURCES[base])} at TP={model.tensor_parallel}")


@COST_MODELS.register("profile")
class OperatorProfileCostModel(CostModel):
    name = "profile"

    def __init__(
        self, model: ModelSpec, hardware: HardwareSpec, root: Path | None = None, efficiency: Efficiency | None = None
    ) -> None:
        super().__init__(model, hardware)
        if hardware.name not in GPU_FOLDERS:
            raise ValueError(f"no operator profiles for {hardware.name!r}; profiled: {', '.join(sorted(GPU_FOLDERS))}")
        gpu = GPU_FOLDERS[hardware.name]
        self.source, self.weight_ratio = resolve_source(model, gpu, root)
        self.overhead_s = (efficiency or Efficiency()).iteration_overhead_s
        self._lm_head = lm_head_roofline(model, hardware, efficiency)
        self._gqa = model.num_kv_heads < model.num_heads
        self._ops = self._ops_lookup()
        self._allreduce = self._allreduce_lookup(root) if model.tensor_parallel > 1 else None
        self._init_attention(need_profile(LEGACY_ATTENTION, root))

    def _ops_lookup(self) -> TokenLookup:
        tokens, ms = load_ops_profile(self.source).by_tp[self.model.tensor_parallel]
        seconds = ms * (MS * self.model.num_layers * self.weight_ratio)
        return TokenLookup(*token_table(tokens, seconds, TOKEN_STEP), TOKEN_STEP)

    def _allreduce_lookup(self, root: Path | None) -> TokenLookup:
        m = self.model
        sizes, ms = load_allreduce(
            need_profile(Path("network", NETWORK_NODES[self.hardware.name], "all_reduce.csv"), root), m.tensor_parallel
        )
        tokens = sizes / (m.hidden_size * m.dtype_bytes)
        seconds = (ms + ALLREDUCE_LAUNCH_MS) * (2 * MS * m.num_layers)
        table, slope = token_table(tokens, seconds, TOKEN_STEP)
        # NOTE: the table starts at 0 tokens; an all-reduce of any size pays at least its launch.
        table[0] = float(seconds[0])
        return TokenLookup(table, slope, TOKEN_STEP)

    def _init_attention(self, path: Path) -> None:
        grid = load_attention_grid(path)
        m, a100 = self.model, get_hardware("a100-80g")
        kv_width = max(m.num_kv_heads // m.tensor_parallel, 1) * m.head_dim
        q_width = m.num_heads // m.tensor_parallel * m.head_dim
        bw_ratio = a100.mem_bandwidth / self.hardware.mem_bandwidth
        flop_ratio = a100.peak_flops / self.hardware.peak_flops
        layers_s = m.num_layers * MS
        dec_scale = kv_width / LEGACY_KV_WIDTH * bw_ratio
        pre_scale = q_width / LEGACY_Q_WIDTH * flop_ratio
        self._decode = self._scaled(grid.decode, grid.decode_floor, dec_scale, layers_s)
        self._prefill = self._scaled(grid.prefill, grid.prefill_floor, pre_scale, layers_s)
        self._decode_floor_s = grid.decode_floor * layers_s
        self._layers_s, self._prefill_floor_ms, self._prefill_scale = layers_s, grid.prefill_floor, pre_scale * layers_s
        self._fit = grid.prefill_fit

    @staticmethod
    def _scaled(table: np.ndarray, floor: float, scale: float, layers_s: float) -> list[list[float]]:
        # NOTE: the launch floor does not grow with heads or bandwidth; only the work above it does.
        return ((floor + (table - floor) * scale) * layers_s).tolist()

    def non_attention_time(self, num_tokens: int) -> float:
        """All layers' mlp.csv operators at `num_tokens` (rounded up to 8)."""
        return self._ops(num_tokens)

    def decode_attention_time(self, batch_size: int, context_sum: int) -> float:
        mean = -(-context_sum // batch_size)
        k = -(-mean // CONTEXT_STEP)
        b = min(batch_size, len(self._decode))
        if k < len(self._decode[0]) and b == batch_size:
            return self._decode[b - 1][k]
        # Memory bound beyond the grid: work above the floor grows with batch x context.
        top = self._decode[b - 1][min(k, len(self._decode[0]) - 1)] - self._decode_floor_s
        growth = batch_size / b * max(k / (len(self._decode[0]) - 1), 1.0)
        return self._decode_floor_s + top * growth

    def prefill_attention_time(self, chunks: list[tuple[int, int]]) -> float:
        chunk = math.sqrt(sum(c * c for c, _ in chunks))
        i = sum(-(-p // CONTEXT_STEP) for _, p in chunks)
        j = math.ceil(chunk / CHUNK_STEP)
        last_i, last_j = len(self._prefill) - 1, len(self._prefill[0]) - 1
        if i <= last_i and j <= last_j:
            return self._prefill[i][j]
        # Beyond the measured grid: the fitted surface, never below the grid's edge.
        work_ms = _fit_ms(self._fit, chunk, i * CONTEXT_STEP) - self._prefill_floor_ms
        fitted = self._prefill_floor_ms * self._layers_s + max(work_ms, 0.0) * self._prefill_scale
        return max(fitted, self._prefill[min(i, last_i)][min(j, last_j)])

    def iteration_time(self, shape: BatchShape) -> float:
        # NOTE: called once per simulated step: the swap terms (0.0 without bytes) and the token
        # count are spelt out here instead of through their helpers; same arithmetic, same order.
        out_bytes, in_bytes = shape.swap_out_bytes, shape.swap_in_bytes
        swaps = self.swap_time(out_bytes) + self.swap_time(in_bytes) if out_bytes or in_bytes else 0.0
        chunks, decodes = shape.prefill_chunks, shape.num_decodes
        n = sum(c for c, _ in chunks) + decodes if chunks else decodes
        if n == 0:
            return swaps
        t = self._ops(n) + self.overhead_s + swaps
        t += self._lm_head.time(decodes + len(chunks))
        if self._allreduce is not None:
            t += self._allreduce(n)
        if decodes:
            attn = self.decode_attention_time(decodes, shape.decode_context_sum)
            t += attn * GQA_PENALTY if self._gqa and decodes > 1 else attn
        if chunks:
            attn = self.prefill_attention_time(chunks)
            t += attn * GQA_PENALTY if self._gqa and len(chunks) > 1 else attn
        return t
