"""The simulator with a prefill pool and a decode pool: every request finishes, transfers are
priced on the network link (faster links, shorter transfers), failed or slow transfers fall
back to recomputing on the decode side, and no KV is left on either pool."""

from __future__ import annotations

import pytest

from scheduler_service.core.slo import SLOSpec
from scheduler_service.costmodel.base import CostModel
from scheduler_service.costmodel.factory import build_cost_model
from scheduler_service.sim.disagg_search import cheapest_split, goodput
from scheduler_service.sim.network import load_network
from scheduler_service.sim.simulator import SimConfig, Simulation, simulate
from scheduler_service.workloads import Workload, apply_arrivals, load_trace
from services.cli import main


@pytest.fixture(scope="module")
def cost_model() -> CostModel:
    return build_cost_model("analytic", "llama-2-7b", "a100-80g")


@pytest.fixture(scope="module")
def arxiv() -> Workload:
    return apply_arrivals(load_trace("arxiv", num_requests=80), "poisson", rate=3.0, seed=1)


def run(cost_model: CostModel, workload: Workload, **kw):
    config = SimConfig(policy=kw.pop("policy", "vllm"), prefill_workers=2, decode_workers=2, **kw)
    sim = Simulation(config, workload, cost_model)
    result = sim.run()
    for sched in sim.cluster.schedulers.values():
        sched.assert_empty()
    sim.kv.assert_empty()
    return result


def finished_all(result, workload: Workload) -> None:
    rejected = sum(result.details["rejected_by_reason"].values())
    assert result.metrics["num_requests"] == len(workload)
    assert result.metrics["num_finished"] + rejected == len(workload)


@pytest.mark.parametrize("policy", ["vllm", "sarathi", "econoserve"])
def test_every_request_finishes_and_each_is_moved_once(cost_model, arxiv, policy: str) -> None:
    result = run(cost_model, arxiv, policy=policy)
    finished_all(result, arxiv)
    d = result.details["disagg"]
    moved = result.metrics["num_finished"] - sum(1 for r in arxiv.requests if min(r.output_tokens, 4096) <= 1)
    assert d["transfers"] == d["succeeded"] >= moved - 2 and d["recomputed"] == 0
    assert d["prefill_workers"] == 2 and d["decode_workers"] == 2
    # decode workers never prefill a prompt: every prompt token was computed on the prefill pool
    busy = result.details["busy_s_per_worker"]
    assert set(busy) == {"0", "1", "2", "3"}
    fit = [r for r in arxiv.requests if r.prompt_tokens + 1 < 4096]
    assert result.details["output_tokens"] == sum(max(1, min(r.output_tokens, 4096 - r.prompt_tokens)) for r in fit)


def test_transfers_are_priced_by_the_link(cost_model, arxiv) -> None:
    nvlink = run(cost_model, arxiv, network="nvlink").details["disagg"]
    ethernet = run(cost_model, arxiv, network="ethernet").details["disagg"]
    assert nvlink["bytes"] == ethernet["bytes"] > 0
    assert ethernet["transfer_s_p50"] > 20 * nvlink["transfer_s_p50"]
    int8 = run(cost_model, arxiv, network="ethernet", int8_transfer=True).details["disagg"]
    assert int8["bytes"] * 2 == pytest.approx(ethernet["bytes"], rel=0.01)


def test_failed_and_slow_transfers_fall_back_to_recomputing_on_the_decode_worker(cost_model, arxiv) -> None:
    failing = run(cost_model, arxiv, transfer_failure_rate=0.5)
    finished_all(failing, arxiv)
    d = failing.details["disagg"]
    assert 0 < d["failed"] == d["recomputed"] < d["transfers"]
    slow = run(cost_model, arxiv, network="ethernet", transfer_timeout_s=1e-4)
    finished_all(slow, arxiv)
    d = slow.details["disagg"]
    assert d["succeeded"] == 0 and d["failed"] == d["recomputed"] == d["transfers"] > 0


def test_network_links_come_from_the_measured_tables() -> None:
    nvlink, ib, pcie = (load_network(n, "a100") for n in ("nvlink", "infiniband", "pcie"))
    assert nvlink.bandwidth_bps > 10 * ib.bandwidth_bps > 10 * pcie.bandwidth_bps > 0
    assert load_network("nvlink", "h100").bandwidth_bps > nvlink.bandwidth_bps
    assert nvlink.transfer_time(2**30) == pytest.approx(nvlink.latency_s + 2**30 / nvlink.bandwidth_bps)
    with pytest.raises(ValueError, match="unknown network"):
        load_network("carrier-pigeon")


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--prefill-workers", "2"], "--prefill-workers and --decode-workers go together"),
        (["--prefill-workers", "1", "--decode-workers", "1", "--network", "wifi"], "--network must be one of"),
        (["--prefill-workers", "1", "--decode-workers", "1", "--transfer-failure-rate", "2"], "failure-rate"),
    ],
)
def test_bad_disaggregation_flags_are_refused_naming_them(capsys, flags: list[str], says: str) -> None:
    assert main(["simulate", "--trace", "arxiv", "--num-requests", "5", "--rate", "1", "--no-progress", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and says in err and "\n" not in err


def test_the_cheapest_split_is_the_smallest_that_meets_the_target(cost_model, arxiv) -> None:
    busy = apply_arrivals(load_trace("arxiv", num_requests=60), "poisson", rate=8.0, seed=1)
    wl = busy.with_slos([SLOSpec(ttft_s=1.0, tbt_s=0.05)] * len(busy), "test")

    def run_split(prefill: int, decode: int):
        return simulate(SimConfig(policy="vllm", prefill_workers=prefill, decode_workers=decode), wl, cost_model)

    search = cheapest_split(run_split, target=0.9, max_workers=4)
    assert search.best is not None and search.best.attainment >= 0.9
    size = search.best.prefill + search.best.decode
    # every split of a smaller size was tried and missed; nothing larger was tried
    smaller = [t for t in search.tried if t.prefill + t.decode < size]
    assert len(smaller) == sum(n - 1 for n in range(2, size)) and all(t.attainment < 0.9 for t in smaller)
    assert all(t.prefill + t.decode <= size for t in search.tried)
    # a single-GPU-per-pool split cannot serve this load: the search had to grow
    assert size > 2
    hopeless = cheapest_split(run_split, target=1.01, max_workers=2)
    assert hopeless.best is None and len(hopeless.tried) == 1


def test_goodput_per_gpu_is_the_search_rate_over_the_gpus(cost_model) -> None:
    base = load_trace("arxiv", num_requests=40).with_slos([SLOSpec(ttft_s=1.0, tbt_s=0.05)] * 40, "test")

    def run_at(rate: float):
        run = simulate(
            SimConfig(policy="vllm", prefill_workers=1, decode_workers=1),
            apply_arrivals(base, "poisson", rate=rate),
            cost_model,
        )
        run.config["rate"] = rate
        return run

    result = goodput(run_at, 2, start_rate=1.0, rel_tol=0.2, max_probes=8)
    assert result.rate_req_s > 0 and result.per_gpu == result.rate_req_s / 2
    held = [rate for rate, ok in result.capacity.probes if ok]
    assert max(held) == result.rate_req_s
    assert result.capacity.run_at_capacity.metrics["slo_attainment_req"] >= 0.9


def test_overlap_asked_of_a_disaggregated_cluster_runs_it_one_step_at_a_time(cost_model, arxiv) -> None:
    # a prefill worker hands a request off when its prefill is answered; a plan made one step
    # ahead would have scheduled its decode already, so the pools never plan ahead
    plain = run(cost_model, arxiv, step_overhead_s=0.002)
    asked = run(cost_model, arxiv, step_overhead_s=0.002, overlap=True)
    finished_all(asked, arxiv)
    assert asked.metrics["jct_s"] == plain.metrics["jct_s"]
    assert asked.details["disagg"] == plain.details["disagg"]
