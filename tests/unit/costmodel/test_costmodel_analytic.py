"""The analytic roofline reproduces the published shapes (Sarathi-Serve Fig. 3, AccelGen's pivot)."""

from __future__ import annotations

import itertools

import pytest

from scheduler_service.costmodel.analytic import AnalyticCostModel
from scheduler_service.costmodel.pivot import pivot_forward_size, probe_shape
from scheduler_service.costmodel.presets import get_hardware, get_model
from sluice.contract.profile import BatchShape


def analytic(model: str, gpu: str = "a100-80g", tp: int = 1) -> AnalyticCostModel:
    return AnalyticCostModel(get_model(model, tp), get_hardware(gpu))


def test_more_tokens_are_never_faster() -> None:
    cm = analytic("llama-2-7b")
    times = [cm.prefill_time(n) for n in range(1, 4097, 7)]
    assert all(b >= a for a, b in itertools.pairwise(times))
    decodes = [cm.decode_time(b, 512) for b in range(1, 257)]
    assert all(b > a for a, b in itertools.pairwise(decodes))


def test_more_context_is_never_faster() -> None:
    cm = analytic("llama-3-8b")
    assert [cm.decode_time(32, c) for c in (128, 1024, 4096)] == sorted(
        cm.decode_time(32, c) for c in (128, 1024, 4096)
    )
    assert cm.decode_time(32, 4096) > cm.decode_time(32, 128)
    assert cm.prefill_time(512, prefix=2048) > cm.prefill_time(512, prefix=0)


def test_sarathi_fig3_decode_throughput_grows_almost_linearly_with_batch() -> None:
    cm = analytic("mistral-7b")
    tps = {b: b / cm.decode_time(b, 1024) for b in (1, 8, 64)}
    assert tps[8] / tps[1] > 7.0  # weight reads dominate: 8 decodes cost barely more than 1
    assert tps[64] / tps[1] > 30.0


def test_sarathi_fig3_prefill_throughput_saturates_after_a_few_hundred_tokens() -> None:
    cm = analytic("mistral-7b")
    tps = {n: n / cm.prefill_time(n) for n in (64, 512, 4096)}
    assert tps[512] == pytest.approx(tps[4096], rel=0.20)
    assert tps[64] < 0.6 * tps[512]


def test_accelgen_pivot_of_opt_13b_on_a100_is_near_768() -> None:
    size, seconds = pivot_forward_size(analytic("opt-13b"))
    assert 512 <= size <= 1024
    assert seconds == analytic("opt-13b").iteration_time(probe_shape(size))


def test_pivot_moves_up_on_h100_where_tensor_cores_outpace_memory_more() -> None:
    a100, _ = pivot_forward_size(analytic("llama-2-7b"))
    h100, _ = pivot_forward_size(analytic("llama-2-7b", "h100-80g"))
    assert h100 > a100


def test_tensor_parallel_splits_the_work_but_pays_all_reduces() -> None:
    one, four = analytic("llama-2-70b", tp=2), analytic("llama-2-70b", tp=4)
    assert four.prefill_time(2048) < one.prefill_time(2048)
    assert four.prefill_time(2048) > one.prefill_time(2048) / 2  # communication keeps it above ideal


def test_swaps_cost_bytes_over_pcie_in_each_direction() -> None:
    cm = analytic("llama-2-7b")
    gib = 2**30
    base = cm.iteration_time(BatchShape(num_decodes=4, decode_context_sum=4000, decode_context_max=1000))
    shape = BatchShape(
        num_decodes=4, decode_context_sum=4000, decode_context_max=1000, swap_out_bytes=gib, swap_in_bytes=gib
    )
    assert cm.iteration_time(shape) - base == pytest.approx(2 * gib / 25e9)
    assert cm.iteration_time(BatchShape(swap_in_bytes=gib)) == pytest.approx(gib / 25e9)
    assert cm.iteration_time(BatchShape()) == 0.0


def test_invalid_pivot_threshold_is_refused() -> None:
    with pytest.raises(ValueError, match="threshold"):
        pivot_forward_size(analytic("opt-13b"), threshold=1.5)
