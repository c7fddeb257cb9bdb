"""`prefix_aware` sends a request to the worker whose prefix cache holds the most of it unless
that worker's queued prefill and KV load outweigh the hit; through a Cluster the cached length
comes from each worker's own cache, so a conversation's next turn follows its earlier ones."""

from __future__ import annotations

import pytest
from harness import fake_result

from scheduler_service.cluster import ClusterSpec, WorkerSpec, build_cluster
from scheduler_service.core.request import Request
from scheduler_service.costmodel.factory import build_cost_model
from scheduler_service.routers import RouterContext, WorkerLoad, build_router
from sluice.contract.sampling import SamplingParams


def load(w: int, cached: int = 0, waiting_tokens: int = 0, used_blocks: int = 0) -> WorkerLoad:
    return WorkerLoad(w, True, 0, 0, 1000 - used_blocks, 1000, cached_tokens=cached, waiting_tokens=waiting_tokens)


def req(rid: str, prompt: list[int], output: int = 3) -> Request:
    sampling = SamplingParams(max_tokens=output)
    return Request(rid, arrival_time=0.0, prompt_token_ids=prompt, sampling=sampling, eos_token_ids=frozenset({0}))


def test_the_longest_cached_prefix_wins_when_loads_are_equal() -> None:
    router = build_router("prefix_aware", RouterContext(block_size=16))
    r = req("r", list(range(1, 600)))
    assert router.select(r, [load(0, cached=64), load(1, cached=512), load(2)], 0.0) == 1


def test_a_queue_that_outweighs_the_hit_sends_the_request_elsewhere() -> None:
    router = build_router("prefix_aware", RouterContext(block_size=16))
    r = req("r", list(range(1, 600)))
    # worker 0 holds 512 of its tokens but has 1000 tokens of prefill queued: 87 + 1000 > 599
    assert router.select(r, [load(0, cached=512, waiting_tokens=1000), load(1)], 0.0) == 1
    # KV held by running requests counts at kv_weight (0.1 by default): 87 + 200 x 16 x 0.1 = 407 < 599
    assert router.select(r, [load(0, cached=512, used_blocks=200), load(1)], 0.0) == 0
    heavy = build_router("prefix_aware:kv_weight=1", RouterContext(block_size=16))
    assert heavy.select(r, [load(0, cached=512, used_blocks=200), load(1)], 0.0) == 1


def test_unhealthy_workers_are_skipped_and_none_left_holds_nothing() -> None:
    router = build_router("prefix_aware")
    down = load(0, cached=512)
    down.healthy = False
    assert router.select(req("r", [1] * 600), [down, load(1)], 0.0) == 1
    assert router.select(req("r", [1] * 600), [down], 0.0) is None


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("prefix_aware:overlap_weight=-1", "option 'overlap_weight' must be >= 0"),
        ("prefix_aware:kv_weight=x", "option 'kv_weight': not a number"),
        ("prefix_aware:speed=2", "has no option ['speed']"),
    ],
)
def test_bad_options_are_refused_naming_them(spec: str, says: str) -> None:
    with pytest.raises(ValueError) as err:
        build_router(spec)
    assert says in str(err.value)


def run_step(cluster, worker: int, now: float) -> None:
    plan = cluster.plan_step(worker, now)
    if plan is not None:
        cluster.complete_step(worker, fake_result(cluster.schedulers[worker], plan), now + 0.01)


def test_through_a_cluster_the_next_turn_follows_the_worker_that_cached_the_last() -> None:
    cm = build_cost_model("analytic", "llama-2-7b", "a100-80g")
    spec = ClusterSpec("vllm", (WorkerSpec(256, 0, 16),) * 4, cm, 4096, router="prefix_aware")
    cluster = build_cluster(spec)
    turn1 = req("t1", list(range(1, 200)))
    assert cluster.submit(turn1, 0.0) is None
    first = turn1.worker_id
    for i in range(8):
        for w in cluster.schedulers:
            run_step(cluster, w, 0.02 * i)
    assert turn1.status.is_finished
    turn2 = req("t2", [*range(1, 200), 7, 7, 7, 5, 6, 7, 8])
    cluster.submit(turn2, 1.0)
    assert turn2.worker_id == first
    stranger = req("s", list(range(5000, 5200)))
    cluster.submit(stranger, 1.0)
    assert stranger.worker_id != first  # no hit anywhere: the least loaded (t2 queued on `first`)
    loads = cluster.loads(turn2)
    assert loads[first].cached_tokens == 192 and all(x.cached_tokens == 0 for x in loads if x.worker_id != first)
