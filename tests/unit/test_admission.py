"""SLO-aware admission (scheduler_service/core/admission.py): the decisions its estimate makes."""

from __future__ import annotations

import pytest

from scheduler_service.core.admission import QueueView, SpeedFit, StepSpeed, decide, estimate

SPEED = StepSpeed(base_s=0.010, per_token_s=0.002)  # 10 ms a step + 2 ms a token


def test_an_idle_worker_admits_and_the_first_token_costs_one_prefill_step() -> None:
    est = estimate(QueueView(), prompt_tokens=100, output_tokens=50, speed=SPEED)
    assert est.ttft_s == pytest.approx(0.010 + 0.002 * 100)
    assert est.batch == 1
    assert decide(est, ttft_s=0.5, tbt_s=0.2).admit


def test_the_tbt_slo_bounds_the_batch_at_what_the_measured_speed_allows() -> None:
    # prompt 32 / output 32: each decode step also carries the prompts of the requests that
    # replace finished ones, so a batch of B costs 10 ms + 2 ms x 2B; TBT 200 ms -> B <= 47
    assert SPEED.max_batch(0.200, prompt_per_output=1.0) == 47
    admitted = 0
    running: list[int] = []
    while True:
        est = estimate(QueueView(running_left=tuple(running)), 32, 32, SPEED)
        if not decide(est, ttft_s=None, tbt_s=0.200).admit:
            break
        admitted += 1
        running.append(32)
    assert admitted == 47


def test_a_full_set_of_seats_makes_the_request_wait_for_the_first_running_request_to_end() -> None:
    view = QueueView(running_left=(40, 10, 30, 20), max_num_seqs=4)
    est = estimate(view, prompt_tokens=50, output_tokens=20, speed=SPEED)
    # one departure is needed: the shortest remainder, 10 decode steps of a batch of 4
    assert est.ttft_s == pytest.approx(10 * (0.010 + 0.002 * 4) + 0.010 + 0.002 * (50 + 4))
    assert est.batch == 4


def test_prompts_queued_ahead_delay_the_first_token_and_a_long_queue_is_refused_naming_ttft() -> None:
    short = estimate(QueueView(waiting_prompts=(100,), waiting_outputs=(10,)), 100, 10, SPEED)
    long = estimate(QueueView(waiting_prompts=(100,) * 20, waiting_outputs=(10,) * 20), 100, 10, SPEED)
    assert long.ttft_s > short.ttft_s + 19 * 100 * 0.002 - 1e-9
    refused = decide(long, ttft_s=1.0, tbt_s=10.0)
    assert not refused.admit and refused.reason == "ttft"
    assert "SLO cannot be met under the current load: estimated TTFT" in refused.describe(1.0, 10.0)
    assert decide(short, ttft_s=1.0, tbt_s=10.0).admit


def test_the_speed_fit_recovers_the_step_line_and_keeps_the_prior_slope_when_steps_are_alike() -> None:
    fit = SpeedFit(StepSpeed(0.005, 0.001))
    assert fit.speed() == StepSpeed(0.005, 0.001), "the prior until steps are seen"
    fit.add(100, 0.21)  # the first step took twice what the prior says: the prior, doubled
    assert fit.speed().base_s == pytest.approx(0.010) and fit.speed().per_token_s == pytest.approx(0.002)
    for tokens in range(10, 210, 10):
        fit.add(tokens, 0.010 + 0.002 * tokens)
    assert fit.speed().base_s == pytest.approx(0.010)
    assert fit.speed().per_token_s == pytest.approx(0.002)
    alike = SpeedFit(StepSpeed(0.0, 0.001))
    for _ in range(20):
        alike.add(100, 0.15)
    assert alike.speed().per_token_s == pytest.approx(0.001)
    assert alike.speed().base_s == pytest.approx(0.05)


def test_a_batch_filling_up_is_paced_while_a_lone_lump_at_light_load_passes() -> None:
    running = (16,) * 6
    light = QueueView(running_left=running, waiting_prompts=(48, 48), waiting_outputs=(16, 16), recent_prefill=10)
    lump = estimate(light, 48, 16, SPEED)
    # batch 9 at turnover 9 x 3 prompt tokens a step, plus the 144 pending tokens over 16 outputs
    assert lump.tbt_s == pytest.approx(0.010 + 0.002 * (9 + 27) + 0.002 * 144 / 16)
    assert decide(lump, None, 0.150).admit
    # the same lump while the batch fills up (the last steps carried 200 prompt tokens each,
    # above the turnover): it counts as every step's load
    ramping = QueueView(running_left=running, waiting_prompts=(48, 48), waiting_outputs=(16, 16), recent_prefill=200)
    ramp = estimate(ramping, 48, 16, SPEED, tbt_s=0.150)
    assert ramp.tbt_s == pytest.approx(0.010 + 0.002 * (9 + 96))
    assert not decide(ramp, None, 0.150).admit
    # prompt tokens lately at light load (50 a step) stay below a full batch's turnover
    # (the 150 ms TBT allows a batch of 17: 51 prompt tokens a step): no ramp
    light_again = QueueView(running_left=running, waiting_prompts=(48, 48), waiting_outputs=(16, 16), recent_prefill=50)
    assert estimate(light_again, 48, 16, SPEED, tbt_s=0.150).tbt_s == pytest.approx(lump.tbt_s)
