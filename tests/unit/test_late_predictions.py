"""A predicted output length that arrives after its request (the live predictor answering while
the request waits): the scheduler applies it, and policies that file requests by their
prediction at arrival (ALISE, AccelGen) re-file them, so the late prediction decides the order."""

from __future__ import annotations

from harness import make_request, make_scheduler, run_to_completion

from scheduler_service.core.request import Request
from scheduler_service.core.slo import SLOSpec


def first_scheduled(sched, requests: list[Request]) -> list[str]:  # type: ignore[no-untyped-def]
    order: list[str] = []
    for plan in run_to_completion(sched):
        order += [rid for rid in plan.num_scheduled_tokens if rid not in order]
    return order


def test_a_late_short_prediction_moves_a_waiting_alise_job_ahead() -> None:
    sched = make_scheduler("alise", max_num_seqs=1)
    jobs = [make_request("a", 8, 6), make_request("b", 8, 6)]
    jobs[0].predicted_output_tokens, jobs[1].predicted_output_tokens = 6, 40  # b's guess: long
    for r in jobs:
        sched.add_request(r, 0.0)
    assert sched.update_prediction("b", 2, "predictor", 0.001)
    assert jobs[1].predicted_output_tokens == 2 and jobs[1].length_source == "predictor"
    assert first_scheduled(sched, jobs) == ["b", "a"]
    sched.assert_empty()


def test_without_the_late_prediction_alise_keeps_the_arrival_guess() -> None:
    sched = make_scheduler("alise", max_num_seqs=1)
    jobs = [make_request("a", 8, 6), make_request("b", 8, 6)]
    jobs[0].predicted_output_tokens, jobs[1].predicted_output_tokens = 6, 40
    for r in jobs:
        sched.add_request(r, 0.0)
    assert first_scheduled(sched, jobs) == ["a", "b"]
    sched.assert_empty()


def test_a_late_prediction_moves_a_waiting_offline_accelgen_deadline() -> None:
    """AccelGen orders offline requests by their JCT budget per iteration: the JCT SLO left over
    the iterations still to run, so more predicted tokens mean less slack and an earlier deadline."""
    sched = make_scheduler("accelgen", max_num_seqs=1, max_num_batched_tokens=16)
    offline = SLOSpec(jct_s=30.0)
    jobs = [make_request(r, 8, 4, max_tokens=200, slo=offline) for r in ("a", "b")]
    jobs[0].predicted_output_tokens, jobs[1].predicted_output_tokens = 4, 2
    for r in jobs:
        sched.add_request(r, 0.0)
    before = jobs[1].policy_state.deadline
    assert before > jobs[0].policy_state.deadline, "two tokens left: more slack than a's four"
    assert sched.update_prediction("b", 150, "predictor", 0.0)
    assert jobs[1].policy_state.deadline < jobs[0].policy_state.deadline < before
    assert first_scheduled(sched, jobs)[0] == "b"
    sched.assert_empty()


def test_a_prediction_for_an_unknown_or_ended_request_is_ignored() -> None:
    sched = make_scheduler("vllm")
    req = make_request("a", 8, 2)
    sched.add_request(req, 0.0)
    run_to_completion(sched)
    assert not sched.update_prediction("a", 5, "predictor", 1.0)
    assert not sched.update_prediction("nobody", 5, "predictor", 1.0)
    sched.assert_empty()
