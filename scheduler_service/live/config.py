"""The live scheduler's one configuration dataclass (logged in full at start)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LiveConfig:
    policy: str = "vllm"  # name[:key=value,...] as registered in scheduler_service.policies
    router: str = "round_robin"  # name[:key=value,...] as registered in scheduler_service.router
    max_num_seqs: int = 64  # sequences per step and worker
    max_num_batched_tokens: int = 512  # tokens per step and worker (a policy's budget may be smaller)
    max_model_len: int | None = None  # None: the smallest the workers report
    max_waiting: int = 256  # requests waiting for admission, all workers; beyond: RESOURCE_EXHAUSTED
    default_max_tokens: int = 256  # when a request sets none (capped by the context left)
    queue_timeout_s: float | None = None  # a request never admitted within this ends as timed out
    retry_after_s: float = 0.5  # the RetryInfo delay given with RESOURCE_EXHAUSTED
    step_timeout_s: float = 30.0  # a worker that takes longer for one step is treated as lost
    connect_timeout_s: float = 60.0  # Info + Warmup of one worker
    reconnect_min_s: float = 0.2  # first delay before dialling a lost worker again
    reconnect_max_s: float = 5.0  # the delay doubles up to this
    num_gpu_blocks: int | None = None  # KV blocks per worker; None: the worker measures (or its flag)
    swap_space_gib: float = 0.0  # host swap per worker; 0: the worker's own default
    gpu_memory_utilization: float = 0.0  # 0: the worker's own default
    tokenizer: str | None = None  # tokenizer.json for text prompts; None: the model's (as the worker)
    record_step_shapes: bool = False  # keep each step's BatchShape in the loop's step log (calibration)
