"""How a request leaves the batch before it finishes, and why."""

from __future__ import annotations

from enum import StrEnum


class PreemptionMode(StrEnum):
    RECOMPUTE = "recompute"  # drop KV; prefill prompt + generated tokens again later
    SWAP = "swap"  # copy KV to CPU blocks; copy back later
    KEEP = "keep"  # leave KV on the GPU; just stop scheduling it (EconoServe's offload-free)


class PreemptionReason(StrEnum):
    KV_PRESSURE = "kv_pressure"  # a running request needs a block and none is free
    PRIORITY = "priority"  # a more important request needs the room
    DEADLINE = "deadline"  # a request closer to its deadline needs the room
    SLICE_END = "slice_end"  # the request's time slice or quantum ended (SCLS, MLFQ)
    MISPREDICTION = "misprediction"  # it outran its predicted length (EconoServe, ALISE)
    WORKER_RESET = "worker_reset"  # the worker lost its state (failed step, worker death)


class RejectReason(StrEnum):
    QUEUE_FULL = "queue_full"
    PROMPT_TOO_LONG = "prompt_too_long"  # prompt + max_tokens over the model's context
    DUPLICATE_ID = "duplicate_id"
    EXCEEDS_KV_CAPACITY = "exceeds_kv_capacity"  # the prompt alone needs more blocks than the worker has
    NO_WORKER = "no_worker"
    UNSCHEDULABLE = "unschedulable"  # no policy step could ever place it
    SLO_UNMEETABLE = "slo_unmeetable"  # admission: the queue and the workers' speed say its SLOs will be missed
    OFFLINE_QUEUE_FULL = "offline_queue_full"  # an offline-class request beyond the offline queue's bound
