"""Waiters whose prefix-cache lookup found no hit, and pin passes known to pin nothing
(rules 10-11; the fork's waiter pins, pin point 3). A lookup reads only the request's own
hashes and tokens and the pool's cached-hash map, whose insertions the bridge watches."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from sim.vllm_bridge import kv_cache_utils, watch_hash_insertions

if TYPE_CHECKING:
    from sim.vllm_bridge import BlockPool, Request

# What a pin pass read: hash insertions, waiter token changes, the pinned waiters,
# the queue's entries by identity (and the entries: no identity is reused while held).
PassKey = tuple[int, int, tuple[str, ...], tuple[int, ...], tuple[object, ...]]


class MissedPinLookups:
    """The waiters whose lookup found no hit since none of their own hashes
    was inserted, and the last pin pass if it pinned nothing."""

    # Remembered (hash, waiter) pairs past which every memo is dropped (a
    # dropped memo costs a lookup): memory stays bounded on any trace.
    MAX_REMEMBERED_HASHES = 1 << 18

    def __init__(self, block_pool: BlockPool) -> None:
        # (hash, block) pairs inserted into the pool's cached-hash map (or
        # tried: counting one vLLM returns without inserting is safe).
        self.num_hash_insertions = 0
        # request id -> (the request, its tokens, its block hashes) at a lookup
        # with no hit, none of its hashes inserted since.
        self._missed: dict[str, tuple[Request, int, int]] = {}
        # block hash -> the remembered waiters whose hashes include it.
        self._waiters_by_hash: dict[bytes, set[str]] = {}
        self._num_remembered_hashes = 0
        self.num_waiter_changes = 0  # stale outputs landed on waiters (async)
        self._idle_pass: PassKey | None = None
        self._idle_ids: frozenset[int] = frozenset()  # its entries' ids
        # Its queue and the queue's insertions then (None: a queue without the count).
        self._idle_queue: tuple[object, int] | None = None
        # Whether every waiter it met is remembered by rule 10 (a remembered
        # waiter meets a pass differently only once forgotten), and the ids of
        # those that may since: forgotten by a hash insertion, or admitted (a
        # preempted request comes back as the same object, with more tokens).
        self._idle_covered = False
        self._changed_ids: set[int] = set()
        self._forgot = False  # whether an insertion forgot a waiter since it
        self._pass_covered = False  # the same for the pass under way
        self._count_insertions(block_pool)

    def _count_insertions(self, block_pool: BlockPool) -> None:
        """Count every pair the map gains (not one it holds: a decode
        re-inserts it every step), forgetting its waiters."""

        def inserted(key: Any) -> None:
            self.num_hash_insertions += 1
            self._forget_waiters_of(kv_cache_utils.get_block_hash(key))

        watch_hash_insertions(block_pool, inserted)

    def _forget_waiters_of(self, block_hash: bytes) -> None:  # they may hit now
        for request_id in self._waiters_by_hash.pop(block_hash, ()):
            missed = self._missed.pop(request_id, None)
            if missed is not None:
                self._changed_ids.add(id(missed[0]))
                self._forgot = True

    def waiter_tokens_change(self) -> None:  # a stale output lands
        self.num_waiter_changes += 1

    def knows_no_hit(self, request: Request) -> bool:
        return self.memo_of(request) is not None

    def memo_of(self, request: Request) -> object | None:
        """What remembers that its lookup finds no hit (None: not known), a new object each time."""
        missed = self._missed.get(request.request_id)
        if (
            missed is not None
            and missed[0] is request
            and missed[1] == request.num_tokens
            and missed[2] == len(request.block_hashes)
        ):
            return missed
        return None

    def found_no_hit(self, request: Request) -> None:
        if self._num_remembered_hashes + len(request.block_hashes) > self.MAX_REMEMBERED_HASHES:
            # Its waiters' memos go: none is known forgotten.
            self._idle_covered = self._pass_covered = False
            self._missed.clear()
            self._waiters_by_hash.clear()
            self._num_remembered_hashes = 0
        request_id = request.request_id
        self._missed[request_id] = (request, request.num_tokens, len(request.block_hashes))
        for block_hash in request.block_hashes:
            self._waiters_by_hash.setdefault(block_hash, set()).add(request_id)
        self._num_remembered_hashes += len(request.block_hashes)

    def _pass_key(self, waiting: Iterable[object], pinned_ids: tuple[str, ...]) -> PassKey:
        queue = tuple(waiting)
        return (self.num_hash_insertions, self.num_waiter_changes, pinned_ids, tuple(map(id, queue)), queue)

    def knows_idle_pass(self, waiting: Iterable[object], pinned_ids: tuple[str, ...]) -> bool:
        """It would pass over every waiter, or meet the idle pass's queue."""
        idle = self._passable_idle_pass(pinned_ids)
        if idle is None:
            return False  # it would pass over nobody
        if not self._forgot and self._only_removed_from(waiting):
            # Every waiter now met the idle pass, none is forgotten since,
            # and the admitted ones have left: each would be passed over.
            return True
        # The entries by identity, not compared themselves.
        if idle[0] != self.num_hash_insertions or self._changed_ids or idle[3] != tuple(map(id, waiting)):
            return False
        self._idle_queue = _queue_state(waiting)  # changed back: the next check is one number
        return True

    def _only_removed_from(self, waiting: Iterable[object]) -> bool:  # since the idle pass
        idle_queue = self._idle_queue
        return idle_queue is not None and idle_queue[0] is waiting and idle_queue[1] == _insertions(waiting)

    def idle_pass_entries(self, pinned_ids: tuple[str, ...]) -> frozenset[int]:
        """A pass starts: the ids of the idle pass's entries that meet it as they met that one."""
        passed_over = self._passed_over(pinned_ids)
        # The waiters passed over carry that pass's cover into this one.
        self._pass_covered = self._idle_covered or not passed_over
        return passed_over

    def _passed_over(self, pinned_ids: tuple[str, ...]) -> frozenset[int]:
        if self._passable_idle_pass(pinned_ids) is None:
            return frozenset()
        return self._idle_ids.difference(self._changed_ids) if self._changed_ids else self._idle_ids

    def _passable_idle_pass(self, pinned_ids: tuple[str, ...]) -> PassKey | None:
        """The idle pass, if a pass now passes over its waiters: the same waiter
        tokens and pinned waiters, and no insertion or only remembered waiters met."""
        idle = self._idle_pass
        if idle is None or idle[1:3] != (self.num_waiter_changes, pinned_ids):
            return None
        return idle if idle[0] == self.num_hash_insertions or self._idle_covered else None

    def waiter_admitted(self, request: Request) -> None:
        self._changed_ids.add(id(request))

    def pass_meets_unremembered_waiter(self) -> None:
        self._pass_covered = False

    def pass_ends(self, waiting: Iterable[object], pinned_ids: tuple[str, ...], pinned: bool) -> None:
        """``pinned``: it changed the allocator."""
        self._idle_pass = None if pinned else self._pass_key(waiting, pinned_ids)
        self._idle_queue = None if pinned else _queue_state(waiting)
        self._idle_covered = not pinned and self._pass_covered
        self._changed_ids = set()
        self._forgot = False
        self._idle_ids = frozenset() if self._idle_pass is None else frozenset(self._idle_pass[3])


def _insertions(waiting: Iterable[object]) -> int | None:  # None: not a ``WaitingQueue``
    return getattr(waiting, "insertions", None)


def _queue_state(waiting: Iterable[object]) -> tuple[object, int] | None:
    """The queue (held, so its identity is not reused) and its insertions."""
    insertions = _insertions(waiting)
    return None if insertions is None else (waiting, insertions)
