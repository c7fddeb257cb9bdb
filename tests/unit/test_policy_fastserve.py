"""FastServe's skip-join MLFQ: placement by prefill time, demotion after the quantum, swap
under KV pressure. Every test ends with the leak check."""

from __future__ import annotations

from collections import Counter

import pytest
from harness import make_request, make_scheduler, run_to_completion, step

from scheduler_service.core.request import RequestStatus
from scheduler_service.policies.baselines.fastserve import DEFAULT_PREFILL_S_PER_TOKEN, FastServePolicy
from scheduler_service.policies.mlfq import JobState
from sluice.contract.plan import KVMoveKind


def level(req: object) -> int:
    st = req.policy_state  # type: ignore[attr-defined]
    assert isinstance(st, JobState)
    return st.level


def test_fastserve_skip_join_places_a_job_in_the_first_queue_whose_quantum_covers_its_prefill() -> None:
    sched = make_scheduler(
        "fastserve:quantum_s=0.01", num_gpu_blocks=512, max_model_len=4096, max_num_batched_tokens=4096
    )
    policy = sched.policy
    assert isinstance(policy, FastServePolicy)
    assert policy.quanta == [0.01, 0.02, 0.04, 0.08, 0.16]
    placed = {}
    for prompt in (8, 100, 150, 700, 1000):
        req = make_request(f"p{prompt}", prompt, 2)
        sched.add_request(req, 0.0)
        placed[prompt] = level(req)
    # prefill 0.0016 s, 0.02 s, 0.03 s, 0.14 s, 0.2 s (longer than every quantum: the last queue)
    assert DEFAULT_PREFILL_S_PER_TOKEN == 2e-4
    assert placed == {8: 0, 100: 1, 150: 2, 700: 4, 1000: 4}
    run_to_completion(sched)
    sched.assert_empty()


def test_fastserve_demotes_a_job_that_uses_up_its_quantum_and_a_new_job_overtakes_it() -> None:
    sched = make_scheduler("fastserve:quantum_s=0.02", max_num_seqs=1)
    old = make_request("old", 8, 30)
    sched.add_request(old, 0.0)
    step(sched, 0.0)
    assert level(old) == 0
    step(sched, 0.01)  # two 10 ms iterations: queue 0's 20 ms quantum is used up
    assert level(old) == 1
    for t in range(4):
        step(sched, 0.02 + 0.01 * t)
    assert level(old) == 2  # 40 ms more in queue 1
    new = make_request("new", 8, 3)
    sched.add_request(new, 0.1)
    plan, _ = step(sched, 0.1)
    assert list(plan.num_scheduled_tokens) == ["new"]
    assert old.status is RequestStatus.PREEMPTED_KEPT
    run_to_completion(sched)
    assert new.finish_time is not None and old.finish_time is not None and new.finish_time < old.finish_time
    sched.assert_empty()


def test_fastserve_swaps_the_lower_priority_job_out_when_gpu_kv_is_short() -> None:
    sched = make_scheduler("fastserve:quantum_s=0.02", num_gpu_blocks=10, block_size=4)
    old = make_request("old", 12, 20)
    sched.add_request(old, 0.0)
    now = 0.0
    while sched.kv.gpu.num_free > 4:
        step(sched, now)
        now += 0.01
    assert level(old) > 0
    new = make_request("new", 20, 2)  # needs 5 blocks, 4 are free
    sched.add_request(new, now)
    plan, _ = step(sched, now)
    assert "new" in plan.num_scheduled_tokens
    assert old.status is RequestStatus.PREEMPTED_SWAPPED
    assert [m.request_id for m in plan.kv_moves if m.kind is KVMoveKind.SWAP_OUT] == ["old"]
    kinds = [m.kind for p in run_to_completion(sched) for m in p.kv_moves]
    assert KVMoveKind.SWAP_IN in kinds
    assert sched.metrics.preemptions[("swap", "kv_pressure")] == 1
    sched.assert_empty()


def test_queue_policies_sort_paused_jobs_by_ranks_that_are_still_current() -> None:
    """Only running jobs are re-ranked each step; every paused job's cached rank must still
    equal its rank now (aging, demotion and swaps included), or the batch order is wrong."""
    import random

    rng = random.Random(3)
    for spec in ("fastserve:quantum_s=0.01", "alise:age_threshold_s=0.05"):
        sched = make_scheduler(spec, num_gpu_blocks=48, max_num_seqs=4, max_model_len=512)
        paused_checked = 0
        now = 0.0
        for i in range(80):
            sched.add_request(make_request(f"r{i}", rng.randint(4, 40), rng.randint(2, 30)), now)
            for _ in range(3):
                step(sched, now)
                now += 0.01
                for req in [*sched.kept.values(), *sched.swapped.values()]:
                    assert req.policy_state.rank == sched.policy.rank(req), (spec, req)
                    paused_checked += 1
                if sched.policy.index_paused:
                    # the paused index, brought up to date as a step would, holds exactly
                    # the paused jobs under their ranks now, in rank order
                    index = sched.policy.paused
                    index.sync(sched.kept, sched.swapped)
                    paused = sorted(
                        (r.policy_state.rank, r.request_id) for r in [*sched.kept.values(), *sched.swapped.values()]
                    )
                    assert [((lvl, key, seq), r.request_id) for lvl, key, seq, r in index.entries] == paused, spec
        if sched.policy.index_paused:
            assert sched.policy.paused.rebuilds == 0, f"{spec}: a paused job moved without the index being told"
        assert paused_checked > 100, f"{spec}: the workload paused too few jobs to test anything"
        run_to_completion(sched)
        sched.assert_empty()


def _plan_trace(
    spec: str, index_paused: bool, seed: int
) -> tuple[list[tuple[object, ...]], dict[str, int], dict[str, object]]:
    """Every step's decisions for a random workload on a small, contended GPU, the preemptions
    by mode and reason, and the policy's counters."""
    import random

    rng = random.Random(seed)
    sched = make_scheduler(spec, num_gpu_blocks=40, num_cpu_blocks=24, max_num_seqs=6, max_model_len=512)
    sched.policy.index_paused = index_paused  # type: ignore[attr-defined]
    trace: list[tuple[object, ...]] = []
    now = 0.0
    for i in range(120):
        sched.add_request(make_request(f"r{i}", rng.randint(4, 60), rng.randint(1, 40)), now)
        for _ in range(rng.randint(1, 3)):
            plan, _ = step(sched, now)
            moves = tuple((m.kind, m.request_id, m.src_block_ids, m.dst_block_ids) for m in plan.kv_moves)
            trace.append((tuple(plan.num_scheduled_tokens.items()), moves, len(sched.kept), len(sched.swapped)))
            now += 0.01
    run_to_completion(sched)
    sched.assert_empty()
    if index_paused:
        assert sched.policy.paused.rebuilds == 0, f"{spec}: a paused job moved without the index being told"
    preemptions = {f"{mode}/{reason}": n for (mode, reason), n in sched.metrics.preemptions.items()}
    return trace, preemptions, sched.policy.stats_report()


# ALISE: the prefill pass of vLLM's engine (victims below each head) and hybrid batches, the
# three memory managers, and Algorithm 2 with a job limit small enough to swap out and back in.
INDEX_CASES = [
    *(f"fastserve:quantum_s=0.01,memory={memory}" for memory in ("swap", "recompute", "defer")),
    *(f"alise:age_threshold_s=0.05,memory={memory}" for memory in ("swap", "recompute", "defer")),
    "alise:age_threshold_s=0.05,hybrid=true",
    "alise:age_threshold_s=0.05,job_limit=2",
    "alise:age_threshold_s=0.05,job_limit=4",
    "alise:age_threshold_s=0.05,job_limit=2,hybrid=true",
]


@pytest.mark.parametrize("spec", INDEX_CASES)
def test_the_paused_index_makes_the_decisions_of_sorting_every_kv_holder(spec: str) -> None:
    """FastServe and ALISE read their paused jobs from an index kept up to date by hooks (and
    ALISE's Algorithm 2 reads its queues' sizes from it); the generic path sorts every KV holder
    each step and walks them all. Under KV pressure (evictions from the worst end, swaps,
    recomputes, jobs put back) both must make the same decisions, step by step."""
    moved: Counter[str] = Counter()
    for seed in (1, 2):
        indexed, preempted, counters = _plan_trace(spec, True, seed)
        sorted_each_step, preempted_sorted, counters_sorted = _plan_trace(spec, False, seed)
        assert indexed == sorted_each_step, (spec, seed)
        assert preempted == preempted_sorted
        assert counters == counters_sorted
        assert any("kv_pressure" in k for k in preempted), f"{spec}: no eviction, nothing tested"
        moved.update({k: v for k, v in counters.items() if k.startswith("ewt_")})
    if "job_limit" in spec:
        # Algorithm 2 moved jobs both ways (swapped out beyond M, back in ahead of their turn)
        assert moved["ewt_swap_outs"] and (moved["ewt_early_swap_ins"] or "hybrid" in spec), moved


@pytest.mark.parametrize("spec", ["fastserve:quantum_s=0.01", "alise:age_threshold_s=0.05"])
def test_paused_jobs_handed_back_to_the_router_leave_both_indexes_exact(spec: str) -> None:
    """Jobs paused on one worker and handed back (the worker is evacuated) are placed on another
    before the first steps again: each worker's index must still hold exactly its own paused
    jobs, without the fallback re-sort (which would mean a job moved without the index's hooks)."""
    import random

    rng = random.Random(5)
    first = make_scheduler(spec, num_gpu_blocks=48, max_num_seqs=4, max_model_len=512)
    second = make_scheduler(spec, num_gpu_blocks=48, max_num_seqs=4, max_model_len=512)
    now = 0.0
    for i in range(12):
        # NOTE: two arrivals a step, so that shorter jobs (ALISE) and fresh ones (FastServe)
        # take the seats of running ones, which pause
        first.add_request(make_request(f"r{i}", rng.randint(4, 40), rng.randint(10, 30)), now)
        if i % 2:
            step(first, now)
            now += 0.01
    assert first.kept, "nothing paused: nothing to hand back"
    for req in first.evacuate(now):
        second.add_request(req, now)
    for i in range(12, 20):
        first.add_request(make_request(f"r{i}", rng.randint(4, 40), rng.randint(2, 10)), now)
    for sched in (second, first):
        for _ in range(5):
            step(sched, now)
            now += 0.01
        index = sched.policy.paused
        index.sync(sched.kept, sched.swapped)
        assert sorted(e[3].request_id for e in index.entries) == sorted([*sched.kept, *sched.swapped])
    run_to_completion(first)
    run_to_completion(second)
    first.assert_empty()
    second.assert_empty()
    assert first.policy.paused.rebuilds == 0
    assert second.policy.paused.rebuilds == 0


def test_level_queues_with_fronts_give_the_order_of_one_heap() -> None:
    """Heads taken and put back (set aside by a step) sit in their level's front; with
    requeues of smaller keys (also while heads are out), discards and re-keys in between,
    every take still returns the best live job, as a single heap of every waiting job would."""
    import random

    from scheduler_service.policies.mlfq import LevelQueues

    rng = random.Random(7)
    queues = LevelQueues(3)
    jobs = [make_request(f"j{i}", 4, 4) for i in range(300)]
    waiting: set[int] = set()
    seq = 0
    fronts_used = 0
    for i, job in enumerate(jobs):
        seq += 1
        job.policy_state = JobState(level=rng.randrange(3), key=float(rng.randrange(1000)), seq=seq, clock=0.0)
        if i < 200:
            queues.push(job)
            waiting.add(i)

    def requeue(i: int) -> None:
        # a job back from recompute (its state, and so its entries' versions, carried over)
        nonlocal seq
        seq += 1
        st = jobs[i].policy_state
        st.level, st.key, st.seq = rng.randrange(3), float(rng.randrange(50)), seq
        queues.push(jobs[i])
        waiting.add(i)

    def best() -> int | None:
        live = [(jobs[i].policy_state.level, jobs[i].policy_state.key, jobs[i].policy_state.seq, i) for i in waiting]
        return min(live)[3] if live else None

    for _ in range(400):
        # a step: take a few heads, set some aside and put them back, as `fill_batch` does
        taken: list[int] = []
        for _ in range(rng.randrange(1, 6)):
            head = queues.peek()
            expected = best()
            assert (head is None) == (expected is None)
            if head is None:
                break
            assert head is jobs[expected]
            queues.take(head)
            waiting.discard(expected)
            taken.append(expected)
        if rng.random() < 0.3 and len(waiting) < len(jobs):
            # an eviction in the step sends a job back to recompute, its key before the heads'
            requeue(rng.choice([k for k in range(len(jobs)) if k not in waiting and k not in taken]))
        aside = [i for i in taken if rng.random() < 0.6]
        by_level: dict[int, list[tuple[float, int, int, object]]] = {}
        for i in aside:
            st = jobs[i].policy_state
            st.version -= 1  # untouched since taken: its entry goes back as it was
            st.in_heap = True
            queues.counts[st.level] += 1
            by_level.setdefault(st.level, []).append((st.key, st.seq, st.version, jobs[i]))
            waiting.add(i)
        for entries in by_level.values():
            queues.put_back(entries)
        fronts_used = max(fronts_used, sum(map(len, queues.fronts)))
        # between steps: a requeue with a small key, a re-key of a waiting job, a discard
        move = rng.random()
        if move < 0.3 and len(waiting) < len(jobs):
            requeue(rng.choice([k for k in range(len(jobs)) if k not in waiting]))
        elif move < 0.5 and waiting:
            i = rng.choice(sorted(waiting))
            queues.discard(jobs[i])
            jobs[i].policy_state.level = rng.randrange(3)
            jobs[i].policy_state.key = float(rng.randrange(1000))
            queues.push(jobs[i])
        elif move < 0.6 and waiting:
            i = rng.choice(sorted(waiting))
            queues.discard(jobs[i])
            waiting.discard(i)
        assert len(queues) == len(waiting)
    assert fronts_used > 0  # the put-backs went to the fronts


def test_a_job_filed_mid_step_in_a_level_the_walk_found_empty_is_the_next_head() -> None:
    """The walk over waiting heads skips, for the rest of the step, the levels it found empty,
    unless a job is filed since. Here a decode's eviction files the victim in queue 0 (empty
    when the walk found the head in queue 1): the victim is the next head, and as it does not
    fit (defer: a new job waits for memory) the step admits nobody after it. Without the
    refiled level read again, the head behind it would be admitted in its place."""
    sched = make_scheduler(
        "fastserve:quantum_s=0.02,memory=defer,watermark=0",
        num_gpu_blocks=17,
        block_size=16,
        max_num_batched_tokens=512,
    )
    policy = sched.policy
    assert isinstance(policy, FastServePolicy)

    def requeue_first(req: object) -> None:
        # a policy whose recompute sends a job to the front of queue 0 (FastServe's keeps its place)
        st = req.policy_state  # type: ignore[attr-defined]
        policy.queues.discard(req)  # type: ignore[arg-type]
        st.level, st.key = 0, -1.0
        st.rank = (0, -1.0, st.seq)
        st.entry = (0, -1.0, st.seq, req)
        policy.queues.push(req)  # type: ignore[arg-type]

    policy.requeue = requeue_first  # type: ignore[method-assign]
    runner = make_request("runner", 112, 4)  # 7 full blocks: its first decode needs an 8th
    victim = make_request("victim", 160, 2)  # 10 blocks; 11 to come back after one token
    for req in (runner, victim):
        sched.add_request(req, 0.0)
    step(sched, 0.0)
    assert sched.kv.gpu.num_free == 0
    late = make_request("late", 120, 2)  # 8 blocks: would fit in what the eviction frees
    sched.add_request(late, 0.01)
    assert [level(r) for r in (runner, victim, late)] == [1, 1, 1]
    plan, _ = step(sched, 0.01)
    assert sched.metrics.preemptions[("recompute", "kv_pressure")] == 1
    assert level(victim) == 0 and victim.status is RequestStatus.PREEMPTED_RECOMPUTE
    assert list(plan.num_scheduled_tokens) == ["runner"]
    run_to_completion(sched)
    sched.assert_empty()


def test_the_paused_index_files_a_steps_pauses_in_rank_order() -> None:
    """`_merged` files a step's new entries among the paused ones (at the end, one alone,
    clustered before every old entry, spread through them) exactly as sorting both would."""
    import random

    from scheduler_service.policies.paused_index import _merged

    rng = random.Random(3)
    job = make_request("j", 4, 4)
    for case in range(300):
        ranks = rng.sample(range(10_000), rng.randrange(2, 400))
        split = rng.randrange(1, len(ranks))
        if case % 3 == 0:  # a cluster before every old entry
            ranks.sort()
        old = sorted((r // 1000, float(r), r, job) for r in ranks[split:])
        new = sorted((r // 1000, float(r), r, job) for r in ranks[:split])
        expected = sorted(old + new)
        merged = _merged(list(old), new)
        assert [e[2] for e in merged] == [e[2] for e in expected]
