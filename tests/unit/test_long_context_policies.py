"""Policies on long contexts: sarathi cuts a chunk where the step's predicted time (its
attention over the prefix included) would pass the TBT SLO, so a 60k-token prompt is
prefilled in steps that each hold the SLO, where a token budget alone overshoots it many
times; SCLS lengthens the slice of a batch whose re-prefill would dominate it, within its KV."""

from __future__ import annotations

import pytest

from kvstore.accounting import KVCacheManager
from scheduler_service import policies  # noqa: F401  (registration)
from scheduler_service.core.policy import PolicyContext, build_policy
from scheduler_service.core.request import Request
from scheduler_service.core.scheduler import Scheduler, SchedulerConfig
from scheduler_service.costmodel.factory import build_cost_model
from scheduler_service.policies.scls.estimator import ServingTimeEstimator
from scheduler_service.policies.scls.router import SCLSRouter, SCLSRouterConfig
from scheduler_service.routers import RouterContext
from sluice.contract.plan import StepResult
from sluice.contract.profile import BatchShape
from sluice.contract.sampling import SamplingParams

CM = build_cost_model("analytic", "llama-3.1-8b", "h100-80g")
SLO = 0.1  # seconds per step
BLOCKS = 8000


def long_prompt_steps(spec: str, prompt: int = 60_000) -> list[BatchShape]:
    """The shapes of the steps that prefill one long prompt while 4 requests of 4k contexts decode."""
    ctx = PolicyContext(0, 16, BLOCKS, 0, 131_072, 256, 131_072, cost_model=CM, tbt_slo_s=SLO)
    sched = Scheduler(0, KVCacheManager(BLOCKS, 0, 16), build_policy(spec, ctx), SchedulerConfig(256, 131_072, 131_072))
    for i in range(4):
        decode = Request(f"d{i}", arrival_time=0.0, num_prompt_tokens=4000, sampling=SamplingParams(max_tokens=10**5))
        sched.add_request(decode, 0.0)
    shapes, computed = [], {}
    for i in range(20_000):
        if i == 20:  # the decodes are decoding by now
            assert all(not r.is_prefill for r in sched.running.values()) and len(sched.running) == 4
            long = Request("long", arrival_time=0.0, num_prompt_tokens=prompt, sampling=SamplingParams(max_tokens=4))
            sched.add_request(long, 0.0)
        plan = sched.schedule(0.0)
        shape = BatchShape()
        for new in plan.new_requests:
            computed[new.request_id] = new.num_computed_tokens
        for rid, n in plan.num_scheduled_tokens.items():
            if n == 1 and computed[rid]:
                shape.add_decode(computed[rid] + 1)
            else:
                shape.prefill_chunks.append((n, computed[rid]))
            computed[rid] += n
        sched.on_step_result(StepResult(plan.step_id, dict.fromkeys(plan.sample_ids, 5), 0.0), 0.0)
        if "long" in plan.num_scheduled_tokens:
            shapes.append(shape)
        if i > 20 and not sched.requests["long"].is_prefill:
            return shapes
    raise AssertionError("the long prompt was never prefilled")


# sarathi holds the deployment's TBT SLO; accelgen its decodes' TBT SLO (default 0.1875 s here)
POLICY_SLOS = [("sarathi", SLO), ("accelgen:default_tbt_s=0.1", 0.1)]


@pytest.mark.parametrize(("spec", "slo"), POLICY_SLOS)
def test_chunks_of_a_60k_prompt_are_priced_so_that_each_step_holds_the_tbt_slo(spec: str, slo: float) -> None:
    shapes = [s for s in long_prompt_steps(spec) if s.num_decodes]  # steps that produce tokens of others
    times = [CM.iteration_time(s) for s in shapes]
    assert len(shapes) > 10 and max(times) <= slo * 1.0001
    chunks = [s.prefill_chunks[-1][0] for s in shapes]
    assert max(chunks) > 2 * chunks[-1]  # the same SLO buys fewer tokens over a longer prefix


@pytest.mark.parametrize(
    ("spec", "slo"),
    [(f"{p},price_in_time=false" if ":" in p else f"{p}:price_in_time=false", s) for p, s in POLICY_SLOS],
)
def test_with_a_token_budget_alone_chunks_over_a_long_prefix_overshoot_the_slo(spec: str, slo: float) -> None:
    times = [CM.iteration_time(s) for s in long_prompt_steps(spec) if s.num_decodes]
    assert max(times) > 3 * slo


def router(share: float) -> SCLSRouter:
    ctx = RouterContext(block_size=16, num_gpu_blocks=27_000, max_model_len=131_072, cost_model=CM)
    est = ServingTimeEstimator.fit_from_cost_model(CM)
    return SCLSRouter(SCLSRouterConfig(max_prefill_share=share), est, ctx)


@pytest.mark.parametrize(("rows", "length"), [(16, 200), (32, 1500)])
def test_scls_keeps_the_papers_slice_for_short_batches(rows: int, length: int) -> None:
    assert router(0.5).batch_slice_len(rows, length) == 128


def test_scls_lengthens_the_slice_of_a_long_batch_until_its_prefill_is_half_of_it_within_its_kv() -> None:
    s = router(0.5).batch_slice_len(2, 60_000)
    prefill = CM.iteration_time(BatchShape(prefill_chunks=[(60_000, 0)] * 2))
    assert s > 128 and s * CM.decode_time(2, 60_000) >= prefill * 0.99
    assert router(0.0).batch_slice_len(2, 60_000) == 128  # the paper's fixed S
    # a batch whose KV leaves no room past S keeps S: 4 rows of 100k do not fit 27,000 x 16 x 0.9
    assert router(0.5).batch_slice_len(4, 100_000) == 128
