"""Cluster.add_worker / remove_worker: the worker set of a running cluster changes (scaling),
driven as the live service drives it, with fabricated step results (no gRPC, no clock)."""

from __future__ import annotations

import pytest
from harness import fake_result, make_request

from scheduler_service.cluster import ClusterSpec, WorkerSpec, build_cluster
from scheduler_service.core.request import RequestStatus
from scheduler_service.costmodel.factory import build_cost_model


def cluster_of(workers: int, policy: str = "vllm", router: str = "round_robin"):
    cm = build_cost_model("analytic", "llama-2-7b", "a100-80g")
    return build_cluster(ClusterSpec(policy, (WorkerSpec(64, 16, 4),) * workers, cm, 256, router=router))


def step_all(cluster, now: float) -> None:
    for w in list(cluster.schedulers):
        if not cluster.healthy[w]:
            continue
        plan = cluster.plan_step(w, now)
        if plan is not None:
            cluster.complete_step(w, fake_result(cluster.schedulers[w], plan), now + 0.01)


@pytest.mark.parametrize("router", ["round_robin", "least_work", "kv_aware", "max_min"])
def test_a_joined_worker_gets_requests_and_a_removed_ones_requests_finish_elsewhere(router: str) -> None:
    cluster = cluster_of(2, router=router)
    requests = [make_request(f"r{i}", 8, 12) for i in range(6)]
    for r in requests:
        assert cluster.submit(r, 0.0) is None
    step_all(cluster, 0.0)
    new = cluster.add_worker(WorkerSpec(64, 16, 4), 0.1)
    assert new == 2 and cluster.healthy[new] and cluster.spec.workers[new] == WorkerSpec(64, 16, 4)
    later = [make_request(f"s{i}", 8, 12) for i in range(6)]
    for r in later:
        assert cluster.submit(r, 0.1) is None
    assert any(r.worker_id == new for r in later), "the router places requests on the new worker"

    on_first = [r for r in requests + later if r.worker_id == 0 and not r.status.is_finished]
    assert on_first, "worker 0 holds requests when it leaves"
    moved = cluster.remove_worker(0, 0.2)
    assert {r.request_id for r in moved} == {r.request_id for r in on_first}
    assert 0 not in cluster.schedulers and 0 not in cluster.healthy and 0 not in cluster.kv.workers
    assert all(r.worker_id in (1, new) for r in moved), "re-routed to the workers left"
    for i in range(200):
        if cluster.num_unfinished == 0:
            break
        step_all(cluster, 0.3 + 0.02 * i)
    ended = {r.request_id: r for r in cluster.pop_ended()}
    assert set(ended) == {r.request_id for r in requests + later}, "every request ends exactly once"
    assert all(r.status is RequestStatus.FINISHED_STOPPED and r.num_output_tokens == 12 for r in ended.values())
    for sched in cluster.schedulers.values():
        sched.assert_empty()
    assert cluster.add_worker(WorkerSpec(64, 16, 4), 5.0) == 3, "ids are never reused"


def test_removing_the_last_worker_ends_its_requests_rejected_and_a_new_one_serves_again() -> None:
    cluster = cluster_of(1)
    held = [make_request(f"r{i}", 8, 12) for i in range(3)]
    for r in held:
        cluster.submit(r, 0.0)
    step_all(cluster, 0.0)
    cluster.remove_worker(0, 0.1)
    ended = cluster.pop_ended()
    assert {r.request_id for r in ended} == {"r0", "r1", "r2"}
    assert all(r.status is RequestStatus.FINISHED_REJECTED and r.finish_message == "no_worker" for r in ended)
    assert not cluster.any_healthy and not cluster.schedulers
    cluster.add_worker(WorkerSpec(64, 16, 4), 1.0)
    late = make_request("late", 8, 4)
    assert cluster.submit(late, 1.0) is None
    for i in range(20):
        step_all(cluster, 1.0 + 0.02 * i)
    assert late.status is RequestStatus.FINISHED_STOPPED


def test_a_worker_with_another_block_size_cannot_join() -> None:
    cluster = cluster_of(1)
    with pytest.raises(ValueError, match="block sizes"):
        cluster.add_worker(WorkerSpec(64, 16, 8), 0.0)
    assert list(cluster.schedulers) == [0]
