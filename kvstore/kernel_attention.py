"""Attention over the paged KV cache with the Triton kernels (`kvstore.paged_kernels`): the CUDA path.

    engine: chunks of one step (SeqChunk: computed, scheduled, block table as an int32 array)
      -> build_kernel_metadata (numpy on the host, then non-blocking copies to the device)
         slot_mapping [T] int64        where each new token's K/V goes
         DecodeLaunch | None           one-token chunks: padded tables [B, W], lens, their rows
         PrefillLaunch | None          multi-token chunks: tables, query tiles
      -> KernelPagedAttention(cache, metadata), called by every layer:
         write K/V through the slot mapping, then one decode launch and one prefill launch

Nothing here reads a device value back to the host, so a step's forward pass is queued
without a single synchronisation. A one-token chunk (a decode, or the last token of a
prompt) attends like a decode whatever it is, so the decode kernel takes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvstore.paged import PagedKVCache, SeqChunk
from kvstore.paged_kernels import (
    DecodeLaunch,
    PrefillLaunch,
    decode_launch,
    paged_decode,
    paged_prefill,
    prefill_launch,
)


@dataclass(frozen=True, slots=True)
class KernelMetadata:
    """Built once per step, shared by every layer."""

    slot_mapping: torch.Tensor  # [T] int64
    decode: DecodeLaunch | None
    prefill: PrefillLaunch | None


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    # NOTE: non-blocking from pageable memory: the driver stages the bytes before returning,
    # so the array may go away at once, and the host never waits for the GPU.
    return torch.from_numpy(array).to(device, non_blocking=True)


def padded_tables(chunks: Sequence[SeqChunk], block_size: int) -> np.ndarray:
    """[len(chunks), widest table] int32; each row the blocks its context needs, then zeros."""
    needed = [-(-c.context_len // block_size) for c in chunks]
    tables = np.zeros((len(chunks), max(needed)), dtype=np.int32)
    for row, (chunk, n) in enumerate(zip(chunks, needed, strict=True)):
        tables[row, :n] = chunk.block_table[:n]
    return tables


def build_kernel_metadata(
    chunks: Sequence[SeqChunk], block_size: int, device: torch.device, num_kv_heads: int
) -> KernelMetadata:
    sizes = np.fromiter((c.num_scheduled for c in chunks), dtype=np.int64, count=len(chunks))
    starts = np.cumsum(sizes) - sizes
    slots = np.empty(int(sizes.sum()), dtype=np.int64)
    decodes = [i for i, c in enumerate(chunks) if c.num_scheduled == 1]
    prefills = [i for i, c in enumerate(chunks) if c.num_scheduled > 1]
    decode = prefill = None
    if decodes:
        pure = len(decodes) == len(chunks)
        decode = _decode_part(
            [chunks[i] for i in decodes], starts[decodes], pure, slots, block_size, device, num_kv_heads
        )
    if prefills:
        prefill = _prefill_part([chunks[i] for i in prefills], starts[prefills], slots, block_size, device)
    return KernelMetadata(to_device(slots, device), decode, prefill)


def decode_columns(chunks: Sequence[SeqChunk], block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tables [B, w] int32, context lens [B] int32, slots [B] int64) of one-token chunks."""
    tables = padded_tables(chunks, block_size)
    lens = np.fromiter((c.context_len for c in chunks), dtype=np.int32, count=len(chunks))
    last = lens.astype(np.int64) - 1
    slots = tables[np.arange(len(chunks)), last // block_size].astype(np.int64) * block_size + last % block_size
    return tables, lens, slots


def _decode_part(
    chunks: list[SeqChunk],
    rows: np.ndarray,
    rows_are_batch: bool,
    slots: np.ndarray,
    block_size: int,
    device: torch.device,
    num_kv_heads: int,
) -> DecodeLaunch:
    tables, lens, slots[rows] = decode_columns(chunks, block_size)
    row_tensor = None if rows_are_batch else to_device(rows.astype(np.int32), device)
    return decode_launch(to_device(tables, device), to_device(lens, device), row_tensor, int(lens.max()), num_kv_heads)


def _prefill_part(
    chunks: list[SeqChunk], rows: np.ndarray, slots: np.ndarray, block_size: int, device: torch.device
) -> PrefillLaunch:
    tables = padded_tables(chunks, block_size)
    for i, (chunk, row) in enumerate(zip(chunks, rows, strict=True)):
        positions = np.arange(chunk.num_computed, chunk.context_len)
        slots[row : row + chunk.num_scheduled] = (
            tables[i, positions // block_size].astype(np.int64) * block_size + positions % block_size
        )
    spans = [(int(row), c.num_computed, c.num_scheduled) for c, row in zip(chunks, rows, strict=True)]
    return prefill_launch(spans, to_device(tables, device))


class KernelPagedAttention:
    """The `Attention` the engine hands the model for one step on CUDA."""

    def __init__(self, cache: PagedKVCache, metadata: KernelMetadata) -> None:
        self.cache = cache
        self.meta = metadata

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.cache.write(layer_idx, k, v, self.meta.slot_mapping)
        k_cache, v_cache = self.cache.layer(layer_idx)
        out = torch.empty_like(q)
        if self.meta.decode is not None:
            paged_decode(q, k_cache, v_cache, self.meta.decode, out)
        if self.meta.prefill is not None:
            paged_prefill(q, k_cache, v_cache, self.meta.prefill, out)
        return out
