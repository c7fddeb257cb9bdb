"""The live scheduler's one configuration dataclass (logged in full at start). Its defaults for
the serving limits are those of `sluice.contract.limits`, the same as the simulator's; the
`sluice scheduler` and `sluice serve` flags and SLUICE_* variables are generated from it."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.common.config import opt
from sluice.contract.limits import DEFAULT_MAX_NUM_SEQS


@dataclass
class LiveConfig:
    policy: str = opt("vllm", "policy[:key=value,...] as registered in scheduler_service.policies")
    router: str = opt("round_robin", "router[:key=value,...] as registered in scheduler_service.routers")
    max_num_seqs: int = opt(DEFAULT_MAX_NUM_SEQS, "sequences per step and worker")
    max_num_batched_tokens: int | None = opt(
        None, "tokens per step and worker (a policy's budget may be smaller); none: max(8192, max_model_len)"
    )
    max_model_len: int | None = opt(None, "context length limit; none: the smallest the workers report")
    max_waiting: int = opt(256, "requests waiting for admission, all workers; beyond it RESOURCE_EXHAUSTED")
    max_offline_waiting: int = opt(
        4096,
        "offline-class requests queued behind online work, all workers (never refused for an SLO; they use the "
        "seats online requests leave idle and give way to them: scheduler_service/core/offline.py); beyond it "
        "RESOURCE_EXHAUSTED; 0: offline requests queue as online ones do, within max_waiting",
    )
    default_max_tokens: int = opt(
        256, "max_tokens of a request that sets none (capped by the context left; GetServerInfo advertises it)"
    )
    max_prompt_bytes: int | None = opt(
        None, "largest text prompt in bytes, checked before tokenizing; none: 32 per token of the longest prompt served"
    )
    queue_timeout_s: float | None = opt(None, "a request not admitted within this many seconds ends as timed out")
    predictor: str | None = opt(
        None, "HOST:PORT of a length predictor service; none: the client's predicted length, else max_tokens"
    )
    predictor_timeout_ms: float = opt(
        200.0, "an answer later than this is dropped; no request waits for it (live/predictor_link.py)"
    )
    predictor_model: str | None = opt(None, "the served model's name as the predictor knows it; none: the workers'")
    tbt_slo_s: float | None = opt(None, "the deployment's TBT SLO in seconds, for the policies that plan with one")
    profile: str | None = opt(None, "a `sluice profile` JSON of the workers: the fitted cost model; none: analytic")
    int8_swap: bool = opt(False, "int8-compress swapped KV (where the workers support it)")
    prefix_caching: bool = opt(True, "automatic prefix caching: reuse the KV of full blocks a request shares")
    overlap: bool = opt(
        True, "plan each worker's next step while it runs the current one (overlapped scheduling; --no-overlap: off)"
    )
    transfer_timeout_s: float = opt(
        10.0, "disaggregated: a KV transfer not done in this many seconds is given up (the decode worker recomputes)"
    )
    transfer_blocks_per_chunk: int = opt(0, "disaggregated: KV blocks per streamed chunk; 0: the worker picks (~4 MiB)")
    int8_transfer: bool = opt(False, "disaggregated: int8-compress the KV moved between workers (where supported)")
    retry_after_s: float = opt(0.5, "the RetryInfo delay given with RESOURCE_EXHAUSTED")
    admission: str = opt(
        "slo",
        "slo: refuse (RESOURCE_EXHAUSTED) an online request whose TTFT or TBT SLO the queue and the workers' "
        "measured speed say cannot be met (scheduler_service/core/admission.py); off: admit up to max_waiting",
    )
    # NOTE: measured steps vary (the scheduler's own work, other processes on the cores): an
    # estimate right at the SLO is met about half the time, so it must fit with room to spare.
    admission_headroom: float = opt(0.75, "admission: the estimate must fit within this share of each SLO")
    step_timeout_s: float = opt(30.0, "a worker that takes longer for one step is treated as lost")
    connect_timeout_s: float = opt(60.0, "seconds for Info + Warmup of one worker")
    probe_interval_s: float = opt(
        5.0, "an idle worker is probed (Health, renewing its lease) this often; at most a quarter of its lease"
    )
    reconnect_min_s: float = opt(0.2, "first delay before dialling a lost worker again")
    reconnect_max_s: float = opt(5.0, "the reconnect delay doubles up to this")
    num_gpu_blocks: int | None = opt(None, "KV blocks per worker; none: the worker measures (or its own flag)")
    swap_space_gib: float = opt(0.0, "host swap space per worker in GiB; 0: the worker's own default")
    gpu_memory_utilization: float = opt(0.0, "share of accelerator memory a worker may use; 0: the worker's default")
    tokenizer: str | None = opt(None, "tokenizer.json for text prompts; none: the model's (as the worker loads it)")
    record_step_shapes: bool = opt(
        False, "keep each step's BatchShape in the loop's step log (cost-model calibration)", flag=False
    )
