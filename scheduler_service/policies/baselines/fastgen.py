"""`fastgen`: DeepSpeed-FastGen's iteration-level scheduler, the ILS baseline of SCLS
(seed 002, section 5: "FastGen-v0.2.0 ... adopts a conservative memory management mechanism
which limits the number of parallel-processing requests").

Why choose it: to compare with SCLS the way its paper does. `vllm` runs up to
`max_num_seqs` sequences (256) with recompute preemption; FastGen caps the sequences in
flight far lower so that it never runs out of KV, and that cap, not continuous batching,
is what SCLS's larger static batches beat.
What it does, each iteration: Dynamic SplitFuse under a token budget (`budget`, FastGen's
`max_ragged_batch_size`, 768): every running decode gets its token, ongoing prompts their
next chunk, then new requests FCFS, each chunked to the leftover budget, while fewer than
`max_seqs` sequences (FastGen's `max_ragged_sequence_count` as its memory policy leaves it)
are in flight and their whole prompt gets blocks. KV pressure, rare under the cap, preempts
the newest as in vLLM.
Configuration: max_seqs (the cap), budget, watermark, preemption_mode.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_service.core.policy import POLICIES
from scheduler_service.policies.baselines.vllm_chunked import ChunkedConfig, ChunkedPrefillPolicy


@dataclass
class FastGenConfig(ChunkedConfig):
    budget: int | None = 768  # tokens per iteration (FastGen's max_ragged_batch_size)
    max_seqs: int = 16  # sequences in flight at most (the conservative cap)


@POLICIES.register("fastgen")
class FastGenPolicy(ChunkedPrefillPolicy):
    name = "fastgen"
    config_cls = FastGenConfig
    config: FastGenConfig

    def seat_limit(self) -> int:
        if self.config.max_seqs < 1:
            raise ValueError(f"fastgen max_seqs must be >= 1, got {self.config.max_seqs}")
        return min(self.config.max_seqs, self.ctx.max_num_seqs)
