"""AccelGen makes the decisions its paper describes (seed 000, sections 4.2 to 4.4); every
test ends with the leak check. The pivot is given (S_pf = 64 tokens in T_pf = 0.1 s) so that
Eq. 6 reads S_b = 640 x SLO_min, capped by the 64-token step."""

from __future__ import annotations

import pytest
from harness import fake_result, make_request, make_scheduler, run_to_completion, step

from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.slo import SLOSpec
from scheduler_service.policies.accelgen.policy import AccelGenPolicy
from scheduler_service.policies.accelgen.queue import JCTBudget, RemainingTime
from scheduler_service.policies.accelgen.select import Candidate, CandidateSet

BASE = "accelgen:pivot_tokens=64,pivot_s=0.1,min_budget=1"


def spec(**options: object) -> str:
    return BASE + "".join(f",{k}={v}" for k, v in options.items())


def ttft(seconds: float, tbt: float | None = None) -> SLOSpec:
    return SLOSpec(ttft_s=seconds, tbt_s=tbt)


def offline(rid: str, prompt: int, output: int, jct_s: float, predicted: int | None) -> Request:
    req = make_request(rid, prompt, output, slo=SLOSpec(jct_s=jct_s))
    req.predicted_output_tokens = predicted
    return req


def policy(sched: Scheduler) -> AccelGenPolicy:
    assert isinstance(sched.policy, AccelGenPolicy)
    return sched.policy


def finish(sched: Scheduler) -> None:
    run_to_completion(sched)
    sched.assert_empty()


# ---------------------------------------------------------------- dynamic chunking (4.2)
def test_budget_follows_eq6_from_the_pivot_and_the_tightest_slo() -> None:
    sched = make_scheduler(spec(), max_num_batched_tokens=1024)
    p = policy(sched)
    assert p.budget_for(0.1875) == int(64 * 0.1875 / 0.1)  # 120
    assert p.budget_for(0.05) == 32
    assert p.budget_for(10.0) == 1024  # capped by the step's token limit
    sched.assert_empty()


def test_budget_shrinks_when_a_tighter_slo_request_is_at_the_head() -> None:
    sched = make_scheduler(spec(), num_gpu_blocks=128, max_num_batched_tokens=1024)
    sched.add_request(make_request("loose", 200, 2, slo=ttft(0.2)), 0.0)
    plan, _ = step(sched, 0.0)
    assert plan.token_budget == 128 and plan.num_scheduled_tokens == {"loose": 128}  # a 128-token chunk
    sched.add_request(make_request("tight", 40, 2, slo=ttft(0.05)), 0.02)
    plan, _ = step(sched, 0.02)
    assert plan.token_budget == 32  # SLO_min = 0.05 s fixed by the new head
    assert list(plan.num_scheduled_tokens) == ["tight"] and plan.num_scheduled_tokens["tight"] == 32
    finish(sched)


def test_a_prompt_cut_by_the_budget_continues_next_iteration_and_samples_once() -> None:
    sched = make_scheduler(spec(), max_num_batched_tokens=1024)
    req = make_request("long", 100, 2, slo=ttft(0.06))  # S_b = 38
    sched.add_request(req, 0.0)
    chunks = []
    t = 0.0
    while req.num_output_tokens == 0:
        plan, _ = step(sched, t)
        chunks.append(plan.num_scheduled_tokens["long"])
        assert ("long" in plan.sample_ids) == (sum(chunks) == 100)
        t += 0.05
    assert chunks == [38, 38, 24]
    finish(sched)


def test_era_holds_back_a_second_long_prompt_while_one_is_prefilled() -> None:
    sched = make_scheduler(spec(long_prompt_tokens=16), max_num_batched_tokens=64)
    for rid, n in (("a", 60), ("b", 60), ("c", 4)):
        sched.add_request(make_request(rid, n, 2, slo=ttft(1.0)), 0.0)
    plan, _ = step(sched, 0.0)
    assert plan.num_scheduled_tokens == {"a": 60, "c": 4}  # b may not start while a is prefilled
    finish(sched)


def test_without_era_the_second_long_prompt_starts_in_the_leftover_budget() -> None:
    sched = make_scheduler(spec(long_prompt_tokens=16, era="false", batch="false"), max_num_batched_tokens=64)
    for rid, n in (("a", 60), ("b", 60), ("c", 4)):
        sched.add_request(make_request(rid, n, 2, slo=ttft(1.0)), 0.0)
    plan, _ = step(sched, 0.0)
    assert plan.num_scheduled_tokens == {"a": 60, "b": 4}
    finish(sched)


def test_chunk_off_uses_the_fixed_budget_whatever_the_slo() -> None:
    sched = make_scheduler(spec(chunk="false", fixed_budget=24), max_num_batched_tokens=1024)
    sched.add_request(make_request("a", 100, 2, slo=ttft(0.05)), 0.0)
    plan, _ = step(sched, 0.0)
    assert plan.token_budget == 24 and plan.num_scheduled_tokens == {"a": 24}
    finish(sched)


# ---------------------------------------------------------------- prioritization (4.3)
def test_queue_is_served_by_ascending_remaining_time() -> None:
    sched = make_scheduler(spec(batch="false"))
    for i, slo in enumerate((1.0, 0.3, 0.6)):
        sched.add_request(make_request(f"r{i}", 4, 2, slo=ttft(slo)), 0.0)
    plan, _ = step(sched, 0.0)
    assert list(plan.num_scheduled_tokens) == ["r1", "r2", "r0"]
    finish(sched)


def test_order_off_serves_fcfs() -> None:
    sched = make_scheduler(spec(batch="false", order="false"))
    for i, slo in enumerate((1.0, 0.3, 0.6)):
        sched.add_request(make_request(f"r{i}", 4, 2, slo=ttft(slo)), 0.0)
    plan, _ = step(sched, 0.0)
    assert list(plan.num_scheduled_tokens) == ["r0", "r1", "r2"]
    finish(sched)


def test_remaining_time_is_slo_minus_wait_minus_chunks_times_t_max() -> None:
    sched = make_scheduler(spec(), max_num_batched_tokens=1024)
    req = make_request("a", 200, 3, slo=ttft(2.0, tbt=0.3))
    sched.add_request(req, 1.0)
    # N_ck = ceil(200 / L_c) with L_c = S_pf = 64 before any chunk ran: 4 chunks of T_max = T_pf = 0.1.
    assert req.policy_state.deadline == pytest.approx(1.0 + 2.0 - 4 * 0.1)
    plan = sched.schedule(1.0)
    sched.on_step_result(fake_result(sched, plan, duration=0.5), 1.5)
    p = policy(sched)
    assert p.rt.t_max_s == 0.5  # learned from the step's duration
    # a returned TG task: its clock restarts when its token came out, SLO = TBT, N_ck = 1
    assert req.policy_state.t0 == 1.5
    assert req.policy_state.deadline == pytest.approx(1.5 + 0.3 - 0.5)
    finish(sched)


def test_missing_tbt_slo_defaults_to_reading_speed() -> None:
    rt = RemainingTime(0.1, 64, default_ttft_s=1.0, default_tbt_s=0.1875)
    req = make_request("a", 4, 3)
    assert rt.iteration_slo(req) == 1.0
    req.num_output_tokens = 1
    assert rt.iteration_slo(req) == 0.1875


def test_jct_slo_becomes_a_per_iteration_wait() -> None:
    sched = make_scheduler(spec(), max_num_batched_tokens=1024)
    req = offline("off", 128, 3, 3.6, predicted=10)
    sched.add_request(req, 0.0)
    # T_e = N_ck*T_max + S_g*(T_max + P_max*P) = 2*0.1 + 10*0.1 = 1.2; T_r = (3.6 - 1.2) / (2 + 10)
    assert req.policy_state.jct.base_s == pytest.approx(0.2)
    rt = policy(sched).rt
    rt.observe_preemption_length(1.0)
    rt.observe_step(0.1, [], 10)
    rt.observe_preemption()  # P = 1 / 10 tokens
    assert rt.jct_budget(req, 3.6).base_s == pytest.approx((3.6 - 0.2 - 10 * (0.1 + 1.0 * 0.1)) / 12)
    finish(sched)


def test_jct_length_source_falls_back_to_max_tokens() -> None:
    rt = RemainingTime(0.1, 64, 1.0, 0.1875)
    req = offline("off", 64, 3, 10.0, predicted=None)
    assert rt.jct_budget(req, 10.0).base_s == pytest.approx((10.0 - 0.1 - req.max_tokens * 0.1) / (1 + req.max_tokens))


def test_jct_carry_forward_moves_over_and_under_use_into_the_next_iteration() -> None:
    budget = JCTBudget(base_s=0.5)
    budget.record_wait(0.7)  # d = 0.2 late
    assert budget.allowed_s == pytest.approx(0.3)
    budget.record_wait(0.3 + 0.1)  # late again by d1 = 0.1: T_r - d1
    assert budget.allowed_s == pytest.approx(0.4)
    budget.record_wait(0.2)  # 0.2 early: T_r + 0.2
    assert budget.allowed_s == pytest.approx(0.7)


def test_offline_request_carries_its_wait_between_iterations() -> None:
    sched = make_scheduler(spec(), max_num_batched_tokens=1024)
    req = offline("off", 8, 3, 30.0, predicted=5)
    sched.add_request(req, 0.0)
    base = req.policy_state.jct.base_s
    plan = sched.schedule(0.4)  # waited 0.4 s
    sched.on_step_result(fake_result(sched, plan), 0.41)
    assert req.policy_state.jct.allowed_s == pytest.approx(base + base - 0.4)
    assert req.policy_state.deadline == pytest.approx(0.41 + 2 * base - 0.4)
    finish(sched)


# ---------------------------------------------------------------- batching (4.4)
def test_euclidean_rule_picks_the_candidate_nearest_the_free_point() -> None:
    r = make_request("x", 4, 1)
    cands = CandidateSet()
    cands.add(Candidate(r, (0.0, 1, "more-compute"), 8, 8), is_decode=False)
    cands.add(Candidate(r, (0.0, 2, "fills-kv"), 6, 96), is_decode=False)
    cands.add(Candidate(r, (0.0, 3, "too-big"), 12, 4), is_decode=False)
    cands.add(Candidate(r, (0.0, 4, "decode"), 1, 0), is_decode=True)
    pick, prompt_fits = cands.nearest(10, 100)
    assert pick is not None and pick.entry[2] == "fills-kv" and prompt_fits
    pick, _ = cands.nearest(10, 100)
    assert pick is not None and pick.entry[2] == "more-compute"
    pick, prompt_fits = cands.nearest(1, 100)
    assert pick is not None and pick.entry[2] == "decode" and not prompt_fits
    assert cands.nearest(1, 100) == (None, False)


def test_euclidean_rule_places_decodes_that_need_a_block_first_then_the_covered_ones() -> None:
    """Algorithm 2 over decodes alone: every decode is the point (1, D_m), so the nearest to the
    free point is one that takes a block while the free KV holds one, and the covered ones
    (D_m = 0) come after; inside each group the window's last (least urgent) goes first."""
    sched = make_scheduler(spec())  # 4-token blocks
    prompts = {"a": 4, "b": 3, "c": 8, "d": 6, "e": 10, "f": 12}  # a, c and f fill their last block
    for rid, n in prompts.items():
        sched.add_request(make_request(rid, n, 5, slo=ttft(10.0, tbt=10.0)), 0.0)  # none urgent
    first, _ = step(sched, 0.0)
    assert first.num_scheduled_tokens == prompts  # every prompt whole (43 tokens of the 64)
    # the decodes return with equal deadlines: the window is the first step's batch order
    window = list(first.num_scheduled_tokens)
    plan, _ = step(sched, 0.02)
    needs_block = [r for r in window if prompts[r] % 4 == 0]
    covered = [r for r in window if prompts[r] % 4]
    assert list(plan.num_scheduled_tokens) == needs_block[::-1] + covered[::-1]
    assert set(plan.num_scheduled_tokens.values()) == {1}
    assert policy(sched).stats["alg2_decodes"] == 6
    finish(sched)


def test_batching_prefers_the_request_that_fills_the_budget_over_queue_order() -> None:
    sched = make_scheduler(spec())
    for rid, n in (("y", 40), ("z", 20), ("x", 60)):
        sched.add_request(make_request(rid, n, 2, slo=ttft(10.0)), 0.0)  # none urgent
    plan, _ = step(sched, 0.0)
    assert plan.num_scheduled_tokens == {"x": 60}
    finish(sched)


def test_batch_off_fills_greedily_in_queue_order() -> None:
    sched = make_scheduler(spec(batch="false"))
    for rid, n in (("y", 40), ("z", 20), ("x", 60)):
        sched.add_request(make_request(rid, n, 2, slo=ttft(10.0)), 0.0)
    plan, _ = step(sched, 0.0)
    assert plan.num_scheduled_tokens == {"y": 40, "z": 20, "x": 4}
    finish(sched)


def test_an_urgent_request_is_never_left_out_for_a_non_urgent_one() -> None:
    sched = make_scheduler(spec())
    sched.add_request(make_request("calm", 32, 2, slo=ttft(10.0)), 0.0)  # alone it would fill S_b exactly
    sched.add_request(make_request("urgent", 20, 2, slo=ttft(0.05)), 0.0)  # S_b = 32
    plan, _ = step(sched, 0.0)
    assert plan.num_scheduled_tokens["urgent"] == 20
    assert plan.num_scheduled_tokens.get("calm", 0) <= 12
    finish(sched)


def test_kv_pressure_preempts_the_running_request_with_the_largest_remaining_time() -> None:
    sched = make_scheduler(spec(), num_gpu_blocks=4, block_size=4)
    old_loose = make_request("old-loose", 7, 6, slo=ttft(1.0, tbt=1.0))
    new_tight = make_request("new-tight", 7, 6, slo=ttft(1.0, tbt=0.1))
    sched.add_request(old_loose, 0.0)
    sched.add_request(new_tight, 0.001)
    t = 0.01
    while old_loose.num_preemptions == 0 and new_tight.num_preemptions == 0:
        step(sched, t)
        t += 0.01
    assert old_loose.num_preemptions == 1 and new_tight.num_preemptions == 0  # vLLM would pick the newest
    assert old_loose.status is RequestStatus.PREEMPTED_RECOMPUTE
    finish(sched)


def test_every_ablation_serves_a_mixed_workload_to_the_end() -> None:
    for variant in ("", ",chunk=false", ",order=false", ",batch=false", ",preemption_mode=swap"):
        sched = make_scheduler(BASE + variant + ",long_prompt_tokens=32", num_gpu_blocks=24, block_size=4)
        for i in range(12):
            slo = SLOSpec(jct_s=5.0) if i % 4 == 3 else ttft(0.05 + 0.02 * i, tbt=0.1 + 0.01 * i)
            sched.add_request(make_request(f"r{i}", 4 + 7 * i % 50, 3 + i % 5, slo=slo, arrival=0.01 * i), 0.01 * i)
        finish(sched)


# ---------------------------------------------------------------- paper-faithful defaults
def test_t_max_is_the_largest_step_time_over_the_recent_window() -> None:
    recent = RemainingTime(0.2, 64, 1.0, 0.1875, t_max_window=2)
    all_time = RemainingTime(0.2, 64, 1.0, 0.1875, t_max_window=0)
    assert recent.t_max_s == 0.2  # the prior until a step is seen
    for seconds in (0.5, 0.1, 0.1):
        recent.observe_step(seconds, [], 1)
        all_time.observe_step(seconds, [], 1)
    assert recent.t_max_s == 0.1  # the 0.5 s step left the window
    assert all_time.t_max_s == 0.5


def test_a_late_waiting_request_stays_first_in_deadline_order_by_default() -> None:
    """The paper orders by T_r alone; demoting a request past its SLO is ours."""
    for demote, first in (("false", "late"), ("true", "fresh")):
        sched = make_scheduler(spec(demote_missed=demote), max_num_batched_tokens=64)
        sched.add_request(make_request("late", 40, 2, slo=ttft(0.05)), 0.0)
        sched.add_request(make_request("fresh", 40, 2, slo=ttft(0.5), arrival=1.0), 1.0)
        plan, _ = step(sched, 1.0)
        assert list(plan.num_scheduled_tokens) == [first]  # S_b = 32 (SLO_min 0.05 s): one chunk
        finish(sched)


def test_per_chunk_allocation_gives_a_first_chunk_only_its_own_blocks() -> None:
    sched = make_scheduler(spec(), max_num_batched_tokens=1024)
    sched.add_request(make_request("long", 100, 2, slo=ttft(0.06)), 0.0)  # S_b = 38
    plan, _ = step(sched, 0.0)
    assert plan.num_scheduled_tokens == {"long": 38}
    assert len(sched.kv.gpu_tables["long"]) == 10  # ceil(38 / 4), not the prompt's 25 blocks
    finish(sched)


def test_per_chunk_admission_counts_the_rest_of_started_prompts() -> None:
    """20 blocks; `a` (60 tokens, 15 blocks) starts and leaves 5 free. `b`'s first 4-token chunk
    would fit, but its whole prompt (10 blocks) could never be finished: admitting it is how
    per-chunk allocation livelocked (each later chunk preempted another half-done prompt)."""
    sched = make_scheduler(spec(batch="false"), num_gpu_blocks=20, max_num_batched_tokens=64)
    sched.add_request(make_request("a", 60, 2, slo=ttft(0.5)), 0.0)
    sched.add_request(make_request("b", 40, 2, slo=ttft(1.0)), 0.0)
    plan, _ = step(sched, 0.0)
    assert plan.num_scheduled_tokens == {"a": 60}
    assert sched.requests["b"].status is RequestStatus.WAITING
    plans = run_to_completion(sched)
    assert sum(r.num_preemptions for r in (sched.requests.get("a"), sched.requests.get("b")) if r) == 0
    assert plans


def test_per_chunk_allocation_does_not_livelock_under_kv_pressure() -> None:
    """Many prompts larger than a step's budget over a small cache: every request finishes
    with few preemptions (before the admission rule: one or more per request, forever)."""
    sched = make_scheduler(spec(), num_gpu_blocks=40, max_num_batched_tokens=48, max_num_seqs=16)
    for i in range(16):
        sched.add_request(make_request(f"r{i}", 60 + 5 * (i % 4), 4 + i % 3, slo=ttft(0.3, tbt=0.2)), 0.0)
    requests = list(sched.requests.values())
    run_to_completion(sched, max_steps=2_000)
    sched.assert_empty()
    assert sum(r.num_preemptions for r in requests) <= len(requests) // 2
