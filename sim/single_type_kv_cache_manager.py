"""Twin of the fork's additions to ``single_type_kv_cache_manager.py``: the
ring slot pool, the ring manager that claims slots and records its claims,
and the Mamba manager that retains each request's cached checkpoint.

All three extend vLLM 0.33.0's own classes through their public hooks and keep
their argument names; vLLM builds them itself, through its spec -> manager
registry, from the kvsim spec types in ``sim.kv_cache_interface``.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import Any

from sim.kv_cache_interface import RetainedCheckpointMambaSpec, RingSlotsSpec
from sim.vllm_bridge import (
    BlockPool,
    CircularBufferManager,
    CircularBufferSpec,
    KVCacheBlock,
    KVCacheSpecRegistry,
    MambaManager,
    MambaSpec,
)


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


class RetainingMambaManager(MambaManager):
    """vLLM's Mamba manager plus the fork's retained checkpoint.

    In align mode upstream frees a request's cached checkpoint state (the
    prompt's replay-boundary state) back to the free queue once the running
    state has moved past it; under pool pressure it can then be evicted while
    its owner still runs, and the owner's resume finds no hit. The fork keeps
    it: the latest cached state a request's table drops is held outside the
    table, one per request, until the request is freed (through the same
    free paths, the deferred one included). A running request then holds
    ``2 + K`` blocks per Mamba group, the checkpoint included.
    """

    def __init__(self, kv_cache_spec: MambaSpec, block_pool: BlockPool, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, block_pool, **kwargs)
        # request id -> its retained checkpoint block
        self._retained_checkpoints: dict[str, KVCacheBlock] = {}

    def retained_checkpoints(self) -> dict[str, KVCacheBlock]:
        """Each request's retained checkpoint (a copy: read, not change)."""
        return dict(self._retained_checkpoints)

    def retained_blocks(self) -> list[KVCacheBlock]:
        return list(self._retained_checkpoints.values())

    def num_retained_checkpoints(self) -> int:
        return len(self._retained_checkpoints)

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        table = self.req_to_blocks.get(request_id)
        before = list(table) if table else []
        super().remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)
        dropped = [
            block
            for index, block in enumerate(before)
            if not block.is_null
            and table is not None
            and table[index].is_null
            and block.block_hash is not None
        ]
        if dropped:
            self._retain(request_id, dropped[-1])

    def _retain(self, request_id: str, block: KVCacheBlock) -> None:
        """Take ``block`` back from the free queue (or share it, if another
        request holds it) and release the checkpoint it replaces."""
        self.block_pool.touch([block])
        previous = self._retained_checkpoints.get(request_id)
        self._retained_checkpoints[request_id] = block
        if previous is not None:
            self.block_pool.free_blocks([previous])

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        blocks = super().pop_blocks_for_free(request_id)
        retained = self._retained_checkpoints.pop(request_id, None)
        if retained is None:
            return blocks
        # First in table order, so it is freed last (evicted after the tail).
        return [retained, *blocks]


def _register() -> None:
    """Map kvsim's spec types to kvsim's managers in vLLM's registry.

    vLLM fills its built-in registrations lazily on first use, only while the
    registry is empty, so they must be in place before kvsim adds its own.
    """
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(
        RingSlotsSpec, RingCircularBufferManager, uniform_type_base_spec=CircularBufferSpec
    )
    KVCacheSpecRegistry.register(
        RetainedCheckpointMambaSpec, RetainingMambaManager, uniform_type_base_spec=MambaSpec
    )


_register()
