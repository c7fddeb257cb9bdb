"""The one-command reproductions (sluice_bench.repro, run as benchmarks/repro.py): equal
resources for every system of a claim,
steady-state measurement with the warm-up excluded, capacity that stops at its floor."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
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
            # two labelled comparisons, both between systems of the claim, no "ours" line in either
            kinds = {c.kind for c in claim.comparisons}
            assert kinds == {repro.PUBLISHED, repro.EQUAL_ENGINE}, (paper, claim.name)
            by_label = {s.label: s for s in claim.systems}
            for c in claim.comparisons:
                assert not by_label[c.system].ours and not by_label[c.baseline].ours
            # the paper's line of AccelGen sizes chunks by Eq. 6 alone (our time pricing off)
            for s in claim.systems:
                if s.policy.startswith("accelgen") and not s.ours and "chunk=false" not in s.policy:
                    assert "price_in_time=false" in s.policy
    scls = repro.PAPERS["scls"]()[0]
    assert scls.baseline.startswith("fastgen") and "vllm" not in [s.label for s in scls.systems]
    assert scls.max_input == scls.max_output == 1024  # the paper's limits
    assert "memory_rule=deepspeed" in next(s.router for s in scls.systems if s.label == "scls")


def test_seeds_vary_the_lengths_of_every_trace_format(repro: ModuleType) -> None:
    for trace in ("sharegpt", "econoserve-sharegpt"):  # a CSV file and a generator
        a, b = (repro.sample_trace(trace, 50, seed) for seed in (0, 1))
        assert [r.prompt_tokens for r in a.requests] != [r.prompt_tokens for r in b.requests], trace
        again = repro.sample_trace(trace, 50, 0)
        assert [r.prompt_tokens for r in again.requests] == [r.prompt_tokens for r in a.requests], trace
    cut = repro.truncate(repro.sample_trace("sharegpt", 200, 0), 1024, 1024)
    assert max(r.prompt_tokens for r in cut.requests) == 1024 and max(r.output_tokens for r in cut.requests) <= 1024


def test_int8_resident_kv_doubles_tokens_in_the_same_bytes(repro: ModuleType) -> None:
    claim = next(c for c in repro.PAPERS["alise"]() if c.name == "sharegpt")
    setup = repro.Setup(20.0, 0.2, 30)
    rows = {s.label: repro.run_one(claim, s, 1.0, 0, setup) for s in claim.systems if s.label in ("alise", "vllm")}
    # the same workload fills half the share of a KV pool that holds twice the tokens
    assert rows["alise"]["kv_util_mean"] < rows["vllm"]["kv_util_mean"]
    assert rows["alise"]["counters"]  # ALISE's mechanism counters reach the row


def test_quick_run_writes_rows_a_plot_and_the_json(repro: ModuleType, tmp_path: Path) -> None:
    results = repro.main(["sarathi", "--quick", "--out", str(tmp_path)])
    (claim,) = results["claims"]
    assert {r["system"] for r in claim["rows"]} == {"sarathi", "vllm"}
    assert [c["kind"] for c in claim["comparisons"]] == ["published", "equal-engine"]
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


def _run(seeds: list[int], rates: list[float], latency: dict[tuple[str, float, int], float]) -> dict:
    """A saved repro.py result of the econoserve claim with the given rows (normalized latency only)."""
    rows = [
        {"system": s, "rate": r, "seed": k, "num_finished": 10, "normalized_latency_s": v, "tbt_p99_s": 0}
        | {"queue_p50_s": 0}
        for (s, r, k), v in latency.items()
    ]
    systems = [{"label": s} for s in dict.fromkeys(s for s, _, _ in latency)]
    setup = {"duration_s": 300.0, "warmup_share": 0.2, "seeds": seeds, "rates": rates}
    claim = {"claim": "capacity", "setup": setup, "systems": systems, "comparisons": [], "rows": rows}
    return {"paper": "econoserve", "command": f"run {seeds}", "claims": [claim]}


def test_runs_of_other_seeds_merge_and_capacity_reads_only_rates_every_seed_ran(repro: ModuleType) -> None:
    seed0 = _run([0], [1.0, 2.0, 3.0], {("vllm", 1.0, 0): 0.01, ("vllm", 2.0, 0): 0.02, ("vllm", 3.0, 0): 0.03})
    seed0["claims"][0]["comparisons"] = [{"kind": "published", "system": "vllm", "baseline": "vllm", "note": ""}]
    # seeds 1-2 at 1 and 2 req/s only; seed 1 breaks the bound at 2 req/s, so the mean does too
    later = _run(
        [1, 2], [1.0, 2.0], {("vllm", r, k): (0.9 if (r, k) == (2.0, 1) else 0.01) for r in (1.0, 2.0) for k in (1, 2)}
    )
    merged = repro.merge_results([seed0, later])
    (res,) = merged["claims"]
    assert res["setup"]["seeds"] == [0, 1, 2] and res["setup"]["rates"] == [1.0, 2.0, 3.0]
    assert len(res["rows"]) == 7 and res["comparisons"]  # the comparisons of the run that had them
    assert repro.complete_rates(res, "vllm") == [1.0, 2.0]  # 3 req/s ran on seed 0 alone
    claim = repro.PAPERS["econoserve"]()[0]
    caps = repro.combine_capacities(res, claim, 0.2)["capacity"]
    # seed 0 alone held at 3 req/s; over the three seeds 2 req/s fails (mean 0.31) and 3 is not judged
    assert caps["vllm"]["capacity"] == 1.0 and caps["vllm"]["rates"] == [1.0, 2.0]
    # the same row twice is one row; a row that differs between runs is refused
    assert len(repro.merge_results([seed0, seed0])["claims"][0]["rows"]) == 3
    other = _run([0], [1.0], {("vllm", 1.0, 0): 0.011})
    with pytest.raises(ValueError, match="differs"):
        repro.merge_results([seed0, other])
    longer = _run([1], [1.0], {("vllm", 1.0, 1): 0.01})
    longer["claims"][0]["setup"]["duration_s"] = 600.0
    with pytest.raises(ValueError):
        repro.merge_results([seed0, longer])


def test_duration_overrides_the_claims_own_and_name_names_the_files(repro: ModuleType, tmp_path: Path) -> None:
    # ALISE's ShareGPT claim runs 600 s of arrivals unless told otherwise
    argv = ["alise", "--claim", "sharegpt", "--systems", "vllm", "--rates", "1", "--seeds", "1", "--refine", "0"]
    argv += ["--duration", "30", "--min-requests", "10", "--name", "short", "--out", str(tmp_path)]
    results = repro.main(argv)
    (claim,) = results["claims"]
    assert claim["setup"]["duration_s"] == 30.0
    (row,) = claim["rows"]
    assert row["num_requests"] == 30  # 1 req/s x 30 s, not 600
    assert json.loads((tmp_path / "short.json").read_text())["claims"][0]["setup"]["duration_s"] == 30.0
