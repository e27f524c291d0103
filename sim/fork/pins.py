"""The fork's prefix-hit pins on kvsim's ``KVCacheManager`` (patches 0095,
0096 and 0097 of ``halt95/qwen38-flash-next-3090s``, release v2.5.1).

Twin of the fork's additions to ``vllm/v1/core/kv_cache_manager.py``; no
twin in vLLM 0.33.0. With a prefix-match unit finer than the block a
hybrid follow-up resumes from one Mamba state keyed in the top attention
block, so losing any one block of its prefix is a total miss. Two kinds of
extra reference keep such a prefix out of the free queue:

- **waiter pins** (0095, 0096): a waiting request's current hit, every
  non-null hit block of every group plus the block holding the MTP proof
  unit (one unit past the key), at most ``max_pinned_waiters`` requests;
  released when the request is admitted, freed (either free path) or the
  prefix cache is reset. A pin is a snapshot: a hit that grows later is not
  re-pinned.
- **grace pins** (0097): a turn that finished with output keeps one extra
  reference on every hashed block it held (table and retained Mamba
  checkpoints) until another request is admitted on it, at most
  ``max_grace_pins`` (oldest released first). Only with a unit finer than
  the block (vLLM's ``enable_partial_hash_hits``): at a block-sized unit
  they are inactive, as in the fork.

Pins never cost anyone blocks: ``yield_pinned_hits`` releases them (graces
oldest first, then waiter pins newest first) before a running request
would be preempted (``scheduler_pins.py``). Pinned blocks are referenced,
so admission and the watermark count them as used.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sim.fork.frees import KVCacheManager
from sim.fork.retention import RetainingMambaManager
from sim.vllm_bridge import KVCacheBlock, KVCacheBlocks, Request, RequestStatus

HitBlocks = tuple[Sequence[KVCacheBlock], ...]

# A finished turn with no next turn worth holding for: nothing resumes it.
_NO_GRACE_STATUSES = (RequestStatus.FINISHED_ERROR, RequestStatus.FINISHED_IGNORED)
# vLLM applies the watermark to these only (waiting and preempted admissions).
_ADMITTED_STATUSES = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


@dataclass(frozen=True, slots=True)
class _Grace:
    """A finished turn's grace: its hashed blocks in eviction order (each
    group's tail first, retained checkpoints last), their ids, its prompt."""

    blocks: list[KVCacheBlock]
    block_ids: frozenset[int]
    num_prompt_tokens: int


class PinningKVCacheManager(KVCacheManager):
    """kvsim's manager with the fork's waiter pins and grace pins.

    ``waiter_pins`` (0095/0096) and ``grace_pins`` (0097) are the scenario's
    switches; the manager turns each off where the fork does: no prefix
    caching, a KV connector, and (graces) a unit equal to the block.
    """

    # 0095 pinned at most 8 waiters; 0096 raised it to 16 (twice the
    # deployed max_num_seqs).
    max_pinned_waiters: int = 16
    # 0097: one grace per conversation; twice the deployed max_num_seqs.
    max_grace_pins: int = 16

    def __init__(
        self,
        *args: Any,
        waiter_pins: bool = True,
        grace_pins: bool = True,
        kv_connector: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        active = self.enable_caching and not kv_connector
        self.enable_waiter_pins = waiter_pins and active
        self.enable_grace_pins = grace_pins and active and bool(self.coordinator.enable_partial_hash_hits)
        # 0097's scheduler side (graces yield first, the head waiter's
        # shortfall guard) runs whenever the patch is in, graces or not.
        self.guards_head_yields = grace_pins
        self._pinned_hits: dict[str, list[KVCacheBlock]] = {}
        self._graces: dict[str, _Grace] = {}
        # Blocks missing when the last allocate_slots returned None (0097).
        self.last_alloc_shortfall = 0
        # Whether the last ``pin_waiting_hit`` looked the request up and found
        # no hit (the fast path remembers such waiters, ``scheduler_pins.py``).
        self.pin_lookup_found_no_hit = False
        self._last_need: tuple[int, bool] = (0, False)
        self._record_block_needs()

    def _record_block_needs(self) -> None:
        """Remember the coordinator's last block count (and whether it was
        the full-sequence gate's) so a failed allocation's shortfall is
        vLLM's own arithmetic, not a second estimate."""
        coordinator = self.coordinator
        count = coordinator.get_num_blocks_to_allocate

        def recording(*args: Any, **kwargs: Any) -> int:
            num_blocks = count(*args, **kwargs)
            self._last_need = (num_blocks, bool(kwargs.get("apply_admission_cap")))
            return num_blocks

        coordinator.get_num_blocks_to_allocate = recording

    # ------------------------------------------------------------ allocation
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> KVCacheBlocks | None:
        blocks = super().allocate_slots(
            request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, *args, **kwargs
        )
        if blocks is None:
            self.last_alloc_shortfall = self._shortfall(request, kwargs)
            return None
        self.last_alloc_shortfall = 0
        # Admitted: the table now references the hit; the pins are redundant.
        self.release_pinned_hit(request.request_id)
        if self._graces and num_new_computed_tokens > 0 and new_computed_blocks is not None:
            reused = num_new_computed_tokens + kwargs.get("num_external_computed_tokens", 0)
            self._release_grace_for_hit(
                self._admitted_hit(new_computed_blocks.blocks, reused),
                request.num_computed_tokens + num_new_computed_tokens,
            )
        return blocks

    def _admitted_hit(self, hit: HitBlocks, num_reused_tokens: int) -> HitBlocks:
        """The hit as ``allocate_slots`` adopts it: a group that retains a
        longer hit keeps only the blocks the reused tokens cover."""
        groups = list(hit)
        for group_id in self.retained_hit_group_ids:
            block_size = self.managers[group_id].block_size
            groups[group_id] = groups[group_id][: -(-num_reused_tokens // block_size)]
        return tuple(groups)

    def _shortfall(self, request: Request, kwargs: dict[str, Any]) -> int:
        """vLLM's failed check, required minus available: the full-sequence
        gate against the free blocks, else the step's need against the free
        blocks less ``reserved_blocks``; the watermark as vLLM applies it."""
        num_blocks, full_sequence_gate = self._last_need
        watermark = 0
        if kwargs.get("has_scheduled_reqs") and request.status in (
            RequestStatus.WAITING,
            RequestStatus.PREEMPTED,
        ):
            watermark = self.watermark_blocks
        available = self.block_pool.get_num_free_blocks()
        if not full_sequence_gate:
            available -= kwargs.get("reserved_blocks", 0)
        return max(num_blocks + watermark - available, 0)

    # ------------------------------------------------------------------ frees
    def free(self, request: Request) -> None:
        if self._grace_eligible(request):
            # 0097: the fork frees a graced turn as the deferred path does, in
            # one call over pop_blocks_for_free's list (its grace ref on
            # first, so the hashed blocks never pass through the free queue),
            # not group by group: one call puts the unhashed blocks at the
            # queue's head in that list's order (kvsim conform --fork).
            self.block_pool.free_blocks(reversed(self.pop_blocks_for_free(request)))
            return
        self.release_pinned_hit(request.request_id)
        super().free(request)

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        # 0096: a waiter's pin is never written by a step in flight, so it
        # goes now, not with the fenced blocks. 0097: a finished turn's grace
        # takes its ref now; the table's refs go at the fence.
        self.release_pinned_hit(request.request_id)
        if self._grace_eligible(request):
            self._take_grace_pin(request)
        return super().pop_blocks_for_free(request)

    def reset_prefix_cache(self) -> bool:
        # Every pinned hit is about to be invalidated anyway.
        self.yield_pinned_hits()
        return super().reset_prefix_cache()

    # ------------------------------------------------------------ waiter pins
    @property
    def num_pinned_waiters(self) -> int:
        return len(self._pinned_hits)

    @property
    def num_pinned_blocks(self) -> int:
        return sum(len(blocks) for blocks in self._pinned_hits.values())

    def pinned_hits(self) -> dict[str, list[KVCacheBlock]]:
        """Each pinned waiter's blocks, in pin order (a copy)."""
        return {request_id: list(blocks) for request_id, blocks in self._pinned_hits.items()}

    def pinned_waiter_ids(self) -> tuple[str, ...]:
        """The pinned waiters, in pin order."""
        return tuple(self._pinned_hits)

    def pinned_hit_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return list(self._pinned_hits.get(request_id, ()))

    def pin_waiting_hit(self, request: Request) -> int:
        """Reference ``request``'s current hit while it waits: every non-null
        hit block of every group, plus the block holding the MTP proof unit
        past the key (never part of the returned hit, but the hit depends on
        it). Returns the blocks pinned now: 0 when pins are off, the request
        is pinned already, nothing hits, or the bound is reached."""
        self.pin_lookup_found_no_hit = False
        if (
            not self.enable_waiter_pins
            or request.request_id in self._pinned_hits
            or not self.prefix_cache_lookup_enabled(request)
            or len(self._pinned_hits) >= self.max_pinned_waiters
        ):
            return 0
        computed, num_hit, _ = self.get_computed_blocks(request)
        self.pin_lookup_found_no_hit = num_hit == 0
        blocks = [block for group in computed.blocks for block in group if not block.is_null]
        if num_hit == 0 or not blocks:
            return 0
        blocks += self._proof_blocks(request, num_hit, {block.block_id for block in blocks})
        self.block_pool.touch(blocks)
        self._pinned_hits[request.request_id] = blocks
        return len(blocks)

    def _proof_blocks(self, request: Request, num_hit: int, seen: set[int]) -> list[KVCacheBlock]:
        """Each group's cached block at hash unit ``num_hit // unit`` not
        pinned already (a different block when the key ends a block)."""
        proof_index = num_hit // self.block_pool.hash_block_size
        if proof_index >= len(request.block_hashes):
            return []
        proofs = []
        for group_id in range(self.num_kv_cache_groups):
            cached = self.block_pool.get_cached_block(request.block_hashes[proof_index], [group_id])
            if cached and cached[0].block_id not in seen:
                seen.add(cached[0].block_id)
                proofs.append(cached[0])
        return proofs

    def release_pinned_hit(self, request_id: str) -> int:
        blocks = self._pinned_hits.pop(request_id, None)
        if not blocks:
            return 0
        # Reversed: the prefix stays an eviction candidate longer than the tail.
        self.block_pool.free_blocks(reversed(blocks))
        return len(blocks)

    def _pinned_extras(self, request_id: str, hit: HitBlocks) -> list[KVCacheBlock]:
        hit_ids = {id(block) for group in hit for block in group}
        return [block for block in self._pinned_hits.get(request_id, ()) if id(block) not in hit_ids]

    def release_pinned_extras(self, request_id: str, hit: HitBlocks) -> int:
        """Drop the request's pinned blocks outside ``hit`` (the proof block
        past it): it is admitted on ``hit`` now, so they protect nothing."""
        extras = self._pinned_extras(request_id, hit)
        if not extras:
            return 0
        extra_ids = {id(block) for block in extras}
        rest = [block for block in self._pinned_hits[request_id] if id(block) not in extra_ids]
        if rest:
            self._pinned_hits[request_id] = rest
        else:
            del self._pinned_hits[request_id]
        self.block_pool.free_blocks(extras)
        return len(extras)

    # ------------------------------------------------------------ grace pins
    @property
    def num_grace_pins(self) -> int:
        return len(self._graces)

    @property
    def num_grace_pinned_blocks(self) -> int:
        return sum(len(grace.blocks) for grace in self._graces.values())

    def grace_order(self) -> list[str]:
        """The graced requests, oldest first."""
        return list(self._graces)

    def grace_pinned_blocks(self, request_id: str) -> list[KVCacheBlock]:
        grace = self._graces.get(request_id)
        return [] if grace is None else list(grace.blocks)

    def _grace_eligible(self, request: Request) -> bool:
        """A turn that finished with output (stop, length, an abort after
        decoding) may have a next turn; a preemption (still RUNNING), an
        error, an ignored request or an aborted waiter may not."""
        return (
            self.enable_grace_pins
            and self.prefix_cache_lookup_enabled(request)
            and request.is_finished()
            and request.status not in _NO_GRACE_STATUSES
            and request.num_output_tokens > 0
        )

    def _held_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The request's blocks in eviction order: each group's table tail
        first, then its retained checkpoints."""
        blocks = [block for m in self.managers for block in reversed(m.req_to_blocks.get(request_id, ()))]
        for manager in self.managers:
            if isinstance(manager, RetainingMambaManager):
                held = manager.retained_checkpoints().get(request_id)
                blocks += [] if held is None else [held]
        return blocks

    def _take_grace_pin(self, request: Request) -> int:
        """One extra ref on every hashed block the request holds in the main
        pool (unhashed blocks, ring slots and the null block go back with the
        table); the oldest grace goes beyond the bound."""
        keep: list[KVCacheBlock] = []
        seen: set[int] = set()
        for block in self._held_blocks(request.request_id):
            if block.is_null or block.block_hash is None or id(block) in seen:
                continue
            if block.pool is not None and block.pool is not self.block_pool:
                continue
            assert block.ref_cnt > 0, "a held block is referenced"
            seen.add(id(block))
            keep.append(block)
        if not keep:
            return 0
        self.release_grace_pin(request.request_id)  # a repeated free replaces it
        for block in keep:
            block.ref_cnt += 1
        self._graces[request.request_id] = _Grace(keep, frozenset(seen), request.num_prompt_tokens)
        while len(self._graces) > self.max_grace_pins:
            self.release_grace_pin(next(iter(self._graces)))
        return len(keep)

    def release_grace_pin(self, request_id: str) -> int:
        grace = self._graces.pop(request_id, None)
        if grace is None:
            return 0
        self.block_pool.free_blocks(grace.blocks)
        return len(grace.blocks)

    def _release_grace_for_hit(self, hit: HitBlocks, num_hit_tokens: int) -> None:
        """The grace of the turn an admission resumes has done its job: one
        that holds the deepest hit block of every group whose deepest block
        any grace holds, and whose prompt the hit reaches to within two
        units. A hit on a shared system prompt only releases nothing."""
        candidates: set[str] | None = None
        for group in hit:
            deepest = next((block for block in reversed(group) if not block.is_null), None)
            if deepest is None:
                continue
            owners = {rid for rid, grace in self._graces.items() if id(deepest) in grace.block_ids}
            if owners:
                candidates = owners if candidates is None else candidates & owners
        reach = num_hit_tokens + 2 * self.block_pool.hash_block_size
        for request_id in sorted(candidates or (), key=list(self._graces).index):
            if reach >= self._graces[request_id].num_prompt_tokens:
                self.release_grace_pin(request_id)

    # -------------------------------------------------------------- yielding
    def yield_pinned_hits(self, keep: str | None = None, limit: int | None = None) -> int:
        """Release pins so someone can allocate: graces oldest first, then
        waiter pins newest first (never ``keep``'s), at most ``limit`` pins.
        Returns the blocks released (0: nothing to yield)."""
        order = [(True, rid) for rid in self._graces]
        order += [(False, rid) for rid in reversed(list(self._pinned_hits)) if rid != keep]
        released = 0
        for is_grace, request_id in order[:limit]:
            release = self.release_grace_pin if is_grace else self.release_pinned_hit
            released += release(request_id)
        return released

    def num_yieldable_blocks(self, keep: str | None = None, keep_hit: HitBlocks | None = None) -> int:
        """Blocks that would return to the free queue if every grace and
        every waiter pin but ``keep``'s were released; with ``keep_hit`` (the
        hit ``keep`` is admitted on) also ``keep``'s pinned blocks outside
        it. Blocks of that hit never count: the admission takes them back."""
        holders = [grace.blocks for grace in self._graces.values()]
        holders += [blocks for rid, blocks in self._pinned_hits.items() if rid != keep]
        hit_ids: set[int] = set()
        if keep is not None and keep_hit is not None:
            holders.append(self._pinned_extras(keep, keep_hit))
            hit_ids = {id(block) for group in keep_hit for block in group}
        counts: dict[int, list[Any]] = {}
        for blocks in holders:
            for block in blocks:
                counts.setdefault(id(block), [block, 0])[1] += 1
        return sum(
            1 for key, (block, num_pins) in counts.items() if block.ref_cnt == num_pins and key not in hit_ids
        )

    def pin_holders(self) -> list[tuple[str, list[KVCacheBlock]]]:
        """Every pin as (holder, blocks), for the invariant checker."""
        holders = [(f"grace of {rid}", grace.blocks) for rid, grace in self._graces.items()]
        return holders + [(f"pin of {rid}", blocks) for rid, blocks in self._pinned_hits.items()]
