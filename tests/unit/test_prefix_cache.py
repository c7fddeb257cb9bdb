"""Automatic prefix caching in the KV accounting (kvstore.accounting) and the block hashes
that name blocks (core/prefix.py): hits are found, shared by reference and counted once; a
referenced block is never freed; freed cached blocks wait in an LRU and are evicted only when
no plain free block is left, oldest first and a request's tail before its prefix."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.accounting import KVCacheManager
from scheduler_service.core.prefix import PrefixSource, block_hashes
from scheduler_service.core.request import Request


def cached_request(kv: KVCacheManager, rid: str, hashes: list[int], num_tokens: int) -> list[int]:
    """Allocates like the scheduler: prefix hit first, then registers the computed full blocks."""
    hit = kv.lookup_prefix(hashes)
    assert kv.allocate(rid, num_tokens, prefix=hit) is not None
    kv.cache_blocks(rid, hashes, num_tokens // kv.block_size)
    return hit


def test_a_cached_prefix_is_found_shared_and_counted_once() -> None:
    kv = KVCacheManager(16, 0, 4, prefix_caching=True)
    assert cached_request(kv, "a", [1, 2, 3], 12) == []
    hit = cached_request(kv, "b", [1, 2, 9], 14)
    assert hit == kv.gpu_tables["a"][:2] == kv.gpu_tables["b"][:2]
    assert kv.gpu.num_used == 3 + 2  # b took one new full block and one partial, shared two
    assert [kv.gpu.ref_count(x) for x in kv.gpu_tables["b"]] == [2, 2, 1, 1]
    kv.check_invariants()
    kv.free("a")
    kv.free("b")
    kv.assert_empty()


def test_a_block_is_never_freed_while_a_table_references_it() -> None:
    kv = KVCacheManager(8, 0, 4, prefix_caching=True)
    cached_request(kv, "a", [1, 2], 8)
    cached_request(kv, "b", [1, 2], 8)
    shared = list(kv.gpu_tables["b"])
    kv.free("a")
    assert all(kv.gpu.is_allocated(x) for x in shared) and kv.gpu.num_evictable == 0
    # all six other blocks go to a third request: nothing of b's may be taken
    taken = kv.allocate("c", 24)
    assert taken is not None and not set(taken) & set(shared)
    assert kv.allocate("d", 4) is None
    kv.check_invariants()
    for rid in ("b", "c"):
        kv.free(rid)
    kv.assert_empty()


def test_freed_cached_blocks_stay_cached_until_no_plain_free_block_is_left() -> None:
    kv = KVCacheManager(6, 0, 4, prefix_caching=True)
    cached_request(kv, "a", [1, 2], 8)
    kv.free("a")
    assert kv.gpu.num_free == 6 and kv.gpu.num_evictable == 2 and kv.gpu.num_used == 0
    kv.allocate("b", 16)  # the 4 never-registered blocks
    assert kv.lookup_prefix([1, 2]) != [] and kv.gpu.num_evictions == 0
    kv.allocate("c", 4)  # one more: the LRU gives up its oldest
    assert kv.gpu.num_evictions == 1 and kv.gpu.num_evictable == 1
    kv.check_invariants()


def test_eviction_takes_the_least_recently_freed_request_first_and_its_tail_before_its_prefix() -> None:
    kv = KVCacheManager(6, 0, 4, prefix_caching=True)
    cached_request(kv, "old", [1, 2, 3], 12)
    cached_request(kv, "new", [7, 8, 9], 12)
    kv.free("old")
    kv.free("new")
    kv.allocate("x", 4)
    assert kv.lookup_prefix([1, 2, 3]) == kv.lookup_prefix([1, 2])  # old's last block went first
    kv.allocate("y", 8)
    assert kv.lookup_prefix([1, 2, 3]) == [] and len(kv.lookup_prefix([7, 8, 9])) == 3
    kv.free("x")
    kv.free("y")
    kv.assert_empty()


def test_sharing_a_cached_block_from_the_lru_takes_it_out_of_the_free_count() -> None:
    kv = KVCacheManager(4, 0, 4, prefix_caching=True)
    cached_request(kv, "a", [1, 2], 8)
    kv.free("a")
    hit = kv.lookup_prefix([1, 2])
    assert kv.num_new_blocks("b", 16, hit) == 2 + 2  # two new blocks plus the two it revives
    assert kv.num_new_blocks("b", 20, hit) == 5 and not kv.can_allocate("b", 20, prefix=hit)
    assert kv.allocate("b", 20, prefix=hit) is None and kv.gpu.num_evictable == 2  # nothing changed
    kv.check_invariants()


def test_clearing_the_cache_forgets_every_hash_and_frees_the_lru() -> None:
    kv = KVCacheManager(4, 0, 4, prefix_caching=True)
    cached_request(kv, "a", [1, 2], 8)
    cached_request(kv, "b", [5], 4)
    kv.free("a")
    kv.clear_prefix_cache()
    assert kv.lookup_prefix([1]) == [] and kv.lookup_prefix([5]) == [] and kv.gpu.num_cached == 0
    assert kv.gpu.num_free == 3
    kv.free("b")
    kv.assert_empty()


def test_without_prefix_caching_nothing_is_registered_or_found() -> None:
    kv = KVCacheManager(4, 0, 4)
    cached_request(kv, "a", [1, 2], 8)
    assert kv.gpu.num_cached == 0 and kv.lookup_prefix([1, 2]) == []


def test_swapping_out_a_request_that_shares_its_prefix_leaves_the_others_blocks_cached() -> None:
    kv = KVCacheManager(8, 8, 4, prefix_caching=True)
    cached_request(kv, "a", [1, 2], 10)
    cached_request(kv, "b", [1, 2], 10)
    pairs = kv.swap_out("b")
    assert pairs is not None and [g for g, _ in pairs] == [*kv.gpu_tables["a"][:2], pairs[2][0]]
    assert [kv.gpu.ref_count(x) for x in kv.gpu_tables["a"]] == [1, 1, 1]
    assert kv.swap_in("b") is not None
    kv.check_invariants()
    kv.free("a")
    kv.free("b")
    kv.assert_empty()


OPS = st.lists(
    st.tuples(
        st.sampled_from(["admit", "grow", "free", "swap_out", "swap_in", "shrink"]),
        st.integers(0, 4),
        st.integers(0, 24),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(OPS)
def test_random_sequences_with_prefix_caching_keep_every_invariant(ops: list[tuple[str, int, int]]) -> None:
    kv = KVCacheManager(num_gpu_blocks=12, num_cpu_blocks=8, block_size=4, prefix_caching=True)
    for op, who, n in ops:
        rid = f"r{who}"
        hashes = [who % 2, 10 + who % 3, 20 + who, 30 + n % 2, 40, 50, 60]  # requests share leading blocks
        if op == "admit" and rid not in kv.gpu_tables and rid not in kv.cpu_tables:
            hit = kv.lookup_prefix(hashes[: max(0, n - 1) // 4])
            if kv.allocate(rid, max(n, 1), prefix=hit) is not None:
                kv.cache_blocks(rid, hashes, n // 4)
        elif op == "grow" and rid in kv.gpu_tables:
            kv.allocate(rid, kv.capacity(rid) + n)
        elif op == "free":
            kv.free(rid)
        elif op == "swap_out" and rid not in kv.cpu_tables:
            kv.swap_out(rid)
        elif op == "swap_in" and rid not in kv.gpu_tables:
            kv.swap_in(rid)
        elif op == "shrink":
            kv.free_tail(rid, n)
        kv.check_invariants()
        assert kv.gpu.num_used == len({x for t in kv.gpu_tables.values() for x in t})
    for rid in list(kv.gpu_tables) + list(kv.cpu_tables):
        kv.free(rid)
    kv.assert_empty()


END_OPS = st.lists(
    st.tuples(st.sampled_from(["admit", "grow", "end", "free"]), st.integers(0, 5), st.integers(0, 28)),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(END_OPS)
def test_parking_an_ended_requests_blocks_as_a_run_leaves_the_pool_as_parking_each_block(
    ops: list[tuple[str, int, int]],
) -> None:
    """`free_parked` (the run) against `park_blocks` + `free` (a block at a time): every
    allocation gets the same block ids, evictions and LRU counts agree, and the registered
    blocks of other requests are found again (or evicted) alike."""
    runs = KVCacheManager(num_gpu_blocks=16, num_cpu_blocks=0, block_size=4, prefix_caching=True)
    each = KVCacheManager(num_gpu_blocks=16, num_cpu_blocks=0, block_size=4, prefix_caching=True)
    for op, who, n in ops:
        rid = f"r{who}"
        hashes = [who % 2, 10 + who % 3, 20 + who, 30 + n % 2]  # the leading blocks others share
        for kv in (runs, each):
            if op == "admit" and rid not in kv.gpu_tables:
                hit = kv.lookup_prefix(hashes[: max(0, n - 1) // 4])
                got = kv.allocate(rid, max(n, 1), prefix=hit)
                if got is not None:
                    kv.cache_blocks(rid, hashes, min(n // 4, who % 3))  # some full blocks not registered
            elif op == "grow" and rid in kv.gpu_tables:
                got = kv.allocate(rid, kv.capacity(rid) + n)
            elif op == "end" and kv is runs:
                kv.free_parked(rid, n // 4)
            elif op == "end":
                kv.park_blocks(rid, n // 4)
                kv.free(rid)
            elif op == "free":
                kv.free(rid)
            kv.check_invariants()
        assert runs.gpu_tables == each.gpu_tables
        assert (runs.gpu.num_evictions, runs.gpu.num_free, runs.gpu.num_evictable, runs.gpu.num_cached) == (
            each.gpu.num_evictions,
            each.gpu.num_free,
            each.gpu.num_evictable,
            each.gpu.num_cached,
        )
        assert all(runs.lookup_prefix(h) == each.lookup_prefix(h) for h in ([0, 10, 20], [1, 11, 21], [0, 12, 22]))
    assert runs.gpu.allocate(runs.gpu.num_available()) == each.gpu.allocate(each.gpu.num_available())


OWN_OPS = st.lists(
    st.tuples(st.sampled_from(["admit", "grow", "release", "swap", "end"]), st.integers(0, 4), st.integers(0, 28)),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(OWN_OPS)
def test_a_requests_own_run_leaves_the_pool_as_registering_each_of_its_blocks(
    ops: list[tuple[str, int, int]],
) -> None:
    """Requests whose blocks only they can name (salted hashes): `free_owned` + `owned_prefix`
    (one LRU run, taken back whole) against registering every block under its hash and freeing
    it: every allocation gets the same block ids, each request finds the same hit, evictions
    and free counts agree; a swap (`mark_hashed`) or a partial hit turns the run into
    registered blocks in place."""
    runs = KVCacheManager(num_gpu_blocks=16, num_cpu_blocks=0, block_size=4, prefix_caching=True)
    each = KVCacheManager(num_gpu_blocks=16, num_cpu_blocks=0, block_size=4, prefix_caching=True)
    ended: set[str] = set()
    for op, who, n in ops:
        rid = f"r{who}"
        if rid in ended:  # NOTE: an id is never reused (its hashes would name its old blocks)
            continue
        if op == "end":
            ended.add(rid)
        hashes = [1000 * (who + 1) + j for j in range(16)]  # unique to the request
        limit = n % 9
        for kv in (runs, each):
            table = kv.gpu_tables.get(rid)
            full = len(table) if table else 0  # NOTE: every block it holds is full and computed
            hashed = kv is each or rid in kv.hashed
            if op == "admit" and table is None:
                hit = None if hashed else kv.owned_prefix(rid, limit)
                if hit is None:
                    hit = kv.lookup_prefix(hashes[:limit])
                hashed = kv is each or rid in kv.hashed  # NOTE: a partial hit registers the run
                if kv.allocate(rid, max(n, 1, 4 * len(hit)), prefix=hit) is not None and hashed:
                    kv.cache_blocks(rid, hashes, len(kv.gpu_tables[rid]))  # registered as they fill
            elif op == "grow" and table is not None:
                if kv.allocate(rid, kv.capacity(rid) + n) is not None and hashed:
                    kv.cache_blocks(rid, hashes, len(kv.gpu_tables[rid]))
            elif op == "release" and table is not None:
                if hashed:
                    kv.cache_blocks(rid, hashes, full)
                    kv.free(rid)
                else:
                    kv.free_owned(rid, full, lambda k, h=hashes: h[:k])
            elif op == "swap" and table is not None:
                if not hashed:
                    kv.mark_hashed(rid)
                kv.cache_blocks(rid, hashes, full)
                kv.free(rid)
            elif op == "end":
                if hashed:
                    kv.free(rid)
                else:
                    kv.free_parked(rid, full)
                kv.forget_owner(rid)
            kv.check_invariants()
        assert runs.gpu_tables == each.gpu_tables
        assert (runs.gpu.num_evictions, runs.gpu.num_free, runs.gpu.num_evictable) == (
            each.gpu.num_evictions,
            each.gpu.num_free,
            each.gpu.num_evictable,
        )
    assert runs.gpu.allocate(runs.gpu.num_available()) == each.gpu.allocate(each.gpu.num_available())


def request(rid: str, prompt: int, **kw: object) -> Request:
    return Request(rid, arrival_time=0.0, num_prompt_tokens=prompt, **kw)  # type: ignore[arg-type]


def test_mooncake_hash_ids_name_32_of_our_16_token_blocks_each() -> None:
    a = request("a", 1100, prefix_source=PrefixSource((7, 8, 9), 512))
    b = request("b", 1100, prefix_source=PrefixSource((7, 8, 4), 512))
    ha, hb = block_hashes(a, 16, 100), block_hashes(b, 16, 100)
    assert len(ha) == 1100 // 16
    same = next(i for i, (x, y) in enumerate(zip(ha, hb, strict=True)) if x != y)
    assert same == 64  # two shared 512-token trace blocks = 64 of ours


def test_requests_without_token_identity_share_nothing_but_keep_their_own_hashes() -> None:
    a, b = request("a", 64, prefix_source=PrefixSource()), request("b", 64, prefix_source=PrefixSource())
    assert not set(block_hashes(a, 16, 4)) & set(block_hashes(b, 16, 4))
    again = request("a", 64, prefix_source=PrefixSource())
    assert block_hashes(again, 16, 4) == block_hashes(a, 16, 4)  # a recomputed request finds its own blocks


def test_token_hashes_are_chained_over_the_whole_prefix() -> None:
    a = Request("a", arrival_time=0.0, prompt_token_ids=[1, 2, 3, 4, 5, 6, 7, 8])
    b = Request("b", arrival_time=0.0, prompt_token_ids=[9, 2, 3, 4, 5, 6, 7, 8])
    c = Request("c", arrival_time=0.0, prompt_token_ids=[1, 2, 3, 4, 5, 6, 7, 9])
    ha, hb, hc = (block_hashes(r, 4, 2) for r in (a, b, c))
    assert ha[0] != hb[0] and ha[1] != hb[1]  # same second block, different first: no match
    assert ha[0] == hc[0] and ha[1] != hc[1]
