"""Waiters whose prefix-cache lookup found no hit, and pin passes known to
pin nothing: the fast path's memos for the fork's waiter pins (pin point 3,
``sim/sched/pins.py``).

No twin in vLLM or the fork (both look every waiter up at the end of every
schedule). A waiter with no hit is looked up again every step until the
pin bound is reached, which a trace without shared prefixes never reaches:
most of an async saturated decode's time. The memo skips a lookup known to
find no hit again (rule 10 of ``fast_path.py``):

- a lookup (``get_computed_blocks``) reads the request's block hashes and
  token count and the pool's cached-hash map, nothing else that moves;
- the map grows only through ``BlockPool._insert_block_hash`` (full,
  partial and moved hashes alike), which this counts; evictions, frees and
  a prefix-cache reset only remove entries, and a lookup's hit only
  shrinks with entries removed (each group's hit is monotone in the cached
  hashes, and so is the coordinator's fixed point over them);
- so a lookup that found no hit finds none while no hash was inserted and
  the request has the same tokens and block hashes (a preempted request's
  stale output, drained in async mode, adds tokens to a waiter).

A whole pass (rule 11) pins nothing again when the last one pinned nothing
and no hash was inserted, the waiting queue holds the same requests in the
same order, no waiter took tokens and the same waiters are pinned: each
waiter then meets the pass as before (pinned, past the bound, or known to
find no hit), so not even the per-waiter checks are made.

``FastPath.audit`` makes every skipped lookup anyway.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sim.vllm_bridge import BlockPool, KVCacheBlock, Request

# What a pin pass read: hash insertions, waiter token changes, the pinned
# waiters, the waiting queue's entries by identity (and the entries, so no
# identity is reused while it is remembered).
PassKey = tuple[int, int, tuple[str, ...], tuple[int, ...], tuple[object, ...]]


class MissedPinLookups:
    """The waiters whose lookup found no hit since the last hash insertion,
    and the last pin pass if it pinned nothing."""

    def __init__(self, block_pool: BlockPool) -> None:
        # (hash, block) pairs inserted into the pool's cached-hash map so far
        # (or tried: a pair the map lacks counts even where vLLM returns
        # without inserting it, which is safe).
        self.num_hash_insertions = 0
        # request id -> (the request, its tokens, its block hashes) at a lookup
        # that found no hit, since insertion ``_memo_insertions``.
        self._missed: dict[str, tuple[Request, int, int]] = {}
        self._memo_insertions = 0
        # Tokens appended to a waiting request (a stale output, async mode).
        self.num_waiter_changes = 0
        self._idle_pass: PassKey | None = None
        self._count_insertions(block_pool)

    def _count_insertions(self, block_pool: BlockPool) -> None:
        """Count every hash inserted into ``cached_block_hash_to_block`` (the
        one place vLLM's pool inserts into it). A call for a pair the map
        already holds is not counted: vLLM returns at once, and a decode's
        caching makes one every step (the prompt's partial tail, re-keyed),
        which would void the memo every step. The map is read through
        ``block_pool`` each time: a reset replaces it, not this method, so
        the count survives it."""
        insert = block_pool._insert_block_hash

        def counting(key: object, block: KVCacheBlock, *args: Any, **kwargs: Any) -> None:
            held = block_pool.cached_block_hash_to_block.contain(key, block.block_id)
            insert(key, block, *args, **kwargs)
            if not held:
                self.num_hash_insertions += 1

        block_pool._insert_block_hash = counting  # type: ignore[method-assign]

    def _forget_after_insertions(self) -> bool:
        """Forget every remembered miss if a hash was inserted since they
        were remembered (any waiter may hit now); whether it forgot."""
        if self._memo_insertions == self.num_hash_insertions:
            return False
        self._missed.clear()
        self._memo_insertions = self.num_hash_insertions
        return True

    def waiter_tokens_change(self) -> None:
        """A waiting request may take tokens (a stale output lands)."""
        self.num_waiter_changes += 1

    def knows_no_hit(self, request: Request) -> bool:
        """Whether ``request``'s lookup is known to find no hit."""
        if self._forget_after_insertions():
            return False
        missed = self._missed.get(request.request_id)
        return (
            missed is not None
            and missed[0] is request
            and missed[1] == request.num_tokens
            and missed[2] == len(request.block_hashes)
        )

    def found_no_hit(self, request: Request) -> None:
        """``request``'s lookup, just made, found no hit."""
        self._forget_after_insertions()
        self._missed[request.request_id] = (request, request.num_tokens, len(request.block_hashes))

    # ------------------------------------------------------- whole passes
    def _pass_key(self, waiting: Iterable[object], pinned_ids: tuple[str, ...]) -> PassKey:
        entries = tuple(waiting)
        return (
            self.num_hash_insertions,
            self.num_waiter_changes,
            pinned_ids,
            tuple(map(id, entries)),
            entries,
        )

    def knows_idle_pass(self, waiting: Iterable[object], pinned_ids: tuple[str, ...]) -> bool:
        """Whether a pin pass over ``waiting`` is known to pin nothing."""
        idle = self._idle_pass
        if idle is None:
            return False
        key = self._pass_key(waiting, pinned_ids)
        return key[:4] == idle[:4]  # by identity: the entries themselves are not compared

    def pass_ends(self, waiting: Iterable[object], pinned_ids: tuple[str, ...], pinned: bool) -> None:
        """A pin pass ended; ``pinned``: it changed the allocator."""
        self._idle_pass = None if pinned else self._pass_key(waiting, pinned_ids)
