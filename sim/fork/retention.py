"""Fork patches 0086, 0087, 0093 and 0094: Mamba checkpoint retention
(``VLLM_E2_MAMBA_RETAIN_CHECKPOINT``). Twin of the fork's additions to
``vllm/v1/core/single_type_kv_cache_manager.py`` and
``vllm/v1/kv_cache_interface.py``: the Mamba manager that retains each
request's cached checkpoint (0086/0087), its subclass that also holds a
partial hit's copy-on-write endpoints (0093), and the spec types that select
them. 0094 (a prompt tail on a block end keyed and held) has no code of its
own: vLLM 0.33.0 keys such a tail itself, and the hold is the managers' here.
The retained checkpoint is freed last (0086) in ``frees.py``.

Both managers extend vLLM 0.33.0's own classes through their public hooks and
keep their argument names; vLLM builds them itself, through its spec ->
manager registry, from the spec types below.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from sim.fork.patches import ForkPatches
from sim.kv_cache_interface import register_managers
from sim.vllm_bridge import BlockPool, KVCacheBlock, MambaManager, MambaSpec


@dataclass(frozen=True)
class RetainedCheckpointMambaSpec(MambaSpec):
    """A Mamba group whose manager keeps each request's newest cached
    checkpoint state (the fork's ``VLLM_E2_MAMBA_RETAIN_CHECKPOINT``,
    patches 0086/0087). Scheduler-side only: the worker sees the same block
    tables either way.
    """


@dataclass(frozen=True)
class PartialTailHoldingMambaSpec(RetainedCheckpointMambaSpec):
    """A retaining Mamba group whose manager also holds a partial hit's
    copy-on-write endpoints (the fork's patch 0093, same switch as
    0086/0087). Scheduler-side only, like its base."""


def retaining_mamba_spec_type(fork: ForkPatches) -> type[RetainedCheckpointMambaSpec]:
    """The spec type (hence manager) of a Mamba group under retention:
    with patch 0093's hold or without it."""
    return PartialTailHoldingMambaSpec if fork.mamba_hold_partial_tail else RetainedCheckpointMambaSpec


class RetainingMambaManager(MambaManager):
    """vLLM's align-mode Mamba manager plus the fork's checkpoint retention
    (patches 0086/0087, ``VLLM_E2_MAMBA_RETAIN_CHECKPOINT``).

    Upstream frees a state block as soon as the request has computed one
    block past it; when that block is hashed it is the request's prefix
    checkpoint, and freed mid-request it is the first block a concurrent
    prefill evicts. The fork keeps the newest hashed retired state
    referenced, at most one per request (a superseded one is freed then),
    until the request is freed; the coordinator twin
    (``frees.py``'s ``KVCacheManager``) frees it after every group's
    table. Full-sequence admission reserves it
    (``retained_checkpoint_blocks_to_reserve``).
    """

    def __init__(self, kv_cache_spec: MambaSpec, block_pool: BlockPool, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, block_pool, **kwargs)
        # request id -> (the token position its state is keyed at, the block).
        # Ordered by position, not by table index, so that a sub-block key
        # (patch 0093's partial tail) sorts against full-block states; for
        # full-block states alone both orders agree (0086/0087).
        self._retained_checkpoints: dict[str, tuple[int, KVCacheBlock]] = {}

    def retained_checkpoints(self) -> dict[str, KVCacheBlock]:
        """Each request's retained checkpoint (a copy: read, not change)."""
        return {request_id: block for request_id, (_, block) in self._retained_checkpoints.items()}

    def retained_blocks(self) -> list[KVCacheBlock]:
        return [block for _, block in self._retained_checkpoints.values()]

    def num_retained_checkpoints(self) -> int:
        """Blocks held as checkpoints. Two requests can hold one block (a
        sibling that resumed at another's tail, patch 0093): counted once."""
        held = self._retained_checkpoints
        if not held:  # most steps (a gauge read at every one): no set to build
            return 0
        return len(set(map(id, map(itemgetter(1), held.values()))))

    # ------------------------------------------------------------ retention
    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Upstream's skip, then the fork's retirement rule on the hashed
        states it dropped from the table. Upstream freed them already;
        taking the newest back (``touch``) leaves the free queue exactly as
        if it had never been freed, the others in upstream's order."""
        table = self.req_to_blocks.get(request_id)
        before = list(table) if table else []
        super().remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)
        retired = [
            block
            for index, block in enumerate(before)
            if table is not None
            and table[index].is_null
            and not block.is_null
            and block.block_hash is not None
        ]
        if retired:
            self._hold_checkpoint(request_id, retired[-1])

    def _hold_checkpoint(self, request_id: str, block: KVCacheBlock) -> bool:
        """Hold ``block`` (a hashed state) with a ref of its own unless the
        request already holds it or a state at a later position; release the
        checkpoint it supersedes. Returns whether ``block`` is now held."""
        position = block.block_hash_num_tokens
        assert position is not None, "only a hashed state is a checkpoint"
        held = self._retained_checkpoints.get(request_id)
        if held is not None and (held[1] is block or position <= held[0]):
            return False
        self.block_pool.touch([block])
        self._retained_checkpoints[request_id] = (position, block)
        if held is not None:
            self.block_pool.free_blocks([held[1]])  # superseded: ages like any cached free block
        return True

    def pop_retained_checkpoints(self, request_id: str) -> list[KVCacheBlock]:
        """The request's held checkpoint, no longer held and not yet freed."""
        held = self._retained_checkpoints.pop(request_id, None)
        return [] if held is None else [held[1]]

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        # A direct caller frees in reverse: first here, so it is freed last
        # of this group. The coordinator twin pops it before this call.
        return self.pop_retained_checkpoints(request_id) + super().pop_blocks_for_free(request_id)

    # ------------------------------------------------------------ admission
    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        """Upstream's estimate; the full-sequence gate (``apply_admission_cap``)
        adds the checkpoint the request will hold outside its table. The fork
        adds that term in the coordinator, after this estimate; the sum the
        gate reads is the same."""
        num_blocks = super().get_num_blocks_to_allocate(
            request_id,
            num_tokens,
            new_computed_blocks,
            total_computed_tokens,
            num_local_computed_tokens,
            num_tokens_main_model,
            apply_admission_cap=apply_admission_cap,
            prefill_end=prefill_end,
        )
        if apply_admission_cap:
            num_blocks += self.retained_checkpoint_blocks_to_reserve(
                request_id, num_tokens_main_model, new_computed_blocks, num_local_computed_tokens
            )
        return num_blocks

    def retained_checkpoint_blocks_to_reserve(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_local_computed_tokens: int = 0,
    ) -> int:
        """1 when the request will come to hold a checkpoint it does not hold
        yet: a state behind the running one to retire
        (``num_tokens > block_size``, 0086), and no hit block or hashed
        state in its table that already is that block (0087). The hit length
        is read only by the partial-tail hold (0093)."""
        if num_tokens <= self.block_size:
            return 0
        if request_id in self._retained_checkpoints:
            return 0
        if any(not block.is_null for block in new_computed_blocks):
            return 0
        table = self.req_to_blocks.get(request_id, ())
        return 0 if any(not b.is_null and b.block_hash is not None for b in table) else 1


class PartialTailHoldingMambaManager(RetainingMambaManager):
    """The retaining Mamba manager plus the fork's partial-tail hold (patch
    0093, under the same ``VLLM_E2_MAMBA_RETAIN_CHECKPOINT``).

    With a hash unit finer than the block, a request that resumed inside a
    block (a partial hit) hashes no block-end state of its own: the only
    state its next turn can resume at is its prompt tail, which vLLM keys
    on the running block and then moves into a copy-on-write block in no
    block table. Once the copy has run that block sits at ref 0 ahead of
    the request's attention blocks and a concurrent prefill evicts it.
    This manager holds both copy endpoints as the request's checkpoint:

    - a new request's hit source, once its copy is queued (a request that
      stops before its own tail still leaves the state it resumed from);
    - a running request's moved tail (the copy), superseding the source;
    - another request holding the moved source follows it to the copy,
      so a hold never pins someone else's running block.

    Admission reserves one block more for a partial hit (the held source
    and the moved tail coexist for one step) and, when the unit is finer
    than the block, for a prompt no longer than one block (its tail is
    moved and held too).
    """

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        """vLLM's allocation, whose copy-on-write of a partial hit (a new
        request's ``_apply_cow`` or a running request's hash move) is then
        held. Holding afterwards changes no free-queue order: between the
        copy and the return vLLM touches the pool no more."""
        partial_hit = self._partial_hit_reqs.get(request_id)
        was_running = request_id in self._allocated_block_reqs
        new_blocks = super().allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
        if partial_hit is None:
            return new_blocks
        source = partial_hit[1]
        if not was_running:
            self._hold_if_hashed(request_id, source)
            return new_blocks
        copy = next(c for s, c in reversed(self._pending_cow_copies) if s is source)
        self._follow_moved_hash(request_id, source, copy)
        self._hold_if_hashed(request_id, copy)
        return new_blocks

    def _hold_if_hashed(self, request_id: str, block: KVCacheBlock) -> None:
        if not block.is_null and block.block_hash is not None:
            self._hold_checkpoint(request_id, block)

    def _follow_moved_hash(self, owner_id: str, source: KVCacheBlock, copy: KVCacheBlock) -> None:
        """``owner_id`` moved ``source``'s hashes to ``copy`` and goes on
        writing ``source``: whoever else held ``source`` (it resumed at
        that tail while it was still the owner's running block) now holds
        the copy, the hashed state."""
        for request_id, (position, block) in list(self._retained_checkpoints.items()):
            if request_id != owner_id and block is source:
                self.block_pool.touch([copy])
                self._retained_checkpoints[request_id] = (position, copy)
                self.block_pool.free_blocks([source])

    def retained_checkpoint_blocks_to_reserve(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_local_computed_tokens: int = 0,
    ) -> int:
        if request_id in self._retained_checkpoints:
            return 0  # a holder only ever swaps its checkpoint
        if self._has_partial_local_hit(new_computed_blocks, num_local_computed_tokens):
            return 1
        if num_tokens <= self.block_size:
            return int(self.block_pool.hash_block_size < self.block_size)
        return super().retained_checkpoint_blocks_to_reserve(
            request_id, num_tokens, new_computed_blocks, num_local_computed_tokens
        )


def _register() -> None:
    """kvsim's Mamba spec types served by kvsim's Mamba managers, in vLLM's registry."""
    register_managers(
        (RetainedCheckpointMambaSpec, RetainingMambaManager, MambaSpec),
        (PartialTailHoldingMambaSpec, PartialTailHoldingMambaManager, MambaSpec),
    )


_register()
