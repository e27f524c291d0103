"""An allocator invariant checker any caller can run after any step.

No twin in vLLM (its tests assert pieces of this ad hoc). The invariants of
one shared ``BlockPool`` serving every KV-cache group:

* every non-null pool block is free XOR held, and it is free exactly when its
  reference count is 0 (the free queue holds exactly the unreferenced blocks);
* a block's reference count equals the number of its holders: block-table
  entries, retained Mamba checkpoints, ring slot pages, popped blocks waiting
  for the fence, both ends of a pending copy-on-write copy (a sub-block
  prefix hit's tail, vLLM's ``_apply_cow``), the fork's waiter and grace
  pins (``sim/fork/pins.py``);
* a block id belongs to one group at a time, and a block with two holders is
  a cached (hashed) block or a copy's end: no block has two exclusive owners;
* ring slots are unique, single-owner, and lie in pages the ring holds; a
  page's live count is the number of its slots held;
* free blocks + held blocks + the null block = the pool.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sim.fork.retention import RetainingMambaManager
from sim.fork.side_cache_rings import RingCircularBufferManager, RingSlotPool
from sim.kv_cache_manager import KVCacheManager
from sim.vllm_bridge import KVCacheBlock


class AllocatorInvariantError(AssertionError):
    """The allocator's state broke an invariant; the message lists each one."""


@dataclass
class _Holders:
    """Who holds each pool block and each ring slot."""

    pool: dict[int, list[str]] = field(default_factory=lambda: defaultdict(list))
    groups: dict[int, set[int]] = field(default_factory=lambda: defaultdict(set))
    slots: dict[int, list[str]] = field(default_factory=lambda: defaultdict(list))
    slot_blocks: dict[int, KVCacheBlock] = field(default_factory=dict)

    def add(self, block: KVCacheBlock, holder: str, group: int | None, pool: object) -> None:
        if block.is_null:
            return
        if block.pool is not pool:
            self.slots[block.block_id].append(holder)
            self.slot_blocks[block.block_id] = block
            return
        self.pool[block.block_id].append(holder)
        if group is not None:
            self.groups[block.block_id].add(group)


COPY_HOLDER = "copy-on-write retention"


def _collect(
    manager: KVCacheManager,
    deferred: Iterable[Sequence[KVCacheBlock]],
    copy_retained: Iterable[Sequence[KVCacheBlock]] = (),
) -> _Holders:
    pool = manager.block_pool
    holders = _Holders()
    for gid, mgr in enumerate(manager.managers):
        for req_id, table in mgr.req_to_blocks.items():
            for block in table:
                holders.add(block, f"group {gid} table of {req_id}", gid, pool)
        if isinstance(mgr, RetainingMambaManager):
            for req_id, block in mgr.retained_checkpoints().items():
                holders.add(block, f"group {gid} checkpoint of {req_id}", gid, pool)
        if isinstance(mgr, RingCircularBufferManager) and mgr.slot_pool is not None:
            for page in mgr.slot_pool.pages():
                holders.add(page, f"group {gid} ring page", gid, pool)
    # The fork's waiter and grace pins (patches 0095-0097): one ref each.
    for holder, blocks in getattr(manager, "pin_holders", list)():
        for block in blocks:
            holders.add(block, holder, None, pool)
    for index, blocks in enumerate(deferred):
        for block in blocks:
            holders.add(block, f"deferred free #{index}", None, pool)
    for index, blocks in enumerate(copy_retained):
        for block in blocks:
            holders.add(block, f"{COPY_HOLDER} #{index}", None, pool)
    return holders


def _check_pool(manager: KVCacheManager, holders: _Holders) -> list[str]:
    pool = manager.block_pool
    problems: list[str] = []
    free_ids = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    if len(free_ids) != pool.get_num_free_blocks():
        problems.append(f"free queue walks {len(free_ids)} blocks, counter says {pool.get_num_free_blocks()}")
    free = set(free_ids)
    if len(free) != len(free_ids):
        problems.append("a block is in the free queue twice")
    for block in pool.blocks:
        if block.is_null:
            if block.block_id in free or holders.pool.get(block.block_id):
                problems.append("the null block is free or held")
            continue
        held_by = holders.pool.get(block.block_id, [])
        in_queue = block.block_id in free
        if in_queue == bool(held_by):
            state = "free and held" if in_queue else "neither free nor held"
            problems.append(f"block {block.block_id} is {state} ({held_by})")
        if in_queue != (block.ref_cnt == 0):
            problems.append(f"block {block.block_id}: ref_cnt {block.ref_cnt} but in_queue={in_queue}")
        if not in_queue and block.ref_cnt != len(held_by):
            problems.append(
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != {len(held_by)} holders {held_by}"
            )
        if len(holders.groups.get(block.block_id, ())) > 1:
            problems.append(
                f"block {block.block_id} owned by groups {sorted(holders.groups[block.block_id])}"
            )
        exclusive = [h for h in held_by if not h.startswith(COPY_HOLDER)]
        if len(exclusive) > 1 and block.block_hash is None:
            problems.append(f"block {block.block_id} has two exclusive owners {held_by}")
    held = sum(1 for b in pool.blocks if not b.is_null and holders.pool.get(b.block_id))
    if len(free) + held + 1 != pool.num_gpu_blocks:
        problems.append(f"free {len(free)} + held {held} + null != pool {pool.num_gpu_blocks}")
    return problems


def _check_slots(slot_pool: RingSlotPool, holders: _Holders) -> list[str]:
    problems: list[str] = []
    size = slot_pool.slots_per_block
    live: dict[int, int] = defaultdict(int)
    for slot_id, held_by in holders.slots.items():
        block = holders.slot_blocks[slot_id]
        if block.pool is not slot_pool:
            continue
        page_id, slot = divmod(slot_id, size)
        if len(held_by) != 1 or block.ref_cnt != 1:
            problems.append(f"ring slot {slot_id} held by {held_by} with ref_cnt {block.ref_cnt}")
        if page_id not in slot_pool._pages:
            problems.append(f"ring slot {slot_id} lies in block {page_id}, which the ring does not hold")
            continue
        if slot in slot_pool._pages[page_id].free_slots:
            problems.append(f"ring slot {slot_id} is held and free")
        live[page_id] += 1
    for page_id, page in slot_pool._pages.items():
        if page.live != live[page_id] or page.live + len(page.free_slots) != size:
            problems.append(
                f"ring page {page_id}: live {page.live}, held slots {live[page_id]}, "
                f"free {len(page.free_slots)} of {size}"
            )
    return problems


def allocator_problems(
    manager: KVCacheManager,
    deferred: Iterable[Sequence[KVCacheBlock]] = (),
    copy_retained: Iterable[Sequence[KVCacheBlock]] = (),
) -> list[str]:
    """Every broken invariant, one line each (empty when all hold).

    ``deferred`` holds the blocks popped for a fenced free that the scheduler
    has not drained yet: they are held, not free. ``copy_retained`` holds the
    ends of copy-on-write copies not yet known to have run.
    """
    holders = _collect(manager, deferred, copy_retained)
    problems = _check_pool(manager, holders)
    slot_pools = {id(p): p for p in manager.ring_slot_pools}
    for slot_pool in slot_pools.values():
        problems += _check_slots(slot_pool, holders)
    foreign = [s for s, b in holders.slot_blocks.items() if id(b.pool) not in slot_pools]
    if foreign:
        problems.append(f"blocks {foreign[:5]} belong to no pool of this manager")
    return problems


def check_allocator(
    manager: KVCacheManager,
    deferred: Iterable[Sequence[KVCacheBlock]] = (),
    copy_retained: Iterable[Sequence[KVCacheBlock]] = (),
) -> None:
    problems = allocator_problems(manager, deferred, copy_retained)
    if problems:
        raise AllocatorInvariantError(
            "; ".join(problems[:10]) + (f" (+{len(problems) - 10} more)" if len(problems) > 10 else "")
        )


def _snapshot(value: Any, depth: int = 0) -> Any:
    """A comparable copy of one piece of allocator state: blocks as (id,
    references, hash); sets sorted; deeper nesting as its repr."""
    if isinstance(value, KVCacheBlock):
        return ("block", value.block_id, value.ref_cnt, value.block_hash)
    if depth > 4:
        return repr(value)
    if isinstance(value, dict):
        return {repr(k): _snapshot(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        items = [_snapshot(v, depth + 1) for v in value]
        return sorted(items, key=repr) if isinstance(value, set | frozenset) else items
    if isinstance(value, int | float | str | bool | type(None)):
        return value
    return type(value).__name__


def allocator_snapshot(manager: KVCacheManager) -> dict[str, Any]:
    """The whole allocator state, comparable with ``==``: every block's id,
    reference count and hash, the free queue's order, the cached-block
    count, and every field of every per-group manager (the fast path's
    audit compares two of these around each call it would skip)."""
    pool = manager.block_pool
    managers = [
        {
            name: _snapshot(field)
            for name, field in vars(m).items()
            if name not in ("block_pool", "kv_cache_spec")
        }
        for m in manager.managers
    ]
    return {
        "blocks": [_snapshot(block) for block in pool.blocks],
        "free_queue": [block.block_id for block in pool.free_block_queue.get_all_free_blocks()],
        "cached": len(pool.cached_block_hash_to_block),
        "managers": managers,
    }
