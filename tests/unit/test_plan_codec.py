"""The plan codec round-trips every StepPlan and StepResult shape through real proto bytes,
and decoding rejects malformed messages with an error that names the field."""

from __future__ import annotations

import dataclasses

import pytest

from sluice.contract.plan import (
    CachedRequestData,
    KVMove,
    KVMoveKind,
    NewRequestData,
    StepError,
    StepPlan,
    StepResult,
    new_request_data,
)
from sluice.contract.plan_codec import (
    TOKEN_BUDGET_KEY,
    PlanReceiver,
    PlanSender,
    plan_from_proto,
    plan_to_proto,
    result_from_proto,
    result_to_proto,
    sampling_from_proto,
    sampling_to_proto,
)
from sluice.contract.sampling import InvalidRequestError, SamplingParams
from sluice.v1 import common_pb2, worker_pb2

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _over_the_wire_plan(plan: StepPlan, worker_id: int = 0) -> StepPlan:
    data = plan_to_proto(plan).SerializeToString()
    return plan_from_proto(worker_pb2.ExecuteRequest.FromString(data), worker_id=worker_id)


def _over_the_wire_result(result: StepResult) -> StepResult:
    data = result_to_proto(result).SerializeToString()
    return result_from_proto(worker_pb2.ExecuteResponse.FromString(data))


def _new(rid: str, prompt: tuple[int, ...], blocks: tuple[int, ...], **kw) -> NewRequestData:
    return NewRequestData(
        request_id=rid,
        prompt_token_ids=prompt,
        num_tokens=len(prompt),
        sampling=kw.pop("sampling", SamplingParams()),
        block_ids=blocks,
        **kw,
    )


def _plan(**kw) -> StepPlan:
    fields = {
        "step_id": 7,
        "worker_id": 2,
        "new_requests": (),
        "cached_requests": CachedRequestData(),
        "num_scheduled_tokens": {},
        "sample_ids": frozenset(),
    }
    fields.update(kw)
    return StepPlan(**fields)


def test_empty_plan_round_trips() -> None:
    plan = _plan(metadata={})
    assert _over_the_wire_plan(plan, worker_id=2) == plan
    assert plan_to_proto(plan).ByteSize() < 16


def test_plan_with_new_cached_release_and_metadata_round_trips() -> None:
    sampling = SamplingParams(
        temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, max_tokens=64, min_tokens=2, seed=1234, stop=("\n\n",)
    )
    plan = _plan(
        new_requests=(
            _new(
                "a", (1, 2, 3, 4, 5), (0, 1), sampling=sampling, traceparent="00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
            ),
            _new("b", tuple(range(40)), (2, 3, 4), num_computed_tokens=16),
        ),
        cached_requests=CachedRequestData(
            request_ids=("c", "d"), new_block_ids=((9,), ()), resumed=(False, False), num_computed_tokens=(31, 17)
        ),
        num_scheduled_tokens={"a": 5, "b": 24, "c": 1, "d": 1},
        sample_ids=frozenset({"a", "c", "d"}),
        release_ids=("x", "y"),
        token_budget=512,
        metadata={"policy": "sarathi", "chunk": "24"},
    )
    decoded = _over_the_wire_plan(plan, worker_id=2)
    assert decoded == plan
    assert list(decoded.num_scheduled_tokens) == ["a", "b", "c", "d"], "batch order is insertion order"
    assert decoded.new_requests[0].sampling.temperature == 0.7, "float32 on the wire comes back as the decimal sent"
    assert decoded.new_requests[1].num_tokens == 40


def test_resumed_request_after_recompute_keeps_its_output_count() -> None:
    plan = _plan(
        new_requests=(_new("r", tuple(range(30)), (5, 6), num_output_tokens=12),),
        num_scheduled_tokens={"r": 30},
        sample_ids=frozenset({"r"}),
    )
    assert _over_the_wire_plan(plan, worker_id=2).new_requests[0].num_output_tokens == 12


def test_request_back_from_swap_replaces_its_table_with_int8_swap_in() -> None:
    plan = _plan(
        cached_requests=CachedRequestData(
            request_ids=("s", "t"),
            new_block_ids=((10, 11, 12), (4,)),
            resumed=(True, False),
            num_computed_tokens=(40, 3),
        ),
        num_scheduled_tokens={"s": 1, "t": 1},
        sample_ids=frozenset({"s", "t"}),
        kv_moves=(
            KVMove(KVMoveKind.SWAP_OUT, "u", (1, 2), (30, 31), int8=True),
            KVMove(KVMoveKind.SWAP_IN, "s", (20, 21, 22), (10, 11, 12), int8=True),
            KVMove(KVMoveKind.COPY, "t", (3,), (4,)),
        ),
    )
    decoded = _over_the_wire_plan(plan, worker_id=2)
    assert decoded == plan
    assert [m.kind for m in decoded.kv_moves] == [KVMoveKind.SWAP_OUT, KVMoveKind.SWAP_IN, KVMoveKind.COPY]
    assert [m.int8 for m in decoded.kv_moves] == [True, True, False]


def test_token_budget_travels_in_metadata_and_is_taken_out_again() -> None:
    msg = plan_to_proto(_plan(token_budget=2048))
    assert msg.metadata[TOKEN_BUDGET_KEY] == "2048"
    decoded = plan_from_proto(msg)
    assert decoded.token_budget == 2048
    assert TOKEN_BUDGET_KEY not in decoded.metadata


def test_sampling_defaults_fill_unset_optional_fields() -> None:
    assert sampling_from_proto(common_pb2.SamplingParams()) == SamplingParams()
    assert sampling_from_proto(common_pb2.SamplingParams(temperature=0.0)).is_greedy


def test_sampling_round_trips_every_field() -> None:
    params = SamplingParams(
        temperature=1.3,
        top_p=0.95,
        top_k=5,
        min_p=0.1,
        max_tokens=9,
        min_tokens=3,
        seed=2**63 + 5,
        stop=("END", "."),
        stop_token_ids=(2, 7),
        ignore_eos=True,
        presence_penalty=-1.5,
        frequency_penalty=0.25,
        repetition_penalty=1.1,
        skip_special_tokens=False,
    )
    assert sampling_from_proto(common_pb2.SamplingParams.FromString(sampling_to_proto(params).SerializeToString())) == (
        params
    )


@pytest.mark.parametrize(
    ("msg", "field"),
    [
        (common_pb2.SamplingParams(top_p=0.0), "sampling_params.top_p"),
        (common_pb2.SamplingParams(temperature=-1.0), "sampling_params.temperature"),
        (common_pb2.SamplingParams(max_tokens=0), "sampling_params.max_tokens"),
        (common_pb2.SamplingParams(max_tokens=4, min_tokens=5), "sampling_params.min_tokens"),
        (common_pb2.SamplingParams(n=2), "sampling_params.n"),
    ],
)
def test_invalid_sampling_names_the_field(msg: common_pb2.SamplingParams, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        sampling_from_proto(msg)
    assert info.value.field == field


def test_invalid_sampling_inside_a_plan_names_the_request() -> None:
    msg = worker_pb2.ExecuteRequest(
        new_requests=[worker_pb2.NewRequest(request_id="q7", sampling_params=common_pb2.SamplingParams(top_p=2.0))]
    )
    with pytest.raises(InvalidRequestError) as info:
        plan_from_proto(msg)
    assert info.value.field == "new_requests[q7].sampling_params.top_p"


@pytest.mark.parametrize(
    ("msg", "field"),
    [
        (
            worker_pb2.ExecuteRequest(scheduled_ids=["a", "b"], num_scheduled_tokens=[1], sample=[True, True]),
            "num_scheduled_tokens",
        ),
        (worker_pb2.ExecuteRequest(scheduled_ids=["a"], num_scheduled_tokens=[1], sample=[]), "sample"),
        (
            worker_pb2.ExecuteRequest(scheduled_ids=["a", "a"], num_scheduled_tokens=[1, 1], sample=[True, True]),
            "scheduled_ids",
        ),
        (
            worker_pb2.ExecuteRequest(cached_requests=worker_pb2.CachedRequests(request_ids=["a"], resumed=[False])),
            "cached_requests.new_block_ids",
        ),
        (worker_pb2.ExecuteRequest(kv_moves=[worker_pb2.KvMove(request_id="a")]), "kv_moves[0].kind"),
        (
            worker_pb2.ExecuteRequest(kv_moves=[worker_pb2.KvMove(kind=1, src_block_ids=[1, 2], dst_block_ids=[3])]),
            "kv_moves[0].dst_block_ids",
        ),
        (worker_pb2.ExecuteRequest(new_requests=[worker_pb2.NewRequest()]), "new_requests.request_id"),
    ],
)
def test_malformed_plan_names_the_field(msg: worker_pb2.ExecuteRequest, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        plan_from_proto(msg)
    assert info.value.field == field


def test_duplicate_scheduled_id_is_named_in_the_message() -> None:
    msg = worker_pb2.ExecuteRequest(scheduled_ids=["a", "dup", "dup"], num_scheduled_tokens=[1, 1, 1], sample=[1, 1, 1])
    with pytest.raises(InvalidRequestError, match="'dup'"):
        plan_from_proto(msg)


def test_step_result_round_trips_with_timings() -> None:
    result = StepResult(
        step_id=41,
        sampled_token_ids={"a": 17, "b": 0, "c": 31999},
        total_s=0.0125,
        forward_s=0.01,
        swap_s=0.001,
        sample_s=0.0005,
        prepare_s=0.0002,
        swap_bytes=3 * 2**20,
    )
    decoded = _over_the_wire_result(result)
    assert decoded == result
    assert list(decoded.sampled_token_ids) == ["a", "b", "c"]


def test_failed_step_round_trips_its_error() -> None:
    result = StepResult(
        step_id=3,
        sampled_token_ids={},
        total_s=0.0,
        error=StepError("INVALID_ARGUMENT", "block id 999 out of range [0, 64)", request_id="b"),
    )
    assert _over_the_wire_result(result) == result
    assert _over_the_wire_result(StepResult(step_id=4, sampled_token_ids={}, total_s=0.0)).error is None


def _decode_heavy_plan(num_seqs: int) -> StepPlan:
    ids = tuple(f"req-{i:05d}" for i in range(num_seqs))
    return _plan(
        cached_requests=CachedRequestData(
            request_ids=ids,
            new_block_ids=tuple((i,) if i % 16 == 0 else () for i in range(num_seqs)),
            resumed=(False,) * num_seqs,
            num_computed_tokens=tuple(500 + i for i in range(num_seqs)),
        ),
        num_scheduled_tokens=dict.fromkeys(ids, 1),
        sample_ids=frozenset(ids),
        token_budget=512,
    )


def test_a_256_sequence_decode_step_round_trips_in_both_forms() -> None:
    plan = _decode_heavy_plan(256)
    full = plan_to_proto(plan)
    repeated = plan_to_proto(plan, same_scheduled_ids=True)
    ids = list(plan.num_scheduled_tokens)
    assert plan_from_proto(worker_pb2.ExecuteRequest.FromString(full.SerializeToString()), worker_id=2) == plan
    wire = worker_pb2.ExecuteRequest.FromString(repeated.SerializeToString())
    assert plan_from_proto(wire, worker_id=2, previous_ids=ids) == plan
    assert not repeated.scheduled_ids and repeated.ByteSize() < full.ByteSize() - 256 * len("req-00000")


def _steady(step_id: int, ids: tuple[str, ...], sample: tuple[str, ...] | None = None) -> StepPlan:
    return _plan(
        step_id=step_id,
        num_scheduled_tokens=dict.fromkeys(ids, 1),
        sample_ids=frozenset(ids if sample is None else sample),
    )


def _answer(plan: StepPlan) -> StepResult:
    """Tokens in an order unlike the step's, as an engine's dict may come."""
    return StepResult(plan.step_id, {rid: 100 + i for i, rid in reversed(list(enumerate(plan.sample_ids)))}, 0.01)


def test_steady_decode_steps_leave_ids_out_both_ways_and_decode_to_the_same_steps() -> None:
    sender, receiver = PlanSender(), PlanReceiver(worker_id=2)
    ids = tuple(f"r{i}" for i in range(64))
    for step_id, plan in enumerate([_steady(1, ids), _steady(2, ids), _steady(3, ids)], start=1):
        msg = sender.encode(plan)
        assert msg.same_scheduled_ids == (step_id > 1)
        assert bool(msg.scheduled_ids) == (step_id == 1)
        assert receiver.decode(worker_pb2.ExecuteRequest.FromString(msg.SerializeToString())) == plan
        answer = receiver.encode(_answer(plan))
        assert not answer.sampled_ids, "tokens come back in step order, without ids"
        assert list(answer.token_ids) == [_answer(plan).sampled_token_ids[rid] for rid in ids]
        assert sender.decode(worker_pb2.ExecuteResponse.FromString(answer.SerializeToString()), plan) == _answer(plan)


def test_a_changed_batch_lists_its_ids_again() -> None:
    sender = PlanSender()
    sender.encode(_steady(1, ("a", "b", "c")))
    for step_id, ids in enumerate([("a", "c"), ("c", "a"), ("c", "a", "d")], start=2):
        msg = sender.encode(_steady(step_id, ids))
        assert not msg.same_scheduled_ids and list(msg.scheduled_ids) == list(ids), ids


def test_after_a_failed_step_the_sender_lists_its_ids_again() -> None:
    sender = PlanSender()
    plan = _steady(1, ("a", "b"))
    sender.encode(plan)
    failed = result_to_proto(StepResult(1, {}, 0.0, error=StepError("INVALID_ARGUMENT", "bad", "a")))
    assert sender.decode(failed, plan).error is not None
    assert not sender.encode(_steady(2, ("a", "b"))).same_scheduled_ids


def test_a_result_that_does_not_sample_the_steps_requests_keeps_its_ids() -> None:
    receiver = PlanReceiver()
    plan = _steady(1, ("a", "b", "c"), sample=("a", "c"))
    receiver.decode(plan_to_proto(plan))
    odd = StepResult(1, {"a": 5, "b": 6}, 0.0)  # b sampled, c did not: not the step's order
    answer = receiver.encode(odd)
    assert list(answer.sampled_ids) == ["a", "b"]
    assert result_from_proto(answer, plan).sampled_token_ids == {"a": 5, "b": 6}


def test_step_ordered_tokens_need_the_plan_and_the_right_count() -> None:
    plan = _steady(1, ("a", "b"))
    answer = worker_pb2.ExecuteResponse(step_id=1, token_ids=[5, 6])
    with pytest.raises(InvalidRequestError, match="sampled_ids"):
        result_from_proto(answer)
    short = worker_pb2.ExecuteResponse(step_id=1, token_ids=[5])
    with pytest.raises(InvalidRequestError, match="token_ids"):
        result_from_proto(short, plan)


def test_repeating_ids_needs_a_decoded_previous_step_on_the_stream() -> None:
    receiver = PlanReceiver()
    with pytest.raises(InvalidRequestError, match="same_scheduled_ids"):
        receiver.decode(plan_to_proto(_steady(1, ("a",)), same_scheduled_ids=True))
    receiver.decode(plan_to_proto(_steady(1, ("a",))))
    uneven = plan_to_proto(_steady(2, ("a",)), same_scheduled_ids=True)
    uneven.num_scheduled_tokens.append(1)
    with pytest.raises(InvalidRequestError, match="num_scheduled_tokens"):
        receiver.decode(uneven)
    with pytest.raises(InvalidRequestError, match="same_scheduled_ids"):
        receiver.decode(plan_to_proto(_steady(3, ("a",)), same_scheduled_ids=True))  # the failed one reset it


def test_the_cheap_new_request_builder_gives_the_dataclass_it_builds():
    """`new_request_data` (what the scheduler's plan writer builds with) bypasses the frozen
    dataclass's `__init__`: the value must be the one `__init__` makes, still frozen, equal,
    hashable alike and encoded alike."""
    sampling = SamplingParams(max_tokens=9, temperature=0.5, seed=3)
    args = ("r7", (5, 6, 7), 3, sampling, (4, 1), 2, 1, TRACEPARENT)
    built, made = new_request_data(*args), NewRequestData(*args)
    assert type(built) is NewRequestData
    assert built == made and hash(built) == hash(made)
    assert tuple(getattr(built, f.name) for f in dataclasses.fields(built)) == args
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.num_tokens = 4  # type: ignore[misc]
    plan = _plan(new_requests=(built,))
    assert _over_the_wire_plan(plan).new_requests == (made,)
