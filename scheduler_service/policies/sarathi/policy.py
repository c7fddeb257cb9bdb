"""`sarathi`: Sarathi-Serve's stall-free batching (OSDI'24, Algorithm 3, section 4.3).

Why choose it: decodes are never paused for a prefill, so time between tokens stays bounded
while prompts still flow in. What it does: the `vllm_chunked` iteration (every decode, then
partial prefills, then new prompts FCFS, all under a token budget tau), with tau derived once
from a TBT SLO: the largest forward size whose predicted iteration time (the cost model) is
within the SLO, rounded down to a multiple of the tile size (default 128; the paper's
settings are 512 strict and 2048 relaxed).
Long prompts (`price_in_time`, on by default): a chunk also stops where the step's predicted
time (the cost model, the chunk's attention over its prefix included) would pass the TBT SLO.
The paper sizes tau once, on prefill-only batches over an empty prefix; over a 100k-token prefix
that tau takes 7x the SLO (10,496 tokens for 0.367 s on llama-3.1-8b / H100 take 2.6 s), so chunks
there are cut in time rather than in tokens. Off, it is the paper's token budget alone.
Configuration: budget (a fixed tau), tbt_slo_s, tile, price_in_time, plus vllm_chunked's.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_service.core.policy import POLICIES
from scheduler_service.policies.baselines.vllm_chunked import ChunkedConfig, ChunkedPrefillPolicy
from scheduler_service.policies.decisions import budget_from_tbt_slo

__all__ = ["SarathiConfig", "SarathiPolicy", "budget_from_tbt_slo"]


@dataclass
class SarathiConfig(ChunkedConfig):
    budget: int | None = None  # fixed tau; None derives it from tbt_slo_s
    tbt_slo_s: float | None = None  # None: the deployment's TBT SLO (PolicyContext), else tau = 512
    tile: int = 128  # tau is rounded down to a multiple of this
    price_in_time: bool = True  # also cut chunks where the step's predicted time passes the TBT SLO


@POLICIES.register("sarathi")
class SarathiPolicy(ChunkedPrefillPolicy):
    name = "sarathi"
    config_cls = SarathiConfig
    config: SarathiConfig

    def _resolve_budget(self) -> int:
        if self.config.budget:
            return self.config.budget
        slo = self.config.tbt_slo_s or self.ctx.tbt_slo_s
        if slo is None or self.ctx.cost_model is None:
            return 512  # the paper's strict-SLO budget
        return budget_from_tbt_slo(self.ctx.cost_model, float(slo), self.config.tile)

    def _resolve_step_time(self) -> float | None:
        slo = self.config.tbt_slo_s or self.ctx.tbt_slo_s
        if not self.config.price_in_time or slo is None or self.ctx.cost_model is None:
            return None
        return float(slo)
