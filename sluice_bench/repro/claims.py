"""The papers' claims as data: each paper's systems, its baseline, its rates, its capacity rule,
the paper's number and the two labelled comparisons (published vs published, equal-engine
ablation). `PAPERS` maps a paper to its claims; `benchmarks/repro.py` runs them (see its --help).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from scheduler_service.sim.capacity import SLORule

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
    """The paper's capacity criterion over a run's steady-state metrics: a claim's reading of
    `sluice capacity`'s rules (scheduler_service/sim/capacity.py), whose bound may be relative
    (norm_latency: `threshold` x the baseline's idle normalized latency, measured per claim)."""

    name: str  # sarathi | norm_latency | attainment
    threshold: float | None = None  # norm_latency: x the baseline's idle normalized latency

    def holds(self, m: dict[str, Any], bound: float | None) -> bool:
        """`bound`: the TBT SLO (sarathi) or the normalized-latency bound this claim's threshold
        gives (norm_latency); the check itself is `sluice capacity`'s (SLORule)."""
        if self.name == "sarathi":
            assert bound is not None
            return SLORule("sarathi", None).holds_for(m, bound, m["queue_p50_s"])
        if self.name == "norm_latency":
            assert bound is not None
            return SLORule("norm_latency", bound).holds_for(m, None)
        return SLORule("attainment", float(self.threshold or 0.0)).holds_for(m, None)

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
