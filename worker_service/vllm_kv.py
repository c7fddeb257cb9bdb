"""The vLLM engine's KV cache as our swap and transfer code sees it: a PagedKVCache whose
device blocks live in vLLM's per-layer tensors.

    our block b  <->  vLLM block b + 1 of every layer tensor (vLLM's block 0 is its null block)
    a block      =   the bytes of that block in each layer, layer after layer, read through
                     vLLM's own logical view, [blocks, heads, kernel states, ...] in every
                     layout (CPU: [blocks, kv_heads, block_size, 2 * head_dim])

Gather and scatter are the only device access; swap out and in, int8 packing and the byte
format of KV transfers are PagedKVCache's, unchanged. A block is an opaque run of bytes in
vLLM's layout: swapped and transferred KV is bit-exact; int8 groups the block's values per
channel of the [layers, 2, block_size, heads, head_dim] view of those bytes, which is a valid
quantization (every value within half a step) though not per true channel. KV moves between
a vLLM worker and a torch worker would not mean the same bytes: a deployment's workers share
one engine.

No vLLM import here: this module holds torch tensors only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstore.paged import KVCacheSpec, PagedKVCache

NULL_BLOCKS = 1  # vLLM reserves block 0; ours start at 1 in its tensors


class LayerTensorsKVCache(PagedKVCache):
    """PagedKVCache over external per-layer tensors (see the module docstring)."""

    def __init__(
        self,
        spec: KVCacheSpec,
        layers: Sequence[torch.Tensor],
        block_dim: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
    ) -> None:
        per_block = sum(t.numel() // t.shape[block_dim] * t.element_size() for t in layers)
        if per_block != spec.bytes_per_block:
            raise ValueError(f"vLLM's KV holds {per_block} bytes per block, the spec {spec.bytes_per_block}")
        if any(t.shape[block_dim] < num_gpu_blocks + NULL_BLOCKS for t in layers):
            raise ValueError(f"vLLM's KV tensors hold fewer than {num_gpu_blocks} + {NULL_BLOCKS} blocks")
        self.layers = list(layers)
        self.block_dim = block_dim
        self._init_host(spec, num_gpu_blocks, num_cpu_blocks, layers[0].device)

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError("vLLM's attention reads its own tensors")

    def _index(self, ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor([b + NULL_BLOCKS for b in ids], dtype=torch.long).to(self.device, non_blocking=True)

    def _gather_gpu(self, ids: Sequence[int]) -> torch.Tensor:
        index, n = self._index(ids), len(ids)
        rows = [t.index_select(self.block_dim, index).movedim(self.block_dim, 0).reshape(n, -1) for t in self.layers]
        flat = torch.stack(rows, dim=1) if len(rows) > 1 else rows[0][:, None]
        return flat.view(n, *self.spec.block_shape)

    def _scatter_gpu(self, ids: Sequence[int], data: torch.Tensor) -> None:
        index, n = self._index(ids), len(ids)
        rows = data.to(self.device, non_blocking=True).reshape(n, len(self.layers), -1)
        for i, t in enumerate(self.layers):
            shape = (n, *(s for d, s in enumerate(t.shape) if d != self.block_dim))
            t.index_copy_(self.block_dim, index, rows[:, i].reshape(shape).movedim(0, self.block_dim))

    def export_blocks(self, gpu_ids: Sequence[int], int8: bool) -> bytes:
        data = self._gather_gpu(gpu_ids)
        packed = self._pack_int8(data) if int8 else data.reshape(len(gpu_ids), -1).view(torch.uint8)
        return packed.cpu().numpy().tobytes()

    def import_blocks(self, gpu_ids: Sequence[int], packed: torch.Tensor, int8: bool) -> None:
        expected = (len(gpu_ids), self.transfer_bytes_per_block(int8))
        if tuple(packed.shape) != expected:
            raise ValueError(f"KV rows of shape {tuple(packed.shape)}, expected {expected}")
        packed = packed.to(self.device)
        data = self._unpack_int8(packed) if int8 else packed.view(self.spec.dtype).view(-1, *self.spec.block_shape)
        self._scatter_gpu(gpu_ids, data)

    def zero(self) -> None:
        """Every block back to zeros (a new session must not read the last one's KV)."""
        for t in self.layers:
            t.zero_()
