"""Each paper policy reports, in `details.policy_stats` (and SCLS's router in
`details.router_stats`), a counter per mechanism of its paper, and each counter moves when,
and only when, its mechanism fires: a reproduction can then show that a mechanism ran."""

from __future__ import annotations

from scheduler_service.costmodel.factory import build_cost_model
from scheduler_service.sim.simulator import SimConfig, Simulation
from scheduler_service.sim.slo_profiles import apply_slo_profile
from scheduler_service.workloads import Workload, apply_arrivals, load_trace
from scheduler_service.workloads.base import TraceRequest

CM = build_cost_model("analytic", "opt-13b", "a100-80g")


def _trace(name: str, n: int, rate: float, profile: str | None = None) -> Workload:
    wl = apply_arrivals(load_trace(name, num_requests=n, seed=1), "poisson", rate=rate, seed=1)
    return apply_slo_profile(profile, wl, CM, 1) if profile else wl


def _stats(cfg: SimConfig, wl: Workload) -> tuple[dict, dict]:  # type: ignore[type-arg]
    run = Simulation(cfg, wl, CM).run()
    return run.details["policy_stats"].get("0", {}), run.details["router_stats"]


def test_alise_counts_ewt_swap_outs_apart_from_forced_evictions() -> None:
    wl = _trace("sharegpt", 80, 4.0)
    tight, _ = _stats(SimConfig(policy="alise", kv_gb=2, length_source="noisy_oracle"), wl)
    # a 2 GB cache cannot hold the load: forced evictions, and Algorithm 2's proactive swaps
    assert tight["forced_swap_outs"] > 0
    assert tight["ewt_swap_outs"] > 0 and tight["ewt_early_swap_ins"] > 0
    assert tight["mispredictions"] > 0  # noisy lengths under-predict some jobs
    roomy, _ = _stats(SimConfig(policy="alise", kv_gb=40, length_source="oracle"), wl)
    # the whole load fits and the lengths are exact: no eviction of either kind, no misprediction
    assert roomy.get("forced_swap_outs", 0) == roomy.get("ewt_swap_outs", 0) == roomy.get("mispredictions", 0) == 0


def _prefill_heavy(n: int, rate: float) -> Workload:
    reqs = [TraceRequest(f"r{i}", i / rate, 1800, 8) for i in range(n)]
    return apply_slo_profile("accelgen", Workload("prefill-heavy", reqs), CM, 0)


def test_accelgen_counts_budget_binding_steps_and_algorithm2_placements() -> None:
    heavy_wl = _prefill_heavy(40, 30.0)
    paper = SimConfig(policy="accelgen:price_in_time=false", kv_gb=20, block_size=32)
    heavy, _ = _stats(paper, heavy_wl)
    # a burst of 1,800-token prompts against an Eq. 6 budget of ~1,800: the budget binds and cuts them
    assert heavy["budget_bound_steps"] > 0
    assert heavy["forward_tokens"] <= heavy["budget_tokens"]
    assert heavy.get("price_in_time_cuts", 0) == 0  # off in the paper's line
    assert heavy.get("alg2_prompt_chunks", 0) + heavy.get("alg2_decodes", 0) == heavy["alg2_placements"]
    timed, _ = _stats(SimConfig(policy="accelgen", kv_gb=20, block_size=32), heavy_wl)
    # on, the running decodes' TBT SLO stops prompt chunks before the TTFT-sized budget does
    assert timed["price_in_time_cuts"] > 0
    light, _ = _stats(paper, _trace("econoserve-alpaca", 40, 0.5, "accelgen"))
    # short prompts arriving slowly never fill a budget
    assert light["steps"] > 0 and light["budget_bound_steps"] == 0


def test_accelgen_algorithm2_places_requests_outside_the_urgent_set() -> None:
    wl = _trace("accelgen-mix", 60, 1.0, "accelgen")
    stats, _ = _stats(SimConfig(policy="accelgen", kv_gb=12, block_size=32), wl)
    assert stats["alg2_placements"] > 0
    assert stats["alg2_placements"] == stats.get("alg2_prompt_chunks", 0) + stats.get("alg2_decodes", 0)


def test_scls_counts_slices_reprefills_and_the_deepspeed_memory_caps() -> None:
    wl = _trace("econoserve-sharegpt", 150, 20.0)  # short prompts, many at once: Eq. 9 allows large batches
    eq9, eq9_router = _stats(SimConfig(policy="scls", router="scls", num_workers=2, kv_gb=30), wl)
    _, ds_router = _stats(SimConfig(policy="scls", router="scls:memory_rule=deepspeed", num_workers=2, kv_gb=30), wl)
    assert eq9["slices"] > 0 and eq9["returned_to_pool"] > 0
    # a request back from the pool prefills its prompt and generated tokens again
    assert eq9["reprefill_tokens"] > 0
    # the DeepSpeed rule (at most 12/22/28 rows) caps batches that Eq. 9 alone would let grow
    assert ds_router["memory_capped_batches"] > eq9_router["memory_capped_batches"]
    assert ds_router["rows"] / ds_router["batches"] <= 28
    assert ds_router["rows"] / ds_router["batches"] < eq9_router["rows"] / eq9_router["batches"]


def test_scls_with_one_slice_per_request_reprefills_nothing() -> None:
    reqs = [TraceRequest(f"r{i}", 0.1 * i, 100, 20) for i in range(20)]  # every answer fits one slice
    stats, _ = _stats(SimConfig(policy="scls", router="scls", num_workers=1, kv_gb=10), Workload("short", reqs))
    assert stats["slices"] > 0 and stats["reprefill_tokens"] == 0 and stats["returned_to_pool"] == 0


def test_every_paper_policy_reports_counters() -> None:
    wl = _trace("econoserve-sharegpt", 30, 4.0, "econoserve")
    for policy in ("alise", "accelgen", "econoserve", "scls", "fastserve"):
        router = "scls" if policy == "scls" else "round_robin"
        stats, _ = _stats(SimConfig(policy=policy, router=router, kv_gb=4, block_size=32), wl)
        assert stats, policy


def test_deepspeed_rule_is_the_papers_algorithm_2() -> None:
    from scheduler_service.policies.scls.estimator import MemoryEstimator, deepspeed_max_rows

    # L + S: > 1,024 -> 12 rows, > 512 -> 22, else 28 (S = 128)
    assert [deepspeed_max_rows(n, 128) for n in (384, 385, 896, 897, 1024)] == [28, 22, 22, 12, 12]
    huge = MemoryEstimator(10**7, 16, 0.9, deepspeed=True)
    assert huge.max_batch(100, 128) == 28 and huge.fits(28, 100, 128) and not huge.fits(29, 100, 128)
    assert MemoryEstimator(10**7, 16, 0.9).fits(29, 100, 128)  # Eq. 9 alone


def test_econoserve_counts_prompt_admissions_by_rule_and_kvcpipe_lends() -> None:
    wl = _trace("econoserve-sharegpt", 120, 6.0, "econoserve")
    paper, _ = _stats(SimConfig(policy="econoserve", kv_gb=2, block_size=32, length_source="oracle"), wl)
    assert paper["pt_reserve_admissions"] > 0 and paper.get("pt_pool_admissions", 0) == 0
    assert paper["pipe_guests"] > 0  # KVCPipe lent a host's unused tail
    pool, _ = _stats(
        SimConfig(
            policy="econoserve:pt_reserve_only=false,admit_future=1,pipe=false",
            kv_gb=2,
            block_size=32,
            length_source="oracle",
        ),
        wl,
    )
    assert pool["pt_pool_admissions"] > 0 and pool.get("pt_reserve_admissions", 0) == 0
    assert pool.get("pipe_guests", 0) == 0  # lending switched off
