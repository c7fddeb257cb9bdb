"""Worker-to-worker KV transfer over real gRPC (two in-process tiny-llama workers): a request
prefilled on one worker and decoded on another after OfferKv / PullKv produces exactly the
greedy tokens of serving it on one worker; the bytes arrive intact (int8 within its bound);
only the lease holder starts a transfer and only the one-time token reads the KV; a decode
worker never overwrites a held request's blocks; a prefill worker dying mid-transfer fails
the pull (UNAVAILABLE) and leaves the decode worker serving; a Warmup mid-transfer ends it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import pytest
import torch
from harness import LeasedStub

from sluice.common.grpc_server import CHANNEL_OPTIONS, GrpcServer
from sluice.common.security import ApiKeys, ClientSecurity, ServerSecurity, bearer_metadata
from sluice.contract.plan import CachedRequestData, NewRequestData, StepPlan
from sluice.contract.plan_codec import PlanSender
from sluice.contract.sampling import SamplingParams
from sluice.v1 import worker_pb2, worker_pb2_grpc
from worker_service.engine import EngineConfig, LLMEngine
from worker_service.kv_transfer import TOKEN_KEY, chunk_spans, encode_chunk, parse_chunk
from worker_service.server import EngineRunner, WorkerServerOptions, build_server

torch.set_num_threads(1)

T = TypeVar("T")
NUM_GPU_BLOCKS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
PROMPT = tuple(range(1000, 1040))  # 40 tokens: 3 blocks of 16
NUM_DECODES = 8  # 48 tokens in all: still 3 blocks


class GatedRunner(EngineRunner):
    """The real runner; once `gate` is cleared, a KV read after the first chunk waits for it
    (so a test can kill the worker in the middle of a transfer, deterministically)."""

    def __init__(self, engine: LLMEngine) -> None:
        super().__init__(engine)
        self.gate = asyncio.Event()
        self.gate.set()
        self.held = asyncio.Event()  # a read is waiting at the gate
        self.chunks_read = 0

    async def call_inline(self, fn: Callable[..., T], *args: Any) -> T:
        if getattr(fn, "__name__", "") == "_export":  # KVTransferHandler reading one chunk
            if self.chunks_read and not self.gate.is_set():
                self.held.set()
                await self.gate.wait()
            result = await super().call_inline(fn, *args)
            self.chunks_read += 1
            return result
        return await super().call_inline(fn, *args)


@dataclass
class Worker:
    engine: LLMEngine
    runner: GatedRunner
    server: GrpcServer
    channel: grpc.aio.Channel
    stub: LeasedStub
    raw: worker_pb2_grpc.WorkerServiceStub

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    async def stop(self) -> None:
        await self.channel.close()
        await self.server.server.stop(None)


async def start_worker(worker_id: int, role: int = worker_pb2.WORKER_ROLE_MIXED, api_key: str | None = None) -> Worker:
    """A tiny-llama worker, warmed up; with `api_key`, it requires the key and presents it to peers."""
    engine = LLMEngine(EngineConfig(model="tiny-llama", load_format="dummy", seed=0))
    runner = GatedRunner(engine)
    options = WorkerServerOptions()
    if api_key is not None:
        options = WorkerServerOptions(
            ServerSecurity(api_keys=ApiKeys((api_key,))), peer_security=ClientSecurity(api_key=api_key)
        )
    server = build_server(engine, 0, worker_id=worker_id, runner=runner, options=options)
    await server.start(ready=False)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=CHANNEL_OPTIONS)
    raw = worker_pb2_grpc.WorkerServiceStub(channel)
    bearer = bearer_metadata(api_key)
    warm = await raw.Warmup(
        worker_pb2.WarmupRequest(num_gpu_blocks_override=NUM_GPU_BLOCKS, swap_space_gib=0.001, role=role),
        metadata=bearer,
    )
    return Worker(engine, runner, server, channel, LeasedStub(raw, warm.session_id, bearer), raw)


@pytest.fixture(scope="module")
async def pair() -> AsyncIterator[tuple[Worker, Worker]]:
    prefill = await start_worker(0, worker_pb2.WORKER_ROLE_PREFILL)
    decode = await start_worker(1, worker_pb2.WORKER_ROLE_DECODE)
    yield prefill, decode
    await prefill.stop()
    await decode.stop()


class Steps:
    """One Execute stream, one step in flight, as the scheduler's RemoteWorker drives it."""

    def __init__(self, worker: Worker) -> None:
        self.call = worker.stub.Execute()
        self.sender = PlanSender()
        self.step_id = 0

    async def run(
        self,
        scheduled: dict[str, int],
        sample: Sequence[str],
        new: Sequence[NewRequestData] = (),
        release: Sequence[str] = (),
    ) -> dict[str, int]:
        self.step_id += 1
        plan = StepPlan(
            step_id=self.step_id,
            worker_id=0,
            new_requests=tuple(new),
            cached_requests=CachedRequestData(),
            num_scheduled_tokens=scheduled,
            sample_ids=frozenset(sample),
            release_ids=tuple(release),
        )
        await self.call.write(self.sender.encode(plan))
        answer = await self.call.read()
        result = self.sender.decode(answer, plan)
        assert result.error is None, result.error
        return dict(result.sampled_token_ids)

    async def close(self) -> None:
        await self.call.done_writing()
        assert await self.call.read() is grpc.aio.EOF


async def prefill(steps: Steps, rid: str, blocks: tuple[int, ...]) -> int:
    new = NewRequestData(rid, PROMPT, len(PROMPT), GREEDY, blocks)
    return (await steps.run({rid: len(PROMPT)}, [rid], new=[new]))[rid]


async def decode(steps: Steps, rid: str, num: int) -> list[int]:
    return [(await steps.run({rid: 1}, [rid]))[rid] for _ in range(num)]


async def colocated_tokens(worker: Worker, blocks: tuple[int, ...]) -> list[int]:
    steps = Steps(worker)
    first = await prefill(steps, "colocated", blocks)
    rest = await decode(steps, "colocated", NUM_DECODES)
    await steps.run({}, [], release=["colocated"])
    await steps.close()
    return [first, *rest]


async def transfer(
    src: Worker,
    dst: Worker,
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    int8: bool = False,
    per_chunk: int = 1,
) -> worker_pb2.PullKvResponse:
    offer = await src.stub.OfferKv(worker_pb2.OfferKvRequest(request_id="r", block_ids=src_blocks, int8=int8))
    return await dst.stub.PullKv(
        worker_pb2.PullKvRequest(
            peer_address=src.address, token=offer.token, block_ids=dst_blocks, blocks_per_chunk=per_chunk
        )
    )


def blocks_of(worker: Worker, ids: Sequence[int]) -> torch.Tensor:
    assert worker.engine.cache is not None
    return worker.engine.cache.kv[:, :, list(ids)].clone()


async def test_tokens_identical_colocated_and_disaggregated(pair: tuple[Worker, Worker]) -> None:
    prefill_worker, decode_worker = pair
    expected = await colocated_tokens(prefill_worker, (10, 11, 12))

    p_steps = Steps(prefill_worker)
    first = await prefill(p_steps, "r", (0, 1, 2))
    pulled = await transfer(prefill_worker, decode_worker, (0, 1, 2), (7, 3, 20))
    assert pulled.num_blocks == 3
    assert pulled.nbytes == 3 * prefill_worker.engine.spec.bytes_per_block
    assert torch.equal(blocks_of(decode_worker, (7, 3, 20)), blocks_of(prefill_worker, (0, 1, 2)))
    await p_steps.run({}, [], release=["r"])  # the prefill worker's blocks are freed after the transfer
    await p_steps.close()

    # The decode worker gets the request with its filled table: its first step computes the
    # first token's KV and samples the second (as DisaggCluster hands it over).
    d_steps = Steps(decode_worker)
    new = NewRequestData(
        "r", (*PROMPT, first), len(PROMPT) + 1, GREEDY, (7, 3, 20), num_computed_tokens=len(PROMPT), num_output_tokens=1
    )
    second = (await d_steps.run({"r": 1}, ["r"], new=[new]))["r"]
    rest = await decode(d_steps, "r", NUM_DECODES - 1)
    await d_steps.run({}, [], release=["r"])
    await d_steps.close()
    assert [first, second, *rest] == expected
    assert prefill_worker.engine.num_requests == decode_worker.engine.num_requests == 0


async def test_warmup_sets_the_role_info_reports(pair: tuple[Worker, Worker]) -> None:
    roles = [(await w.raw.Info(worker_pb2.InfoRequest())).capabilities.role for w in pair]
    assert roles == [worker_pb2.WORKER_ROLE_PREFILL, worker_pb2.WORKER_ROLE_DECODE]
    worker = await start_worker(9, worker_pb2.WORKER_ROLE_PREFILL)
    try:
        await worker.stub.Release(worker_pb2.ReleaseRequest(end_lease=True))
        # the role was that session's: the next scheduler's Info must not read it as the worker's
        assert (await worker.raw.Info(worker_pb2.InfoRequest())).capabilities.role == worker_pb2.WORKER_ROLE_MIXED
    finally:
        await worker.stop()


async def test_int8_transfer_is_within_the_quantization_bound(pair: tuple[Worker, Worker]) -> None:
    prefill_worker, decode_worker = pair
    steps = Steps(prefill_worker)
    await prefill(steps, "q", (4, 5, 6))
    pulled = await transfer(prefill_worker, decode_worker, (4, 5, 6), (8, 9, 10), int8=True, per_chunk=2)
    spec = prefill_worker.engine.spec
    assert pulled.nbytes == 3 * spec.int8_bytes_per_block < 3 * spec.bytes_per_block
    sent, got = blocks_of(prefill_worker, (4, 5, 6)), blocks_of(decode_worker, (8, 9, 10))
    # per (layer, K/V, head, dim) channel over a block's tokens: |error| <= (max - min) / 255 / 2
    span = sent.amax(dim=3, keepdim=True) - sent.amin(dim=3, keepdim=True)
    assert torch.all((got - sent).abs() <= span / 255 / 2 + 1e-6)
    assert not torch.equal(got, torch.zeros_like(got))
    await steps.run({}, [], release=["q"])
    await steps.close()


async def test_only_the_one_time_token_reads_the_kv(pair: tuple[Worker, Worker]) -> None:
    prefill_worker, _ = pair
    offer = await prefill_worker.stub.OfferKv(worker_pb2.OfferKvRequest(request_id="t", block_ids=(0, 1)))
    read = worker_pb2.ReadKvRequest(blocks_per_chunk=1)

    async def read_with(metadata: tuple[tuple[str, str], ...]) -> grpc.StatusCode:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in prefill_worker.raw.ReadKv(read, metadata=metadata):
                pass
        return err.value.code()

    assert await read_with(()) == grpc.StatusCode.FAILED_PRECONDITION
    assert await read_with(((TOKEN_KEY, "guessed"),)) == grpc.StatusCode.PERMISSION_DENIED
    chunks = [c async for c in prefill_worker.raw.ReadKv(read, metadata=((TOKEN_KEY, offer.token),))]
    assert [(c.first, c.num_blocks) for c in chunks] == [(0, 1), (1, 1)]
    assert await read_with(((TOKEN_KEY, offer.token),)) == grpc.StatusCode.PERMISSION_DENIED  # read once


async def test_transfers_need_the_lease(pair: tuple[Worker, Worker]) -> None:
    prefill_worker, decode_worker = pair
    offer_req = worker_pb2.OfferKvRequest(request_id="x", block_ids=(0,))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await prefill_worker.raw.OfferKv(offer_req)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await prefill_worker.raw.OfferKv(offer_req, metadata=(("x-sluice-session", "not-the-lease"),))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    pull = worker_pb2.PullKvRequest(peer_address=prefill_worker.address, token="t", block_ids=(0,))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await decode_worker.raw.PullKv(pull, metadata=(("x-sluice-session", "not-the-lease"),))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_bad_transfer_fields_are_named(pair: tuple[Worker, Worker]) -> None:
    prefill_worker, decode_worker = pair
    for request, field in (
        (worker_pb2.OfferKvRequest(block_ids=(NUM_GPU_BLOCKS,)), "block_ids"),
        (worker_pb2.OfferKvRequest(block_ids=(1, 1)), "block_ids"),
        (worker_pb2.OfferKvRequest(block_ids=(1,), ttl_s=-1), "ttl_s"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await prefill_worker.stub.OfferKv(request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await decode_worker.stub.PullKv(worker_pb2.PullKvRequest(token="t", block_ids=(0,)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "peer_address" in err.value.details()


async def test_the_decode_worker_never_overwrites_a_held_request(pair: tuple[Worker, Worker]) -> None:
    prefill_worker, decode_worker = pair
    steps = Steps(decode_worker)
    held = NewRequestData("held", PROMPT[:16], 16, GREEDY, (30,))
    await steps.run({"held": 16}, ["held"], new=[held])
    before = blocks_of(decode_worker, (30,))
    offer = await prefill_worker.stub.OfferKv(worker_pb2.OfferKvRequest(block_ids=(0,)))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await decode_worker.stub.PullKv(
            worker_pb2.PullKvRequest(peer_address=prefill_worker.address, token=offer.token, block_ids=(30,))
        )
    assert err.value.code() == grpc.StatusCode.ABORTED and "held" in err.value.details()
    assert torch.equal(blocks_of(decode_worker, (30,)), before)
    await steps.run({}, [], release=["held"])
    await steps.close()


async def test_prefill_worker_dying_mid_transfer_fails_the_pull(pair: tuple[Worker, Worker]) -> None:
    _, decode_worker = pair
    doomed = await start_worker(5, worker_pb2.WORKER_ROLE_PREFILL)
    offer = await doomed.stub.OfferKv(worker_pb2.OfferKvRequest(block_ids=tuple(range(12))))
    # NOTE: the gate parks the doomed worker's ReadKv after its first chunk, so the worker dies
    # with the transfer begun (two blocks written on the decode side) and unfinished, every time.
    doomed.runner.gate.clear()
    request = worker_pb2.PullKvRequest(
        peer_address=doomed.address, token=offer.token, block_ids=tuple(range(12)), blocks_per_chunk=2
    )
    pull = asyncio.ensure_future(decode_worker.stub.PullKv(request))
    await asyncio.wait_for(doomed.runner.held.wait(), 30)
    await doomed.stop()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await pull
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and doomed.address in err.value.details()
    assert decode_worker.engine.num_requests == 0
    # the decode worker carries on: the same blocks take a transfer from a live prefill worker
    prefill_worker, _ = pair
    pulled = await transfer(prefill_worker, decode_worker, range(12), range(12), per_chunk=4)
    assert pulled.num_blocks == 12


def test_chunks_never_span_a_gap_in_the_block_ids() -> None:
    assert chunk_spans([0, 1, 2, 3, 4, 7, 8, 9, 20], 2) == [(0, 2), (2, 2), (4, 1), (5, 2), (7, 1), (8, 1)]
    assert chunk_spans(list(range(7)), 3) == [(0, 3), (3, 3), (6, 1)]


def test_chunk_parser_reads_what_protobuf_writes() -> None:
    data = bytes(range(256)) * 300
    for msg in (
        worker_pb2.ReadKvResponse(first=70000, num_blocks=3, int8=True, data=data),
        worker_pb2.ReadKvResponse(num_blocks=1, data=b"x"),  # first 0 and int8 false are not on the wire
    ):
        view = parse_chunk(msg.SerializeToString())
        assert (view.first, view.num_blocks, view.int8, bytes(view.data)) == (
            msg.first,
            msg.num_blocks,
            msg.int8,
            msg.data,
        )
    with pytest.raises(ValueError, match="truncated"):
        parse_chunk(worker_pb2.ReadKvResponse(num_blocks=1, data=data).SerializeToString()[:-1])


def test_chunk_encoder_writes_what_protobuf_reads() -> None:
    data = bytes(range(256)) * 300
    for first, num_blocks, int8 in ((70000, 3, True), (0, 1, False)):
        msg = worker_pb2.ReadKvResponse.FromString(encode_chunk(first, num_blocks, int8, data))
        assert (msg.first, msg.num_blocks, msg.int8, msg.data) == (first, num_blocks, int8, data)


async def test_a_warmup_during_a_transfer_ends_it(pair: tuple[Worker, Worker]) -> None:
    _, decode_worker = pair
    src = await start_worker(6, worker_pb2.WORKER_ROLE_PREFILL)
    try:
        offer = await src.stub.OfferKv(worker_pb2.OfferKvRequest(block_ids=tuple(range(6))))
        src.runner.gate.clear()
        request = worker_pb2.PullKvRequest(
            peer_address=src.address, token=offer.token, block_ids=tuple(range(6)), blocks_per_chunk=2
        )
        pull = asyncio.ensure_future(decode_worker.stub.PullKv(request))
        await asyncio.wait_for(src.runner.held.wait(), 30)
        # the lease holder starts over: the new cache's KV must never reach the old offer's reader
        await src.stub.Warmup(worker_pb2.WarmupRequest(num_gpu_blocks_override=NUM_GPU_BLOCKS, swap_space_gib=0.001))
        src.runner.gate.set()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pull
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "warmed up again" in err.value.details()
        assert src.runner.chunks_read == 1
    finally:
        await src.stop()


async def test_with_api_keys_the_decode_worker_presents_its_key_to_the_peer() -> None:
    src = await start_worker(7, worker_pb2.WORKER_ROLE_PREFILL, api_key="deployment-key")
    dst = await start_worker(8, worker_pb2.WORKER_ROLE_DECODE, api_key="deployment-key")
    try:
        pulled = await transfer(src, dst, (0, 1), (2, 3))
        assert pulled.num_blocks == 2
        assert torch.equal(blocks_of(dst, (2, 3)), blocks_of(src, (0, 1)))
        offer = await src.stub.OfferKv(worker_pb2.OfferKvRequest(block_ids=(0,)))
        with pytest.raises(grpc.aio.AioRpcError) as err:  # the token alone is not enough without the key
            async for _ in src.raw.ReadKv(
                worker_pb2.ReadKvRequest(blocks_per_chunk=1), metadata=((TOKEN_KEY, offer.token),)
            ):
                pass
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await src.stop()
        await dst.stop()
