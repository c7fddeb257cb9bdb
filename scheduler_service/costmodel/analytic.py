"""Analytic roofline cost model ("analytic"): model dimensions x GPU peaks, with efficiency curves.

Data flow: `iteration_time(BatchShape)` splits one step into the parts a transformer runs per
layer on one GPU (one tensor-parallel shard), prices each with the roofline
`time = max(FLOPs / achieved FLOP/s, bytes / achieved bandwidth)` (Williams et al., CACM 2009),
multiplies by the number of layers, and adds the LM head, the tensor-parallel all-reduces, a
fixed per-iteration overhead and the KV swap copies:

    linear layers  QKV, output projection, MLP: 2 x tokens x weights FLOPs vs reading the
                   weights once; both grow with the weights, so the roofline picks the regime
                   (weight-read bound below ~100-300 tokens, compute bound above: the
                   "flat then linear" shape of Sarathi-Serve Fig. 3 and Vidur's profiles)
    elementwise    norms, rope, activation, residual adds: activation bytes / bandwidth
    prefill attn   4 x head_dim x q_heads x chunk x (prefix + chunk/2) FLOPs: QK^T and PV
                   over the cached prefix plus the causal half of the chunk itself
    decode attn    memory bound: every decode reads its whole KV (decode_context_sum tokens)
    KV writes      the new tokens' K and V written to the paged cache
    all-reduce     2 per layer under TP (after attention and after the MLP, Megatron-LM,
                   Shoeybi et al. 2019), ring algorithm: 2 (tp-1)/tp x message / link
    LM head        one logits row per sampled sequence (each decode and each prefill chunk)
    overhead       kernel launches, Python and scheduling per step (constant)
    swaps          bytes / PCIe, out and in serialised (vLLM issues both before the forward)

Compute efficiency curve: `eff(n) = compute_max x n / (n + n_half)`. A GEMM with n token rows
fills the tensor cores only once there are enough row tiles to give every SM work and each tile
is full (wave and tile quantisation); below that, throughput grows almost linearly with n and
then saturates. `n_half` (the token count at half efficiency) is proportional to the GPU's
ridge point (peak FLOP/s / bandwidth): a GPU with relatively faster tensor cores needs more rows
in flight. The constants are calibrated against Vidur's measured A100/H100 operator profiles
(compute_max 0.68: Llama-2-7B projections and MLP reach 64-66% of the A100 and H100 peaks at
2048-4096 tokens; weight reads reach 70% of HBM bandwidth at one token), and reproduce
AccelGen's (section 4.2) saturation of OPT-13B on A100 near forward size 768 and Sarathi-Serve's
Fig. 3 (decode throughput linear in batch size, prefill saturated after a few hundred tokens).
See docs/results/costmodel_calibration.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_service.costmodel.base import COST_MODELS, CostModel, HardwareSpec
from sluice.contract.profile import BatchShape, ModelSpec


@dataclass(frozen=True, slots=True)
class Efficiency:
    """Fractions of the data-sheet peaks that real kernels reach, and fixed costs."""

    compute_max: float = 0.68  # large GEMMs, fraction of dense fp16 peak
    half_tokens_per_ridge: float = 0.25  # n_half = this x ridge point (FLOP per byte)
    memory: float = 0.70  # weight and activation streaming, fraction of HBM bandwidth
    attention_compute: float = 0.25  # prefill attention: Vidur legacy A100 grid gives 0.17-0.55
    attention_memory: float = 0.75  # paged decode attention, fraction of HBM bandwidth
    interconnect: float = 0.70  # NCCL ring all-reduce bus bandwidth / NVLink bandwidth
    allreduce_latency_s: float = 20e-6  # per all-reduce launch (Vidur adds 0.02 ms too)
    attention_kernel_s: float = 12e-6  # smallest attention kernel (Vidur legacy A100 grid)
    iteration_overhead_s: float = 1e-3  # launches, sampling, scheduling per step


def layer_weight_params(model: ModelSpec) -> int:
    """Parameters of one layer's matmuls on one GPU (QKV, output, MLP)."""
    h, kv = model.hidden_size, model.num_kv_heads * model.head_dim
    mlp_mats = 3 if model.gated_mlp else 2
    return (2 * h * h + 2 * h * kv + mlp_mats * h * model.intermediate_size) // model.tensor_parallel


class GemmRoofline:
    """Time of a weight GEMM over n token rows: max(compute with eff(n), weight reads)."""

    def __init__(self, flops_per_row: float, weight_bytes: float, hw: HardwareSpec, eff: Efficiency) -> None:
        self.row_s = flops_per_row / (hw.peak_flops * eff.compute_max)
        self.read_s = weight_bytes / (hw.mem_bandwidth * eff.memory)
        self.n_half = eff.half_tokens_per_ridge * hw.peak_flops / hw.mem_bandwidth

    def time(self, n: int) -> float:
        # n / eff(n) = (n + n_half) / compute_max: compute time is linear with an n_half offset.
        return max((n + self.n_half) * self.row_s, self.read_s) if n else 0.0


def lm_head_roofline(model: ModelSpec, hardware: HardwareSpec, eff: Efficiency | None = None) -> GemmRoofline:
    """The vocabulary projection (column-parallel under TP): one row per sampled sequence."""
    eff = eff or Efficiency()
    per_gpu = model.vocab_size * model.hidden_size / model.tensor_parallel
    return GemmRoofline(2 * per_gpu, per_gpu * model.dtype_bytes, hardware, eff)


@COST_MODELS.register("analytic")
class AnalyticCostModel(CostModel):
    name = "analytic"

    def __init__(self, model: ModelSpec, hardware: HardwareSpec, efficiency: Efficiency | None = None) -> None:
        super().__init__(model, hardware)
        eff = self.efficiency = efficiency or Efficiency()
        m, hw, layers, tp = model, hardware, model.num_layers, model.tensor_parallel
        params = layer_weight_params(m)
        self._gemm = GemmRoofline(2 * params * layers, params * m.dtype_bytes * layers, hw, eff)
        self._lm_head = lm_head_roofline(m, hw, eff)
        mem_bw = hw.mem_bandwidth * eff.memory
        # NOTE: per token and layer, elementwise kernels move about 10 hidden vectors (two
        # norms in/out, rope on q/k, two residual adds) and 3 MLP-wide vectors (activation).
        act_bytes = m.dtype_bytes * (10 * m.hidden_size + 3 * m.intermediate_size) / tp
        kv_layer_bytes = 2 * m.num_kv_heads * m.head_dim * m.dtype_bytes / tp
        if m.num_kv_heads < tp:
            kv_layer_bytes = 2 * m.head_dim * m.dtype_bytes
        self._token_s = layers * (act_bytes + kv_layer_bytes) / mem_bw
        self._ctx_s = layers * kv_layer_bytes / (hw.mem_bandwidth * eff.attention_memory)
        q_width = m.num_heads * m.head_dim / tp
        self._attn_flop_s = layers * 4 * q_width / (hw.peak_flops * eff.attention_compute)
        self._attn_kernel_s = layers * eff.attention_kernel_s
        self._allreduce_fixed_s = 2 * layers * eff.allreduce_latency_s if tp > 1 else 0.0
        ring = 2 * (tp - 1) / tp
        link = max(hw.interconnect_bandwidth * eff.interconnect, 1.0)
        self._allreduce_token_s = 2 * layers * ring * m.hidden_size * m.dtype_bytes / link if tp > 1 else 0.0

    def non_attention_time(self, num_tokens: int) -> float:
        """Projections, MLP and elementwise kernels of all layers: what Vidur's mlp.csv covers."""
        return self._gemm.time(num_tokens) + num_tokens * self._token_s

    def prefill_attention_time(self, chunks: list[tuple[int, int]]) -> float:
        """All layers' attention over (new tokens, cached prefix) chunks, causal half included."""
        work = sum(c * (p + 0.5 * c) for c, p in chunks)
        return self._attn_kernel_s + work * self._attn_flop_s if chunks else 0.0

    def decode_attention_time(self, batch_size: int, context_sum: int) -> float:
        """All layers' decode attention: reading `context_sum` tokens of KV."""
        return self._attn_kernel_s + context_sum * self._ctx_s if batch_size else 0.0

    def iteration_time(self, shape: BatchShape) -> float:
        swaps = self.swap_time(shape.swap_out_bytes) + self.swap_time(shape.swap_in_bytes)
        n = shape.num_tokens
        if n == 0:
            return swaps
        attn = self.prefill_attention_time(shape.prefill_chunks)
        attn += self.decode_attention_time(shape.num_decodes, shape.decode_context_sum)
        comm = self._allreduce_fixed_s + n * self._allreduce_token_s if self._allreduce_fixed_s else 0.0
        rows = shape.num_decodes + len(shape.prefill_chunks)
        forward = self.non_attention_time(n) + attn + comm + self._lm_head.time(rows)
        return forward + self.efficiency.iteration_overhead_s + swaps
