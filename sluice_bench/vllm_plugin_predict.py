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
from scheduler_service.core.slo import SLOSpec
from scheduler_service.costmodel.fitted import FittedCostModel
from scheduler_service.sim.simulator import SimConfig, Simulation
from scheduler_service.workloads import TraceRequest, Workload
from sluice.contract.profile import BatchShape, ModelSpec, StepSample, WorkerProfile
from sluice_bench.vllm_plugin_emulation import emulating


def sim_policy(plugin_policy: str) -> str:
    """The simulator's policy for a `SLUICE_VLLM_POLICY` (or "vllm", vLLM's own scheduler): vLLM's
    loop with that plug-in policy's decisions (sluice_bench/vllm_plugin_emulation.py)."""
    name, _, rest = plugin_policy.partition(":")
    if name == "vllm":
        return "vllm_plugin:plugin=fcfs"
    options = [f"plugin_{item}" for item in rest.split(",") if item]
    return ",".join([f"vllm_plugin:plugin={name}", *options])


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
    slo: SLOSpec | None = None  # the SLO hints it carried (vllm_xargs)


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
    """Request id -> simulated completion time (last token minus arrival) of the requests run
    through vLLM's loop with the plug-in policy `policy` (or vLLM's own, "vllm") on one worker
    priced by `cost_model`."""
    t0 = min(r.sent_s for r in requests)
    trace = [
        TraceRequest(r.rid, r.sent_s - t0, r.prompt_tokens, r.output_tokens, slo=r.slo, priority=r.priority)
        for r in requests
    ]
    bytes_per_block = cost_model.model.kv_bytes_per_token_per_gpu * block_size
    config = SimConfig(
        **SYNCHRONOUS_UNBOUNDED,  # vLLM on CPU: steps one after another, no waiting bound
        policy=sim_policy(policy),
        block_size=block_size,
        kv_gb=num_blocks * bytes_per_block / 2**30,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        swap_space_gib=0.0,
        length_source="oracle",  # every request carries its true length as its hint
    )
    with emulating():
        sim = Simulation(config, Workload("vllm-plugin", trace), cost_model)
    jct: dict[str, float] = {}
    record_finish = sim.metrics.on_finish

    def on_finish(request, now):  # type: ignore[no-untyped-def]
        if request.token_times:
            jct[request.request_id] = request.token_times[-1] - request.arrival_time
        record_finish(request, now)

    # NOTE: an observer on the recorder the schedulers hold: the simulator keeps aggregates only
    sim.metrics.on_finish = on_finish  # type: ignore[method-assign]
    with emulating():
        sim.run()
    return jct


def median_error(measured: dict[str, float], simulated: dict[str, float]) -> tuple[float, float, float]:
    """(measured median JCT, simulated median JCT, their relative difference)."""
    ids = sorted(set(measured) & set(simulated))
    live = statistics.median(measured[i] for i in ids)
    sim = statistics.median(simulated[i] for i in ids)
    return live, sim, abs(sim - live) / live
