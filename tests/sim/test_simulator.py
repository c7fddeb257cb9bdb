"""The simulator end to end on slices of the real traces: every request ends (finished or
rejected with a reason), the JSON has exactly DESIGN's keys, runs are deterministic, and
the policies' known orderings show up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scheduler_service.core.metrics import METRIC_KEYS
from scheduler_service.costmodel.base import CostModel
from scheduler_service.costmodel.factory import build_cost_model
from scheduler_service.sim.simulator import SimConfig, simulate
from scheduler_service.workloads import Workload, apply_arrivals, load_trace
from services.cli import main


@pytest.fixture(scope="module")
def cost_model() -> CostModel:
    return build_cost_model("analytic", "llama-2-7b", "a100-80g")


@pytest.fixture(scope="module")
def sharegpt() -> Workload:
    return apply_arrivals(load_trace("sharegpt", num_requests=150), "poisson", rate=2.0, seed=1)


@pytest.mark.parametrize("policy", ["vllm", "vllm_chunked", "sarathi", "orca", "sls"])
def test_every_request_finishes_or_is_rejected_with_a_reason(
    policy: str, cost_model: CostModel, sharegpt: Workload
) -> None:
    run = simulate(SimConfig(policy=policy), sharegpt, cost_model)
    m, d = run.metrics, run.details
    rejected = sum(d["rejected_by_reason"].values())
    assert m["num_requests"] == len(sharegpt)
    assert m["num_finished"] + rejected == len(sharegpt)
    # llama-2-7b has a 4096-token context: longer sharegpt prompts are rejected, and only those
    too_long = sum(1 for r in sharegpt.requests if r.prompt_tokens + 1 > 4096)
    assert d["rejected_by_reason"].get("prompt_too_long", 0) == too_long
    assert tuple(m) == METRIC_KEYS


def test_runs_are_deterministic(cost_model: CostModel, sharegpt: Workload) -> None:
    a = simulate(SimConfig(policy="sarathi"), sharegpt, cost_model).metrics
    b = simulate(SimConfig(policy="sarathi"), sharegpt, cost_model).metrics
    a.pop("sched_overhead_ms"), b.pop("sched_overhead_ms")
    assert a == b


def test_stall_free_batching_bounds_tbt_where_vllm_does_not(cost_model: CostModel, sharegpt: Workload) -> None:
    vllm = simulate(SimConfig(policy="vllm"), sharegpt, cost_model).metrics
    sarathi = simulate(SimConfig(policy="sarathi:budget=512"), sharegpt, cost_model).metrics
    assert sarathi["tbt_s"]["p99"] < 0.5 * vllm["tbt_s"]["p99"]


def test_orca_max_allocation_never_preempts_and_sls_pads(cost_model: CostModel, sharegpt: Workload) -> None:
    orca = simulate(SimConfig(policy="orca"), sharegpt, cost_model)
    sls = simulate(SimConfig(policy="sls"), sharegpt, cost_model)
    assert orca.metrics["preemptions"] == 0
    assert sls.details["pad_tokens"] > 0 and sls.details["invalid_tokens"] > 0


def test_two_workers_split_the_load(cost_model: CostModel, sharegpt: Workload) -> None:
    run = simulate(SimConfig(policy="vllm_chunked", num_workers=2, router="least_work"), sharegpt, cost_model)
    busy = run.details["busy_s_per_worker"]
    assert set(busy) == {"0", "1"} and min(busy.values()) > 0.3 * max(busy.values())
    assert run.metrics["load_imbalance_s"] >= 0.0


def test_cli_simulate_writes_table_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    code = main(
        [
            "simulate", "--trace", "azure-conv", "--policy", "vllm", "--policy", "sarathi", "--model", "llama-2-7b",
            "--hardware", "a100-80g", "--num-requests", "60", "--rate", "3", "--json", str(out), "--plot", str(png),
            "--no-progress",
        ]
    )  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "sarathi" in printed and "TTFT p50" in printed
    runs = json.loads(out.read_text())
    assert [r["policy"] for r in runs] == ["vllm", "sarathi"]
    for run in runs:
        assert {"policy", "workload", "config", "metrics"} <= set(run)
        assert tuple(run["metrics"]) == METRIC_KEYS
    assert png.stat().st_size > 10_000


def test_cli_reports_bad_input_clearly(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--trace", "no-such-trace", "--rate", "1", "--no-progress"]) == 2
    assert "no-such-trace" in capsys.readouterr().err
    assert main(["simulate", "--trace", "sharegpt", "--policy", "nope", "--rate", "1", "--no-progress"]) == 2
    assert "unknown policy 'nope'" in capsys.readouterr().err


def test_prompts_larger_than_the_kv_cache_are_rejected_and_do_not_block_the_queue(cost_model: CostModel) -> None:
    wl = apply_arrivals(load_trace("mooncake", num_requests=40), "poisson", rate=1.0, seed=0)
    run = simulate(SimConfig(policy="vllm", kv_gb=8.0, max_model_len=200_000), wl, cost_model)
    m, d = run.metrics, run.details
    assert d["rejected_by_reason"].get("exceeds_kv_capacity", 0) > 0
    assert m["num_finished"] + sum(d["rejected_by_reason"].values()) == 40
    assert 0 < d["window_s"] < 1e6 and m["throughput_tok_s"] > 0


def test_cpu_overhead_model_adds_its_cost_to_every_step(cost_model: CostModel) -> None:
    one = apply_arrivals(load_trace("sharegpt", num_requests=1), "poisson", rate=1.0, seed=0)
    base = simulate(SimConfig(policy="sarathi:budget=512", overlap=False), one, cost_model)
    slow = simulate(
        SimConfig(policy="sarathi:budget=512", step_overhead_s=0.002, seq_overhead_s=0.001, overlap=False),
        one,
        cost_model,
    )
    steps = base.details["num_steps"]
    assert slow.details["num_steps"] == steps  # one request: the same steps, each 3 ms dearer
    extra = slow.metrics["jct_s"]["p50"] - base.metrics["jct_s"]["p50"]
    assert abs(extra - steps * 0.003) < 1e-6


def test_new_sequence_overhead_is_paid_once_per_prefill_that_starts(cost_model: CostModel) -> None:
    """The per-new-sequence term prices a request's admission into the engine: once, in the
    step its prefill starts, not in its later chunks or decodes."""
    one = apply_arrivals(load_trace("sharegpt", num_requests=1), "poisson", rate=1.0, seed=0)
    assert one.requests[0].prompt_tokens > 32  # a prefill of several chunks
    policy = "sarathi:budget=32"
    base = simulate(SimConfig(policy=policy), one, cost_model)
    admitted = simulate(SimConfig(policy=policy, new_seq_overhead_s=0.005), one, cost_model)
    assert admitted.details["num_steps"] == base.details["num_steps"] > 2
    for metric in ("ttft_s", "jct_s"):
        assert admitted.metrics[metric]["p50"] - base.metrics[metric]["p50"] == pytest.approx(0.005, abs=1e-9)


def test_swap_costs_add_a_per_block_copy_cost_and_a_stall_to_each_swapping_step(cost_model: CostModel) -> None:
    from scheduler_service.sim.executor import SimulatedExecutor
    from sluice.contract.plan import CachedRequestData, KVMove, KVMoveKind, StepPlan

    layers = cost_model.model.num_layers
    plain = SimulatedExecutor(cost_model, 1 << 20, {})
    dear = SimulatedExecutor(cost_model, 1 << 20, {}, swap_costs=(2 * layers * 5e-6, 1e-3))
    move = KVMove(KVMoveKind.SWAP_OUT, "r", tuple(range(10)), tuple(range(10)))
    plan = StepPlan(1, 0, (), CachedRequestData(), {}, frozenset(), kv_moves=(move,))
    base, extra = plain.execute(plan).swap_s, dear.execute(plan).swap_s
    assert base == pytest.approx(cost_model.swap_time(10 << 20))
    assert extra - base == pytest.approx(10 * 2 * layers * 5e-6 + 1e-3)
    # the simulator turns the per-copy knob into the per-block cost (2 x layers copies a block)
    one = apply_arrivals(load_trace("sharegpt", num_requests=40), "poisson", rate=50.0, seed=0)
    cheap = simulate(SimConfig(policy="vllm:preemption_mode=swap", kv_gb=2.0), one, cost_model)
    costly = simulate(
        SimConfig(policy="vllm:preemption_mode=swap", kv_gb=2.0, swap_copy_overhead_s=5e-6, swap_stall_s=1e-3),
        one,
        cost_model,
    )
    assert cheap.details["swap_bytes"] > 0
    assert costly.metrics["jct_s"]["mean"] > cheap.metrics["jct_s"]["mean"]


def test_named_swap_costs_price_as_their_numbers_and_the_measured_worker_swaps_cheaper(cost_model: CostModel) -> None:
    one = apply_arrivals(load_trace("sharegpt", num_requests=40), "poisson", rate=50.0, seed=0)
    swap = {"policy": "vllm:preemption_mode=swap", "kv_gb": 2.0}
    by_hand = simulate(SimConfig(**swap, swap_copy_overhead_s=5e-6, swap_stall_s=1e-3), one, cost_model)
    named = simulate(SimConfig(**swap, swap_costs="vllm-v0"), one, cost_model)
    measured = simulate(SimConfig(**swap, swap_costs="sluice-h100"), one, cost_model)
    free = simulate(SimConfig(**swap, swap_costs="none"), one, cost_model)
    assert named.metrics["jct_s"] == by_hand.metrics["jct_s"]
    assert free.metrics["jct_s"]["mean"] < measured.metrics["jct_s"]["mean"] < named.metrics["jct_s"]["mean"]
    with pytest.raises(ValueError, match="--swap-costs must be one of"):
        SimConfig(**swap, swap_costs="h100").validate()
    with pytest.raises(ValueError, match="give one or the other"):
        SimConfig(**swap, swap_costs="vllm-v0", swap_stall_s=1e-3).validate()


def test_overlap_hides_the_cpu_overhead_behind_the_previous_step(cost_model: CostModel) -> None:
    """Overlapped scheduling: each step is planned while the previous one runs, so a CPU
    overhead shorter than a step costs only the first step from idle; one extra step (planned
    ahead of the request's last token, its token discarded) runs at the end."""
    one = apply_arrivals(load_trace("sharegpt", num_requests=1), "poisson", rate=1.0, seed=0)
    policy = "sarathi:budget=512"
    base = simulate(SimConfig(policy=policy, overlap=False), one, cost_model)
    slow = simulate(SimConfig(policy=policy, step_overhead_s=0.003, overlap=False), one, cost_model)
    hidden = simulate(SimConfig(policy=policy, step_overhead_s=0.003, overlap=True), one, cost_model)
    steps = base.details["num_steps"]
    assert hidden.details["num_steps"] == steps + 1
    assert hidden.metrics["num_finished"] == 1
    assert hidden.metrics["jct_s"]["p50"] - base.metrics["jct_s"]["p50"] == pytest.approx(0.003, abs=1e-6)
    assert slow.metrics["jct_s"]["p50"] - base.metrics["jct_s"]["p50"] == pytest.approx(steps * 0.003, abs=1e-6)
    # an overhead fitted to what overlapped live steps still showed is not hidden a second time
    kept = simulate(
        SimConfig(policy=policy, step_overhead_s=0.003, overlap=True, overlap_hides_overhead=False), one, cost_model
    )
    assert kept.metrics["jct_s"]["p50"] == pytest.approx(slow.metrics["jct_s"]["p50"], abs=1e-6)


def test_overlap_in_the_simulator_finishes_every_request_of_a_trace(cost_model: CostModel, sharegpt: Workload) -> None:
    base = simulate(SimConfig(policy="vllm", step_overhead_s=0.002, overlap=False), sharegpt, cost_model)
    over = simulate(SimConfig(policy="vllm", step_overhead_s=0.002, overlap=True), sharegpt, cost_model)
    assert over.metrics["num_finished"] == base.metrics["num_finished"]
    assert over.metrics["jct_s"]["p50"] < base.metrics["jct_s"]["p50"]
