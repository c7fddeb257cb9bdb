"""SLO profiles: each paper's formula, priced with a small linear cost model of our own."""

from __future__ import annotations

import numpy as np
import pytest

from scheduler_service.core.slo import SLOClass
from scheduler_service.costmodel.base import CostModel
from scheduler_service.sim.slo_profiles import (
    SLO_PROFILES,
    accelgen_group,
    apply_slo_profile,
    group_prefill_means,
)
from scheduler_service.workloads import Workload, load_trace
from sluice.contract.profile import BatchShape


class LinearCostModel(CostModel):
    """Seconds linear in tokens: 5 ms overhead, 0.2 ms per prefill token, 0.1 ms per decode,
    20 ns per token of decode context."""

    name = "linear-test"

    def __init__(self) -> None:
        """No model or hardware: the formula is the whole model."""

    def iteration_time(self, shape: BatchShape) -> float:
        return 0.005 + 2e-4 * shape.num_prefill_tokens + 1e-4 * shape.num_decodes + 2e-8 * shape.decode_context_sum


COST = LinearCostModel()


@pytest.fixture(scope="module")
def workload() -> Workload:
    return load_trace("azure-conv", num_requests=3_000)


def test_every_profile_is_registered() -> None:
    assert SLO_PROFILES.names() == ["accelgen", "econoserve", "none", "sarathi-relaxed", "sarathi-strict"]


def test_none_profile_attaches_no_slo(workload: Workload) -> None:
    result = apply_slo_profile("none", workload, COST)
    assert all(r.slo is None for r in result)
    assert result.metadata["slo_profile"] == "none"


def test_accelgen_groups_prompts_in_512_token_ranges() -> None:
    assert [accelgen_group(n) for n in (1, 512, 513, 1024, 1025)] == [0, 0, 1, 1, 2]


def test_accelgen_tbt_is_reading_speed_times_uniform_075_125(workload: Workload) -> None:
    tbts = np.array([r.slo.tbt_s for r in apply_slo_profile("accelgen", workload, COST, seed=1)])
    assert tbts.min() >= 0.140625 and tbts.max() <= 0.234375
    assert tbts.min() < 0.145 and tbts.max() > 0.23  # the whole range is used
    assert tbts.mean() == pytest.approx(0.1875, rel=0.02)


def test_accelgen_ttft_is_group_average_prefill_times_uniform_05_15(workload: Workload) -> None:
    result = apply_slo_profile("accelgen", workload, COST, seed=1)
    means = group_prefill_means(workload, COST)
    scales = []
    for r in result:
        group = accelgen_group(r.prompt_tokens)
        lo, hi = COST.prefill_time(group * 512 + 1), COST.prefill_time((group + 1) * 512)
        assert lo <= means[group] <= hi
        assert 0.5 * lo <= r.slo.ttft_s <= 1.5 * hi
        scales.append(r.slo.ttft_s / means[group])
        assert r.slo.slo_class is SLOClass.ONLINE and r.slo.jct_s is None
    assert min(scales) >= 0.5 and max(scales) <= 1.5
    assert np.mean(scales) == pytest.approx(1.0, abs=0.03)


def test_accelgen_group_mean_is_the_mean_over_the_groups_own_prompts() -> None:
    small = load_trace("azure-conv", num_requests=50)
    group0 = [r.prompt_tokens for r in small if accelgen_group(r.prompt_tokens) == 0]
    expected = np.mean([COST.prefill_time(p) for p in group0])
    assert group_prefill_means(small, COST)[0] == pytest.approx(expected)


def test_accelgen_is_deterministic_under_seed(workload: Workload) -> None:
    a = apply_slo_profile("accelgen", workload, COST, seed=9)
    b = apply_slo_profile("accelgen", workload, COST, seed=9)
    c = apply_slo_profile("accelgen", workload, COST, seed=10)
    assert [r.slo for r in a] == [r.slo for r in b] != [r.slo for r in c]


def test_econoserve_jct_is_twice_prefill_plus_per_token_decode_times_output(workload: Workload) -> None:
    result = apply_slo_profile("econoserve", workload, COST)
    prompts, outputs = workload.prompt_lengths(), workload.output_lengths()
    t_p = np.mean([COST.prefill_time(int(p)) for p in prompts])
    t_g = COST.decode_time(1, round(float(prompts.mean() + outputs.mean() / 2)))
    for r in result:
        assert r.slo.jct_s == pytest.approx(2.0 * (t_p + t_g * r.output_tokens))
        assert r.slo.slo_class is SLOClass.OFFLINE and r.slo.ttft_s is None and r.slo.tbt_s is None
    assert result.metadata["slo_profile"].startswith("econoserve(scale=2")


def test_sarathi_tbt_is_5x_and_25x_a_lone_decode_of_4k_at_batch_32(workload: Workload) -> None:
    decode = COST.decode_time(32, 4096)
    assert decode == pytest.approx(0.005 + 32e-4 + 2e-8 * 32 * 4096)
    strict = apply_slo_profile("sarathi-strict", workload, COST)
    relaxed = apply_slo_profile("sarathi-relaxed", workload, COST)
    assert [r.slo.tbt_s for r in strict] == pytest.approx([5 * decode] * len(workload))
    assert [r.slo.tbt_s for r in relaxed] == pytest.approx([25 * decode] * len(workload))
    assert all(r.slo.ttft_s is None and r.slo.effective_class is SLOClass.ONLINE for r in strict)


def test_profiles_leave_lengths_and_arrivals_alone(workload: Workload) -> None:
    result = apply_slo_profile("accelgen", workload, COST)
    assert [(r.request_id, r.arrival_s, r.prompt_tokens) for r in result] == [
        (r.request_id, r.arrival_s, r.prompt_tokens) for r in workload
    ]
    assert all(r.slo is None for r in workload)


def test_unknown_profile_is_a_clear_error(workload: Workload) -> None:
    with pytest.raises(ValueError, match=r"unknown SLO profile 'tight'.*accelgen"):
        apply_slo_profile("tight", workload, COST)
