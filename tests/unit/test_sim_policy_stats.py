"""The simulator exports what each worker's policy counted about its own decisions
(`details["policy_stats"]`), so reports can show e.g. EconoServe's regroups next to the metrics."""

from __future__ import annotations

import json
from pathlib import Path

from scheduler_service.costmodel.factory import build_cost_model
from scheduler_service.sim.report import write_json
from scheduler_service.sim.simulator import SimConfig, Simulation
from scheduler_service.sim.slo_profiles import apply_slo_profile
from scheduler_service.workloads import apply_arrivals, load_trace


def _workload(cm, n: int = 60):  # type: ignore[no-untyped-def]
    base = load_trace("econoserve-sharegpt", num_requests=n, seed=1)
    return apply_slo_profile("econoserve", apply_arrivals(base, "poisson", rate=6.0, seed=1), cm, 1)


def test_econoserve_counters_reach_the_result_json(tmp_path: Path) -> None:
    cm = build_cost_model("analytic", "opt-13b", "a100-80g")
    cfg = SimConfig(policy="econoserve", kv_gb=2, block_size=32, length_source="noisy_oracle", length_error=0.4)
    sim = Simulation(cfg, _workload(cm), cm)
    run = sim.run()
    exported = run.details["policy_stats"]
    assert list(exported) == ["0"]  # one worker, keyed by its id
    stats = exported["0"]
    assert stats == sim.cluster.schedulers[0].policy.stats_report()  # the policy's own report, unchanged
    # 40% noise under-predicts some requests: the misprediction path ran and was counted
    assert stats["mispredicted_kept"] > 0
    assert stats["regrouped"] > 0
    assert stats["requests_logged"] == run.metrics["num_finished"] == 60
    out = tmp_path / "run.json"
    write_json([run], out)
    assert json.loads(out.read_text())["details"]["policy_stats"]["0"]["regrouped"] == stats["regrouped"]


def test_a_policy_without_counters_exports_none_and_each_worker_is_keyed() -> None:
    cm = build_cost_model("analytic", "opt-13b", "a100-80g")
    wl = _workload(cm, 40)
    vllm = Simulation(SimConfig(policy="vllm", kv_gb=2, block_size=32), wl, cm).run()
    assert vllm.details["policy_stats"] == {}
    two = Simulation(SimConfig(policy="econoserve", kv_gb=2, block_size=32, num_workers=2), wl, cm).run()
    assert set(two.details["policy_stats"]) == {"0", "1"}
    assert sum(s["requests_logged"] for s in two.details["policy_stats"].values()) == two.metrics["num_finished"]
