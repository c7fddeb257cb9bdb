"""`sluice profile --quick` drives the real engine through StepPlans and writes a WorkerProfile
that loads back, covers every kind of step and swap, and fits the fitted cost model."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.profile import main
from sluice.contract.profile import WorkerProfile
from worker_service.engine import EngineConfig, LLMEngine
from worker_service.profiler import QUICK_GRID, ProfileGrid, run_profile


def test_quick_profile_writes_a_valid_worker_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "profile.json"

    assert main(["--model", "tiny-llama", "--quick", "--threads", "1", "--no-progress", "--out", str(out)]) == 0

    profile = WorkerProfile.load(out)
    assert (profile.model.name, profile.device, profile.dtype) == ("tiny-llama", "cpu", "float32")
    assert profile.block_size == 16
    assert profile.model.num_layers == 2 and profile.model.gated_mlp
    prefill_only = [s for s in profile.steps if s.shape.prefill_chunks and not s.shape.num_decodes]
    decode_only = [s for s in profile.steps if s.shape.num_decodes and not s.shape.prefill_chunks]
    mixed = [s for s in profile.steps if s.shape.num_decodes and s.shape.prefill_chunks]
    assert len(prefill_only) == len(QUICK_GRID.prefill)
    assert len(decode_only) == len(QUICK_GRID.decode_batches) * len(QUICK_GRID.decode_contexts)
    assert len(mixed) == len(QUICK_GRID.mixed)
    assert {(64, 256)} <= {tuple(c) for s in prefill_only for c in s.shape.prefill_chunks}, "cached prefix kept"
    for sample in profile.steps:
        assert len(sample.times_s) == QUICK_GRID.repeats
        assert sample.time_s == sorted(sample.times_s)[len(sample.times_s) // 2] > 0
    biggest = max(decode_only, key=lambda s: (s.shape.num_decodes, s.shape.decode_context_max))
    assert biggest.shape.num_decodes == 64 and biggest.shape.decode_context_max >= 1024

    swaps = {(s.direction, s.int8, s.num_blocks): s for s in profile.swaps}
    assert len(swaps) == 2 * 2 * len(QUICK_GRID.swap_blocks)
    plain, int8 = swaps[("out", False, 32)], swaps[("out", True, 32)]
    assert plain.bytes == 32 * 16384, "tiny-llama: 16 KiB per block"
    assert 0 < int8.bytes < plain.bytes, "int8 swaps move fewer bytes"
    assert all(s.time_s > 0 for s in profile.swaps)

    printed = capsys.readouterr().out
    assert "step MAPE" in printed


def test_declared_contexts_profile_the_same_steps_as_prefilled_ones() -> None:
    """Skipping setup prefills (the default on CUDA) must measure exactly the same step shapes."""
    grid = ProfileGrid(
        prefill=((32, 0), (16, 40)),
        decode_batches=(1, 3),
        decode_contexts=(20, 70),
        mixed=((24, 2, 33),),
        swap_blocks=(2,),
        repeats=2,
        warmup=1,
    )
    shapes = {}
    for declare in (False, True):
        engine = LLMEngine(EngineConfig(model="tiny-llama", block_size=16))
        profile, skipped = run_profile(engine, grid, progress=False, declare_context=declare)
        assert not skipped
        shapes[declare] = ([s.shape.to_dict() for s in profile.steps], [(s.direction, s.bytes) for s in profile.swaps])
    assert shapes[True] == shapes[False]
