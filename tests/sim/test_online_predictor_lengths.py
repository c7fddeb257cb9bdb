"""The simulator's `predictor-online` length source: the real predictor predicts each request
when it is submitted, and its history learns every request that finished on its own, as the
live service's predictor does (ALISE's Algorithm 1, line 12)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from predictor_service.trace_lengths import OnlineTracePredictor
from scheduler_service.cluster.length_sources import LearningLengths
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.costmodel.factory import build_cost_model
from scheduler_service.sim.simulator import SimConfig, Simulation
from scheduler_service.workloads import Workload, apply_arrivals, load_trace
from services.predictor_lengths import trace_prompts
from sluice.common.tokenizer import demo_tokenizer_path


class _Recording(LearningLengths):
    def __init__(self, workload: Workload) -> None:
        super().__init__(OnlineTracePredictor(None, trace_prompts(workload), progress=False))
        self.predicted: dict[str, int] = {}
        self.ended: list[RequestStatus] = []

    def predict(self, request: Request) -> int | None:
        self.predicted[request.request_id] = p = super().predict(request)  # type: ignore[assignment]
        return p

    def observe(self, request: Request) -> None:
        self.ended.append(request.status)
        super().observe(request)


def _twice(n: int) -> Workload:
    """n ShareGPT first turns, then the same n prompts again long after the first ones ended."""
    base = load_trace("sharegpt-conversations-2k", num_requests=n, tokenizer_path=demo_tokenizer_path())
    first = apply_arrivals(base, "poisson", rate=2.0, seed=0).requests
    again = [replace(r, request_id=f"{r.request_id}-again", arrival_s=(r.arrival_s or 0.0) + 900.0) for r in first]
    return Workload("twice", first + again)


def test_history_learns_finished_requests_and_repeats_are_predicted_from_them() -> None:
    wl = _twice(30)
    source = _Recording(wl)
    history = source.predictor.length_predictor.history
    seed_entries = len(history)
    cm = build_cost_model("analytic", "opt-13b", "a100-80g")
    Simulation(SimConfig(policy="vllm", kv_gb=8, block_size=32), wl, cm, source).run()
    # every request that stopped on its own was learned; one cut at max_tokens was not
    stopped = source.ended.count(RequestStatus.FINISHED_STOPPED)
    assert stopped > 0 and source.predictor.num_observed == stopped
    assert len(history) == seed_entries + stopped
    # a prompt asked again after its answer was learned is predicted from it (an exact neighbour)
    true = {r.request_id: r.output_tokens for r in wl.requests}
    first = [r.request_id for r in wl.requests[:30]]
    err_first = np.mean([abs(source.predicted[rid] - true[rid]) for rid in first])
    err_again = np.mean([abs(source.predicted[f"{rid}-again"] - true[rid]) for rid in first])
    assert err_again < 0.5 * err_first
