"""The fast path's memos of the scheduler's own loops, and its lanes.

``FastPath`` (held as ``Scheduler.fast_path``; ``NoFastPath`` when the
fast path is off) remembers waiting loops known to admit nobody, refused
admissions (rules 4, 9, 12) and pin passes known to pin nothing (rule 11),
and makes the steady lanes (rules 5-9). Its rules are the package's
docstring (``sim/sched/fast_path/__init__.py``); the calls into the
allocator are decided behind the door (``kv_cache_manager.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from sim.sched.fast_path.async_steady import AsyncSteadyDecode
from sim.sched.fast_path.kv_cache_manager import AuditCounts, FastPathKVCacheManager
from sim.sched.fast_path.steady import SteadyDecode

if TYPE_CHECKING:
    from sim.sched.model_runner import ModelRunner
    from sim.sched.scheduler import Scheduler, _StepState
    from sim.vllm_bridge import Request

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class _Refusal:
    """A refused admission (rule 12): the request, its tokens, whether any
    request was running (vLLM's watermark), and the release version and
    the pool's free blocks then."""

    request: object
    num_new: int
    has_scheduled_reqs: bool
    release_version: int
    num_free_blocks: int


@dataclass(frozen=True, slots=True)
class _IdleWaiting:
    """Waiting loops that admitted nobody with the same head and allocator
    version: their inputs (the latest last), the head and the version; for
    rule 12, the release version, the pool's free blocks and whether the
    last loop's lookup of the head found nothing in any group."""

    head: object
    inputs: tuple[tuple, ...]
    allocator_version: int
    release_version: int
    num_free_blocks: int
    head_missed: bool

    # Inputs kept per head and version. Async scheduling's decode stagger
    # alternates two budgets (each half of the running set leaves its own),
    # so one would be forgotten at every other micro-batch.
    MAX_INPUTS = 4


class FastPath:
    """The scheduler-level fast path of one scheduler (rules 4-12 above):
    the waiting-loop memo, the pin-pass memo and the lanes. The calls into
    the allocator are decided behind its door (``door``)."""

    enabled = True

    def __init__(self, scheduler: Scheduler, door: FastPathKVCacheManager) -> None:
        self.scheduler = scheduler
        self.door = door
        # Waiting requests whose stale output drained (rule 9): each voids
        # the remembered loops as an allocator change does.
        self._waiters_changed = 0
        self._idle_waiting: _IdleWaiting | None = None
        self._refusal: _Refusal | None = None
        self._pin_pass_version = 0
        # The steady lane on (off: only the scheduler's own skips, which the
        # lane would otherwise take most of; an audit of those turns it off).
        self.use_lane = True

    @property
    def audit(self) -> bool:
        """Make every skipped call anyway and assert it changed nothing."""
        return self.door.audit

    @audit.setter
    def audit(self, on: bool) -> None:
        self.door.audit = on

    @property
    def audited(self) -> AuditCounts:
        return self.door.audited

    @property
    def allocator_version(self) -> int:
        """The door's version (rule 3), voided too by a waiter's change."""
        return self.door.allocator_version + self._waiters_changed

    @property
    def release_version(self) -> int:
        return self.door.release_version + self._waiters_changed

    def make_lane(self, model_runner: ModelRunner) -> SteadyDecode | None:
        """The steady lane for an engine core (``EngineCore`` makes one)."""
        return SteadyDecode(self.scheduler, self.door, model_runner) if self.use_lane else None

    def make_async_lane(self) -> AsyncSteadyDecode | None:
        """The steady lane for a batch-queue engine core (async mode)."""
        scheduler = self.scheduler
        return AsyncSteadyDecode(scheduler, self.door) if self.use_lane else None  # type: ignore[arg-type]

    def waiting_request_changes(self) -> None:
        """A waiting request the waiting loop skipped may be admitted now
        (its stale output drained, rule 9): every remembered loop is void."""
        self._waiters_changed += 1

    # ------------------------------------------------ known-idle waiting
    def skips_waiting(self, step: _StepState) -> bool:
        """Whether the waiting loop is known to admit nobody."""
        known = self.waiting_known_idle(step.token_budget, step.running_scheduled, step.prefill_scheduled)
        if known and self.audit:
            self._audit_waiting(step)
        return known

    def waiting_loop(self, step: _StepState, admit: Callable[[_StepState], bool]) -> None:
        """Run the waiting loop (``admit``: it admits, and says whether it
        admitted anyone), remembering one that admitted nobody."""
        inputs = self.waiting_starts(step)
        self.waiting_ends(inputs, admit(step))

    def waiting_starts(self, step: _StepState) -> tuple:
        self.door.last_lookup = None
        return self._waiting_inputs(step.token_budget, step.running_scheduled, step.prefill_scheduled)

    def waiting_ends(self, inputs: tuple, admitted: bool) -> None:
        """A loop that admitted nobody changed nothing (a failed admission
        allocates nothing): with the same inputs, head and allocator state,
        it admits nobody again. Idle loops with other inputs are kept while
        the head and the allocator's version stay: the state each read is
        the same."""
        waiting, idle = self.scheduler.waiting, self._idle_waiting
        self._idle_waiting = None
        if admitted or not waiting:
            return
        head = waiting[0]
        kept: tuple[tuple, ...] = (inputs,)
        if idle is not None and idle.head is head and self._allocator_as_when(idle):
            kept = (*idle.inputs, inputs)[-_IdleWaiting.MAX_INPUTS :]
        last = self.door.last_lookup
        self._idle_waiting = _IdleWaiting(
            head,
            kept,
            self.allocator_version,
            self.release_version,
            self._num_free_blocks(),
            head_missed=last is not None and last[0] is head and last[1],
        )

    def waiting_known_idle(self, token_budget: int, running_scheduled: bool, prefill_scheduled: bool) -> bool:
        """Whether a waiting loop with these inputs is one remembered to
        have admitted nobody, with the same head, and the allocator's state
        the same (rule 3) or changed only as rule 12 allows."""
        idle, waiting = self._idle_waiting, self.scheduler.waiting
        return (
            idle is not None
            and bool(waiting)
            and idle.head is waiting[0]
            and self._waiting_inputs(token_budget, running_scheduled, prefill_scheduled) in idle.inputs
            and self._allocator_as_when(idle)
        )

    def _allocator_as_when(self, idle: _IdleWaiting) -> bool:
        """Whether the allocator refuses ``idle``'s head as it did then: no
        call since that may change it (rule 3), or only those rule 12 allows."""
        return idle.allocator_version == self.allocator_version or self._head_still_refused(idle)

    def _head_still_refused(self, idle: _IdleWaiting) -> bool:
        """Rule 12: the idle loops' head found nothing in any group, none of
        its hashes was inserted since (rule 10 remembers it), only running
        requests' allocations and caching changed the allocator since, and
        the pool has no more free blocks than then."""
        return (
            idle.head_missed
            and self._only_took_blocks_since(idle.release_version, idle.num_free_blocks)
            and self.door.finds_nothing(idle.head)  # type: ignore[arg-type]
        )

    def _only_took_blocks_since(self, release_version: int, num_free_blocks: int) -> bool:
        """Rule 12: since a state with these counts, only running requests'
        allocations and caching changed the allocator, and the pool has no
        more free blocks than then."""
        return release_version == self.release_version and self._num_free_blocks() <= num_free_blocks

    def _num_free_blocks(self) -> int:
        """The count ``allocate_slots`` compares a need with."""
        return self.door.block_pool.get_num_free_blocks()

    def admission(self, request: Request, num_new: int, attempt: Callable[[], T]) -> T | None:
        """The head's admission (``attempt``: the allocation, then the
        fork's head guard), or None where it is known refused (rule 12); a
        refused one is remembered."""
        if self.skips_refused_admission(request, num_new, attempt):
            return None
        allocated = attempt()
        if allocated is None:
            self.admission_refused(request, num_new)
        return allocated

    def skips_refused_admission(self, request: Request, num_new: int, attempt: Callable[[], object]) -> bool:
        """Whether admitting ``request`` with ``num_new`` tokens (``attempt``:
        the allocation, then the fork's head guard) is known to be refused
        (rule 12): it was with the same tokens and scheduled requests, it
        finds nothing, and since then running requests only took blocks."""
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
            assert self.door.check_unchanged(attempt, "refused admission") is None, (
                f"{request.request_id}: admitted"
            )
            self.audited.refused_admissions += 1
        return True

    def admission_refused(self, request: Request, num_new: int) -> None:
        """Admitting ``request`` with ``num_new`` tokens was refused."""
        self._refusal = _Refusal(
            request, num_new, bool(self.scheduler.running), self.release_version, self._num_free_blocks()
        )

    def _waiting_inputs(self, token_budget: int, running_scheduled: bool, prefill_scheduled: bool) -> tuple:
        """What the waiting loop reads besides its head and the allocator (rule 4)."""
        scheduler = self.scheduler
        return (
            token_budget,
            len(scheduler.running),
            len(scheduler.waiting),
            running_scheduled,
            prefill_scheduled,
        )

    # ------------------------------------------------------ idle pin passes
    def skips_pin_pass(self, pinned_ids: tuple[str, ...]) -> bool:
        """Whether the pin pass is known to pin nothing (rule 11);
        ``pinned_ids``: the pinned waiters now."""
        self._pin_pass_version = self.allocator_version
        if not self.door.missed_pin_lookups.knows_idle_pass(self.scheduler.waiting, pinned_ids):
            return False
        if self.audit:
            self._audit_pin_pass()
        return True

    def unchanged_waiters(self, pinned_ids: tuple[str, ...]) -> Container[int]:
        """The waiters (by ``id``) a pin pass may pass over (rule 11): those
        of the last pass, which pinned nothing, while the hash insertions,
        the waiters' tokens and the pinned waiters are the same."""
        return self.door.missed_pin_lookups.idle_pass_entries(pinned_ids)

    def unchanged_waiter_passed_over(self, request: Request) -> None:
        if self.audit:
            self._audit_unchanged_waiter(request)

    def waiter_admitted(self, request: Request) -> None:
        """A waiter was admitted (rule 11: it may come back preempted)."""
        self.door.missed_pin_lookups.waiter_admitted(request)

    def pin_pass_ends(self, pinned_ids: tuple[str, ...]) -> None:
        """A pin pass ended (it pinned something iff it bumped the version)."""
        pinned = self.allocator_version != self._pin_pass_version
        self.door.missed_pin_lookups.pass_ends(self.scheduler.waiting, pinned_ids, pinned)

    def waiting_tokens_change(self) -> None:
        """A waiting request may take tokens (a stale output lands, rule 11)."""
        self.door.missed_pin_lookups.waiter_tokens_change()

    # -------------------------------------------------------------- audit
    def _audit_unchanged_waiter(self, request: Request) -> None:
        """Make a passed-over waiter's pin call: it must pin nothing (it is
        pinned already, or finds no hit)."""
        pinned = self.door.wrapped.pin_waiting_hit(request)  # type: ignore[attr-defined]
        assert pinned == 0, f"{request.request_id}: a waiter passed over pins"
        self.audited.unchanged_waiters += 1

    def _audit_pin_pass(self) -> None:
        """Run the skipped pin pass (its skipped lookups audited in turn)."""
        scheduler = self.scheduler
        pins = scheduler.pins.pin_waiters  # type: ignore[union-attr]  # a SchedulerPins'
        self.door.check_unchanged(lambda: pins(scheduler._waiting_requests()), "pin pass")
        self.audited.pin_passes += 1

    def _audit_waiting(self, step: _StepState) -> None:
        """Run the skipped waiting loop on a copy of the step's inputs."""
        probe = type(step)(
            token_budget=step.token_budget,
            running_scheduled=step.running_scheduled,
            prefill_scheduled=step.prefill_scheduled,
        )
        self.door.check_unchanged(lambda: self.scheduler._schedule_waiting(probe), "waiting loop")
        assert not probe.new_ids and not probe.resumed_ids, "a skipped waiting loop admits"
        self.audited.waiting_loops += 1


class NoFastPath:
    """The fast path off: every call is made, nothing is remembered."""

    enabled = False
    audit = False

    def make_lane(self, model_runner: ModelRunner) -> SteadyDecode | None:
        return None

    def make_async_lane(self) -> AsyncSteadyDecode | None:
        return None

    def admission(self, request: Request, num_new: int, attempt: Callable[[], T]) -> T | None:
        return attempt()

    def waiting_request_changes(self) -> None:
        return None

    def skips_waiting(self, step: _StepState) -> bool:
        return False

    def waiting_loop(self, step: _StepState, admit: Callable[[_StepState], bool]) -> None:
        admit(step)

    def skips_pin_pass(self, pinned_ids: tuple[str, ...]) -> bool:
        return False

    def unchanged_waiters(self, pinned_ids: tuple[str, ...]) -> Container[int]:
        return frozenset()

    def unchanged_waiter_passed_over(self, request: Request) -> None:
        return None

    def waiter_admitted(self, request: Request) -> None:
        return None

    def pin_pass_ends(self, pinned_ids: tuple[str, ...]) -> None:
        return None

    def waiting_tokens_change(self) -> None:
        return None


def fast_path_of(scheduler: Scheduler) -> FastPath | NoFastPath:
    """``scheduler``'s fast path: on where its manager is the door."""
    door = scheduler.kv_cache_manager
    return FastPath(scheduler, door) if isinstance(door, FastPathKVCacheManager) else NoFastPath()
