"""`prefix_aware`: the worker whose prefix cache holds the most of the request, balanced
against load, as NVIDIA Dynamo's KV router and llm-d's prefix-cache scorer do.

Why choose it: with prefix caching, where a request runs decides how much of its prompt is
computed at all. Round robin spreads a conversation's turns (or a shared document's readers)
over every worker, so each worker computes the shared prefix once and caches it N times;
routing by prefix computes it once and keeps the other workers' caches for other prefixes.

What it does: for each healthy worker w, in tokens (Dynamo's `overlap_score_weight x
prefill blocks + active blocks`):

    cost(w) = overlap_weight x (its tokens - the tokens w's prefix cache holds of it)
              + tokens w's waiting queue has to compute   (prefill already queued there)
              + KV tokens w's running requests hold        (the decode load and memory)

and the request goes to the cheapest (ties: the longer hit, then the lower id). The cached
length is exact: the Cluster looks the request up in each worker's prefix cache. The load
terms are measured, not predicted, so they need no output lengths. `overlap_weight` 0
balances load alone; a large one chases the cache regardless of load.
Configuration: overlap_weight (1.0), kv_weight (0.1: a KV token held by a running request
weighs a tenth of a prefill token). Measured on sharegpt-multiturn, 4 x H100, llama-3.1-8b,
12 req/s, 2,000 turns (hits / TTFT p50 / std of per-worker busy time): kv_weight 0 lets one
worker take the hot prefixes (68.3% / 13.8 ms / 76.9 s), 0.1 keeps the hits and balances
(67.0% / 13.1 ms / 2.0 s), 0.3 and 1 give up hits (58.1%, 46.2%) and TTFT (13.8, 14.6 ms).
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler_service.core.request import Request
from scheduler_service.routers.base import ROUTERS, Router, RouterContext, WorkerLoad
from sluice.common.config import parse_value


@ROUTERS.register("prefix_aware")
class PrefixAwareRouter(Router):
    name = "prefix_aware"
    wants_prefix_match = True

    def __init__(self, block_size: int = 16, overlap_weight: float = 1.0, kv_weight: float = 0.1) -> None:
        super().__init__()
        for name, value in (("overlap_weight", overlap_weight), ("kv_weight", kv_weight)):
            if value < 0:
                raise ValueError(f"router 'prefix_aware': option {name!r} must be >= 0, got {value}")
        self.block_size = block_size
        self.overlap_weight = overlap_weight
        self.kv_weight = kv_weight

    @classmethod
    def create(cls, options: dict[str, str], ctx: RouterContext) -> Router:
        unknown = set(options) - {"overlap_weight", "kv_weight"}
        if unknown:
            raise ValueError(f"router 'prefix_aware' has no option {sorted(unknown)}; known: overlap_weight, kv_weight")
        weights = {k: parse_value(v, float, f"option {k!r}") for k, v in options.items()}
        return cls(ctx.block_size, **weights)

    def cost(self, request: Request, load: WorkerLoad) -> float:
        uncached = request.num_tokens_to_compute - load.cached_tokens
        active = (load.total_gpu_blocks - load.free_gpu_blocks) * self.block_size
        return self.overlap_weight * uncached + load.waiting_tokens + self.kv_weight * active

    def select(self, request: Request, loads: Sequence[WorkerLoad], now: float) -> int | None:
        healthy = [w for w in loads if w.healthy]
        if not healthy:
            return None
        best = min(healthy, key=lambda w: (self.cost(request, w), -w.cached_tokens, w.worker_id))
        return best.worker_id
