"""One command per paper: its headline comparison, run the way a reviewer would accept.

    python benchmarks/repro.py PAPER [--quick] [--seeds 3] [--duration 300] [--out docs/results/data/repro]
                                     [--length-source predictor[:DIR]]
    python benchmarks/repro.py econoserve --regroup 0.25,0.5,1,2     # the regroup factor, measured

PAPER is sarathi, accelgen, econoserve, scls or alise. For each claim of the paper:
- every system gets the same model, GPU, KV cache size, block size and precision (the only
  per-system settings are the ones the paper's system itself has, listed in `System.extra`);
- arrival rates are swept (Poisson), each run a fixed simulated duration of arrivals
  (`--duration`), whose first `--warmup` share is excluded from the latency, SLO and
  throughput numbers (steady state: the measured requests arrive into a loaded system);
- several seeds (`--seeds`, each a different sample of the trace and of the arrivals), shown
  as the mean and the min-max band;
- capacity, where the paper claims one, is the largest swept rate whose seeds' mean meets
  the paper's rule, refined by bisection between it and the next rate (`--refine` probes);
  a system that misses the rule at the lowest swept rate is reported as "< floor" (the
  floor is that rate), never searched below it;
- systems marked "ours" carry an extra that the paper does not have; they are reported
  beside the paper-faithful one, never in its place.
Writes `<out>/<paper>.json` (every run) and `<out>/<paper>_<claim>.png` (one plot per claim),
and prints markdown tables. `--length-source SRC` gives every system that reads predicted
lengths (those not on `max_tokens`) SRC instead, labelled "system (SRC)", and writes
`<out>/<paper>_<SRC>.json` and `..._<SRC>.png`; `predictor` is the real predictor on a trace
with prompt text and, on a trace without (the papers' length generators), predictions drawn
from the predictor's held-out error model (`services/lengths.py`). `--quick` (one seed, one
short run per system, one rate) is what the tests run.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from scheduler_service.core.metrics import MetricsRecorder
from scheduler_service.core.request import Request
from scheduler_service.core.slo import SLOClass, SLOSpec
from scheduler_service.costmodel.base import CostModel
from scheduler_service.costmodel.factory import build_cost_model
from scheduler_service.sim.simulator import SimConfig, Simulation
from scheduler_service.sim.slo_profiles import apply_slo_profile, econoserve_latencies
from scheduler_service.sim.workloads import Workload, apply_arrivals, load_trace
from scheduler_service.sim.workloads.base import TraceRequest
from services.lengths import is_predictor_source, predictor_lengths
from sluice.common.tokenizer import demo_tokenizer_path

# vLLM v0's swap, beyond bytes / PCIe bandwidth: each block is one cudaMemcpyAsync per layer
# for keys and one for values; ~5 us of launch and DMA set-up each (a pinned-memory copy of a
# few hundred KB), and the step waits ~1 ms for the copies to drain before its forward. These
# are stated assumptions, not measurements: no GPU was available to calibrate them.
VLLM_SWAP = {"swap_copy_overhead_s": 5e-6, "swap_stall_s": 1e-3}


@dataclass(frozen=True)
class System:
    label: str
    policy: str
    length_source: str = "max_tokens"
    router: str = "round_robin"
    extra: dict[str, Any] = field(default_factory=dict)  # SimConfig fields of this system's own design
    ours: bool = False  # carries an extra the paper does not have


@dataclass(frozen=True)
class Rule:
    """The paper's capacity criterion over a run's steady-state metrics."""

    name: str  # sarathi | norm_latency | attainment
    threshold: float | None = None  # norm_latency: x the baseline's idle normalized latency

    def holds(self, m: dict[str, Any], bound: float | None) -> bool:
        if not m["num_finished"]:
            return False
        if self.name == "sarathi":
            assert bound is not None
            return (m["tbt_s"]["p99"] or 0.0) <= bound and m["queue_p50_s"] <= 2.0
        if self.name == "norm_latency":
            assert bound is not None
            return (m["normalized_latency_s"] or math.inf) <= bound
        return (m["slo_attainment_req"] or 0.0) >= float(self.threshold or 0.0)

    def describe(self, bound: float | None) -> str:
        if self.name == "sarathi":
            return f"P99 TBT <= {bound:.3f} s and median scheduling delay <= 2 s"
        if self.name == "norm_latency":
            return f"mean normalized latency <= {bound:.3f} s/token ({self.threshold:g} x the baseline's idle)"
        return f"request-level SLO attainment >= {self.threshold:.0%}"


@dataclass(frozen=True)
class Claim:
    name: str
    title: str
    paper_says: str
    model: str
    hardware: str
    trace: str
    systems: tuple[System, ...]
    baseline: str  # label of the paper's baseline
    rates: tuple[float, ...]
    metrics: tuple[str, ...]  # plotted against the rate (first one headlines the table)
    slo_profile: str | None = None
    kv_gb: float | None = None
    block_size: int = 16
    max_model_len: int | None = None
    max_tokens: int | None = None
    workers: int = 1
    rule: Rule | None = None
    offline_share: float = 0.0  # AccelGen: this share of requests carries a JCT SLO instead
    quick_rate: float | None = None
    duration_s: float | None = None  # simulated seconds of arrivals per run (None: --duration)
    context_is_kv: bool = False  # the context is capped at what the KV cache holds (AccelGen's setting)
    # count a text trace in the predictor's tokenizer's tokens, the unit its predictions are in
    predictor_tokens: bool = False


# ---------------------------------------------------------------- the papers' claims
def _sarathi() -> list[Claim]:
    return [
        Claim(
            "capacity",
            "Sarathi-Serve vs vLLM: capacity under a strict TBT SLO (Mistral-7B, A100, ShareGPT)",
            "2.6x (Mistral-7B, sharegpt, strict SLO, Figure 10)",
            "mistral-7b",
            "a100-80g",
            "sharegpt",
            (System("sarathi", "sarathi:budget=512"), System("vllm", "vllm")),
            "vllm",
            (0.5, 1.0, 1.5, 2.0, 3.0),
            ("throughput_req_s", "tbt_p99_s", "queue_p50_s"),
            slo_profile="sarathi-strict",
            rule=Rule("sarathi"),
            quick_rate=1.0,
        )
    ]


def _accelgen() -> list[Claim]:
    faithful = System("accelgen", "accelgen")
    ours = System("accelgen-ours", "accelgen:demote_missed=true,allocate_whole_prompt=true", ours=True)
    return [
        Claim(
            "goodput",
            "AccelGen vs vLLM: goodput on the AccelGen mix (OPT-13B, A100, 12 GB KV)",
            "1.42-11.21x tok/s, 1.54-10x req/s; goodput 1.61-12.22x (section 6.2)",
            "opt-13b",
            "a100-80g",
            "accelgen-mix",
            (faithful, ours, System("vllm", "vllm")),
            "vllm",
            (0.25, 0.4, 0.6),
            ("goodput_req_s", "throughput_tok_s", "slo_attainment_iter"),
            slo_profile="accelgen",
            kv_gb=12.0,
            block_size=32,
            max_tokens=2048,
            offline_share=0.2,
            quick_rate=0.4,
            duration_s=300.0,
            context_is_kv=True,
        )
    ]


def _econoserve() -> list[Claim]:
    econo = "econoserve:padding=0.15,buffer=0.15"
    return [
        Claim(
            "capacity",
            "EconoServe vs vLLM (swap): rate at a normalized-latency bound (OPT-13B, A100, ShareGPT)",
            "1.28-2.33x the request rate of vLLM (OPT-13B, section 4)",
            "opt-13b",
            "a100-80g",
            "econoserve-sharegpt",
            (
                System("econoserve", econo, "noisy_oracle"),
                System("econoserve-ours", econo + ",pt_reserve_only=false,admit_future=1", "noisy_oracle", ours=True),
                System("vllm", "vllm:preemption_mode=swap", extra=VLLM_SWAP),
                System("vllm-bulk-swap", "vllm:preemption_mode=swap"),
            ),
            "vllm",
            (1.0, 2.0, 3.0),
            ("normalized_latency_s", "kv_util_mean", "kv_used_mean"),
            slo_profile="econoserve",
            kv_gb=12.0,
            block_size=32,
            rule=Rule("norm_latency", 4.0),
            quick_rate=1.0,
        )
    ]


def _econoserve_regroup(factors: tuple[float, ...]) -> list[Claim]:
    """EconoServe's misprediction rule (a GT that outran its allocation gets `regroup_factor` x
    its tokens so far as its new remaining length) under the real predictor's errors, on ShareGPT
    prompts with text; the oracle line shows what no misprediction would give."""
    econo = "econoserve:padding=0.15,buffer=0.15"
    return [
        Claim(
            "regroup",
            "EconoServe's misprediction regroup factor under the real predictor (OPT-13B, A100, ShareGPT first turns)",
            "not stated: a mispredicted GT is regrouped with a new predicted length (section 3.3.1)",
            "opt-13b",
            "a100-80g",
            "sharegpt-conversations-2k",
            (
                *(System(f"regroup {f:g}", f"{econo},regroup_factor={f:g}", "predictor") for f in factors),
                System("oracle lengths", econo, "oracle"),
                System("vllm", "vllm:preemption_mode=swap", extra=VLLM_SWAP),
            ),
            "vllm",
            (1.0, 1.5, 2.0, 3.0),
            ("normalized_latency_s", "jct_mean_s", "throughput_tok_s"),
            slo_profile="econoserve",
            kv_gb=12.0,
            block_size=32,
            rule=Rule("norm_latency", 4.0),
            quick_rate=1.0,
            duration_s=200.0,
            predictor_tokens=True,
        )
    ]


def _scls() -> list[Claim]:
    scls = System("scls", "scls", router="scls")
    return [
        Claim(
            "throughput",
            "SCLS vs its ILS baseline (FastGen, capped at 16 and 8 sequences): throughput and response time "
            "(Llama-2-13B, 2 x A100, ShareGPT)",
            "+61.6% to +171% throughput vs FastGen (DS engine, section 5.2)",
            "llama-2-13b",
            "a100-80g",
            "sharegpt",
            (
                scls,
                System("fastgen", "fastgen:max_seqs=16"),
                System("fastgen-cap8", "fastgen:max_seqs=8"),
            ),
            "fastgen",
            (2.0, 4.0, 6.0),
            ("throughput_req_s", "jct_mean_s", "jct_p95_s"),
            kv_gb=20.0,
            max_model_len=4096,
            workers=2,
            quick_rate=2.0,
            duration_s=150.0,
        )
    ]


def _alise() -> list[Claim]:
    def claim(trace: str, says: str, rates: tuple[float, ...], duration_s: float | None = None) -> Claim:
        return Claim(
            trace.split("-")[1],
            f"ALISE vs vLLM on vLLM's engine: rate at a latency bound (OPT-13B, A100, {trace})",
            says,
            "opt-13b",
            "a100-80g",
            trace,
            (
                System("alise", "alise", "noisy_oracle", extra={"overlap_swap": True}),
                System("alise-ours", "alise:hybrid=true", "noisy_oracle", extra={"overlap_swap": True}, ours=True),
                System("vllm", "vllm"),
            ),
            "vllm",
            rates,
            ("normalized_latency_s", "throughput_req_s", "kv_used_mean"),
            kv_gb=12.0,
            rule=Rule("norm_latency", 4.0),
            quick_rate=rates[0],
            duration_s=duration_s,
        )

    return [
        claim(
            "econoserve-sharegpt",
            "up to 2.1x throughput at the same latency (ShareGPT, Figure 6)",
            (3.0, 4.0, 5.0),
            150.0,
        ),
        claim(
            "econoserve-alpaca", "1.3-1.8x throughput at the same latency (Alpaca, Figure 6)", (24.0, 40.0, 56.0), 40.0
        ),
    ]


PAPERS: dict[str, Callable[[], list[Claim]]] = {
    "sarathi": _sarathi,
    "accelgen": _accelgen,
    "econoserve": _econoserve,
    "scls": _scls,
    "alise": _alise,
}


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


def workload(claim: Claim, cm: CostModel, rate: float, seed: int, setup: Setup) -> Workload:
    n = max(setup.min_requests, math.ceil(rate * setup.duration_s))
    tokenizer = demo_tokenizer_path() if claim.predictor_tokens else None
    base = load_trace(claim.trace, num_requests=n, seed=seed, tokenizer_path=tokenizer)
    wl = apply_arrivals(base, "poisson", rate=rate, seed=seed)
    if claim.slo_profile:
        wl = apply_slo_profile(claim.slo_profile, wl, cm, seed)
    return _with_offline(wl, claim.offline_share, cm, seed)


def steady_metrics(sim: _Recorded, warmup_s: float) -> dict[str, Any]:
    """The run's metrics over the requests that arrived after the warm-up."""
    rec = MetricsRecorder()
    for req in sim.made:
        if req.arrival_time < warmup_s:
            continue
        rec.on_admitted(req)
        end = req.token_times[-1] if len(req.token_times) else req.arrival_time
        rec.on_finish(req, end)
    m = rec.summary()
    d = rec.details()
    return {
        "num_measured": m["num_requests"],
        "num_finished": m["num_finished"],
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
    table = (
        predictor_lengths(system.length_source, wl, seed, progress=False)
        if is_predictor_source(system.length_source)
        else None
    )
    cfg = SimConfig(
        policy=system.policy,
        router=system.router,
        num_workers=claim.workers,
        kv_gb=claim.kv_gb,
        block_size=claim.block_size,
        max_model_len=max_model_len,
        max_tokens=claim.max_tokens,
        length_source=system.length_source if table is None else "oracle",  # unused when a table is given
        seed=seed,
    )
    cfg = replace(cfg, **system.extra)
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
    stats = list(full.details["policy_stats"].values())
    if any(stats):  # a policy that keeps counters (EconoServe); summed over workers, absent ones are 0
        for key in MISPREDICTION_COUNTERS:
            row[key] = sum(int(s.get(key, 0)) for s in stats)  # type: ignore[call-overload]
    placements = [getattr(s.policy, "num_alg2_placements", None) for s in sim.cluster.schedulers.values()]
    if placements[0] is not None:  # AccelGen: how often Algorithm 2 placed a request
        row["alg2_placements"] = sum(placements)
        row["num_steps"] = full.details["num_steps"]
    return row


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
) -> dict[str, Any]:
    """Largest rate whose seeds' mean meets the rule; bisection between it and the next swept rate."""
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
        mid_rows = [run_one(claim, system, mid, s, setup) for s in seeds]
        bar.update(1)
        rows.extend(mid_rows)
        held = holds_at(mid_rows)
        probes.append((mid, held))
        lo, hi = (mid, hi) if held else (lo, mid)
    return {"capacity": lo, "below_floor": False, "floor": claim.rates[0], "beyond_sweep": hi is None, "probes": probes}


def run_claim(claim: Claim, setup: Setup, seeds: list[int], refine: int, quick: bool) -> dict[str, Any]:
    rates = (claim.quick_rate or claim.rates[0],) if quick else claim.rates
    if claim.duration_s is not None and not quick:
        setup = replace(setup, duration_s=claim.duration_s)
    claim = replace(claim, rates=rates)
    jobs = [(s, r, seed) for s in claim.systems for r in rates for seed in seeds]
    bound = idle_bound(claim, setup, seeds) if not quick else None
    rows: list[dict[str, Any]] = []
    with tqdm(total=len(jobs), desc=f"{claim.name}", unit="run") as bar:
        for system, rate, seed in jobs:
            rows.append(run_one(claim, system, rate, seed, setup))
            bar.update(1)
        caps = {}
        if claim.rule is not None and not quick:
            for system in claim.systems:
                mine = [r for r in rows if r["system"] == system.label]
                caps[system.label] = capacity(claim, system, mine, bound, setup, seeds, refine, bar)
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
            }
            for s in claim.systems
        ],
        "baseline": claim.baseline,
        "metrics": list(claim.metrics),
        "rule": None
        if claim.rule is None or (bound is None and claim.rule.name != "attainment")
        else claim.rule.describe(bound),
        "capacity": caps,
        "rows": rows,
    }


# ---------------------------------------------------------------- report
def fmt(v: Any, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def claim_tables(res: dict[str, Any]) -> str:
    labels = [s["label"] for s in res["systems"]]
    key = res["metrics"][0]
    base = res["baseline"]
    lines = [f"### {res['title']}", "", f"Paper: {res['paper_says']}.", ""]
    head = "| rate (req/s) | " + " | ".join(f"{lab} {key} (mean [min, max])" for lab in labels) + " |"
    lines += [head, "|" + "---|" * (len(labels) + 1)]
    for rate in res["setup"]["rates"]:
        cells = []
        for lab in labels:
            rows = [r for r in res["rows"] if r["system"] == lab and r["rate"] == rate]
            mean, lo, hi = _band(rows, key)
            cells.append(f"{fmt(mean)} [{fmt(lo)}, {fmt(hi)}]")
        lines.append(f"| {rate:g} | " + " | ".join(cells) + " |")
    if res["capacity"]:
        lines += [
            "",
            f"Capacity ({res['rule']}):",
            "",
            "| system | capacity (req/s) | vs " + base + " |",
            "|---|---|---|",
        ]
        ref = res["capacity"].get(base, {}).get("capacity")
        for lab in labels:
            c = res["capacity"][lab]
            if c["below_floor"]:
                text, ratio = f"< {c['floor']:g} (floor)", "-"
            else:
                text = f"{c['capacity']:.2f}" + (" (beyond the sweep)" if c.get("beyond_sweep") else "")
                ratio = f"{c['capacity'] / ref:.2f}x" if ref else "-"
            lines.append(f"| {lab} | {text} | {ratio} |")
    if any("regrouped" in r for r in res["rows"]):
        lines += ["", counter_table(res)]
    return "\n".join(lines)


def counter_table(res: dict[str, Any]) -> str:
    """EconoServe's misprediction counters and the preemptions, mean over seeds per rate."""
    rates = sorted({r["rate"] for r in res["rows"]})
    lines = [
        "Mean over seeds: regrouped / stopped at a full allocation (mispredicted_kept) / preemptions",
        "",
        "| system | " + " | ".join(f"{r:g} req/s" for r in rates) + " |",
        "|---|" + "---|" * len(rates),
    ]
    for s in res["systems"]:
        cells = []
        for rate in rates:
            rows = [r for r in res["rows"] if r["system"] == s["label"] and r["rate"] == rate]
            if not rows:
                cells.append("-")
                continue
            keys = ("regrouped", "mispredicted_kept", "preemptions")
            cells.append(" / ".join(fmt(_mean(rows, k), 4) for k in keys))
        lines.append(f"| {s['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def with_length_source(claim: Claim, source: str) -> Claim:
    """Every system that reads predicted lengths gets `source`; the others are unchanged."""
    systems = tuple(
        s if s.length_source == "max_tokens" else replace(s, label=f"{s.label} ({source})", length_source=source)
        for s in claim.systems
    )
    return replace(claim, systems=systems)


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = res["metrics"]
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.8))
    for ax, key in zip(np.atleast_1d(axes), keys, strict=True):
        for s in res["systems"]:
            pts = []
            for rate in sorted({r["rate"] for r in res["rows"] if r["system"] == s["label"]}):
                rows = [r for r in res["rows"] if r["system"] == s["label"] and r["rate"] == rate]
                pts.append((rate, *_band(rows, key)))
            if not pts:
                continue
            x, mean, lo, hi = (np.array(v) for v in zip(*pts, strict=True))
            ax.plot(x, mean, marker="o", ls="--" if s["ours"] else "-", label=s["label"])
            ax.fill_between(x, lo, hi, alpha=0.2)
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    np.atleast_1d(axes)[0].legend(fontsize=8)
    fig.suptitle(res["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paper", choices=sorted(PAPERS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0, help="seeds are first-seed .. first-seed + seeds - 1")
    parser.add_argument("--rates", help="comma-separated arrival rates instead of each claim's own sweep")
    parser.add_argument("--duration", type=float, default=300.0, help="simulated seconds of arrivals per run")
    parser.add_argument("--warmup", type=float, default=0.2, help="share of the arrival span excluded as warm-up")
    parser.add_argument("--min-requests", type=int, default=200)
    parser.add_argument("--refine", type=int, default=1, help="bisection probes per capacity beyond the sweep")
    parser.add_argument("--quick", action="store_true", help="one seed, one rate, 60 s: a smoke run")
    parser.add_argument("--out", default="docs/results/data/repro")
    parser.add_argument("--cause", action="store_true", help="scls only: where its GPU time goes against FastGen's")
    parser.add_argument(
        "--length-source",
        help="predicted lengths for every system that reads them: oracle, noisy_oracle or predictor[:DIR]",
    )
    parser.add_argument(
        "--regroup",
        help="econoserve only: sweep the misprediction regroup_factor over these values (comma-separated), "
        "with the real predictor on ShareGPT prompts",
    )
    args = parser.parse_args(argv)
    if args.cause:
        if args.paper != "scls":
            parser.error("--cause is measured for scls only")
        return {"paper": "scls", "cause": scls_cause()}
    claims = PAPERS[args.paper]()
    name = args.paper
    if args.regroup:
        if args.paper != "econoserve":
            parser.error("--regroup is measured for econoserve only")
        try:
            factors = tuple(float(f) for f in args.regroup.split(","))
        except ValueError:
            parser.error(f"--regroup must be comma-separated numbers, got {args.regroup!r}")
        claims, name = _econoserve_regroup(factors), "econoserve_regroup"
    if args.rates:
        try:
            rates = tuple(sorted(float(r) for r in args.rates.split(",")))
        except ValueError:
            parser.error(f"--rates must be comma-separated numbers, got {args.rates!r}")
        claims = [replace(c, rates=rates) for c in claims]
        name = f"{name}_{'-'.join(f'{r:g}' for r in rates)}"  # beside, not over, the full sweep's file
    if args.length_source:
        known = ("oracle", "noisy_oracle", "max_tokens")
        if args.length_source not in known and not is_predictor_source(args.length_source):
            parser.error(f"--length-source must be one of {', '.join(known)} or predictor[:DIR]")
        claims = [with_length_source(c, args.length_source) for c in claims]
        name = f"{name}_{args.length_source.split(':')[0]}"
    if args.quick:
        setup, seeds = Setup(60.0, args.warmup, 30), [0]
    else:
        setup = Setup(args.duration, args.warmup, args.min_requests)
        seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    if args.first_seed and not args.quick:
        name = f"{name}_seeds{seeds[0]}-{seeds[-1]}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"paper": args.paper, "command": "python benchmarks/repro.py " + " ".join(argv or []), "claims": []}
    for claim in claims:
        res = run_claim(claim, setup, seeds, args.refine, args.quick)
        results["claims"].append(res)
        plot(res, out / f"{name}_{claim.name}.png")
        print(claim_tables(res), flush=True)
        print(flush=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=1, default=str))
    return results


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
