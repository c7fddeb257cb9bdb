"""Faults under load, small but real (benchmarks/fault_suite.py runs the heavy versions): a
worker process SIGKILLed under load loses no request; all workers killed ends the requests in
flight UNAVAILABLE and one worker started again is taken back; random cancellations and
aborts at every stage leak no KV block or request, on the scheduler or the workers."""

from __future__ import annotations

import pytest

from sluice_bench.fault_harness import (
    scenario_all_killed_then_one_back,
    scenario_overload,
    scenario_random_cancellations,
    scenario_sigkill_under_load,
)

pytestmark = pytest.mark.slow


async def test_a_worker_sigkilled_under_load_loses_no_request() -> None:
    figures = await scenario_sigkill_under_load(num_requests=40, max_tokens=40)
    assert figures["lost"] == 0 and figures["held_after"] == 0, figures


async def test_all_workers_killed_then_one_back() -> None:
    figures = await scenario_all_killed_then_one_back(num_requests=12, max_tokens=200)
    assert figures["in_flight_codes"] == {"UNAVAILABLE": 12}, figures
    assert figures["rejected_final_with_ok"] == 0
    assert figures["new_request_while_none"] == "UNAVAILABLE"
    assert figures["readmitted"] and figures["after"] == 12 and figures["held_after"] == 0, figures


async def test_random_cancellations_and_aborts_leak_nothing() -> None:
    figures = await scenario_random_cancellations(num_requests=150, concurrency=40)
    assert figures["scheduler_held_after"] == 0, figures
    assert figures["worker_requests_after"] == [0, 0] and figures["worker_blocks_after"] == [0, 0], figures
    outcomes = figures["outcomes"]
    assert set(outcomes) <= {"cancel:CANCELLED", "abort:OK", "finish:OK"}, outcomes


async def test_a_tenfold_burst_is_refused_with_retry_info_while_the_admitted_finish() -> None:
    figures = await scenario_overload(capacity=16, factor=10, step_s=0.005)
    codes = figures["burst_codes"]
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes
    assert codes.get("RESOURCE_EXHAUSTED", 0) == figures["refused_with_retry_info"] > 0
    assert figures["admitted_complete"] == codes["OK"] >= 16
    assert figures["base_codes"] == {"OK": 16}
    assert figures["held_after"] == 0
    assert figures["rss_mb"]["peak"] - figures["rss_mb"]["before"] < 200, figures["rss_mb"]
