"""``FastPath`` (``Scheduler.fast_path``; ``NoFastPath`` when off): the memos
of the scheduler's own loops (idle waiting loops and refused admissions,
rules 4, 9, 12; idle pin passes, rule 11), and the steady lanes."""

from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from sim.sched.fast_path.async_steady import AsyncSteadyLane
from sim.sched.fast_path.kv_cache_manager import FastPathKVCacheManager
from sim.sched.fast_path.steady import SyncSteadyLane

if TYPE_CHECKING:
    from sim.sched.model_runner import ModelRunner
    from sim.sched.scheduler import Scheduler, _StepState
    from sim.vllm_bridge import Request

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class _Refusal:
    """A refused admission, and what rule 12 compares (``has_scheduled_reqs``: vLLM's watermark)."""

    request: object
    num_new: int
    has_scheduled_reqs: bool
    release_version: int
    num_free_blocks: int


@dataclass(frozen=True, slots=True)
class _IdleWaiting:
    """The inputs (latest last) of waiting loops that admitted nobody with
    one head and allocator version, and what rule 12 compares."""

    head: object
    inputs: tuple[tuple, ...]
    allocator_version: int
    release_version: int
    num_free_blocks: int
    head_missed: bool

    # Async scheduling's decode stagger alternates two budgets (rule 4).
    MAX_INPUTS = 4


class FastPath:
    """One scheduler's memos and lanes, beside its door."""

    def __init__(self, scheduler: Scheduler, door: FastPathKVCacheManager) -> None:
        self.scheduler = scheduler
        self.door = door
        self._idle_waiting: _IdleWaiting | None = None
        self._refusal: _Refusal | None = None
        self._pin_pass_version = 0
        # Off: only the scheduler's own skips (audited without the lane taking most).
        self.use_lane = True

    @property
    def audit(self) -> bool:
        return self.door.audit

    def make_lane(self, model_runner: ModelRunner) -> SyncSteadyLane | None:
        return SyncSteadyLane(self.scheduler, self.door, model_runner) if self.use_lane else None

    def make_async_lane(self) -> AsyncSteadyLane | None:
        return AsyncSteadyLane(self.scheduler, self.door) if self.use_lane else None  # type: ignore[arg-type]

    def waiting_request_changes(self) -> None:  # a stale output drained: every memo is void (rule 9)
        self.door.changes()

    def skips_waiting(self, step: _StepState) -> bool:
        known = self.waiting_known_idle(step.token_budget, step.running_scheduled, step.prefill_scheduled)
        if known and self.audit:
            self._audit_waiting(step)
        return known

    def waiting_loop(self, step: _StepState, admit: Callable[[_StepState], bool]) -> None:
        """``admit``: the loop, which says whether it admitted anyone. One that
        admitted nobody changed nothing; idle loops of other inputs are kept
        while the head and the allocator version stay (rule 4)."""
        self.door.last_lookup = None
        inputs = self._waiting_inputs(step.token_budget, step.running_scheduled, step.prefill_scheduled)
        admitted = admit(step)
        waiting, idle = self.scheduler.waiting, self._idle_waiting
        self._idle_waiting = None
        if admitted or not waiting:
            return
        head = waiting[0]
        kept: tuple[tuple, ...] = (inputs,)
        if idle is not None and idle.head is head and self._allocator_as_when(idle):
            kept = (*idle.inputs, inputs)[-_IdleWaiting.MAX_INPUTS :]
        door, last = self.door, self.door.last_lookup
        head_missed = last is not None and last[0] is head and last[1]
        versions = door.allocator_version, door.release_version
        self._idle_waiting = _IdleWaiting(head, kept, *versions, self._num_free_blocks(), head_missed)

    def waiting_known_idle(self, token_budget: int, running_scheduled: bool, prefill_scheduled: bool) -> bool:
        """Remembered idle with the same head and inputs, and the allocator
        as it was (rule 3, or rule 12)."""
        idle, waiting = self._idle_waiting, self.scheduler.waiting
        return (
            idle is not None
            and bool(waiting)
            and idle.head is waiting[0]
            and self._waiting_inputs(token_budget, running_scheduled, prefill_scheduled) in idle.inputs
            and self._allocator_as_when(idle)
        )

    def _allocator_as_when(self, idle: _IdleWaiting) -> bool:
        return idle.allocator_version == self.door.allocator_version or (
            idle.head_missed  # rule 12: the head is still refused
            and self._only_took_blocks_since(idle.release_version, idle.num_free_blocks)
            and self.door.finds_nothing(idle.head)  # type: ignore[arg-type]
        )

    def _only_took_blocks_since(self, release_version: int, num_free_blocks: int) -> bool:
        """Rule 12: only running requests' allocations and caching since, and no more free blocks."""
        return release_version == self.door.release_version and self._num_free_blocks() <= num_free_blocks

    def _num_free_blocks(self) -> int:  # what ``allocate_slots`` compares a need with
        return self.door.block_pool.get_num_free_blocks()

    def admission(self, request: Request, num_new: int, attempt: Callable[[], T]) -> T | None:
        """``attempt``: the allocation, then the fork's head guard; None where known refused (rule 12)."""
        if self.skips_refused_admission(request, num_new, attempt):
            return None
        allocated = attempt()
        if allocated is None:
            running, release = bool(self.scheduler.running), self.door.release_version
            self._refusal = _Refusal(request, num_new, running, release, self._num_free_blocks())
        return allocated

    def skips_refused_admission(self, request: Request, num_new: int, attempt: Callable[[], object]) -> bool:
        """Refused with the same tokens and scheduled requests, it finds
        nothing, and running requests only took blocks since (rule 12)."""
        refusal = self._refusal
        if (
            refusal is None
            or refusal.request is not request
            or refusal.num_new != num_new
            or refusal.has_scheduled_reqs != bool(self.scheduler.running)
            or not self.door.finds_nothing(request)
            or not self._only_took_blocks_since(refusal.release_version, refusal.num_free_blocks)
        ):
            return False
        if self.audit:
            admitted = self.door.check_unchanged(attempt, "refused admission")
            assert admitted is None, f"{request.request_id}: admitted"
        return True

    def _waiting_inputs(self, token_budget: int, running_scheduled: bool, prefill_scheduled: bool) -> tuple:
        """What the waiting loop reads besides its head and the allocator (rule 4)."""
        running, waiting = self.scheduler.running, self.scheduler.waiting
        return (token_budget, len(running), len(waiting), running_scheduled, prefill_scheduled)

    def skips_pin_pass(self, pinned_ids: tuple[str, ...]) -> bool:  # rule 11
        self._pin_pass_version = self.door.allocator_version
        known = self.door.missed_pin_lookups.knows_idle_pass(self.scheduler.waiting, pinned_ids)
        if known and self.audit:
            self._audit_pin_pass()
        return known

    def unchanged_waiters(self, pinned_ids: tuple[str, ...]) -> Container[int]:
        """The waiters (by ``id``) a pin pass passes over (rule 11)."""
        return self.door.missed_pin_lookups.idle_pass_entries(pinned_ids)

    def unchanged_waiter_passed_over(self, request: Request) -> None:
        if self.audit:
            pinned = self.door.wrapped.pin_waiting_hit(request)  # type: ignore[attr-defined]
            assert pinned == 0, f"{request.request_id}: a waiter passed over pins"
            self.door.audited["unchanged waiter"] += 1

    def waiter_admitted(self, request: Request) -> None:  # it may come back preempted (rule 11)
        self.door.missed_pin_lookups.waiter_admitted(request)

    def pin_pass_ends(self, pinned_ids: tuple[str, ...]) -> None:
        pinned = self.door.allocator_version != self._pin_pass_version  # iff it bumped the version
        self.door.missed_pin_lookups.pass_ends(self.scheduler.waiting, pinned_ids, pinned)

    def waiting_tokens_change(self) -> None:  # a stale output may land on a waiter (rule 11)
        self.door.missed_pin_lookups.waiter_tokens_change()

    def _audit_pin_pass(self) -> None:  # its skipped lookups are audited in turn
        scheduler = self.scheduler
        pins = scheduler.pins.pin_waiters  # type: ignore[union-attr]  # a SchedulerPins'
        self.door.check_unchanged(lambda: pins(scheduler._waiting_requests()), "pin pass")

    def _audit_waiting(self, step: _StepState) -> None:  # on a copy of the step's inputs
        probe = type(step)(token_budget=step.token_budget)
        probe.running_scheduled, probe.prefill_scheduled = step.running_scheduled, step.prefill_scheduled
        self.door.check_unchanged(lambda: self.scheduler._schedule_waiting(probe), "waiting loop")
        assert not probe.new_ids and not probe.resumed_ids, "a skipped waiting loop admits"


class NoFastPath:
    """Every call is made, nothing is remembered."""

    audit = False
    make_lane = make_async_lane = waiting_request_changes = waiter_admitted = staticmethod(lambda *args: None)
    unchanged_waiter_passed_over = pin_pass_ends = waiting_tokens_change = make_lane

    @staticmethod
    def admission(request: Request, num_new: int, attempt: Callable[[], T]) -> T | None:
        return attempt()

    @staticmethod
    def skips_waiting(step: _StepState) -> bool:
        return False

    @staticmethod
    def waiting_loop(step: _StepState, admit: Callable[[_StepState], bool]) -> None:
        admit(step)

    @staticmethod
    def skips_pin_pass(pinned_ids: tuple[str, ...]) -> bool:
        return False

    @staticmethod
    def unchanged_waiters(pinned_ids: tuple[str, ...]) -> Container[int]:
        return frozenset()


def fast_path_of(scheduler: Scheduler) -> FastPath | NoFastPath:
    """``scheduler``'s fast path: on where its manager is the door."""
    door = scheduler.kv_cache_manager
    return FastPath(scheduler, door) if isinstance(door, FastPathKVCacheManager) else NoFastPath()
