"""Logical KV-cache accounting: the scheduler owns every block id of every worker.

A worker's KV memory is cut into blocks of `block_size` tokens, one pool per tier
(GPU, CPU swap space). A request owns an ordered block table per tier; its token `t`
lives in block `table[t // block_size]` at slot `t % block_size`:

    block_size = 4, request with 10 tokens computed
    tokens   t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 __ __
    table  [     17      ,      3      ,     42      ]   ids drawn from the GPU pool
    capacity 12 tokens; the next 2 tokens fit, the 13th needs a new block

How much a request asks for depends on the allocation mode (vLLM allocates a block
when one is needed; Orca reserves prompt + max_tokens; EconoServe reserves prompt +
predicted output x (1 + padding)); `required_tokens` turns a mode into a token count
and `KVCacheManager.allocate` grows the table to cover it. Allocation answers None when
the blocks are not there: that is the caller's preemption trigger. Named reserves keep
a floor of free blocks that ordinary allocations may not take (EconoServe's PT reserve,
vLLM's watermark), without pinning particular ids.

Every operation is O(blocks moved); invariants (no block owned twice, no leak) are
checked by `check_invariants` in tests.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from enum import IntEnum, StrEnum


class Tier(IntEnum):
    GPU = 1
    CPU = 2


class AllocationMode(StrEnum):
    BLOCK = "block"  # vLLM: cover what is computed so far plus this step's tokens
    MAX = "max"  # Orca: prompt + max_tokens at the first allocation
    EXACT = "exact"  # EconoServe: prompt + predicted output x (1 + padding)
    RESERVED = "reserved"  # like BLOCK, but may draw on a named reserve


def required_tokens(
    mode: AllocationMode,
    *,
    num_tokens_after_step: int,
    num_prompt_tokens: int,
    max_tokens: int,
    predicted_output_tokens: int | None = None,
    padding: float = 0.0,
) -> int:
    """Tokens the request's block table must cover after this step, under `mode`."""
    if mode is AllocationMode.MAX:
        return max(num_tokens_after_step, num_prompt_tokens + max_tokens)
    if mode is AllocationMode.EXACT:
        predicted = max_tokens if predicted_output_tokens is None else predicted_output_tokens
        padded = min(max_tokens, math.ceil(predicted * (1.0 + padding)))
        return max(num_tokens_after_step, num_prompt_tokens + padded)
    return num_tokens_after_step


class KVAllocationError(RuntimeError):
    """A block operation that would break an invariant (double free, foreign id)."""


class BlockPool:
    """One tier of one worker: block ids 0..num_blocks-1 and an O(1) free stack."""

    __slots__ = ("_free", "_in_use", "_reserves", "block_size", "num_blocks")

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 0 or block_size <= 0:
            raise ValueError(f"bad pool shape: num_blocks={num_blocks} block_size={block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # NOTE: reversed so that pop() hands out low ids first (readable tests and plans).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._in_use = bytearray(num_blocks)
        self._reserves: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_reserved(self) -> int:
        return sum(self._reserves.values())

    def set_reserve(self, name: str, num_blocks: int) -> None:
        """Keeps `num_blocks` free blocks out of reach of allocations not naming `name`."""
        if num_blocks < 0:
            raise ValueError(f"reserve {name!r} must be >= 0 blocks, got {num_blocks}")
        if num_blocks == 0:
            self._reserves.pop(name, None)
        else:
            self._reserves[name] = num_blocks

    def num_available(self, reserve: str | None = None) -> int:
        """Free blocks an allocation may take (all reserves but its own are off limits)."""
        floor = self.num_reserved - (self._reserves.get(reserve, 0) if reserve else 0)
        return max(0, len(self._free) - floor)

    def allocate(self, num_blocks: int, reserve: str | None = None) -> list[int] | None:
        if num_blocks > self.num_available(reserve):
            return None
        free = self._free
        if not num_blocks:
            return []
        taken = free[len(free) - num_blocks :]
        del free[len(free) - num_blocks :]
        taken.reverse()  # the stack's top holds the lowest ids: hand them out in order
        in_use = self._in_use
        for b in taken:
            in_use[b] = 1
        return taken

    def free(self, block_ids: Iterable[int]) -> None:
        in_use = self._in_use
        for b in block_ids:
            if not 0 <= b < self.num_blocks or not in_use[b]:
                raise KVAllocationError(f"block {b} freed but not allocated")
            in_use[b] = 0
            self._free.append(b)

    def is_allocated(self, block_id: int) -> bool:
        return bool(self._in_use[block_id])

    def check_invariants(self) -> None:
        if len(set(self._free)) != len(self._free):
            raise KVAllocationError("a block is on the free list twice")
        if any(self._in_use[b] for b in self._free):
            raise KVAllocationError("a block is both free and in use")
        if len(self._free) + sum(self._in_use) != self.num_blocks:
            raise KVAllocationError("free + in use != total")


class KVCacheManager:
    """Block tables of the requests on one worker, over a GPU and a CPU pool."""

    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int, worker_id: int = 0) -> None:
        self.worker_id = worker_id
        self.block_size = block_size
        self.gpu = BlockPool(num_gpu_blocks, block_size)
        self.cpu = BlockPool(num_cpu_blocks, block_size)
        self.gpu_tables: dict[str, list[int]] = {}
        self.cpu_tables: dict[str, list[int]] = {}

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def capacity(self, request_id: str) -> int:
        """Tokens the request's GPU blocks can hold."""
        table = self.gpu_tables.get(request_id)
        return len(table) * self.block_size if table else 0

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        table = self.gpu_tables.get(request_id)
        have = len(table) if table else 0
        return max(0, self.num_blocks_for(num_tokens) - have)

    def can_allocate(self, request_id: str, num_tokens: int, reserve: str | None = None) -> bool:
        return self.num_new_blocks(request_id, num_tokens) <= self.gpu.num_available(reserve)

    def allocate(self, request_id: str, num_tokens: int, reserve: str | None = None) -> list[int] | None:
        """Grows the request's GPU table to cover `num_tokens`; returns the new block ids,
        [] when it already does, None (and changes nothing) when the blocks are not there."""
        table = self.gpu_tables.get(request_id)
        have = len(table) if table else 0
        need = -(-num_tokens // self.block_size) - have
        if need <= 0:
            return []
        new = self.gpu.allocate(need, reserve)
        if new is None:
            return None
        if table is None:
            self.gpu_tables[request_id] = new
        else:
            table.extend(new)
        return new

    def free(self, request_id: str) -> int:
        """Frees every block of the request on both tiers; returns the number freed."""
        n = 0
        table = self.gpu_tables.pop(request_id, None)
        if table:
            self.gpu.free(table)
            n += len(table)
        table = self.cpu_tables.pop(request_id, None)
        if table:
            self.cpu.free(table)
            n += len(table)
        return n

    def free_tail(self, request_id: str, num_tokens_kept: int) -> list[int]:
        """Frees the GPU blocks past those needed for `num_tokens_kept` (over-reservation)."""
        table = self.gpu_tables.get(request_id)
        if not table:
            return []
        keep = self.num_blocks_for(num_tokens_kept)
        tail = table[keep:]
        del table[keep:]
        self.gpu.free(tail)
        if not table:
            del self.gpu_tables[request_id]
        return tail

    def transfer_tail(self, src_id: str, dst_id: str, num_blocks: int) -> list[int]:
        """Moves the last `num_blocks` GPU blocks of `src_id` to the end of `dst_id`'s table
        (EconoServe's KV pipelining: a host lends the unused half of its allocation)."""
        src = self.gpu_tables.get(src_id, [])
        if num_blocks > len(src):
            raise KVAllocationError(f"{src_id} owns {len(src)} blocks, cannot lend {num_blocks}")
        moved = src[len(src) - num_blocks :]
        del src[len(src) - num_blocks :]
        if not src:
            self.gpu_tables.pop(src_id, None)
        self.gpu_tables.setdefault(dst_id, []).extend(moved)
        return moved

    def swap_out(self, request_id: str) -> list[tuple[int, int]] | None:
        """Moves the request's GPU blocks to CPU blocks; returns (gpu, cpu) pairs, or None
        when the swap space is full (nothing changes then)."""
        table = self.gpu_tables.get(request_id)
        if not table:
            return []
        cpu = self.cpu.allocate(len(table))
        if cpu is None:
            return None
        del self.gpu_tables[request_id]
        self.gpu.free(table)
        self.cpu_tables[request_id] = cpu
        return list(zip(table, cpu, strict=True))

    def swap_in(self, request_id: str, reserve: str | None = None) -> list[tuple[int, int]] | None:
        """Moves the request's CPU blocks back to new GPU blocks; returns (cpu, gpu) pairs."""
        table = self.cpu_tables.get(request_id)
        if not table:
            return []
        if request_id in self.gpu_tables:
            raise KVAllocationError(f"{request_id} swapped in while it still owns GPU blocks")
        gpu = self.gpu.allocate(len(table), reserve)
        if gpu is None:
            return None
        del self.cpu_tables[request_id]
        self.cpu.free(table)
        self.gpu_tables[request_id] = gpu
        return list(zip(table, gpu, strict=True))

    def check_invariants(self) -> None:
        """No block owned twice, every owned block allocated, every allocated block owned."""
        for pool, tables in ((self.gpu, self.gpu_tables), (self.cpu, self.cpu_tables)):
            pool.check_invariants()
            owned = [b for t in tables.values() for b in t]
            if len(owned) != len(set(owned)):
                raise KVAllocationError("a block is owned by two requests")
            if any(not pool.is_allocated(b) for b in owned):
                raise KVAllocationError("a request owns a free block")
            if len(owned) != pool.num_used:
                raise KVAllocationError(f"leak: {pool.num_used} blocks in use, {len(owned)} owned")

    def assert_empty(self) -> None:
        """The leak check that ends every core and policy test."""
        self.check_invariants()
        if self.gpu_tables or self.cpu_tables:
            raise KVAllocationError(f"requests still own KV: {sorted(self.gpu_tables) + sorted(self.cpu_tables)}")
        if self.gpu.num_used or self.cpu.num_used:
            raise KVAllocationError("blocks still in use")


class KVAccounting:
    """The global view: one KVCacheManager per worker."""

    def __init__(self) -> None:
        self.workers: dict[int, KVCacheManager] = {}

    def add_worker(self, worker_id: int, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int) -> KVCacheManager:
        if worker_id in self.workers:
            raise ValueError(f"worker {worker_id} already has a KV pool")
        manager = KVCacheManager(num_gpu_blocks, num_cpu_blocks, block_size, worker_id)
        self.workers[worker_id] = manager
        return manager

    def __getitem__(self, worker_id: int) -> KVCacheManager:
        return self.workers[worker_id]

    def check_invariants(self) -> None:
        for manager in self.workers.values():
            manager.check_invariants()

    def assert_empty(self) -> None:
        for manager in self.workers.values():
            manager.assert_empty()
