"""The plug-in inside vLLM's real scheduler classes, no model: each policy's admission order,
token budget and preemption victim on synthetic requests (sluice_bench/vllm_plugin_harness.py plays
the model: one token per scheduled decode)."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

from scheduler_service.policies.decisions import budget_from_tbt_slo
from sluice_bench.vllm_plugin_harness import build_scheduler, make_request, step
from sluice_vllm.config import PluginConfigError
from sluice_vllm.policies import LinearStepTime
from sluice_vllm.scheduler import SluiceAsyncScheduler, SluiceScheduler
from sluice_vllm.vllm_compat import RequestStatus, Scheduler, UnsupportedVLLMError, check_version

BASES = [SluiceScheduler, SluiceAsyncScheduler]


def plug(cls: type, policy: str, **kw: object) -> object:
    return build_scheduler(cls, env={"SLUICE_VLLM_POLICY": policy}, **kw)


def admitted(out: object) -> list[str]:
    return [r.req_id for r in out.scheduled_new_reqs]  # type: ignore[attr-defined]


def run_all(s: object, max_steps: int = 400) -> list[str]:
    """Steps until every request finished; the finish order."""
    order: list[str] = []
    for _ in range(max_steps):
        if not s.requests:  # type: ignore[attr-defined]
            return order
        before = set(s.requests)  # type: ignore[attr-defined]
        step(s)
        order += sorted(before - set(s.requests), key=lambda r: r)  # type: ignore[attr-defined]
    raise AssertionError("requests did not finish")


# ---------------------------------------------------------------------------- FCFS


def test_fcfs_plugin_decides_exactly_as_vllms_own_scheduler_under_kv_pressure() -> None:
    """Same requests, same KV shortage: every step's scheduled tokens and preemptions match."""
    mine, theirs = plug(SluiceScheduler, "fcfs", num_blocks=9), build_scheduler(Scheduler, num_blocks=9)
    trace: dict[str, list[object]] = {"mine": [], "theirs": []}
    for s, key in ((mine, "mine"), (theirs, "theirs")):
        for i in range(5):
            s.add_request(make_request(f"r{i}", 40 + 8 * i, 30 + 10 * i, arrival=i))
        for _ in range(200):
            if not s.requests:
                break
            out = step(s)
            trace[key].append((dict(out.num_scheduled_tokens), sorted(out.preempted_req_ids or ())))
    assert trace["mine"] == trace["theirs"]
    assert any(p for _, p in trace["mine"]), "the workload must preempt, or it checks nothing"


# ---------------------------------------------------------------------------- priority, SLO classes


@pytest.mark.parametrize("cls", BASES)
def test_priority_admits_smallest_value_first_and_preempts_the_lowest(cls: type) -> None:
    s = plug(cls, "priority", max_num_seqs=2, num_blocks=8)
    for i, prio in enumerate([3, 1, 2, 0]):
        s.add_request(make_request(f"p{prio}", 64, 200, arrival=i, priority=prio))
    assert sorted(admitted(step(s))) == ["p0", "p1"]
    # the running list is served highest priority first, so its end is the victim
    assert [r.request_id for r in s.running] == ["p0", "p1"]
    preempted: list[str] = []
    for _ in range(100):
        preempted += step(s).preempted_req_ids or []
        if preempted:
            break
    assert preempted[0] == "p1"


def test_slo_class_puts_online_before_offline_and_derives_the_budget_from_tbt() -> None:
    s = plug(SluiceScheduler, "slo_class:step_base_ms=5,step_us_per_token=100", max_num_seqs=2)
    s.add_request(make_request("batch", 64, 50, arrival=0, jct_ms=60000))
    s.add_request(make_request("chat", 64, 50, arrival=1, tbt_ms=20))
    s.add_request(make_request("chat2", 64, 50, arrival=2, slo_class="online"))
    assert sorted(admitted(step(s))) == ["chat", "chat2"]
    s.add_request(make_request("doc", 600, 5, arrival=3, tbt_ms=20))
    step(s)
    # tau for 20 ms at 5 ms + 0.1 ms/token: 150 tokens -> 128 (a multiple of 32)
    assert s.max_num_scheduled_tokens == budget_from_tbt_slo(LinearStepTime(0.005, 1e-4), 0.02, 32) == 128


# ---------------------------------------------------------------------------- Sarathi


def test_sarathi_budget_is_the_tbt_slo_tau_and_chunks_long_prompts() -> None:
    s = plug(SluiceScheduler, "sarathi:tbt_slo_ms=30,step_base_ms=5,step_us_per_token=100")
    assert s.sluice_policy.tau == 224  # (30 - 5) ms / 0.1 ms = 250 tokens -> 224
    s.add_request(make_request("long", 700, 4))
    s.add_request(make_request("short", 40, 4, arrival=1))
    sizes = [step(s).total_num_scheduled_tokens for _ in range(4)]
    assert sizes[:3] == [224, 224, 224]  # the 700-token prompt in chunks of tau
    assert max(sizes) <= 224


def test_sarathi_without_an_slo_option_sizes_tau_by_the_tightest_client_tbt_slo() -> None:
    """The clients' own tbt_ms reach tau (as in Sluice's Sarathi); the paper's 512 without one."""
    s = plug(SluiceScheduler, "sarathi:step_base_ms=5,step_us_per_token=100")
    assert step(s).total_num_scheduled_tokens == 0 and s.max_num_scheduled_tokens == 512
    s.add_request(make_request("loose", 700, 4, tbt_ms=60))
    s.add_request(make_request("tight", 700, 4, arrival=1, tbt_ms=30))
    s.add_request(make_request("batch", 700, 4, arrival=2, jct_ms=600000))  # offline: no TBT SLO
    assert step(s).total_num_scheduled_tokens == 224  # (30 - 5) ms / 0.1 ms = 250 -> 224
    assert s.max_num_scheduled_tokens == budget_from_tbt_slo(LinearStepTime(0.005, 1e-4), 0.03, 32) == 224
    s.finish_requests(["tight"], RequestStatus.FINISHED_ABORTED)
    step(s)
    assert s.max_num_scheduled_tokens == budget_from_tbt_slo(LinearStepTime(0.005, 1e-4), 0.06, 32)


def test_sarathi_fixed_budget_and_a_bad_value_is_named() -> None:
    s = plug(SluiceScheduler, "sarathi:budget=64")
    s.add_request(make_request("a", 200, 2))
    assert step(s).total_num_scheduled_tokens == 64
    with pytest.raises(PluginConfigError, match=r"sarathi\.budget"):
        plug(SluiceScheduler, "sarathi:budget=abc")


# ---------------------------------------------------------------------------- ALISE


@pytest.mark.parametrize("cls", BASES)
def test_alise_admits_shortest_predicted_first(cls: type) -> None:
    s = plug(cls, "alise", max_num_seqs=1)
    for i, pred in enumerate([300, 20, 120]):
        s.add_request(make_request(f"pred{pred}", 40, 400, arrival=i, predicted_tokens=pred))
    assert admitted(step(s)) == ["pred20"]


def test_alise_preempts_the_longest_remaining_not_the_newest() -> None:
    """vLLM preempts the newest running request; ALISE the worst-ranked one."""
    s = plug(SluiceScheduler, "alise", num_blocks=8)  # 7 usable blocks of 32 tokens
    s.add_request(make_request("long", 64, 300, arrival=0, predicted_tokens=300))
    s.add_request(make_request("mid", 64, 300, arrival=1, predicted_tokens=100))
    s.add_request(make_request("short", 64, 300, arrival=2, predicted_tokens=40))
    preempted: list[str] = []
    for _ in range(100):
        preempted += step(s).preempted_req_ids or []
        if preempted:
            break
    assert preempted[0] == "long"
    vllm_own = build_scheduler(Scheduler, num_blocks=8)
    for i, name in enumerate(["long", "mid", "short"]):
        vllm_own.add_request(make_request(name, 64, 300, arrival=i))
    theirs: list[str] = []
    for _ in range(100):
        theirs += step(vllm_own).preempted_req_ids or []
        if theirs:
            break
    assert theirs[0] == "short"  # the contrast: vLLM's victim is the newest


def test_alise_doubles_a_prediction_that_ran_out() -> None:
    s = plug(SluiceScheduler, "alise")
    s.add_request(make_request("r", 40, 50, predicted_tokens=3))
    for _ in range(9):  # ALISE's refresh pass runs every 8 steps (refresh_steps)
        step(s)
    job = s._sluice_jobs["r"]
    assert job.req.num_output_tokens >= 3 and job.predicted >= 6


def test_alise_aging_lifts_a_long_waiting_request_over_new_short_ones() -> None:
    s = plug(SluiceScheduler, "alise:aging_s=0.05", max_num_seqs=1)
    s.add_request(make_request("busy", 40, 1000, predicted_tokens=5))
    step(s)
    s.add_request(make_request("long", 40, 50, arrival=1, predicted_tokens=2000))
    s.add_request(make_request("short", 40, 50, arrival=2, predicted_tokens=10))
    assert [r.request_id for r in s.waiting] == ["long", "short"]  # not reordered yet
    step(s)
    assert [r.request_id for r in s.waiting] == ["short", "long"]
    end = time.monotonic() + 0.5  # ten aging periods: "long" climbs to queue 0
    while time.monotonic() < end:
        step(s)
        time.sleep(0.01)
    assert s._sluice_jobs["long"].level == 0
    s.add_request(make_request("short2", 40, 50, arrival=3, predicted_tokens=10))
    step(s)
    order = [r.request_id for r in s.waiting]
    assert order.index("long") < order.index("short2")  # a new short job no longer overtakes it


# ---------------------------------------------------------------------------- FastServe


def test_fastserve_skip_join_and_demotion_after_the_quantum() -> None:
    opts = "fastserve:quantum_ms=10,step_base_ms=5,step_us_per_token=100"
    s = plug(SluiceScheduler, opts, max_num_seqs=1)
    s.add_request(make_request("big", 900, 50, arrival=0))  # prefill 95 ms: joins queue 4
    s.add_request(make_request("small", 40, 50, arrival=1))  # 9 ms: queue 0
    assert s._sluice_jobs["big"].level == 4 and s._sluice_jobs["small"].level == 0
    assert admitted(step(s)) == ["small"]
    # "small" spends queue 0's 10 ms quantum within a few steps, then queue 1's 20 ms
    for _ in range(8):
        step(s, model_s=0.005)
    assert s._sluice_jobs["small"].level >= 1


# ---------------------------------------------------------------------------- AccelGen


@pytest.mark.parametrize("cls", BASES)
def test_accelgen_serves_the_most_urgent_first_with_the_eq6_budget(cls: type) -> None:
    s = plug(cls, "accelgen:pivot_tokens=256,pivot_ms=20,min_budget=64", max_num_seqs=1)
    s.add_request(make_request("loose", 40, 20, arrival=0, ttft_ms=5000))
    s.add_request(make_request("tight", 40, 20, arrival=1, ttft_ms=100))
    out = step(s)
    assert admitted(out) == ["tight"]
    # Eq. 6: 256 tokens x 100 ms / 20 ms = 1280, capped at max_num_batched_tokens (1024)
    assert s.max_num_scheduled_tokens == 1024
    step(s)  # "tight" now decodes: its iteration SLO is the default TBT 187.5 ms -> 2400 -> 1024
    s2 = plug(cls, "accelgen:pivot_tokens=256,pivot_ms=20,min_budget=64")
    s2.add_request(make_request("t", 900, 5, ttft_ms=50))
    assert step(s2).total_num_scheduled_tokens == 640  # 256 x 50 / 20


def test_accelgen_offline_request_yields_to_online() -> None:
    s = plug(SluiceScheduler, "accelgen", max_num_seqs=1)
    s.add_request(make_request("offline", 40, 20, arrival=0, jct_ms=600000, predicted_tokens=20))
    s.add_request(make_request("online", 40, 20, arrival=1, ttft_ms=1000))
    assert admitted(step(s)) == ["online"]


def test_accelgen_refresh_refiles_each_request_as_its_full_rule_does() -> None:
    """The refresh's shortcut for requests past their prompt (one T_r per TBT SLO) gives every
    request the deadline and rank the full rule gives: prompts keep their clock, offline
    requests get their JCT share, online decodes their TBT SLO less T_max."""
    s = plug(SluiceScheduler, "accelgen:min_budget=256", max_num_seqs=8, max_num_batched_tokens=256)
    hints = [{"tbt_ms": 50}, {"tbt_ms": 50}, {}, {"tbt_ms": 200}, {"jct_ms": 600000, "predicted_tokens": 30}]
    hints.append({"ttft_ms": 60000})  # the long prompt, least urgent: still in its prefill below
    for i, extra in enumerate(hints):
        s.add_request(make_request(f"r{i}", 2000 if i == 5 else 40, 30, arrival=i, **extra))
    for _ in range(4):
        step(s)
    policy = s.sluice_policy  # type: ignore[attr-defined]
    jobs = list(s._sluice_jobs.values())  # type: ignore[attr-defined]
    assert any(j.prefill_left for j in jobs) and sum(j.req.num_output_tokens > 0 for j in jobs) >= 4
    now = time.monotonic() + 1.0
    t0s = [j.t0 for j in jobs]
    policy.on_step(jobs, 0.01, now)
    fast = [(j.t0, j.deadline, j.rank) for j in jobs]
    for job, t0 in zip(jobs, t0s, strict=True):
        job.t0 = t0
        policy._file(job, job.t0 if job.prefill_left and not job.hints.offline else now)
    assert fast == [(j.t0, j.deadline, j.rank) for j in jobs]


# ---------------------------------------------------------------------------- configuration and hints


def test_unknown_policy_or_option_is_a_clear_error() -> None:
    with pytest.raises(PluginConfigError, match=r"unknown policy 'sjf'.*alise"):
        plug(SluiceScheduler, "sjf")
    with pytest.raises(PluginConfigError, match=r"alise.*no option 'agingg'.*aging_s"):
        plug(SluiceScheduler, "alise:agingg=1")


def test_bad_hints_are_dropped_counted_and_the_request_still_served() -> None:
    s = plug(SluiceScheduler, "alise")
    s.add_request(make_request("r", 40, 3, predicted_tokens=-4, tbt_ms="fast", slo_class="gold"))
    assert s.sluice_counters["bad_hints"] == 3
    assert run_all(s) == ["r"]


def test_a_vllm_outside_the_tested_range_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedVLLMError, match=r"tested with vLLM >=0.32.0,<0.33.0; found 0.31.2"):
        check_version("0.31.2")
    assert check_version("0.32.0+cpu") == "0.32.0+cpu"


def test_an_unreachable_predictor_fails_open() -> None:
    """No predictor answering: requests run on max_tokens, nothing waits, failures counted."""
    from tests.predictor_harness import closed_port

    env = {
        "SLUICE_VLLM_POLICY": "alise",
        "SLUICE_VLLM_PREDICTOR": f"127.0.0.1:{closed_port()}",
        "SLUICE_VLLM_PREDICTOR_TIMEOUT_MS": "50",
    }
    s = build_scheduler(SluiceScheduler, env=env)
    s.add_request(make_request("a", 40, 4))
    started = time.perf_counter()
    step(s)
    assert time.perf_counter() - started < 0.05  # schedule() never waits on the predictor
    assert s._sluice_jobs["a"].predicted == 4  # the fallback: max_tokens
    run_all(s)
    deadline = time.time() + 5
    while time.time() < deadline and not any(k.startswith("predict_failed") for k in s._sluice_predictor.counters):
        time.sleep(0.05)
    assert s._sluice_predictor.counters["predict_asked"] == 1
    assert any(k.startswith("predict_failed") for k in s._sluice_predictor.counters)
    s.shutdown()


def test_vllms_own_priority_mode_is_refused_because_it_overrides_the_victim_choice() -> None:
    with pytest.raises(ValueError, match="leave vLLM's --scheduling-policy at fcfs"):
        plug(SluiceScheduler, "alise", scheduling_policy="priority")
