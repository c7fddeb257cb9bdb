"""Whether a request met its SLOs is decided in one place (scheduler_service/core/slo.py): the
simulator's metrics and the live service's final timings must give the same answer for the
same token times."""

from __future__ import annotations

from array import array

import pytest

from scheduler_service.core.metrics import MetricsRecorder
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.slo import NO_SLO, SLOSpec, SLOVerdict, judge_slo, mean_token_gap
from scheduler_service.server import request_timings, slo_met
from sluice.contract.sampling import SamplingParams

ARRIVAL = 10.0
# first token 0.5 s after arrival, then gaps of 0.1, 0.3 and 0.2 s (mean 0.2 s, max 0.3 s), last at 1.1 s
TIMES = (10.5, 10.6, 10.9, 11.1)
SLO = SLOSpec(ttft_s=0.6, tbt_s=0.25, jct_s=1.2)


def test_mean_token_gap_is_the_mean_of_the_gaps() -> None:
    assert mean_token_gap(TIMES) == pytest.approx(0.2)
    assert mean_token_gap((3.0,)) is None
    assert mean_token_gap(()) is None


@pytest.mark.parametrize(
    ("slo", "missed"),
    [
        (SLO, ()),
        (SLOSpec(ttft_s=0.4, tbt_s=0.25, jct_s=1.2), ("ttft",)),
        # judged on the mean gap (0.2 s), not the worst one (0.3 s)
        (SLOSpec(ttft_s=0.6, tbt_s=0.15, jct_s=1.2), ("tbt",)),
        (SLOSpec(ttft_s=0.6, tbt_s=0.25, jct_s=1.0), ("jct",)),
        (SLOSpec(ttft_s=0.1, tbt_s=0.1, jct_s=0.1), ("ttft", "tbt", "jct")),
        (NO_SLO, ()),
    ],
    ids=["met", "ttft", "tbt", "jct", "all", "no-slo"],
)
def test_the_verdict_names_each_missed_objective(slo: SLOSpec, missed: tuple[str, ...]) -> None:
    verdict = judge_slo(slo, ARRIVAL, TIMES)
    assert verdict.missed == missed
    assert verdict.met == (missed == ())


def test_bounds_are_inclusive_and_an_absent_slo_is_not_judged() -> None:
    # exactly on each bound: met (the times are chosen to be exact in binary)
    exact = judge_slo(SLOSpec(ttft_s=0.5, tbt_s=0.25, jct_s=1.0), 0.0, (0.5, 0.75, 1.0))
    assert exact == SLOVerdict(ttft_met=True, tbt_met=True, jct_met=True)
    assert judge_slo(SLOSpec(jct_s=5.0), ARRIVAL, TIMES) == SLOVerdict(jct_met=True)
    # one token has no gap: a TBT SLO cannot be missed
    assert judge_slo(SLOSpec(tbt_s=1e-9), ARRIVAL, (10.5,)) == SLOVerdict()


def test_a_request_without_tokens_cannot_be_judged() -> None:
    with pytest.raises(ValueError):
        judge_slo(SLO, ARRIVAL, ())


def finished(slo: SLOSpec, times: tuple[float, ...], status: RequestStatus = RequestStatus.FINISHED_STOPPED) -> Request:
    request = Request("r", arrival_time=ARRIVAL, num_prompt_tokens=4, sampling=SamplingParams(max_tokens=8), slo=slo)
    request.token_times = array("d", times)
    request.num_output_tokens = len(times)
    request.status = status
    return request


def simulated_attainment(request: Request) -> float:
    recorder = MetricsRecorder()
    recorder.on_admitted(request)
    recorder.on_finish(request, request.token_times[-1] if request.token_times else ARRIVAL)
    return recorder.summary()["slo_attainment_req"]


@pytest.mark.parametrize(
    "slo",
    [
        SLO,
        SLOSpec(ttft_s=0.4),
        SLOSpec(tbt_s=0.15),
        SLOSpec(tbt_s=0.2),  # the mean gap exactly: both sides must agree on its arithmetic
        SLOSpec(jct_s=1.0),
        NO_SLO,
    ],
    ids=["met", "ttft", "tbt", "tbt-on-bound", "jct", "no-slo"],
)
def test_live_and_simulated_metrics_agree(slo: SLOSpec) -> None:
    request = finished(slo, TIMES)
    live = slo_met(request)
    assert request_timings(request).slo_met == live
    assert simulated_attainment(request) == (1.0 if live else 0.0)
    assert live == judge_slo(slo, ARRIVAL, TIMES).met


@pytest.mark.parametrize("status", [RequestStatus.FINISHED_TIMEOUT, RequestStatus.FINISHED_ERROR])
def test_a_request_that_did_not_complete_missed_its_slo_in_both(status: RequestStatus) -> None:
    request = finished(SLO, TIMES[:1], status)
    assert not slo_met(request)
    assert simulated_attainment(request) == 0.0
