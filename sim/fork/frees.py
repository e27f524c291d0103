"""Fork patches 0018 and 0023: frees. Twin of the fork's additions to
``vllm/v1/core/kv_cache_manager.py`` and ``kv_cache_coordinator.py`` other
than the pins (``pins.py``), and of 0018's gate in ``sched/scheduler.py``:

- 0018: fenced (deferred) frees whenever more than one batch may be in
  flight and a ring group exists (``fork_defers_block_free``). The fenced
  frees themselves are vLLM 0.33.0's (``defer_block_free``), mirrored in
  ``sim/sched/scheduler.py``.
- 0023 (port of vLLM #48532): a deferred free evicts in the same order as an
  immediate one (``KVCacheManager.pop_blocks_for_free``).
- On the same manager: 0086's retained checkpoints freed last (they are held
  by ``retention.py``'s managers) and 0049's ring claim record
  (``take_new_ring_block_ids``, the rings in ``side_cache_rings.py``).

The manager is built by ``sim/kv_cache_manager.py``'s factory.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cached_property

from sim.fork.retention import RetainingMambaManager
from sim.fork.side_cache_rings import RingCircularBufferManager, RingSlotPool
from sim.vllm_bridge import KVCacheBlock, Request, SingleTypeKVCacheManager
from sim.vllm_bridge import KVCacheManager as _VllmKVCacheManager


def fork_defers_block_free(max_concurrent_batches: int) -> bool:
    """Patch 0018's gate, as the fork's ``Scheduler.__init__`` derives it:
    fenced frees whenever more than one batch may be in flight and a raw-key
    ring group exists (Flash-Next's model file requires one), connector or
    not. kvsim's simulations take ``scheduler.defer_block_free`` as a switch
    instead (default on; ``docs/fidelity.md``)."""
    return max_concurrent_batches > 1


class BlockObserver:
    """Hooks for a caller that watches blocks leave requests (the pool
    replay, ``sim/pool_replay/``); a no-op here. The manager calls it; an
    observer reads, never changes, the allocator."""

    def blocks_freed(self, request: Request) -> None:
        """``request``'s blocks are about to be freed or popped for a fenced free."""


class KVCacheManager(_VllmKVCacheManager):
    """vLLM's manager plus the fork's ring claim record and the fork's
    coordinator changes to freeing, with a block observer (kvsim has no coordinator of its own:
    the free paths are twinned here, where vLLM's manager calls them).

    - Retained checkpoints go back last (patch 0086): ``free`` and
      ``pop_blocks_for_free`` release every group's table first, then the
      checkpoints, so a finished request's checkpoint is never evicted
      ahead of the attention prefix it resumes.
    - ``deferred_free_eviction_order`` (patch 0023, port of vLLM #48532):
      a deferred free evicts in the same order as an immediate one (each
      group's tail first, group after group). Upstream 0.33.0 returns the
      groups' blocks concatenated and the caller reverses the whole list,
      which frees the last group first.
    """

    deferred_free_eviction_order: bool = True
    observer: BlockObserver = BlockObserver()

    @property
    def managers(self) -> tuple[SingleTypeKVCacheManager, ...]:
        return self.coordinator.single_type_managers

    # The managers are fixed at construction; the gauges read these every step.
    @cached_property
    def ring_managers(self) -> tuple[RingCircularBufferManager, ...]:
        return tuple(m for m in self.managers if isinstance(m, RingCircularBufferManager))

    @cached_property
    def _retaining_managers(self) -> tuple[RetainingMambaManager, ...]:
        return tuple(m for m in self.managers if isinstance(m, RetainingMambaManager))

    @property
    def ring_slot_pools(self) -> list[RingSlotPool]:
        return [m.slot_pool for m in self.ring_managers if m.slot_pool is not None]

    def take_new_ring_block_ids(self) -> list[int]:
        """Ring ids claimed since the last call, in claim order (the worker
        clears their tag words before the step that first writes them)."""
        return [i for m in self.ring_managers for i in m.take_new_ring_block_ids()]

    @property
    def num_free_blocks(self) -> int:
        """Free pool blocks (evictable cached ones included), as the
        admission check counts them."""
        return self.block_pool.get_num_free_blocks()

    def num_retained_checkpoints(self) -> int:
        return sum(m.num_retained_checkpoints() for m in self._retaining_managers)

    def _pop_retained_checkpoints(self, request_id: str) -> list[KVCacheBlock]:
        return [b for m in self._retaining_managers for b in m.pop_retained_checkpoints(request_id)]

    def free(self, request: Request) -> None:
        self.observer.blocks_freed(request)
        retained = self._pop_retained_checkpoints(request.request_id)
        super().free(request)
        if retained:
            self.block_pool.free_blocks(retained)

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Return blocks popped for a fenced free (or a copy-on-write's
        retained ends) to the pool: kvsim's fenced frees, no twin in vLLM,
        go through the manager like every other change to the allocator."""
        self.block_pool.free_blocks(blocks)

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        """The request's blocks, not yet freed, under vLLM's contract: the
        caller frees the list reversed. With patch 0023 that reversal is
        ``free``'s eviction order exactly (e.g. two groups of blocks 1-3 and
        4-6 evict as 3, 2, 1, 6, 5, 4); upstream's is 6, 5, 4, 3, 2, 1."""
        self.observer.blocks_freed(request)
        retained = self._pop_retained_checkpoints(request.request_id)
        if not self.deferred_free_eviction_order:
            return retained + super().pop_blocks_for_free(request)
        request_id = request.request_id
        eviction_order = [b for m in self.managers for b in reversed(m.pop_blocks_for_free(request_id))]
        return (eviction_order + retained)[::-1]
