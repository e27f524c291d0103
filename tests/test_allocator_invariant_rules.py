"""A failing control for every rule of ``sim.allocator_invariants`` (issue 10).

Each case starts from a healthy allocator (three requests prefilled and
decoding on the tiny model; the checker finds nothing), breaks exactly one
thing the way a buggy allocator would, and asserts that the checker's
message names the rule that thing breaks. The expected rule comes from the
module docstring's list, not from running the checker: removing any one
rule from the checker turns its case red.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from helpers.allocator import decode, held_blocks, prefill, request, tiny_manager, tokens

from sim.allocator_invariants import (
    AllocatorInvariantError,
    allocator_problems,
    check_allocator,
)
from sim.fork.side_cache_rings import RingSlotPool
from sim.kv_cache_manager import KVCacheManager
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
    """Live one too high, free slots one too few: the page's total still
    adds up, only the live count disagrees with the slots held."""
    [page] = m.ring_slot_pools[0]._pages.values()
    page.live += 1
    page.free_slots.remove(max(page.free_slots))


def _page_slot_count_off(m: KVCacheManager) -> None:
    """A free-slot entry too many: live matches the slots held, the total
    does not add up to the page's slots."""
    [page] = m.ring_slot_pools[0]._pages.values()
    page.free_slots.append(m.ring_slot_pools[0].slots_per_block)


def _slot_of_a_foreign_pool(m: KVCacheManager) -> None:
    foreign = RingSlotPool(BlockPool(num_gpu_blocks=4, enable_caching=True, hash_block_size=32), 4)
    _table(m, _ring_group(m), "R1").append(foreign.get_new_blocks(1)[0])


RULES: list[tuple[str, bool, Callable[[KVCacheManager], None], str]] = [
    (
        "free-queue walk = free counter",
        False,
        _counter_off_by_one,
        r"free queue walks \d+ blocks, counter says \d+",
    ),
    ("no block twice in the queue", False, _queue_lists_a_block_twice, r"a block is in the free queue twice"),
    ("the null block is never free", False, _null_block_freed, r"the null block is free or held"),
    (
        "free XOR held (both)",
        False,
        _held_block_also_free,
        r"block \d+ is free and held \(\['group \d+ table of R0'\]\)",
    ),
    (
        "free XOR held (neither)",
        False,
        _block_dropped_without_free,
        r"block \d+ is neither free nor held \(\[\]\)",
    ),
    ("free iff ref_cnt 0", False, _free_block_with_a_reference, r"block \d+: ref_cnt 1 but in_queue=True"),
    (
        "ref_cnt = holders",
        False,
        _reference_count_too_high,
        r"block \d+: ref_cnt 2 != 1 holders \['group \d+ table of R0'\]",
    ),
    ("one group per block", False, _block_in_two_groups, r"block \d+ owned by groups \[0, \d+\]"),
    (
        "shared blocks are hashed",
        False,
        _unhashed_block_shared,
        r"block \d+ has two exclusive owners \['group \d+ table of R0', 'group \d+ table of R1'\]",
    ),
    ("free + held + null = pool", False, _pool_size_grew, r"free \d+ \+ held \d+ \+ null != pool 121"),
    (
        "a slot has one owner, ref_cnt 1",
        True,
        _slot_reference_dropped,
        r"ring slot \d+ held by \['group \d+ table of R0'\] with ref_cnt 0",
    ),
    (
        "slots lie in held pages",
        True,
        _slot_outside_the_ring_pages,
        r"ring slot \d+ lies in block \d+, which the ring does not hold",
    ),
    ("a held slot is not free", True, _slot_also_free, r"ring slot \d+ is held and free"),
    (
        "page live = slots held",
        True,
        _page_live_count_off,
        r"ring page \d+: live 4, held slots 3, free \d+ of \d+",
    ),
    (
        "page live + free = slots",
        True,
        _page_slot_count_off,
        r"ring page \d+: live 3, held slots 3, free \d+ of \d+",
    ),
    (
        "slots belong to this manager",
        True,
        _slot_of_a_foreign_pool,
        r"blocks \[\d+\] belong to no pool of this manager",
    ),
]


@pytest.mark.parametrize("on, breakage, rule", [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_each_broken_rule_is_named(on, breakage, rule):
    """The rule's own message appears (others may too: a real bug often
    breaks several rules at once)."""
    manager = _healthy(on)
    breakage(manager)
    # Anchored: the rule's message is one whole item of the "; "-joined list.
    with pytest.raises(AllocatorInvariantError, match=rf"(?:^|; ){rule}(?:$|; | \(\+)"):
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


def _exclusive_blocks(manager: KVCacheManager, count: int) -> list[KVCacheBlock]:
    """``count`` distinct blocks each held by exactly one table entry."""
    blocks = [b for t in manager.coordinator.get_blocks("R0") for b in t if not b.is_null and b.ref_cnt == 1]
    blocks += [b for t in manager.coordinator.get_blocks("R1") for b in t if not b.is_null and b.ref_cnt == 1]
    unique = list({b.block_id: b for b in blocks}.values())
    assert len(unique) >= count
    return unique[:count]


_REF_PROBLEM = r"block \d+: ref_cnt 2 != 1 holders \['group \d+ table of R[01]'\]"


@pytest.mark.parametrize("count", [1, 2, 10, 11])
def test_the_message_joins_ten_problems_and_counts_the_rest(count):
    """One doubled reference per block is one problem per block (hand
    count). The message: the problems joined by "; ", at most ten of them,
    then " (+N more)" only when more than ten: 1 -> one item; 2 -> two; 10 ->
    ten, no count; 11 -> ten and "(+1 more)"."""
    manager = _healthy(False)
    for block in _exclusive_blocks(manager, count):
        block.ref_cnt += 1
    with pytest.raises(AllocatorInvariantError) as caught:
        check_allocator(manager)
    message = str(caught.value)
    shown = min(count, 10)
    suffix = " (+1 more)" if count == 11 else ""
    assert re.fullmatch("; ".join([_REF_PROBLEM] * shown) + re.escape(suffix), message), message


def test_each_holder_is_named():
    """The holders a message lists say who holds the block: a table entry,
    a retained checkpoint, a ring page, a deferred free."""
    manager = _healthy(False)
    retaining = next(m for m in manager.managers if hasattr(m, "_retained_checkpoints"))
    checkpoint = retaining.retained_checkpoints()["R0"]
    checkpoint.ref_cnt += 1
    with pytest.raises(AllocatorInvariantError, match=r"\['group \d+ checkpoint of R0'\]"):
        check_allocator(manager)
    checkpoint.ref_cnt -= 1

    packed = _healthy(True)
    [page] = packed.ring_slot_pools[0].pages()
    page.ref_cnt += 1
    with pytest.raises(AllocatorInvariantError, match=r"\['group \d+ ring page'\]"):
        check_allocator(packed)
    page.ref_cnt -= 1

    popped = manager.pop_blocks_for_free(request_by_id(manager, "R2"))
    popped[0].ref_cnt += 1
    with pytest.raises(AllocatorInvariantError, match=r"\['deferred free #0'\]"):
        check_allocator(manager, [popped])


def request_by_id(manager: KVCacheManager, req_id: str):
    """The minimal request stand-in ``pop_blocks_for_free`` needs."""

    class _Request:
        request_id = req_id

    return _Request()


@pytest.mark.parametrize("holder", ["checkpoint", "ring page"])
def test_checkpoints_and_ring_pages_belong_to_their_group(holder):
    """A retained checkpoint (or a ring page) is its group's block: the
    same block in another group's table breaks one-group-per-block."""
    manager = _healthy(holder == "ring page")
    if holder == "checkpoint":
        retaining = next(m for m in manager.managers if hasattr(m, "_retained_checkpoints"))
        block = retaining.retained_checkpoints()["R0"]
    else:
        [block] = manager.ring_slot_pools[0].pages()
    block.ref_cnt += 1
    _table(manager, _attention_group(manager)).append(block)
    with pytest.raises(AllocatorInvariantError, match=r"owned by groups \[\d+, \d+\]"):
        check_allocator(manager)


@pytest.mark.parametrize("first", [_slot_of_a_foreign_pool, _slot_outside_the_ring_pages])
def test_one_bad_slot_does_not_hide_the_next(first):
    """A foreign slot (or one outside the ring's pages) is skipped, not the
    end of the slot check: R2's slot, checked after it, still reports its
    dropped reference."""
    manager = _healthy(True)
    first(manager)
    _table(manager, _ring_group(manager), "R2")[0].ref_cnt = 0
    problems = allocator_problems(manager)
    assert any(
        re.fullmatch(r"ring slot \d+ held by \['group \d+ table of R2'\] with ref_cnt 0", p) for p in problems
    )


def test_at_most_five_foreign_blocks_are_listed():
    """Six slots of a foreign pool: the message lists the first five."""
    manager = _healthy(True)
    foreign = RingSlotPool(BlockPool(num_gpu_blocks=4, enable_caching=True, hash_block_size=32), 8)
    _table(manager, _ring_group(manager), "R1").extend(foreign.get_new_blocks(6))
    [line] = [p for p in allocator_problems(manager) if "belong to no pool" in p]
    listed = re.fullmatch(r"blocks \[(.*)\] belong to no pool of this manager", line)
    assert listed is not None and len(listed.group(1).split(",")) == 5
