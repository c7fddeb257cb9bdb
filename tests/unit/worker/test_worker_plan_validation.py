"""A malformed plan raises StepPlanError naming the request, and changes nothing: the
other requests' state and KV stay as they were, and they go on decoding the same tokens."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from worker_harness import GREEDY, MiniScheduler, dense_greedy, make_engine, random_prompt

from sluice.contract.plan import CachedRequestData, KVMove, KVMoveKind, NewRequestData, StepPlan
from worker_service.engine import LLMEngine, StepPlanError

NUM_GPU_BLOCKS = 32


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return make_engine("tiny-llama", num_gpu_blocks=NUM_GPU_BLOCKS, num_cpu_blocks=8)


@pytest.fixture(scope="module")
def reference(engine: LLMEngine) -> dict[str, list[int]]:
    """Greedy continuations of the two requests the `sched` fixture starts (dense, no cache)."""
    return {rid: dense_greedy(engine.model, random_prompt(n, seed), 6) for rid, n, seed in (("a", 9, 10), ("b", 6, 11))}


@pytest.fixture
def sched(engine: LLMEngine) -> MiniScheduler:
    engine.init_kv_cache(NUM_GPU_BLOCKS, 8)
    s = MiniScheduler(engine)
    s.add("a", random_prompt(9, seed=10))
    s.add("b", random_prompt(6, seed=11))
    s.step({"a": 9, "b": 6})
    s.step({"a": 1, "b": 1})
    return s


def snapshot(engine: LLMEngine) -> tuple[dict, torch.Tensor]:
    assert engine.cache is not None
    state = {
        rid: vars(r) | {"generator": None, "block_array": r.block_array.tolist()} for rid, r in engine.requests.items()
    }
    return copy.deepcopy(state), engine.cache.kv.clone()


def new(rid: str, blocks: tuple[int, ...], n: int = 5) -> NewRequestData:
    tokens = tuple(random_prompt(n, seed=99))
    return NewRequestData(rid, tokens, n, GREEDY, blocks)


def plan(**kw: object) -> StepPlan:
    base = {
        "step_id": 7,
        "worker_id": 0,
        "new_requests": (),
        "cached_requests": CachedRequestData(),
        "num_scheduled_tokens": {"a": 1, "b": 1},
        "sample_ids": frozenset({"a", "b"}),
    }
    return StepPlan(**(base | kw))  # type: ignore[arg-type]


def free_block(s: MiniScheduler) -> int:
    used = {b for t in s.kv.gpu_tables.values() for b in t}
    return next(b for b in range(NUM_GPU_BLOCKS) if b not in used)


BAD_PLANS: dict[str, Callable[[MiniScheduler], StepPlan]] = {
    "unknown request scheduled": lambda s: plan(num_scheduled_tokens={"a": 1, "ghost": 1}),
    "block out of range": lambda s: plan(
        new_requests=(new("c", (NUM_GPU_BLOCKS + 3, free_block(s))),), num_scheduled_tokens={"a": 1, "c": 5}
    ),
    "block owned by another request": lambda s: plan(
        new_requests=(new("c", (s.kv.gpu_tables["b"][0], free_block(s))),),
        num_scheduled_tokens={"a": 1, "c": 5},
        sample_ids=frozenset({"a"}),
    ),
    "duplicate block within a request": lambda s: plan(
        new_requests=(new("c", (free_block(s), free_block(s))),), num_scheduled_tokens={"a": 1, "c": 5}
    ),
    "too few blocks": lambda s: plan(new_requests=(new("c", (free_block(s),), n=7),), num_scheduled_tokens={"c": 7}),
    "known request sent as new": lambda s: plan(new_requests=(new("a", (free_block(s), free_block(s) + 1)),)),
    "num_computed mismatch": lambda s: plan(
        cached_requests=CachedRequestData(("a",), ((),), (False,), (s.computed["a"] + 3,))
    ),
    "cached diff for unknown request": lambda s: plan(
        cached_requests=CachedRequestData(("zz",), ((),), (False,), (0,))
    ),
    "schedules beyond known tokens": lambda s: plan(num_scheduled_tokens={"a": 2, "b": 1}),
    "samples an unscheduled request": lambda s: plan(num_scheduled_tokens={"a": 1}),
    "swap-out of blocks it does not own": lambda s: plan(
        kv_moves=(KVMove(KVMoveKind.SWAP_OUT, "a", tuple(s.kv.gpu_tables["b"]), (0,) * len(s.kv.gpu_tables["b"])),)
    ),
    "swap-in of CPU blocks it does not own": lambda s: plan(
        kv_moves=(KVMove(KVMoveKind.SWAP_IN, "a", (3,), (s.kv.gpu_tables["a"][0],)),)
    ),
    "prompt longer than num_tokens": lambda s: plan(
        new_requests=(replace(new("c", (free_block(s),)), num_tokens=3),), num_scheduled_tokens={"c": 3}
    ),
}


# Plans that collide with state the worker holds from earlier plans: the states diverged.
DIVERGED = {"block owned by another request", "known request sent as new"}


@pytest.mark.parametrize("case", sorted(BAD_PLANS))
def test_bad_plan_raises_and_leaves_state_untouched(
    case: str, engine: LLMEngine, sched: MiniScheduler, reference: dict[str, list[int]]
) -> None:
    before_state, before_kv = snapshot(engine)
    with pytest.raises(StepPlanError) as err:
        engine.execute(BAD_PLANS[case](sched))
    assert err.value.code == ("ABORTED" if case in DIVERGED else "INVALID_ARGUMENT")
    assert err.value.message
    after_state, after_kv = snapshot(engine)
    assert after_state == before_state
    assert torch.equal(after_kv, before_kv)
    for _ in range(4):
        sched.step({"a": 1, "b": 1})
    for rid in ("a", "b"):
        assert sched.outputs(rid) == reference[rid]


def test_error_names_the_request_at_fault(engine: LLMEngine, sched: MiniScheduler) -> None:
    with pytest.raises(StepPlanError) as err:
        engine.execute(BAD_PLANS["unknown request scheduled"](sched))
    assert err.value.request_id == "ghost"


def test_release_then_resend_as_new_in_the_same_plan_is_allowed(engine: LLMEngine, sched: MiniScheduler) -> None:
    sched.preempt_recompute("a")
    result = sched.step({"a": len(sched.tokens["a"]), "b": 1})
    assert set(result.sampled_token_ids) == {"a", "b"}
    assert engine.num_requests == 2


def test_release_is_idempotent_and_reports_what_it_forgot(engine: LLMEngine, sched: MiniScheduler) -> None:
    assert engine.release(["a", "nope"]) == ["a"]
    assert engine.release(["a"]) == []
    assert engine.num_requests == 1


def test_plan_before_kv_cache_exists_is_refused() -> None:
    engine = LLMEngine.__new__(LLMEngine)
    engine.cache, engine.requests = None, {}
    with pytest.raises(StepPlanError) as err:
        engine.execute(plan())
    assert err.value.code == "FAILED_PRECONDITION"
