"""StepPlan (scheduler -> worker) and StepResult (worker -> scheduler).

A plan says how many tokens each request advances this step (`num_scheduled_tokens`: a
prefill chunk and a decode are the same thing with different counts). Requests the
worker has not seen are sent once in full (`NewRequestData`); known ones get a
column-oriented diff (`CachedRequestData`). A worker runs a step as: releases, KV moves
in order, then one forward pass over all scheduled tokens, then sampling for
`sample_ids`. Frozen, slotted dataclasses; proto conversion lives at the service edge.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import IntEnum
from typing import Any

from sluice.contract.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class NewRequestData:
    request_id: str
    prompt_token_ids: tuple[int, ...]  # empty in the simulator, which only counts tokens
    num_tokens: int  # tokens known: prompt, plus generated ones when resuming a recompute
    sampling: SamplingParams
    block_ids: tuple[int, ...]
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    traceparent: str = ""


_NEW_REQUEST_FIELDS = (
    "request_id",
    "prompt_token_ids",
    "num_tokens",
    "sampling",
    "block_ids",
    "num_computed_tokens",
    "num_output_tokens",
    "traceparent",
)
if tuple(f.name for f in fields(NewRequestData)) != _NEW_REQUEST_FIELDS:
    raise TypeError("new_request_data() sets NewRequestData's fields by name: list them all, in order")
_make = object.__new__
_set_id, _set_prompt, _set_num, _set_sampling, _set_blocks, _set_computed, _set_outputs, _set_trace = (
    getattr(NewRequestData, name).__set__ for name in _NEW_REQUEST_FIELDS
)


def new_request_data(
    request_id: str,
    prompt_token_ids: tuple[int, ...],
    num_tokens: int,
    sampling: SamplingParams,
    block_ids: tuple[int, ...],
    num_computed_tokens: int,
    num_output_tokens: int,
    traceparent: str,
) -> NewRequestData:
    """`NewRequestData(...)` with every field given, at half the cost: a frozen dataclass's
    generated `__init__` sets each field through `object.__setattr__` (a global lookup and a
    call each), where the slots' own descriptors set them directly. The scheduler builds one
    per request it sends in full, and a queue policy admits a dozen a step."""
    data = _make(NewRequestData)
    _set_id(data, request_id)
    _set_prompt(data, prompt_token_ids)
    _set_num(data, num_tokens)
    _set_sampling(data, sampling)
    _set_blocks(data, block_ids)
    _set_computed(data, num_computed_tokens)
    _set_outputs(data, num_output_tokens)
    _set_trace(data, traceparent)
    return data


@dataclass(frozen=True, slots=True)
class CachedRequestData:
    """Known requests whose block table changed this step (grew, or was replaced on a
    swap-in); entry i of every column belongs to request_ids[i]."""

    request_ids: tuple[str, ...] = ()
    new_block_ids: tuple[tuple[int, ...], ...] = ()
    resumed: tuple[bool, ...] = ()  # True: new_block_ids replaces the table (back from swap)
    num_computed_tokens: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.request_ids)


class KVMoveKind(IntEnum):
    SWAP_OUT = 1  # GPU -> CPU
    SWAP_IN = 2  # CPU -> GPU
    COPY = 3  # GPU -> GPU


@dataclass(frozen=True, slots=True)
class KVMove:
    kind: KVMoveKind
    request_id: str
    src_block_ids: tuple[int, ...]
    dst_block_ids: tuple[int, ...]
    int8: bool = False

    @property
    def num_blocks(self) -> int:
        return len(self.src_block_ids)


@dataclass(frozen=True, slots=True)
class StepPlan:
    step_id: int
    worker_id: int
    new_requests: tuple[NewRequestData, ...]
    cached_requests: CachedRequestData
    num_scheduled_tokens: Mapping[str, int]  # batch order = insertion order
    sample_ids: frozenset[str]
    release_ids: tuple[str, ...] = ()
    kv_moves: tuple[KVMove, ...] = ()
    token_budget: int = 0  # the policy's budget this step (compute utilization = tokens / budget)
    metadata: Mapping[str, Any] = field(default_factory=dict)  # policy extras; workers ignore them
    # Overlap: the step still in flight when this plan was made (0: none). Its sampled tokens are
    # this step's inputs, which the worker knows; if that step failed, this one is void.
    follows_step_id: int = 0

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens and not self.kv_moves and not self.release_ids


@dataclass(frozen=True, slots=True)
class StepError:
    code: str  # INVALID_ARGUMENT, INTERNAL, RESOURCE_EXHAUSTED, UNAVAILABLE
    message: str
    request_id: str = ""


@dataclass(frozen=True, slots=True)
class StepResult:
    step_id: int
    sampled_token_ids: Mapping[str, int]
    total_s: float  # wall (live) or cost-model (simulated) duration of the whole step
    forward_s: float = 0.0
    swap_s: float = 0.0
    sample_s: float = 0.0
    prepare_s: float = 0.0
    swap_bytes: int = 0
    error: StepError | None = None


@dataclass(frozen=True, slots=True)
class KVTransfer:
    """One request's KV moving between workers (disaggregated prefill and decode): the
    scheduler reserved `dst_block_ids` on the decode worker before issuing it and frees
    `src_block_ids` on the prefill worker once it is answered. Entry i of the source table
    lands in entry i of the destination table; `num_tokens` of KV are valid."""

    transfer_id: int
    request_id: str
    src_worker: int
    dst_worker: int
    src_block_ids: tuple[int, ...]
    dst_block_ids: tuple[int, ...]
    num_tokens: int
    int8: bool = False

    @property
    def num_blocks(self) -> int:
        return len(self.src_block_ids)


@dataclass(frozen=True, slots=True)
class KVTransferResult:
    """How a KVTransfer ended: `ok` False (an error, a timeout, a lost worker) makes the
    scheduler recompute the request's prefill on the decode worker instead."""

    transfer_id: int
    ok: bool
    total_s: float
    nbytes: int = 0
    error: str = ""
