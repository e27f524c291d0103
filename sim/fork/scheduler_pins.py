"""The scheduler side of the fork's prefix-hit pins (patches 0095, 0096,
0097 of ``halt95/qwen38-flash-next-3090s``; the manager side is
``pins.py``). No twin in vLLM 0.33.0.

The scheduler enters here at three named points, each a call on
``Scheduler.pins`` (a ``NoPins`` when the manager pins nothing, so the
scheduler never branches on it and ``fork: upstream`` is vLLM's scheduler):

1. ``yield_for_running``: a running request failed to allocate; one pin
   yields and the allocation is retried before any victim is chosen
   (0095), so a pin never causes a preemption.
2. ``admit_head``: the head waiter failed to allocate. 0095/0096: the
   other waiters' pins yield and the allocation is retried once. With
   0097: the head pins its own hit first (its pin takes the proof block
   past the hit out of the free queue, so the shortfall is measured again),
   then, only while everything yieldable covers its shortfall, gives back
   its own pinned blocks outside the hit and yields one pin at a time.
3. ``pin_waiting``: the end of each ``schedule()`` that scheduled the
   waiting queue (no preemption): the waiters' hits are pinned in arrival
   order, skipping requests that computed anything or are neither WAITING
   nor PREEMPTED, up to the manager's bound. The fast path skips a lookup
   known to find no hit, and a pass known to pin nothing (its rules 10, 11).

Every call made here goes through the scheduler's ``kv_cache_manager``:
with the fast path on, its door (``fast_path/kv_cache_manager.py``) counts each pin
or yield that changes the allocator (rule 3) and answers a lookup known to
find no hit (rule 10).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterator
from typing import TYPE_CHECKING

from sim.fork.frees import KVCacheManager
from sim.fork.pins import PinningKVCacheManager
from sim.sched.fast_path.kv_cache_manager import unwrapped
from sim.vllm_bridge import KVCacheBlocks, Request, RequestStatus

if TYPE_CHECKING:
    from sim.sched.fast_path.memos import FastPath, NoFastPath

Allocate = Callable[[], "KVCacheBlocks | None"]
Waiters = Callable[[Container[int]], Iterator[Request]]
_PINNABLE_STATUSES = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class NoPins:
    """Upstream: no pins, nothing to yield."""

    def yield_for_running(self) -> bool:
        return False

    def admit_head(self, request: Request, hit: KVCacheBlocks, retry: Allocate) -> KVCacheBlocks | None:
        return None

    def pin_waiting(self, waiting: Waiters) -> None:
        return None


class SchedulerPins:
    """The pin points of one scheduler over a ``PinningKVCacheManager``."""

    def __init__(self, manager: PinningKVCacheManager, fast_path: FastPath | NoFastPath) -> None:
        self.manager = manager
        self.fast_path = fast_path

    def yield_for_running(self) -> bool:
        return bool(self.manager.yield_pinned_hits(limit=1))

    def admit_head(self, request: Request, hit: KVCacheBlocks, retry: Allocate) -> KVCacheBlocks | None:
        """A second chance for the head waiter whose allocation failed
        (``retry`` repeats that allocation); None: it still waits."""
        if not self.manager.guards_head_yields:
            # 0095/0096: the pins of the waiters behind it yield; one retry.
            if self.manager.yield_pinned_hits(keep=request.request_id):
                return retry()
            return None
        return self._admit_head_guarded(request, hit.blocks, retry)

    def _admit_head_guarded(self, request: Request, hit: tuple, retry: Allocate) -> KVCacheBlocks | None:
        """0097's rule; ``hit`` is the lookup's blocks per group."""
        manager, request_id = self.manager, request.request_id
        if manager.last_alloc_shortfall <= 0 or not (manager.num_grace_pins or manager.num_pinned_waiters):
            return None
        allocated = None
        if request.num_computed_tokens == 0 and manager.pin_waiting_hit(request):
            allocated = retry()  # the shortfall on the pinned state
        if allocated is not None or not self._covered(request_id, hit):
            return allocated
        if manager.release_pinned_extras(request_id, hit):
            allocated = retry()  # its own proof block first: it costs nobody anything
        # Coverage is read again before every yield: a retry can fail by more.
        while (
            allocated is None
            and self._covered(request_id, hit)
            and manager.yield_pinned_hits(keep=request_id, limit=1)
        ):
            allocated = retry()
        return allocated

    def _covered(self, request_id: str, hit: tuple) -> bool:
        manager = self.manager
        return manager.last_alloc_shortfall <= manager.num_yieldable_blocks(keep=request_id, keep_hit=hit)

    def pin_waiting(self, waiting: Waiters) -> None:
        """Pin the waiters' hits in arrival order up to the manager's bound,
        unless the fast path knows the pass pins nothing (its rule 11).
        ``waiting(skip)``: the waiting queue in order, less the entries
        (by ``id``) in ``skip``."""
        manager = self.manager
        pinned_ids = manager.pinned_waiter_ids()
        if not manager.enable_waiter_pins or self.fast_path.skips_pin_pass(pinned_ids):
            return
        unchanged = self.fast_path.unchanged_waiters(pinned_ids)
        # The waiters the fast path knows unchanged are not even walked, but
        # under its audit each is met and checked to pin nothing.
        self.pin_waiters(waiting(frozenset() if self.fast_path.audit else unchanged), unchanged)
        self.fast_path.pin_pass_ends(manager.pinned_waiter_ids())

    def pin_waiters(self, waiting: Iterator[Request], unchanged: Container[int] = frozenset()) -> None:
        """The pass itself. ``unchanged``: the waiters (by ``id``) the fast
        path knows meet this pass as they met the last, which pinned nothing
        (its rule 11): passed over."""
        manager = self.manager
        for request in waiting:
            if manager.num_pinned_waiters >= manager.max_pinned_waiters:
                return
            if request.num_computed_tokens == 0 and request.status in _PINNABLE_STATUSES:
                if id(request) in unchanged:
                    self.fast_path.unchanged_waiter_passed_over(request)
                else:
                    manager.pin_waiting_hit(request)


def scheduler_pins(manager: KVCacheManager, fast_path: FastPath | NoFastPath) -> NoPins | SchedulerPins:
    """``manager``: the scheduler's (behind the fast path's door, if on)."""
    if isinstance(unwrapped(manager), PinningKVCacheManager):
        return SchedulerPins(manager, fast_path)  # type: ignore[arg-type]  # its door passes every call on
    return NoPins()
