"""Each router picks the worker its rule names; SCLS's router holds its pool until the
interval, places whole DP batches max-min, and drops a batch's load when it ends."""

from __future__ import annotations

import pytest
from harness import make_request

from scheduler_service.policies.scls.batcher import MaxMinOffloader, SliceTag
from scheduler_service.policies.scls.estimator import ServingTimeEstimator
from scheduler_service.policies.scls.router import MaxMinRouter, SCLSRouter, SCLSRouterConfig
from scheduler_service.routers import RouterContext, WorkerLoad, build_router
from scheduler_service.routers.kv_aware import KVAwareRouter

EST = ServingTimeEstimator((1.5e-5, 0.0, 0.0, 0.02), (4.3e-6, 5e-4, 0.0, 0.0207))


def loads(n: int, free: list[int] | None = None, waiting: list[int] | None = None) -> list[WorkerLoad]:
    free = free or [1000] * n
    waiting = waiting or [0] * n
    return [WorkerLoad(w, True, waiting[w], 0, free[w], 1000) for w in range(n)]


def test_round_robin_cycles_and_skips_unhealthy_workers() -> None:
    router = build_router("round_robin")
    ws = loads(3)
    ws[1].healthy = False
    picks = [router.select(make_request(str(i), 4, 1), ws, 0.0) for i in range(4)]
    assert picks == [0, 2, 0, 2]


def test_least_work_sends_to_the_worker_with_the_fewest_outstanding_tokens() -> None:
    router = build_router("least_work")
    ws = loads(2)
    assert router.select(make_request("big", 100, 100), ws, 0.0) == 0
    assert router.select(make_request("small", 4, 4), ws, 0.0) == 1
    assert router.select(make_request("next", 4, 4), ws, 0.0) == 1


def test_max_min_offloader_places_the_longest_first_on_the_least_loaded_worker() -> None:
    off = MaxMinOffloader()
    off.load = {0: 4.0, 1: 0.0}
    # 5 -> w1 (load 0), then 3 -> w0 (load 4 < 5), then 1 -> w1 (load 5 < 7)
    assert off.assign([1.0, 5.0, 3.0], [0, 1]) == [1, 1, 0]
    assert off.load == {0: 7.0, 1: 6.0}
    off.finish(0, 3.0)
    assert off.load[0] == 4.0


def test_max_min_router_charges_estimates_and_subtracts_them_when_the_request_leaves() -> None:
    router = MaxMinRouter(EST)
    ws = loads(2)
    long_, short = make_request("long", 1000, 500), make_request("short", 10, 10)
    assert router.select(long_, ws, 0.0) == 0
    assert router.select(short, ws, 0.0) == 1
    assert router.select(make_request("third", 10, 10), ws, 0.0) == 1  # w1 still far below w0
    router.on_request_left(long_, 0, 1.0)
    assert router.offloader.load[0] == pytest.approx(0.0)
    assert router.select(make_request("fourth", 10, 10), ws, 1.0) == 0


def test_kv_aware_picks_the_most_free_kv_after_its_waiting_queue() -> None:
    router = KVAwareRouter(block_size=16)
    assert router.select(make_request("a", 160, 1), loads(2, free=[500, 900]), 0.0) == 1
    # w1 has more free blocks, but 4 waiting requests of 10 blocks each will take them
    ws = loads(2, free=[500, 520], waiting=[0, 4])
    assert router.select(make_request("b", 160, 1), ws, 0.0) == 0
    router.on_request_left(make_request("a", 160, 1), 1, 1.0)
    assert router._sent[1] == [0, 0]


def _scls(variant: str = "full", **kw: float) -> SCLSRouter:
    cfg = SCLSRouterConfig(variant=variant, slice_len=128, gamma_s=3.0, **kw)  # type: ignore[arg-type]
    return SCLSRouter(cfg, EST, RouterContext(block_size=16, num_gpu_blocks=1000, max_num_seqs=64))


def _submit(router: SCLSRouter, reqs: list, ws: list[WorkerLoad], now: float) -> None:
    for r in reqs:
        assert router.select(r, ws, now) is None
        router.held.append(r)  # what Cluster.submit does with a held request


def test_scls_router_holds_the_pool_until_its_interval_then_places_whole_dp_batches() -> None:
    router = _scls()
    ws = loads(2)
    reqs = [make_request(f"s{i}", 10, 5) for i in range(15)] + [make_request("long", 1024, 5)]
    _submit(router, reqs, ws, 0.5)
    assert router.next_release(0.5) == pytest.approx(3.0)
    assert router.release(ws, 2.9) == []
    placed = router.release(ws, 3.0)
    assert len(placed) == 16 and not router.held
    by_batch: dict[int, set[int]] = {}
    for req, worker in placed:
        assert isinstance(req.policy_state, SliceTag) and req.policy_state.slice_len == 128
        by_batch.setdefault(req.policy_state.batch_id, set()).add(worker)
    assert sorted(len([r for r, _ in placed if r.policy_state.batch_id == b]) for b in by_batch) == [1, 15]
    assert all(len(ws_) == 1 for ws_ in by_batch.values())  # a batch is never split across workers
    assert {w for _, w in placed} == {0, 1}  # max-min: the two batches go to different workers


def test_scls_router_subtracts_a_batch_estimate_only_when_its_last_member_leaves() -> None:
    router = _scls()
    ws = loads(1)
    reqs = [make_request(f"r{i}", 10, 5) for i in range(3)]
    _submit(router, reqs, ws, 0.0)
    router.release(ws, 3.0)
    est = router.offloader.load[0]
    assert est == pytest.approx(EST.serve_time(3, 10, 128))
    router.on_request_left(reqs[0], 0, 4.0)
    router.on_request_left(reqs[1], 0, 4.0)
    assert router.offloader.load[0] == pytest.approx(est)
    router.on_request_left(reqs[2], 0, 4.0)
    assert router.offloader.load[0] == pytest.approx(0.0)


def test_scls_adaptive_interval_is_max_of_xi_times_min_load_and_gamma() -> None:
    router = _scls()
    ws = loads(1)
    _submit(router, [make_request(f"r{i}", 1000, 5) for i in range(40)], ws, 0.0)
    router.release(ws, 3.0)
    assert router.interval == pytest.approx(max(0.5 * router.offloader.load[0], 3.0))
    assert router.interval > 3.0
    fixed = _scls("lb")
    _submit(fixed, [make_request(f"q{i}", 1000, 5) for i in range(40)], ws, 0.0)
    fixed.release(ws, 3.0)
    assert fixed.interval == 3.0


def test_scls_pm_variant_caps_batches_and_deals_them_round_robin() -> None:
    router = _scls("pm", pm_batch=4)
    ws = loads(3)
    _submit(router, [make_request(f"r{i}", 10, 5) for i in range(12)], ws, 0.0)
    placed = router.release(ws, 3.0)
    sizes: dict[int, int] = {}
    for req, _ in placed:
        sizes[req.policy_state.batch_id] = sizes.get(req.policy_state.batch_id, 0) + 1
    assert max(sizes.values()) <= 4
    assert {w for _, w in placed} == {0, 1, 2}


def test_router_specs_parse_options_and_reject_unknown_ones() -> None:
    from scheduler_service.costmodel.factory import build_cost_model

    ctx = RouterContext(cost_model=build_cost_model("analytic", "llama-2-13b", "a100-80g"), num_gpu_blocks=100)
    router = build_router("scls:variant=ab,slice_len=64,gamma_s=6", ctx)
    assert isinstance(router, SCLSRouter) and router.config.slice_len == 64 and router.interval == 6.0
    with pytest.raises(ValueError, match="no option"):
        build_router("scls:slices=3", ctx)
    with pytest.raises(ValueError, match="variant"):
        build_router("scls:variant=xx", ctx)
    with pytest.raises(ValueError, match="takes no options"):
        build_router("round_robin:x=1", ctx)
