"""KVTransfers: the live driver of a disaggregated cluster's KV transfers (the simulator's is
SimulatedTransfers: the same Cluster calls, priced instead of run).

    LiveScheduler.settle -> Cluster.pop_transfers -> one task per KVTransfer:
        wait until the decode worker applied what freed the reserved blocks (below)
        OfferKv on the prefill worker                  -> a one-time token for its blocks
        PullKv on the decode worker (the prefill worker's address, the token, the reserved
            blocks): the decode worker reads the KV from its peer (ReadKv) into those blocks
        Cluster.complete_transfer(KVTransferResult)    -> the prefill worker's blocks freed;
            on success the request joins the decode worker's queue; on failure its
            reservation is freed too and the decode worker recomputes the prefill
        LiveScheduler.settle                           -> the loops with work are woken

The whole transfer runs within `transfer_timeout_s`; a refusal, a timeout or a lost worker
answers ok=False (recompute). So does a worker that was warmed up again meanwhile: its KV
cache was rebuilt empty, whatever the calls answered (each WorkerLoop counts its sessions in
`epoch`, bumped when a loss begins and again when it is resolved). A transfer the cluster
already voided (a worker died: mark_down moved its request) is answered anyway and ignored
there. Each transfer is its own task: no step of any worker waits for one.

Why the wait. The decode worker's reserved blocks were free on the scheduler's books, but the
worker learns that a request gave them up only from a plan: the step in flight when they were
reserved (a swap-out, a release), or the next one when releases were still pending. A PullKv
before that would find them owned and be refused; the worker applies each plan's releases
before its step, so the transfer waits until those plans are answered (a step or two).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from scheduler_service.cluster import Cluster
from scheduler_service.live.config import LiveConfig
from scheduler_service.live.remote import RemoteWorker, TransferFailed
from sluice.contract.plan import KVTransfer, KVTransferResult
from sluice.v1 import worker_pb2

log = logging.getLogger(__name__)

MAX_OFFER_TTL_S = 600.0  # the worker's bound on an offer's lifetime (worker_service/kv_transfer.py)


def check_transfer_config(cfg: LiveConfig) -> None:
    """ValueError naming the field for transfer settings no transfer could run with."""
    if not cfg.transfer_timeout_s > 0:
        raise ValueError(f"transfer_timeout_s: must be > 0, got {cfg.transfer_timeout_s}")
    if not 0 <= cfg.transfer_blocks_per_chunk < 2**32:
        raise ValueError(
            f"transfer_blocks_per_chunk: must be >= 0 (0: the worker picks), got {cfg.transfer_blocks_per_chunk}"
        )


class TransferLoop(Protocol):
    """What a transfer needs of a WorkerLoop (named here, so this module imports no loop)."""

    remote: RemoteWorker
    epoch: int
    connected: bool

    async def next_progress(self) -> None: ...


class TransferHost(Protocol):
    """What the driver needs of the LiveScheduler."""

    cluster: Cluster
    config: LiveConfig
    clock: Callable[[], float]
    loops: dict[int, TransferLoop]

    def settle(self) -> None: ...


@dataclass(frozen=True, slots=True)
class TransferRecord:
    """One transfer as it ran (benchmarks read these): seconds waiting for the decode worker
    to apply its releases, for OfferKv, for PullKv, and in all (issue to answer)."""

    request_id: str
    src_worker: int
    dst_worker: int
    ok: bool
    num_blocks: int
    nbytes: int
    wait_s: float
    offer_s: float
    pull_s: float
    total_s: float
    error: str = ""


class KVTransfers:
    def __init__(self, host: TransferHost) -> None:
        self.host = host
        self.tasks: set[asyncio.Task] = set()
        self.in_flight: dict[int, KVTransfer] = {}  # transfer id -> the transfer, while its task runs
        self.records: deque[TransferRecord] = deque(maxlen=100_000)

    @property
    def num_in_flight(self) -> int:
        return len(self.in_flight)

    def start_issued(self) -> None:
        """A task for every transfer the cluster issued since the last call."""
        for transfer in self.host.cluster.pop_transfers():
            run = self._run(transfer, self._epochs(transfer))
            task = asyncio.create_task(run, name=f"sluice-kv-{transfer.request_id}")
            self.in_flight[transfer.transfer_id] = transfer
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def close(self) -> None:
        pending = set(self.tasks)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
        self.in_flight.clear()

    def _epochs(self, transfer: KVTransfer) -> tuple[int, int] | None:
        """Both workers' sessions now; None when one is not connected (its KV is not to be had)."""
        loops = self.host.loops
        src, dst = loops.get(transfer.src_worker), loops.get(transfer.dst_worker)
        if src is None or dst is None or not src.connected or not dst.connected:
            return None
        return src.epoch, dst.epoch

    async def _run(self, transfer: KVTransfer, epochs: tuple[int, int] | None) -> None:
        host = self.host
        cfg = host.config
        started = time.perf_counter()
        wait_s = offer_s = pull_s = 0.0
        nbytes, error = 0, ""
        try:
            if epochs is None:
                raise TransferFailed("a worker of the transfer is not connected")
            src, dst = host.loops[transfer.src_worker], host.loops[transfer.dst_worker]
            async with asyncio.timeout(cfg.transfer_timeout_s):
                await self._releases_applied(transfer.dst_worker, dst, epochs[1])
                t1 = time.perf_counter()
                wait_s = t1 - started
                offer = await src.remote.offer_kv(
                    worker_pb2.OfferKvRequest(
                        request_id=transfer.request_id,
                        block_ids=transfer.src_block_ids,
                        int8=transfer.int8,
                        ttl_s=min(MAX_OFFER_TTL_S, cfg.transfer_timeout_s),
                    ),
                    cfg.transfer_timeout_s,
                )
                t2 = time.perf_counter()
                offer_s = t2 - t1
                pulled = await dst.remote.pull_kv(
                    worker_pb2.PullKvRequest(
                        peer_address=src.remote.address,
                        token=offer.token,
                        block_ids=transfer.dst_block_ids,
                        blocks_per_chunk=cfg.transfer_blocks_per_chunk,
                    ),
                    max(0.001, cfg.transfer_timeout_s - (t2 - started)),
                )
                pull_s = time.perf_counter() - t2
            nbytes = pulled.nbytes
            if pulled.num_blocks != transfer.num_blocks:
                raise TransferFailed(f"{pulled.num_blocks} blocks written of {transfer.num_blocks}")
            # NOTE: checked with no await before complete_transfer: a worker warmed up again
            # since the transfer was issued has a new, empty cache, whatever the calls answered.
            if (src.epoch, dst.epoch) != epochs:
                raise TransferFailed("a worker of the transfer was warmed up again meanwhile")
            ok = True
        except TimeoutError:
            ok, error = False, f"took over {cfg.transfer_timeout_s:g} s"
        except TransferFailed as exc:
            ok, error = False, str(exc)
        except Exception as exc:
            # NOTE: a bug must not leave the request parked forever: it is recomputed instead.
            log.exception("KV transfer of %s failed", transfer.request_id)
            ok, error = False, f"{type(exc).__name__}: {exc}"
        total_s = time.perf_counter() - started
        if not ok:
            log.warning(
                "KV transfer of %s (worker %d -> %d) failed: %s; the decode worker recomputes it",
                transfer.request_id, transfer.src_worker, transfer.dst_worker, error,
            )  # fmt: skip
        self.records.append(
            TransferRecord(
                transfer.request_id,
                transfer.src_worker,
                transfer.dst_worker,
                ok,
                transfer.num_blocks,
                nbytes,
                wait_s,
                offer_s,
                pull_s,
                total_s,
                error,
            )
        )
        del self.in_flight[transfer.transfer_id]
        host.cluster.complete_transfer(KVTransferResult(transfer.transfer_id, ok, total_s, nbytes, error), host.clock())
        host.settle()

    async def _releases_applied(self, worker: int, loop: TransferLoop, epoch: int) -> None:
        """Until the decode worker answered the plans that freed the blocks reserved on it: the
        one in flight now and, when releases are pending, the next (see the module's note)."""
        cluster = self.host.cluster
        sched = cluster.schedulers.get(worker)
        if sched is None:
            raise TransferFailed(f"worker {worker} left the cluster")
        planned = sched.plans.step_id
        target = planned + 1 if sched.plans.has_pending_releases else planned
        while sched.plans.step_id < target or any(cluster.is_in_flight(worker, s) for s in range(planned, target + 1)):
            if loop.epoch != epoch or not loop.connected:
                raise TransferFailed(f"worker {worker} was lost before the transfer began")
            await loop.next_progress()
