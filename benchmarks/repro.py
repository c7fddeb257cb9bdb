"""One command per paper: its headline claim, as two labelled comparisons, run the way a reviewer would accept.

    python benchmarks/repro.py PAPER [--claim NAME] [--quick] [--seeds 3] [--duration 300]
                                     [--out docs/results/data/repro] [--length-source predictor[:DIR]]
    python benchmarks/repro.py econoserve --regroup 0.25,0.5,1,2     # the regroup factor, measured

PAPER is sarathi, accelgen, econoserve, scls or alise. Each claim holds the paper's number as
data (`Claim.paper_ratio`) and two comparisons (`Claim.comparisons`), printed side by side:
- **published**: the paper's system as published against the paper's baseline as published,
  same model, GPU and KV bytes, each system with its own published engine features (ALISE:
  hybrid batching and resident int8 KV, `System.int8_kv`; vLLM: prefill-only iterations, fp16);
  only this one is set against the paper's number;
- **equal-engine**: both systems on one batching engine and KV precision, which isolates the
  scheduling idea; an ablation, never called paper-faithful.
Every system of a claim gets the same model, GPU, KV bytes, block size and the claim's
`common` settings (one swap pricing for all); the only per-system settings are those of its
own design (`System.extra`). Systems marked "ours" carry an extra the paper does not have and
are in no comparison. Runs:
- arrival rates are swept (Poisson), each run a fixed simulated duration of arrivals
  (`--duration`, or the claim's), whose first `--warmup` share is excluded from the latency,
  SLO and throughput numbers (steady state: the measured requests arrive into a loaded system);
- several seeds (`--seeds`); each seed draws other lengths for every trace format (a generator
  samples with it; a file is read whole and sampled with it) and other arrivals; shown as the
  mean and the min-max band; a claim may cut lengths to the paper's limits (`max_input`,
  `max_output`);
- capacity, where the paper claims one, is the largest swept rate whose seeds' mean meets
  the paper's rule, refined by bisection between it and the next rate (`--refine` probes);
  a system that misses the rule at the lowest swept rate is "< floor", never searched below;
- each row carries the mechanism counters of the policy (`counters`, from the simulator's
  `details.policy_stats`) and of the router (`router_counters`), so a table can show that a
  paper's mechanism ran (`Claim.counters` picks the columns printed).
Writes `<out>/<paper>.json` (every run) and `<out>/<paper>_<claim>.png` (one plot per claim),
and prints markdown tables. `--length-source SRC` gives every system that reads predicted
lengths (those not on `max_tokens`) SRC instead, labelled "system (SRC)", and writes
`<out>/<paper>_<SRC>.json` and `..._<SRC>.png`; `predictor` is the real predictor on a trace
with prompt text and, on a trace without (the papers' length generators), predictions drawn
from the predictor's held-out error model (`predictor_service/trace_lengths.py`). `--quick` (one seed, one
short run per system, one rate) is what the tests run.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
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

# vLLM v0's swap, beyond bytes / PCIe bandwidth: each block is one cudaMemcpyAsync per layer
# for keys and one for values; ~5 us of launch and DMA set-up each (a pinned-memory copy of a
# few hundred KB), and the step waits ~1 ms for the copies to drain before its forward. These
# are stated assumptions about vLLM v0, not measurements (scheduler_service/sim/swap_costs.py;
# Sluice's own worker, measured on an H100, pays 0.06 us per copy and a 0.21 ms stall).
VLLM_SWAP = {"swap_costs": "vllm-v0"}


@dataclass(frozen=True)
class System:
    label: str
    policy: str
    length_source: str = "max_tokens"
    router: str = "round_robin"
    extra: dict[str, Any] = field(default_factory=dict)  # SimConfig fields of this system's own design
    ours: bool = False  # carries an extra the paper does not have
    # resident KV in int8 (an engine feature, ALISE's in every experiment of its paper): the same
    # KV bytes hold twice the tokens; the claim's `kv_gb` stays the bytes every system gets
    int8_kv: bool = False


PUBLISHED = "published"  # the paper's system as published against the paper's baseline as published
EQUAL_ENGINE = "equal-engine"  # both on the same batching engine and KV precision: the scheduling idea alone


@dataclass(frozen=True)
class Comparison:
    """One labelled ratio of a claim: `system` against `baseline` (labels of the claim's systems)."""

    kind: str  # PUBLISHED | EQUAL_ENGINE
    system: str
    baseline: str
    note: str  # what each side brings (engine, KV precision, the paper's own settings)


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
    comparisons: tuple[Comparison, ...] = ()  # (1) published vs published, (2) equal-engine ablation
    paper_ratio: tuple[float, float] | None = None  # the paper's number for the headline ratio (low, high)
    max_input: int | None = None  # prompts longer than this are truncated to it (the paper's limit)
    max_output: int | None = None  # outputs longer than this end there (the paper's limit)
    # SimConfig fields every system gets (one swap pricing for all; `price_in_time` and such never here)
    common: dict[str, Any] = field(default_factory=dict)
    counters: tuple[str, ...] = ()  # mechanism counters shown per system and rate (policy, then router)


# ---------------------------------------------------------------- the papers' claims
# Each claim carries two labelled comparisons (`Comparison`): PUBLISHED, the paper's system with
# its own published engine features against the paper's baseline with its own; EQUAL_ENGINE,
# both on one batching engine and KV precision, which isolates the scheduling idea. Only
# PUBLISHED is compared with the paper's number; EQUAL_ENGINE is an ablation, never "faithful".


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
            paper_ratio=(2.6, 2.6),
            comparisons=(
                Comparison(
                    PUBLISHED,
                    "sarathi",
                    "vllm",
                    "Sarathi: chunked prefills (512-token budget), stall-free hybrid batches; vLLM: prefill-only "
                    "iterations; both fp16 KV, 256 seats",
                ),
                Comparison(
                    EQUAL_ENGINE,
                    "sarathi",
                    "vllm",
                    "the same pair: Sarathi's idea is the batching engine itself, so giving vLLM that engine "
                    "gives it the idea; KV precision and seats are already equal",
                ),
            ),
        )
    ]


ACCELGEN_PAPER = "accelgen:price_in_time=false"  # Eq. 6 alone sizes the budget, as published
ACCELGEN_OFF = "accelgen:chunk=false,order=false,batch=false"  # same engine, its three mechanisms off
ACCELGEN_COUNTERS = ("steps", "budget_bound_steps", "alg2_prompt_chunks", "alg2_decodes", "kv_preemptions")


def _accelgen_systems() -> tuple[System, ...]:
    return (
        System("accelgen", ACCELGEN_PAPER),
        System("accelgen-ours", "accelgen:demote_missed=true,allocate_whole_prompt=true", ours=True),
        System("accelgen-fcfs", ACCELGEN_OFF),
        System("vllm", "vllm"),
    )


def _accelgen_comparisons() -> tuple[Comparison, ...]:
    return (
        Comparison(
            PUBLISHED,
            "accelgen",
            "vllm",
            "AccelGen: hybrid batches, Eq. 6 budget, SLO order, Algorithms 1-2, per-chunk KV; vLLM: prefill-only "
            "iterations, whole-prompt KV; both fp16",
        ),
        Comparison(
            EQUAL_ENGINE,
            "accelgen",
            "accelgen-fcfs",
            "one engine (hybrid batches, per-chunk KV, fp16); the baseline runs FCFS with a fixed 512-token "
            "budget and greedy fill (`chunk`, `order`, `batch` off)",
        ),
    )


def _accelgen() -> list[Claim]:
    return [
        Claim(
            "goodput",
            "AccelGen vs vLLM: goodput in the paper's setting (OPT-13B, A100, 12 GB KV, AccelGen mix)",
            "1.42-11.21x tok/s, 1.54-10x req/s; goodput 1.61-12.22x (section 6.2)",
            "opt-13b",
            "a100-80g",
            "accelgen-mix",
            _accelgen_systems(),
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
            paper_ratio=(1.61, 12.22),
            comparisons=_accelgen_comparisons(),
            counters=ACCELGEN_COUNTERS,
        ),
        Claim(
            "prefill_heavy",
            "AccelGen vs vLLM where its budget can bind: prefill-heavy mix (OPT-13B, A100, 40 GB KV, "
            "AccelGen mix with prompts <= 2,048 and answers <= 32 tokens)",
            "not a paper setting: the regime Eq. 6 and Algorithm 2 are for (prefill-heavy, KV not the limit)",
            "opt-13b",
            "a100-80g",
            "accelgen-mix",
            _accelgen_systems(),
            "vllm",
            (4.0, 6.0, 8.0),
            ("goodput_req_s", "throughput_tok_s", "ttft_p50_s"),
            slo_profile="accelgen",
            kv_gb=40.0,
            block_size=32,
            max_tokens=2048,
            offline_share=0.2,
            quick_rate=6.0,
            duration_s=90.0,
            context_is_kv=True,
            max_input=2048,
            max_output=32,
            paper_ratio=(1.61, 12.22),
            comparisons=_accelgen_comparisons(),
            counters=ACCELGEN_COUNTERS,
        ),
    ]


# One swap pricing for every system of a claim: vLLM v0's per-copy and stall costs (VLLM_SWAP).
ECONO = "econoserve:padding=0.15,buffer=0.15"
# The admission reading consistent with the paper's numbers: a prompt takes any free KV while
# the free KV still covers its GT's exact allocation (prompt + predicted output x 1.15) and the
# queued GTs' (`admit_future=1`); the reserve only guarantees that prompts can be added each
# iteration. The literal "prompts from the reserve only" reading is kept beside it.
ECONO_PUBLISHED = ECONO + ",pt_reserve_only=false,admit_future=1"


def _econoserve() -> list[Claim]:
    return [
        Claim(
            "capacity",
            "EconoServe vs vLLM (swap): rate at a normalized-latency bound (OPT-13B, A100, ShareGPT)",
            "1.28-2.33x the request rate of vLLM (OPT-13B, section 4)",
            "opt-13b",
            "a100-80g",
            "econoserve-sharegpt",
            (
                System("econoserve", ECONO_PUBLISHED, "noisy_oracle"),
                System("econoserve-reserve-only", ECONO, "noisy_oracle"),
                System("vllm", "vllm:preemption_mode=swap"),
                System("vllm-hybrid", "vllm_chunked:preemption_mode=swap"),
            ),
            "vllm",
            (1.0, 2.0, 2.5, 3.0, 3.5, 4.0),
            ("normalized_latency_s", "kv_util_mean", "kv_used_mean"),
            slo_profile="econoserve",
            kv_gb=12.0,
            block_size=32,
            rule=Rule("norm_latency", 4.0),
            quick_rate=1.0,
            paper_ratio=(1.28, 2.33),
            common=VLLM_SWAP,
            comparisons=(
                Comparison(
                    PUBLISHED,
                    "econoserve",
                    "vllm",
                    "EconoServe: PTs fill a target forward size beside the GTs (hybrid batches), exact allocation, "
                    "KVCPipe, offload-free preemption; vLLM: prefill-only iterations, swap preemption; fp16 both",
                ),
                Comparison(
                    EQUAL_ENGINE,
                    "econoserve",
                    "vllm-hybrid",
                    "both run hybrid (chunked-prefill) batches on fp16 KV with the same swap pricing; the baseline "
                    "allocates blocks on demand, FCFS",
                ),
            ),
            counters=(
                "pt_pool_admissions",
                "pt_reserve_admissions",
                "pipe_guests",
                "regrouped",
                "mispredicted_kept",
                "unstick_swaps",
            ),
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


FASTGEN_CAPS = (8, 12, 16, 28, 512)
FASTGEN_CAP_SOURCES = {
    12: "the paper's DS batch size for SLS, and its DS rule for L + S > 1,024",
    28: "the paper's DS rule for L + S <= 512",
    512: "DeepSpeed's default max_ragged_sequence_count (DSStateManagerConfig), FastGen's own cap",
}


def _scls() -> list[Claim]:
    scls = System("scls", "scls", router="scls:memory_rule=deepspeed")
    fastgens = tuple(System(f"fastgen-cap{c}", f"fastgen:max_seqs={c}") for c in FASTGEN_CAPS)
    return [
        Claim(
            "throughput",
            "SCLS vs its ILS baseline (FastGen, a sweep of its sequence cap) and its SLS baseline: throughput "
            "(Llama-2-13B, 2 x A100, ShareGPT cut to the paper's 1,024-token limits)",
            "+61.6% to +171% throughput vs FastGen, +82.5% to +191.9% vs SLS (DS engine, section 5.2)",
            "llama-2-13b",
            "a100-80g",
            "sharegpt",
            (
                scls,
                System("scls-eq9", "scls", router="scls"),  # Eq. 9's KV check alone (the paper's HF rule)
                *fastgens,
                System("sls", "sls:batch_size=12"),
            ),
            "fastgen-cap512",
            (2.0, 4.0),
            ("throughput_req_s", "jct_mean_s", "jct_p95_s"),
            max_model_len=2048,
            max_input=1024,
            max_output=1024,
            workers=2,
            quick_rate=2.0,
            duration_s=150.0,
            paper_ratio=(1.616, 2.71),
            comparisons=(
                *(
                    Comparison(
                        PUBLISHED,
                        "scls",
                        f.label,
                        "SCLS on a static-batch engine (padded rows, slices of 128 re-prefilled, the paper's "
                        "DeepSpeed memory rule: 12/22/28 rows) vs FastGen (Dynamic SplitFuse, 768-token budget) "
                        f"capped at {c} sequences; fp16 both"
                        if i == 0
                        else f"the same, FastGen capped at {c} sequences ({FASTGEN_CAP_SOURCES.get(c, 'sweep')})",
                    )
                    for i, (c, f) in enumerate(zip(FASTGEN_CAPS, fastgens, strict=True))
                ),
                Comparison(
                    EQUAL_ENGINE,
                    "scls",
                    "sls",
                    "both static batches on the same engine under the DeepSpeed rule (SLS: 12 rows, the paper's DS "
                    "batch size), fp16; SCLS adds slices, the DP batcher and max-min offloading",
                ),
            ),
            counters=("slices", "reprefill_tokens", "pad_tokens", "memory_capped_batches", "batches"),
        )
    ]


def _alise() -> list[Claim]:
    def claim(trace: str, says: str, ratio: tuple[float, float], rates: tuple[float, ...], duration_s: float) -> Claim:
        return Claim(
            trace.split("-")[1],
            f"ALISE vs vLLM: rate at a latency bound (OPT-13B, A100, 12 GB of KV bytes, {trace})",
            says,
            "opt-13b",
            "a100-80g",
            trace,
            (
                System(
                    "alise",
                    "alise:hybrid=true",
                    "noisy_oracle",
                    extra={"overlap_swap": True},
                    int8_kv=True,
                ),
                System("vllm", "vllm"),
                System("vllm-hybrid-int8", "vllm_chunked", extra={"overlap_swap": True}, int8_kv=True),
            ),
            "vllm",
            rates,
            ("normalized_latency_s", "throughput_req_s", "kv_used_mean"),
            kv_gb=12.0,
            rule=Rule("norm_latency", 4.0),
            quick_rate=rates[0],
            duration_s=duration_s,
            paper_ratio=ratio,
            comparisons=(
                Comparison(
                    PUBLISHED,
                    "alise",
                    "vllm",
                    "ALISE: selective (hybrid) batching, resident int8 KV (twice the tokens in the same bytes), int8 "
                    "swaps on a copy stream; vLLM: prefill-only iterations, fp16 KV",
                ),
                Comparison(
                    EQUAL_ENGINE,
                    "alise",
                    "vllm-hybrid-int8",
                    "both hybrid batches, resident int8 KV, swaps on a copy stream; the baseline is FCFS",
                ),
            ),
            counters=("ewt_swap_outs", "forced_swap_outs", "forced_recomputes", "priority_pauses", "mispredictions"),
        )

    return [
        claim(
            "econoserve-sharegpt",
            "up to 2.1x throughput at the same latency (ShareGPT, Figure 6)",
            (2.1, 2.1),
            (3.0, 3.5, 4.0, 4.5, 5.0, 5.5, 6.0),
            600.0,
        ),
        claim(
            "econoserve-alpaca",
            "1.3-1.8x throughput at the same latency (Alpaca, Figure 6)",
            (1.3, 1.8),
            (32.0, 40.0, 48.0, 56.0, 64.0, 72.0),
            120.0,
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


# ---------------------------------------------------------------- several runs as one
def merge_results(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Runs of one paper that differ in seeds, rates or systems (e.g. `--first-seed 1 --seeds 2`
    beside an earlier seed-0 run) as one result: per claim, the rows of every run (one row per
    system, rate and seed; a row given twice must be the same run), the systems in the order
    first seen, the seeds and rates of all, the comparisons of the first run that has them.
    Capacities are left empty: `combine_capacities` judges them on the merged rows."""
    if not results:
        raise ValueError("nothing to merge")
    papers = {r["paper"] for r in results}
    if len(papers) != 1:
        raise ValueError(f"runs of one paper only, got {sorted(papers)}")
    claims: dict[str, dict[str, Any]] = {}
    for result in results:
        for res in result["claims"]:
            name = res["claim"]
            if name not in claims:
                claims[name] = {**res, "rows": [], "systems": [], "comparisons": [], "capacity": {}}
            merged = claims[name]
            if res["setup"]["duration_s"] != merged["setup"]["duration_s"]:
                raise ValueError(f"{name}: runs of {res['setup']['duration_s']} and {merged['setup']['duration_s']} s")
            known = {s["label"] for s in merged["systems"]}
            merged["systems"] += [s for s in res["systems"] if s["label"] not in known]
            if not merged["comparisons"]:
                merged["comparisons"] = res["comparisons"]
            seen = {(r["system"], r["rate"], r["seed"]): r for r in merged["rows"]}
            for row in res["rows"]:
                key = (row["system"], row["rate"], row["seed"])
                if key in seen:
                    if seen[key].get("normalized_latency_s") != row.get("normalized_latency_s"):
                        raise ValueError(f"{name}: {key} differs between runs")
                    continue
                seen[key] = row
                merged["rows"].append(row)
    for merged in claims.values():
        rows = merged["rows"]
        merged["setup"] = {
            **merged["setup"],
            "seeds": sorted({r["seed"] for r in rows}),
            "rates": sorted({r["rate"] for r in rows}),
        }
    commands = [r["command"] for r in results]
    return {
        "paper": papers.pop(),
        "command": " && ".join(commands),
        "merged_from": commands,
        "claims": list(claims.values()),
    }


def complete_rates(res: dict[str, Any], label: str) -> list[float]:
    """The rates at which `label` ran every seed of the merged result."""
    seeds = set(res["setup"]["seeds"])
    return [
        rate
        for rate in res["setup"]["rates"]
        if {r["seed"] for r in res["rows"] if r["system"] == label and r["rate"] == rate} == seeds
    ]


def combine_capacities(res: dict[str, Any], claim: Claim, bound: float | None) -> dict[str, Any]:
    """Each system's capacity by `claim`'s rule on the merged rows, over the rates at which it
    ran every seed (no bisection: the grid the runs share); the rule's text beside it."""
    assert claim.rule is not None
    caps: dict[str, Any] = {}
    for system in res["systems"]:
        rates = complete_rates(res, system["label"])
        if not rates:
            continue
        mine = [r for r in res["rows"] if r["system"] == system["label"] and r["rate"] in rates]
        grid = replace(claim, rates=tuple(rates))
        with tqdm(disable=True) as bar:  # no bisection: nothing runs, the arguments for runs are unused
            caps[system["label"]] = capacity(grid, claim.systems[0], mine, bound, Setup(0.0, 0.0, 0), [], 0, bar)
        caps[system["label"]]["rates"] = rates
    return {**res, "capacity": caps, "rule": claim.rule.describe(bound), "bound": bound}


def combine(paths: list[Path]) -> dict[str, Any]:
    """`merge_results` over JSON files, then each claim's capacities on the merged rows, with
    the rule's bound measured again at the lowest merged seed and rate (as a single run does)."""
    merged = merge_results([json.loads(p.read_text()) for p in paths])
    by_name = {c.name: c for c in PAPERS[merged["paper"]]()}
    out = []
    for res in merged["claims"]:
        claim = by_name[res["claim"]]
        if claim.rule is None:
            out.append(res)
            continue
        # the runs' own trace (`--trace` counts a trace in the predictor's tokens, as there)
        trace = res["setup"]["trace"]
        claim = replace(
            claim,
            rates=tuple(res["setup"]["rates"]),
            trace=trace,
            predictor_tokens=claim.predictor_tokens or trace != claim.trace,
        )
        setup = Setup(res["setup"]["duration_s"], res["setup"]["warmup_share"], 200)
        out.append(combine_capacities(res, claim, idle_bound(claim, setup, res["setup"]["seeds"])))
    return {**merged, "claims": out}


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
    if any(r.get("norm_latency_late_s") is not None for r in res["rows"]) and res["capacity"]:
        lines += ["", growth_table(res)]
    if res.get("comparisons"):
        lines += ["", comparison_table(res)]
    if res.get("counters"):
        lines += ["", mechanism_table(res)]
    if any("regrouped" in r for r in res["rows"]):
        lines += ["", counter_table(res)]
    return "\n".join(lines)


def _ratio_text(res: dict[str, Any], sys_label: str, base_label: str) -> str:
    """Capacity ratio where the claim has a rule; else the headline metric's ratio per rate:
    ratio of the seed means [min, max of the per-seed ratios], with the counts behind goodput."""
    caps = res.get("capacity") or {}
    if caps:
        a, b = caps.get(sys_label, {}), caps.get(base_label, {})
        if a.get("below_floor") or b.get("below_floor") or not a or not b:
            return "below the floor: " + (sys_label if a.get("below_floor") else base_label)
        ratio = a["capacity"] / b["capacity"]
        text = f"**{ratio:.2f}x** ({a['capacity']:.2f} vs {b['capacity']:.2f} req/s)"
        if b.get("beyond_sweep") and not a.get("beyond_sweep"):
            text = "<= " + text
        elif a.get("beyond_sweep") and not b.get("beyond_sweep"):
            text = ">= " + text
        elif a.get("beyond_sweep") and b.get("beyond_sweep"):
            text += " (both beyond the sweep)"
        return text
    key = res["metrics"][0]
    parts = []
    for rate in res["setup"]["rates"]:
        mine = {r["seed"]: r for r in res["rows"] if r["system"] == sys_label and r["rate"] == rate}
        base = {r["seed"]: r for r in res["rows"] if r["system"] == base_label and r["rate"] == rate}
        seeds = sorted(set(mine) & set(base))
        if not seeds:
            continue
        m = float(np.mean([mine[k][key] or 0.0 for k in seeds]))
        b = float(np.mean([base[k][key] or 0.0 for k in seeds]))
        per_seed = [(mine[k][key] or 0.0) / base[k][key] for k in seeds if base[k][key]]
        text = f"{rate:g}: {fmt(m / b) if b else '-'}x"
        if per_seed:
            text += f" [{fmt(min(per_seed))}, {fmt(max(per_seed))}]"
        if key.startswith("goodput"):
            good_m = sum(mine[k]["num_good"] for k in seeds)
            good_b = sum(base[k]["num_good"] for k in seeds)
            judged = sum(base[k]["num_judged"] for k in seeds)
            text += f" ({good_m} vs {good_b} of {judged} requests met their SLO)"
        parts.append(text)
    return "; ".join(parts) or "-"


def growth_table(res: dict[str, Any]) -> str:
    """Normalized latency of the measured window's second half over its first (by arrival),
    mean over seeds: about 1 in a steady state, well above 1 while a queue still grows."""
    rates = res["setup"]["rates"]
    lines = [
        "Steady state: normalized latency, second half of the measured arrivals over the first (mean over seeds)",
        "",
        "| system | " + " | ".join(f"{r:g}" for r in rates) + " |",
        "|---|" + "---|" * len(rates),
    ]
    for s in res["systems"]:
        cells = []
        for rate in rates:
            rows = [r for r in res["rows"] if r["system"] == s["label"] and r["rate"] == rate]
            ratios = [
                r["norm_latency_late_s"] / r["norm_latency_early_s"] for r in rows if r.get("norm_latency_early_s")
            ]
            cells.append(fmt(float(np.mean(ratios))) if ratios else "-")
        lines.append(f"| {s['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def comparison_table(res: dict[str, Any]) -> str:
    head = "| comparison | system vs baseline | ratio | what each side brings |"
    lines = ["Comparisons:", "", head, "|---|---|---|---|"]
    for c in res["comparisons"]:
        ratio = _ratio_text(res, c["system"], c["baseline"])
        lines.append(f"| {c['kind']} | {c['system']} vs {c['baseline']} | {ratio} | {c['note']} |")
    return "\n".join(lines)


def mechanism_table(res: dict[str, Any]) -> str:
    """The paper mechanisms' counters (`details.policy_stats`, `router_stats`), mean over seeds."""
    keys = res["counters"]
    lines = [
        "Mechanism counters (mean over seeds, whole run): " + ", ".join(keys),
        "",
        "| system | rate | " + " | ".join(keys) + " |",
        "|---|---|" + "---|" * len(keys),
    ]
    for s in res["systems"]:
        for rate in res["setup"]["rates"]:
            rows = [r for r in res["rows"] if r["system"] == s["label"] and r["rate"] == rate]
            if not rows or not any(r.get("counters") or r.get("router_counters") for r in rows):
                continue
            # a counter a policy keeps but never moved is absent from its report: 0
            merged = [{**r.get("router_counters", {}), **r.get("counters", {})} for r in rows]
            vals = [fmt(float(np.mean([m.get(k, 0) for m in merged])), 4) for k in keys]
            lines.append(f"| {s['label']} | {rate:g} | " + " | ".join(vals) + " |")
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
    renamed = {s.label: f"{s.label} ({source})" for s in claim.systems if s.length_source != "max_tokens"}
    systems = tuple(
        replace(s, label=renamed[s.label], length_source=source) if s.label in renamed else s for s in claim.systems
    )
    comparisons = tuple(
        replace(c, system=renamed.get(c.system, c.system), baseline=renamed.get(c.baseline, c.baseline))
        for c in claim.comparisons
    )
    return replace(
        claim, systems=systems, comparisons=comparisons, baseline=renamed.get(claim.baseline, claim.baseline)
    )


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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paper", choices=sorted(PAPERS))
    parser.add_argument("--claim", help="run only this claim of the paper (e.g. alise's sharegpt)")
    parser.add_argument("--systems", help="comma-separated labels: run only these systems of the claim(s)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0, help="seeds are first-seed .. first-seed + seeds - 1")
    parser.add_argument("--rates", help="comma-separated arrival rates instead of each claim's own sweep")
    parser.add_argument(
        "--duration",
        type=float,
        help="simulated seconds of arrivals per run, over the claim's own (default: the claim's, else 300)",
    )
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
    parser.add_argument(
        "--trace",
        help=f"run the claim(s) on this trace instead (e.g. {HELD_OUT}: the predictor's held-out ShareGPT first "
        "turns, with text, for predictor-online)",
    )
    parser.add_argument(
        "--combine",
        help="comma-separated JSON files of earlier runs of PAPER (other seeds, rates or systems): merge their rows, "
        "judge capacities on the merged rows (rates every seed ran) and write <out>/<name>.json",
    )
    parser.add_argument("--name", help="base name of the files written (default: from the paper and the options)")
    args = parser.parse_args(argv)
    if args.combine:
        merged = combine([Path(p) for p in args.combine.split(",")])
        if merged["paper"] != args.paper:
            parser.error(f"--combine files are runs of {merged['paper']}, not {args.paper}")
        seeds = sorted({s for c in merged["claims"] for s in c["setup"]["seeds"]})
        name = args.name or f"{args.paper}_merged_seeds{seeds[0]}-{seeds[-1]}"
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for res in merged["claims"]:
            plot(res, out / f"{name}_{res['claim']}.png")
            print(claim_tables(res), flush=True)
            print(flush=True)
        (out / f"{name}.json").write_text(json.dumps(merged, indent=1, default=str))
        return merged
    if args.cause:
        if args.paper != "scls":
            parser.error("--cause is measured for scls only")
        return {"paper": "scls", "cause": scls_cause()}
    claims = PAPERS[args.paper]()
    name = args.paper
    if args.claim:
        known = [c.name for c in claims]
        if args.claim not in known:
            parser.error(f"--claim must be one of {', '.join(known)} for {args.paper}, got {args.claim!r}")
        claims = [c for c in claims if c.name == args.claim]
        name = f"{name}_{args.claim}"
    if args.regroup:
        if args.paper != "econoserve":
            parser.error("--regroup is measured for econoserve only")
        try:
            factors = tuple(float(f) for f in args.regroup.split(","))
        except ValueError:
            parser.error(f"--regroup must be comma-separated numbers, got {args.regroup!r}")
        claims, name = _econoserve_regroup(factors), "econoserve_regroup"
    if args.systems:
        wanted = set(args.systems.split(","))
        known = {s.label for c in claims for s in c.systems}
        if not wanted <= known:
            parser.error(f"--systems must name systems of the claim: {', '.join(sorted(known))}")
        # the comparisons need both sides; a partial run reports no capacity ratio
        claims = [
            replace(c, systems=tuple(s for s in c.systems if s.label in wanted), comparisons=(), rule=None)
            for c in claims
        ]
        name = f"{name}_{'-'.join(sorted(wanted))}"
    if args.rates:
        try:
            rates = tuple(sorted(float(r) for r in args.rates.split(",")))
        except ValueError:
            parser.error(f"--rates must be comma-separated numbers, got {args.rates!r}")
        claims = [replace(c, rates=rates) for c in claims]
        name = f"{name}_{'-'.join(f'{r:g}' for r in rates)}"  # beside, not over, the full sweep's file
    if args.trace:
        # NOTE: a text trace is counted in the predictor's tokens, the unit its predictions are in
        claims = [replace(c, trace=args.trace, predictor_tokens=True) for c in claims]
        name = f"{name}_{args.trace}"
    if args.length_source:
        known = ("oracle", "noisy_oracle", "max_tokens")
        src = args.length_source
        if src not in known and not is_predictor_source(src) and not is_online_source(src):
            parser.error(
                f"--length-source must be one of {', '.join(known)}, predictor[:DIR] or predictor-online[:DIR]"
            )
        claims = [with_length_source(c, args.length_source) for c in claims]
        name = f"{name}_{args.length_source.split(':')[0]}"
    if args.duration is not None and not args.quick:
        claims = [replace(c, duration_s=args.duration) for c in claims]
    if args.quick:
        setup, seeds = Setup(60.0, args.warmup, 30), [0]
    else:
        setup = Setup(args.duration or 300.0, args.warmup, args.min_requests)
        seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    if args.first_seed and not args.quick:
        name = f"{name}_seeds{seeds[0]}-{seeds[-1]}"
    name = args.name or name
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
