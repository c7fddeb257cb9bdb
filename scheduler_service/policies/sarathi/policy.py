"""`sarathi`: Sarathi-Serve's stall-free batching (OSDI'24, Algorithm 3, section 4.3).

Why choose it: decodes are never paused for a prefill, so time between tokens stays bounded
while prompts still flow in. What it does: the `vllm_chunked` iteration (every decode, then
partial prefills, then new prompts FCFS, all under a token budget tau), with tau derived
from a TBT SLO: the largest forward size whose predicted iteration time (the cost model) is
within the SLO, rounded down to a multiple of the tile size (default 128; the paper's
settings are 512 strict and 2048 relaxed). The TBT SLO is the policy's `tbt_slo_s` option when
given, else the tightest TBT SLO of the requests on the worker (each request's own `tbt_ms`,
else the deployment's: core/slo.py `request_tbt_slo`), so tau follows the clients' SLOs live
and simulated alike; with one SLO for every request it is the paper's tau, sized once.
Long prompts (`price_in_time`, on by default): a chunk also stops where the step's predicted
time (the cost model, the chunk's attention over its prefix included) would pass the TBT SLO.
The paper sizes tau once, on prefill-only batches over an empty prefix; over a 100k-token prefix
that tau takes 7x the SLO (10,496 tokens for 0.367 s on llama-3.1-8b / H100 take 2.6 s), so chunks
there are cut in time rather than in tokens. Off, it is the paper's token budget alone.
Configuration: budget (a fixed tau), tbt_slo_s, tile, price_in_time, plus vllm_chunked's.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_service.core.policy import POLICIES, PolicyConfig, PolicyContext
from scheduler_service.core.request import Request
from scheduler_service.core.slo import TbtSloSet
from scheduler_service.policies.baselines.vllm_chunked import ChunkedConfig, ChunkedPrefillPolicy
from scheduler_service.policies.decisions import budget_from_tbt_slo

__all__ = ["SarathiConfig", "SarathiPolicy", "budget_from_tbt_slo"]


@dataclass
class SarathiConfig(ChunkedConfig):
    budget: int | None = None  # fixed tau; None derives it from tbt_slo_s
    tbt_slo_s: float | None = None  # None: the requests' tightest (theirs, else the deployment's); none: 512
    tile: int = 128  # tau is rounded down to a multiple of this
    price_in_time: bool = True  # also cut chunks where the step's predicted time passes the TBT SLO


@POLICIES.register("sarathi")
class SarathiPolicy(ChunkedPrefillPolicy):
    name = "sarathi"
    config_cls = SarathiConfig
    config: SarathiConfig

    def __init__(self, config: PolicyConfig, ctx: PolicyContext) -> None:
        self.tbt_slos = TbtSloSet(ctx.tbt_slo_s)
        self._budgets: dict[float, int] = {}  # tau per TBT SLO, each priced once
        super().__init__(config, ctx)

    def _slo(self) -> float | None:
        return self.config.tbt_slo_s or self.tbt_slos.tightest

    def _resolve_budget(self) -> int:
        if self.config.budget:
            return self.config.budget
        slo = self._slo()
        if slo is None or self.ctx.cost_model is None:
            return 512  # the paper's strict-SLO budget
        if (tau := self._budgets.get(slo)) is None:
            tau = self._budgets[slo] = budget_from_tbt_slo(self.ctx.cost_model, float(slo), self.config.tile)
        return tau

    def _resolve_step_time(self) -> float | None:
        slo = self._slo()
        if not self.config.price_in_time or slo is None or self.ctx.cost_model is None:
            return None
        return float(slo)

    def on_arrival(self, request: Request, now: float) -> None:
        super().on_arrival(request, now)
        if self.config.tbt_slo_s is None and self.tbt_slos.add(request.request_id, request.slo):
            self._retune()

    def on_finished(self, request: Request, now: float) -> None:
        super().on_finished(request, now)
        if self.config.tbt_slo_s is None and self.tbt_slos.remove(request.request_id):
            self._retune()

    def _retune(self) -> None:
        self.budget = self._resolve_budget()
        self.step_time_s = self._resolve_step_time()
