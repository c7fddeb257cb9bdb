"""The plug-in's step log (vLLM's real scheduler class, no model) and the simulator priced by it:
what the benchmark predicts `vllm serve` runs with."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from sluice.contract.profile import BatchShape, StepSample
from sluice_bench.vllm_plugin_harness import TINY_MODEL, build_scheduler, make_request, step
from sluice_bench.vllm_plugin_predict import (
    SentRequest,
    at_speed,
    busy_samples,
    fit_profile,
    model_spec,
    predict_jct,
    read_steps,
    speed_level,
)
from sluice_vllm.scheduler import SluiceScheduler


def test_step_log_records_each_step_as_vllm_scheduled_it(tmp_path: Path) -> None:
    log = tmp_path / "steps.jsonl"
    s = build_scheduler(
        SluiceScheduler, env={"SLUICE_VLLM_STEP_LOG": str(log)}, max_num_batched_tokens=64, num_blocks=64
    )
    s.add_request(make_request("a", 100, 3))
    s.add_request(make_request("b", 40, 2, arrival=1.0))
    while s.requests:
        step(s, model_s=0.005)
    time.sleep(0.2)  # idle: the gap to the next request is no step's cost
    s.add_request(make_request("c", 16, 2, arrival=2.0))
    while s.requests:
        step(s, model_s=0.005)
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    # chunked prefill under the 64-token budget, then decodes at their contexts
    assert (lines[0]["p"], lines[0]["d"]) == ([[64, 0]], [])
    assert (lines[1]["p"], lines[1]["d"]) == ([[36, 64], [28, 0]], [])
    assert (lines[2]["p"], lines[2]["d"]) == ([[12, 28]], [100])
    assert lines[3]["d"] == [101, 40]
    assert [x["left"] for x in lines[:4]] == [2, 2, 2, 0]  # both answered at step 4
    ends = [i for i, x in enumerate(lines) if x["left"] == 0]
    assert len(ends) == 2 and ends[1] == len(lines) - 1  # each burst of work ends with none left

    steps = read_steps(log)
    assert steps[2].shape.prefill_chunks == [(12, 28)] and steps[2].shape.num_decodes == 1
    samples = busy_samples(steps, steps[0].t, steps[-1].t)
    assert len(samples) == len(steps) - 2  # neither last step before an idle gap is priced
    assert all(0.005 <= x.time_s < 0.2 for x in samples)


def synthetic_profile(base_s: float, per_token_s: float) -> list[StepSample]:
    samples = []
    for seqs in (1, 2, 3, 4):
        for prefill in (0, 32, 128, 256):
            shape = BatchShape(prefill_chunks=[(prefill, 0)] if prefill else [])
            for _ in range(seqs):
                shape.add_decode(100)
            samples.append(StepSample(shape, base_s + per_token_s * shape.num_tokens))
    return samples


def test_simulator_priced_by_the_engine_steps_predicts_queueing_at_the_seat_limit() -> None:
    cost_model = fit_profile(synthetic_profile(0.01, 1e-5), model_spec(Path(TINY_MODEL), 2048), 32)
    assert cost_model.fit_report().mape < 0.05

    def jct(requests: list[SentRequest], policy: str = "fcfs") -> dict[str, float]:
        return predict_jct(
            policy,
            requests,
            cost_model,
            num_blocks=4096,
            block_size=32,
            max_num_seqs=4,
            max_num_batched_tokens=1024,
            max_model_len=2048,
        )

    alone = jct([SentRequest("x", 0.0, 64, 20, 0)])["x"]
    assert 20 * 0.01 <= alone <= 22 * 0.0102  # one step per token at the profile's price
    # eight at once on four seats: the second four wait for the first
    burst = jct([SentRequest(f"r{i}", 0.0, 64, 20, 0) for i in range(8)])
    first, second = sorted(burst.values())[:4], sorted(burst.values())[4:]
    assert max(first) < 0.3 and min(second) > 1.8 * max(first) * 0.9
    # shortest predicted first: the ALISE plug-in admits the short answers before a long one that
    # came first (s0 arrives first and runs at once; the others arrive during its first step)
    order = (("s0", 10), ("long", 200), ("s1", 10), ("s2", 10), ("s3", 10), ("s4", 10))
    mixed = [SentRequest(rid, i * 1e-4, 64, n, 0) for i, (rid, n) in enumerate(order)]
    alise, fcfs = jct(mixed, "alise"), jct(mixed, "fcfs")
    assert alise["s3"] < fcfs["s3"] and alise["long"] > fcfs["long"]


def test_a_round_slower_than_the_burst_is_priced_at_its_own_speed() -> None:
    """The profile's shape from the burst, its level from a later round's steps: a round whose
    engine ran 1.5x slower (a shared machine's drift) is priced 1.5x, its JCTs with it."""
    spec = model_spec(Path(TINY_MODEL), 2048)
    burst = fit_profile(synthetic_profile(0.01, 1e-5), spec, 32)
    later = synthetic_profile(0.015, 1.5e-5)[::3]  # the same shapes' steps, 1.5x as long, fewer of them
    level = speed_level(burst, later)
    assert level == pytest.approx(1.5, rel=0.03)
    slower = at_speed(burst, level)
    shape = later[0].shape
    assert slower.iteration_time(shape) == pytest.approx(1.5 * burst.iteration_time(shape), rel=1e-9)
    assert burst.iteration_time(shape) == pytest.approx(later[0].time_s / 1.5, rel=0.05), "the burst's model unchanged"
    one = [SentRequest("x", 0.0, 64, 20, 0)]
    shape_args = {"num_blocks": 4096, "block_size": 32, "max_num_seqs": 4, "max_num_batched_tokens": 1024}
    fast = predict_jct("fcfs", one, burst, max_model_len=2048, **shape_args)["x"]
    slow = predict_jct("fcfs", one, slower, max_model_len=2048, **shape_args)["x"]
    assert slow == pytest.approx(1.5 * fast, rel=0.05)


def test_step_log_keeps_each_step_when_the_async_scheduler_runs_ahead(tmp_path: Path) -> None:
    """vLLM's async scheduler plans step N+1 before step N's output is back: each line is still
    its own step's shape, in order."""
    from vllm.v1.outputs import ModelRunnerOutput

    from sluice_vllm.scheduler import SluiceAsyncScheduler

    log = tmp_path / "steps.jsonl"
    s = build_scheduler(SluiceAsyncScheduler, env={"SLUICE_VLLM_STEP_LOG": str(log)}, max_num_batched_tokens=64)
    s.add_request(make_request("a", 100, 4))
    steps = []
    for _ in range(2):  # 64 prompt tokens, then the other 36, before either output is back
        out = s.schedule()
        done = [s.requests[r].num_computed_tokens >= s.requests[r].num_prompt_tokens for r in out.num_scheduled_tokens]
        steps.append((out, done))
    for out, done in steps:
        ids = list(out.num_scheduled_tokens)
        sampled = [[5] if d else [] for d in done]
        index = {r: i for i, r in enumerate(ids)}
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index=index, sampled_token_ids=sampled)
        s.update_from_output(out, mro)
    s.shutdown()
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["p"] for x in lines[:2]] == [[[64, 0]], [[36, 64]]]
