"""The echo engine (`sluice worker --engine echo`): the engine's plan rules without a model,
checked all-or-nothing, synthetic tokens that are never EOS, blocks tracked incrementally."""

from __future__ import annotations

import pytest

from sluice.contract.plan import CachedRequestData, KVMove, KVMoveKind, NewRequestData, StepPlan
from sluice.contract.sampling import SamplingParams
from worker_service.echo_engine import EchoEngine
from worker_service.engine import EngineConfig, StepPlanError

SAMPLING = SamplingParams(temperature=0.0, max_tokens=100)


@pytest.fixture
def engine() -> EchoEngine:
    e = EchoEngine(EngineConfig(model="tiny-llama", block_size=4))
    e.init_kv_cache(16, 8)
    return e


def plan(step: int, scheduled: dict[str, int], sample=(), new=(), cached=None, moves=(), release=()) -> StepPlan:
    return StepPlan(
        step_id=step,
        worker_id=0,
        new_requests=tuple(new),
        cached_requests=cached or CachedRequestData(),
        num_scheduled_tokens=scheduled,
        sample_ids=frozenset(sample),
        release_ids=tuple(release),
        kv_moves=tuple(moves),
    )


def new(rid: str, n: int, blocks: tuple[int, ...]) -> NewRequestData:
    return NewRequestData(rid, tuple(range(1000, 1000 + n)), n, SAMPLING, blocks)


def test_prefill_then_decodes_give_non_eos_tokens(engine: EchoEngine) -> None:
    r = engine.execute(plan(1, {"a": 6}, sample=["a"], new=[new("a", 6, (0, 1))]))
    tokens = [r.sampled_token_ids["a"]]
    for step in range(2, 5):
        cached = CachedRequestData(("a",), ((2,),), (False,), (7,)) if step == 3 else None
        tokens.append(engine.execute(plan(step, {"a": 1}, sample=["a"], cached=cached)).sampled_token_ids["a"])
    assert len(set(tokens)) == 4
    assert not set(tokens) & set(engine.info.eos_token_ids)
    assert engine.requests["a"].num_computed_tokens == 9 and engine.gpu_owner == {0: "a", 1: "a", 2: "a"}


BAD_PLANS = [
    (plan(2, {"zz": 1}, sample=["zz"]), "unknown"),
    (plan(2, {"b": 4}, new=[new("b", 4, (1,))]), "given to both"),
    (plan(2, {"b": 4}, new=[new("b", 4, (99,))]), "out of range"),
    (plan(2, {"b": 8}, new=[new("b", 8, (5,))]), "cannot hold"),
    (plan(2, {"b": 2}, sample=["b"], new=[new("b", 4, (5,))]), "before the end"),
    (plan(2, {"a": 1}, sample=["a"], cached=CachedRequestData(("a",), ((),), (False,), (3,))), "computed"),
]


@pytest.mark.parametrize(("bad", "message"), BAD_PLANS)
def test_a_bad_plan_is_refused_and_changes_nothing(engine: EchoEngine, bad: StepPlan, message: str) -> None:
    engine.execute(plan(1, {"a": 6}, sample=["a"], new=[new("a", 6, (0, 1))]))
    before = (dict(engine.gpu_owner), {k: (v.num_tokens, v.num_computed_tokens) for k, v in engine.requests.items()})
    with pytest.raises(StepPlanError, match=message):
        engine.execute(bad)
    after = (dict(engine.gpu_owner), {k: (v.num_tokens, v.num_computed_tokens) for k, v in engine.requests.items()})
    assert after == before


def test_blocks_freed_by_a_swap_out_can_go_to_another_request_in_the_same_plan(engine: EchoEngine) -> None:
    engine.execute(plan(1, {"a": 6}, sample=["a"], new=[new("a", 6, (0, 1))]))
    out = KVMove(KVMoveKind.SWAP_OUT, "a", (0, 1), (3, 4))
    result = engine.execute(plan(2, {"b": 4}, new=[new("b", 4, (0,))], moves=[out]))
    assert result.error is None and result.swap_bytes == 2 * engine.spec.bytes_per_block
    assert engine.gpu_owner == {0: "b"} and engine.cpu_owner == {3: "a", 4: "a"}
    back = KVMove(KVMoveKind.SWAP_IN, "a", (3, 4), (5, 6))
    resumed = CachedRequestData(("a",), ((5, 6),), (True,), (6,))
    engine.execute(plan(3, {"a": 1}, sample=["a"], cached=resumed, moves=[back]))
    assert engine.gpu_owner == {0: "b", 5: "a", 6: "a"} and engine.cpu_owner == {}


def test_release_frees_blocks_for_reuse(engine: EchoEngine) -> None:
    engine.execute(plan(1, {"a": 6}, sample=["a"], new=[new("a", 6, (0, 1))]))
    engine.execute(plan(2, {"b": 4}, sample=["b"], new=[new("b", 4, (1,))], release=["a"]))
    assert engine.gpu_owner == {1: "b"} and set(engine.requests) == {"b"}
    assert engine.release(["b", "b"]) == ["b"] and engine.num_requests == 0


@pytest.mark.parametrize(("bad", "message"), BAD_PLANS)
def test_the_torch_engine_refuses_the_same_plans_with_the_same_words(bad: StepPlan, message: str) -> None:
    from worker_service.engine import LLMEngine

    echo = EchoEngine(EngineConfig(model="tiny-llama", block_size=4))
    torch_engine = LLMEngine(EngineConfig(model="tiny-llama", load_format="dummy", block_size=4))
    errors = []
    for e in (echo, torch_engine):
        e.init_kv_cache(16, 8)
        e.execute(plan(1, {"a": 6}, sample=["a"], new=[new("a", 6, (0, 1))]))
        with pytest.raises(StepPlanError, match=message) as info:
            e.execute(bad)
        errors.append((info.value.message, info.value.request_id))
    assert errors[0] == errors[1]
