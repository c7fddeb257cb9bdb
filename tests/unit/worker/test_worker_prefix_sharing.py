"""Prefix caching end to end on the real engine: the core scheduler (vllm policy, prefix
caching on) plans, the torch engine executes. A request whose prompt starts with blocks an
earlier or a running request computed is admitted with them as its computed prefix: the
worker holds those physical blocks in both tables (no copy) and computes only the rest, and
greedy outputs are the same as without a hit. The worker still refuses a plan that would
write into a block another request holds, or share one that is not computed."""

from __future__ import annotations

import pytest
from worker_harness import GREEDY, dense_greedy, make_engine, random_prompt

from kvstore.accounting import KVCacheManager
from scheduler_service import policies  # noqa: F401  (registration)
from scheduler_service.core.policy import PolicyContext, build_policy
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler, SchedulerConfig
from sluice.contract.plan import CachedRequestData, NewRequestData, StepPlan
from sluice.contract.sampling import SamplingParams
from worker_service.engine import LLMEngine, StepPlanError

BLOCK = 4
NUM_OUTPUT = 6
SHARED = random_prompt(14, seed=1)  # 3 full blocks + 2 tokens


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return make_engine("tiny-llama", num_gpu_blocks=64, num_cpu_blocks=0, block_size=BLOCK)


def make_core(engine: LLMEngine, prefix_caching: bool) -> Scheduler:
    engine.init_kv_cache(64, 0)
    kv = KVCacheManager(64, 0, BLOCK, prefix_caching=prefix_caching)
    ctx = PolicyContext(0, BLOCK, 64, 0, 256, 8, 64)
    return Scheduler(0, kv, build_policy("vllm", ctx), SchedulerConfig(8, 64, 256))


def request(rid: str, prompt: list[int], arrival: float) -> Request:
    sampling = SamplingParams(temperature=0.0, max_tokens=NUM_OUTPUT, ignore_eos=True)
    return Request(rid, arrival_time=arrival, prompt_token_ids=prompt, sampling=sampling)


def run(engine: LLMEngine, core: Scheduler, arrivals: dict[int, Request], tables: dict[str, list[int]]) -> None:
    """Steps until every request ends; `arrivals[step]` joins before that step; records
    each request's block table the first time it runs."""
    ended = 0
    for step in range(200):
        if step in arrivals:
            core.add_request(arrivals[step], float(step))
        plan = core.schedule(float(step))
        for new in plan.new_requests:
            tables.setdefault(new.request_id, list(new.block_ids))
        result = engine.execute(plan)
        ended += len(core.on_step_result(result, float(step)).finished)
        if ended == len(arrivals) and not core.has_work:
            break
    core.assert_empty()


def outputs(prompts: dict[str, list[int]], engine: LLMEngine, caching: bool, starts: dict[str, int]) -> dict:
    core = make_core(engine, caching)
    reqs = {rid: request(rid, p, float(starts[rid])) for rid, p in prompts.items()}
    tables: dict[str, list[int]] = {}
    run(engine, core, {starts[rid]: r for rid, r in reqs.items()}, tables)
    return {"out": {r: q.output_token_ids for r, q in reqs.items()}, "reqs": reqs, "tables": tables, "core": core}


PROMPTS = {
    "a": SHARED + random_prompt(3, seed=2),
    "b": SHARED + random_prompt(5, seed=3),  # arrives while a is decoding: shares a's blocks
    "c": SHARED + random_prompt(2, seed=4),  # arrives after a and b ended: blocks from the LRU
}
STARTS = {"a": 0, "b": 3, "c": 40}


def test_a_prefix_hit_changes_no_output_and_shares_the_blocks(engine: LLMEngine) -> None:
    hit = outputs(PROMPTS, engine, True, STARTS)
    miss = outputs(PROMPTS, engine, False, STARTS)
    assert hit["out"] == miss["out"]
    for rid, prompt in PROMPTS.items():
        assert hit["out"][rid] == dense_greedy(engine.model, prompt, NUM_OUTPUT), rid
    reqs, tables = hit["reqs"], hit["tables"]
    assert reqs["a"].num_cached_tokens == 0
    assert reqs["b"].num_cached_tokens == reqs["c"].num_cached_tokens == 12  # 3 full blocks of the shared prompt
    assert tables["b"][:3] == tables["a"][:3] == tables["c"][:3]  # the same physical blocks, not copies
    assert hit["core"].metrics.prefix_hit_tokens == 24
    assert miss["core"].metrics.prefill_tokens - hit["core"].metrics.prefill_tokens == 24


def test_a_fully_cached_prompt_still_computes_its_last_token(engine: LLMEngine) -> None:
    prompt = random_prompt(12, seed=5)  # exactly 3 blocks
    res = outputs({"x": prompt, "y": list(prompt)}, engine, True, {"x": 0, "y": 30})
    assert res["reqs"]["y"].num_cached_tokens == 8  # the last block is computed again to sample
    assert res["out"]["y"] == res["out"]["x"] == dense_greedy(engine.model, prompt, NUM_OUTPUT)


def _started(engine: LLMEngine) -> tuple[list[int], int]:
    """One request 'a' whose 12 prompt tokens (3 blocks) are computed; returns its table."""
    engine.init_kv_cache(64, 0)
    prompt = [*SHARED[:12], 5]
    new = NewRequestData("a", tuple(prompt), 13, GREEDY, (0, 1, 2, 3))
    engine.execute(StepPlan(1, 0, (new,), CachedRequestData(), {"a": 13}, frozenset({"a"})))
    return [0, 1, 2, 3], 13


def test_worker_refuses_to_write_into_a_block_another_request_holds(engine: LLMEngine) -> None:
    table, _ = _started(engine)
    # b claims a's computed blocks 0..2 as its prefix (fine) but says only 8 tokens are computed,
    # so this step would write its tokens 8..11 into block 2, which a holds.
    tokens = tuple([*SHARED[:12], 9, 9])
    new = NewRequestData("b", tokens, 14, GREEDY, (*table[:3], 9), num_computed_tokens=8)
    with pytest.raises(StepPlanError, match="given to both"):
        engine.execute(StepPlan(2, 0, (new,), CachedRequestData(), {"b": 6}, frozenset({"b"})))
    ok = NewRequestData("b", tokens, 14, GREEDY, (*table[:3], 9), num_computed_tokens=12)
    result = engine.execute(StepPlan(3, 0, (ok,), CachedRequestData(), {"b": 2}, frozenset({"b"})))
    assert set(result.sampled_token_ids) == {"b"}
    assert engine.requests["b"].block_table[:3] == table[:3]


def test_worker_refuses_to_share_a_block_its_holder_has_not_computed(engine: LLMEngine) -> None:
    table, _ = _started(engine)
    # a's block 3 holds one computed token of four: not a full cached block, not shareable.
    tokens = tuple([*SHARED[:12], 5, 6, 7, 8, 1])
    new = NewRequestData("b", tokens, 17, GREEDY, (*table, 10), num_computed_tokens=16)
    with pytest.raises(StepPlanError, match="given to both"):
        engine.execute(StepPlan(2, 0, (new,), CachedRequestData(), {"b": 1}, frozenset({"b"})))
