"""CUDA graphs of the model's forward pass for decode steps (every chunk one token), one per batch size.

    engine, a step of B one-token chunks (B <= the largest size):
        size = the smallest captured size >= B
        pinned host staging <- ids, positions, slots, block tables, context lens (rows B..size
                               padded: token 0 at position 0 in the cache's pad block)
        static device inputs <- one non-blocking copy each
        graph[size].replay()  (captured on first use: two eager warm-up passes, then capture)
        -> hidden [B, hidden_size] (a view of the graph's static output)

A decode step of an 8B model launches about 25 kernels per layer; replaying them as one
graph removes the host's launch time (several ms a step), which is what bounds small
decode batches. Only the layers are captured: the LM head and sampling stay eager (they
run on the rows that sample). The attention's split size depends on the batch size only
(`paged_kernels.split_tokens`), and the kernels read each sequence's own context length
from the static inputs, so one graph serves any context up to max_model_len. Graphs bake
in the KV cache's address: the engine drops them whenever it builds a new cache.
"""

from __future__ import annotations

import numpy as np
import torch

from kvstore.kernel_attention import KernelMetadata, KernelPagedAttention
from kvstore.paged import PagedKVCache
from kvstore.paged_kernels import DecodeLaunch, split_tokens
from worker_service.model import CausalLM

# Padding a batch up to the next size costs little (decode is bound by reading the weights).
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


class DecodeGraphs:
    def __init__(self, model: CausalLM, cache: PagedKVCache, max_model_len: int, max_batch: int = 256) -> None:
        self.model = model
        self.cache = cache
        self.max_model_len = max_model_len
        self.sizes = tuple(s for s in GRAPH_BATCH_SIZES if s <= max_batch)
        self.num_kv_heads = cache.spec.num_kv_heads
        block_size = cache.spec.block_size
        self.pad_slot = cache.pad_block * block_size
        batch, width = self.sizes[-1], -(-max_model_len // block_size)
        device = cache.device
        pin = device.type == "cuda"
        # NOTE: two sets of pinned staging buffers, used in turn: with the worker's pipeline a
        # step is staged while the one before is still queued (its copies maybe not done yet);
        # the step before that has been waited for, so its set is free again.
        self.hosts = [
            {
                "ids": torch.zeros(batch, dtype=torch.long, pin_memory=pin),
                "positions": torch.zeros(batch, dtype=torch.long, pin_memory=pin),
                "slots": torch.zeros(batch, dtype=torch.long, pin_memory=pin),
                "tables": torch.zeros((batch, width), dtype=torch.int32, pin_memory=pin),
                "lens": torch.ones(batch, dtype=torch.int32, pin_memory=pin),
            }
            for _ in range(2)
        ]
        self._turn = 0
        self.static = {name: torch.zeros_like(t, device=device) for name, t in self.hosts[0].items()}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: tuple[int, int] | None = None

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def size_for(self, batch: int) -> int:
        return next(s for s in self.sizes if s >= batch)

    def run(
        self,
        ids: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        tables: np.ndarray,
        lens: np.ndarray,
        fill: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Hidden states [B, hidden] of B one-token chunks (tables [B, w] int32, lens [B] int32);
        `fill`: (rows, tokens) on the device, input ids the step before sampled and has not
        brought back yet (written after the staged copy, before the replay, in stream order)."""
        batch = len(ids)
        size = self.size_for(batch)
        self._stage(batch, size, ids, positions, slots, tables, lens)
        if fill is not None:
            self.static["ids"][fill[0]] = fill[1]
        entry = self.graphs.get(size) or self._capture(size)
        entry[0].replay()
        return entry[1][:batch]

    def capture_all(self) -> None:
        """Captures every size now (rows all padding), so no live step pays for a capture."""
        empty = np.zeros(0, dtype=np.int64)
        for size in self.sizes:
            if size not in self.graphs:
                self._stage(0, size, empty, empty, empty, np.zeros((0, 1), dtype=np.int32), empty.astype(np.int32))
                self._capture(size)

    def _stage(self, batch: int, size: int, *columns: np.ndarray) -> None:
        pinned = self.hosts[self._turn]
        self._turn ^= 1
        h = {name: t.numpy() for name, t in pinned.items()}
        ids, positions, slots, tables, lens = columns
        h["ids"][:batch], h["positions"][:batch], h["slots"][:batch], h["lens"][:batch] = ids, positions, slots, lens
        h["tables"][:batch, : tables.shape[1]] = tables
        # Padding rows: token 0 at position 0, written to and read from the pad block only.
        h["ids"][batch:size], h["positions"][batch:size], h["slots"][batch:size] = 0, 0, self.pad_slot
        h["tables"][batch:size, 0], h["lens"][batch:size] = self.cache.pad_block, 1
        # NOTE: this set is rewritten two steps later, after this step's tokens came back (the
        # engine waits for every step), so these copies have long finished by then.
        for name, host in pinned.items():
            self.static[name][:size].copy_(host[:size], non_blocking=True)

    def _attention(self, size: int) -> KernelPagedAttention:
        s = self.static
        launch = DecodeLaunch(
            s["tables"][:size], s["lens"][:size], None, self.max_model_len, split_tokens(size, self.num_kv_heads)
        )
        return KernelPagedAttention(self.cache, KernelMetadata(s["slots"][:size], launch, None))

    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        attn = self._attention(size)
        ids, positions = self.static["ids"][:size], self.static["positions"][:size]
        # Warm-up passes compile the kernels and build lazily made tensors (the rotary table)
        # outside the capture; they recompute this step's K/V into the same slots.
        side = torch.cuda.Stream(self.cache.device)
        side.wait_stream(torch.cuda.current_stream(self.cache.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.model(ids, positions, attn)
        torch.cuda.current_stream(self.cache.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # NOTE: thread_local: the worker's gRPC threads must not be able to break a capture
        # that only the engine thread makes.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self.model(ids, positions, attn)
        self._pool = graph.pool()
        self.graphs[size] = (graph, out)
        return graph, out
