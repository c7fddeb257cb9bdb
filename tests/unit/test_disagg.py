"""Disaggregated prefill and decode through the Cluster: a request is prefilled on a prefill
worker, its blocks are reserved on a decode worker before its KV transfer is issued and freed
on the prefill worker only after the transfer is answered; a failed transfer or a worker
that dies mid-transfer ends in a recompute on the decode side, and nothing leaks on either pool."""

from __future__ import annotations

import pytest
from harness import EOS, TOKEN, fake_result, make_request

from scheduler_service.cluster import ClusterSpec, DisaggCluster, WorkerSpec, build_cluster
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.costmodel.factory import build_cost_model
from sluice.contract.plan import KVTransfer, KVTransferResult

P, D, D2 = 0, 1, 2
BLOCK = 16


@pytest.fixture(scope="module")
def cost_model():
    return build_cost_model("analytic", "llama-2-7b", "a100-80g")


def cluster_of(cost_model, *roles: str, policy: str = "vllm", decode_blocks: int = 256) -> DisaggCluster:
    workers = tuple(WorkerSpec(decode_blocks if r == "decode" else 256, 64, BLOCK, role=r) for r in roles)
    cluster = build_cluster(ClusterSpec(policy, workers, cost_model, 4096))
    assert isinstance(cluster, DisaggCluster)
    return cluster


def step(cluster: DisaggCluster, worker: int, now: float) -> bool:
    plan = cluster.plan_step(worker, now)
    if plan is None:
        return False
    cluster.complete_step(worker, fake_result(cluster.schedulers[worker], plan), now + 0.01)
    cluster.kv.check_invariants()
    return True


def drive(cluster: DisaggCluster, answer=lambda t: True, max_rounds: int = 500) -> list[Request]:
    """Every worker steps in turn; transfers are answered at once (`answer(t)`: ok or not)."""
    ended: list[Request] = []
    now = 0.0
    for _ in range(max_rounds):
        for w in cluster.schedulers:
            if cluster.has_work(w):
                step(cluster, w, now)
        for t in cluster.pop_transfers():
            cluster.complete_transfer(KVTransferResult(t.transfer_id, answer(t), 0.001, 1), now)
        ended += cluster.pop_ended()
        now += 0.02
        if cluster.num_unfinished == 0:
            return ended
    raise AssertionError(f"still unfinished: {cluster.num_unfinished}")


def leak_check(cluster: DisaggCluster) -> None:
    for sched in cluster.schedulers.values():
        sched.assert_empty()
    cluster.kv.assert_empty()


def prefill_once(cluster: DisaggCluster, request: Request) -> KVTransfer:
    assert cluster.submit(request, 0.0) is None
    assert request.worker_id == P
    assert step(cluster, P, 0.0)  # the whole prompt, and the first token
    (transfer,) = cluster.pop_transfers()
    return transfer


def test_blocks_are_reserved_on_the_decode_worker_before_the_transfer_and_freed_on_the_prefill_worker_after(
    cost_model,
) -> None:
    cluster = cluster_of(cost_model, "prefill", "decode")
    r = make_request("r", prompt=100, output=5)
    transfer = prefill_once(cluster, r)
    p_kv, d_kv = cluster.kv[P], cluster.kv[D]
    # issued: the prefill worker still holds the KV, the decode worker's blocks are already reserved
    assert r.num_output_tokens == 1 and r.first_token_time is not None
    assert "r" not in cluster.schedulers[P].requests and "r" not in cluster.schedulers[D].requests
    assert transfer.src_worker == P and transfer.dst_worker == D and transfer.num_tokens == 100
    assert list(transfer.src_block_ids) == p_kv.gpu_tables["r"][: len(transfer.dst_block_ids)]
    assert list(transfer.dst_block_ids) == d_kv.gpu_tables["r"]
    assert len(transfer.dst_block_ids) == -(-100 // BLOCK)
    assert cluster.num_unfinished == 1
    # the prefill worker is told to drop the request; its blocks stay allocated meanwhile
    plan = cluster.plan_step(P, 0.02)
    assert plan is not None and plan.release_ids == ("r",)
    cluster.complete_step(P, fake_result(cluster.schedulers[P], plan), 0.03)
    assert "r" in p_kv.gpu_tables
    cluster.complete_transfer(KVTransferResult(transfer.transfer_id, True, 0.001, 1), 0.04)
    assert "r" not in p_kv.gpu_tables and p_kv.gpu.num_used == 0
    assert d_kv.gpu_tables["r"] == list(transfer.dst_block_ids)
    # the decode worker goes on from the transferred KV: the first plan computes one token
    plan = cluster.plan_step(D, 0.05)
    assert plan is not None
    (new,) = plan.new_requests
    assert new.num_computed_tokens == 100 and new.block_ids[: len(transfer.dst_block_ids)] == transfer.dst_block_ids
    assert plan.num_scheduled_tokens == {"r": 1}
    cluster.complete_step(D, fake_result(cluster.schedulers[D], plan), 0.06)
    ended = drive(cluster)
    assert ended == [r] and r.status is RequestStatus.FINISHED_STOPPED and r.num_output_tokens == 5
    assert r.output_token_ids == [TOKEN] * 4 + [EOS]
    assert cluster.metrics.prefill_tokens == 100  # the prompt was computed once, on the prefill worker
    assert cluster.transfers.succeeded == 1 and cluster.transfers.recomputed == 0
    leak_check(cluster)


def test_a_failed_transfer_frees_both_ends_and_the_decode_worker_recomputes(cost_model) -> None:
    cluster = cluster_of(cost_model, "prefill", "decode")
    r = make_request("r", prompt=100, output=5)
    transfer = prefill_once(cluster, r)
    cluster.complete_transfer(KVTransferResult(transfer.transfer_id, False, 0.5, 0, "timed out"), 0.5)
    assert cluster.kv[P].gpu.num_used == 0 and cluster.kv[D].gpu.num_used == 0
    assert r.num_computed_tokens == 0 and r.prefill_len == 101  # prompt + the first token
    assert "r" in cluster.schedulers[D].waiting
    ended = drive(cluster)
    assert ended == [r] and r.num_output_tokens == 5 and r.output_token_ids == [TOKEN] * 4 + [EOS]
    assert cluster.metrics.prefill_tokens == 100 + 101
    assert cluster.transfers.failed == 1 and cluster.transfers.recomputed == 1
    leak_check(cluster)


def test_prefill_worker_death_mid_transfer_loses_nothing(cost_model) -> None:
    cluster = cluster_of(cost_model, "prefill", "decode")
    r = make_request("r", prompt=100, output=5)
    transfer = prefill_once(cluster, r)
    cluster.mark_down(P, 0.1)
    assert cluster.kv[P].gpu.num_used == 0 and cluster.transfers.voided == 1
    # a late answer of the voided transfer changes nothing
    cluster.complete_transfer(KVTransferResult(transfer.transfer_id, True, 0.001, 1), 0.2)
    ended = drive(cluster)
    assert ended == [r] and r.num_output_tokens == 5 and r.finish_time is not None
    assert cluster.transfers.recomputed == 1
    leak_check(cluster)


def test_decode_worker_death_mid_transfer_sends_the_kv_to_another_decode_worker(cost_model) -> None:
    cluster = cluster_of(cost_model, "prefill", "decode", "decode")
    r = make_request("r", prompt=100, output=5)
    first = prefill_once(cluster, r)
    cluster.mark_down(first.dst_worker, 0.1)
    assert cluster.kv[first.dst_worker].gpu.num_used == 0
    (second,) = cluster.pop_transfers()
    other = D2 if first.dst_worker == D else D
    assert second.dst_worker == other and second.src_block_ids == first.src_block_ids
    assert "r" in cluster.kv[P].gpu_tables  # the KV waited on the prefill worker
    cluster.complete_transfer(KVTransferResult(second.transfer_id, True, 0.001, 1), 0.2)
    ended = drive(cluster)
    assert ended == [r] and r.num_output_tokens == 5
    assert cluster.transfers.succeeded == 1 and cluster.transfers.recomputed == 0
    leak_check(cluster)


def test_a_full_decode_pool_parks_requests_in_order_until_blocks_free(cost_model) -> None:
    # the decode worker holds one 100-token request at a time (7 blocks + growth; 10 blocks)
    cluster = cluster_of(cost_model, "prefill", "decode", decode_blocks=10)
    a, b = make_request("a", prompt=100, output=30), make_request("b", prompt=100, output=3)
    cluster.submit(a, 0.0)
    cluster.submit(b, 0.0)
    assert step(cluster, P, 0.0)
    (only,) = cluster.pop_transfers()
    assert only.request_id == "a" and cluster.num_in_transfer == 2  # b waits, its KV on the prefill worker
    assert "b" in cluster.kv[P].gpu_tables and "b" not in cluster.kv[D].gpu_tables
    cluster.complete_transfer(KVTransferResult(only.transfer_id, True, 0.001, 1), 0.01)
    assert cluster.pop_transfers() == []  # a holds 7 of the 10 blocks: still no room for b
    ended = drive(cluster)
    assert {r.request_id for r in ended} == {"a", "b"}
    assert all(r.status is RequestStatus.FINISHED_STOPPED for r in ended)
    assert b.token_times[1] > a.finish_time - 0.05  # b decoded once a's blocks came back
    assert cluster.transfers.succeeded == 2
    leak_check(cluster)


def test_an_abort_mid_transfer_frees_both_ends(cost_model) -> None:
    cluster = cluster_of(cost_model, "prefill", "decode")
    r = make_request("r", prompt=100, output=5)
    transfer = prefill_once(cluster, r)
    assert cluster.abort("r", 0.1)
    assert r.status is RequestStatus.FINISHED_ABORTED and cluster.pop_ended() == [r]
    cluster.complete_transfer(KVTransferResult(transfer.transfer_id, True, 0.001, 1), 0.2)
    drive(cluster)  # the prefill worker's release goes out
    leak_check(cluster)


@pytest.mark.parametrize("policy", ["vllm", "sarathi", "econoserve", "orca"])
def test_every_request_finishes_with_its_tokens_under_each_policy_with_failures(cost_model, policy: str) -> None:
    cluster = cluster_of(cost_model, "prefill", "prefill", "decode", "decode", policy=policy)
    requests = [make_request(f"r{i}", prompt=40 + 37 * i, output=1 + i % 7) for i in range(24)]
    for r in requests:
        assert cluster.submit(r, 0.0) is None
    ended = drive(cluster, answer=lambda t: t.transfer_id % 3 != 0)  # every third transfer fails
    assert sorted(r.request_id for r in ended) == sorted(r.request_id for r in requests)
    for r in requests:
        assert r.status is RequestStatus.FINISHED_STOPPED
        assert r.output_token_ids == [TOKEN] * (r.true_output_tokens - 1) + [EOS]
    stats = cluster.transfers
    assert stats.failed > 0 and stats.recomputed == stats.failed
    assert stats.issued == sum(1 for r in requests if r.true_output_tokens > 1)
    leak_check(cluster)


def test_roles_are_checked(cost_model) -> None:
    with pytest.raises(ValueError, match="needs a decode"):
        ClusterSpec("vllm", (WorkerSpec(64, 0, role="prefill"),), cost_model, 4096)
    with pytest.raises(ValueError, match="roles must be"):
        ClusterSpec("vllm", (WorkerSpec(64, 0, role="verify"),), cost_model, 4096)
    colocated = build_cluster(ClusterSpec("vllm", (WorkerSpec(64, 0),) * 2, cost_model, 4096))
    assert not isinstance(colocated, DisaggCluster) and colocated.pop_transfers() == []


def test_a_mixed_worker_prefills_and_decodes_its_own_and_takes_the_prefill_workers_kv(cost_model) -> None:
    cluster = cluster_of(cost_model, "prefill", "mixed")
    assert cluster.prefill_pool == [0, 1] and cluster.decode_pool == [1]
    a, b = make_request("a", prompt=60, output=4), make_request("b", prompt=60, output=4)
    cluster.submit(a, 0.0)
    cluster.submit(b, 0.0)
    assert (a.worker_id, b.worker_id) == (0, 1)  # round robin over the prefill pool
    ended = drive(cluster)
    assert {r.request_id for r in ended} == {"a", "b"} and all(r.num_output_tokens == 4 for r in ended)
    assert cluster.transfers.issued == 1  # only the prefill-only worker's request moved
    leak_check(cluster)


def test_with_no_prefill_worker_left_the_decode_workers_prefill_themselves(cost_model) -> None:
    cluster = cluster_of(cost_model, "prefill", "decode")
    cluster.mark_down(P, 0.0)
    r = make_request("r", prompt=60, output=4)
    assert cluster.submit(r, 0.0) is None and r.worker_id == D
    ended = drive(cluster)
    assert ended == [r] and r.num_output_tokens == 4 and cluster.transfers.issued == 0
    leak_check(cluster)
