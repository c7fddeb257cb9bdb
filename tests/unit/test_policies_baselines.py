"""The baselines make the decisions their papers describe; each test ends with the leak check."""

from __future__ import annotations

import pytest
from harness import make_request, make_scheduler, run_to_completion, step

from scheduler_service.core.request import RequestStatus
from scheduler_service.costmodel.factory import build_cost_model
from scheduler_service.policies.sarathi.policy import budget_from_tbt_slo


# ---------------------------------------------------------------- vllm
def test_vllm_runs_prefill_only_iterations() -> None:
    sched = make_scheduler("vllm", max_num_batched_tokens=64)
    sched.add_request(make_request("a", 8, 5), 0.0)
    step(sched, 0.0)
    sched.add_request(make_request("b", 8, 5), 0.05)
    plan, _ = step(sched, 0.1)
    assert plan.num_scheduled_tokens == {"b": 8}  # a's decode waits for the prefill iteration
    assert plan.metadata["phase"] == "prefill"
    plan, _ = step(sched, 0.2)
    assert plan.num_scheduled_tokens == {"a": 1, "b": 1}
    run_to_completion(sched)
    sched.assert_empty()


def test_vllm_admits_fcfs_and_stops_at_the_first_that_does_not_fit() -> None:
    sched = make_scheduler("vllm", num_gpu_blocks=5, block_size=4)
    sched.add_request(make_request("a", 12, 2), 0.0)  # 3 blocks
    sched.add_request(make_request("b", 12, 2), 0.0)  # does not fit beside a
    sched.add_request(make_request("c", 4, 2), 0.0)  # would fit, but FCFS blocks it
    plan, _ = step(sched, 0.0)
    assert list(plan.num_scheduled_tokens) == ["a"]
    run_to_completion(sched)
    sched.assert_empty()


@pytest.mark.parametrize("policy", ["vllm", "vllm_chunked", "sarathi"])
def test_a_prompt_that_can_never_fit_is_rejected_instead_of_blocking_the_queue(policy: str) -> None:
    # vLLM's AllocStatus.NEVER: 100 blocks of 4 tokens, a 1-block watermark; a 398-token prompt
    # needs all 100 and can never be admitted, so it is rejected and the next request runs.
    sched = make_scheduler(policy, num_gpu_blocks=100, block_size=4, max_model_len=1024, max_num_batched_tokens=512)
    big, small = make_request("big", 398, 2), make_request("small", 8, 2)
    sched.add_request(big, 0.0)
    sched.add_request(small, 0.0)
    plan, _ = step(sched, 0.0)
    assert big.status is RequestStatus.FINISHED_REJECTED and "unschedulable" in big.finish_message
    assert "small" in plan.num_scheduled_tokens
    run_to_completion(sched)
    assert small.status is RequestStatus.FINISHED_STOPPED
    sched.assert_empty()


def test_a_prompt_that_fits_only_without_others_waits_instead_of_being_rejected() -> None:
    sched = make_scheduler("vllm", num_gpu_blocks=100, block_size=4, max_model_len=1024, max_num_batched_tokens=512)
    first, big = make_request("first", 40, 3), make_request("big", 392, 2)  # big: 98 blocks, fits alone
    sched.add_request(first, 0.0)
    sched.add_request(big, 0.0)
    plan, _ = step(sched, 0.0)
    assert list(plan.num_scheduled_tokens) == ["first"]
    run_to_completion(sched)
    assert big.status is RequestStatus.FINISHED_STOPPED
    sched.assert_empty()


def test_vllm_preempts_the_newest_request_under_kv_pressure_and_requeues_it_first() -> None:
    sched = make_scheduler("vllm", num_gpu_blocks=4, block_size=4)
    old = make_request("old", 4, 8)
    new = make_request("new", 4, 8)
    sched.add_request(old, 0.0)
    sched.add_request(new, 0.0)
    sched.add_request(make_request("later", 4, 1), 0.0)
    step(sched, 0.0)  # prefill old, new (2 blocks), later waits? it fits: 3 blocks
    t = 0.1
    while new.num_preemptions == 0:
        step(sched, t)
        t += 0.1
    assert old.num_preemptions == 0
    assert new.status is RequestStatus.PREEMPTED_RECOMPUTE and next(iter(sched.waiting)) == "new"
    assert sched.metrics.preemptions[("recompute", "kv_pressure")] >= 1
    run_to_completion(sched)
    assert old.status is new.status is RequestStatus.FINISHED_STOPPED
    sched.assert_empty()


def test_vllm_swap_mode_swaps_the_victim_out_and_back_in() -> None:
    from sluice.contract.plan import KVMoveKind

    sched = make_scheduler("vllm:preemption_mode=swap", num_gpu_blocks=4, block_size=4)
    sched.add_request(make_request("old", 4, 8), 0.0)
    victim = make_request("new", 4, 8)
    sched.add_request(victim, 0.0)
    kinds = []
    for plan in run_to_completion(sched):
        kinds += [m.kind for m in plan.kv_moves]
    assert victim.num_preemptions >= 1
    assert KVMoveKind.SWAP_OUT in kinds and KVMoveKind.SWAP_IN in kinds
    assert sched.metrics.preemptions[("swap", "kv_pressure")] >= 1
    sched.assert_empty()


def test_vllm_priority_mode_preempts_lower_priority_for_a_waiting_urgent_request() -> None:
    sched = make_scheduler("vllm:priority=true", num_gpu_blocks=4, block_size=4)
    low = make_request("low", 12, 20, max_tokens=20, priority=5)
    sched.add_request(low, 0.0)
    step(sched, 0.0)
    urgent = make_request("urgent", 8, 2, priority=0)
    sched.add_request(urgent, 0.01)
    plan, _ = step(sched, 0.02)
    assert "urgent" in plan.num_scheduled_tokens and low.status is RequestStatus.PREEMPTED_RECOMPUTE
    assert sched.metrics.preemptions[("recompute", "priority")] == 1
    sched.abort("low", 0.1)
    run_to_completion(sched)
    sched.assert_empty()


# ---------------------------------------------------------------- sarathi / vllm_chunked
def test_sarathi_schedules_every_running_decode_every_iteration_within_budget() -> None:
    sched = make_scheduler("sarathi:budget=16", num_gpu_blocks=128, block_size=4, max_num_batched_tokens=64)
    for i in range(4):
        sched.add_request(make_request(f"d{i}", 4, 30), 0.0)
    step(sched, 0.0)
    for i in range(3):
        sched.add_request(make_request(f"long{i}", 40, 3), 0.05)
    now, chunked = 0.1, 0
    while sched.has_work:
        decoding = {rid for rid, r in sched.running.items() if not r.is_prefill}
        plan, _ = step(sched, now)
        assert decoding <= set(plan.num_scheduled_tokens), "a decode was stalled"
        assert sum(plan.num_scheduled_tokens.values()) <= 16
        chunked += any(n > 1 for n in plan.num_scheduled_tokens.values())
        now += 0.1
    assert chunked >= 3 * 40 // 16  # the long prompts went through in chunks
    sched.assert_empty()


def test_sarathi_chunks_a_long_prompt_to_the_leftover_budget() -> None:
    sched = make_scheduler("sarathi:budget=16", num_gpu_blocks=128, block_size=4, max_num_batched_tokens=64)
    sched.add_request(make_request("d", 4, 10), 0.0)
    step(sched, 0.0)
    sched.add_request(make_request("long", 40, 2), 0.05)
    plan, _ = step(sched, 0.1)
    assert plan.num_scheduled_tokens == {"d": 1, "long": 15}
    assert "long" not in plan.sample_ids  # a chunk in the middle of the prompt samples nothing
    plan, _ = step(sched, 0.2)
    assert plan.num_scheduled_tokens == {"d": 1, "long": 15}
    plan, _ = step(sched, 0.3)
    assert plan.num_scheduled_tokens == {"d": 1, "long": 10} and "long" in plan.sample_ids
    run_to_completion(sched)
    sched.assert_empty()


def test_sarathi_allocates_the_whole_prompt_at_the_first_chunk() -> None:
    sched = make_scheduler("sarathi:budget=8", num_gpu_blocks=64, block_size=4, max_num_batched_tokens=64)
    sched.add_request(make_request("long", 40, 2), 0.0)
    step(sched, 0.0)
    assert len(sched.kv.gpu_tables["long"]) == 10
    run_to_completion(sched)
    sched.assert_empty()


def test_sarathi_budget_is_the_largest_tile_multiple_within_the_tbt_slo() -> None:
    cm = build_cost_model("analytic", "mistral-7b", "a100-80g")
    slo = cm.prefill_time(1000)
    budget = budget_from_tbt_slo(cm, slo, tile=128)
    assert budget % 128 == 0
    assert cm.prefill_time(budget) <= slo < cm.prefill_time(budget + 128)
    strict = budget_from_tbt_slo(cm, 5 * cm.decode_time(32, 4096), 128)
    relaxed = budget_from_tbt_slo(cm, 25 * cm.decode_time(32, 4096), 128)
    assert strict < relaxed


def test_vllm_chunked_mixes_decodes_and_chunks_under_its_fixed_budget() -> None:
    sched = make_scheduler("vllm_chunked:budget=12", num_gpu_blocks=64, block_size=4)
    sched.add_request(make_request("a", 4, 6), 0.0)
    sched.add_request(make_request("b", 30, 2), 0.0)
    plans = run_to_completion(sched)
    assert plans[0].num_scheduled_tokens == {"a": 4, "b": 8}
    assert plans[1].num_scheduled_tokens == {"a": 1, "b": 11}
    assert all(sum(p.num_scheduled_tokens.values()) <= 12 for p in plans)
    sched.assert_empty()


# ---------------------------------------------------------------- fastgen (SCLS's ILS baseline)
def test_fastgen_caps_the_sequences_in_flight_below_the_engine_limit() -> None:
    sched = make_scheduler("fastgen:max_seqs=2,budget=64", num_gpu_blocks=64, block_size=4, max_num_seqs=16)
    for rid in "abcd":
        sched.add_request(make_request(rid, 4, 3), 0.0)
    plans = run_to_completion(sched)
    assert set(plans[0].num_scheduled_tokens) == {"a", "b"}  # room for all four, the cap admits two
    assert all(len(p.num_scheduled_tokens) <= 2 for p in plans)
    assert {"c", "d"} <= {rid for p in plans for rid in p.num_scheduled_tokens}
    sched.assert_empty()


def test_fastgen_splits_a_prompt_to_its_token_budget_beside_the_decodes() -> None:
    sched = make_scheduler("fastgen:max_seqs=4,budget=12", num_gpu_blocks=64, block_size=4)
    sched.add_request(make_request("a", 4, 6), 0.0)
    sched.add_request(make_request("b", 30, 2), 0.0)
    plans = run_to_completion(sched)
    assert plans[1].num_scheduled_tokens == {"a": 1, "b": 11}  # Dynamic SplitFuse
    sched.assert_empty()


# ---------------------------------------------------------------- orca
def test_orca_reserves_prompt_plus_max_tokens_at_admission() -> None:
    sched = make_scheduler("orca", num_gpu_blocks=64, block_size=4)
    sched.add_request(make_request("a", 8, 3, max_tokens=24), 0.0)
    step(sched, 0.0)
    assert len(sched.kv.gpu_tables["a"]) == (8 + 24) // 4
    run_to_completion(sched)
    sched.assert_empty()


def test_orca_prefills_whole_prompts_beside_running_decodes_up_to_its_batch_size() -> None:
    sched = make_scheduler("orca:max_batch_size=2", num_gpu_blocks=64, block_size=4)
    sched.add_request(make_request("a", 8, 5), 0.0)
    step(sched, 0.0)
    sched.add_request(make_request("b", 20, 5), 0.01)
    sched.add_request(make_request("c", 4, 5), 0.01)
    plan, _ = step(sched, 0.02)
    assert plan.num_scheduled_tokens == {"a": 1, "b": 20}  # hybrid batch, no chunking; c waits (batch of 2)
    run_to_completion(sched)
    sched.assert_empty()


# ---------------------------------------------------------------- sls
def test_sls_keeps_its_batch_until_every_member_finishes_and_counts_invalid_tokens() -> None:
    sched = make_scheduler("sls:batch_size=2", num_gpu_blocks=64, block_size=4)
    sched.add_request(make_request("short", 4, 2), 0.0)
    sched.add_request(make_request("long", 8, 6), 0.0)
    sched.add_request(make_request("next", 4, 2), 0.0)
    plans = run_to_completion(sched)
    first = plans[0]
    assert set(first.num_scheduled_tokens) == {"short", "long"}
    assert first.metadata["padded_len"] == 8 and first.metadata["pad_tokens"] == 4
    batch_one = plans[: 1 + 5]
    assert all("next" not in p.num_scheduled_tokens for p in batch_one)
    assert plans[6].num_scheduled_tokens == {"next": 4}
    # short finished after 2 tokens and pads for the 4 decode iterations long still needs
    assert sched.metrics.invalid_tokens == 4
    sched.assert_empty()
