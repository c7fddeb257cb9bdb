"""Routers beyond round robin and least work: `max_min`, `kv_aware` and `scls`.

`max_min` (SCLS's offloader, seed 002 section 4.5, per request): each request goes to the
worker with the least estimated serving time queued; load += its estimate, and the
estimate is subtracted when the request leaves the worker. Requests are placed as they
arrive, so the "longest first" order of max-min only matters inside the `scls` router,
which places whole batches at once. Estimates come from the SCLS serving-time estimator
fitted to the cost model, T_serve(1, tokens so far, predicted tokens left); without a cost
model they are tokens (prompt + predicted output), like `least_work`.

`kv_aware`: the worker with the most free KV blocks once its waiting queue is admitted
(free blocks minus its waiting requests times the mean prompt blocks it was sent);
ties go to the worker with fewer running requests.

`scls` (seed 002, sections 4.4 to 4.6): the batcher and offloader. `select` holds every
request in the pool (`self.held`); at each pool interval `release` splits the pool with
the DP batcher (Algorithm 1) under the memory check, places the batches longest first on
the least loaded worker (max-min), stamps each member with a `SliceTag` (batch id, slice
length) in `request.policy_state` so the worker's `scls` policy starts them together,
and sets the next interval I = max(xi * min_w load(w), Gamma). A worker's load drops by
a batch's estimate when its last member leaves. Ablations (section 5.4, `variant`):
`pm` (DP capped at `pm_batch` rows, round robin, fixed interval Gamma), `ab` (the full DP,
round robin, fixed interval), `lb` (+ max-min), `full` (+ adaptive interval); SO is the
round-robin router with the `scls` policy forming its own FCFS batches.
Options: `scls:variant=full,slice_len=128,xi=0.5,gamma_s=3,zeta=0.9,pm_batch=16,max_batch=0`.

Importing `scheduler_service.policies` imports this module, which registers the three.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from itertools import count

from scheduler_service.core.request import Request
from scheduler_service.policies import scls  # noqa: F401  (registers the worker side with its router)
from scheduler_service.policies.scls_batcher import MaxMinOffloader, PlannedBatch, dp_batches, slice_tag
from scheduler_service.policies.scls_estimator import MemoryEstimator, ServingTimeEstimator
from scheduler_service.router import ROUTERS, Router, RouterContext, WorkerLoad, healthy_ids

VARIANTS = ("pm", "ab", "lb", "full")


def _estimator(ctx: RouterContext) -> ServingTimeEstimator | None:
    if ctx.cost_model is None:
        return None
    return ServingTimeEstimator.fit_from_cost_model(ctx.cost_model, max_len=min(ctx.max_model_len, 4096))


@ROUTERS.register("max_min")
class MaxMinRouter(Router):
    name = "max_min"

    def __init__(self, estimator: ServingTimeEstimator | None = None) -> None:
        super().__init__()
        self.estimator = estimator
        self.offloader = MaxMinOffloader()
        self._charged: dict[str, tuple[int, float]] = {}

    @classmethod
    def create(cls, options: dict[str, str], ctx: RouterContext) -> Router:
        if options:
            raise ValueError(f"router 'max_min' takes no options, got {sorted(options)}")
        return cls(_estimator(ctx))

    def estimate(self, request: Request) -> float:
        left = request.remaining_output_estimate
        if self.estimator is None:
            return float(request.num_tokens_to_compute + left)
        return float(self.estimator.serve_time(1, request.num_tokens, left))

    def select(self, request: Request, loads: Sequence[WorkerLoad], now: float) -> int | None:
        ids = healthy_ids(loads)
        if not ids:
            return None
        est = self.estimate(request)
        (worker,) = self.offloader.assign([est], ids)
        self._charged[request.request_id] = (worker, est)
        return worker

    def on_request_left(self, request: Request, worker_id: int, now: float) -> None:
        charged = self._charged.pop(request.request_id, None)
        if charged is not None:
            self.offloader.finish(*charged)


@ROUTERS.register("kv_aware")
class KVAwareRouter(Router):
    name = "kv_aware"

    def __init__(self, block_size: int = 16) -> None:
        super().__init__()
        self.block_size = block_size
        self._sent: dict[int, list[int]] = {}  # worker -> [requests on it, their prompt blocks]
        self._placed: dict[str, tuple[int, int]] = {}

    @classmethod
    def create(cls, options: dict[str, str], ctx: RouterContext) -> Router:
        if options:
            raise ValueError(f"router 'kv_aware' takes no options, got {sorted(options)}")
        return cls(ctx.block_size)

    def effective_free(self, load: WorkerLoad) -> float:
        n, blocks = self._sent.get(load.worker_id, (0, 0))
        mean_blocks = blocks / n if n else 0.0
        return load.free_gpu_blocks - load.num_waiting * mean_blocks

    def select(self, request: Request, loads: Sequence[WorkerLoad], now: float) -> int | None:
        healthy = [w for w in loads if w.healthy]
        if not healthy:
            return None
        best = max(healthy, key=lambda w: (self.effective_free(w), -w.num_running, -w.worker_id))
        blocks = -(-request.num_tokens // self.block_size)
        sent = self._sent.setdefault(best.worker_id, [0, 0])
        sent[0] += 1
        sent[1] += blocks
        self._placed[request.request_id] = (best.worker_id, blocks)
        return best.worker_id

    def on_request_left(self, request: Request, worker_id: int, now: float) -> None:
        placed = self._placed.pop(request.request_id, None)
        if placed is not None:
            sent = self._sent[placed[0]]
            sent[0] -= 1
            sent[1] -= placed[1]


@dataclass
class SCLSRouterConfig:
    variant: str = "full"  # pm | ab | lb | full (section 5.4 ablations)
    slice_len: int = 128  # S, stamped on every batch
    xi: float = 0.5  # interval factor of Eq. 12 (the paper's lambda)
    gamma_s: float = 3.0  # minimum pool interval Gamma (3 s for DeepSpeed, 6 s for HF)
    zeta: float = 0.9  # share of the KV cache a batch may plan to use (Eq. 9)
    pm_batch: int = 16  # PM's fixed batch-size cap
    max_batch: int = 0  # rows per batch; 0 = the workers' max_num_seqs

    @classmethod
    def from_options(cls, options: dict[str, str]) -> SCLSRouterConfig:
        defaults = cls()
        known = {f.name for f in fields(cls)}
        values: dict[str, object] = {}
        for key, raw in options.items():
            if key not in known:
                raise ValueError(f"router 'scls' has no option {key!r}; known: {', '.join(sorted(known))}")
            values[key] = type(getattr(defaults, key))(raw)
        config = cls(**values)  # type: ignore[arg-type]
        if config.variant not in VARIANTS:
            raise ValueError(f"scls variant must be one of {VARIANTS}, got {config.variant!r}")
        return config


@ROUTERS.register("scls")
class SCLSRouter(Router):
    name = "scls"

    def __init__(
        self,
        config: SCLSRouterConfig,
        estimator: ServingTimeEstimator,
        ctx: RouterContext | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.estimator = estimator
        self.ctx = ctx or RouterContext()
        self.offloader = MaxMinOffloader()
        self.interval = config.gamma_s
        self.last_tick = 0.0
        self.due: float | None = None  # the pool's next tick while it holds requests
        self._batch_of: dict[str, PlannedBatch] = {}
        self._ids = count()
        self._rr = 0
        self.num_releases = 0

    @classmethod
    def create(cls, options: dict[str, str], ctx: RouterContext) -> Router:
        estimator = _estimator(ctx)
        if estimator is None:
            raise ValueError("the scls router needs a cost model to fit its serving-time estimator")
        return cls(SCLSRouterConfig.from_options(options), estimator, ctx)

    # ------------------------------------------------------------------ the pool
    def select(self, request: Request, loads: Sequence[WorkerLoad], now: float) -> int | None:
        if self.due is None:
            # The pool ticks every `interval` from the last release; an empty pool skips ticks.
            k = max(1, math.ceil((now - self.last_tick) / self.interval - 1e-9))
            self.due = self.last_tick + k * self.interval
        return None

    def next_release(self, now: float) -> float | None:
        return self.due if self.held else None

    def release(self, loads: Sequence[WorkerLoad], now: float) -> list[tuple[Request, int]]:
        workers = healthy_ids(loads)
        if not self.held or self.due is None or now < self.due - 1e-9 or not workers:
            return []
        pending, self.held = self.held, []
        batches = self.form_batches(pending, loads)
        placements = self._offload(pending, batches, workers)
        self.last_tick = now
        self.due = None
        self.num_releases += 1
        if self.config.variant == "full":
            self.interval = max(self.config.xi * self.offloader.min_load(workers), self.config.gamma_s)
        return placements

    def form_batches(self, pending: Sequence[Request], loads: Sequence[WorkerLoad]) -> list[PlannedBatch]:
        cfg = self.config
        cap = cfg.max_batch or self.ctx.max_num_seqs
        if cfg.variant == "pm":
            cap = min(cap, cfg.pm_batch)
        lengths = [r.num_tokens for r in pending]
        return dp_batches(lengths, cfg.slice_len, self.estimator, self.memory(loads), cap)

    def memory(self, loads: Sequence[WorkerLoad]) -> MemoryEstimator:
        blocks = min((w.total_gpu_blocks for w in loads if w.healthy), default=self.ctx.num_gpu_blocks)
        return MemoryEstimator(blocks * self.ctx.block_size, self.ctx.block_size, self.config.zeta)

    def _offload(
        self, pending: Sequence[Request], batches: list[PlannedBatch], workers: list[int]
    ) -> list[tuple[Request, int]]:
        batches.sort(key=lambda b: -b.est_s)  # the order each worker's local queue serves them
        if self.config.variant in ("lb", "full"):
            targets = self.offloader.assign([b.est_s for b in batches], workers)
        else:
            targets = []
            for b in batches:
                w = workers[self._rr % len(workers)]
                self._rr += 1
                self.offloader.charge(w, b.est_s)
                targets.append(w)
        out: list[tuple[Request, int]] = []
        for batch, worker in zip(batches, targets, strict=True):
            batch.batch_id, batch.worker_id, batch.remaining = next(self._ids), worker, len(batch.members)
            for idx in batch.members:
                req = pending[idx]
                tag = slice_tag(req.policy_state)
                tag.batch_id, tag.slice_len = batch.batch_id, self.config.slice_len
                req.policy_state = tag
                self._batch_of[req.request_id] = batch
                out.append((req, worker))
        return out

    def on_request_left(self, request: Request, worker_id: int, now: float) -> None:
        batch = self._batch_of.pop(request.request_id, None)
        if batch is None:
            return
        batch.remaining -= 1
        if batch.remaining == 0:
            self.offloader.finish(batch.worker_id, batch.est_s)

    def loads_s(self) -> dict[int, float]:
        return dict(self.offloader.load)
