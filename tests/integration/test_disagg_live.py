"""Disaggregated prefill and decode live: in-process tiny-llama workers started with a role
(`--role prefill` / `--role decode`, WarmupDefaults.role) under the live scheduler over real
gRPC, which builds a DisaggCluster from the roles the workers announce and drives the KV
transfers between them (OfferKv on the prefill worker, PullKv on the decode worker).

Every request's tokens (greedy, prompts of different lengths) must be those of the engine
alone and of the same requests served colocated; after the run no KV block is held on either
pool, on the scheduler's books or the workers'; a prefill or a decode worker that dies with a
transfer in flight, and a transfer that times out, end in a recompute on the decode side with
the same tokens and nothing leaked. Also: a transfer into blocks a finished request gave up
waits until the decode worker applied that release; a later pull fences an earlier one into
the same blocks; int8 transfers; `sluice serve --prefill-workers 1 --decode-workers 1`.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import pytest

from scheduler_service.cluster import DisaggCluster
from scheduler_service.live.config import LiveConfig
from scheduler_service.live.service import LiveScheduler
from services.serve import ServeConfig, start_scheduler, start_workers, stop_workers, worker_roles
from sluice.common.grpc_server import CHANNEL_OPTIONS
from sluice.common.tokenizer import Tokenizer
from sluice.contract.plan import StepPlan, StepResult
from sluice.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.integration.test_scheduler_live import (
    Client,
    Worker,
    engine,
    ids_of,
    run_alone,
    scheduler,
)
from worker_service.engine import LLMEngine
from worker_service.server import EngineRunner, WarmupDefaults
from worker_service.server import build_server as build_worker_server

T = TypeVar("T")
MAX_TOKENS = (1, 7, 12, 20, 9, 16, 3, 25, 2, 11, 30, 5)  # the first ends at its prefill: it never moves
LENGTHS = (5, 15, 16, 33, 61, 90, 40, 8, 70, 17, 26, 50)  # under a block, a few blocks, several
# NOTE: few blocks per worker, so a decode worker's blocks are reserved for a transfer soon
# after a finished request gave them up (the worker must have applied that release first).
NUM_GPU_BLOCKS = 40


class GatedRunner(EngineRunner):
    """The real runner; while `gate` is clear, every KV read (ReadKv's export of a chunk)
    waits at it, so a test holds a transfer in flight for as long as it needs; while
    `release_gate` is clear, so does every step that releases requests."""

    def __init__(self, eng: LLMEngine) -> None:
        super().__init__(eng)
        self.gate = asyncio.Event()
        self.gate.set()
        self.held = asyncio.Event()  # a read is waiting at the gate
        self.release_gate = asyncio.Event()
        self.release_gate.set()
        self.release_held = asyncio.Event()  # a releasing step is waiting at its gate

    async def call_inline(self, fn: Callable[..., T], *args: Any) -> T:
        if getattr(fn, "__name__", "") == "_export" and not self.gate.is_set():
            self.held.set()
            await self.gate.wait()
        return await super().call_inline(fn, *args)

    async def step(self, plan: StepPlan) -> StepResult:
        if plan.release_ids and not self.release_gate.is_set():
            self.release_held.set()
            await self.release_gate.wait()
        return await super().step(plan)


@dataclass
class RoleWorker(Worker):
    runner: GatedRunner


async def start_worker(worker_id: int, role: str, port: int = 0) -> RoleWorker:
    """A tiny-llama worker started with `--role role` (its WarmupDefaults)."""
    eng = engine()
    runner = GatedRunner(eng)
    server = build_worker_server(eng, port, worker_id=worker_id, runner=runner, defaults=WarmupDefaults(role=role))
    await server.start(ready=False)
    return RoleWorker(eng, server.server, server.port, runner)


async def stop_all(workers: Sequence[Worker]) -> None:
    for w in workers:
        await w.server.stop(None)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.demo()


@pytest.fixture(scope="module")
def prompts(tokenizer: Tokenizer) -> list[list[int]]:
    """Token prompts of different lengths (under a block, a few blocks, several), cut from real text."""
    text = " ".join(
        [
            "Write a function that returns the nth Fibonacci number using memoization and explain",
            "why the naive recursive version is exponential while the memoized one runs in linear time;",
            "then show how to turn it into an iterative loop that keeps only the last two values,",
            "and compare the memory each version needs for large inputs on a typical laptop.",
        ]
        * 3
    )
    ids = tokenizer.encode(text)
    assert len(ids) >= max(LENGTHS) + len(LENGTHS)
    return [ids[i : i + n] for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def expected(prompts: list[list[int]]) -> list[list[int]]:
    reference = engine()
    reference.init_kv_cache(16, 0)
    return [run_alone(reference, p, n) for p, n in zip(prompts, MAX_TOKENS, strict=True)]


async def generate_all(client: Client, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    async def one(i: int, prompt: Sequence[int]) -> list[int]:
        sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[i])
        messages = await client.generate(
            request_id=f"r{i}", token_ids=common_pb2.TokenIds(ids=prompt), sampling_params=sampling
        )
        assert messages[-1].finish_reason in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP)
        return ids_of(messages)

    return list(await asyncio.wait_for(asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))), timeout=60))


async def assert_nothing_held(client: Client, workers: Sequence[Worker]) -> None:
    """The leak check on both pools: the scheduler's books (every worker's KV, no request
    parked or in transfer) and the workers' own (no request held)."""
    stats = await client.wait_until_idle()
    live = client.server.live
    cluster = live.cluster
    assert isinstance(cluster, DisaggCluster)
    assert cluster.num_in_transfer == 0 and live.transfers.num_in_flight == 0
    for sched in cluster.schedulers.values():
        sched.assert_empty()
    cluster.kv.assert_empty()
    assert all(w.gpu_blocks_used == 0 for w in stats.workers)
    for _ in range(50):  # the release of the last requests reaches the workers with their last step
        held = [await w.held_requests() for w in workers if await alive(w)]
        if not any(held):
            break
        await asyncio.sleep(0.02)
    assert not any(held), f"requests still held on the workers: {held}"


async def alive(worker: Worker) -> bool:
    try:
        await worker.held_requests()
    except grpc.aio.AioRpcError:
        return False
    return True


async def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    for _ in range(math.ceil(timeout_s / 0.005)):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting until {what}")


# ---------------------------------------------------------------- roles


async def test_a_worker_announces_its_configured_role_and_keeps_it_for_its_session() -> None:
    worker = await start_worker(0, "prefill")
    try:
        async with grpc.aio.insecure_channel(worker.address, options=CHANNEL_OPTIONS) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            info = await stub.Info(worker_pb2.InfoRequest())
            assert info.capabilities.role == worker_pb2.WORKER_ROLE_PREFILL
        async with scheduler([worker.address, (decode := await start_worker(1, "decode")).address]) as client:
            live = client.server.live
            assert isinstance(live.cluster, DisaggCluster)
            assert live.cluster.roles == {0: "prefill", 1: "decode"}
            assert not live.cluster.overlaps(0) and not live.cluster.overlaps(1)
        await decode.server.stop(None)
    finally:
        await worker.server.stop(None)


def test_transfer_settings_out_of_range_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="transfer_timeout_s"):
        LiveScheduler(["127.0.0.1:1"], LiveConfig(transfer_timeout_s=0.0))
    with pytest.raises(ValueError, match="transfer_blocks_per_chunk"):
        LiveScheduler(["127.0.0.1:1"], LiveConfig(transfer_blocks_per_chunk=-1))


def test_serve_starts_the_prefill_then_the_decode_workers_and_refuses_a_one_sided_split() -> None:
    assert worker_roles(ServeConfig(workers=3)) == ["mixed"] * 3
    assert worker_roles(ServeConfig(prefill_workers=1, decode_workers=2)) == ["prefill", "decode", "decode"]
    with pytest.raises(ValueError, match="decode_workers"):
        worker_roles(ServeConfig(prefill_workers=2))
    with pytest.raises(ValueError, match="prefill_workers"):
        worker_roles(ServeConfig(decode_workers=1))


# ---------------------------------------------------------------- serving


async def test_tokens_are_identical_colocated_and_disaggregated_and_no_block_is_held_after(
    prompts: list[list[int]], expected: list[list[int]]
) -> None:
    mixed = [await start_worker(0, "mixed"), await start_worker(1, "mixed")]
    try:
        async with scheduler([w.address for w in mixed], num_gpu_blocks=NUM_GPU_BLOCKS) as client:
            assert not isinstance(client.server.live.cluster, DisaggCluster)
            colocated = await generate_all(client, prompts)
    finally:
        await stop_all(mixed)
    split = [await start_worker(0, "prefill"), await start_worker(1, "decode")]
    try:
        async with scheduler([w.address for w in split], num_gpu_blocks=NUM_GPU_BLOCKS) as client:
            disaggregated = await generate_all(client, prompts)
            await assert_nothing_held(client, split)
            cluster = client.server.live.cluster
            stats = cluster.transfers
            moved = sum(n > 1 for n in MAX_TOKENS)
            assert stats.issued == stats.succeeded == moved, stats.summary()
            assert stats.failed == stats.recomputed == 0
            records = list(client.server.live.transfers.records)
            assert len(records) == moved and all(r.ok and r.nbytes > 0 for r in records)
            assert {(r.src_worker, r.dst_worker) for r in records} == {(0, 1)}
            # the decode worker never prefilled: it computed one token per step of each request
            decode_steps = (await client.stats()).workers[1].num_steps
            assert decode_steps > 0
    finally:
        await stop_all(split)
    assert colocated == expected
    assert disaggregated == expected


async def test_a_prefill_worker_dying_mid_transfer_leaves_every_request_finished_on_the_decode_worker(
    prompts: list[list[int]], expected: list[list[int]]
) -> None:
    prefill, decode = await start_worker(0, "prefill"), await start_worker(1, "decode")
    try:
        # NOTE: probed often: the prefill worker is idle once it handed its requests off, and only
        # a probe (or a step) notices that it died.
        config = {"transfer_timeout_s": 30.0, "probe_interval_s": 0.2}
        async with scheduler([prefill.address, decode.address], **config) as client:
            live = client.server.live
            prefill.runner.gate.clear()
            task = asyncio.ensure_future(generate_all(client, prompts))
            await asyncio.wait_for(prefill.runner.held.wait(), timeout=20)
            assert live.transfers.num_in_flight >= 1
            await prefill.server.stop(None)  # a read held at the gate: the transfer is in flight
            results = await task
            await assert_nothing_held(client, [decode])
            stats = live.cluster.transfers
            assert stats.succeeded == 0 and stats.recomputed >= 1, stats.summary()
            await wait_for(lambda: not live.cluster.healthy[0], "the prefill worker is marked down")
    finally:
        prefill.runner.gate.set()
        await stop_all([prefill, decode])
    assert results == expected


async def test_a_decode_worker_dying_mid_transfer_moves_its_requests_to_the_other_decode_worker(
    prompts: list[list[int]], expected: list[list[int]]
) -> None:
    workers = [await start_worker(0, "prefill"), await start_worker(1, "decode"), await start_worker(2, "decode")]
    prefill = workers[0]
    try:
        async with scheduler([w.address for w in workers], transfer_timeout_s=30.0) as client:
            live = client.server.live
            prefill.runner.gate.clear()
            task = asyncio.ensure_future(generate_all(client, prompts))
            await asyncio.wait_for(prefill.runner.held.wait(), timeout=20)
            await wait_for(lambda: live.transfers.num_in_flight > 0, "a transfer is in flight")
            doomed = next(iter(live.transfers.in_flight.values())).dst_worker
            await workers[doomed].server.stop(None)
            await wait_for(lambda: not live.cluster.healthy[doomed], f"decode worker {doomed} is marked down")
            prefill.runner.gate.set()
            results = await task
            survivors = [w for i, w in enumerate(workers) if i != doomed]
            await assert_nothing_held(client, survivors)
            stats = live.cluster.transfers
            # the doomed worker's transfer failed (its PullKv was cut) or was voided (it was marked
            # down first); either way the request was prefilled again and moved to the survivor
            assert stats.failed + stats.voided >= 1, stats.summary()
            assert stats.succeeded >= 1, "the requests re-parked moved to the other decode worker"
            assert all(r.dst_worker != doomed for r in live.transfers.records if r.ok)
    finally:
        prefill.runner.gate.set()
        await stop_all(workers)
    assert results == expected


async def test_a_transfer_that_times_out_falls_back_to_recomputing_on_the_decode_worker(
    prompts: list[list[int]], expected: list[list[int]]
) -> None:
    prefill, decode = await start_worker(0, "prefill"), await start_worker(1, "decode")
    try:
        async with scheduler([prefill.address, decode.address], transfer_timeout_s=0.3) as client:
            live = client.server.live
            prefill.runner.gate.clear()  # every KV read waits: every transfer runs out of time
            results = await generate_all(client, prompts)
            await assert_nothing_held(client, [prefill, decode])
            stats = live.cluster.transfers
            moved = sum(n > 1 for n in MAX_TOKENS)
            assert stats.issued == stats.failed == stats.recomputed == moved, stats.summary()
            assert stats.succeeded == 0
            assert all(not r.ok and "took over" in r.error for r in live.transfers.records)
            assert live.cluster.healthy == {0: True, 1: True}, "a slow transfer is no lost worker"
    finally:
        prefill.runner.gate.set()
        await stop_all([prefill, decode])
    assert results == expected


@pytest.mark.slow
async def test_sluice_serve_with_a_prefill_and_a_decode_worker_process_gives_the_colocated_tokens(
    prompts: list[list[int]],
) -> None:
    """The processes `sluice serve --prefill-workers 1 --decode-workers 1` starts (`sluice
    worker --role ...`): the scheduler reads their roles and moves every request's KV."""
    runs = {}
    for name, split in (("colocated", {"workers": 2}), ("disaggregated", {"prefill_workers": 1, "decode_workers": 1})):
        cfg = ServeConfig(port=0, num_gpu_blocks=NUM_GPU_BLOCKS, worker_threads=1, start_predictor=False, **split)
        processes = await start_workers(cfg)
        try:
            server = await start_scheduler(cfg, [w.address for w in processes])
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                    runs[name] = await generate_all(Client(channel, server), prompts)
                cluster = server.live.cluster
                if name == "disaggregated":
                    assert isinstance(cluster, DisaggCluster) and cluster.roles == {0: "prefill", 1: "decode"}
                    moved = sum(n > 1 for n in MAX_TOKENS)
                    assert cluster.transfers.succeeded == moved, cluster.transfers.summary()
            finally:
                await server.stop(grace_s=1.0, drain_s=0.0)
        finally:
            await stop_workers(processes)
    assert runs["disaggregated"] == runs["colocated"]


async def test_a_later_pull_into_the_same_blocks_fences_an_earlier_one_still_running() -> None:
    """The scheduler reuses a given-up transfer's blocks for another transfer; the earlier
    pull, still running on the decode worker, must not write its late chunks over the new KV."""
    from tests.integration.test_kv_transfer import Steps, blocks_of, prefill, transfer
    from tests.integration.test_kv_transfer import start_worker as start_kv_worker

    slow = await start_kv_worker(0, worker_pb2.WORKER_ROLE_PREFILL)  # its reads wait after one chunk
    fresh = await start_kv_worker(1, worker_pb2.WORKER_ROLE_PREFILL)
    decode = await start_kv_worker(2, worker_pb2.WORKER_ROLE_DECODE)
    try:
        steps = Steps(fresh)
        await prefill(steps, "r", (0, 1, 2))
        assert not (blocks_of(slow, (0, 1, 2)) == blocks_of(fresh, (0, 1, 2))).all()
        slow.runner.gate.clear()
        given_up = asyncio.ensure_future(transfer(slow, decode, (0, 1, 2), (5, 6, 7), per_chunk=1))
        await asyncio.wait_for(slow.runner.held.wait(), timeout=20)  # its first chunk is written
        pulled = await transfer(fresh, decode, (0, 1, 2), (5, 6, 7), per_chunk=1)
        assert pulled.num_blocks == 3
        slow.runner.gate.set()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(given_up, timeout=20)
        assert err.value.code() == grpc.StatusCode.ABORTED and "superseded" in err.value.details()
        assert (blocks_of(decode, (5, 6, 7)) == blocks_of(fresh, (0, 1, 2))).all(), "the new KV stands"
        await steps.run({}, [], release=["r"])
        await steps.close()
    finally:
        slow.runner.gate.set()
        for w in (slow, fresh, decode):
            await w.stop()


async def test_a_transfer_into_blocks_a_finished_request_gave_up_waits_until_the_decode_worker_released_it(
    prompts: list[list[int]],
) -> None:
    """The decode worker learns that a finished request gave its blocks up only from its next
    plan; a transfer reserved into those blocks must not be pulled before that plan is applied
    (the worker would refuse the pull: the blocks are still the finished request's)."""
    prompt = (prompts[5] * 2)[:60]
    reference = engine()
    reference.init_kv_cache(16, 0)
    want = {"x": run_alone(reference, prompt, 40), "r": run_alone(reference, prompt[::-1], 5)}
    prefill, decode = await start_worker(0, "prefill"), await start_worker(1, "decode")
    try:
        # 8 blocks of 16 tokens a worker: x grows to 7 on the decode worker, r needs 4 there
        async with scheduler([prefill.address, decode.address], num_gpu_blocks=8) as client:
            live, cluster = client.server.live, client.server.live.cluster

            def ask(rid: str, ids: list[int], n: int) -> asyncio.Future:
                sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=n)
                call = client.generate(request_id=rid, token_ids=common_pb2.TokenIds(ids=ids), sampling_params=sampling)
                return asyncio.ensure_future(call)

            x = ask("x", prompt, 40)
            d_kv = cluster.schedulers[1].kv
            await wait_for(lambda: len(d_kv.gpu_tables.get("x", ())) >= 5, "x holds 5 blocks on the decode worker")
            decode.runner.release_gate.clear()
            r = ask("r", prompt[::-1], 5)
            x_blocks: set[int] = set()
            async with asyncio.timeout(30):
                while not decode.runner.release_held.is_set():  # x finished: its release waits at the gate
                    x_blocks |= set(d_kv.gpu_tables.get("x", ()))
                    await asyncio.sleep(0.001)
            assert live.transfers.num_in_flight == 1
            (transfer,) = live.transfers.in_flight.values()
            # r's 4 blocks are reserved among x's 7 (the decode worker has 8): the worker still holds them
            assert transfer.request_id == "r" and len(set(transfer.dst_block_ids) & x_blocks) >= 3
            await asyncio.sleep(0.3)
            assert live.transfers.num_in_flight == 1, "the transfer waits for the release to be applied"
            decode.runner.release_gate.set()
            got = {"x": ids_of(await x), "r": ids_of(await r)}
            await assert_nothing_held(client, [prefill, decode])
            stats = cluster.transfers
            assert stats.succeeded == 2 and stats.failed == stats.recomputed == 0, stats.summary()
    finally:
        decode.runner.release_gate.set()
        await stop_all([prefill, decode])
    assert got == want


async def test_int8_transfers_move_under_two_fifths_of_the_bytes_and_every_request_finishes(
    prompts: list[list[int]], expected: list[list[int]]
) -> None:
    """`--int8-transfer`: the float32 KV goes int8-quantized (a byte per value plus per-channel
    scales: 6 of 16 KiB a tiny-llama block); greedy tokens may differ after quantization, their
    number and the requests' ends may not."""
    prefill, decode = await start_worker(0, "prefill"), await start_worker(1, "decode")
    try:
        async with scheduler([prefill.address, decode.address], num_gpu_blocks=NUM_GPU_BLOCKS) as client:
            raw = await generate_all(client, prompts)
            raw_bytes = {r.request_id: r.nbytes for r in client.server.live.transfers.records}
        async with scheduler(
            [prefill.address, decode.address], num_gpu_blocks=NUM_GPU_BLOCKS, int8_transfer=True
        ) as client:
            live = client.server.live
            assert live.spec.int8_transfer
            quantized = await generate_all(client, prompts)
            await assert_nothing_held(client, [prefill, decode])
            records = {r.request_id: r for r in live.transfers.records}
            assert records and all(r.ok for r in records.values())
            for rid, record in records.items():
                assert record.nbytes < 0.4 * raw_bytes[rid], (rid, record.nbytes, raw_bytes[rid])
    finally:
        await stop_all([prefill, decode])
    assert raw == expected
    assert [len(t) for t in quantized] == [len(t) for t in expected]
    assert [t[0] for t in quantized] == [t[0] for t in expected], "the first token comes from the prefill worker"
