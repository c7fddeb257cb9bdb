"""SCLS's routers: `max_min` and `scls` (the batcher and the offloader).

`max_min` (SCLS's offloader, seed 002 section 4.5, per request): each request goes to the
worker with the least estimated serving time queued; load += its estimate, and the
estimate is subtracted when the request leaves the worker. Requests are placed as they
arrive, so the "longest first" order of max-min only matters inside the `scls` router,
which places whole batches at once. Estimates come from the SCLS serving-time estimator
fitted to the cost model, T_serve(1, tokens so far, predicted tokens left); without a cost
model they are tokens (prompt + predicted output), like `least_work`.

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
Long prompts (`max_prefill_share`, ours, off by default): every slice re-prefills its batch's prompts and
generated tokens, which the paper's S = 128 amortises over short prompts only (a padded
100k-token prefill takes seconds, 128 decodes of it well under one). A batch whose prefill,
priced by the cost model, would take more than this share of its slice gets a longer slice,
as far as its KV fits (Eq. 9); 0 (the default) keeps the paper's fixed S; long-context
runs set 0.5 with padded rows and 0.8 (with S = 256) with `varlen_attention`.
Rows not padded (`varlen_attention`, ours, off by default): for workers whose `scls` policy
runs with `varlen_attention=true`, the DP prices a group at its rows' own lengths and checks
their own KV (a batch of mixed lengths no longer pays for padding, so the batcher stops
splitting on length alone), and `max_prefill_share` prices the rows' own prefill.
A bounded pool interval (`max_interval_s`, ours, 0 = unbounded as in the paper): Eq. 12's
I = max(xi x min_w load(w), Gamma) grows with the load, to minutes when batches of long
prompts queue on a worker, and every arrival waits for the next tick; the bound caps I.
Options: `scls:variant=full,slice_len=128,xi=0.5,gamma_s=3,zeta=0.9,pm_batch=16,max_batch=0,
max_prefill_share=0,varlen_attention=false,max_interval_s=0,memory_rule=eq9`.

Importing `scheduler_service.policies` imports this module, which registers the two.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import count

from scheduler_service.core.request import Request
from scheduler_service.policies.scls.batcher import MaxMinOffloader, PlannedBatch, dp_batches, slice_tag
from scheduler_service.policies.scls.estimator import MemoryEstimator, ServingTimeEstimator
from scheduler_service.routers import ROUTERS, Router, RouterContext, WorkerLoad, healthy_ids
from sluice.common.config import config_from_options
from sluice.contract.profile import BatchShape

VARIANTS = ("pm", "ab", "lb", "full")
MEMORY_RULES = ("eq9", "deepspeed")


def _estimator(ctx: RouterContext) -> ServingTimeEstimator | None:
    if ctx.cost_model is None:
        return None
    # NOTE: fitted over every batch size the batcher may form (up to the workers' max_num_seqs).
    return ServingTimeEstimator.fit_from_cost_model(
        ctx.cost_model, max_len=min(ctx.max_model_len, 4096), max_batch=ctx.max_num_seqs
    )


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


@dataclass
class SCLSRouterConfig:
    variant: str = "full"  # pm | ab | lb | full (section 5.4 ablations)
    slice_len: int = 128  # S, stamped on every batch
    xi: float = 0.5  # interval factor of Eq. 12 (the paper's lambda)
    gamma_s: float = 3.0  # minimum pool interval Gamma (3 s for DeepSpeed, 6 s for HF)
    zeta: float = 0.9  # share of the KV cache a batch may plan to use (Eq. 9)
    pm_batch: int = 16  # PM's fixed batch-size cap
    max_batch: int = 0  # rows per batch; 0 = the workers' max_num_seqs
    max_prefill_share: float = 0.0  # ours: longer slices where the prefill passes this share; 0: fixed S
    varlen_attention: bool = False  # ours: the workers do not pad rows; price and check rows at their own length
    max_interval_s: float = 0.0  # ours: upper bound on the pool interval I of Eq. 12; 0: unbounded
    # eq9: Eq. 9's KV check alone (the HF engine's rule); deepspeed: also the paper's Algorithm 2
    # row caps (12/22/28 by L + S), the rule its DS-SCLS, compared with FastGen, ran under
    memory_rule: str = "eq9"

    @classmethod
    def from_options(cls, options: dict[str, str]) -> SCLSRouterConfig:
        config = config_from_options(cls, options, "router 'scls'")
        if config.variant not in VARIANTS:
            raise ValueError(f"scls variant must be one of {VARIANTS}, got {config.variant!r}")
        if config.memory_rule not in MEMORY_RULES:
            raise ValueError(f"scls memory_rule must be one of {MEMORY_RULES}, got {config.memory_rule!r}")
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
        self.stats: Counter[str] = Counter()  # reports (`stats_report`)

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
            self.interval = self.next_interval(workers)
        return placements

    def next_interval(self, workers: Sequence[int]) -> float:
        """Eq. 12, I = max(xi x min_w load(w), Gamma), capped at `max_interval_s` when set."""
        cfg = self.config
        interval = max(cfg.xi * self.offloader.min_load(workers), cfg.gamma_s)
        if cfg.max_interval_s > 0:
            interval = min(interval, max(cfg.max_interval_s, cfg.gamma_s))
        return interval

    def form_batches(self, pending: Sequence[Request], loads: Sequence[WorkerLoad]) -> list[PlannedBatch]:
        cfg = self.config
        cap = cfg.max_batch or self.ctx.max_num_seqs
        if cfg.variant == "pm":
            cap = min(cap, cfg.pm_batch)
        lengths = [r.num_tokens for r in pending]
        memory = self.memory(loads)
        batches = dp_batches(lengths, cfg.slice_len, self.estimator, memory, cap, cfg.varlen_attention)
        self._count(batches, memory, cap)
        return batches

    def _count(self, batches: list[PlannedBatch], memory: MemoryEstimator, cap: int) -> None:
        """Batches formed, their rows, and how many stopped at the memory rule's row limit."""
        stats = self.stats
        stats["batches"] += len(batches)
        stats["rows"] += sum(len(b.members) for b in batches)
        if self.config.varlen_attention:
            return
        for b in batches:
            limit = memory.max_batch(b.padded_len, self.config.slice_len)
            stats["memory_capped_batches"] += len(b.members) >= limit and limit < cap

    def stats_report(self) -> dict[str, object]:
        return {**dict(sorted(self.stats.items())), "releases": self.num_releases}

    def memory(self, loads: Sequence[WorkerLoad]) -> MemoryEstimator:
        blocks = min((w.total_gpu_blocks for w in loads if w.healthy), default=self.ctx.num_gpu_blocks)
        deepspeed = self.config.memory_rule == "deepspeed"
        return MemoryEstimator(blocks * self.ctx.block_size, self.ctx.block_size, self.config.zeta, deepspeed)

    def batch_slice_len(self, rows: int, length: int, lengths: Sequence[int] | None = None) -> int:
        """S, or longer where the batch's prefill (`rows` padded to `length`, or the rows'
        own `lengths` with `varlen_attention`) would take more than `max_prefill_share` of
        the slice (prefill vs decodes priced by the cost model), within the KV the memory
        check allows for the batch."""
        s, share, cm = self.config.slice_len, self.config.max_prefill_share, self.ctx.cost_model
        if share <= 0 or cm is None:
            return s
        if self.config.varlen_attention and lengths:
            chunks = [(n, 0) for n in lengths]
            decode = cm.decode_time(rows, round(sum(lengths) / rows))
            kv_held = sum(lengths)
        else:
            chunks = [(length, 0)] * rows
            decode = cm.decode_time(rows, length)
            kv_held = rows * length
        prefill = cm.iteration_time(BatchShape(prefill_chunks=chunks))
        wanted = min(math.ceil(prefill * (1 - share) / share / decode), self.ctx.max_model_len - length)
        room = (int(self.config.zeta * self.ctx.num_gpu_blocks * self.ctx.block_size) - kv_held) // rows
        return max(s, min(wanted, room))

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
            lengths = [pending[i].num_tokens for i in batch.members]
            slice_len = self.batch_slice_len(len(lengths), batch.padded_len, lengths)
            for idx in batch.members:
                req = pending[idx]
                tag = slice_tag(req.policy_state)
                tag.batch_id, tag.slice_len = batch.batch_id, slice_len
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
