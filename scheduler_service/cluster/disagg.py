"""Disaggregated prefill and decode (DistServe, Splitwise, Mooncake): a prefill pool and a
decode pool under one Cluster, the request's KV moving between them after its prefill.

    submit            the router picks a prefill worker (among `prefill` and `mixed` workers)
    prefill step      the prefill worker samples the first token; the request leaves it with
                      its KV still allocated there (Scheduler.hand_off) and is parked
    dispatch          the decode router picks a decode worker; its blocks for the request's
                      computed tokens are reserved there BEFORE the transfer is issued; a
                      request no decode worker has room for waits parked, first come first
                      served (its KV holds the prefill worker's blocks: back-pressure)
    transfer          a KVTransfer (sluice/contract/plan.py) the driver executes: the
                      simulator prices it on a network link, the live service has the
                      workers stream it (live/transfers.py); the driver answers complete_transfer(result)
    answered          the prefill worker's blocks are freed (AFTER the transfer); on success
                      the request joins the decode worker's queue holding its reserved,
                      filled table (one token to compute: the first decode); on failure or
                      timeout its reservation is freed too and the decode worker recomputes
                      the prefill (prompt + first token) itself
    worker death      prefill worker: its transfers fail over to recomputing on the decode
                      side; decode worker: its reservations are void and the requests, whose
                      KV the prefill worker still holds, are parked again for another one;
                      a prefill worker that stays up but loses its KV (a failed step, or live:
                      warmed up again) recomputes its handoffs as a dead one does (kv_lost)

The scheduler's KV accounting owns both ends of every transfer, so the leak check covers
both pools. `mixed` workers do both (a mixed-only cluster is the colocated Cluster); a
request's prefill goes to the decode pool when no prefill worker is healthy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore.accounting import KVAccounting
from scheduler_service.cluster.cluster import Cluster
from scheduler_service.cluster.spec import ClusterSpec
from scheduler_service.core.metrics import MetricsRecorder
from scheduler_service.core.preemption import RejectReason
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.scheduler import Scheduler, StepOutputs
from scheduler_service.routers import Router, WorkerLoad
from sluice.contract.plan import KVTransfer, KVTransferResult, StepResult

PREFILL, DECODE, MIXED = "prefill", "decode", "mixed"
ROLES = (PREFILL, DECODE, MIXED)


@dataclass(slots=True)
class Handoff:
    """A request between its prefill and its decode worker."""

    request: Request
    src: int
    since: float
    dst: int | None = None
    transfer: KVTransfer | None = None


@dataclass
class TransferStats:
    issued: int = 0
    succeeded: int = 0
    failed: int = 0  # answered not ok: recomputed on the decode worker
    voided: int = 0  # a worker died while the transfer was in flight
    recomputed: int = 0  # fallbacks to recomputing the prefill on a decode worker
    bytes: int = 0
    seconds: list[float] = field(default_factory=list)  # per successful transfer
    parked_s: list[float] = field(default_factory=list)  # prefill end -> transfer issued

    def summary(self) -> dict[str, float | int | None]:
        def pct(values: list[float], q: float) -> float | None:
            if not values:
                return None
            ordered = sorted(values)
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

        return {
            "transfers": self.issued,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "voided": self.voided,
            "recomputed": self.recomputed,
            "bytes": self.bytes,
            "transfer_s_total": sum(self.seconds),
            "transfer_s_p50": pct(self.seconds, 0.5),
            "transfer_s_p99": pct(self.seconds, 0.99),
            "parked_s_p50": pct(self.parked_s, 0.5),
            "parked_s_p99": pct(self.parked_s, 0.99),
        }


class DisaggCluster(Cluster):
    def __init__(
        self,
        spec: ClusterSpec,
        schedulers: list[Scheduler],
        router: Router,
        kv: KVAccounting,
        metrics: MetricsRecorder,
        timer: Callable[[], float] | None,
        decode_router: Router,
    ) -> None:
        super().__init__(spec, schedulers, router, kv, metrics, timer)
        self._decode_router = decode_router
        self._parked: OrderedDict[str, Handoff] = OrderedDict()  # prefill done, no decode blocks yet
        self._inflight: dict[int, Handoff] = {}  # transfer id -> its handoff
        self._issued: list[KVTransfer] = []
        self._next_transfer = 0
        self.transfers = TransferStats()

    # NOTE: roles and pools are read from the spec and the schedulers each time, so a worker that
    # joins or leaves the running cluster is in (or out of) its pool at once.
    @property
    def roles(self) -> dict[int, str]:
        return {w: self.spec.workers[w].role for w in self.schedulers}

    @property
    def prefill_pool(self) -> list[int]:
        return [w for w in self.schedulers if self.spec.workers[w].role in (PREFILL, MIXED)]

    @property
    def decode_pool(self) -> list[int]:
        return [w for w in self.schedulers if self.spec.workers[w].role in (DECODE, MIXED)]

    def _role(self, worker: int) -> str:
        return self.spec.workers[worker].role

    def overlaps(self, worker: int) -> bool:
        # NOTE: a prefill worker hands a request off when its prefill's answer comes, which a
        # plan made one step ahead would already have scheduled a decode for; the two were
        # built apart and are not combined until that is handled and tested: one step at a time.
        return False

    # ------------------------------------------------------------------ the driver's side
    def pop_transfers(self) -> list[KVTransfer]:
        issued, self._issued = self._issued, []
        return issued

    def complete_transfer(self, result: KVTransferResult, now: float) -> None:
        handoff = self._inflight.pop(result.transfer_id, None)
        if handoff is None:
            return  # voided: a worker died while it was in flight (handled by mark_down)
        transfer = handoff.transfer
        assert transfer is not None
        request = handoff.request
        self.schedulers[transfer.src_worker].kv.free(request.request_id)  # the prefill side, after the transfer
        if result.ok:
            self.transfers.succeeded += 1
            self.transfers.bytes += result.nbytes
            self.transfers.seconds.append(result.total_s)
            request.status = RequestStatus.WAITING
            self._join_decode(request, transfer.dst_worker, now)
        else:
            self.transfers.failed += 1
            self._recompute(request, transfer.dst_worker, now)
        self._dispatch(now)

    @property
    def num_in_transfer(self) -> int:
        return len(self._parked) + len(self._inflight)

    @property
    def num_unfinished(self) -> int:
        return super().num_unfinished + self.num_in_transfer

    # ------------------------------------------------------------------ one step
    def complete_step(self, worker: int, result: StepResult, now: float) -> StepOutputs:
        out = super().complete_step(worker, result, now)
        if self._role(worker) == PREFILL:
            if result.error is not None:
                # NOTE: the worker's KV is unreliable after a failed step; what it was to send is too.
                self.kv_lost(worker, now)
            sched = self.schedulers[worker]
            for request, _ in out.tokens:
                # A prefill worker never decodes: a sampled token means the prefill is done.
                if request.request_id in sched.requests and not request.status.is_finished:
                    sched.hand_off(request, now)
                    self._router.on_request_left(request, worker, now)
                    self._parked[request.request_id] = Handoff(request, worker, now)
        self._dispatch(now)
        return out

    # ------------------------------------------------------------------ outside events
    def finish(self, request_id: str, status: RequestStatus, now: float, message: str = "") -> bool:
        handoff = self._parked.pop(request_id, None)
        if handoff is None:
            tid = next((t for t, h in self._inflight.items() if h.request.request_id == request_id), None)
            if tid is not None:
                handoff = self._inflight.pop(tid)
                self.transfers.voided += 1
        if handoff is None:
            return super().finish(request_id, status, now, message)
        self._release(handoff, now)
        self._end(handoff.request, status, now, message)
        self._dispatch(now)
        return True

    def _recompute_parked_on(self, worker: int, now: float) -> None:
        """Requests parked on `worker` for a transfer lose their KV there: freed, and recomputed
        on the decode side."""
        for rid, handoff in list(self._parked.items()):
            if handoff.src == worker:
                del self._parked[rid]
                self.schedulers[worker].kv.free(rid)
                self._recompute(handoff.request, None, now)

    def kv_lost(self, worker: int, now: float) -> None:
        """The worker's KV is gone or unreliable (a failed step; live: it was warmed up again,
        which rebuilds its cache empty) while it stays up: the requests it prefilled and still
        holds for a transfer are recomputed on the decode side."""
        self._recompute_parked_on(worker, now)
        for tid, handoff in list(self._inflight.items()):
            transfer = handoff.transfer
            assert transfer is not None
            if transfer.src_worker == worker:
                del self._inflight[tid]
                self.transfers.voided += 1
                self.schedulers[worker].kv.free(transfer.request_id)
                self._recompute(handoff.request, transfer.dst_worker, now)

    def mark_down(self, worker: int, now: float) -> list[Request]:
        moved = super().mark_down(worker, now)
        if self._role(worker) in (DECODE, MIXED):
            for request in moved:
                self._decode_router.on_request_left(request, worker, now)
        self._recompute_parked_on(worker, now)  # their KV died with the worker
        for tid, handoff in list(self._inflight.items()):
            transfer = handoff.transfer
            assert transfer is not None
            if worker not in (transfer.src_worker, transfer.dst_worker):
                continue
            del self._inflight[tid]
            self.transfers.voided += 1
            rid = handoff.request.request_id
            if transfer.src_worker == worker:
                self.schedulers[worker].kv.free(rid)
                self._recompute(handoff.request, transfer.dst_worker, now)
            else:  # the decode side died: its reservation is void, the KV is still on the prefill worker
                self.schedulers[worker].kv.free(rid)
                self._decode_router.on_request_left(handoff.request, worker, now)
                handoff.dst, handoff.transfer = None, None
                self._parked[rid] = handoff
                self._parked.move_to_end(rid, last=False)
        self._dispatch(now)
        return moved

    def mark_up(self, worker: int, now: float) -> None:
        super().mark_up(worker, now)
        self._dispatch(now)

    def release_held(self, now: float) -> None:
        for request, worker in self._router.release(self._pool_loads(self.prefill_pool), now):
            self._place_or_end(request, worker, now)

    def reject_leftovers(self, now: float) -> None:
        for handoff in [*self._parked.values(), *self._inflight.values()]:
            self._release(handoff, now)
            request = handoff.request
            request.status = RequestStatus.FINISHED_REJECTED
            request.finish_time = now
            request.finish_message = "unschedulable: no decode worker ever had room"
            self.metrics.on_reject(request, RejectReason.UNSCHEDULABLE, now)
            self._ended.append(request)
        self._parked.clear()
        self._inflight.clear()
        super().reject_leftovers(now)

    # ------------------------------------------------------------------ internals
    def _pool_loads(self, pool: list[int], request: Request | None = None) -> list[WorkerLoad]:
        members = set(pool)
        return [load for load in self.loads(request) if load.worker_id in members]

    def _route(self, request: Request, now: float) -> RejectReason | None:
        router = self._router
        if not any(self.healthy[w] for w in self.prefill_pool):
            # No prefill worker: a decode worker prefills itself (colocated, degraded).
            worker = self._pick_decode(request, now)
            if worker is None:
                return self._reject(request, RejectReason.NO_WORKER, now)
            return self._place(request, worker, now)
        loads = self._pool_loads(self.prefill_pool, request if router.wants_prefix_match else None)
        worker = router.select(request, loads, now)
        if worker is None:
            router.held.append(request)
            return None
        return self._place(request, worker, now)

    def _place(self, request: Request, worker: int, now: float) -> RejectReason | None:
        reason = self.schedulers[worker].add_request(request, now)
        if reason is not None:
            router = self._decode_router if self._role(worker) == DECODE else self._router
            router.on_request_left(request, worker, now)
        return reason

    def _settle(self, worker: int, finished: list[Request], now: float) -> None:
        if self._role(worker) in (DECODE, MIXED):
            for request in [*finished, *self.schedulers[worker].returned]:
                self._decode_router.on_request_left(request, worker, now)
        super()._settle(worker, finished, now)

    def _pick_decode(self, request: Request, now: float) -> int | None:
        loads = [load for load in self._pool_loads(self.decode_pool) if load.healthy]
        if not loads:
            return None
        return self._decode_router.select(request, loads, now)

    def _dispatch(self, now: float) -> None:
        """Reserves decode-side blocks for parked requests, oldest first, and issues their
        transfers; stops at the first that finds no room (no overtaking)."""
        while self._parked:
            rid, handoff = next(iter(self._parked.items()))
            request = handoff.request
            decode = [w for w in self.decode_pool if self.healthy[w]]
            if not decode:
                return
            need = self.schedulers[decode[0]].kv.num_blocks_for(request.num_computed_tokens + 1)
            if all(need > self.schedulers[w].kv.gpu.num_blocks for w in decode):
                del self._parked[rid]
                self.schedulers[handoff.src].kv.free(rid)
                request.status = RequestStatus.FINISHED_REJECTED
                request.finish_time = now
                request.finish_message = str(RejectReason.EXCEEDS_KV_CAPACITY)
                self.metrics.on_reject(request, RejectReason.EXCEEDS_KV_CAPACITY, now)
                self._ended.append(request)
                continue
            dst = self._reserve(request, now)
            if dst is None:
                return
            del self._parked[rid]
            self._issue(handoff, dst, now)

    def _reserve(self, request: Request, now: float) -> int | None:
        """A decode worker with the request's blocks allocated to it: the router's pick, else
        the one with the most free blocks that has room; None when none has."""
        rid, tokens = request.request_id, request.num_computed_tokens
        picked = self._pick_decode(request, now)
        if picked is None:
            return None
        if self.schedulers[picked].kv.allocate(rid, tokens) is not None:
            return picked
        self._decode_router.on_request_left(request, picked, now)
        others = sorted(
            (w for w in self.decode_pool if self.healthy[w] and w != picked),
            key=lambda w: -self.schedulers[w].kv.gpu.num_free,
        )
        for w in others:
            if self.schedulers[w].kv.allocate(rid, tokens) is not None:
                return w
        return None

    def _issue(self, handoff: Handoff, dst: int, now: float) -> None:
        request = handoff.request
        rid = request.request_id
        src_table = self.schedulers[handoff.src].kv.gpu_tables[rid]
        dst_table = self.schedulers[dst].kv.gpu_tables[rid]
        n = len(dst_table)
        self._next_transfer += 1
        transfer = KVTransfer(
            transfer_id=self._next_transfer,
            request_id=rid,
            src_worker=handoff.src,
            dst_worker=dst,
            src_block_ids=tuple(src_table[:n]),
            dst_block_ids=tuple(dst_table),
            num_tokens=request.num_computed_tokens,
            int8=self.spec.int8_transfer,
        )
        handoff.dst, handoff.transfer = dst, transfer
        self._inflight[transfer.transfer_id] = handoff
        self._issued.append(transfer)
        self.transfers.issued += 1
        self.transfers.parked_s.append(now - handoff.since)

    def _join_decode(self, request: Request, worker: int, now: float) -> None:
        if self.schedulers[worker].add_request(request, now) is not None:
            self.schedulers[worker].kv.free(request.request_id)
            self._decode_router.on_request_left(request, worker, now)
            self._ended.append(request)

    def _recompute(self, request: Request, worker: int | None, now: float) -> None:
        """The transfer is lost: the decode worker (`worker`, else the decode router's pick)
        recomputes the request's prefill, prompt and first token, from nothing."""
        self.transfers.recomputed += 1
        rid = request.request_id
        if worker is not None and self.healthy[worker]:
            self.schedulers[worker].kv.free(rid)  # the reservation; the prefill is redone from scratch
        else:
            if worker is not None:
                self.schedulers[worker].kv.free(rid)
                self._decode_router.on_request_left(request, worker, now)
            worker = self._pick_decode(request, now)
        request.num_computed_tokens = 0
        request.prefill_len = request.num_tokens
        request.status = RequestStatus.WAITING
        if worker is None:
            if self._route(request, now) is not None:  # no decode worker: back to the prefill pool
                self._ended.append(request)
            return
        self._join_decode(request, worker, now)

    def _release(self, handoff: Handoff, now: float) -> None:
        """Frees both ends of a handoff that will not complete."""
        rid = handoff.request.request_id
        self.schedulers[handoff.src].kv.free(rid)
        if handoff.dst is not None:
            self.schedulers[handoff.dst].kv.free(rid)
            self._decode_router.on_request_left(handoff.request, handoff.dst, now)

    def _end(self, request: Request, status: RequestStatus, now: float, message: str) -> None:
        request.status = status
        request.finish_time = now
        request.finish_message = message
        self.metrics.on_finish(request, now)
        self._ended.append(request)
