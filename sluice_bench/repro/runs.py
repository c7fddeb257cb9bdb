"""One run of a claim's system at a rate and seed (steady-state metrics and the mechanisms'
counters), a claim's sweep over systems x rates x seeds, and its capacity by bisection."""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from tqdm import tqdm

from scheduler_service.cluster.length_sources import LearningLengths, LengthSource
from scheduler_service.core.metrics import MetricsRecorder
from scheduler_service.core.request import Request
from scheduler_service.core.slo import SLOClass, SLOSpec
from scheduler_service.costmodel.base import CostModel
from scheduler_service.costmodel.factory import build_cost_model
from scheduler_service.sim.simulator import PAPER_SETTING, SimConfig, Simulation
from scheduler_service.sim.slo_profiles import apply_slo_profile, econoserve_latencies
from scheduler_service.workloads import Workload, apply_arrivals, load_trace
from scheduler_service.workloads.base import TraceRequest
from scheduler_service.workloads.synthetic import SYNTHETIC_WORKLOADS
from services.predictor_lengths import (
    is_online_source,
    is_predictor_source,
    online_predictor_lengths,
    predictor_lengths,
)
from sluice.common.tokenizer import demo_tokenizer_path
from sluice_bench.options import SERIAL, Parallelism
from sluice_bench.repro.claims import Claim, System, _scls
from sluice_bench.sweep import run_tasks


# ---------------------------------------------------------------- one run
class _Recorded(Simulation):
    """A simulation that keeps its Request objects, for steady-state metrics."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.made: list[Request] = []
        self.swap_s = 0.0  # seconds steps spent on KV swaps (copies, per-block costs, stalls)
        for executor in self.executors.values():
            execute = executor.execute

            def counted(plan: Any, execute: Callable[[Any], Any] = execute) -> Any:
                result = execute(plan)
                self.swap_s += result.swap_s
                return result

            executor.execute = counted  # type: ignore[method-assign]

    def _make_request(self, tr: TraceRequest) -> Request:
        req = super()._make_request(tr)
        self.made.append(req)
        return req


# policy counters (the simulator's `policy_stats`) copied into a run's row where a policy keeps them
MISPREDICTION_COUNTERS = ("regrouped", "mispredicted_kept", "reserve_blocks_used", "requests_under_provisioned")


@dataclass(frozen=True)
class Setup:
    duration_s: float
    warmup: float
    min_requests: int


def _with_offline(wl: Workload, share: float, cm: CostModel, seed: int) -> Workload:
    """AccelGen: `share` of the requests carry a JCT SLO of 2 x (t_p + t_g x l_g) instead."""
    if share <= 0:
        return wl
    t_p, t_g = econoserve_latencies(wl, cm)
    pick = np.random.default_rng(seed + 17).random(len(wl)) < share
    slos = [
        SLOSpec(jct_s=2.0 * (t_p + t_g * r.output_tokens), slo_class=SLOClass.OFFLINE) if off else r.slo
        for r, off in zip(wl.requests, pick, strict=True)
    ]
    return wl.with_slos(slos, f"offline share {share:g}")


# the predictor's own held-out split (ShareGPT first turns, with text): a trace on which the real
# predictor, and the online one that learns from it, never saw a prompt in training
HELD_OUT = "sharegpt-held-out"


@functools.lru_cache(maxsize=4)
def _whole_file(trace: str, predictor_tokens: bool) -> Workload:
    if trace == HELD_OUT:
        return _held_out()
    tokenizer = demo_tokenizer_path() if predictor_tokens else None
    return load_trace(trace, tokenizer_path=tokenizer)


def _held_out() -> Workload:
    """Every first turn of the predictor's ShareGPT test split, its prompt counted in the
    predictor's tokens (the unit of its predictions) and its true answer length as the output."""
    from predictor_service.data import load_samples
    from predictor_service.evaluate import select
    from scheduler_service.workloads.tokens import make_token_counter
    from sluice.common.paths import data_file

    samples = select(load_samples(data_file("prompts/sharegpt_v3_conversations.jsonl.gz")), "test", True, None)
    count = make_token_counter(demo_tokenizer_path())
    reqs = [
        TraceRequest(
            f"h{i}", None, max(1, count(s.prompt)), max(1, s.output_tokens), prompt_text=s.prompt, source="sharegpt"
        )
        for i, s in enumerate(samples)
    ]
    return Workload(HELD_OUT, reqs, {"split": "the predictor's test split, ShareGPT first turns"})


def sample_trace(trace: str, n: int, seed: int, predictor_tokens: bool = False) -> Workload:
    """`n` requests of `trace` whose lengths depend on `seed` for every trace format: a
    generator draws them with the seed; a file (CSV, JSON, JSONL) is read whole and `n` of its
    requests are drawn with the seed (without replacement while the file has enough)."""
    if trace in SYNTHETIC_WORKLOADS:
        return load_trace(trace, num_requests=n, seed=seed)
    whole = _whole_file(trace, predictor_tokens)
    rng = np.random.default_rng(seed)
    idx = rng.choice(len(whole), size=n, replace=n > len(whole))
    picked = [whole.requests[int(i)] for i in idx]
    reqs = [replace(r, request_id=f"{r.request_id}#{k}") for k, r in enumerate(picked)]
    return Workload(whole.name, reqs, {**whole.metadata, "sample": f"{n} drawn with seed {seed}"})


def truncate(wl: Workload, max_input: int | None, max_output: int | None) -> Workload:
    """The paper's length limits: a longer prompt is cut to `max_input` tokens, a longer answer
    ends at `max_output` (SCLS: both 1,024)."""
    if max_input is None and max_output is None:
        return wl
    cut_in, cut_out = max_input or math.inf, max_output or math.inf
    reqs = [
        replace(
            r,
            prompt_tokens=int(min(r.prompt_tokens, cut_in)),
            output_tokens=int(min(r.output_tokens, cut_out)),
            prompt_token_ids=None if r.prompt_tokens > cut_in else r.prompt_token_ids,
        )
        for r in wl.requests
    ]
    return Workload(wl.name, reqs, {**wl.metadata, "limits": {"max_input": max_input, "max_output": max_output}})


def workload(claim: Claim, cm: CostModel, rate: float, seed: int, setup: Setup) -> Workload:
    n = max(setup.min_requests, math.ceil(rate * setup.duration_s))
    base = truncate(sample_trace(claim.trace, n, seed, claim.predictor_tokens), claim.max_input, claim.max_output)
    wl = apply_arrivals(base, "poisson", rate=rate, seed=seed)
    if claim.slo_profile:
        wl = apply_slo_profile(claim.slo_profile, wl, cm, seed)
    return _with_offline(wl, claim.offline_share, cm, seed)


def steady_metrics(sim: _Recorded, warmup_s: float) -> dict[str, Any]:
    """The run's metrics over the requests that arrived after the warm-up."""
    rec = MetricsRecorder()
    # the measured window in two halves by arrival: a latency that still grows from the first
    # half to the second is a transient (an overloaded queue), not a steady state
    span = max((r.arrival_time for r in sim.made), default=0.0)
    mid = (warmup_s + span) / 2
    halves = (MetricsRecorder(), MetricsRecorder())
    for req in sim.made:
        if req.arrival_time < warmup_s:
            continue
        end = req.token_times[-1] if len(req.token_times) else req.arrival_time
        for r in (rec, halves[req.arrival_time >= mid]):
            r.on_admitted(req)
            r.on_finish(req, end)
    m = rec.summary()
    d = rec.details()
    early, late = (h.summary()["normalized_latency_s"] for h in halves)
    return {
        "norm_latency_early_s": early,
        "norm_latency_late_s": late,
        "num_measured": m["num_requests"],
        "num_finished": m["num_finished"],
        "num_good": rec.req_met,  # requests that met their SLO (goodput's count)
        "num_judged": rec.req_judged,
        "throughput_req_s": m["throughput_req_s"],
        "throughput_tok_s": m["throughput_tok_s"],
        "goodput_req_s": m["goodput_req_s"],
        "slo_attainment_iter": m["slo_attainment_iter"],
        "slo_attainment_req": m["slo_attainment_req"],
        "normalized_latency_s": m["normalized_latency_s"],
        "tbt_s": m["tbt_s"],
        "tbt_p99_s": m["tbt_s"]["p99"],
        "ttft_p50_s": m["ttft_s"]["p50"],
        "jct_mean_s": m["jct_s"]["mean"],
        "jct_p95_s": float(np.percentile(rec.jct, 95)) if len(rec.jct) else None,
        "queue_p50_s": d["queue_time_s"]["p50"] or 0.0,
    }


def run_one(claim: Claim, system: System, rate: float, seed: int, setup: Setup) -> dict[str, Any]:
    cm = build_cost_model("analytic", claim.model, claim.hardware)
    wl = workload(claim, cm, rate, seed, setup)
    max_model_len = claim.max_model_len
    if claim.context_is_kv:
        # NOTE: so that one request always fits alone; longer prompts are rejected for every system alike
        assert claim.kv_gb is not None
        max_model_len = cm.num_kv_blocks(claim.block_size, 0.9, claim.kv_gb) * claim.block_size
    # the predictor runs before the simulation (once per prompt set: cached on disk) and its
    # answers go in as a table; the builtin sources are built by the simulator from their name
    table: LengthSource | None = None
    if is_predictor_source(system.length_source):
        table = predictor_lengths(system.length_source, wl, seed, progress=False)
    elif is_online_source(system.length_source):
        table = online_predictor_lengths(system.length_source, wl, progress=False)
    kv_gb = claim.kv_gb
    if system.int8_kv:
        # NOTE: the same bytes at one byte per value: twice fp16's tokens (the claim fixes the bytes)
        kv_gb = 2.0 * (kv_gb if kv_gb is not None else full_kv_gb(cm))
    cfg = SimConfig(
        policy=system.policy,
        router=system.router,
        num_workers=claim.workers,
        kv_gb=kv_gb,
        block_size=claim.block_size,
        max_model_len=max_model_len,
        max_tokens=claim.max_tokens,
        length_source=system.length_source if table is None else "oracle",  # unused when a table is given
        seed=seed,
    )
    cfg = replace(cfg, **{**PAPER_SETTING, **claim.common, **system.extra})
    sim = _Recorded(cfg, wl, cm, table)
    full = sim.run()
    span = max((r.arrival_time for r in sim.made), default=0.0)
    row: dict[str, Any] = {
        "system": system.label,
        "rate": rate,
        "seed": seed,
        "num_requests": len(wl),
        "lengths": full.config["length_source"],
    }
    row.update(steady_metrics(sim, setup.warmup * span))
    if isinstance(table, LearningLengths):
        row["history_learned"] = table.predictor.num_observed  # finished requests the predictor's history took in
    fm = full.metrics
    row.update(
        kv_util_mean=fm["kv_util_mean"],
        kv_used_mean=fm["kv_used_mean"],
        compute_util_mean=fm["compute_util_mean"],
        preemptions=fm["preemptions"],
        swap_bytes=full.details["swap_bytes"],
        busy_s=sum(full.details["busy_s_per_worker"].values()),
        swap_s=sim.swap_s,
    )
    row["num_steps"] = full.details["num_steps"]
    # what each paper mechanism did: the policies' counters summed over workers, and the router's
    row["counters"] = sum_counters(full.details["policy_stats"].values())
    row["router_counters"] = sum_counters([full.details["router_stats"]])
    if "requests_logged" in row["counters"]:  # EconoServe's report: its counters at the top level, as before
        for key in MISPREDICTION_COUNTERS:
            row[key] = row["counters"].get(key, 0)
    return row


def full_kv_gb(cm: CostModel) -> float:
    """The KV a GPU holds when no size is given (memory minus weights), in GiB."""
    return cm.num_kv_blocks(16) * 16 * cm.model.kv_bytes_per_token_per_gpu / 2**30


def sum_counters(reports: Any) -> dict[str, float]:
    """Numeric counters summed over reports (one per worker); nested or text entries are left out."""
    out: dict[str, float] = {}
    for report in reports:
        for key, value in report.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                out[key] = out.get(key, 0) + value
    return out


# ---------------------------------------------------------------- a claim
def _mean(rows: list[dict[str, Any]], key: str) -> float:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return float(np.mean(vals)) if vals else math.nan


def _band(rows: list[dict[str, Any]], key: str) -> tuple[float, float, float]:
    vals = [float(r[key]) for r in rows if r.get(key) is not None]
    if not vals:
        return math.nan, math.nan, math.nan
    return float(np.mean(vals)), float(min(vals)), float(max(vals))


def idle_bound(claim: Claim, setup: Setup, seeds: list[int]) -> float | None:
    """The rule's bound: Sarathi's TBT SLO (the profile's median), or a factor x the
    baseline's normalized latency at a near-idle rate."""
    rule = claim.rule
    if rule is None or rule.name == "attainment":
        return None
    cm = build_cost_model("analytic", claim.model, claim.hardware)
    if rule.name == "sarathi":
        wl = workload(claim, cm, claim.rates[0], seeds[0], setup)
        return float(np.median([r.slo.tbt_s for r in wl.requests if r.slo.tbt_s is not None]))
    base = next(s for s in claim.systems if s.label == claim.baseline)
    idle = run_one(claim, base, 0.05 * claim.rates[0], seeds[0], replace(setup, min_requests=40))
    return float(rule.threshold or 1.0) * idle["normalized_latency_s"]


def capacity(
    claim: Claim,
    system: System,
    rows: list[dict[str, Any]],
    bound: float | None,
    setup: Setup,
    seeds: list[int],
    refine: int,
    bar: tqdm,
    parallelism: Parallelism = SERIAL,
) -> dict[str, Any]:
    """Largest rate whose seeds' mean meets the rule; bisection between it and the next swept rate
    (each probe's seeds run side by side under `parallelism`)."""
    rule = claim.rule
    assert rule is not None

    def holds_at(rate_rows: list[dict[str, Any]]) -> bool:
        # NOTE: the mean over seeds of each quantity the rule reads
        m = {
            "num_finished": _mean(rate_rows, "num_finished"),
            "tbt_s": {"p99": _mean(rate_rows, "tbt_p99_s")},
            "queue_p50_s": _mean(rate_rows, "queue_p50_s"),
            "normalized_latency_s": _mean(rate_rows, "normalized_latency_s"),
            "slo_attainment_req": _mean(rate_rows, "slo_attainment_req"),
        }
        return rule.holds(m, bound)

    by_rate = {r: [x for x in rows if x["rate"] == r] for r in claim.rates}
    ok = [r for r in claim.rates if by_rate[r] and holds_at(by_rate[r])]
    if not ok or not holds_at(by_rate[claim.rates[0]]):
        return {"capacity": None, "below_floor": True, "floor": claim.rates[0], "probes": []}
    lo = max(ok)
    above = [r for r in claim.rates if r > lo]
    probes: list[tuple[float, bool]] = []
    hi = min(above) if above else None
    for _ in range(refine if hi is not None else 0):
        assert hi is not None
        mid = (lo + hi) / 2
        mid_rows = run_tasks(run_one, [(claim, system, mid, s, setup) for s in seeds], parallelism, progress=False)
        bar.update(1)
        rows.extend(mid_rows)
        held = holds_at(mid_rows)
        probes.append((mid, held))
        lo, hi = (mid, hi) if held else (lo, mid)
    return {"capacity": lo, "below_floor": False, "floor": claim.rates[0], "beyond_sweep": hi is None, "probes": probes}


def run_claim(
    claim: Claim, setup: Setup, seeds: list[int], refine: int, quick: bool, parallelism: Parallelism = SERIAL
) -> dict[str, Any]:
    """Every system x rate x seed of `claim` (independent runs: side by side under `parallelism`,
    rows in the serial order), then each system's capacity where the claim has a rule."""
    rates = (claim.quick_rate or claim.rates[0],) if quick else claim.rates
    if claim.duration_s is not None and not quick:
        setup = replace(setup, duration_s=claim.duration_s)
    claim = replace(claim, rates=rates)
    jobs = [(s, r, seed) for s in claim.systems for r in rates for seed in seeds]
    bound = idle_bound(claim, setup, seeds) if not quick else None
    with tqdm(total=len(jobs), desc=f"{claim.name}", unit="run") as bar:
        rows: list[dict[str, Any]] = run_tasks(run_one, [(claim, *job, setup) for job in jobs], parallelism, bar=bar)
        caps = {}
        if claim.rule is not None and not quick:
            for system in claim.systems:
                mine = [r for r in rows if r["system"] == system.label]
                caps[system.label] = capacity(claim, system, mine, bound, setup, seeds, refine, bar, parallelism)
                rows = [r for r in rows if r["system"] != system.label] + mine
    return {
        "claim": claim.name,
        "title": claim.title,
        "paper_says": claim.paper_says,
        "setup": {
            "model": claim.model,
            "hardware": claim.hardware,
            "trace": claim.trace,
            "kv_gb": claim.kv_gb,
            "block_size": claim.block_size,
            "workers": claim.workers,
            "slo_profile": claim.slo_profile,
            "offline_share": claim.offline_share,
            "duration_s": setup.duration_s,
            "max_input": claim.max_input,
            "max_output": claim.max_output,
            "common": claim.common,
            "warmup_share": setup.warmup,
            "seeds": seeds,
            "rates": list(rates),
        },
        "systems": [
            {
                "label": s.label,
                "policy": s.policy,
                "router": s.router,
                "length_source": s.length_source,
                "extra": s.extra,
                "ours": s.ours,
                "int8_kv": s.int8_kv,
            }
            for s in claim.systems
        ],
        "baseline": claim.baseline,
        "paper_ratio": claim.paper_ratio,
        "comparisons": [
            {"kind": c.kind, "system": c.system, "baseline": c.baseline, "note": c.note} for c in claim.comparisons
        ],
        "counters": list(claim.counters),
        "metrics": list(claim.metrics),
        "rule": None
        if claim.rule is None or (bound is None and claim.rule.name != "attainment")
        else claim.rule.describe(bound),
        "capacity": caps,
        "rows": rows,
    }


def scls_cause(rate: float = 4.0, seed: int = 0) -> list[dict[str, Any]]:
    """Where SCLS's GPU time goes against FastGen's, on one seed of the SCLS claim: tokens
    prefilled (every slice re-prefills prompt + generated), pad and invalid tokens, busy time,
    for the same output; FastGen capped at 16 and at 4 sequences."""
    claim = _scls()[0]
    cm = build_cost_model("analytic", claim.model, claim.hardware)
    wl = workload(claim, cm, rate, seed, Setup(claim.duration_s or 150.0, 0.2, 200))
    out = []
    for label, policy, router in (
        ("scls", "scls", "scls"),
        ("fastgen", "fastgen:max_seqs=16", "round_robin"),
        ("fastgen-cap4", "fastgen:max_seqs=4", "round_robin"),
    ):
        cfg = SimConfig(
            policy=policy,
            router=router,
            num_workers=claim.workers,
            kv_gb=claim.kv_gb,
            block_size=claim.block_size,
            max_model_len=claim.max_model_len,
            seed=seed,
            **PAPER_SETTING,
        )
        run = Simulation(cfg, wl, cm).run()
        d = run.details
        row = {
            "system": label,
            "throughput_req_s": run.metrics["throughput_req_s"],
            "output_tokens": d["output_tokens"],
            "prefill_tokens": d["prefill_tokens"],
            "pad_tokens": d["pad_tokens"],
            "invalid_tokens": d["invalid_tokens"],
            "busy_s": sum(d["busy_s_per_worker"].values()),
        }
        print(json.dumps(row), flush=True)
        out.append(row)
    return out
