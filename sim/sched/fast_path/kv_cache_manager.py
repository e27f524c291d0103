"""The fast path's door: the scheduler's ``KVCacheManager`` when
``simulation.fast_path`` is on. It decides every call that may change the
allocator and passes the reads in ``PASSED_THROUGH`` on (rules 1-3, 10, 12)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from sim.allocator_invariants import allocator_snapshot
from sim.sched.fast_path.missed_lookups import MissedPinLookups
from sim.sched.fast_path.settled import SettledSteps
from sim.sched.output import is_decoding
from sim.vllm_bridge import RequestStatus

if TYPE_CHECKING:
    from sim.kv_cache_manager import KVCacheManager
    from sim.sched.scheduler import SchedulerConfig
    from sim.vllm_bridge import KVCacheBlock, KVCacheBlocks, Request

T = TypeVar("T")


class FastPathKVCacheManager:
    """The manager ``wrapped`` behind the fast path's door (rules 1-3, 10, 12)."""

    def __init__(self, wrapped: KVCacheManager, config: SchedulerConfig) -> None:
        self.wrapped = wrapped
        # Read on every step and skipped call; fixed at construction.
        self.block_pool = wrapped.block_pool
        self.empty_kv_cache_blocks = wrapped.empty_kv_cache_blocks
        self.allocations = settled_steps(wrapped, config)
        self.caching = settled_steps(wrapped, config)
        # Every call that may change the allocator, and a waiter's drained
        # stale output (rule 9); less those that only take blocks (rule 12).
        self.allocator_version = self.release_version = 0
        self.missed_pin_lookups = MissedPinLookups(wrapped.block_pool)  # rule 10
        # The waiting loop's last lookup (the request, whether it found nothing),
        # and the last that did, with rule 10's memo of it then (rule 12).
        self.last_lookup: tuple[object, bool] | None = None
        self._found_nothing: tuple[object, object] | None = None
        self.audit = False
        self.audited: Counter[str] = Counter()  # the skipped calls made anyway, by kind

    def changes(self) -> None:  # beyond taking blocks: every memo is void
        self.allocator_version += 1
        self.release_version += 1

    def _changed(self, released_or_pinned: int) -> int:
        if released_or_pinned:
            self.changes()
        return released_or_pinned

    def allocate_slots(self, request: Request, num_new_tokens: int, **kwargs: Any) -> KVCacheBlocks | None:
        """Skipped when settled (rule 1); a running request's only takes blocks (rule 12)."""
        allocate = self.wrapped.allocate_slots
        if request.status != RequestStatus.RUNNING:
            blocks = allocate(request, num_new_tokens, **kwargs)
            if blocks is not None:
                self.changes()
            return blocks
        span = self.decode_span(request, num_new_tokens + kwargs.get("num_lookahead_tokens", 0))
        if span is not None and self.allocations.is_settled(request.request_id, *span):
            if self.audit:
                self._audit_allocation(request, num_new_tokens, kwargs.get("num_lookahead_tokens", 0))
            return self.empty_kv_cache_blocks
        self.allocator_version += 1
        blocks = allocate(request, num_new_tokens, **kwargs)
        if blocks is not None and span is not None:
            self.allocations.record(request.request_id, *span, request.num_prompt_tokens)
        return blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Skipped when settled (rule 1); else it only takes blocks (rule 12)."""
        computed = num_computed_tokens
        if self.caching.is_settled(request.request_id, computed, computed):
            if self.audit:
                self.check_unchanged(lambda: self.wrapped.cache_blocks(request, computed), "caching")
            return
        self.allocator_version += 1
        self.wrapped.cache_blocks(request, computed)
        self.caching.record(request.request_id, computed, computed, request.num_prompt_tokens)

    @staticmethod
    def decode_span(request: Request, num_tokens: int) -> tuple[int, int] | None:
        """The positions a decode's next ``num_tokens`` slots span (None: not
        decoding), from its processed tokens (rule 9)."""
        computed = request.num_computed_tokens
        if not is_decoding(computed, request.num_tokens):
            return None
        return computed - request.num_in_flight_tokens, computed + num_tokens

    def free(self, request: Request) -> None:
        self._forget(request.request_id)
        self.wrapped.free(request)

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        self._forget(request.request_id)
        return self.wrapped.pop_blocks_for_free(request)

    def _forget(self, request_id: str) -> None:
        self.allocations.forget(request_id)
        self.caching.forget(request_id)
        self.changes()

    def free_blocks(self, blocks: Any) -> None:
        self.changes()
        self.wrapped.free_blocks(blocks)

    def take_kv_cache_block_copies(self) -> Any:
        copies = self.wrapped.take_kv_cache_block_copies()
        if copies[0]:
            self.changes()
        return copies

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int, int]:
        """Known to find nothing: vLLM's empty answer (rule 12); no hit: remembered (rule 10)."""
        if self.finds_nothing(request):
            self.last_lookup = (request, True)
            empty = self.empty_kv_cache_blocks, 0, 0
            if self.audit:
                found = self.check_unchanged(lambda: self.wrapped.get_computed_blocks(request), "lookup")
                assert found == empty, f"{request.request_id}: a lookup finds"
            return empty
        blocks, num_hit, boundary = self.wrapped.get_computed_blocks(request)
        missed = num_hit == 0 and boundary == 0 and not any(blocks.blocks)
        self.last_lookup = (request, missed)
        memos = self.missed_pin_lookups
        if num_hit == 0 and not memos.knows_no_hit(request):
            memos.found_no_hit(request)
        self._found_nothing = (request, memos.memo_of(request)) if missed else None
        return blocks, num_hit, boundary

    def finds_nothing(self, request: Request) -> bool:
        """Its last waiting-loop lookup found nothing, and rule 10's memo of
        it is the one it had then (none of its hashes inserted since)."""
        found = self._found_nothing
        if found is None or found[0] is not request:
            return False
        memo = self.missed_pin_lookups.memo_of(request)
        return memo is not None and memo is found[1]

    def yield_pinned_hits(self, *args: Any, **kwargs: Any) -> int:
        return self._changed(self.wrapped.yield_pinned_hits(*args, **kwargs))  # type: ignore[attr-defined]

    def release_pinned_extras(self, *args: Any) -> int:
        return self._changed(self.wrapped.release_pinned_extras(*args))  # type: ignore[attr-defined]

    def pin_waiting_hit(self, request: Request) -> int:
        """Skipped where known to find no hit (rule 10)."""
        memos, wrapped = self.missed_pin_lookups, self.wrapped
        if memos.knows_no_hit(request):
            if self.audit:
                self._audit_pin_lookup(request)
            return 0
        pinned = self._changed(wrapped.pin_waiting_hit(request))  # type: ignore[attr-defined]
        if wrapped.pin_lookup_found_no_hit:  # type: ignore[attr-defined]
            memos.found_no_hit(request)
        elif not pinned:
            # Pinned already, or a hit of null blocks only: not remembered,
            # so any hash inserted may change what this waiter meets.
            memos.pass_meets_unremembered_waiter()
        return pinned

    def check_unchanged(self, call: Callable[[], T], what: str) -> T:
        """A skipped call, made anyway (the audit): it must change nothing."""
        before = allocator_snapshot(self.wrapped)
        result = call()
        assert allocator_snapshot(self.wrapped) == before, f"a skipped {what} call changed the allocator"
        self.audited[what] += 1
        return result

    def _audit_allocation(self, request: Request, num_new: int, num_lookahead: int) -> None:
        allocate = partial(self.wrapped.allocate_slots, request, num_new, num_lookahead_tokens=num_lookahead)
        blocks = self.check_unchanged(allocate, "allocation")
        allocated = blocks is None or any(blocks.blocks)  # vLLM's refusal is None
        assert not allocated, f"{request.request_id}: a settled call allocated"

    def _audit_pin_lookup(self, request: Request) -> None:
        # No snapshot (there are many): a lookup with no hit returns first.
        pinned = self.wrapped.pin_waiting_hit(request)  # type: ignore[attr-defined]
        no_hit = self.wrapped.pin_lookup_found_no_hit  # type: ignore[attr-defined]
        assert pinned == 0 and no_hit, f"{request.request_id}: a skipped pin lookup hits"
        self.audited["pin lookup"] += 1


# What passes through unseen, read on the wrapped manager each time (``kvsim bench``
# replaces methods there): reads, and ``new_step_starts`` (a per-step set). Named, not
# ``__getattr__``: a new allocator call fails here until it is a door method (rule 3) or listed.
PASSED_THROUGH = (
    "coordinator managers ring_managers ring_slot_pools enable_caching get_block_ids new_step_starts"
    " take_events take_new_block_ids take_new_ring_block_ids make_prefix_cache_stats"
    " record_prefix_cache_stats num_free_blocks usage num_retained_checkpoints"
    # The fork's pins (0095-0097).
    " enable_waiter_pins pinned_waiter_ids guards_head_yields last_alloc_shortfall num_grace_pins"
    " num_pinned_waiters max_pinned_waiters num_yieldable_blocks pin_holders"
).split()
for _name in PASSED_THROUGH:
    setattr(FastPathKVCacheManager, _name, property(lambda door, name=_name: getattr(door.wrapped, name)))


def unwrapped(manager: KVCacheManager | FastPathKVCacheManager) -> KVCacheManager:
    """The manager behind the door (itself when there is none)."""
    return manager.wrapped if isinstance(manager, FastPathKVCacheManager) else manager


def settled_steps(manager: KVCacheManager, config: SchedulerConfig) -> SettledSteps:
    """Windows over every block size a call divides by, widened by the
    margin (rules 1-2). A ring reads no position: its size is left out."""
    rings = manager.ring_managers
    sizes = {m.block_size for m in manager.managers if m not in rings}
    sizes.add(config.block_size)
    unit = manager.block_pool.hash_block_size
    return SettledSteps(
        tuple(sizes), margin_tokens(config.num_speculative_tokens), None if unit in sizes else unit
    )


def margin_tokens(num_speculative_tokens: int) -> int:
    """Rule 2's margin (tests derive their counts from it)."""
    return 4 * (1 + num_speculative_tokens) + 16
