"""SLO profiles: the seed papers' recipes for giving each request of a workload its SLOs.

Data flow: `apply_slo_profile(name, workload, cost_model, seed)` -> the registered profile
`(workload, cost_model, rng) -> Workload` prices the workload's requests with the cost model
(no clock, no I/O) -> `Workload.with_slos` attaches one `SLOSpec` per request and records
the profile in the workload's metadata. Deterministic under `seed`.

- `none`: no SLOs.
- `accelgen` (AccelGen, seed 000, sections 3 and 6.1): prompts are grouped by length in
  512-token groups ((0, 512], (512, 1024], ...); TTFT SLO = the group's average prefill
  latency x U[0.5, 1.5]; TBT SLO = 0.1875 s (normal reading speed) x U[0.75, 1.25]. Online.
- `econoserve` (EconoServe, seed 001, section 4, "Experiment Settings"): JCT SLO =
  SLO-scale x (t_p + t_g x l_g) with SLO-scale 2, t_p the workload's average prefill
  latency, t_g the per-token generation latency and l_g the request's output length.
  t_g is priced as one uncontended decode step of a request at the workload's mean
  mid-generation context (mean prompt + mean output / 2). Offline.
- `sarathi-strict` / `sarathi-relaxed` (Sarathi-Serve, seed 004, section 5.1): TBT SLO =
  5x / 25x the time of a decode iteration with a 4k-token context at batch size 32
  running without contention. Online; the papers judge it at the P99.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import numpy as np

from scheduler_service.core.slo import SLOClass, SLOSpec
from scheduler_service.costmodel.base import CostModel
from scheduler_service.workloads.base import Workload
from sluice.common.registry import Registry

SLOProfile = Callable[[Workload, CostModel, np.random.Generator], Workload]
SLO_PROFILES: Registry[SLOProfile] = Registry("SLO profile")

ACCELGEN_GROUP_TOKENS = 512
ACCELGEN_TTFT_SCALE = (0.5, 1.5)
ACCELGEN_TBT_S = 0.1875
ACCELGEN_TBT_SCALE = (0.75, 1.25)
ECONOSERVE_SLO_SCALE = 2.0
SARATHI_DECODE_BATCH = 32
SARATHI_DECODE_CONTEXT = 4096
SARATHI_STRICT_FACTOR = 5.0
SARATHI_RELAXED_FACTOR = 25.0


def accelgen_group(prompt_tokens: int) -> int:
    """Index of the 512-token length group: 1..512 -> 0, 513..1024 -> 1, ..."""
    return max(prompt_tokens - 1, 0) // ACCELGEN_GROUP_TOKENS


def group_prefill_means(workload: Workload, cost_model: CostModel) -> dict[int, float]:
    """Average prefill latency of each 512-token group over the workload's own prompts."""
    prefill = cache(cost_model.prefill_time)
    sums: dict[int, list[float]] = {}
    for request in workload:
        entry = sums.setdefault(accelgen_group(request.prompt_tokens), [0.0, 0.0])
        entry[0] += prefill(request.prompt_tokens)
        entry[1] += 1
    return {group: total / count for group, (total, count) in sums.items()}


@SLO_PROFILES.register("none")
def no_slo(workload: Workload, cost_model: CostModel, rng: np.random.Generator) -> Workload:
    return workload.with_slos([None] * len(workload), "none")


@SLO_PROFILES.register("accelgen")
def accelgen_slo(workload: Workload, cost_model: CostModel, rng: np.random.Generator) -> Workload:
    group_means = group_prefill_means(workload, cost_model)
    ttft_scale = rng.uniform(*ACCELGEN_TTFT_SCALE, size=len(workload))
    tbt_scale = rng.uniform(*ACCELGEN_TBT_SCALE, size=len(workload))
    slos = [
        SLOSpec(
            ttft_s=group_means[accelgen_group(r.prompt_tokens)] * float(a),
            tbt_s=ACCELGEN_TBT_S * float(b),
            slo_class=SLOClass.ONLINE,
        )
        for r, a, b in zip(workload, ttft_scale, tbt_scale, strict=True)
    ]
    return workload.with_slos(slos, "accelgen")


def econoserve_latencies(workload: Workload, cost_model: CostModel) -> tuple[float, float]:
    """(t_p, t_g): average prefill latency and per-token generation latency, in seconds."""
    prompts, outputs = workload.prompt_lengths(), workload.output_lengths()
    prefill = cache(cost_model.prefill_time)
    t_p = float(np.mean([prefill(int(p)) for p in prompts]))
    context = round(float(prompts.mean() + outputs.mean() / 2))
    t_g = cost_model.decode_time(1, context)
    return t_p, t_g


def econoserve_profile(scale: float = ECONOSERVE_SLO_SCALE) -> SLOProfile:
    def profile(workload: Workload, cost_model: CostModel, rng: np.random.Generator) -> Workload:
        t_p, t_g = econoserve_latencies(workload, cost_model)
        slos = [SLOSpec(jct_s=scale * (t_p + t_g * r.output_tokens), slo_class=SLOClass.OFFLINE) for r in workload]
        return workload.with_slos(slos, f"econoserve(scale={scale:g}, t_p={t_p:.6g}s, t_g={t_g:.6g}s)")

    return profile


SLO_PROFILES.register("econoserve")(econoserve_profile())


def sarathi_tbt_slo(cost_model: CostModel, factor: float) -> float:
    return factor * cost_model.decode_time(SARATHI_DECODE_BATCH, SARATHI_DECODE_CONTEXT)


def sarathi_profile(factor: float) -> SLOProfile:
    def profile(workload: Workload, cost_model: CostModel, rng: np.random.Generator) -> Workload:
        tbt = sarathi_tbt_slo(cost_model, factor)
        slo = SLOSpec(tbt_s=tbt, slo_class=SLOClass.ONLINE)
        return workload.with_slos([slo] * len(workload), f"sarathi(tbt={factor:g}x decode = {tbt:.6g}s)")

    return profile


SLO_PROFILES.register("sarathi-strict")(sarathi_profile(SARATHI_STRICT_FACTOR))
SLO_PROFILES.register("sarathi-relaxed")(sarathi_profile(SARATHI_RELAXED_FACTOR))


def apply_slo_profile(name: str, workload: Workload, cost_model: CostModel, seed: int = 0) -> Workload:
    if name not in SLO_PROFILES:
        raise ValueError(f"unknown SLO profile {name!r}; known: {', '.join(SLO_PROFILES.names())}")
    return SLO_PROFILES.get(name)(workload, cost_model, np.random.default_rng(seed))
