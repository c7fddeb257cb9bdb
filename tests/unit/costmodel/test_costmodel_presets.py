"""Presets carry the published dimensions; names resolve with TP suffixes and fail clearly."""

from __future__ import annotations

import pytest

from scheduler_service.costmodel.analytic import AnalyticCostModel
from scheduler_service.costmodel.presets import HARDWARE_PRESETS, MODEL_PRESETS, get_hardware, get_model

KiB = 1024


def test_kv_bytes_per_token_match_published_layouts() -> None:
    assert get_model("llama-2-7b").kv_bytes_per_token == 512 * KiB
    assert get_model("llama-3-8b").kv_bytes_per_token == 128 * KiB
    assert get_model("llama-2-70b").kv_bytes_per_token == 320 * KiB
    assert get_model("opt-13b").kv_bytes_per_token == 800 * KiB


@pytest.mark.parametrize(
    ("name", "billions"),
    [
        ("opt-13b", 12.9),
        ("opt-175b", 175.0),
        ("llama-2-7b", 6.7),
        ("llama-2-70b", 69.0),
        ("llama-3-8b", 8.0),
        ("llama-3.1-8b", 8.0),
        ("llama-3.1-70b", 70.6),
        ("llama-3.1-405b", 405.9),
    ],
)
def test_parameter_counts_are_within_five_percent_of_the_model_names(name: str, billions: float) -> None:
    assert get_model(name).num_params / 1e9 == pytest.approx(billions, rel=0.05)


def test_opt_models_are_ungated_with_2048_positions() -> None:
    for name in ("opt-2.7b", "opt-6.7b", "opt-13b", "opt-175b"):
        spec = MODEL_PRESETS[name]
        assert not spec.gated_mlp and spec.max_model_len == 2048 and spec.intermediate_size == 4 * spec.hidden_size


@pytest.mark.parametrize(
    ("name", "context"),
    [
        ("opt-13b", 2048),
        ("llama-2-7b", 4096),
        ("yi-34b", 4096),
        ("llama-3-8b", 8192),
        ("codellama-34b", 16384),
        ("mistral-7b", 32768),
        ("qwen-72b", 32768),
        ("llama-3.1-8b", 131072),
        ("llama-3.1-70b", 131072),
        ("llama-3.1-405b", 131072),
    ],
)
def test_presets_carry_their_checkpoints_context_length(name: str, context: int) -> None:
    assert get_model(name).max_model_len == context


def test_tp_suffix_and_argument_both_shard_the_model() -> None:
    assert get_model("llama-2-70b@tp4").tensor_parallel == 4
    assert get_model("Llama-2-70B", tensor_parallel=8).tensor_parallel == 8
    assert get_model("llama-2-70b@tp4").weight_bytes_per_gpu * 4 == get_model("llama-2-70b").weight_bytes_per_gpu


def test_unknown_names_list_the_known_ones() -> None:
    with pytest.raises(KeyError, match="llama-2-7b"):
        get_model("gpt-5")
    with pytest.raises(KeyError, match="a100-80g"):
        get_hardware("tpu-v5")
    with pytest.raises(ValueError, match="TP=3"):
        get_model("llama-2-7b@tp3")


def test_hardware_ordering_follows_the_data_sheets() -> None:
    a100, h100, h200 = (HARDWARE_PRESETS[n] for n in ("a100-80g", "h100-80g", "h200"))
    assert h100.peak_flops > 3 * a100.peak_flops and h200.mem_bandwidth > h100.mem_bandwidth > a100.mem_bandwidth
    assert h100.pcie_bandwidth == 2 * a100.pcie_bandwidth > HARDWARE_PRESETS["v100-32g"].pcie_bandwidth


def test_llama_2_7b_on_a100_holds_about_seven_thousand_16_token_blocks() -> None:
    blocks = AnalyticCostModel(get_model("llama-2-7b"), get_hardware("a100-80g")).num_kv_blocks(16)
    # (0.9 x 80 GiB - 13.5 GB of weights - 4 GiB reserve) / (16 x 512 KiB) = 7097; vLLM reports ~7k.
    assert 6500 <= blocks <= 7600


def test_a_model_too_big_for_one_gpu_is_refused() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        AnalyticCostModel(get_model("llama-2-70b"), get_hardware("a100-80g")).num_kv_blocks(16)
