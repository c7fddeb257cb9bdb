"""KV accounting: real block ids, O(1) free list, modes, reserves, swaps; invariants under
random operation sequences (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.accounting import AllocationMode, BlockPool, KVAllocationError, KVCacheManager, required_tokens


def test_allocation_answers_none_and_changes_nothing_when_it_does_not_fit() -> None:
    kv = KVCacheManager(num_gpu_blocks=4, num_cpu_blocks=0, block_size=16)
    assert kv.allocate("a", 48) == [0, 1, 2]
    assert kv.allocate("b", 32) is None
    assert kv.gpu.num_free == 1 and "b" not in kv.gpu_tables
    kv.free("a")
    kv.assert_empty()


def test_growing_a_table_only_adds_missing_blocks() -> None:
    kv = KVCacheManager(8, 0, 4)
    assert kv.allocate("a", 5) == [0, 1]
    assert kv.allocate("a", 8) == []
    assert kv.allocate("a", 9) == [2]
    assert kv.capacity("a") == 12
    kv.free("a")
    kv.assert_empty()


def test_allocation_modes_turn_into_token_targets() -> None:
    common = {"num_tokens_after_step": 10, "num_prompt_tokens": 10, "max_tokens": 100}
    assert required_tokens(AllocationMode.BLOCK, **common) == 10
    assert required_tokens(AllocationMode.MAX, **common) == 110
    assert required_tokens(AllocationMode.EXACT, predicted_output_tokens=40, padding=0.15, **common) == 10 + 46
    # a mispredicted request grows past its exact reservation block by block
    grown = {**common, "num_tokens_after_step": 70}
    assert required_tokens(AllocationMode.EXACT, predicted_output_tokens=40, padding=0.15, **grown) == 70


def test_named_reserve_is_off_limits_to_other_allocations() -> None:
    pool = BlockPool(10, 16)
    pool.set_reserve("pt", 3)
    assert pool.num_available() == 7
    assert pool.num_available("pt") == 10
    assert pool.allocate(8) is None
    taken = pool.allocate(8, reserve="pt")
    assert taken is not None and pool.num_free == 2
    pool.free(taken)
    pool.check_invariants()


def test_swap_out_and_in_maps_blocks_and_moves_ownership() -> None:
    kv = KVCacheManager(4, 4, 4)
    kv.allocate("a", 8)
    out = kv.swap_out("a")
    assert out == [(0, 0), (1, 1)]
    assert "a" not in kv.gpu_tables and kv.cpu_tables["a"] == [0, 1]
    back = kv.swap_in("a")
    assert back is not None and [cpu for cpu, _ in back] == [0, 1]
    kv.check_invariants()
    kv.free("a")
    kv.assert_empty()


def test_swap_out_answers_none_when_swap_space_is_full() -> None:
    kv = KVCacheManager(4, 1, 4)
    kv.allocate("a", 8)
    assert kv.swap_out("a") is None
    assert kv.gpu_tables["a"] == [0, 1]
    kv.free("a")
    kv.assert_empty()


def test_lending_moves_the_tail_of_a_hosts_table() -> None:
    kv = KVCacheManager(8, 0, 4)
    kv.allocate("host", 32)
    moved = kv.transfer_tail("host", "guest", 4)
    assert moved == [4, 5, 6, 7] and kv.gpu_tables["guest"] == moved
    kv.check_invariants()
    kv.free("host")
    kv.free("guest")
    kv.assert_empty()


def test_double_free_is_caught() -> None:
    pool = BlockPool(2, 4)
    blocks = pool.allocate(1)
    assert blocks is not None
    pool.free(blocks)
    with pytest.raises(KVAllocationError):
        pool.free(blocks)


def test_leak_check_names_the_leaking_request() -> None:
    kv = KVCacheManager(4, 0, 4)
    kv.allocate("leaky", 4)
    with pytest.raises(KVAllocationError, match="leaky"):
        kv.assert_empty()


OPS = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "free", "swap_out", "swap_in", "lend", "shrink"]),
        st.integers(0, 5),
        st.integers(0, 40),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(OPS)
def test_random_operation_sequences_keep_every_invariant(ops: list[tuple[str, int, int]]) -> None:
    kv = KVCacheManager(num_gpu_blocks=16, num_cpu_blocks=8, block_size=4)
    for op, who, n in ops:
        rid = f"r{who}"
        if op == "alloc" and rid not in kv.cpu_tables:
            kv.allocate(rid, kv.capacity(rid) + n)
        elif op == "free":
            kv.free(rid)
        elif op == "swap_out" and rid not in kv.cpu_tables:
            kv.swap_out(rid)
        elif op == "swap_in" and rid not in kv.gpu_tables:
            kv.swap_in(rid)
        elif op == "lend" and kv.gpu_tables.get(rid):
            kv.transfer_tail(rid, f"r{(who + 1) % 6}", min(n, len(kv.gpu_tables[rid])))
        elif op == "shrink":
            kv.free_tail(rid, n)
        kv.check_invariants()
        assert kv.gpu.num_free + sum(map(len, kv.gpu_tables.values())) == 16
        assert kv.cpu.num_free + sum(map(len, kv.cpu_tables.values())) == 8
    for rid in list(kv.gpu_tables) + list(kv.cpu_tables):
        kv.free(rid)
    kv.assert_empty()
