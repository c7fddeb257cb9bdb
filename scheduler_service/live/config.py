"""The live scheduler's one configuration dataclass (logged in full at start): the deployment
description it shares with the simulator (`Deployment`: one default and one meaning per setting)
plus its own settings. The `sluice scheduler` and `sluice serve` flags and SLUICE_* variables are
generated from it."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_service.cluster.deployment import Deployment
from sluice.common.config import opt


@dataclass
class LiveConfig(Deployment):
    """The live scheduler: the deployment (cluster/deployment.py, shared with the simulator) plus
    what only a live scheduler has: the predictor, admission, timeouts, reconnects."""

    default_max_tokens: int = opt(
        256, "max_tokens of a request that sets none (capped by the context left; GetServerInfo advertises it)"
    )
    max_prompt_bytes: int | None = opt(
        None, "largest text prompt in bytes, checked before tokenizing; none: 32 per token of the longest prompt served"
    )
    predictor: str | None = opt(
        None, "HOST:PORT of a length predictor service; none: the client's predicted length, else max_tokens"
    )
    predictor_timeout_ms: float = opt(
        200.0, "an answer later than this is dropped; no request waits for it (live/predictor_link.py)"
    )
    predictor_model: str | None = opt(None, "the served model's name as the predictor knows it; none: the workers'")
    profile: str | None = opt(None, "a `sluice profile` JSON of the workers: the fitted cost model; none: analytic")
    transfer_blocks_per_chunk: int = opt(0, "disaggregated: KV blocks per streamed chunk; 0: the worker picks (~4 MiB)")
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
    tokenizer: str | None = opt(None, "tokenizer.json for text prompts; none: the model's (as the worker loads it)")
    record_step_shapes: bool = opt(
        False, "keep each step's BatchShape in the loop's step log (cost-model calibration)", flag=False
    )
