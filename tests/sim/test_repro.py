"""The one-command reproductions (benchmarks/repro.py): equal resources for every system of a
claim, steady-state measurement with the warm-up excluded, capacity that stops at its floor."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

from tqdm import tqdm


def test_every_paper_compares_its_systems_on_one_setup_with_its_own_baseline(repro: ModuleType) -> None:
    for paper, claims in repro.PAPERS.items():
        for claim in claims():
            labels = [s.label for s in claim.systems]
            assert claim.baseline in labels, (paper, claim.name)
            for system in claim.systems:
                # a system may only bring settings of its own design, never more KV or another model
                assert not {"kv_gb", "block_size", "int8_swap", "num_workers", "max_model_len"} & set(system.extra)
            assert any(not s.ours for s in claim.systems if s.label.startswith(paper[:4]))
    scls = repro.PAPERS["scls"]()[0]
    assert scls.baseline == "fastgen" and "vllm" not in [s.label for s in scls.systems]


def test_quick_run_writes_rows_a_plot_and_the_json(repro: ModuleType, tmp_path: Path) -> None:
    results = repro.main(["sarathi", "--quick", "--out", str(tmp_path)])
    (claim,) = results["claims"]
    assert {r["system"] for r in claim["rows"]} == {"sarathi", "vllm"}
    for row in claim["rows"]:
        assert 0 < row["num_measured"] < row["num_requests"]  # the warm-up's arrivals are left out
        assert row["kv_used_mean"] <= row["kv_util_mean"]
    assert (tmp_path / "sarathi_capacity.png").stat().st_size > 0
    assert json.loads((tmp_path / "sarathi.json").read_text())["paper"] == "sarathi"


def test_capacity_stops_at_the_floor_instead_of_halving(repro: ModuleType) -> None:
    claim = repro.PAPERS["econoserve"]()[0]
    system = claim.systems[0]
    rows = [
        {"rate": r, "num_finished": 10, "normalized_latency_s": 1.0, "tbt_p99_s": 0, "queue_p50_s": 0}
        for r in claim.rates
    ]
    with tqdm(disable=True) as bar:
        cap = repro.capacity(claim, system, rows, 0.5, None, [0], refine=3, bar=bar)
    assert cap["below_floor"] and cap["floor"] == claim.rates[0] and cap["probes"] == []
    rows[0]["normalized_latency_s"] = 0.1
    rows[1]["normalized_latency_s"] = 0.2
    with tqdm(disable=True) as bar:
        cap = repro.capacity(claim, system, rows, 0.5, None, [0], refine=0, bar=bar)
    assert cap["capacity"] == claim.rates[1] and not cap["below_floor"]


def test_find_capacity_stops_at_its_floor() -> None:
    from scheduler_service.sim.capacity import SLORule, find_capacity
    from scheduler_service.sim.simulator import SimRun

    probed: list[float] = []

    def run_at(rate: float) -> SimRun:
        probed.append(rate)
        metrics = {"num_finished": 1, "normalized_latency_s": 1.0}  # never within the bound
        return SimRun("p", "w", {"rate": rate}, metrics, {})

    result = find_capacity(run_at, SLORule("norm_latency", 0.5), None, start_rate=1.0, floor=0.2)
    assert result.below_floor and result.capacity_req_s == 0.0
    assert min(probed) >= 0.2 and len(probed) == 3  # 1, 0.5, 0.25; never below the floor
