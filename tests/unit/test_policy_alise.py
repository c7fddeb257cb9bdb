"""ALISE (seed 003, section 3) makes the decisions its paper describes: shortest predicted
remaining time first with iteration-level preemption, virtual aging, doubling on
misprediction, EWT-driven swapping (Algorithm 2) and the Recompute / Defer strawmen.
Every test ends with the leak check."""

from __future__ import annotations

import math

import pytest
from harness import make_request, make_scheduler, run_to_completion, step

from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.policies.alise.policy import AlisePolicy, ExecTimeModel, _none_can_swap_out, _swappable
from scheduler_service.policies.mlfq import JobState
from sluice.contract.plan import KVMoveKind, StepPlan


def predicted(rid: str, prompt: int, output: int, guess: int | None = None, arrival: float = 0.0) -> Request:
    """A request whose length source predicts `guess` (the oracle by default)."""
    req = make_request(rid, prompt, output, arrival=arrival)
    req.predicted_output_tokens = output if guess is None else guess
    return req


def policy(sched: Scheduler) -> AlisePolicy:
    assert isinstance(sched.policy, AlisePolicy)
    return sched.policy


def state(req: Request) -> JobState:
    assert isinstance(req.policy_state, JobState)
    return req.policy_state


def test_alise_runs_the_shortest_predicted_remaining_job_first_and_preempts_each_iteration() -> None:
    sched = make_scheduler("alise", max_num_seqs=1)
    long = predicted("long", 8, 20)
    sched.add_request(long, 0.0)
    step(sched, 0.0)  # long is prefilled and decoding
    short = predicted("short", 8, 3)
    sched.add_request(short, 0.01)
    plan, _ = step(sched, 0.02)
    assert list(plan.num_scheduled_tokens) == ["short"]
    assert long.status is RequestStatus.PREEMPTED_KEPT  # paused, its KV stays on the GPU
    run_to_completion(sched)
    assert short.finish_time is not None and long.finish_time is not None
    assert short.finish_time < long.finish_time
    sched.assert_empty()


def test_alise_orders_waiting_jobs_by_remaining_time_not_arrival() -> None:
    sched = make_scheduler("alise", max_num_seqs=1)
    for rid, out in (("a", 12), ("b", 2), ("c", 6)):
        sched.add_request(predicted(rid, 8, out), 0.0)
    firsts = []
    for plan in run_to_completion(sched):
        rid = next(iter(plan.num_scheduled_tokens), None)
        if rid is not None and rid not in firsts:
            firsts.append(rid)
    assert firsts == ["b", "c", "a"]
    sched.assert_empty()


def _starved_long_job(age_threshold_s: float, steps: int) -> tuple[Scheduler, Request]:
    sched = make_scheduler(f"alise:age_threshold_s={age_threshold_s}", max_num_seqs=1, max_waiting=1000)
    long = predicted("long", 8, 40)
    sched.add_request(long, 0.0)
    now = 0.0
    for i in range(steps):  # a short job arrives every step: the queue never runs dry
        sched.add_request(predicted(f"s{i}", 4, 2, arrival=now), now)
        step(sched, now)
        now += 0.01
    return sched, long


def test_alise_aging_lets_a_long_job_run_while_short_ones_keep_arriving() -> None:
    sched, long = _starved_long_job(age_threshold_s=0.05, steps=120)
    assert long.first_scheduled_time is not None
    assert state(long).level == 0  # aged all the way up to the queue nothing else reaches
    run_to_completion(sched)
    sched.assert_empty()


def test_alise_without_aging_the_long_job_starves_behind_short_ones() -> None:
    sched, long = _starved_long_job(age_threshold_s=1e9, steps=120)
    assert long.first_scheduled_time is None
    run_to_completion(sched)
    sched.assert_empty()


def test_alise_misprediction_doubles_the_prediction_and_demotes() -> None:
    sched = make_scheduler("alise:level_base_tokens=2", max_num_seqs=4)
    req = predicted("r", 8, 30, guess=4)
    sched.add_request(req, 0.0)
    predictions = [state(req).predicted]
    now = 0.0
    while not req.status.is_finished:
        before = state(req).level
        step(sched, now)
        now += 0.01
        if not req.status.is_finished and state(req).predicted != predictions[-1]:
            assert req.num_output_tokens == predictions[-1]  # it reached the prediction unfinished
            predictions.append(state(req).predicted)
            assert state(req).level > before or state(req).level == policy(sched).config.num_queues
    assert predictions == [4, 8, 16, 32]
    run_to_completion(sched)
    sched.assert_empty()


def test_alise_ewt_is_the_work_ranked_ahead_bounded_by_the_promotion_time() -> None:
    sched = make_scheduler("alise:age_threshold_s=1.0")
    alise = policy(sched)
    jobs = [predicted(f"j{i}", 8, 10) for i in range(3)]
    for i, req in enumerate(jobs):
        req.policy_state = JobState(level=2, key=0.0, seq=i, clock=1.0, predicted=10)
    state(jobs[2]).clock = 0.2  # at t = 1.0 it has waited 0.8 s of its 1 s age threshold
    ranked = [(2, rem, i, req) for i, (rem, req) in enumerate(zip((1.0, 2.0, 3.0), jobs, strict=True))]
    ewts, total = alise._ewts(ranked, 0.5, now=1.0)
    t_promote = 1.0 * (2 - 1) + (1.0 - 0.8)  # one more queue to climb, plus what is left of this one
    assert [e for e, _, _ in ewts] == [0.5, 1.5, min(3.5, t_promote)]
    assert math.isclose(total, 6.5)
    assert sorted(ewts, key=lambda e: e[0])[1][2] is jobs[2]  # the promotion bound moves it up
    for req in jobs:
        req.policy_state = None
    sched.assert_empty()


def test_alise_swaps_out_paused_jobs_beyond_the_job_limit_and_swaps_in_those_about_to_run() -> None:
    sched = make_scheduler("alise:job_limit=2", max_num_seqs=1)
    c, b, a = predicted("c", 8, 9), predicted("b", 8, 6), predicted("a", 8, 3)
    sched.add_request(c, 0.0)
    step(sched, 0.0)
    sched.add_request(b, 0.01)
    step(sched, 0.02)  # b overtakes c
    sched.add_request(a, 0.03)
    plan, _ = step(sched, 0.04)  # a overtakes b: batch {a}, M = 2 leaves one GPU slot for b
    assert list(plan.num_scheduled_tokens) == ["a"]
    assert b.status is RequestStatus.PREEMPTED_KEPT
    assert c.status is RequestStatus.PREEMPTED_SWAPPED
    swap_out = [m for m in plan.kv_moves if m.kind is KVMoveKind.SWAP_OUT]
    assert [m.request_id for m in swap_out] == ["c"] and swap_out[0].int8
    now = 0.05
    while not a.status.is_finished:
        plan, _ = step(sched, now)
        now += 0.01
    plan, _ = step(sched, now)  # b runs; c now ranks within M and is brought back ahead of time
    assert list(plan.num_scheduled_tokens) == ["b"]
    assert [m.request_id for m in plan.kv_moves if m.kind is KVMoveKind.SWAP_IN] == ["c"]
    assert c.status is RequestStatus.DECODING
    run_to_completion(sched)
    sched.assert_empty()


def test_alise_swaps_out_beyond_the_job_limit_only_what_the_swap_space_still_takes() -> None:
    """Two paused jobs fall beyond the job limit M in one step, and the swap space holds one
    of them: the one with the smaller EWT goes to CPU, the other stays paused on the GPU (a
    swap-out the swap space cannot take is skipped), and nothing is recomputed."""
    sched = make_scheduler("alise:job_limit=2", max_num_seqs=2, num_cpu_blocks=3, block_size=4)
    d, c = predicted("d", 8, 12), predicted("c", 8, 9)
    for req in (d, c):
        sched.add_request(req, 0.0)
    step(sched, 0.0)
    step(sched, 0.01)  # both decode: 3 blocks each
    assert [len(sched.kv.gpu_tables[r.request_id]) for r in (c, d)] == [3, 3]
    b, a = predicted("b", 8, 3), predicted("a", 8, 2)
    for req in (b, a):
        sched.add_request(req, 0.02)
    plan, _ = step(sched, 0.02)  # a and b take both seats; M = 2 leaves no slot for c or d
    assert sorted(plan.num_scheduled_tokens) == ["a", "b"]
    assert [m.request_id for m in plan.kv_moves if m.kind is KVMoveKind.SWAP_OUT] == ["c"]
    assert c.status is RequestStatus.PREEMPTED_SWAPPED and d.status is RequestStatus.PREEMPTED_KEPT
    assert sched.kv.cpu.num_available() == 0
    run_to_completion(sched)
    assert not any(mode == "recompute" for mode, _ in sched.metrics.preemptions)
    sched.assert_empty()


def test_with_the_swap_space_full_no_kept_job_can_go_only_if_each_is_known_and_holds_a_block() -> None:
    """Algorithm 2's one answer for every queue with the swap space full must be the queues'
    own scans' (`_swappable` with no free block): a job the worker does not know (no KV to
    copy) or one holding no GPU block passes `can_swap_out` whatever the swap space."""
    jobs = [make_request(rid, 8, 4) for rid in "abc"]
    for job in jobs:
        job.status = RequestStatus.PREEMPTED_KEPT
    kept = {job.request_id: job for job in jobs}
    entries = [(2, float(i), i, job) for i, job in enumerate(jobs)]
    cases = [
        ({"a": [0, 1], "b": [2], "c": [3, 4, 5]}, {"a", "b", "c"}, True),
        ({"a": [0, 1], "b": [2], "c": [3, 4, 5]}, {"a", "c"}, False),  # b is unknown to the worker
        ({"a": [0, 1], "c": [3, 4, 5]}, {"a", "b", "c"}, False),  # b holds no block
        ({"a": [0, 1], "b": [], "c": [3, 4, 5]}, {"a", "b", "c"}, False),
    ]
    for tables, known, none in cases:
        assert _none_can_swap_out(kept, tables, known) is none
        assert none is not _swappable(entries, tables, 0, known)
    assert _none_can_swap_out({}, {}, set())


def _memory_pressure(spec: str, num_cpu_blocks: int = 64) -> tuple[Scheduler, Request, Request, StepPlan]:
    """A long job holds most of a 10-block GPU when a shorter job with a big prompt arrives."""
    sched = make_scheduler(spec, num_gpu_blocks=10, num_cpu_blocks=num_cpu_blocks, block_size=4)
    long = predicted("long", 12, 16)
    sched.add_request(long, 0.0)
    now = 0.0
    while sched.kv.gpu.num_free > 4:
        step(sched, now)
        now += 0.01
    short = predicted("short", 20, 2)
    sched.add_request(short, now)
    plan, _ = step(sched, now)
    return sched, long, short, plan


def test_alise_swap_manager_swaps_out_the_lower_ranked_job_for_a_shorter_one() -> None:
    sched, long, short, _ = _memory_pressure("alise")
    assert long.status is RequestStatus.PREEMPTED_SWAPPED
    assert short.status is RequestStatus.DECODING
    run_to_completion(sched)
    assert sched.metrics.preemptions[("swap", "kv_pressure")] == 1
    sched.assert_empty()


@pytest.mark.parametrize("spec", ["alise", "fastserve"])
def test_a_job_whose_kv_the_swap_space_cannot_take_is_not_recomputed_for_a_new_one(spec: str) -> None:
    # No swap space: evicting the long job would drop its KV. The new job waits instead (the
    # papers evict by swapping), and both finish without a single recompute.
    sched, long, short, _ = _memory_pressure(spec, num_cpu_blocks=0)
    assert long.status.is_running or long.status is RequestStatus.PREEMPTED_KEPT
    assert long.num_preemptions == 0 and short.status.is_waiting
    run_to_completion(sched)
    assert not any(mode == "recompute" for mode, _ in sched.metrics.preemptions)
    sched.assert_empty()


def test_alise_recompute_variant_drops_the_kv_of_evicted_jobs() -> None:
    sched, long, short, _ = _memory_pressure("alise:memory=recompute")
    assert long.status is RequestStatus.PREEMPTED_RECOMPUTE and long.num_computed_tokens == 0
    assert short.status is RequestStatus.DECODING
    run_to_completion(sched)
    assert sched.metrics.preemptions[("recompute", "kv_pressure")] == 1
    assert ("swap", "kv_pressure") not in sched.metrics.preemptions
    sched.assert_empty()


def test_alise_defer_variant_makes_new_jobs_wait_for_memory() -> None:
    sched, long, short, _ = _memory_pressure("alise:memory=defer")
    assert long.status is RequestStatus.DECODING and long.num_preemptions == 0
    assert short.status is RequestStatus.WAITING
    run_to_completion(sched)
    assert long.finish_time is not None and short.first_scheduled_time is not None
    assert short.first_scheduled_time >= long.finish_time  # it waited for long's memory
    sched.assert_empty()


def test_alise_int8_option_decides_whether_swapped_kv_is_compressed() -> None:
    for flag in (True, False):
        sched, long, _, plan = _memory_pressure(f"alise:int8={str(flag).lower()}")
        assert long.status is RequestStatus.PREEMPTED_SWAPPED
        assert [m.int8 for m in plan.kv_moves if m.kind is KVMoveKind.SWAP_OUT] == [flag]
        run_to_completion(sched)
        sched.assert_empty()


class LinearCosts:
    """A cost model that is exactly ALISE's Eq. 4-5."""

    def prefill_time(self, num_tokens: int, prefix: int = 0) -> float:
        return 3e-4 * num_tokens

    def decode_time(self, batch_size: int, context_len: int) -> float:
        return 1e-6 * context_len + 0.015


def test_exec_time_model_fit_recovers_linear_latencies_by_least_squares() -> None:
    model = ExecTimeModel.fit(LinearCosts(), max_len=2048)  # type: ignore[arg-type]
    assert math.isclose(model.t0, 3e-4, rel_tol=1e-6)
    assert math.isclose(model.alpha, 1e-6, rel_tol=1e-6)
    assert math.isclose(model.beta, 0.015, rel_tol=1e-6)
    assert math.isclose(model.decode(100, 10), 10 * (1e-4 + 0.015))


# ---------------------------------------------------------------- vLLM's engine (the paper's)
def test_alise_admits_new_jobs_in_a_prefill_only_step_as_vllm_does() -> None:
    sched = make_scheduler("alise")
    long = predicted("long", 8, 20)
    sched.add_request(long, 0.0)
    step(sched, 0.0)
    sched.add_request(predicted("new", 8, 5), 0.01)
    plan, _ = step(sched, 0.02)
    assert list(plan.num_scheduled_tokens) == ["new"] and plan.metadata["phase"] == "prefill"
    assert long.status is RequestStatus.DECODING and long.num_preemptions == 0  # it sat out, not paused
    plan, _ = step(sched, 0.03)
    assert set(plan.num_scheduled_tokens) == {"long", "new"}  # then both decode
    run_to_completion(sched)
    sched.assert_empty()


def test_alise_hybrid_option_mixes_the_new_prompt_into_the_decode_batch() -> None:
    sched = make_scheduler("alise:hybrid=true")
    sched.add_request(predicted("long", 8, 20), 0.0)
    step(sched, 0.0)
    sched.add_request(predicted("new", 8, 5), 0.01)
    plan, _ = step(sched, 0.02)
    assert plan.num_scheduled_tokens == {"new": 8, "long": 1}
    run_to_completion(sched)
    sched.assert_empty()


def test_aging_due_queue_gives_the_order_of_one_heap_of_entries() -> None:
    """ALISE's aging checks come due in (time, seq) order. The due-time buckets must give exactly
    what one heap of (time, seq, job) entries gives, with many jobs due at the same time (a
    cohort that arrived together) and entries filed again while a step walks its due ones."""
    import heapq
    import random

    from scheduler_service.policies.alise.aging import DueQueue

    rng = random.Random(7)
    jobs = [make_request(f"j{i}", 4, 4) for i in range(400)]
    queue, heap = DueQueue(), []
    for seq, job in enumerate(jobs):
        due = rng.choice((1.0, 1.0, 2.0, 3.5)) if seq % 3 else rng.uniform(0.0, 5.0)  # many ties
        queue.push(due, seq, job)
        heapq.heappush(heap, (due, seq, job))
    now, popped = 0.0, 0
    while heap:
        now += rng.uniform(0.1, 1.5)
        want = []
        while heap and heap[0][0] <= now:
            want.append(heapq.heappop(heap))
        got = queue.pop_due(now)
        assert [(seq, job.request_id) for _, seq, job in want] == [(seq, job.request_id) for seq, job in got]
        popped += len(got)
        together: list[tuple[int, object]] = []  # filed again as one batch (a promoted cohort)
        for (_, seq, job), entry in zip(want, got, strict=True):
            if rng.random() < 0.5 and now < 20:  # filed again, at a time some others share
                due = now + rng.choice((1.0, 2.0))
                queue.push_entry(due, entry)
                heapq.heappush(heap, (due, seq, job))
            elif rng.random() < 0.5 and now < 20:
                together.append(entry)
                heapq.heappush(heap, (now + 1.0, seq, job))
        if together:
            rng.shuffle(together)  # a bucket's order comes from its sort, not from its filing
            queue.push_entries(now + 1.0, together)  # type: ignore[arg-type]
    assert len(queue) == 0 and popped > 400


def test_moving_waiting_jobs_up_together_is_discard_then_push_of_each() -> None:
    """`LevelQueues.move_up` (a cohort promoted by aging) must leave every level's count, its
    sum of weights to the last bit, and the order of every later take as `discard`, then
    `push`, of each job in turn: the EWTs of Algorithm 2 are summed from those sums."""
    import random

    from scheduler_service.policies.mlfq import LevelQueues

    rng = random.Random(11)
    levels = 5

    def build() -> tuple[LevelQueues, list[Request]]:
        queues, jobs = LevelQueues(levels), []
        for seq in range(1, 601):
            job = make_request(f"j{seq}", 4, 4)
            weight = rng.uniform(0.001, 3.0)
            job.policy_state = JobState(level=rng.randrange(1, levels), key=weight, seq=seq, clock=0.0, weight=weight)
            queues.push(job)
            jobs.append(job)
        return queues, jobs

    state = rng.getstate()
    bulk, bulk_jobs = build()
    rng.setstate(state)
    one_by_one, jobs = build()
    for _ in range(6):
        picked = rng.sample(range(len(jobs)), rng.choice((5, 300, 580)))  # a few, half, nearly all
        keys = [rng.uniform(0.001, 3.0) for _ in picked]
        bulk.move_up(
            [bulk_jobs[i] for i in picked if bulk_jobs[i].policy_state.level > 0],
            [k for i, k in zip(picked, keys, strict=True) if bulk_jobs[i].policy_state.level > 0],
        )
        for i, key in zip(picked, keys, strict=True):
            st = jobs[i].policy_state
            if st.level == 0:
                continue
            one_by_one.discard(jobs[i])
            st.level, st.key, st.weight = st.level - 1, key, key
            one_by_one.push(jobs[i])
        assert bulk.counts == one_by_one.counts
        assert bulk.sums == one_by_one.sums  # the same floats, not close ones
        assert bulk.changes == one_by_one.changes
    order = []
    while (head := bulk.pop()) is not None:
        order.append(head.request_id)
    want = []
    while (head := one_by_one.pop()) is not None:
        want.append(head.request_id)
    assert order == want and len(order) == 600
