"""A failing control for every rule of ``sim.allocator_invariants`` (issue 10).

Each case starts from a healthy allocator (three requests prefilled and
decoding on the tiny model; the checker finds nothing), breaks exactly one
thing the way a buggy allocator would, and asserts that the checker's
message names the rule that thing breaks. The expected rule comes from the
module docstring's list, not from running the checker: removing any one
rule from the checker turns its case red.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from allocator_driver import decode, prefill, request, tiny_manager, tokens

from sim.allocator_invariants import (
    AllocatorInvariantError,
    allocator_problems,
    check_allocator,
    held_blocks,
)
from sim.kv_cache_manager import KVCacheManager
from sim.single_type_kv_cache_manager import RingSlotPool
from sim.vllm_bridge import BlockPool, KVCacheBlock

POOL = 120


def _healthy(on: bool) -> KVCacheManager:
    manager = tiny_manager(on, num_blocks=POOL)
    for index in range(3):
        req = request(f"R{index}", tokens(10 + index, 70))
        prefill(manager, req)
        decode(manager, req, 2)
    assert allocator_problems(manager) == []  # the starting point is clean
    return manager


def _table(manager: KVCacheManager, group: int, req_id: str = "R0") -> list[KVCacheBlock]:
    return manager.managers[group].req_to_blocks[req_id]


def _attention_group(manager: KVCacheManager) -> int:
    return len(manager.managers) - 1  # the full-attention group comes last


def _ring_group(manager: KVCacheManager) -> int:
    [ring] = manager.ring_managers
    return manager.managers.index(ring)


def _held_block(manager: KVCacheManager) -> KVCacheBlock:
    """A hashed (prefix-cached) attention block R0 holds alone."""
    return _table(manager, _attention_group(manager))[0]


def _unhashed_ring_block(manager: KVCacheManager) -> KVCacheBlock:
    """R0's ring block in the old layout: a pool block, never hashed."""
    [block] = _table(manager, _ring_group(manager))
    assert block.block_hash is None
    return block


# --- one breakage per rule ------------------------------------------------------
def _counter_off_by_one(m: KVCacheManager) -> None:
    m.block_pool.free_block_queue.num_free_blocks += 1


def _queue_lists_a_block_twice(m: KVCacheManager) -> None:
    queue = m.block_pool.free_block_queue
    walked = queue.get_all_free_blocks()
    queue.get_all_free_blocks = lambda: [*walked, walked[0]]  # type: ignore[method-assign]


def _null_block_freed(m: KVCacheManager) -> None:
    m.block_pool.free_block_queue.append(m.block_pool.null_block)


def _held_block_also_free(m: KVCacheManager) -> None:
    m.block_pool.free_block_queue.append(_held_block(m))


def _block_dropped_without_free(m: KVCacheManager) -> None:
    _table(m, _attention_group(m)).pop()  # ref_cnt 1, no holder, not in the queue


def _free_block_with_a_reference(m: KVCacheManager) -> None:
    m.block_pool.free_block_queue.get_all_free_blocks()[-1].ref_cnt = 1


def _reference_count_too_high(m: KVCacheManager) -> None:
    _held_block(m).ref_cnt += 1


def _block_in_two_groups(m: KVCacheManager) -> None:
    block = _held_block(m)
    block.ref_cnt += 1
    _table(m, 0).append(block)


def _unhashed_block_shared(m: KVCacheManager) -> None:
    block = _unhashed_ring_block(m)
    block.ref_cnt += 1
    _table(m, _ring_group(m), "R1").append(block)


def _pool_size_grew(m: KVCacheManager) -> None:
    m.block_pool.num_gpu_blocks += 1


def _slot_reference_dropped(m: KVCacheManager) -> None:
    _table(m, _ring_group(m))[0].ref_cnt = 0


def _slot_outside_the_ring_pages(m: KVCacheManager) -> None:
    [slot] = _table(m, _ring_group(m))
    [page] = m.ring_slot_pools[0].pages()
    stranger = page.block_id + 1  # a pool block the ring does not hold
    slot.block_id = stranger * m.ring_slot_pools[0].slots_per_block


def _slot_also_free(m: KVCacheManager) -> None:
    [slot] = _table(m, _ring_group(m))
    pool = m.ring_slot_pools[0]
    page_id, index = divmod(slot.block_id, pool.slots_per_block)
    pool._pages[page_id].free_slots.append(index)
    pool._pages[page_id].free_slots.remove(pool.slots_per_block - 1)  # keep the page's count


def _page_live_count_off(m: KVCacheManager) -> None:
    [page] = m.ring_slot_pools[0]._pages.values()
    page.live += 1


def _slot_of_a_foreign_pool(m: KVCacheManager) -> None:
    foreign = RingSlotPool(BlockPool(num_gpu_blocks=4, enable_caching=True, hash_block_size=32), 4)
    _table(m, _ring_group(m), "R1").append(foreign.get_new_blocks(1)[0])


RULES: list[tuple[str, bool, Callable[[KVCacheManager], None], str]] = [
    ("free-queue walk = free counter", False, _counter_off_by_one, r"free queue walks \d+ blocks, counter"),
    ("no block twice in the queue", False, _queue_lists_a_block_twice, "in the free queue twice"),
    ("the null block is never free", False, _null_block_freed, "the null block is free or held"),
    ("free XOR held (both)", False, _held_block_also_free, r"block \d+ is free and held"),
    ("free XOR held (neither)", False, _block_dropped_without_free, r"block \d+ is neither free nor held"),
    ("free iff ref_cnt 0", False, _free_block_with_a_reference, r"ref_cnt 1 but in_queue=True"),
    ("ref_cnt = holders", False, _reference_count_too_high, r"ref_cnt 2 != 1 holders"),
    ("one group per block", False, _block_in_two_groups, r"owned by groups \[0, \d+\]"),
    ("shared blocks are hashed", False, _unhashed_block_shared, "has two exclusive owners"),
    ("free + held + null = pool", False, _pool_size_grew, r"free \d+ \+ held \d+ \+ null != pool 121"),
    ("a slot has one owner, ref_cnt 1", True, _slot_reference_dropped, r"ring slot \d+ held by .* ref_cnt 0"),
    ("slots lie in held pages", True, _slot_outside_the_ring_pages, "which the ring does not hold"),
    ("a held slot is not free", True, _slot_also_free, r"ring slot \d+ is held and free"),
    ("page live = slots held", True, _page_live_count_off, r"ring page \d+: live 4, held slots 3"),
    ("slots belong to this manager", True, _slot_of_a_foreign_pool, "belong to no pool of this manager"),
]


@pytest.mark.parametrize("on, breakage, rule", [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_each_broken_rule_is_named(on, breakage, rule):
    """The rule's own message appears (others may too: a real bug often
    breaks several rules at once)."""
    manager = _healthy(on)
    breakage(manager)
    with pytest.raises(AllocatorInvariantError, match=rule):
        check_allocator(manager)


def test_more_than_ten_problems_are_summarised():
    """The checker lists ten problems and counts the rest: twelve held
    blocks with a doubled reference each give twelve ``ref_cnt`` lines."""
    manager = _healthy(False)
    blocks = [b for t in manager.coordinator.get_blocks("R0") for b in t if not b.is_null][:12]
    assert len(blocks) == 12
    for block in blocks:
        block.ref_cnt += 1
    with pytest.raises(AllocatorInvariantError, match=r"\(\+2 more\)$"):
        check_allocator(manager)


def test_held_blocks_counts_each_pool_block_once():
    """The seed's ``_held``: a pool block counts once however many holders
    it has (three requests share nothing here, so it is the pool less the
    free and the null block), and slot blocks are not pool blocks."""
    for on in (False, True):
        manager = _healthy(on)
        assert held_blocks(manager) == POOL - 1 - manager.block_pool.get_num_free_blocks()
    shared = _healthy(False)
    before = held_blocks(shared)
    _block_in_two_groups(shared)  # a second holder of a held block
    assert held_blocks(shared) == before
