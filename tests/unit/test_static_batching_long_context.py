"""The long-context options of the static batchers (ours, each off by default): `sls` keeps a
long prompt out of a batch of short ones when padding would cost more than its bound, groups
a batch around its oldest request by prompt and predicted output length, and pads nothing on
a variable-length-attention engine; `scls` pads nothing with `varlen_attention`, its DP then
prices and checks rows at their own lengths, and its pool interval can be capped. With every
option off the decisions are the papers'. Every scheduler test ends with the leak check."""

from __future__ import annotations

import pytest
from harness import fake_result, make_request, make_scheduler, run_to_completion

from kvstore.accounting import KVCacheManager
from scheduler_service import policies  # noqa: F401  (registration)
from scheduler_service.core.policy import PolicyContext, build_policy
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler, SchedulerConfig
from scheduler_service.costmodel.factory import build_cost_model
from scheduler_service.policies.baselines.sls_batching import (
    grouped_candidates,
    padded_prefill_ratio,
    within_pad_bound,
)
from scheduler_service.policies.scls.batcher import dp_batches
from scheduler_service.policies.scls.estimator import MemoryEstimator, ServingTimeEstimator
from scheduler_service.policies.scls.router import SCLSRouter, SCLSRouterConfig
from scheduler_service.routers import RouterContext
from sluice.contract.plan import StepPlan
from sluice.contract.sampling import SamplingParams

CM = build_cost_model("analytic", "llama-3.1-8b", "h100-80g")
BLOCKS = 20_000  # 320k tokens of 16
S = 128


def long_scheduler(spec: str) -> Scheduler:
    """A worker of the long-context runs' shape: 16-token blocks, a 128k context, the cost model."""
    ctx = PolicyContext(0, 16, BLOCKS, 0, 131_072, 256, 131_072, cost_model=CM)
    return Scheduler(0, KVCacheManager(BLOCKS, 0, 16), build_policy(spec, ctx), SchedulerConfig(256, 131_072, 131_072))


def request(rid: str, prompt: int, output: int) -> Request:
    """A request of `prompt` tokens that ends after `output` tokens, predicted exactly (oracle)."""
    return Request(
        rid,
        arrival_time=0.0,
        num_prompt_tokens=prompt,
        sampling=SamplingParams(max_tokens=2048),
        eos_token_ids=frozenset({0}),
        true_output_tokens=output,
        predicted_output_tokens=output,
    )


def batches_of(sched: Scheduler, reqs: list[Request]) -> list[tuple[set[str], StepPlan]]:
    """Runs `reqs` to completion; the members and plan of every batch start (a prefill step)."""
    for req in reqs:
        sched.add_request(req, 0.0)
    starts, now = [], 0.0
    for _ in range(10_000):
        if not sched.has_work:
            sched.assert_empty()
            return starts
        plan = sched.schedule(now)
        sched.kv.check_invariants()
        if any(n > 1 for n in plan.num_scheduled_tokens.values()):
            starts.append((set(plan.num_scheduled_tokens), plan))
        sched.on_step_result(fake_result(sched, plan), now + 0.01)
        now += 0.01
    raise AssertionError("requests did not finish")


# ---------------------------------------------------------------- sls: the pad bound
def test_padding_a_40k_prompt_onto_5k_rows_passes_a_25_percent_bound_and_similar_rows_do_not() -> None:
    assert padded_prefill_ratio([5_000, 5_000, 40_000], CM) > 2  # three 40k prefills instead of one and two 5k
    assert not within_pad_bound([5_000, 5_000, 40_000], 0.25, CM)
    assert within_pad_bound([5_000, 5_200, 5_400], 0.25, CM)
    assert within_pad_bound([5_000, 5_000, 40_000], 0.0, CM)  # 0: no bound (the paper)
    # without a cost model the bound is in tokens
    assert padded_prefill_ratio([10, 30], None) == pytest.approx(60 / 40)


def test_sls_pad_bound_splits_the_batch_at_the_long_prompt_and_keeps_fcfs() -> None:
    reqs = [request("a", 5_000, 4), request("b", 5_100, 4), request("long", 40_000, 4), request("c", 5_000, 4)]
    starts = batches_of(long_scheduler("sls:max_pad_share=0.25"), reqs)
    assert [members for members, _ in starts] == [{"a", "b"}, {"long"}, {"c"}]
    assert starts[0][1].metadata["pad_tokens"] == 100 and starts[1][1].metadata["pad_tokens"] == 0


def test_sls_without_the_bound_pads_every_row_to_the_long_prompt_as_the_paper_does() -> None:
    reqs = [request("a", 5_000, 4), request("b", 5_100, 4), request("long", 40_000, 4), request("c", 5_000, 4)]
    starts = batches_of(long_scheduler("sls"), reqs)
    assert [members for members, _ in starts] == [{"a", "b", "long", "c"}]
    assert starts[0][1].metadata["padded_len"] == 40_000
    assert starts[0][1].metadata["pad_tokens"] == 35_000 + 34_900 + 35_000


def test_sls_pad_bound_has_nothing_to_bound_when_rows_are_not_padded() -> None:
    reqs = [request("a", 5_000, 4), request("b", 5_100, 4), request("long", 40_000, 4), request("c", 5_000, 4)]
    starts = batches_of(long_scheduler("sls:max_pad_share=0.25,varlen_attention=true"), reqs)
    assert [members for members, _ in starts] == [{"a", "b", "long", "c"}]


# ---------------------------------------------------------------- sls: grouping
def test_grouping_puts_the_oldest_first_then_the_closest_in_prompt_and_output_length() -> None:
    waiting = [
        request("old", 1_000, 100),
        request("far", 30_000, 5),
        request("near", 1_100, 90),
        request("mid", 3_000, 100),
    ]
    assert [r.request_id for r in grouped_candidates(waiting, 0)] == ["old", "far", "near", "mid"]  # the paper: FCFS
    assert [r.request_id for r in grouped_candidates(waiting, 8)] == ["old", "near", "mid", "far"]
    # unpadded rows: only the output length matters
    assert [r.request_id for r in grouped_candidates(waiting, 8, by_prompt=False)][:2] == ["old", "mid"]
    # outside the window a request is not considered
    assert [r.request_id for r in grouped_candidates(waiting, 2)] == ["old", "far"]


def test_sls_group_window_batches_similar_answers_so_no_row_waits_for_a_long_one() -> None:
    outputs = [200, 3, 200, 3, 200, 3]
    reqs = [request(f"r{i}", 2_000, o) for i, o in enumerate(outputs)]
    grouped = long_scheduler("sls:batch_size=3,group_window=6,varlen_attention=true")
    starts = batches_of(grouped, reqs)
    assert [members for members, _ in starts] == [{"r0", "r2", "r4"}, {"r1", "r3", "r5"}]
    assert grouped.metrics.invalid_tokens == 0
    sched = long_scheduler("sls:batch_size=3")
    paper = batches_of(sched, [request(f"r{i}", 2_000, o) for i, o in enumerate(outputs)])
    assert [members for members, _ in paper] == [{"r0", "r1", "r2"}, {"r3", "r4", "r5"}]
    assert sched.metrics.invalid_tokens == 3 * 197  # each 3-token row runs on until its batch's 200th token


def test_sls_varlen_attention_prefills_and_decodes_each_row_at_its_own_length() -> None:
    sched = make_scheduler("sls:batch_size=2,varlen_attention=true", num_gpu_blocks=64, block_size=4)
    sched.add_request(make_request("short", 4, 2), 0.0)
    sched.add_request(make_request("long", 8, 4), 0.0)
    plans = run_to_completion(sched)
    assert plans[0].num_scheduled_tokens == {"short": 4, "long": 8}
    assert not {"padded_len", "pad_tokens"} & plans[0].metadata.keys()
    assert all("padded_context" not in p.metadata for p in plans)
    # short (4 + 2 tokens) finished at iteration 1 and runs on at its own context: 4 + k at iteration k
    invalid = [p.metadata["invalid_context_sum"] for p in plans if p.metadata.get("invalid_tokens")]
    assert invalid == [4 + 2, 4 + 3]
    assert sched.metrics.invalid_tokens == 2
    sched.assert_empty()


# ---------------------------------------------------------------- scls: rows not padded
def test_varlen_serve_time_equals_the_papers_when_every_row_is_as_long_as_the_longest() -> None:
    est = ServingTimeEstimator.fit_from_cost_model(CM)
    assert est.serve_time_varlen(8, 8 * 700, 700, S) == pytest.approx(est.serve_time(8, 700, S), rel=1e-12)
    assert est.serve_time_varlen(8, 7 * 10 + 700, 700, S) < est.serve_time(8, 700, S)


def test_dp_without_padding_keeps_the_long_request_with_the_short_ones() -> None:
    """The paper's Figure 11 case on an H100 (a 4,000-token request among 15 of 10 tokens):
    padded, the long request goes apart; unpadded, it costs only its own tokens in the
    batch, and one batch of 16 is the cheapest."""
    est = ServingTimeEstimator.fit_from_cost_model(CM)
    lengths = [4_000] + [10] * 15
    padded = dp_batches(lengths, S, est, MemoryEstimator(1_000_000), max_batch=64)
    varlen = dp_batches(lengths, S, est, MemoryEstimator(1_000_000), max_batch=64, varlen=True)
    assert sorted(len(b.members) for b in padded) == [1, 15]
    assert [len(b.members) for b in varlen] == [16]
    assert varlen[0].est_s == pytest.approx(float(est.serve_time_varlen(16, 4_000 + 150, 4_000, S)))


def test_dp_without_padding_checks_the_rows_own_kv() -> None:
    est = ServingTimeEstimator.fit_from_cost_model(CM)
    # 0.9 x 10,000 tokens: four rows padded to 4,000 + S never fit; their own rows do (3 x 144 + 4,128)
    memory = MemoryEstimator(10_000, 16, 0.9)
    lengths = [10, 10, 10, 4_000]
    assert not memory.fits(4, 4_000, S)
    varlen = dp_batches(lengths, S, est, memory, max_batch=64, varlen=True)
    assert [len(b.members) for b in varlen] == [4]
    # 8 rows of 1,100 + S need 8 x 1,232 > 9,000: the DP splits them
    assert all(len(b.members) <= 7 for b in dp_batches([1_100] * 8, S, est, memory, 64, varlen=True))


def test_scls_varlen_attention_prefills_and_decodes_each_row_at_its_own_length() -> None:
    sched = make_scheduler("scls:batch_size=2,slice_len=4,varlen_attention=true", num_gpu_blocks=64, block_size=4)
    sched.add_request(make_request("short", 4, 2), 0.0)
    sched.add_request(make_request("long", 8, 4), 0.0)
    plans = run_to_completion(sched)
    assert plans[0].num_scheduled_tokens == {"short": 4, "long": 8}
    assert not {"padded_len", "pad_tokens"} & plans[0].metadata.keys()
    assert all("padded_context" not in p.metadata for p in plans)
    invalid = [p.metadata["invalid_context_sum"] for p in plans if p.metadata.get("invalid_tokens")]
    assert invalid == [4 + 2, 4 + 3]  # short's row at its own context, iterations 3 and 4
    sched.assert_empty()


def test_scls_without_the_switch_pads_every_row_as_the_paper_does() -> None:
    sched = make_scheduler("scls:batch_size=2,slice_len=4", num_gpu_blocks=64, block_size=4)
    sched.add_request(make_request("short", 4, 2), 0.0)
    sched.add_request(make_request("long", 8, 4), 0.0)
    plans = run_to_completion(sched)
    assert plans[0].metadata["padded_len"] == 8 and plans[0].metadata["pad_tokens"] == 4
    assert [p.metadata["invalid_context_sum"] for p in plans if p.metadata.get("invalid_tokens")] == [8 + 2, 8 + 3]
    sched.assert_empty()


# ---------------------------------------------------------------- scls: the pool interval
def scls_router(**options: float) -> SCLSRouter:
    ctx = RouterContext(block_size=16, num_gpu_blocks=27_000, max_model_len=131_072, cost_model=CM)
    return SCLSRouter(SCLSRouterConfig(**options), ServingTimeEstimator.fit_from_cost_model(CM), ctx)  # type: ignore[arg-type]


def test_pool_interval_is_eq_12_and_the_cap_bounds_it_only_when_set() -> None:
    paper, capped = scls_router(), scls_router(max_interval_s=10.0)
    for router in (paper, capped):
        router.offloader.load = {0: 400.0, 1: 500.0}
    assert paper.next_interval([0, 1]) == pytest.approx(200.0)  # 0.5 x the least loaded worker
    assert capped.next_interval([0, 1]) == pytest.approx(10.0)
    for router in (paper, capped):
        router.offloader.load = {0: 1.0, 1: 0.0}
    assert paper.next_interval([0, 1]) == capped.next_interval([0, 1]) == pytest.approx(3.0)  # Gamma


def test_varlen_router_lengthens_a_slice_by_the_rows_own_prefill() -> None:
    lengths = [60_000, 100, 100, 100]
    padded = scls_router(max_prefill_share=0.5).batch_slice_len(4, 60_000, lengths)
    own = scls_router(max_prefill_share=0.5, varlen_attention=True).batch_slice_len(4, 60_000, lengths)
    assert S < own < padded  # one 60k prefill, not four
    assert scls_router(varlen_attention=True).batch_slice_len(4, 60_000, lengths) == S  # share 0: the paper's S
