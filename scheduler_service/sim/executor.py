"""SimulatedExecutor: a worker that obeys StepPlans on a virtual clock.

It keeps the same per-request state a real worker keeps (tokens computed, tokens
generated), turns each plan into a BatchShape, prices it with the cost model, and
"samples" a token for every request in `sample_ids`: the end-of-sequence token once the
request reaches its true length from the trace, a filler token otherwise. Static-batching
plans (`padded_len`, `padded_context`, `invalid_tokens` in the metadata) are priced with their
padding: prefill rows at the padded length, decode rows at the padded context.
KV swaps are priced over PCIe, plus a cost per block moved and a stall per step that swaps
(`swap_copy_overhead_s`, `swap_stall_s`); int8 halves the bytes (ALISE), and `overlap_swap`
hides them behind compute as an engine with a copy stream does. An optional CPU-overhead model
(a fixed cost per step, one per scheduled sequence and one per sequence whose prefill starts
in the step) adds what the serving stack spends outside the model, calibrated from a live
run's step log.
"""

from __future__ import annotations

from scheduler_service.costmodel.base import CostModel
from sluice.contract.plan import KVMoveKind, StepError, StepPlan, StepResult
from sluice.contract.profile import BatchShape

SIM_EOS = 0
SIM_TOKEN = 1


class SimulatedExecutor:
    def __init__(
        self,
        cost_model: CostModel,
        bytes_per_block: int,
        truth: dict[str, int],
        overlap_swap: bool = False,
        overhead: tuple[float, float, float] = (0.0, 0.0, 0.0),
        swap_costs: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        self.cost_model = cost_model
        # seconds per block moved beyond its bytes, and per step that swaps (see SimConfig)
        self.swap_block_s, self.swap_stall_s = swap_costs
        # per step, per scheduled sequence, per sequence whose prefill starts in the step
        self.step_overhead_s, self.seq_overhead_s, self.new_seq_overhead_s = overhead
        self.bytes_per_block = bytes_per_block
        self.truth = truth  # request id -> true output length (shared with the simulator)
        self.overlap_swap = overlap_swap
        self.computed: dict[str, int] = {}
        self.generated: dict[str, int] = {}
        self.last_overhead_s = 0.0  # the CPU-overhead part of the last step's total_s

    def execute(self, plan: StepPlan) -> StepResult:
        computed, generated = self.computed, self.generated
        for rid in plan.release_ids:
            computed.pop(rid, None)
            generated.pop(rid, None)
        for new in plan.new_requests:
            computed[new.request_id] = new.num_computed_tokens
            generated[new.request_id] = new.num_output_tokens
        scheduled = plan.num_scheduled_tokens
        # NOTE: a containment test of the key views builds no set (the difference did, every step).
        if not scheduled.keys() <= computed.keys():
            return self._error(plan, min(scheduled.keys() - computed.keys()))
        shape = BatchShape()
        chunks = shape.prefill_chunks
        meta = plan.metadata
        padded = meta.get("padded_len") if meta else None
        # A static batch's live rows decode at the padded context, not their own (every row
        # of a padded batch is as long as its longest input).
        padded_ctx = int(meta.get("padded_context", 0)) if meta else 0
        fresh = decodes = context_sum = context_max = 0
        # NOTE: BatchShape.add_decode inlined (one call per decode token was a tenth of the loop).
        for rid, n in scheduled.items():
            ctx = computed[rid]
            if n == 1 and ctx > 0:
                context = ctx + 1 if ctx >= padded_ctx else padded_ctx
                decodes += 1
                context_sum += context
                if context > context_max:
                    context_max = context
            else:
                chunks.append((padded, 0) if padded else (n, ctx))
                fresh += ctx == 0
            computed[rid] = ctx + n
        shape.num_decodes, shape.decode_context_sum, shape.decode_context_max = decodes, context_sum, context_max
        if meta and meta.get("invalid_tokens"):
            shape.num_decodes += int(meta["invalid_tokens"])
            shape.decode_context_sum += int(meta.get("invalid_context_sum", 0))
        compute_s = self.cost_model.iteration_time(shape) if shape.num_seqs else 0.0
        swap_s = 0.0
        swap_bytes = 0
        if plan.kv_moves:
            swap_bytes, swap_blocks = self._swap_bytes(plan)
            swap_s = self.cost_model.swap_time(swap_bytes)
            if swap_blocks:
                swap_s += swap_blocks * self.swap_block_s + self.swap_stall_s
        total = max(compute_s, swap_s) if self.overlap_swap else compute_s + swap_s
        overhead = 0.0
        if shape.num_seqs:
            overhead = self.step_overhead_s + self.seq_overhead_s * len(scheduled) + self.new_seq_overhead_s * fresh
        total += overhead
        self.last_overhead_s = overhead
        return StepResult(
            step_id=plan.step_id,
            sampled_token_ids=self._sample(plan),
            total_s=total,
            forward_s=compute_s,
            swap_s=swap_s,
            swap_bytes=swap_bytes,
        )

    def _sample(self, plan: StepPlan) -> dict[str, int]:
        generated, truth = self.generated, self.truth
        out: dict[str, int] = {}
        for rid in plan.sample_ids:
            n = generated[rid] + 1
            generated[rid] = n
            out[rid] = SIM_EOS if n >= truth[rid] else SIM_TOKEN
        return out

    def _swap_bytes(self, plan: StepPlan) -> tuple[int, int]:
        """(bytes, blocks) the plan's swaps move."""
        total = blocks = 0
        for move in plan.kv_moves:
            if move.kind is KVMoveKind.COPY:
                continue
            nbytes = move.num_blocks * self.bytes_per_block
            total += nbytes // 2 if move.int8 else nbytes
            blocks += move.num_blocks
        return total, blocks

    def _error(self, plan: StepPlan, rid: str) -> StepResult:
        error = StepError("INVALID_ARGUMENT", f"num_scheduled_tokens: unknown request {rid!r}", rid)
        return StepResult(plan.step_id, {}, total_s=0.0, error=error)
