"""The scheduler <-> worker wire: core dataclasses to and from the `sluice.v1` worker protos.

    scheduler                                   worker
    StepPlan   --plan_to_proto-->   ExecuteRequest   --plan_from_proto-->   StepPlan
    StepResult <-result_from_proto- ExecuteResponse  <-result_to_proto---   StepResult

Both sides import this module, so it stays torch-free. Decoding is where untrusted bytes
become domain objects: every shape check that the dataclasses cannot express (column
lengths, duplicate ids, enum values, sampling ranges) raises `InvalidRequestError` naming
the proto field, which the worker turns into a `StepError` without touching its engine.

One Execute stream carries a little state on each end (`PlanSender`, `PlanReceiver`): a
step that schedules the same requests in the same order as the previous one (every
steady decode step) sets `same_scheduled_ids` instead of listing the ids, and the worker
answers its tokens in step order without the ids. At 256 decoding sequences that takes
the two messages from about 1.9 kB to 0.5 kB and 0.4 kB, and the codec's Python work on
both sides down by about half. The stateless functions below speak the full form, which
every receiver also accepts.

Fields the proto does not carry travel as follows: `StepPlan.worker_id` is the receiver's
own id (given to `plan_from_proto`), `StepPlan.token_budget` rides in `metadata` under
`TOKEN_BUDGET_KEY`, `NewRequestData.num_tokens` is the length of the prompt ids, and
`SamplingParams.extra` stays on the scheduler.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from itertools import compress

from sluice.contract.plan import (
    CachedRequestData,
    KVMove,
    KVMoveKind,
    NewRequestData,
    StepError,
    StepPlan,
    StepResult,
)
from sluice.contract.sampling import InvalidRequestError, SamplingParams
from sluice.v1 import common_pb2, worker_pb2

TOKEN_BUDGET_KEY = "sluice.token_budget"

_DEFAULTS = SamplingParams()
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_INT_FIELDS = ("top_k", "max_tokens", "min_tokens")


# ---------------------------------------------------------------- sampling parameters


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """Every field is set explicitly, so the receiver never depends on our defaults."""
    return common_pb2.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        max_tokens=params.max_tokens,
        min_tokens=params.min_tokens,
        seed=params.seed,
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        skip_special_tokens=params.skip_special_tokens,
    )


def _float32_to_decimal(value: float) -> float:
    # NOTE: proto floats are 32-bit; 0.7 comes back as 0.699999988. Seven significant
    # digits is float32's precision, so this recovers the decimal the sender meant.
    return float(f"{value:.7g}")


def sampling_from_proto(msg: common_pb2.SamplingParams, prefix: str = "sampling_params") -> SamplingParams:
    """Unset optional fields take the dataclass defaults; the result is validated."""
    if msg.HasField("n") and msg.n != 1:
        raise InvalidRequestError(f"{prefix}.n", f"only n=1 is supported, got {msg.n}")
    kwargs: dict = {}
    for name in _FLOAT_FIELDS:
        if msg.HasField(name):
            kwargs[name] = _float32_to_decimal(getattr(msg, name))
    for name in _INT_FIELDS:
        if msg.HasField(name):
            kwargs[name] = getattr(msg, name)
    if msg.HasField("seed"):
        kwargs["seed"] = msg.seed
    if msg.HasField("skip_special_tokens"):
        kwargs["skip_special_tokens"] = msg.skip_special_tokens
    params = SamplingParams(
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        **kwargs,
    )
    params.validate(prefix)
    return params


# ---------------------------------------------------------------- step plan


def _new_request_to_proto(req: NewRequestData) -> worker_pb2.NewRequest:
    return worker_pb2.NewRequest(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        sampling_params=sampling_to_proto(req.sampling),
        block_ids=req.block_ids,
        num_computed_tokens=req.num_computed_tokens,
        num_output_tokens=req.num_output_tokens,
        traceparent=req.traceparent,
    )


def _cached_to_proto(cached: CachedRequestData) -> worker_pb2.CachedRequests:
    return worker_pb2.CachedRequests(
        request_ids=cached.request_ids,
        new_block_ids=[worker_pb2.BlockIds(ids=ids) for ids in cached.new_block_ids],
        resumed=cached.resumed,
        num_computed_tokens=cached.num_computed_tokens,
    )


def _move_to_proto(move: KVMove) -> worker_pb2.KvMove:
    return worker_pb2.KvMove(
        kind=int(move.kind),
        request_id=move.request_id,
        src_block_ids=move.src_block_ids,
        dst_block_ids=move.dst_block_ids,
        int8=move.int8,
    )


def plan_to_proto(plan: StepPlan, *, same_scheduled_ids: bool = False) -> worker_pb2.ExecuteRequest:
    """`same_scheduled_ids`: the caller knows the receiver's previous step scheduled the same
    ids in the same order (PlanSender does), so they are left out."""
    scheduled = plan.num_scheduled_tokens
    metadata = {str(k): str(v) for k, v in plan.metadata.items()}
    if plan.token_budget:
        metadata[TOKEN_BUDGET_KEY] = str(plan.token_budget)
    return worker_pb2.ExecuteRequest(
        step_id=plan.step_id,
        new_requests=[_new_request_to_proto(r) for r in plan.new_requests],
        cached_requests=_cached_to_proto(plan.cached_requests),
        scheduled_ids=() if same_scheduled_ids else scheduled.keys(),
        num_scheduled_tokens=scheduled.values(),
        sample=map(plan.sample_ids.__contains__, scheduled),
        release_ids=plan.release_ids,
        kv_moves=[_move_to_proto(m) for m in plan.kv_moves],
        metadata=metadata,
        follows_step_id=plan.follows_step_id,
        same_scheduled_ids=same_scheduled_ids,
    )


def _new_request_from_proto(msg: worker_pb2.NewRequest) -> NewRequestData:
    if not msg.request_id:
        raise InvalidRequestError("new_requests.request_id", "must not be empty")
    prompt = tuple(msg.prompt_token_ids)
    return NewRequestData(
        request_id=msg.request_id,
        prompt_token_ids=prompt,
        num_tokens=len(prompt),
        sampling=sampling_from_proto(msg.sampling_params, f"new_requests[{msg.request_id}].sampling_params"),
        block_ids=tuple(msg.block_ids),
        num_computed_tokens=msg.num_computed_tokens,
        num_output_tokens=msg.num_output_tokens,
        traceparent=msg.traceparent,
    )


def _check_columns(prefix: str, ids: Sequence[str], columns: Mapping[str, Sequence]) -> None:
    for name, column in columns.items():
        if len(column) != len(ids):
            raise InvalidRequestError(
                f"{prefix}.{name}", f"has {len(column)} entries but {prefix}.request_ids has {len(ids)}"
            )


def _cached_from_proto(msg: worker_pb2.CachedRequests) -> CachedRequestData:
    ids = tuple(msg.request_ids)
    _check_columns(
        "cached_requests",
        ids,
        {"new_block_ids": msg.new_block_ids, "resumed": msg.resumed, "num_computed_tokens": msg.num_computed_tokens},
    )
    return CachedRequestData(
        request_ids=ids,
        new_block_ids=tuple(tuple(b.ids) for b in msg.new_block_ids),
        resumed=tuple(msg.resumed),
        num_computed_tokens=tuple(msg.num_computed_tokens),
    )


def _move_from_proto(index: int, msg: worker_pb2.KvMove) -> KVMove:
    try:
        kind = KVMoveKind(msg.kind)
    except ValueError:
        raise InvalidRequestError(
            f"kv_moves[{index}].kind", f"must be SWAP_OUT, SWAP_IN or COPY, got {msg.kind}"
        ) from None
    if len(msg.src_block_ids) != len(msg.dst_block_ids):
        raise InvalidRequestError(
            f"kv_moves[{index}].dst_block_ids",
            f"has {len(msg.dst_block_ids)} ids but src_block_ids has {len(msg.src_block_ids)}",
        )
    return KVMove(kind, msg.request_id, tuple(msg.src_block_ids), tuple(msg.dst_block_ids), msg.int8)


def scheduled_ids_from_proto(msg: worker_pb2.ExecuteRequest, previous_ids: Sequence[str] | None) -> Sequence[str]:
    """The step's scheduled ids: its own, or with `same_scheduled_ids` the previous step's."""
    if not msg.same_scheduled_ids:
        return msg.scheduled_ids
    if msg.scheduled_ids:
        raise InvalidRequestError("scheduled_ids", "must be empty when same_scheduled_ids is set")
    if previous_ids is None:
        raise InvalidRequestError("same_scheduled_ids", "no previous step on this stream to repeat the ids of")
    return previous_ids


def _scheduled_from_proto(msg: worker_pb2.ExecuteRequest, ids: Sequence[str]) -> tuple[dict[str, int], frozenset[str]]:
    if len(msg.num_scheduled_tokens) != len(ids):
        raise InvalidRequestError(
            "num_scheduled_tokens", f"has {len(msg.num_scheduled_tokens)} entries but scheduled_ids has {len(ids)}"
        )
    if len(msg.sample) != len(ids):
        raise InvalidRequestError("sample", f"has {len(msg.sample)} entries but scheduled_ids has {len(ids)}")
    scheduled = dict(zip(ids, msg.num_scheduled_tokens, strict=True))
    if len(scheduled) != len(ids):
        duplicate = next(rid for rid, n in Counter(ids).items() if n > 1)
        raise InvalidRequestError("scheduled_ids", f"request {duplicate!r} is scheduled twice")
    return scheduled, frozenset(compress(ids, msg.sample))


def plan_from_proto(
    msg: worker_pb2.ExecuteRequest, worker_id: int = 0, previous_ids: Sequence[str] | None = None
) -> StepPlan:
    """Raises InvalidRequestError naming the field when the message is malformed.

    `previous_ids`: the scheduled ids of the previous step on the stream, for a message
    with `same_scheduled_ids` (PlanReceiver keeps them)."""
    scheduled, sample_ids = _scheduled_from_proto(msg, scheduled_ids_from_proto(msg, previous_ids))
    metadata = dict(msg.metadata)
    budget = metadata.pop(TOKEN_BUDGET_KEY, "0")
    return StepPlan(
        step_id=msg.step_id,
        worker_id=worker_id,
        new_requests=tuple(_new_request_from_proto(r) for r in msg.new_requests),
        cached_requests=_cached_from_proto(msg.cached_requests),
        num_scheduled_tokens=scheduled,
        sample_ids=sample_ids,
        release_ids=tuple(msg.release_ids),
        kv_moves=tuple(_move_from_proto(i, m) for i, m in enumerate(msg.kv_moves)),
        token_budget=int(budget) if budget.isdigit() else 0,
        metadata=metadata,
        follows_step_id=msg.follows_step_id,
    )


def step_order(plan: StepPlan) -> list[str]:
    """The plan's sampling requests in scheduled order: the order of step-ordered token ids."""
    return list(filter(plan.sample_ids.__contains__, plan.num_scheduled_tokens))


# ---------------------------------------------------------------- step result


def error_to_proto(error: StepError) -> worker_pb2.StepError:
    return worker_pb2.StepError(code=error.code, message=error.message, request_id=error.request_id)


def error_from_proto(msg: worker_pb2.StepError) -> StepError:
    return StepError(code=msg.code or "UNKNOWN", message=msg.message, request_id=msg.request_id)


def result_to_proto(result: StepResult, order: Sequence[str] | None = None) -> worker_pb2.ExecuteResponse:
    """`order`: the step's sampling requests in scheduled order (`step_order`); when the
    result sampled exactly those, the tokens go in that order without their ids."""
    sampled = result.sampled_token_ids
    ids: Sequence[str] = ()
    tokens: Sequence[int] = ()
    if order is not None and len(order) == len(sampled):
        try:
            tokens = list(map(sampled.__getitem__, order))
        except KeyError:  # it sampled other requests than the step's: say which, with ids
            tokens = ()
    if len(tokens) != len(sampled):
        ids, tokens = list(sampled), list(sampled.values())
    return worker_pb2.ExecuteResponse(
        step_id=result.step_id,
        sampled_ids=ids,
        token_ids=tokens,
        timings=worker_pb2.StepTimings(
            prepare_s=result.prepare_s,
            forward_s=result.forward_s,
            sample_s=result.sample_s,
            swap_s=result.swap_s,
            total_s=result.total_s,
        ),
        error=error_to_proto(result.error) if result.error is not None else None,
        swap_bytes=result.swap_bytes,
    )


def result_from_proto(msg: worker_pb2.ExecuteResponse, plan: StepPlan | None = None) -> StepResult:
    """`plan`: the step this answers, needed when the tokens come in step order (no ids)."""
    if msg.sampled_ids or not msg.token_ids:
        ids: Sequence[str] = msg.sampled_ids
        if len(msg.token_ids) != len(ids):
            raise InvalidRequestError("token_ids", f"has {len(msg.token_ids)} entries but sampled_ids has {len(ids)}")
    elif plan is None:
        raise InvalidRequestError("sampled_ids", "is empty, and step-ordered token_ids need the step's plan")
    else:
        ids = step_order(plan)
        if len(msg.token_ids) != len(ids):
            raise InvalidRequestError(
                "token_ids", f"has {len(msg.token_ids)} entries but step {plan.step_id} sampled {len(ids)} requests"
            )
    t = msg.timings
    return StepResult(
        step_id=msg.step_id,
        sampled_token_ids=dict(zip(ids, msg.token_ids, strict=True)),
        total_s=t.total_s,
        forward_s=t.forward_s,
        swap_s=t.swap_s,
        sample_s=t.sample_s,
        prepare_s=t.prepare_s,
        swap_bytes=msg.swap_bytes,
        error=error_from_proto(msg.error) if msg.HasField("error") else None,
    )


def error_result(step_id: int, code: str, message: str, request_id: str = "") -> StepResult:
    """A failed step: no request advanced."""
    return StepResult(step_id=step_id, sampled_token_ids={}, total_s=0.0, error=StepError(code, message, request_id))


# ---------------------------------------------------------------- one stream's ends


class PlanSender:
    """The scheduler's end of one Execute stream (one per stream; a new stream starts empty)."""

    def __init__(self) -> None:
        self._last_ids: list[str] | None = None

    def encode(self, plan: StepPlan) -> worker_pb2.ExecuteRequest:
        ids = list(plan.num_scheduled_tokens)
        same = bool(ids) and ids == self._last_ids
        self._last_ids = ids
        return plan_to_proto(plan, same_scheduled_ids=same)

    def decode(self, msg: worker_pb2.ExecuteResponse, plan: StepPlan) -> StepResult:
        try:
            result = result_from_proto(msg, plan)
        except ValueError:
            self._last_ids = None
            raise
        if result.error is not None:
            # NOTE: the worker may not have decoded that step (and then has no ids to
            # repeat); the next step lists its ids in full, which every worker accepts.
            self._last_ids = None
        return result


class PlanReceiver:
    """The worker's end of one Execute stream: the previous step's ids and sampling order."""

    def __init__(self, worker_id: int = 0) -> None:
        self.worker_id = worker_id
        self._previous: list[str] | None = None
        self._order: list[str] = []

    def decode(self, msg: worker_pb2.ExecuteRequest) -> StepPlan:
        """Raises InvalidRequestError naming the field; the stream then has no previous step."""
        previous, self._previous, self._order = self._previous, None, []
        plan = plan_from_proto(msg, self.worker_id, previous)
        self._previous = previous if msg.same_scheduled_ids else list(plan.num_scheduled_tokens)
        self._order = step_order(plan)
        return plan

    def forget(self) -> None:
        """A step answered without being decoded (the engine is not ready)."""
        self._previous, self._order = None, []

    def encode(self, result: StepResult) -> worker_pb2.ExecuteResponse:
        """The answer to the step decoded last."""
        return result_to_proto(result, self._order)
