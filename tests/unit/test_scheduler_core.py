"""The scheduling core: intake, plans as full-then-diff, preemption modes, aborts,
timeouts, failed steps and lost workers. Every test ends with the leak check."""

from __future__ import annotations

from harness import EOS, TOKEN, fake_result, make_request, make_scheduler, run_to_completion, step

from scheduler_service.core.preemption import PreemptionMode, PreemptionReason, RejectReason
from scheduler_service.core.request import RequestStatus
from scheduler_service.core.step_builder import StepBuilder
from sluice.contract.plan import KVMoveKind, StepError, StepResult
from sluice.contract.sampling import SamplingParams


def test_bounded_queue_rejects_with_a_reason() -> None:
    sched = make_scheduler("vllm", max_waiting=2)
    assert sched.add_request(make_request("a", 4, 2), 0.0) is None
    assert sched.add_request(make_request("b", 4, 2), 0.0) is None
    late = make_request("c", 4, 2)
    assert sched.add_request(late, 0.0) is RejectReason.QUEUE_FULL
    assert late.status is RequestStatus.FINISHED_REJECTED
    run_to_completion(sched)
    sched.assert_empty()


def test_prompt_plus_max_tokens_over_the_context_is_rejected() -> None:
    sched = make_scheduler("vllm", max_model_len=32)
    assert sched.add_request(make_request("long", 30, 2, max_tokens=8), 0.0) is RejectReason.PROMPT_TOO_LONG
    assert sched.add_request(make_request("dup", 4, 2), 0.0) is None
    assert sched.add_request(make_request("dup", 4, 2), 0.0) is RejectReason.DUPLICATE_ID
    run_to_completion(sched)
    sched.assert_empty()


def test_new_requests_are_sent_once_in_full_then_as_block_diffs() -> None:
    sched = make_scheduler("vllm", block_size=4)
    sched.add_request(make_request("a", 6, 4), 0.0)
    plan, _ = step(sched, 0.0)
    (new,) = plan.new_requests
    assert new.prompt_token_ids == (1, 2, 3, 4, 5, 6) and new.block_ids == (0, 1)
    assert plan.num_scheduled_tokens == {"a": 6} and plan.sample_ids == {"a"}
    plan, _ = step(sched, 0.1)  # 7th token fits block 1: the table did not change, no diff
    assert not plan.new_requests and len(plan.cached_requests) == 0 and plan.num_scheduled_tokens == {"a": 1}
    plan, _ = step(sched, 0.2)  # 8th token
    plan, _ = step(sched, 0.3)  # 9th token needs block 2
    assert plan.cached_requests.request_ids == ("a",) and plan.cached_requests.new_block_ids == ((2,),)
    run_to_completion(sched)
    sched.assert_empty()


def test_finished_request_is_released_in_the_next_plan() -> None:
    sched = make_scheduler("vllm")
    sched.add_request(make_request("a", 4, 1), 0.0)
    _, out = step(sched, 0.0)
    assert [r.request_id for r in out.finished] == ["a"]
    assert out.finished[0].status is RequestStatus.FINISHED_STOPPED
    plan = sched.schedule(0.1)
    assert plan.release_ids == ("a",)
    sched.on_step_result(fake_result(sched, plan), 0.1)
    sched.assert_empty()


def test_abort_frees_kv_at_once_and_tells_the_worker_next_step() -> None:
    sched = make_scheduler("vllm")
    sched.add_request(make_request("a", 8, 50), 0.0)
    sched.add_request(make_request("b", 8, 2), 0.0)
    step(sched, 0.0)
    used = sched.kv.gpu.num_used
    assert sched.abort("a", 0.05)
    assert sched.kv.gpu.num_used < used and "a" not in sched.kv.gpu_tables
    plan, _ = step(sched, 0.1)
    assert "a" in plan.release_ids and "a" not in plan.num_scheduled_tokens
    assert not sched.abort("a", 0.2)  # idempotent
    run_to_completion(sched)
    sched.assert_empty()


def test_abort_during_a_step_in_flight_drops_its_result() -> None:
    sched = make_scheduler("vllm")
    sched.add_request(make_request("a", 4, 5), 0.0)
    plan = sched.schedule(0.0)
    result = fake_result(sched, plan)
    sched.abort("a", 0.005)
    out = sched.on_step_result(result, 0.01)
    assert out.tokens == []
    run_to_completion(sched)
    sched.assert_empty()


def test_queue_timeout_ends_a_request_that_never_got_in() -> None:
    sched = make_scheduler("vllm", num_gpu_blocks=4, block_size=4, queue_timeout_s=1.0)
    sched.add_request(make_request("big", 12, 3, max_tokens=4), 0.0)  # holds 3 of 4 blocks
    sched.add_request(make_request("starved", 8, 2, arrival=0.0), 0.0)
    step(sched, 0.0)
    _, out = step(sched, 1.5)
    assert [r.request_id for r in out.finished if r.status is RequestStatus.FINISHED_TIMEOUT] == ["starved"]
    run_to_completion(sched)
    sched.assert_empty()


def test_stop_conditions_eos_min_tokens_and_length() -> None:
    sched = make_scheduler("vllm")
    r1 = make_request("eos", 4, 3)
    r2 = make_request("len", 4, 100, max_tokens=5)
    r3 = make_request("min", 4, 1)
    r3.sampling = SamplingParams(max_tokens=10, min_tokens=3)
    for r in (r1, r2, r3):
        sched.add_request(r, 0.0)
    run_to_completion(sched)
    assert r1.status is RequestStatus.FINISHED_STOPPED and r1.num_output_tokens == 3
    assert r2.status is RequestStatus.FINISHED_LENGTH and r2.num_output_tokens == 5
    # EOS is ignored until min_tokens; the harness keeps answering EOS after the true length
    assert r3.status is RequestStatus.FINISHED_STOPPED and r3.num_output_tokens == 3
    assert r3.output_token_ids == [EOS, EOS, EOS] and r1.output_token_ids == [TOKEN, TOKEN, EOS]
    sched.assert_empty()


def _builder(sched) -> StepBuilder:  # type: ignore[no-untyped-def]
    from scheduler_service.core.budget import TokenBudget

    return StepBuilder(sched, TokenBudget(64, 16), 0.0)


def test_recompute_preemption_resends_prompt_and_generated_tokens() -> None:
    sched = make_scheduler("vllm")
    req = make_request("a", 4, 6)
    sched.add_request(req, 0.0)
    for t in range(3):
        step(sched, t * 0.1)
    assert req.num_output_tokens == 3
    _builder(sched).preempt(req, PreemptionMode.RECOMPUTE, PreemptionReason.KV_PRESSURE)
    assert req.status is RequestStatus.PREEMPTED_RECOMPUTE and "a" not in sched.kv.gpu_tables
    assert next(iter(sched.waiting)) == "a"
    plan, _ = step(sched, 1.0)
    assert plan.release_ids == ("a",)
    (new,) = plan.new_requests
    assert new.num_tokens == 7 and new.num_output_tokens == 3 and len(new.prompt_token_ids) == 7
    assert plan.num_scheduled_tokens == {"a": 7} and "a" in plan.sample_ids
    run_to_completion(sched)
    assert req.num_output_tokens == 6 and req.num_preemptions == 1
    sched.assert_empty()


def test_swap_preemption_moves_blocks_and_resumes_with_a_replaced_table() -> None:
    sched = make_scheduler("vllm", block_size=4)
    req = make_request("a", 8, 6)
    sched.add_request(req, 0.0)
    step(sched, 0.0)
    builder = _builder(sched)
    builder.preempt(req, PreemptionMode.SWAP, PreemptionReason.PRIORITY)
    (move,) = builder.kv_moves
    assert move.kind is KVMoveKind.SWAP_OUT and move.src_block_ids == (0, 1)
    assert req.status is RequestStatus.PREEMPTED_SWAPPED and sched.kv.cpu_tables["a"] == [0, 1]
    plan, _ = step(sched, 0.5)  # vllm swaps it back in when blocks allow
    assert [m.kind for m in plan.kv_moves] == [KVMoveKind.SWAP_IN]
    assert plan.cached_requests.resumed == (True,)
    assert plan.cached_requests.new_block_ids[0] == tuple(sched.kv.gpu_tables["a"])
    run_to_completion(sched)
    sched.assert_empty()


def test_keep_preemption_holds_kv_and_resume_puts_it_back() -> None:
    sched = make_scheduler("vllm")
    req = make_request("a", 4, 3)
    sched.add_request(req, 0.0)
    step(sched, 0.0)
    blocks = list(sched.kv.gpu_tables["a"])
    builder = _builder(sched)
    builder.preempt(req, PreemptionMode.KEEP, PreemptionReason.MISPREDICTION)
    assert req.status is RequestStatus.PREEMPTED_KEPT and sched.kv.gpu_tables["a"] == blocks
    _builder(sched).resume(req)
    assert req.status is RequestStatus.DECODING
    run_to_completion(sched)
    sched.assert_empty()


def test_a_failed_step_recomputes_everyone_and_fails_the_blamed_request() -> None:
    sched = make_scheduler("vllm")
    sched.add_request(make_request("good", 4, 3), 0.0)
    sched.add_request(make_request("bad", 4, 3), 0.0)
    plan = sched.schedule(0.0)
    error = StepError("INVALID_ARGUMENT", "block_ids: duplicate", "bad")
    out = sched.on_step_result(StepResult(plan.step_id, {}, total_s=0.0, error=error), 0.01)
    assert [(r.request_id, r.status) for r in out.finished] == [("bad", RequestStatus.FINISHED_ERROR)]
    assert sched.requests["good"].status is RequestStatus.PREEMPTED_RECOMPUTE
    plan, _ = step(sched, 0.1)
    assert set(plan.release_ids) == {"good", "bad"} and [n.request_id for n in plan.new_requests] == ["good"]
    run_to_completion(sched)
    sched.assert_empty()


def test_evacuate_returns_every_request_reset_for_recompute() -> None:
    sched = make_scheduler("vllm")
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 4, 5), 0.0)
    step(sched, 0.0)
    step(sched, 0.1)
    moved = sched.evacuate(0.2)
    assert sorted(r.request_id for r in moved) == ["r0", "r1", "r2"]
    assert all(r.num_computed_tokens == 0 and r.prefill_len == r.num_tokens for r in moved)
    assert not sched.pop_returned()
    sched.assert_empty()


def test_metrics_summary_has_exactly_the_design_keys() -> None:
    from scheduler_service.core.metrics import METRIC_KEYS

    sched = make_scheduler("vllm")
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 4, 3, arrival=0.0), 0.0)
    run_to_completion(sched)
    summary = sched.metrics.summary()
    assert tuple(summary) == METRIC_KEYS
    assert summary["num_finished"] == 3 and summary["num_requests"] == 3
    assert summary["ttft_s"]["p50"] is not None and summary["throughput_tok_s"] > 0
    sched.assert_empty()


def _decoding(num: int, prompt_lens: list[int]):  # type: ignore[no-untyped-def]
    """A scheduler with `num` requests decoding (block size 4), prompts of the given lengths."""
    sched = make_scheduler("vllm", max_num_batched_tokens=128)
    for i in range(num):
        sched.add_request(make_request(f"r{i}", prompt_lens[i], 50), 0.0)
    step(sched, 0.0)  # all prefilled in one step; each sampled its first token
    return sched


def test_schedule_covered_charges_covered_decodes_and_hands_back_the_first_needing_a_block() -> None:
    from collections import deque

    # After the prefill each decode computes token prompt+1: r0's 6th fits its 2 blocks, r1's
    # 9th needs a third block, r2's 3rd fits its one block.
    sched = _decoding(3, [5, 8, 2])
    tables_before = {rid: list(t) for rid, t in sched.kv.gpu_tables.items()}
    builder = _builder(sched)
    queue = deque(sched.running.values())
    back = builder.schedule_covered(queue)
    assert back is sched.running["r1"] and [r.request_id for r in queue] == ["r2"]
    assert builder.scheduled == {"r0": 1} and builder.budget.num_tokens == 1 and builder.budget.num_seqs == 1
    assert {rid: list(t) for rid, t in sched.kv.gpu_tables.items()} == tables_before, "nothing allocated"
    # The general path takes the handed-back request (a new block) and the rest goes on.
    assert builder.schedule(back, 1) and len(sched.kv.gpu_tables["r1"]) == 3
    assert builder.schedule_covered(queue) is None and builder.scheduled == {"r0": 1, "r1": 1, "r2": 1}


def test_schedule_if_covered_leaves_tokens_a_request_does_not_have_to_the_general_path() -> None:
    sched = _decoding(1, [5])
    builder = _builder(sched)
    req = sched.running["r0"]
    assert not builder.schedule_if_covered(req, 2)  # one token to compute, though its blocks hold 8
    assert builder.scheduled == {} and builder.budget.num_tokens == 0
    assert builder.schedule_if_covered(req, 1) and builder.scheduled == {"r0": 1}


def test_schedule_covered_stops_where_the_budget_does_and_chunks_to_it_when_asked() -> None:
    from collections import deque

    from scheduler_service.core.budget import TokenBudget

    sched = _decoding(3, [5, 5, 5])
    builder = StepBuilder(sched, TokenBudget(2, 16), 0.0)
    queue = deque(sched.running.values())
    assert builder.schedule_covered(queue) is sched.running["r2"] and builder.scheduled == {"r0": 1, "r1": 1}
    # With chunking to the budget, a request that would get no tokens is passed over instead.
    chunked = StepBuilder(sched, TokenBudget(2, 16), 0.0)
    assert chunked.schedule_covered(deque(sched.running.values()), chunk_to_budget=True) is None
    assert chunked.scheduled == {"r0": 1, "r1": 1}


def test_used_kv_is_reported_beside_allocated_kv() -> None:
    """Orca reserves prompt + max_tokens at admission: most of what it allocates is never
    used; vLLM allocates block by block, so used is allocated less the last block's tail."""
    used_share = {}
    for policy in ("orca", "vllm"):
        sched = make_scheduler(policy, num_gpu_blocks=64, block_size=4)
        for i in range(4):
            sched.add_request(make_request(f"r{i}", 8, 4, max_tokens=40), 0.0)
        run_to_completion(sched)
        summary = sched.metrics.summary()
        assert 0 < summary["kv_used_mean"] <= summary["kv_util_mean"]
        used_share[policy] = summary["kv_used_mean"] / summary["kv_util_mean"]
        sched.assert_empty()
    assert used_share["orca"] < 0.35 < 0.7 < used_share["vllm"]


def test_admit_fresh_leaves_what_schedule_with_the_whole_cover_leaves() -> None:
    """A queue policy's fresh admission (no table, nothing a prefix lookup could name) takes
    the same blocks, budget, status and prefix-lookup count as the general `schedule`, and
    changes nothing when the blocks are not there."""
    states = []
    for fresh in (True, False):
        sched = make_scheduler("vllm", num_gpu_blocks=16, block_size=4)
        req = make_request("a", 9, 3)
        sched.add_request(req, 0.0)
        builder = _builder(sched)
        tokens = req.num_prompt_tokens + req.num_output_tokens
        assert builder.admit_fresh(req, tokens) if fresh else builder.schedule(req, tokens, cover=tokens)
        m = sched.metrics
        states.append(
            (
                list(sched.kv.gpu_tables["a"]),
                builder.scheduled,
                (builder.budget.num_tokens, builder.budget.num_seqs),
                req.status,
                list(sched.running),
                list(sched.waiting),
                (m.prefix_lookups, m.prefix_query_tokens, m.prefix_hit_tokens),
            )
        )
    assert states[0] == states[1] and states[0][3] is RequestStatus.PREFILLING
    sched = make_scheduler("vllm", num_gpu_blocks=4, block_size=4)
    first, second = make_request("a", 9, 3), make_request("b", 9, 3)
    sched.add_request(first, 0.0)
    sched.add_request(second, 0.0)
    builder = _builder(sched)
    assert builder.admit_fresh(first, 12)  # 3 of the 4 blocks
    assert not builder.admit_fresh(second, 12)
    assert builder.scheduled == {"a": 12} and "b" in sched.waiting and "b" not in sched.kv.gpu_tables
    assert sched.metrics.kv_alloc_failures == 1
