"""EconoServe makes the decisions its paper describes (seed 001, section 3); each test ends
with the leak check."""

from __future__ import annotations

import pytest
from harness import make_request, make_scheduler, run_to_completion, step

from kvstore.accounting import AllocationMode, required_tokens
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.slo import SLOSpec
from scheduler_service.costmodel.factory import build_cost_model
from scheduler_service.policies.econoserve.queues import OrderingConfig, PTQueue, ordering_key
from scheduler_service.sim.simulator import SimConfig, Simulation
from scheduler_service.sim.slo_profiles import apply_slo_profile
from scheduler_service.workloads import apply_arrivals, load_trace
from sluice.contract.plan import KVMoveKind

# Figure 7 in tokens: block_size 1, no padding, buffer or reserve, so 1 block = 1 token; with
# no reserve, prompts take any free KV (`pt_reserve_only=false`) so both start in one step.
PIPE = "econoserve:padding=0,buffer=0,reserve=0,pt_reserve_only=false,admit_future=0,group_tokens=1,tfs=64"


def predicted(rid: str, prompt: int, output: int, prediction: int, **kw: object) -> Request:
    req = make_request(rid, prompt, output, **kw)  # type: ignore[arg-type]
    req.predicted_output_tokens = prediction
    return req


def add(sched: Scheduler, *reqs: Request) -> None:
    for req in reqs:
        sched.add_request(req, 0.0)


def table(sched: Scheduler, rid: str) -> list[int]:
    return list(sched.kv.gpu_tables.get(rid, []))


# ---------------------------------------------------------------- KVCPipe (section 3.2, Figure 7)
def test_kvcpipe_host_of_rl_32_lends_its_second_half_to_a_gt_of_rl_16_figure_7a() -> None:
    # 4 + 4 prompt blocks, r1's 32-token allocation, 4 spare: r2's own 16 would not fit.
    sched = make_scheduler(PIPE, num_gpu_blocks=44, block_size=1, max_model_len=128)
    r1, r2 = predicted("r1", 4, 33, 33), predicted("r2", 4, 17, 17)  # remaining RL 32 and 16
    add(sched, r1, r2)
    step(sched, 0.0)  # both prompts
    plan = sched.schedule(0.1)
    assert plan.num_scheduled_tokens == {"r1": 1, "r2": 1}  # both start together
    lent = table(sched, "r2")[4:]
    assert len(lent) == 16 and len(table(sched, "r1")) == 4 + 16  # r1 keeps its first half
    assert sched.policy.stats["pipe_blocks_lent"] == 16
    sched.kv.check_invariants()
    from harness import fake_result

    sched.on_step_result(fake_result(sched, plan), 0.11)
    t, kinds = 0.2, []
    while r2.status is not RequestStatus.FINISHED_STOPPED:
        p, _ = step(sched, t)
        kinds += [m.kind for m in p.kv_moves]
        t += 0.1
    assert r1.num_output_tokens == r2.num_output_tokens == 17  # r2 ends as r1 reaches the middle
    step(sched, t)
    assert sched.kv.capacity("r1") == 4 + 32  # the 16 lent blocks came back to the host
    run_to_completion(sched)
    assert KVMoveKind.SWAP_OUT not in kinds and r1.status is RequestStatus.FINISHED_STOPPED
    sched.assert_empty()


def test_kvcpipe_nests_four_gts_like_russian_dolls_figure_7b() -> None:
    sched = make_scheduler(PIPE, num_gpu_blocks=50, block_size=1, max_model_len=128)
    reqs = [predicted("r1", 4, 33, 33), predicted("r2", 4, 17, 17), predicted("r3", 4, 9, 9), predicted("r4", 4, 9, 9)]
    add(sched, *reqs)
    step(sched, 0.0)
    plan, _ = step(sched, 0.1)
    assert set(plan.num_scheduled_tokens) == {"r1", "r2", "r3", "r4"}
    states = {r.request_id: r.policy_state for r in reqs}
    # Level 1: r2 (RL 16) in r1's second half; level 2: one RL-8 GT inside each half.
    assert states["r2"].host == "r1" and states["r2"].lent_blocks == 16
    assert {states["r3"].host, states["r4"].host} == {"r1", "r2"}
    assert states["r3"].lent_blocks == states["r4"].lent_blocks == 8
    assert sched.policy.stats["pipe_guests"] == 3  # m * 2^(k-1): 1 at level 1, 2 at level 2
    assert sched.kv.gpu.num_used == 4 * 4 + 32  # four GTs in the space of one allocation
    run_to_completion(sched)
    assert all(r.status is RequestStatus.FINISHED_STOPPED for r in reqs)
    assert sched.policy.stats["pipe_guests_swapped"] == 0
    sched.assert_empty()


def test_hosted_gt_that_outlives_its_slot_is_swapped_out_never_overwritten() -> None:
    sched = make_scheduler(PIPE, num_gpu_blocks=44, block_size=1, max_model_len=128)
    r1, r2 = predicted("r1", 4, 33, 33), predicted("r2", 4, 30, 17)  # r2 under-predicted
    add(sched, r1, r2)
    step(sched, 0.0)
    step(sched, 0.1)
    lent = table(sched, "r2")[4:]
    t, swap_plan = 0.2, None
    while swap_plan is None:
        plan, _ = step(sched, t)  # step() checks that no block is owned twice
        if any(m.kind is KVMoveKind.SWAP_OUT for m in plan.kv_moves):
            swap_plan = plan
        t += 0.1
    (move,) = [m for m in swap_plan.kv_moves if m.kind is KVMoveKind.SWAP_OUT]
    assert move.request_id == "r2" and set(lent) <= set(move.src_block_ids)  # its KV copied to CPU
    assert r2.status is RequestStatus.PREEMPTED_SWAPPED and "r2" not in swap_plan.num_scheduled_tokens
    assert r1.num_computed_tokens == 4 + 16 + 1 and sched.kv.capacity("r1") >= 4 + 17  # host got room back
    assert sched.metrics.preemptions[("swap", "kv_pressure")] == 1
    run_to_completion(sched)
    assert r2.status is RequestStatus.FINISHED_STOPPED and r2.num_output_tokens == 30
    sched.assert_empty()


# ---------------------------------------------------------------- decoupling and time-synced batching
def test_pt_selection_reaches_tfs_with_the_closest_prompt_found_by_binary_search() -> None:
    sched = make_scheduler("econoserve:variant=SD,tfs=20,reserve=0.5", num_gpu_blocks=64)
    add(sched, *(make_request(rid, n, 3) for rid, n in [("a", 12), ("b", 10), ("c", 7), ("d", 8)]))
    plan, _ = step(sched, 0.0)
    assert plan.num_scheduled_tokens == {"a": 12, "d": 8}  # b (10) overshoots; d is closest to 8
    assert sum(plan.num_scheduled_tokens.values()) == 20
    run_to_completion(sched)
    sched.assert_empty()


def test_without_time_synced_batching_the_head_prompt_is_chunked_to_reach_tfs() -> None:
    sched = make_scheduler("econoserve:variant=D,tfs=20,reserve=0.5", num_gpu_blocks=64)
    add(sched, *(make_request(rid, n, 3) for rid, n in [("a", 12), ("b", 10), ("c", 7), ("d", 8)]))
    plan, _ = step(sched, 0.0)
    assert plan.num_scheduled_tokens == {"a": 12, "b": 8}
    plan, _ = step(sched, 0.1)
    assert plan.num_scheduled_tokens["b"] == 2  # the chunked prompt continues first
    run_to_completion(sched)
    sched.assert_empty()


def test_exact_allocation_gives_a_pt_its_prompt_and_a_gt_its_padded_prediction() -> None:
    sched = make_scheduler("econoserve:padding=0.15", num_gpu_blocks=64, block_size=4, max_model_len=128)
    req = predicted("x", 8, 20, 20, max_tokens=60)
    add(sched, req)
    step(sched, 0.0)
    assert sched.kv.capacity("x") == 8  # the PT holds its prompt only
    step(sched, 0.1)
    expected = required_tokens(
        AllocationMode.EXACT,
        num_tokens_after_step=10,
        num_prompt_tokens=8,
        max_tokens=60,
        predicted_output_tokens=20,
        padding=0.15,
    )
    assert expected == 8 + 23 and sched.kv.capacity("x") == sched.kv.num_blocks_for(expected) * 4
    run_to_completion(sched)
    assert sched.policy.provisioning["x"] == (32 - 28, 0)  # over-provisioned by the padding
    sched.assert_empty()


def test_a_group_starts_and_ends_together_and_the_group_that_does_not_fit_is_split() -> None:
    # Three GTs of RL 8 (one group); KV for the prompts and two allocations only.
    sched = make_scheduler(
        "econoserve:variant=SDO,padding=0,reserve=0,pt_reserve_only=false,group_tokens=1",
        num_gpu_blocks=7,
        block_size=4,
    )
    reqs = [predicted(rid, 4, 9, 9) for rid in "abc"]
    add(sched, *reqs)
    step(sched, 0.0)
    plan, _ = step(sched, 0.1)
    assert plan.num_scheduled_tokens == {"a": 1, "b": 1}
    assert sched.policy.stats["gt_groups_split"] == 1 and "c" in sched.policy.gtq
    t, ended = 0.2, {}
    while len(ended) < 3:
        _, out = step(sched, t)
        ended.update({r.request_id: t for r in out.finished})
        t += 0.1
    assert ended["a"] == ended["b"] < ended["c"]  # a and b end in the same iteration
    sched.assert_empty()


def test_a_mispredicted_gt_uses_the_reserve_before_it_is_stopped_and_kept_on_the_gpu() -> None:
    # x: 3 blocks (prompt 4 + 8 predicted), y: 11 blocks, 2 reserve blocks; nothing else free.
    sched = make_scheduler("econoserve:variant=SDO,padding=0,reserve=0.125", num_gpu_blocks=16, block_size=4)
    x, y = predicted("x", 4, 30, 8), predicted("y", 4, 40, 40)
    add(sched, x, y)
    t = 0.0
    while x.status is not RequestStatus.PREEMPTED_KEPT:
        step(sched, t)
        t += 0.1
        assert t < 5
    assert sched.policy.stats["reserve_blocks_used"] == 2  # the whole reserve first
    assert len(table(sched, "x")) == 5 and x.num_computed_tokens == 20  # KV stays on the GPU
    assert sched.metrics.preemptions[("keep", "misprediction")] == 1
    assert x.policy_state.remaining == 9  # re-predicted: half its 17 tokens so far
    run_to_completion(sched)
    assert x.status is RequestStatus.FINISHED_STOPPED and x.num_output_tokens == 30
    assert sched.policy.provisioning["x"][1] > 0  # logged as under-provisioned
    sched.assert_empty()


# ---------------------------------------------------------------- ordering (section 3.4)
def test_queues_order_by_deadline_then_occupied_kv_then_length_each_bucketed() -> None:
    cfg = OrderingConfig(True, deadline_bucket_s=0.5, kv_bucket_tokens=128, length_bucket_tokens=128)
    late = make_request("late", 8, 1, slo=SLOSpec(jct_s=5.0))
    early = make_request("early", 8, 1, slo=SLOSpec(jct_s=1.0))
    early_kv = make_request("early_kv", 8, 1, slo=SLOSpec(jct_s=1.1))  # same 0.5 s window as early
    early_kv_long = make_request("early_kv_long", 300, 1, slo=SLOSpec(jct_s=1.2))
    no_slo = make_request("no_slo", 8, 1)
    rows = [(late, 512, 8), (early, 0, 8), (early_kv, 256, 8), (early_kv_long, 256, 300), (no_slo, 4096, 999)]
    queue = PTQueue()
    for seq, (req, occupied, length) in enumerate(rows):
        queue.push(req.request_id, ordering_key(cfg, req, occupied, length, seq), length)
    assert list(queue.order.ids()) == ["early_kv_long", "early_kv", "early", "late", "no_slo"]
    fifo = OrderingConfig(False, 0.5, 128, 128)
    assert ordering_key(fifo, late, 512, 8, 3) < ordering_key(fifo, early, 0, 8, 4)


def test_ordering_puts_a_gt_holding_more_kv_first_in_the_gt_queue() -> None:
    sched = make_scheduler("econoserve:variant=SDO,kv_bucket_tokens=8,reserve=0.25", num_gpu_blocks=64, block_size=4)
    small, big = predicted("small", 4, 3, 3), predicted("big", 16, 3, 3)
    add(sched, small, big)
    step(sched, 0.0)  # both prompts; both GTs queue with their prompt KV
    assert sched.policy.gtq.order.first() == "big"
    run_to_completion(sched)
    sched.assert_empty()


# ---------------------------------------------------------------- options and the simulator
def test_variants_switch_the_components_and_options_override_them() -> None:
    flags = lambda spec: (lambda p: (p.sync, p.ordering.enabled, p.pipelining))(make_scheduler(spec).policy)  # noqa: E731
    assert flags("econoserve:variant=D") == (False, False, False)
    assert flags("econoserve:variant=SD") == (True, False, False)
    assert flags("econoserve:variant=SDO") == (True, True, False)
    assert flags("econoserve") == (True, True, True)
    assert flags("econoserve:variant=full,pipe=false") == (True, True, False)
    with pytest.raises(ValueError, match="variant"):
        make_scheduler("econoserve:variant=X")


@pytest.mark.parametrize("variant", ["D", "SD", "SDO", "full"])
def test_noisy_predictions_run_every_request_to_the_end_without_leaking_kv(variant: str) -> None:
    cm = build_cost_model("analytic", "opt-13b", "a100-80g")
    base = load_trace("econoserve-sharegpt", num_requests=80, seed=1)
    wl = apply_slo_profile("econoserve", apply_arrivals(base, "poisson", rate=6.0, seed=1), cm, 1)
    cfg = SimConfig(
        policy=f"econoserve:variant={variant}", kv_gb=2, block_size=32, length_source="noisy_oracle", length_error=0.4
    )
    sim = Simulation(cfg, wl, cm)
    run = sim.run()
    assert run.metrics["num_finished"] == 80
    policy = sim.cluster.schedulers[0].policy
    assert policy.stats_report()["requests_under_provisioned"] > 0  # the misprediction path ran
    assert policy.tfs == 816  # the cost model's pivot forward size
    sim.kv.assert_empty()


# ---------------------------------------------------------------- paper-faithful defaults
def test_prompts_are_admitted_only_into_the_reserved_kv() -> None:
    """3.3.1: "a small amount of KVC is reserved for PTs". 4 reserve blocks hold two 8-token
    prompts; the third waits although 60 blocks are free. `pt_reserve_only=false` (ours) lets
    prompts take any free KV."""
    for reserve_only, admitted in (("true", {"a", "b"}), ("false", {"a", "b", "c"})):
        sched = make_scheduler(
            f"econoserve:variant=SD,reserve=0.0625,tfs=64,pt_reserve_only={reserve_only}",
            num_gpu_blocks=64,
            block_size=4,
        )
        add(sched, *(make_request(rid, 8, 3) for rid in "abc"))
        plan, _ = step(sched, 0.0)
        assert set(plan.num_scheduled_tokens) == admitted
        run_to_completion(sched)
        sched.assert_empty()


@pytest.mark.parametrize(("variant", "joins_at_once"), [("SD", False), ("D", True)])
def test_time_synced_groups_start_new_gts_only_when_a_group_completes(variant: str, joins_at_once: bool) -> None:
    """3.3.2: a GT made while a group runs waits for a group to complete (SD); without
    time-synced batching (D) it starts at once."""
    sched = make_scheduler(
        f"econoserve:variant={variant},padding=0,reserve=0.5,group_tokens=1", num_gpu_blocks=64, block_size=4
    )
    a, b = predicted("a", 4, 20, 20), predicted("b", 4, 3, 3)
    add(sched, a)
    step(sched, 0.0)  # a's prompt
    step(sched, 0.1)  # a's group starts
    sched.add_request(b, 0.15)
    plan, _ = step(sched, 0.2)  # b's prompt beside a's decode
    assert plan.num_scheduled_tokens == {"a": 1, "b": 4}
    plan, _ = step(sched, 0.3)  # b is a GT now
    assert ("b" in plan.num_scheduled_tokens) is joins_at_once
    run_to_completion(sched)
    assert b.finish_time is not None and a.finish_time is not None
    assert (b.finish_time < a.finish_time) is joins_at_once
    sched.assert_empty()
