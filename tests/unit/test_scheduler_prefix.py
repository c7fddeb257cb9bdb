"""Prefix caching in the scheduling core: a KV-less request is admitted with its cached prefix
counted as computed (the plan tells the worker so, and only the rest is computed and charged
to the budget); a recompute-preempted request finds its own blocks again; every policy, with
each of its allocation and preemption modes, serves a workload of shared prefixes under KV
pressure to the end with no leaked block and no block freed while referenced."""

from __future__ import annotations

import pytest
from harness import fake_result, make_scheduler, run_to_completion, step

from scheduler_service import policies  # noqa: F401  (registration)
from scheduler_service.core.budget import TokenBudget
from scheduler_service.core.policy import POLICIES
from scheduler_service.core.preemption import PreemptionMode, PreemptionReason
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.step_builder import StepBuilder
from sluice.contract.sampling import SamplingParams

EOS = 0


def req(rid: str, prompt: list[int], output: int, arrival: float = 0.0) -> Request:
    return Request(
        rid,
        arrival_time=arrival,
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=output + 8),
        eos_token_ids=frozenset({EOS}),
        true_output_tokens=output,
    )


SYSTEM = list(range(100, 132))  # 8 blocks of 4


def test_admission_counts_the_cached_prefix_as_computed_and_charges_only_the_rest() -> None:
    sched = make_scheduler("vllm", prefix_caching=True, num_gpu_blocks=64)
    sched.add_request(req("a", [*SYSTEM, 1, 2, 3], 3), 0.0)
    run_to_completion(sched)
    sched.add_request(req("b", [*SYSTEM, 7, 8, 9, 10, 11], 2), 1.0)
    plan = sched.schedule(1.0)
    (new,) = plan.new_requests
    assert new.num_computed_tokens == 32 and plan.num_scheduled_tokens == {"b": 5}
    assert sched.requests["b"].num_cached_tokens == 32
    assert sched.metrics.prefix_hit_tokens == 32 and sched.metrics.prefix_query_tokens == 35 + 37
    sched.on_step_result(fake_result(sched, plan), 1.01)
    run_to_completion(sched)
    assert sched.metrics.prefill_tokens == 35 + 5
    sched.assert_empty()


def test_without_prefix_caching_the_same_request_computes_its_whole_prompt() -> None:
    sched = make_scheduler("vllm", num_gpu_blocks=64)
    sched.add_request(req("a", [*SYSTEM, 1, 2, 3], 3), 0.0)
    run_to_completion(sched)
    sched.add_request(req("b", [*SYSTEM, 7, 8, 9, 10, 11], 2), 1.0)
    plan = sched.schedule(1.0)
    assert plan.new_requests[0].num_computed_tokens == 0 and plan.num_scheduled_tokens == {"b": 37}


def test_a_chunked_policy_gets_a_chunk_of_uncached_tokens() -> None:
    sched = make_scheduler("vllm_chunked:budget=8", prefix_caching=True, num_gpu_blocks=64)
    sched.add_request(req("a", [*SYSTEM, 1], 2), 0.0)
    run_to_completion(sched)
    sched.add_request(req("b", [*SYSTEM, *range(200, 220)], 2), 1.0)
    plan = sched.schedule(1.0)
    assert plan.new_requests[0].num_computed_tokens == 32 and plan.num_scheduled_tokens == {"b": 8}


def test_a_recomputed_request_finds_its_own_blocks_again() -> None:
    sched = make_scheduler("vllm", prefix_caching=True, num_gpu_blocks=64)
    sched.add_request(req("a", list(range(1, 30)), 40), 0.0)
    for t in range(12):
        step(sched, t * 0.01)
    a = sched.requests["a"]
    computed = a.num_computed_tokens
    sched.preempt(a, PreemptionMode.RECOMPUTE, PreemptionReason.KV_PRESSURE, 0.2, to_front=True)
    plan = sched.schedule(0.3)
    assert plan.new_requests[0].num_computed_tokens == computed // 4 * 4
    assert plan.num_scheduled_tokens["a"] == a.num_tokens - computed // 4 * 4
    sched.on_step_result(fake_result(sched, plan), 0.31)
    run_to_completion(sched)
    sched.assert_empty()


def test_a_waiting_requests_hit_is_looked_up_again_after_an_eviction() -> None:
    sched = make_scheduler("vllm", prefix_caching=True, num_gpu_blocks=12)
    sched.add_request(req("a", [*SYSTEM, 1], 2), 0.0)
    run_to_completion(sched)
    b = req("b", [*SYSTEM, 2], 2)
    sched.add_request(b, 1.0)
    builder = StepBuilder(sched, TokenBudget(64, 16), 1.0)
    first = builder.prefix_hit(b)
    assert len(first) == 8
    sched.kv.allocate("filler", 4 * 12)  # every free block, then the whole LRU
    assert builder.prefix_hit(b) == []


def shared_prefix_workload(n: int) -> list[Request]:
    """Three groups sharing a long system prompt each, plus unique ones; some recur verbatim."""
    out = []
    for i in range(n):
        group = i % 4
        head = [] if group == 3 else [1000 * (group + 1) + t for t in range(24 + 8 * group)]
        tail = [50_000 + 100 * i + t for t in range(3 + (i * 5) % 11)]
        out.append(req(f"r{i}", head + tail, 2 + (i * 7) % 9, arrival=0.005 * i))
    return out


POLICY_MODES = [
    *POLICIES.names(),
    "vllm:preemption_mode=swap",
    "vllm_chunked:budget=16,preemption_mode=swap",
    "vllm_chunked:budget=16,allocate_whole_prompt=false",
    "sarathi:budget=16",
    "alise:memory=recompute",
    "alise:memory=defer",
    "fastserve:memory=recompute",
    "econoserve:pipe=false",
    "scls:keep_kv=true",
]


@pytest.mark.parametrize("policy", POLICY_MODES)
def test_every_policy_serves_shared_prefixes_under_kv_pressure_with_no_leak(policy: str) -> None:
    sched = make_scheduler(policy, prefix_caching=True, num_gpu_blocks=40, num_cpu_blocks=40, max_num_batched_tokens=64)
    pending = shared_prefix_workload(24)
    now = 0.0
    for _ in range(20_000):
        while pending and pending[0].arrival_time <= now:
            sched.add_request(pending.pop(0), now)
        if not pending and not sched.has_work:
            break
        step(sched, now)  # checks the KV invariants (reference counts = tables) after each half
        now += 0.01
    assert not pending and not sched.has_work
    finished = sched.metrics.ended.get("FINISHED_STOPPED", 0) + sched.metrics.ended.get("FINISHED_LENGTH", 0)
    assert finished + sum(sched.metrics.rejected.values()) == 24
    assert sched.metrics.prefix_hit_tokens > 0
    sched.assert_empty()


def salted(rid: str, prompt: int, output: int) -> Request:
    """A simulated request that knows only its lengths: no other request can share its blocks."""
    return Request(
        rid,
        arrival_time=0.0,
        num_prompt_tokens=prompt,
        sampling=SamplingParams(max_tokens=output + 8),
        eos_token_ids=frozenset({EOS}),
        true_output_tokens=output,
    )


def running_salted(*rids: str, steps: int = 12) -> Scheduler:
    """A vllm scheduler with prefix caching whose salted requests (29-token prompts, 40 outputs)
    have run `steps` steps."""
    sched = make_scheduler("vllm", prefix_caching=True, num_gpu_blocks=64)
    for rid in rids:
        sched.add_request(salted(rid, 29, 40), 0.0)
    for t in range(steps):
        step(sched, t * 0.01)
    return sched


def test_a_request_whose_blocks_nobody_can_share_is_never_hashed_while_it_runs() -> None:
    sched = running_salted("a")
    a = sched.requests["a"]
    assert a.num_computed_tokens >= 36 and sched.kv.num_registered("a") == 0
    assert a.block_hashes is None and a.prefix_salt is None and sched.kv.gpu.num_cached == 0


def test_its_blocks_are_hashed_when_its_kv_is_freed_and_found_again() -> None:
    sched = running_salted("a")
    a = sched.requests["a"]
    computed = a.num_computed_tokens
    sched.preempt(a, PreemptionMode.RECOMPUTE, PreemptionReason.KV_PRESSURE, 0.2, to_front=True)
    assert a.prefix_salt is not None and sched.kv.gpu.num_cached == computed // 4
    plan = sched.schedule(0.3)
    assert plan.new_requests[0].num_computed_tokens == computed // 4 * 4


def test_an_ended_request_parks_its_blocks_in_the_lru_without_hashing_them() -> None:
    """They age in the LRU exactly as registered blocks would (the eviction order other requests'
    cached blocks see is unchanged), but no lookup can name them."""
    sched = make_scheduler("vllm", prefix_caching=True, num_gpu_blocks=64)
    sched.add_request(salted("a", 29, 10), 0.0)
    run_to_completion(sched)
    gpu = sched.kv.gpu
    assert gpu.num_evictable == (29 + 10) // 4 and not gpu.by_hash
    assert gpu.allocate(64) is not None  # parked blocks are free to take
    gpu.check_invariants()


def test_shareable_blocks_end_at_the_first_salted_block() -> None:
    from scheduler_service.core.prefix import NO_LIMIT, PrefixSource, shareable_blocks

    live = req("l", list(range(1, 30)), 3)
    assert shareable_blocks(live, 4) == NO_LIMIT
    assert shareable_blocks(salted("s", 29, 3), 4) == 0
    trace = Request("t", arrival_time=0.0, num_prompt_tokens=1000, prefix_source=PrefixSource((7, 8), 512))
    assert shareable_blocks(trace, 16) == 1000 // 16  # both trace blocks cover the prompt
    short = Request("u", arrival_time=0.0, num_prompt_tokens=1500, prefix_source=PrefixSource((7, 8), 512))
    assert shareable_blocks(short, 16) == 1024 // 16  # past the trace's last block: salted
    answer = Request(
        "v", arrival_time=0.0, prompt_token_ids=list(range(30)), prefix_source=PrefixSource((), 512, (1,) * 10)
    )
    assert shareable_blocks(answer, 4) == 40 // 4


def test_trimming_or_lending_the_unused_tail_of_a_reservation_leaves_a_request_owning_its_blocks() -> None:
    """EconoServe trims and lends the blocks a request reserved beyond its computed KV: none of
    that KV leaves, so nothing is hashed and the request's freed KV stays its own run."""
    sched = running_salted("a", "b", steps=6)
    a, b = sched.requests["a"], sched.requests["b"]
    computed = a.num_computed_tokens
    assert sched.kv.allocate("a", computed + 6 * 4) is not None  # six blocks past its KV
    builder = StepBuilder(sched, TokenBudget(64, 16), 1.0)
    assert len(builder.shrink_allocation(a, computed + 3 * 4)) >= 2
    assert len(builder.lend_blocks(a, b, 2)) == 2
    assert "a" not in sched.kv.hashed and "b" not in sched.kv.hashed
    assert sched.kv.num_registered("a") == 0 and sched.kv.num_registered("b") == 0 and not sched.kv.gpu.by_hash
    sched.kv.gpu.check_invariants()


def test_trimming_into_its_computed_kv_registers_the_blocks_that_leave() -> None:
    sched = running_salted("a", steps=6)
    a = sched.requests["a"]
    full = a.num_computed_tokens // 4
    builder = StepBuilder(sched, TokenBudget(64, 16), 1.0)
    builder.shrink_allocation(a, 2 * 4)  # keeps two blocks: full - 2 computed ones leave
    assert "a" in sched.kv.hashed and sched.kv.gpu.num_cached == full
    sched.kv.gpu.check_invariants()
