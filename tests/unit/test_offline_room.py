"""The offline queue in the cluster (scheduler_service/core/offline.py): offline requests are
placed into the room online ones leave, give way to them, are bounded, and end exactly once
whatever happens to them while queued."""

from __future__ import annotations

from scheduler_service.cluster import ClusterSpec, WorkerSpec, build_cluster
from scheduler_service.cluster.cluster import Cluster
from scheduler_service.core.offline import Room
from scheduler_service.core.preemption import RejectReason
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.slo import SLOClass, SLOSpec
from scheduler_service.costmodel.factory import build_cost_model
from sluice.contract.plan import StepResult
from sluice.contract.sampling import SamplingParams

ONLINE = SLOSpec(ttft_s=1.0, tbt_s=0.1)
OFFLINE = SLOSpec(jct_s=600.0, slo_class=SLOClass.OFFLINE)


def cluster(workers: int = 1, seats: int = 4, bound: int = 8, budget: int | None = None) -> Cluster:
    spec = ClusterSpec(
        policy="vllm",
        workers=tuple(WorkerSpec(512, 64, 16) for _ in range(workers)),
        cost_model=build_cost_model("analytic", "llama-2-7b", "a100-80g"),
        max_model_len=2048,
        max_num_seqs=seats,
        max_num_batched_tokens=budget,
        max_offline_waiting=bound,
    )
    return build_cluster(spec)


def request(rid: str, slo: SLOSpec, prompt: int = 32, tokens: int = 8) -> Request:
    return Request(rid, arrival_time=0.0, num_prompt_tokens=prompt, sampling=SamplingParams(max_tokens=tokens), slo=slo)


def step(c: Cluster, now: float, worker: int = 0) -> set[str]:
    """One step of the worker; the ids it scheduled."""
    plan = c.plan_step(worker, now)
    if plan is None:
        return set()
    c.complete_step(worker, StepResult(plan.step_id, dict.fromkeys(plan.sample_ids, 7), total_s=0.01), now)
    return set(plan.num_scheduled_tokens)


def test_offline_requests_fill_the_idle_seats_and_give_way_to_an_online_one_which_runs_first() -> None:
    c = cluster(seats=4, bound=10)
    for i in range(10):
        assert c.submit(request(f"off{i}", OFFLINE), 0.0) is None
    assert c.num_offline_queued == 10 and c.num_waiting == 0 and c.has_work(0)
    assert step(c, 0.0) == {"off0", "off1", "off2", "off3"}
    assert c.num_offline_queued == 6
    assert c.submit(request("on", ONLINE), 0.01) is None
    # the one that computed least went back to the head of the queue (its KV freed: recompute)
    sched = c.schedulers[0]
    assert len(sched.requests) == 4 and "on" in sched.waiting
    assert [r.request_id for r in c.offline][:2] == ["off3", "off4"]
    assert "on" in step(c, 0.02)
    assert c.metrics.preemptions[("recompute", "priority")] == 1


def test_an_offline_request_placed_but_not_started_goes_back_when_an_online_one_arrives() -> None:
    c = cluster(seats=4, budget=48)  # one 32-token prompt per step
    for i in range(3):
        c.submit(request(f"off{i}", OFFLINE), 0.0)
    assert step(c, 0.0) == {"off0"}
    sched = c.schedulers[0]
    assert set(sched.waiting) == {"off1", "off2"}  # placed, not started
    c.submit(request("on", ONLINE), 0.01)
    assert list(sched.waiting) == ["on"] and [r.request_id for r in c.offline] == ["off1", "off2"]
    assert step(c, 0.02) == {"on"}


def test_the_room_bounds_the_prompt_tokens_placed_at_once_but_a_lone_long_prompt_still_goes() -> None:
    c = cluster(seats=4)
    c.offline_room = lambda w: Room(4, prompt_tokens=40)
    c.submit(request("long", OFFLINE, prompt=100), 0.0)
    c.submit(request("short", OFFLINE), 0.0)
    assert step(c, 0.0) == {"long"}  # alone on the worker: placed although over the room
    assert c.num_offline_queued == 1
    c.submit(request("on", ONLINE, prompt=100), 0.01)
    c.offline_room = lambda w: Room(4, prompt_tokens=20)
    step(c, 0.02)
    assert c.num_offline_queued == 1  # an online request is there: the room holds


def test_the_bound_refuses_new_offline_requests_but_never_online_ones_nor_those_that_yielded() -> None:
    c = cluster(seats=2, bound=3)
    for i in range(3):
        assert c.submit(request(f"off{i}", OFFLINE), 0.0) is None
    late = request("late", OFFLINE)
    assert c.submit(late, 0.0) is RejectReason.OFFLINE_QUEUE_FULL
    assert late.status is RequestStatus.FINISHED_REJECTED
    step(c, 0.0)  # 2 placed: the queue holds 1
    assert c.num_offline_queued == 1
    assert c.submit(request("off3", OFFLINE), 0.0) is None
    assert c.submit(request("off4", OFFLINE), 0.0) is None
    assert c.num_offline_queued == 3
    assert c.submit(request("on", ONLINE), 0.01) is None
    assert c.num_offline_queued == 4  # the one that yielded goes over the bound: it was admitted


def test_a_queued_offline_request_is_aborted_or_ends_with_the_last_worker_exactly_once() -> None:
    c = cluster(workers=2, seats=1)
    for i in range(4):
        c.submit(request(f"off{i}", OFFLINE), 0.0)
    assert c.update_prediction("off3", 3, "predictor", 0.0)
    assert c.abort("off3", 0.0)
    assert [(r.request_id, r.status) for r in c.pop_ended()] == [("off3", RequestStatus.FINISHED_ABORTED)]
    step(c, 0.0, worker=0)
    c.mark_down(0, 0.0)  # off0 goes back to the queue's head
    assert [r.request_id for r in c.offline] == ["off0", "off1", "off2"]
    c.mark_down(1, 0.0)
    ended = c.pop_ended()
    assert sorted(r.request_id for r in ended) == ["off0", "off1", "off2"]
    assert all(r.status is RequestStatus.FINISHED_REJECTED for r in ended)
    assert c.num_unfinished == 0


def test_without_a_bound_offline_requests_queue_in_the_workers_as_online_ones_do() -> None:
    c = cluster(bound=0)
    assert c.offline is None
    c.submit(request("off", OFFLINE), 0.0)
    assert c.num_waiting == 1 and c.num_offline_queued == 0
