"""Sluice's simulator predicting runs of `vllm serve` with the plug-in.

The served engine's own steps (the plug-in's step log, `SLUICE_VLLM_STEP_LOG`) become a worker
profile: each busy step's shape and the time until the engine's next step, so a step is priced
with everything the engine spends on it (forward, sampling, scheduling, output handling). The
simulator, given that profile, the same requests at the times the client sent them and the
Sluice policy the plug-in runs, predicts each request's completion time.
"""

from __future__ import annotations

import copy
import itertools
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from scheduler_service.cluster.deployment import SYNCHRONOUS_UNBOUNDED
from scheduler_service.costmodel.fitted import FittedCostModel
from scheduler_service.sim.simulator import SimConfig, Simulation
from scheduler_service.workloads import TraceRequest, Workload
from sluice.contract.profile import BatchShape, ModelSpec, StepSample, WorkerProfile

# The Sluice policy each plug-in policy decides with (vLLM V1's loop is chunked prefill with
# decodes first and per-chunk KV allocation; the plug-in cannot price chunks in time).
SIM_POLICY = {
    "vllm": "vllm_chunked:allocate_whole_prompt=false",
    "fcfs": "vllm_chunked:allocate_whole_prompt=false",
    "priority": "vllm_chunked:allocate_whole_prompt=false,priority=true",
    "sarathi:budget=128": "sarathi:budget=128,allocate_whole_prompt=false,price_in_time=false",
    "alise": "alise:hybrid=true",
    "fastserve": "fastserve",
    "accelgen": "accelgen",
}


@dataclass(frozen=True)
class Step:
    t: float
    shape: BatchShape
    left: int


def read_steps(path: Path) -> list[Step]:
    steps = []
    for line in path.read_text().splitlines():
        d = json.loads(line)
        shape = BatchShape(prefill_chunks=[(int(n), int(c)) for n, c in d["p"]])
        for context in d["d"]:
            shape.add_decode(int(context))
        steps.append(Step(float(d["t"]), shape, int(d["left"])))
    return steps


def busy_samples(steps: Sequence[Step], start: float, end: float) -> list[StepSample]:
    """(shape, time to the next step) of every step in [start, end] the engine went straight on
    from (requests left after it); an idle gap is no step's cost."""
    samples = []
    for a, b in itertools.pairwise(steps):
        if start <= a.t <= end and a.left > 0:
            samples.append(StepSample(a.shape, b.t - a.t))
    return samples


def model_spec(config_dir: Path, max_model_len: int) -> ModelSpec:
    c = json.loads((config_dir / "config.json").read_text())
    return ModelSpec(
        name=config_dir.name,
        num_layers=c["num_hidden_layers"],
        hidden_size=c["hidden_size"],
        num_heads=c["num_attention_heads"],
        num_kv_heads=c.get("num_key_value_heads", c["num_attention_heads"]),
        intermediate_size=c["intermediate_size"],
        vocab_size=c["vocab_size"],
        max_model_len=max_model_len,
        dtype_bytes=2 if c.get("torch_dtype") in ("bfloat16", "float16") else 4,
    )


def fit_profile(samples: list[StepSample], model: ModelSpec, block_size: int) -> FittedCostModel:
    created = datetime.now(UTC).isoformat(timespec="seconds")
    profile = WorkerProfile(model, "cpu", "bfloat16", block_size, created, steps=samples)
    return FittedCostModel(profile)


def speed_level(cost_model: FittedCostModel, samples: Sequence[StepSample]) -> float:
    """The median of measured over priced step time on `samples`: how much slower (> 1) or
    faster the engine ran then than when `cost_model`'s steps were measured."""
    ratios = [s.time_s / t for s in samples if (t := cost_model.iteration_time(s.shape)) > 0]
    if not ratios:
        raise ValueError("no busy step to measure the engine's speed on")
    return statistics.median(ratios)


def at_speed(cost_model: FittedCostModel, level: float) -> FittedCostModel:
    """`cost_model` with every step `level` times as long (the shape of its prices kept: a
    shared machine's drift slows every step alike, and a round's own steps are too few and too
    alike to fit the shape on)."""
    scaled = copy.copy(cost_model)
    scaled.coef = tuple(c * level for c in cost_model.coef)
    return scaled


@dataclass(frozen=True)
class SentRequest:
    rid: str
    sent_s: float  # client clock (monotonic, the engine's clock too)
    prompt_tokens: int
    output_tokens: int
    priority: int


def predict_jct(
    policy: str,
    requests: Sequence[SentRequest],
    cost_model: FittedCostModel,
    *,
    num_blocks: int,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
) -> dict[str, float]:
    """Request id -> simulated completion time (last token minus arrival), the plug-in policy
    `policy` decided by its Sluice counterpart on one worker priced by `cost_model`."""
    t0 = min(r.sent_s for r in requests)
    trace = [
        TraceRequest(r.rid, r.sent_s - t0, r.prompt_tokens, r.output_tokens, priority=r.priority) for r in requests
    ]
    bytes_per_block = cost_model.model.kv_bytes_per_token_per_gpu * block_size
    config = SimConfig(
        **SYNCHRONOUS_UNBOUNDED,  # vLLM on CPU: steps one after another, no waiting bound
        policy=SIM_POLICY[policy],
        block_size=block_size,
        kv_gb=num_blocks * bytes_per_block / 2**30,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        swap_space_gib=0.0,
        length_source="oracle",  # every request carries its true length as its hint
    )
    sim = Simulation(config, Workload("vllm-plugin", trace), cost_model)
    jct: dict[str, float] = {}
    record_finish = sim.metrics.on_finish

    def on_finish(request, now):  # type: ignore[no-untyped-def]
        if request.token_times:
            jct[request.request_id] = request.token_times[-1] - request.arrival_time
        record_finish(request, now)

    # NOTE: an observer on the recorder the schedulers hold: the simulator keeps aggregates only
    sim.metrics.on_finish = on_finish  # type: ignore[method-assign]
    sim.run()
    return jct


def median_error(measured: dict[str, float], simulated: dict[str, float]) -> tuple[float, float, float]:
    """(measured median JCT, simulated median JCT, their relative difference)."""
    ids = sorted(set(measured) & set(simulated))
    live = statistics.median(measured[i] for i in ids)
    sim = statistics.median(simulated[i] for i in ids)
    return live, sim, abs(sim - live) / live
