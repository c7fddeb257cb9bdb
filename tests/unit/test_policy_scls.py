"""SCLS (seed 002): the estimators, the DP batcher, and the slice-executing `scls` policy
make the decisions section 4 describes; every policy test ends with the leak check."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from harness import make_request, make_scheduler, run_to_completion, step

from scheduler_service.core.request import RequestStatus
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.costmodel.factory import build_cost_model
from scheduler_service.policies.scls.batcher import SliceTag, dp_batches, total_serve_time
from scheduler_service.policies.scls.estimator import MemoryEstimator, ServingTimeEstimator
from sluice.contract.plan import KVMoveKind, StepResult

S = 128


def paper_estimator() -> ServingTimeEstimator:
    """HF-like coefficients with d1 and d4 solved so that the paper's Figure 11 comes out:
    15 x 10 tokens + 1 x 1024 tokens take 13.5 s together and 7.6 s apart (T_serve is
    linear in its coefficients, so two equations fix two of them)."""
    p, d2 = (1.5e-5, 0.0, 0.0, 0.02), 5e-4

    def basis(n: int, length: int) -> np.ndarray:
        t = [ServingTimeEstimator(p, (d1, d2, 0.0, d4)).serve_time(n, length, S) for d1, d4 in ((0, 0), (1, 0), (0, 1))]
        return np.array([t[0], t[1] - t[0], t[2] - t[0]])

    together, short, long_ = basis(16, 1024), basis(15, 10), basis(1, 1024)
    apart = short + long_
    a = np.array([together[1:], apart[1:]])
    d1, d4 = np.linalg.solve(a, np.array([13.5 - together[0], 7.6 - apart[0]]))
    return ServingTimeEstimator(p, (float(d1), d2, 0.0, float(d4)))


# ---------------------------------------------------------------- estimators
def test_serve_time_closed_form_equals_prefill_plus_the_sum_of_s_decode_iterations() -> None:
    est = ServingTimeEstimator((1e-5, 2e-3, 3e-5, 0.01), (2e-6, 1e-4, 3e-6, 0.02))
    n, length = 7, 300
    by_sum = est.prefill_time(n, length) + sum(est.decode_time(length + i, n) for i in range(1, S + 1))
    assert est.serve_time(n, length, S) == pytest.approx(by_sum, rel=1e-12)


def test_least_squares_fit_recovers_the_coefficients_of_exact_samples() -> None:
    truth = ServingTimeEstimator((1e-5, 2e-3, 3e-5, 0.01), (2e-6, 1e-4, 3e-6, 0.02))
    grid = [(n, length) for n in (1, 4, 16, 32) for length in (64, 512, 1024)]
    fitted = ServingTimeEstimator.fit(
        [(n, x, truth.prefill_time(n, x)) for n, x in grid], [(n, x, truth.decode_time(x, n)) for n, x in grid]
    )
    assert fitted.p == pytest.approx(truth.p, rel=1e-6)
    assert fitted.d == pytest.approx(truth.d, rel=1e-6)


def test_memory_check_is_padded_rows_of_input_plus_slice_within_zeta_of_the_cache() -> None:
    mem = MemoryEstimator(capacity_tokens=10_000, block_size=16, zeta=0.9)
    assert mem.row_tokens(100, 128) == 240  # 228 rounded up to whole blocks
    assert mem.max_batch(100, 128) == 9_000 // 240
    assert mem.fits(37, 100, 128) and not mem.fits(38, 100, 128)


# ---------------------------------------------------------------- DP batcher
def test_paper_example_batches_the_long_request_apart_7_6_s_instead_of_13_5_s_together() -> None:
    est = paper_estimator()
    lengths = [1024] + [10] * 15
    batches = dp_batches(lengths, S, est, MemoryEstimator(1_000_000), max_batch=64)
    assert sorted(len(b.members) for b in batches) == [1, 15]
    assert [b.padded_len for b in batches] == [10, 1024]
    assert batches[1].members == [0]  # the 1024-token request is alone
    assert total_serve_time(batches) == pytest.approx(7.6)
    assert est.serve_time(16, 1024, S) == pytest.approx(13.5)


def test_paper_example_decision_holds_with_the_estimator_fitted_to_the_llama2_13b_cost_model() -> None:
    est = ServingTimeEstimator.fit_from_cost_model(build_cost_model("profile", "llama-2-13b", "a100-80g"))
    batches = dp_batches([1024] + [10] * 15, S, est, MemoryEstimator(1_000_000), max_batch=64)
    assert sorted(len(b.members) for b in batches) == [1, 15]
    # NOTE: 1.05x here vs the paper's 1.78x: a fused-kernel engine pays little for padded decode rows.
    assert est.serve_time(16, 1024, S) > total_serve_time(batches)


def _brute_force(lengths: list[int], est: ServingTimeEstimator, mem: MemoryEstimator, cap: int) -> float:
    ordered = sorted(lengths)
    n = len(ordered)
    best = float("inf")
    for cuts in itertools.product((False, True), repeat=n - 1):
        bounds = [0, *[i + 1 for i, c in enumerate(cuts) if c], n]
        total = 0.0
        for a, b in itertools.pairwise(bounds):
            size, length = b - a, ordered[b - 1]
            if size > 1 and (size > cap or not mem.fits(size, length, S)):
                break
            total += float(est.serve_time(size, length, S))
        else:
            best = min(best, total)
    return best


def test_dp_is_optimal_over_all_contiguous_partitions_on_small_random_inputs() -> None:
    rng = random.Random(7)
    est = ServingTimeEstimator.fit_from_cost_model(build_cost_model("analytic", "llama-2-13b", "a100-80g"))
    for _ in range(40):
        lengths = [rng.choice((8, 40, 200, 500, 1000, rng.randint(1, 1024))) for _ in range(rng.randint(1, 9))]
        mem = MemoryEstimator(capacity_tokens=rng.choice((2_000, 5_000, 50_000)), block_size=16)
        cap = rng.choice((2, 3, 64))
        batches = dp_batches(lengths, S, est, mem, cap)
        assert sorted(i for b in batches for i in b.members) == list(range(len(lengths)))
        assert total_serve_time(batches) == pytest.approx(_brute_force(lengths, est, mem, cap), rel=1e-9)


def test_dp_never_plans_a_multi_row_batch_over_the_memory_limit_or_the_row_cap() -> None:
    rng = random.Random(3)
    est = paper_estimator()
    mem = MemoryEstimator(capacity_tokens=20_000, block_size=16, zeta=0.9)
    lengths = [rng.randint(1, 1024) for _ in range(500)]
    batches = dp_batches(lengths, S, est, mem, max_batch=24)
    for b in batches:
        assert b.padded_len == max(lengths[i] for i in b.members)
        assert len(b.members) <= 24
        assert len(b.members) == 1 or len(b.members) * mem.row_tokens(b.padded_len, S) <= 0.9 * 20_000


# ---------------------------------------------------------------- slice execution
def test_slice_ends_after_s_iterations_and_returns_unfinished_requests_with_their_tokens() -> None:
    sched = make_scheduler("scls:slice_len=4,batch_size=4")
    short, long_ = make_request("short", 6, 2), make_request("long", 10, 9)
    sched.add_request(short, 0.0)
    sched.add_request(long_, 0.0)
    plan, _ = step(sched, 0.0)  # iteration 1: the padded prefill
    assert plan.num_scheduled_tokens == {"short": 6, "long": 10}
    assert plan.metadata["padded_len"] == 10 and plan.metadata["pad_tokens"] == 4
    step(sched, 0.1)  # iteration 2: short generates its 2nd token and finishes
    assert short.status is RequestStatus.FINISHED_STOPPED
    plan, _ = step(sched, 0.2)  # iteration 3: short's row keeps producing an invalid token
    assert plan.metadata["invalid_tokens"] == 1 and plan.num_scheduled_tokens == {"long": 1}
    step(sched, 0.3)  # iteration 4 = S
    assert long_.num_output_tokens == 4 and long_.status is RequestStatus.DECODING
    sched.schedule(0.4)  # the slice is over: long goes back to the pool
    (back,) = sched.pop_returned()
    assert back is long_ and long_.status is RequestStatus.WAITING
    assert long_.num_computed_tokens == 0 and long_.prefill_len == 14  # prompt + its 4 tokens, prefilled again
    assert sched.policy.stats.returned == 1 and sched.policy.stats.early_returns == 0
    sched.on_step_result(_empty_result(sched), 0.4)
    sched.add_request(long_, 0.5)  # the router places it again
    plan, _ = step(sched, 0.5)
    assert plan.num_scheduled_tokens == {"long": 14}
    serve_with_pool(sched)
    assert long_.status is RequestStatus.FINISHED_STOPPED and long_.policy_state.num_slices == 3
    assert sched.policy.stats.slices_per_request == {1: 1, 3: 1}
    sched.assert_empty()


def _empty_result(sched: Scheduler) -> StepResult:
    return StepResult(sched.plans.step_id, {}, total_s=0.0)


def serve_with_pool(sched: Scheduler) -> None:
    """Steps until done, placing returned requests back on the worker (the router's job)."""
    now = 1.0
    while sched.has_work or sched.returned:
        for req in sched.pop_returned():
            sched.add_request(req, now)
        step(sched, now)
        now += 0.01


def test_a_batch_whose_rows_all_finish_before_s_returns_early() -> None:
    sched = make_scheduler("scls:slice_len=8,batch_size=4")
    for rid, out in (("a", 2), ("b", 3)):
        sched.add_request(make_request(rid, 4, out), 0.0)
    plans = [p for p in run_to_completion(sched) if p.num_scheduled_tokens]
    assert len(plans) == 3  # prefill + 2 decodes, not 8 iterations
    assert sched.policy.stats.early_returns == 1 and sched.policy.stats.returned == 0
    sched.assert_empty()


def test_requests_sharing_a_batch_id_start_together_and_batches_run_in_arrival_order() -> None:
    sched = make_scheduler("scls", num_gpu_blocks=128)
    reqs = {rid: make_request(rid, prompt, 2) for rid, prompt in (("x1", 4), ("y1", 20), ("x2", 8))}
    for rid, req in reqs.items():
        req.policy_state = SliceTag(batch_id=1 if rid.startswith("x") else 2, slice_len=16)
        sched.add_request(req, 0.0)
    plan, _ = step(sched, 0.0)
    assert set(plan.num_scheduled_tokens) == {"x1", "x2"} and plan.metadata["padded_len"] == 8
    step(sched, 0.1)  # both finish with their 2nd token
    plan, _ = step(sched, 0.2)
    assert set(plan.num_scheduled_tokens) == {"y1"}
    run_to_completion(sched)
    sched.assert_empty()


def test_a_slice_reserves_kv_for_input_plus_s_tokens_up_front() -> None:
    sched = make_scheduler("scls:slice_len=8", block_size=4)
    req = make_request("a", 5, 30)
    sched.add_request(req, 0.0)
    step(sched, 0.0)
    assert sched.kv.capacity("a") == 16  # 5 + 8 tokens, rounded up to blocks of 4
    run_to_completion(sched)
    sched.assert_empty()


def test_keep_kv_swaps_a_request_out_at_its_slice_end_when_others_wait_and_back_in_without_recompute() -> None:
    sched = make_scheduler("scls:slice_len=3,keep_kv=true", max_num_seqs=1)
    a, b = make_request("a", 4, 6), make_request("b", 4, 2)
    sched.add_request(a, 0.0)
    sched.add_request(b, 0.0)
    for t in range(3):
        step(sched, t * 0.1)
    assert a.num_output_tokens == 3
    plan, _ = step(sched, 0.3)  # a's slice is over and b waits: a's KV goes to CPU
    assert a.status is RequestStatus.PREEMPTED_SWAPPED and set(plan.num_scheduled_tokens) == {"b"}
    assert [m.kind for m in plan.kv_moves] == [KVMoveKind.SWAP_OUT]
    step(sched, 0.4)  # b finishes
    plan, _ = step(sched, 0.5)
    assert plan.num_scheduled_tokens == {"a": 1} and plan.kv_moves[0].kind is KVMoveKind.SWAP_IN
    run_to_completion(sched)
    assert a.status is RequestStatus.FINISHED_STOPPED and sched.policy.stats.swapped == 1
    sched.assert_empty()


# ---------------------------------------------------------------- end to end
def test_scls_router_and_policy_serve_every_request_in_the_simulator_and_count_each_once() -> None:
    from scheduler_service.sim.simulator import SimConfig, Simulation
    from scheduler_service.workloads import apply_arrivals, load_trace

    cm = build_cost_model("analytic", "llama-2-13b", "a100-80g")
    wl = apply_arrivals(load_trace("sharegpt", num_requests=60, seed=1), "poisson", rate=4.0, seed=1)
    cfg = SimConfig(policy="scls", router="scls:slice_len=64", num_workers=2, max_model_len=16384, max_tokens=512)
    sim = Simulation(cfg, wl, cm)
    run = sim.run()
    assert run.metrics["num_finished"] == run.metrics["num_requests"] == 60
    stats = [s.policy.stats for s in sim.cluster.schedulers.values()]
    assert sum(x.returned for x in stats) > 0  # some requests needed more than one slice
    assert all(abs(v) < 1e-6 for v in sim.cluster.router.loads_s().values())  # every batch's load subtracted
    assert run.details["pad_tokens"] > 0
    for s in sim.cluster.schedulers.values():
        s.assert_empty()


# ---------------------------------------------------------------- fidelity of the estimates
def test_router_estimator_is_fitted_over_the_batch_sizes_the_batcher_forms() -> None:
    """The DP forms batches up to max_num_seqs rows; fitted only up to 64 rows the estimate of a
    256-row slice is off by a fifth, which biases the DP towards large batches."""
    from scheduler_service.policies.scls.router import _estimator
    from scheduler_service.routers import RouterContext
    from sluice.contract.profile import BatchShape

    cm = build_cost_model("analytic", "opt-13b", "a100-80g")
    n, length = 256, 512

    def truth(rows: int) -> float:
        prefill = cm.iteration_time(BatchShape(prefill_chunks=[(length, 0)] * rows))
        return prefill + sum(cm.decode_time(rows, length + i) for i in range(1, S + 1))

    fitted = _estimator(RouterContext(max_num_seqs=256, max_model_len=2048, cost_model=cm))
    assert fitted is not None
    assert float(fitted.serve_time(n, length, S)) == pytest.approx(truth(n), rel=0.05)
    small = ServingTimeEstimator.fit_from_cost_model(cm, max_len=2048, max_batch=64)
    assert abs(float(small.serve_time(n, length, S)) / truth(n) - 1.0) > 0.05


@pytest.mark.parametrize("policy", ["scls:slice_len=8,batch_size=4", "sls:batch_size=4"])
def test_live_rows_of_a_static_batch_decode_at_the_padded_context(policy: str) -> None:
    from scheduler_service.sim.executor import SimulatedExecutor

    cm = build_cost_model("analytic", "opt-13b", "a100-80g")
    sched = make_scheduler(policy, max_model_len=512)
    for rid, prompt in (("short", 10), ("long", 100)):
        sched.add_request(make_request(rid, prompt, 5), 0.0)
    truth = {"short": 5, "long": 5}
    executor = SimulatedExecutor(cm, 1, truth)
    plan = sched.schedule(0.0)
    sched.on_step_result(executor.execute(plan), 0.1)
    plan = sched.schedule(0.1)  # the first decode: both rows at the padded context 100 + 1
    assert plan.metadata["padded_context"] == 101
    result = executor.execute(plan)
    assert result.forward_s == pytest.approx(cm.decode_time(2, 101))
    sched.on_step_result(result, 0.2)
    serve_with_pool(sched)
    sched.assert_empty()
