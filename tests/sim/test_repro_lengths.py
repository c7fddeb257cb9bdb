"""The paper reproductions (sluice_bench.repro) with real predictions: `--length-source` swaps
the length source of every system that reads predicted lengths (never the baseline's),
and `econoserve --regroup` runs the
real predictor on prompts with text and reports EconoServe's misprediction counters per run."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest


def test_length_source_reaches_only_the_systems_that_read_lengths(repro: ModuleType) -> None:
    for claim in repro.PAPERS["alise"]():
        swapped = repro.with_length_source(claim, "predictor")
        by_label = {s.label: s for s in swapped.systems}
        assert by_label["alise (predictor)"].length_source == "predictor"
        # the comparisons follow the renamed systems
        assert {c.system for c in swapped.comparisons} == {"alise (predictor)"}
        assert by_label["vllm"] == next(s for s in claim.systems if s.label == "vllm")  # the baseline unchanged
        assert swapped.baseline in by_label


def test_bad_length_source_and_regroup_values_are_refused_by_name(repro: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        repro.main(["alise", "--quick", "--length-source", "psychic", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        repro.main(["econoserve", "--quick", "--regroup", "half", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        repro.main(["alise", "--quick", "--regroup", "0.5", "--out", str(tmp_path)])


def test_regroup_sweep_runs_the_real_predictor_and_counts_mispredictions(repro: ModuleType, tmp_path: Path) -> None:
    results = repro.main(["econoserve", "--regroup", "0.5", "--quick", "--out", str(tmp_path)])
    (claim,) = results["claims"]
    rows = {r["system"]: r for r in claim["rows"]}
    assert set(rows) == {"regroup 0.5", "oracle lengths", "vllm"}
    assert rows["regroup 0.5"]["lengths"] == "predictor"  # the model itself, over the prompts' text
    assert rows["oracle lengths"]["lengths"] == "oracle"
    # the predictor under-predicts some requests; the oracle (plus 15% padding) never does
    assert rows["regroup 0.5"]["requests_under_provisioned"] > 0
    assert rows["oracle lengths"]["requests_under_provisioned"] == 0
    assert rows["oracle lengths"]["regrouped"] == 0
    assert "regrouped" not in rows["vllm"]  # vLLM keeps no policy counters
    saved = json.loads((tmp_path / "econoserve_regroup.json").read_text())
    assert saved["claims"][0]["systems"][0]["policy"].endswith("regroup_factor=0.5")
    assert (tmp_path / "econoserve_regroup_regroup.png").stat().st_size > 0
