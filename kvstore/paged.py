"""The physical paged KV cache of one worker: GPU blocks, CPU swap space, int8, attention.

Layout. One tensor holds every layer's keys and values, block-indexed like the scheduler's
accounting (`kvstore.accounting`): token t of a request lives at block
`block_table[t // block_size]`, offset `t % block_size`, i.e. flat slot
`block_table[t // block_size] * block_size + t % block_size` (its `slot_mapping` entry).

    kv   [num_layers, 2 (K, V), num_gpu_blocks + 1, block_size, num_kv_heads, head_dim]
         the last block (`pad_block`) belongs to no request: padded rows of a CUDA-graph
         batch write and read there, so padding never touches a scheduler-owned block
    cpu  [num_cpu_blocks, bytes_per_block] uint8, block-major: a swapped block is one
         contiguous run of bytes (its layers, K and V), so a swap copies whole rows

A CPU block holds either the raw block (`kv` dtype) or its int8 form (ALISE's per-channel
quantization, `quantize_int8`): uint8 codes for every (layer, K/V, token, head, dim), then a
float32 scale and zero point per (layer, K/V, head, dim) channel. `cpu_int8[b]` remembers
which, so a swap-in dequantizes exactly the blocks that were quantized.

A step: `swapping()` wraps the KV moves (on CUDA they run on their own stream; the forward
waits only for the GPU-side part, device-to-host copies overlap it and may finish after
the step: later copies queue behind them on the same stream; the worker issues them after
the step's forward pass is queued, `flush_swaps()`), then the forward pass
attends through an `Attention`: each layer writes its new K/V through the slot_mapping,
then attends over the request's block table (cached prefix + this step's chunk).
`PagedAttention` here is the torch path (CPU, and the CUDA baseline): it gathers each
sequence's blocks, decodes batched into one padded call, each prefill chunk one call;
`kvstore.kernel_attention` is the CUDA path, Triton kernels reading the blocks in place.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

INT8_LEVELS = 255


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """q [B, Hq, Q, D], k/v [B, Hkv, S, D] -> [B, Hq, Q, D]; grouped-query heads shared."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal and mask is None, enable_gqa=q.shape[1] != k.shape[1]
    )


def causal_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One complete sequence, [S, H, D] each, causal, no cache."""
    out = sdpa(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None, True)
    return out[0].transpose(0, 1)


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block across all layers: [num_layers, 2, block_size, heads, head_dim]."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def num_elements(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim

    @property
    def bytes_per_block(self) -> int:
        return self.num_elements * torch.finfo(self.dtype).bits // 8

    @property
    def int8_payload_bytes(self) -> int:
        return self.num_elements

    @property
    def int8_bytes_per_block(self) -> int:
        """Codes plus a float32 scale and zero point per channel (layer, K/V, head, dim)."""
        return self.num_elements + 2 * 4 * (self.num_elements // self.block_size)

    @property
    def supports_int8(self) -> bool:
        # NOTE: int8 blocks reuse the CPU block's bytes, so they must fit in it; with 16-bit
        # caches that needs block_size >= 8 (scales cost 8 bytes per channel).
        return self.int8_bytes_per_block <= self.bytes_per_block and self.int8_payload_bytes % 4 == 0


def quantize_int8(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ALISE: x_q = round(x / lambda + z), lambda = (max - min) / 255, z = round(-min / lambda),
    per channel (min and max taken along `dim`, the token axis). Returns (codes uint8, lambda, z).
    |dequantize(x_q) - x| <= lambda / 2 for every element."""
    xf = x.float()
    lo, hi = xf.amin(dim, keepdim=True), xf.amax(dim, keepdim=True)
    span = hi - lo
    # NOTE: a constant channel has no span; lambda = |min| / 255 then encodes it exactly
    # (x_q = 0, z = -+255), and an all-zero channel takes lambda = 1, z = 0.
    fallback = torch.where(lo != 0, lo.abs() / INT8_LEVELS, torch.ones_like(lo))
    lam = torch.where(span > 0, span / INT8_LEVELS, fallback)
    z = torch.round(-lo / lam)
    codes = torch.round(xf / lam + z).clamp_(0, INT8_LEVELS).to(torch.uint8)
    return codes, lam, z


def dequantize_int8(codes: torch.Tensor, lam: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return ((codes.float() - z) * lam).to(dtype)


def _runs(ids: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(position in ids, first id, length) of each run of consecutive ids."""
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            yield start, ids[start], i - start
            start = i


class PagedKVCache:
    def __init__(self, spec: KVCacheSpec, num_gpu_blocks: int, num_cpu_blocks: int, device: torch.device) -> None:
        shape = (spec.num_layers, 2, num_gpu_blocks + 1, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.kv = torch.zeros(shape, dtype=spec.dtype, device=device)
        self._init_host(spec, num_gpu_blocks, num_cpu_blocks, device)

    def _init_host(self, spec: KVCacheSpec, num_gpu_blocks: int, num_cpu_blocks: int, device: torch.device) -> None:
        """Everything but the device tensors: the swap space and the swap stream."""
        self.spec = spec
        self.device = device
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.pad_block = num_gpu_blocks
        self.is_cuda = device.type == "cuda"
        self.cpu = torch.zeros((num_cpu_blocks, spec.bytes_per_block), dtype=torch.uint8, pin_memory=self.is_cuda)
        self.cpu_int8 = [False] * num_cpu_blocks
        self._pending_d2h: list[tuple[list[int], torch.Tensor]] = []
        if self.is_cuda:
            self._stream = torch.cuda.Stream(device)
            self._start = torch.cuda.Event(enable_timing=True)
            self._ready = torch.cuda.Event(enable_timing=True)

    # -- per-layer access for attention ------------------------------------------------

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer, [num_gpu_blocks, block_size, num_kv_heads, head_dim]."""
        return self.kv[layer_idx, 0], self.kv[layer_idx, 1]

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        k_cache, v_cache = self.layer(layer_idx)
        flat = (-1, self.spec.num_kv_heads, self.spec.head_dim)
        k_cache.view(flat).index_copy_(0, slot_mapping, k)
        v_cache.view(flat).index_copy_(0, slot_mapping, v)

    # -- KV moves ------------------------------------------------------------------------

    @contextmanager
    def swapping(self, defer_copies: bool = False) -> Iterator[None]:
        """Runs the moves issued inside on the swap stream (CUDA); compute waits for their
        GPU-side part only, so device-to-host copies overlap the forward pass.

        With `defer_copies` the swap-outs' device-to-host copies wait on the host until
        `flush_swaps()`: a step issues them after its forward's kernels are queued and before
        the copies that wait for them. The copy engine runs copies in the order they were
        issued: on an H100 the step's own small input copies queued behind a swap-out's large
        copy and waited for all of it (a decode and a swap-out took the sum of their times,
        17 + 12 ms -> 28 ms for 537 MB beside 64 decodes); issued behind the sampled tokens'
        copy back, the swap's copy waited for the forward instead. Between the two, an H200
        drains both in 15.0 ms (13.4 + 12.0 ms alone)."""
        if not self.is_cuda:
            yield
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            self._start.record()
            yield
            self._ready.record()
        if not defer_copies:
            self.flush_swaps()
        torch.cuda.current_stream(self.device).wait_event(self._ready)

    def flush_swaps(self) -> None:
        """Issues the device-to-host copies of swap-outs still held back (on the swap stream,
        behind their gathers); a no-op when none are."""
        if not self._pending_d2h:
            return
        if not self.is_cuda:
            self._flush_d2h()
            return
        with torch.cuda.stream(self._stream):
            self._flush_d2h()

    def last_swap_seconds(self) -> float:
        """GPU time of the last `swapping()` block's blocking part (CUDA; call after a sync)."""
        return self._start.elapsed_time(self._ready) / 1000.0 if self.is_cuda else 0.0

    def swap_out(self, gpu_ids: Sequence[int], cpu_ids: Sequence[int], int8: bool) -> int:
        """Copies GPU blocks to CPU blocks (quantized if `int8`); returns bytes moved."""
        data = self._gather_gpu(gpu_ids)
        packed = self._pack_int8(data) if int8 else data.view(torch.uint8).reshape(len(gpu_ids), -1)
        for b in cpu_ids:
            self.cpu_int8[b] = int8
        if self.is_cuda:
            self._pending_d2h.append((list(cpu_ids), packed))
        else:
            self._write_cpu(list(cpu_ids), packed)
        return packed.numel()

    def swap_in(self, cpu_ids: Sequence[int], gpu_ids: Sequence[int]) -> int:
        """Copies CPU blocks back to GPU blocks, dequantizing int8 ones; returns bytes moved."""
        self.flush_swaps()  # a block swapped out earlier must reach the host before it is read
        moved = 0
        for int8 in (False, True):
            pairs = [(c, g) for c, g in zip(cpu_ids, gpu_ids, strict=True) if self.cpu_int8[c] == int8]
            if not pairs:
                continue
            src, dst = [c for c, _ in pairs], [g for _, g in pairs]
            nbytes = self.spec.int8_bytes_per_block if int8 else self.spec.bytes_per_block
            packed = self._read_cpu(src, nbytes)
            data = self._unpack_int8(packed) if int8 else packed.view(self.spec.dtype).view(-1, *self.spec.block_shape)
            self._scatter_gpu(dst, data)
            moved += packed.numel()
        return moved

    def copy(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> int:
        self._scatter_gpu(dst_ids, self._gather_gpu(src_ids))
        return len(src_ids) * self.spec.bytes_per_block

    # -- KV transfer between workers (disaggregated prefill and decode) --------------------

    def transfer_bytes_per_block(self, int8: bool) -> int:
        return self.spec.int8_bytes_per_block if int8 else self.spec.bytes_per_block

    def export_blocks(self, gpu_ids: Sequence[int], int8: bool) -> bytes:
        """GPU blocks as bytes: len(ids) rows of transfer_bytes_per_block, in the swap format
        (a block's layers, K and V contiguous; int8: codes then scales)."""
        if int8:
            return self._pack_int8(self._gather_gpu(gpu_ids)).cpu().numpy().tobytes()
        # NOTE: on a CPU the bytes are copied once, straight from the cache into the message
        # (numpy's tobytes walks the strided block-major view of each run of blocks); a
        # gather, a permute and tobytes would copy every byte three times, and on a CPU
        # worker each copy races the wire for the same memory bandwidth.
        parts = []
        for _, first, n in _runs(list(gpu_ids)):
            run = self.kv[:, :, first : first + n].permute(2, 0, 1, 3, 4, 5)
            parts.append((run.contiguous().cpu() if self.is_cuda else run).view(torch.uint8).numpy().tobytes())
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def import_blocks(self, gpu_ids: Sequence[int], packed: torch.Tensor, int8: bool) -> None:
        """Writes rows `export_blocks` made (on any worker of the same model) into GPU blocks."""
        expected = (len(gpu_ids), self.transfer_bytes_per_block(int8))
        if tuple(packed.shape) != expected:
            raise ValueError(f"KV rows of shape {tuple(packed.shape)}, expected {expected}")
        packed = packed.to(self.device)
        if int8:
            self._scatter_gpu(gpu_ids, self._unpack_int8(packed))
            return
        data = packed.view(self.spec.dtype).view(-1, *self.spec.block_shape)
        for pos, first, n in _runs(list(gpu_ids)):
            self.kv[:, :, first : first + n].copy_(data[pos : pos + n].permute(1, 2, 0, 3, 4, 5))

    def _index(self, ids: Sequence[int]) -> torch.Tensor:
        # NOTE: non-blocking: a blocking copy would wait on the swap stream, i.e. for the
        # device-to-host copies earlier steps left running there.
        return torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)

    def _gather_gpu(self, ids: Sequence[int]) -> torch.Tensor:
        return self.kv[:, :, self._index(ids)].permute(2, 0, 1, 3, 4, 5).contiguous()

    def _scatter_gpu(self, ids: Sequence[int], data: torch.Tensor) -> None:
        self.kv[:, :, self._index(ids)] = data.to(self.device, non_blocking=True).permute(1, 2, 0, 3, 4, 5)

    def _pack_int8(self, data: torch.Tensor) -> torch.Tensor:
        codes, lam, z = quantize_int8(data, dim=3)
        scales = torch.stack((lam, z), dim=3).reshape(len(data), -1)
        return torch.cat((codes.reshape(len(data), -1), scales.view(torch.uint8)), dim=1)

    def _unpack_int8(self, packed: torch.Tensor) -> torch.Tensor:
        n, payload = len(packed), self.spec.int8_payload_bytes
        num_layers, _, _, heads, dim = self.spec.block_shape
        codes = packed[:, :payload].reshape(n, *self.spec.block_shape)
        scales = packed[:, payload:].contiguous().view(torch.float32).reshape(n, num_layers, 2, 2, 1, heads, dim)
        return dequantize_int8(codes, scales[:, :, :, 0], scales[:, :, :, 1], self.spec.dtype)

    def _host_slices(self, cpu_ids: list[int], nbytes: int) -> Iterator[tuple[slice, torch.Tensor]]:
        """(rows of the packed tensor, host bytes they go to or come from), each one contiguous.

        A run of whole rows is one range of the host buffer. Int8 blocks fill only the first
        `nbytes` of their rows, so a run of them is strided; on CUDA a copy into or out of a
        strided host view is staged through pageable memory and blocks the host (int8 swaps
        ran at 1.2 GB/s on an H100 against 45 GB/s for plain ones), so there each block is copied
        on its own, straight to or from pinned memory."""
        if nbytes == self.cpu.shape[1] or not self.is_cuda:
            for pos, first, n in _runs(cpu_ids):
                yield slice(pos, pos + n), self.cpu[first : first + n, :nbytes]
            return
        for pos, block in enumerate(cpu_ids):
            yield slice(pos, pos + 1), self.cpu[block : block + 1, :nbytes]

    def _write_cpu(self, cpu_ids: list[int], packed: torch.Tensor) -> None:
        for rows, host in self._host_slices(cpu_ids, packed.shape[1]):
            host.copy_(packed[rows], non_blocking=self.is_cuda)

    def _read_cpu(self, cpu_ids: list[int], nbytes: int) -> torch.Tensor:
        out = torch.empty((len(cpu_ids), nbytes), dtype=torch.uint8, device=self.device)
        for rows, host in self._host_slices(cpu_ids, nbytes):
            out[rows].copy_(host, non_blocking=self.is_cuda)
        return out

    def _flush_d2h(self) -> None:
        for cpu_ids, packed in self._pending_d2h:
            self._write_cpu(cpu_ids, packed)
        self._pending_d2h.clear()


# -- attention over block tables ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """One request's share of a step: tokens [num_computed, num_computed + num_scheduled)."""

    num_computed: int
    num_scheduled: int
    block_table: Sequence[int]

    @property
    def context_len(self) -> int:
        return self.num_computed + self.num_scheduled


@dataclass(frozen=True, slots=True)
class PrefillMeta:
    start: int  # first row of the chunk in the flattened batch
    end: int
    block_table: torch.Tensor | None  # blocks holding the context, None when nothing is cached
    mask: torch.Tensor | None  # [num_scheduled, context_len], None when nothing is cached


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Built once per step, shared by every layer."""

    slot_mapping: torch.Tensor  # [T]
    decode_rows: torch.Tensor  # [B] rows of one-token chunks
    decode_block_tables: torch.Tensor  # [B, max_blocks], padded with block 0
    decode_mask: torch.Tensor  # [B, 1, 1, max_blocks * block_size]
    prefills: tuple[PrefillMeta, ...]


def slot_mapping_of(chunk: SeqChunk, block_size: int) -> list[int]:
    table = chunk.block_table
    return [table[p // block_size] * block_size + p % block_size for p in range(chunk.num_computed, chunk.context_len)]


def build_metadata(chunks: Sequence[SeqChunk], block_size: int, device: torch.device) -> AttentionMetadata:
    slots: list[int] = []
    decode_rows: list[int] = []
    decodes: list[SeqChunk] = []
    prefills: list[PrefillMeta] = []
    row = 0
    for chunk in chunks:
        slots.extend(slot_mapping_of(chunk, block_size))
        if chunk.num_scheduled == 1:
            decode_rows.append(row)
            decodes.append(chunk)
        else:
            prefills.append(_prefill_meta(chunk, row, block_size, device))
        row += chunk.num_scheduled
    tables, mask = _decode_tables(decodes, block_size, device)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        decode_rows=torch.tensor(decode_rows, dtype=torch.long, device=device),
        decode_block_tables=tables,
        decode_mask=mask,
        prefills=tuple(prefills),
    )


def _prefill_meta(chunk: SeqChunk, row: int, block_size: int, device: torch.device) -> PrefillMeta:
    end = row + chunk.num_scheduled
    if chunk.num_computed == 0:
        return PrefillMeta(row, end, None, None)
    num_blocks = -(-chunk.context_len // block_size)
    table = torch.tensor(list(chunk.block_table[:num_blocks]), dtype=torch.long, device=device)
    # NOTE: query i sits at absolute position num_computed + i and sees keys 0..that position:
    # causal aligned to the bottom-right corner, which SDPA's is_causal (top-left) is not.
    q_pos = torch.arange(chunk.num_computed, chunk.context_len, device=device)[:, None]
    mask = torch.arange(chunk.context_len, device=device)[None, :] <= q_pos
    return PrefillMeta(row, end, table, mask)


def _decode_tables(decodes: list[SeqChunk], block_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    num_blocks = [-(-d.context_len // block_size) for d in decodes]
    width = max(num_blocks, default=0)
    rows = [list(d.block_table[:n]) + [0] * (width - n) for d, n in zip(decodes, num_blocks, strict=True)]
    tables = torch.tensor(rows, dtype=torch.long).reshape(len(decodes), width)
    lens = torch.tensor([d.context_len for d in decodes], dtype=torch.long)
    mask = torch.arange(width * block_size)[None, :] < lens[:, None]
    return tables.to(device), mask[:, None, None, :].to(device)


class PagedAttention:
    """The `Attention` the engine hands the model for one step."""

    def __init__(self, cache: PagedKVCache, metadata: AttentionMetadata) -> None:
        self.cache = cache
        self.meta = metadata

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.cache.write(layer_idx, k, v, self.meta.slot_mapping)
        k_cache, v_cache = self.cache.layer(layer_idx)
        out = torch.empty_like(q)
        if len(self.meta.decode_rows):
            out[self.meta.decode_rows] = self._decode(q, k_cache, v_cache)
        for p in self.meta.prefills:
            out[p.start : p.end] = self._prefill(p, q, k, v, k_cache, v_cache)
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        tables = self.meta.decode_block_tables
        batch, heads, dim = tables.shape[0], k_cache.shape[2], k_cache.shape[3]
        keys = k_cache[tables].view(batch, -1, heads, dim).transpose(1, 2)
        values = v_cache[tables].view(batch, -1, heads, dim).transpose(1, 2)
        queries = q[self.meta.decode_rows].unsqueeze(2)
        return sdpa(queries, keys, values, self.meta.decode_mask, causal=False)[:, :, 0]

    def _prefill(
        self,
        p: PrefillMeta,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        if p.block_table is None or p.mask is None:
            return causal_chunk(q[p.start : p.end], k[p.start : p.end], v[p.start : p.end])
        context_len, heads, dim = p.mask.shape[1], k_cache.shape[2], k_cache.shape[3]
        keys = k_cache[p.block_table].view(-1, heads, dim)[:context_len].transpose(0, 1)[None]
        values = v_cache[p.block_table].view(-1, heads, dim)[:context_len].transpose(0, 1)[None]
        queries = q[p.start : p.end].transpose(0, 1)[None]
        return sdpa(queries, keys, values, p.mask[None, None], causal=False)[0].transpose(0, 1)
