"""SimulatedTransfers: the simulator's executor of KV transfers between workers.

A transfer of a request's KV (`KVTransfer`: its blocks on the prefill worker -> blocks
reserved on the decode worker) takes the link's latency + bytes / bandwidth (int8 halves
the bytes). Each worker has one egress and one ingress port, so a worker's transfers run one
after another, while transfers between other pairs and every worker's forward passes go on
meanwhile (the copy engine / NIC works beside the GPU's compute, as in DistServe). A transfer
that would take longer than `timeout_s` is abandoned at the timeout, and `failure_rate`
fails a seeded share of transfers: both are answered not ok, which makes the cluster
recompute the prefill on the decode worker.
"""

from __future__ import annotations

import random

from scheduler_service.sim.network import NetworkLink
from sluice.contract.plan import KVTransfer, KVTransferResult


class SimulatedTransfers:
    def __init__(
        self,
        link: NetworkLink,
        bytes_per_block: int,
        timeout_s: float | None = None,
        failure_rate: float = 0.0,
        seed: int = 0,
    ) -> None:
        self.link = link
        self.bytes_per_block = bytes_per_block
        self.timeout_s = timeout_s
        self.failure_rate = failure_rate
        self._rng = random.Random(seed)
        self._egress_free: dict[int, float] = {}
        self._ingress_free: dict[int, float] = {}

    def nbytes(self, transfer: KVTransfer) -> int:
        n = transfer.num_blocks * self.bytes_per_block
        return n // 2 if transfer.int8 else n

    def start(self, transfer: KVTransfer, now: float) -> tuple[float, KVTransferResult]:
        """When the transfer is answered, and how."""
        nbytes = self.nbytes(transfer)
        src, dst = transfer.src_worker, transfer.dst_worker
        begin = max(now, self._egress_free.get(src, 0.0), self._ingress_free.get(dst, 0.0))
        duration = self.link.transfer_time(nbytes)
        failed = self.failure_rate > 0 and self._rng.random() < self.failure_rate
        if self.timeout_s is not None and (begin - now) + duration > self.timeout_s:
            done = now + self.timeout_s
            result = KVTransferResult(transfer.transfer_id, False, self.timeout_s, 0, "timed out")
        elif failed:
            done = begin + duration
            result = KVTransferResult(transfer.transfer_id, False, done - now, 0, "injected failure")
        else:
            done = begin + duration
            result = KVTransferResult(transfer.transfer_id, True, done - now, nbytes)
        self._egress_free[src] = self._ingress_free[dst] = max(begin, min(done, begin + duration))
        return done, result
