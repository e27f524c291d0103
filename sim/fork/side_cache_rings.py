"""Fork patch 0088 (side-cache layout), its ring slots on the scheduler
side, with patch 0049's ring claim record. Twin of the fork's additions to
``vllm/v1/kv_cache_interface.py`` (the slot-packed ring spec, tensor and
config) and to ``vllm/v1/core/single_type_kv_cache_manager.py`` (the ring
slot pool and the ring manager that claims slots and records its claims).
The planner pass that chooses the slots is ``side_cache_layout.py``.

Upstream 0.33.0 has no ``slots_per_block`` anywhere. kvsim carries it on
subclasses of vLLM's own classes, so everything that reads a config (the
planner's capacity code, ``KVCacheManager``, the worker's view binding) keeps
working unchanged, and the spec type picks the slot-packing ring manager
through vLLM's spec -> manager registry.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sim.kv_cache_interface import convert_spec, first_layer_spec, register_managers
from sim.vllm_bridge import (
    BlockPool,
    CircularBufferManager,
    CircularBufferSpec,
    KVCacheBlock,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
)


@dataclass(frozen=True, kw_only=True)
class RingSlotsSpec(CircularBufferSpec):
    """A QSA raw-key ring as kvsim's ring manager serves it: each request's
    ring block is one of ``slots_per_block`` equal slots of a shared pool
    block (fork: ``KVCacheGroupSpec.slots_per_block``); 1 is the old layout's
    whole block per request.

    Worker configs carry it only for packed rings (so the old layout's
    configs stay exactly vLLM's); the scheduler's view carries it for every
    ring, which selects kvsim's ring manager through vLLM's spec registry.
    """

    slots_per_block: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.slots_per_block < 1:
            raise ValueError(f"slots_per_block must be positive, got {self.slots_per_block}")


@dataclass
class SlotPackedKVCacheTensor(KVCacheTensor):
    """A tensor whose view has ``slots_per_block`` view blocks per pool block:
    ``block_stride`` is one slot, and view block ``pool_block * S + slot`` lies
    inside pool block ``pool_block`` (fork: ``KVCacheTensor.slots_per_block``).
    """

    slots_per_block: int = 1


@dataclass
class SideCacheKVCacheConfig(KVCacheConfig):
    """A ``KVCacheConfig`` with slot-packed ring groups."""

    @property
    def slot_packed_group_ids(self) -> tuple[int, ...]:
        """Groups whose blocks are slots of shared pool blocks: whole-block
        zeroing skips them (their bytes lie in pool blocks only the ring
        manager owns)."""
        return tuple(
            group_id
            for group_id, group in enumerate(self.kv_cache_groups)
            if group_slots_per_block(group) > 1
        )

    def num_blocks_of(self, tensor: KVCacheTensor) -> int:
        if isinstance(tensor, SlotPackedKVCacheTensor) and not tensor.host_resident:
            return self.num_blocks * tensor.slots_per_block
        return super().num_blocks_of(tensor)


def group_slots_per_block(group: KVCacheGroupSpec) -> int:
    """Ring slots per pool block of ``group``; 1 when it is not slot-packed.

    kvsim carries the count on the ring's spec; the fork, when installed,
    carries it on the group itself.
    """
    spec = first_layer_spec(group)
    if isinstance(spec, RingSlotsSpec):
        return spec.slots_per_block
    return int(getattr(group, "slots_per_block", 1))


def as_slot_packed(spec: KVCacheSpec, slots_per_block: int) -> KVCacheSpec:
    """``spec`` (a ring, or a uniform collection of rings) with ring slots."""
    return convert_spec(spec, RingSlotsSpec, slots_per_block=slots_per_block)


class _RingSlotPage:
    """One pool block shared by up to ``slots`` requests' rings."""

    __slots__ = ("block", "free_slots", "live")

    def __init__(self, block: KVCacheBlock, slots: int) -> None:
        self.block = block
        self.free_slots = list(range(slots))  # a min-heap: lowest slot first
        self.live = 0


class RingSlotPool:
    """Ring blocks as slots of shared pool blocks.

    The pool takes whole blocks from the main ``BlockPool`` and cuts each into
    ``slots_per_block`` slots. A slot's block id is
    ``pool_block_id * slots_per_block + slot``: exactly its index in the
    worker's ring view. The oldest page with a free slot fills first and its
    lowest free slot is handed out.

    Slot blocks carry ``pool=self``, so every free path that ends in
    ``BlockPool.free_blocks`` (the manager's ``free``, the coordinator's
    deferred ``pop_blocks_for_free`` and the scheduler's fenced drain) routes
    them back here at the moment the old per-request block would have gone
    back: a popped slot stays live until the drain. A page returns to the main
    pool when its last slot is freed. Rings are never prefix-cached, so slot
    blocks never carry a hash.
    """

    def __init__(self, block_pool: BlockPool, slots_per_block: int) -> None:
        assert slots_per_block > 1, "a slot pool needs at least two slots per block"
        self.block_pool = block_pool
        self.slots_per_block = slots_per_block
        # Pool block id -> page, in claim order (the oldest page fills first).
        self._pages: dict[int, _RingSlotPage] = {}

    @property
    def num_pages(self) -> int:
        """Pool blocks currently held for rings."""
        return len(self._pages)

    @property
    def num_live_slots(self) -> int:
        return sum(page.live for page in self._pages.values())

    def pages(self) -> list[KVCacheBlock]:
        return [page.block for page in self._pages.values()]

    def has_free_slot(self) -> bool:
        return any(page.free_slots for page in self._pages.values())

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        return [self._claim_slot() for _ in range(num_blocks)]

    def _claim_slot(self) -> KVCacheBlock:
        page = next((p for p in self._pages.values() if p.free_slots), None)
        if page is None:
            (pool_block,) = self.block_pool.get_new_blocks(1)
            page = _RingSlotPage(pool_block, self.slots_per_block)
            self._pages[pool_block.block_id] = page
        slot = heapq.heappop(page.free_slots)
        page.live += 1
        block_id = page.block.block_id * self.slots_per_block + slot
        return KVCacheBlock(block_id, ref_cnt=1, pool=self)  # type: ignore[arg-type]

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        released: list[KVCacheBlock] = []
        for block in ordered_blocks:
            assert block.pool is self, f"block {block.block_id} is not a ring slot of this pool"
            block.ref_cnt -= 1
            assert block.ref_cnt == 0, f"ring slot {block.block_id} freed twice (single owner)"
            page_id, slot = divmod(block.block_id, self.slots_per_block)
            page = self._pages.get(page_id)
            assert page is not None and slot not in page.free_slots, f"ring slot {block.block_id} freed twice"
            heapq.heappush(page.free_slots, slot)
            page.live -= 1
            if page.live == 0:
                del self._pages[page_id]
                released.append(page.block)
        if released:
            self.block_pool.free_blocks(released)


class RingCircularBufferManager(CircularBufferManager):
    """vLLM's ring manager plus the fork's ring bookkeeping.

    Records every ring id it claims, in claim order, for the worker to clear
    the ring's tag words (``take_new_ring_block_ids``); with
    ``slots_per_block > 1`` it claims slots of shared pool blocks from a
    ``RingSlotPool`` instead of whole blocks.
    """

    def __init__(self, kv_cache_spec: CircularBufferSpec, block_pool: BlockPool, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, block_pool, **kwargs)
        slots = getattr(kv_cache_spec, "slots_per_block", 1)
        self.slot_pool: RingSlotPool | None = RingSlotPool(block_pool, slots) if slots > 1 else None
        self.new_ring_block_ids: list[int] = []

    def _claim_ring_block(self, request_id: str, record_for_zeroing: bool = True) -> list[KVCacheBlock]:
        """Upstream's claim, from the slot pool when there is one. A claim
        whose ring the load writes after this step (``record_for_zeroing``
        False, external KV) is not recorded: clearing it would race the
        load, as upstream skips zeroing such blocks."""
        req_blocks = self.req_to_blocks[request_id]
        if req_blocks:
            return []
        pool = self.slot_pool if self.slot_pool is not None else self.block_pool
        new_blocks = pool.get_new_blocks(1)
        req_blocks.extend(new_blocks)
        if record_for_zeroing:
            self.new_ring_block_ids.extend(block.block_id for block in new_blocks)
        if self._record_new_block_ids and record_for_zeroing:  # never for rings upstream; kept as upstream
            self.new_block_ids.extend(block.block_id for block in new_blocks)
        return new_blocks

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Any,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        if self.req_to_blocks.get(request_id):
            return 0
        # A free slot in a page the ring already holds costs no pool block.
        if self.slot_pool is not None and self.slot_pool.has_free_slot():
            return 0
        return 1

    def get_ring_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def take_new_ring_block_ids(self) -> list[int]:
        taken, self.new_ring_block_ids = self.new_ring_block_ids, []
        return taken


def _register() -> None:
    """kvsim's ring spec type served by kvsim's ring manager, in vLLM's registry."""
    register_managers((RingSlotsSpec, RingCircularBufferManager, CircularBufferSpec))


_register()
