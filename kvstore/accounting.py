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

Automatic prefix caching (vLLM's APC, SGLang's radix cache at block granularity): a full
block whose KV has been computed is registered under a hash chained over every token before
and in it (`register`). Blocks are reference-counted; a block that several requests' tables
name is shared read-only, and a request admitted with a cached prefix takes references on
the prefix's blocks instead of new ones (`lookup_prefix`, then `allocate(..., prefix=...)`).
When the last reference goes, a registered block is not freed: it waits in an LRU, still
holding its KV, and is evicted (its hash forgotten) only when an allocation finds no plain
free block. Tables are released tail first, so a request's last blocks are evicted first
and the prefix others share last:

    block_size = 4; A computed 10 tokens, its 2 full blocks registered (h0, h1)
    A: [ 17(h0) , 3(h1) , 42 ]            refs 17:1 3:1 42:1
    B admitted with the same 8-token prefix + 5 new tokens:
    B: [ 17(h0) , 3(h1) , 8 , 9 ]         refs 17:2 3:2; B starts at 8 computed tokens
    A ends: 42 -> free list; 3, 17 keep their refs from B; B ends: 9, 8 -> free; 3, 17 -> LRU
    free blocks = free list (never registered) + LRU (registered, ref 0): both allocatable

A request that ends parks its computed full blocks nobody can ever name (their hashes would be
unique to it) in the LRU without hashing them, so that they age there exactly as registered
blocks would (the eviction order the others' cached blocks see is unchanged). Parked blocks that
leave a table together wait as one LRU entry, a run, and an allocation takes them off as a
slice: a trace without shared prefixes, where every ended request's blocks are parked, costs
O(1) LRU operations per request instead of a few per block.

A request whose blocks only it can name (salted: no token ids or trace ids name them) and whose
KV is freed while it lives on (a recompute preemption, the end of an SCLS slice) leaves its full
blocks the same way, as one run that it owns (`free_owned`): its lookup finds what is left of the
run (`owned_prefix`; the LRU evicts a run from its last blocks, so what is left is always a
prefix) and its re-admission takes the run back whole, where registering and sharing each block
would cost a hash, a registration and two LRU operations per block. The pool, the hits and the
evictions are those of registering each block. Where its KV leaves otherwise (a swap, a shrink,
a loan, a hand-off) or a hit takes only part of its run, the request's blocks on that worker are
registered under their hashes from then on (`mark_hashed`; what is left of the run is registered
in place).

Every operation is O(blocks moved); invariants (reference counts match the tables, the free
list, the LRU and the hash map agree, no leak) are checked by `check_invariants` in tests.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
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
    """One tier of one worker: block ids 0..num_blocks-1, reference counts, an O(1) free
    stack of never-registered blocks and an LRU of registered blocks nobody references."""

    __slots__ = (
        "_evictable",
        "_free",
        "_hash_of",
        "_num_parked",
        "_num_runs",
        "_ref",
        "_reserved",
        "_reserves",
        "_runs",
        "block_size",
        "by_hash",
        "num_blocks",
        "num_evictions",
    )

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 0 or block_size <= 0:
            raise ValueError(f"bad pool shape: num_blocks={num_blocks} block_size={block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # NOTE: reversed so that pop() hands out low ids first (readable tests and plans).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._ref = [0] * num_blocks
        self._reserves: dict[str, int] = {}
        self._reserved = 0  # their sum (read by every availability test)
        # ref 0, registered, oldest first: block id -> None, or (a negative key) -> a run of parked
        # blocks, in the order they leave
        self._evictable: OrderedDict[int, list[int] | None] = OrderedDict()
        self._hash_of: dict[int, int | None] = {}  # registered block -> its prefix hash (None: parked)
        self._runs = 0  # runs made so far (their keys are -1, -2, ...)
        self._num_parked = 0  # blocks in the LRU's runs (not in `_hash_of`)
        self._num_runs = 0  # runs in the LRU
        self.by_hash: dict[int, int] = {}  # prefix hash -> the block holding its KV
        self.num_evictions = 0  # cached blocks forgotten so far (a lookup older than a change is stale)

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: never registered, plus registered ones nobody uses."""
        return len(self._free) + self.num_evictable

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Registered (or parked) blocks, in use or waiting in the LRU."""
        return len(self._hash_of) + self._num_parked

    @property
    def num_evictable(self) -> int:
        """Blocks in the LRU (a run of parked blocks is one entry holding them all)."""
        return len(self._evictable) + self._num_parked - self._num_runs

    @property
    def num_reserved(self) -> int:
        return self._reserved

    def set_reserve(self, name: str, num_blocks: int) -> None:
        """Keeps `num_blocks` free blocks out of reach of allocations not naming `name`."""
        if num_blocks < 0:
            raise ValueError(f"reserve {name!r} must be >= 0 blocks, got {num_blocks}")
        if num_blocks == 0:
            self._reserves.pop(name, None)
        else:
            self._reserves[name] = num_blocks
        self._reserved = sum(self._reserves.values())

    def num_available(self, reserve: str | None = None) -> int:
        """Free blocks an allocation may take (all reserves but its own are off limits)."""
        floor = self._reserved - (self._reserves.get(reserve, 0) if reserve else 0)
        return max(0, len(self._free) + len(self._evictable) + self._num_parked - self._num_runs - floor)

    def allocate(self, num_blocks: int, reserve: str | None = None) -> list[int] | None:
        """Fresh blocks (reference 1): the free stack first, then the LRU's oldest, whose
        hashes are forgotten. None (nothing changed) when they are not there."""
        if num_blocks > self.num_available(reserve):
            return None
        if not num_blocks:
            return []
        free = self._free
        from_stack = min(num_blocks, len(free))
        taken = free[len(free) - from_stack :]
        del free[len(free) - from_stack :]
        taken.reverse()  # the stack's top holds the lowest ids: hand them out in order
        if num_blocks > from_stack:
            self._evict_into(taken, num_blocks - from_stack)
        ref = self._ref
        for b in taken:
            ref[b] = 1
        return taken

    def _evict_into(self, taken: list[int], n: int) -> None:
        """Takes the n oldest blocks of the LRU into `taken`, forgetting their hashes (one call
        per allocation: with prefix caching on, every block a finished request freed comes back
        through here)."""
        evictable, hash_of, by_hash = self._evictable, self._hash_of, self.by_hash
        self.num_evictions += n
        while n:
            run = evictable[next(iter(evictable))]
            if run is not None and len(run) > n:
                # NOTE: the run's oldest blocks leave and the rest stays the LRU's oldest entry, in
                # place (a decode's one new block a step, once the pool has turned over)
                taken += run[:n]
                del run[:n]
                self._num_parked -= n
                return
            block, run = evictable.popitem(last=False)
            if run is None:
                h = hash_of.pop(block)
                if h is not None:
                    del by_hash[h]
                taken.append(block)
                n -= 1
            else:
                taken += run
                n -= len(run)
                self._num_parked -= len(run)
                self._num_runs -= 1

    def share(self, block_ids: Iterable[int]) -> None:
        """Takes one more reference on registered blocks (a prefix hit); blocks nobody used
        leave the LRU."""
        ref, evictable, hashed = self._ref, self._evictable, self._hash_of
        for b in block_ids:
            if b not in hashed:
                raise KVAllocationError(f"block {b} shared but not registered in the prefix cache")
            if ref[b] == 0:
                del evictable[b]
            ref[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drops one reference per id; a block nobody references goes to the free stack, or
        to the LRU's young end when it is registered (its KV stays reusable)."""
        ref, hashed = self._ref, self._hash_of
        for b in block_ids:
            if not 0 <= b < self.num_blocks or ref[b] <= 0:
                raise KVAllocationError(f"block {b} freed but not allocated")
            ref[b] -= 1
            if ref[b] == 0:
                if b in hashed:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def register(self, block_id: int, block_hash: int) -> bool:
        """Files a computed full block under its prefix hash; False when the hash already has
        a block (the same prefix computed twice: the first copy stays the cached one)."""
        if block_hash in self.by_hash or block_id in self._hash_of:
            return False
        if self._ref[block_id] <= 0:
            raise KVAllocationError(f"block {block_id} registered but not allocated")
        self.by_hash[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        return True

    def park(self, block_id: int) -> None:
        """Files a computed full block that no lookup can ever name (its request ends and its
        hash was unique to it) as cached without a hash: freed, it ages in the LRU like the
        registered blocks freed with it, and no hash is computed for it."""
        if block_id not in self._hash_of:
            self._hash_of[block_id] = None

    def park_all(self, block_ids: Iterable[int]) -> None:
        """`park` of each block (one call per ended request)."""
        hash_of = self._hash_of
        for b in block_ids:
            if b not in hash_of:
                hash_of[b] = None

    def free_parking(self, table: list[int], start: int, stop: int) -> None:
        """`park_all(table[start:stop])`, then `free(reversed(table))`: the blocks of an ended
        request's table, its full unregistered ones parked. The parked ones, which reach the
        LRU one after another, wait there as one run (same order, same ages)."""
        run = table[start:stop]
        if not self._one_owner_each(run):
            self.park_all(run)
            self.free(reversed(table))
            return
        self.free(table[: stop - 1 : -1])
        self._keep_run(run)
        self.free(table[start - 1 :: -1] if start else ())

    def free_owned(self, table: list[int], stop: int) -> int:
        """`free(reversed(table))` for a table none of whose blocks is registered, its first
        `stop` blocks (full, computed, named only by their own request) kept in the LRU as one
        run, in the order `free` would have put them there: its key, for the owner to find the
        run again (`take_run`); 0 when the blocks do not qualify (nothing changed then)."""
        run = table[:stop]
        if not self._one_owner_each(run):
            return 0
        self.free(table[: stop - 1 : -1])
        return self._keep_run(run)

    def _one_owner_each(self, run: list[int]) -> bool:
        """Whether `run` is non-empty, none of its blocks registered, and each held once."""
        # NOTE: an unregistered block has one owner (only registered blocks are shared)
        # NOTE: the reference counts read by map (a generator per ended request was most of this call)
        return bool(run) and self._hash_of.keys().isdisjoint(run) and set(map(self._ref.__getitem__, run)) == {1}

    def _keep_run(self, run: list[int]) -> int:
        """Frees `run` (first block first) into the LRU as one run, in the order and at the ages
        freeing its blocks last to first would give them; returns the run's key."""
        run.reverse()
        ref = self._ref
        for b in run:
            ref[b] = 0
        self._runs += 1
        self._evictable[-self._runs] = run
        self._num_runs += 1
        self._num_parked += len(run)
        return -self._runs

    def run_blocks(self, key: int) -> list[int]:
        """What is left of a run in the LRU, oldest first (the LRU evicts a run from that end):
        [] once it is evicted."""
        run = self._evictable.get(key)
        return run if run is not None and key < 0 else []

    def take_run(self, key: int) -> list[int]:
        """Takes what is left of a run out of the LRU, its blocks referenced once each; returns
        them newest first (the order of the table they were freed from)."""
        run = self._evictable.pop(key)
        self._num_parked -= len(run)
        self._num_runs -= 1
        ref = self._ref
        for b in run:
            ref[b] = 1
        run.reverse()
        return run

    def register_run(self, key: int, hashes: Sequence[int]) -> None:
        """Turns what is left of a run into registered blocks, one LRU entry each in the run's
        place: its newest block under hashes[0], the next under hashes[1], ... (O(LRU))."""
        run = self._evictable[key]
        items = list(self._evictable.items())
        self._evictable.clear()
        n = len(run)
        for k, v in items:
            if k != key:
                self._evictable[k] = v
                continue
            for i, b in enumerate(run):
                h = hashes[n - 1 - i]
                self.by_hash[h] = b
                self._hash_of[b] = h
                self._evictable[b] = None
        self._num_parked -= n
        self._num_runs -= 1

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """Blocks of the longest run of `hashes`, from the first, that the cache holds."""
        hits: list[int] = []
        by_hash = self.by_hash
        for h in hashes:
            b = by_hash.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def num_taken_from_free(self, block_ids: Iterable[int]) -> int:
        """How many of these registered blocks sit in the LRU (sharing them takes them out)."""
        ref = self._ref
        return sum(1 for b in block_ids if ref[b] == 0)

    def clear_cache(self) -> None:
        """Forgets every hash (the worker's KV is no longer trusted); LRU blocks become plain free."""
        free = self._free
        for block, run in reversed(self._evictable.items()):
            if run is None:
                free.append(block)
            else:
                free.extend(reversed(run))
        self.num_evictions += len(self._hash_of) + self._num_parked + 1
        self._evictable.clear()
        self._hash_of.clear()
        self.by_hash.clear()
        self._num_parked = self._num_runs = 0

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def is_allocated(self, block_id: int) -> bool:
        return self._ref[block_id] > 0

    def is_registered(self, block_id: int) -> bool:
        """Named in the prefix cache, or parked (one block of an LRU run: never in a table)."""
        return block_id in self._hash_of

    def check_invariants(self) -> None:
        free, ref = self._free, self._ref
        singles = [b for b, run in self._evictable.items() if run is None]
        runs = [run for run in self._evictable.values() if run is not None]
        parked = [b for run in runs for b in run]
        if len(set(free)) != len(free) or len(set(parked)) != len(parked) or set(parked) & set(free):
            raise KVAllocationError("a block is on the free list or in a parked run twice")
        if any(ref[b] for b in free) or any(ref[b] for b in singles) or any(ref[b] for b in parked):
            raise KVAllocationError("a block is both free and in use")
        if any(b in self._hash_of for b in free) or any(b not in self._hash_of for b in singles):
            raise KVAllocationError("the free list holds a registered block, or the LRU an unregistered one")
        if any(b in self._hash_of for b in parked) or not all(runs):
            raise KVAllocationError("a parked run holds a registered block, or none")
        if len(runs) != self._num_runs or len(parked) != self._num_parked:
            raise KVAllocationError("the parked runs' counts disagree with the runs")
        if len(free) + len(singles) + len(parked) + sum(1 for r in ref if r > 0) != self.num_blocks:
            raise KVAllocationError("free + cached + in use != total")
        named = {b: h for b, h in self._hash_of.items() if h is not None}
        if any(self.by_hash.get(h) != b for b, h in named.items()) or len(self.by_hash) != len(named):
            raise KVAllocationError("the prefix hash map and the block hashes disagree")


class KVCacheManager:
    """Block tables of the requests on one worker, over a GPU and a CPU pool.

    With `prefix_caching`, computed full blocks are registered in the GPU pool's prefix
    cache (`cache_blocks`), found again by `lookup_prefix` and shared by reference; without
    it nothing is ever registered and every block has one owner, as before."""

    def __init__(
        self,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        block_size: int,
        worker_id: int = 0,
        prefix_caching: bool = False,
    ) -> None:
        self.worker_id = worker_id
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.gpu = BlockPool(num_gpu_blocks, block_size)
        self.cpu = BlockPool(num_cpu_blocks, block_size)
        self.gpu_tables: dict[str, list[int]] = {}
        self.cpu_tables: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}  # leading blocks of a table already offered to the cache
        # a live request's own blocks waiting in the LRU as one run (`free_owned`): request id ->
        # (run key, its block hashes on demand)
        self._owned: dict[str, tuple[int, Callable[[int], Sequence[int]]]] = {}
        # requests whose own blocks are registered under their hashes here instead (`mark_hashed`)
        self.hashed: set[str] = set()

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def capacity(self, request_id: str) -> int:
        """Tokens the request's GPU blocks can hold."""
        table = self.gpu_tables.get(request_id)
        return len(table) * self.block_size if table else 0

    def num_new_blocks(self, request_id: str, num_tokens: int, prefix: Sequence[int] = ()) -> int:
        """Free blocks the request takes to cover `num_tokens`: new ones, plus the LRU blocks
        among a prefix hit it would share (for a request without a table)."""
        table = self.gpu_tables.get(request_id)
        have = len(table) if table else 0
        if have or not prefix:
            return max(0, self.num_blocks_for(num_tokens) - have)
        fresh = max(0, self.num_blocks_for(num_tokens) - len(prefix))
        return fresh + self.gpu.num_taken_from_free(prefix)

    def can_allocate(
        self, request_id: str, num_tokens: int, reserve: str | None = None, prefix: Sequence[int] = ()
    ) -> bool:
        return self.num_new_blocks(request_id, num_tokens, prefix) <= self.gpu.num_available(reserve)

    def allocate(
        self, request_id: str, num_tokens: int, reserve: str | None = None, prefix: Sequence[int] = ()
    ) -> list[int] | None:
        """Grows the request's GPU table to cover `num_tokens`; returns the new block ids,
        [] when it already does, None (and changes nothing) when the blocks are not there.
        `prefix`: cached blocks (from `lookup_prefix`) a table-less request starts with,
        shared rather than allocated."""
        table = self.gpu_tables.get(request_id)
        if table is None:
            if prefix:
                return self._allocate_with_prefix(request_id, num_tokens, reserve, prefix)
            owned = self._owned.get(request_id)
            if owned is not None:  # NOTE: a table that does not start from its own run
                if self.gpu.run_blocks(owned[0]):
                    self.mark_hashed(request_id)
                else:
                    del self._owned[request_id]
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

    def _allocate_with_prefix(
        self, request_id: str, num_tokens: int, reserve: str | None, prefix: Sequence[int]
    ) -> list[int] | None:
        need = max(0, self.num_blocks_for(num_tokens) - len(prefix))
        owned = self._owned.get(request_id)
        if owned is not None:  # the hit is its own run (`owned_prefix`): taken back whole
            if need + len(prefix) > self.gpu.num_available(reserve):
                return None
            run = self.gpu.run_blocks(owned[0])
            if len(run) != len(prefix) or run[-1] != prefix[0]:
                raise KVAllocationError(f"{request_id}'s prefix is not what is left of its run")
            del self._owned[request_id]
            table = self.gpu.take_run(owned[0])
            new = self.gpu.allocate(need, reserve)
            assert new is not None  # NOTE: checked above
            table += new
            self.gpu_tables[request_id] = table
            return new
        if need + self.gpu.num_taken_from_free(prefix) > self.gpu.num_available(reserve):
            return None
        self.gpu.share(prefix)
        new = self.gpu.allocate(need, reserve)
        assert new is not None  # NOTE: checked above; sharing took exactly the LRU blocks counted
        self.gpu_tables[request_id] = [*prefix, *new]
        self._num_registered[request_id] = len(prefix)
        return new

    def lookup_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Cached blocks of the longest prefix of `hashes` (the request's full-block hashes)."""
        return self.gpu.lookup(hashes) if self.prefix_caching else []

    def cache_blocks(self, request_id: str, hashes: Sequence[int], num_full_blocks: int) -> None:
        """Registers the request's first `num_full_blocks` blocks (full, KV computed) under
        `hashes`; blocks offered before are skipped, so this is O(new blocks)."""
        table = self.gpu_tables.get(request_id)
        if not self.prefix_caching or table is None:
            return
        done = self._num_registered.get(request_id, 0)
        upto = min(num_full_blocks, len(table), len(hashes))
        register = self.gpu.register
        for i in range(done, upto):
            register(table[i], hashes[i])
        if upto > done:
            self._num_registered[request_id] = upto

    def park_blocks(self, request_id: str, num_full_blocks: int) -> None:
        """The request ends: its full blocks past those registered are parked (`BlockPool.park`),
        so that freeing them leaves the pool exactly as registering them would have."""
        table = self.gpu_tables.get(request_id)
        if not self.prefix_caching or table is None:
            return
        self.gpu.park_all(table[self._num_registered.get(request_id, 0) : min(num_full_blocks, len(table))])

    def free_parked(self, request_id: str, num_full_blocks: int) -> int:
        """`park_blocks`, then `free`, in one: the parked blocks wait in the LRU as one run
        (`BlockPool.free_parking`)."""
        table = self.gpu_tables.get(request_id)
        if not self.prefix_caching or not table:
            return self.free(request_id)
        start = self._num_registered.pop(request_id, 0)
        del self.gpu_tables[request_id]
        self.gpu.free_parking(table, start, max(start, min(num_full_blocks, len(table))))
        n = len(table)
        return n + self._free_cpu(request_id)

    def free_owned(self, request_id: str, num_full_blocks: int, hashes: Callable[[int], Sequence[int]]) -> int:
        """Frees the request's blocks while it lives on (a recompute preemption, the end of a
        slice) when nobody else can name its blocks (salted, `core/prefix.py`): its first
        `num_full_blocks` blocks (full, computed) wait in the LRU as one run that only its own
        lookup finds (`owned_prefix`) and its re-admission takes back whole. The pool is left as
        registering each under its hash and freeing the table would leave it (same LRU order,
        same evictions), without a hash, a registration or an LRU entry per block; `hashes(n)`
        gives the blocks' hashes should they have to be registered after all (`mark_hashed`).
        Returns the number of blocks released."""
        table = self.gpu_tables.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        n = 0
        if table:
            n = len(table)
            stop = min(num_full_blocks, n)
            key = self.gpu.free_owned(table, stop) if stop > 0 and self.prefix_caching else 0
            if key:
                self._owned[request_id] = (key, hashes)
            else:  # NOTE: not expected (its blocks are neither registered nor shared): the registered way
                if stop > 0 and self.prefix_caching:
                    self.hashed.add(request_id)
                    for b, h in zip(table[:stop], hashes(stop), strict=False):
                        self.gpu.register(b, h)
                self.gpu.free(reversed(table))
        return n + self._free_cpu(request_id)

    def owned_prefix(self, request_id: str, limit: int) -> list[int] | None:
        """The request's own run (`free_owned`) as a prefix hit, in table order: what is left of
        it (the LRU evicts a run from its last blocks), [] when nothing is; None when the
        request's blocks are registered here instead (look its hashes up). A run longer than
        `limit` blocks is registered now (the hit takes only part of it)."""
        if request_id in self.hashed or not self.prefix_caching:
            return None
        owned = self._owned.get(request_id)
        if owned is None:
            return []
        run = self.gpu.run_blocks(owned[0])
        if not run:
            del self._owned[request_id]
            return []
        if len(run) > limit:
            self.mark_hashed(request_id)
            return None
        return run[::-1]

    def mark_hashed(self, request_id: str) -> None:
        """From now on the request's blocks here are registered under their hashes (its KV
        leaves by a swap, a shrink, a loan or a hand-off, or its run is only partly reused):
        what is left of its run is registered in place."""
        owned = self._owned.pop(request_id, None)
        self.hashed.add(request_id)
        if owned is not None:
            run = self.gpu.run_blocks(owned[0])
            if run:
                self.gpu.register_run(owned[0], owned[1](len(run)))

    def forget_owner(self, request_id: str) -> None:
        """The request ended: its run (if any) stays in the LRU, parked, nobody's."""
        self._owned.pop(request_id, None)
        self.hashed.discard(request_id)

    def num_registered(self, request_id: str) -> int:
        """Leading blocks of the request's table already offered to the prefix cache."""
        return self._num_registered.get(request_id, 0)

    def clear_prefix_cache(self) -> None:
        """The worker's KV can no longer be trusted (a failed step, a lost worker)."""
        self.gpu.clear_cache()
        self._num_registered.clear()
        self._owned.clear()
        self.hashed.clear()

    def free(self, request_id: str) -> int:
        """Releases every block of the request on both tiers; returns the number released.
        GPU blocks go tail first, so the LRU evicts a request's last blocks before its prefix."""
        n = 0
        self._num_registered.pop(request_id, None)
        table = self.gpu_tables.pop(request_id, None)
        if table:
            self.gpu.free(reversed(table))
            n += len(table)
        return n + self._free_cpu(request_id)

    def _free_cpu(self, request_id: str) -> int:
        """Releases the request's CPU (swap) blocks; returns how many."""
        table = self.cpu_tables.pop(request_id, None)
        if not table:
            return 0
        self.cpu.free(table)
        return len(table)

    def free_tail(self, request_id: str, num_tokens_kept: int) -> list[int]:
        """Frees the GPU blocks past those needed for `num_tokens_kept` (over-reservation)."""
        table = self.gpu_tables.get(request_id)
        if not table:
            return []
        keep = self.num_blocks_for(num_tokens_kept)
        tail = table[keep:]
        del table[keep:]
        self.gpu.free(reversed(tail))
        if request_id in self._num_registered:
            self._num_registered[request_id] = min(self._num_registered[request_id], keep)
        if not table:
            del self.gpu_tables[request_id]
            self._num_registered.pop(request_id, None)
        return tail

    def transfer_tail(self, src_id: str, dst_id: str, num_blocks: int) -> list[int]:
        """Moves the last `num_blocks` GPU blocks of `src_id` to the end of `dst_id`'s table
        (EconoServe's KV pipelining: a host lends the unused half of its allocation)."""
        src = self.gpu_tables.get(src_id, [])
        if num_blocks > len(src):
            raise KVAllocationError(f"{src_id} owns {len(src)} blocks, cannot lend {num_blocks}")
        moved = src[len(src) - num_blocks :]
        if any(self.gpu.ref_count(b) != 1 or self.gpu.is_registered(b) for b in moved):
            raise KVAllocationError(f"{src_id} cannot lend shared or cached blocks")
        del src[len(src) - num_blocks :]
        if src_id in self._num_registered:
            self._num_registered[src_id] = min(self._num_registered[src_id], len(src))
        if not src:
            self.gpu_tables.pop(src_id, None)
            self._num_registered.pop(src_id, None)
        self.gpu_tables.setdefault(dst_id, []).extend(moved)
        return moved

    def swap_out(self, request_id: str) -> list[tuple[int, int]] | None:
        """Copies the request's GPU blocks to CPU blocks and releases the GPU ones; returns
        (gpu, cpu) pairs, or None when the swap space is full (nothing changes then). Shared
        prefix blocks are copied too (the CPU copy is the request's own) and stay cached."""
        table = self.gpu_tables.get(request_id)
        if not table:
            return []
        cpu = self.cpu.allocate(len(table))
        if cpu is None:
            return None
        del self.gpu_tables[request_id]
        self._num_registered.pop(request_id, None)
        self.gpu.free(reversed(table))
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
        """Every reference is a table entry and every table entry a reference; a block is
        named twice in one table never, by two tables only when it is a registered (cached,
        read-only) block; every allocated block is owned."""
        for pool, tables in ((self.gpu, self.gpu_tables), (self.cpu, self.cpu_tables)):
            pool.check_invariants()
            owners: dict[int, int] = {}
            for table in tables.values():
                if len(set(table)) != len(table):
                    raise KVAllocationError("a table names one block twice")
                for b in table:
                    owners[b] = owners.get(b, 0) + 1
            if any(n > 1 and not pool.is_registered(b) for b, n in owners.items()):
                raise KVAllocationError("a block is owned by two requests")
            if any(pool.ref_count(b) != n for b, n in owners.items()):
                raise KVAllocationError("a request owns a block whose reference count disagrees")
            if len(owners) != pool.num_used:
                raise KVAllocationError(f"leak: {pool.num_used} blocks in use, {len(owners)} owned")

    def assert_empty(self) -> None:
        """The leak check that ends every core and policy test (cached blocks nobody
        references are free: they may stay in the LRU)."""
        self.check_invariants()
        if self.gpu_tables or self.cpu_tables:
            raise KVAllocationError(f"requests still own KV: {sorted(self.gpu_tables) + sorted(self.cpu_tables)}")
        if self.gpu.num_used or self.cpu.num_used:
            raise KVAllocationError("blocks still in use")


class KVAccounting:
    """The global view: one KVCacheManager per worker."""

    def __init__(self) -> None:
        self.workers: dict[int, KVCacheManager] = {}

    def add_worker(
        self, worker_id: int, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int, prefix_caching: bool = False
    ) -> KVCacheManager:
        if worker_id in self.workers:
            raise ValueError(f"worker {worker_id} already has a KV pool")
        manager = KVCacheManager(num_gpu_blocks, num_cpu_blocks, block_size, worker_id, prefix_caching)
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
