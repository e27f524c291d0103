"""The fast path: the scheduler work kvsim skips because it changes nothing.

No twin in vLLM (its scheduler makes every call). Two objects: the
allocator's door (``FastPathKVCacheManager``, ``fast_path_manager.py``: the
scheduler's ``kv_cache_manager`` when ``simulation.fast_path`` is on), which
decides every call into the allocator, and ``FastPath`` (held as
``Scheduler.fast_path``; ``NoFastPath`` when off, so the scheduler never
branches on it), the memos of the scheduler's own loops and the lanes:

- **settled calls** (``settled.py``): a decoding request's ``allocate_slots``
  and ``cache_blocks`` between block boundaries change nothing; the first
  call in a block's window is made, the next are skipped;
- **the steady lane** (``steady.py``): a request whose decode steps are alike
  keeps its tokens aside and is scheduled as it is, past the running loop's
  arithmetic (``EngineCore`` makes it with ``make_lane``; in async mode
  ``BatchQueueEngineCore`` makes ``async_steady.py``'s with ``make_async_lane``);
- **known-idle waiting loops**: a waiting loop that admitted nobody admits
  nobody again while its inputs, its head and the allocator are unchanged
  (the allocator's version counts the calls that may change it), or, for
  a head that found no prefix hit, while running requests only took
  blocks;
- **missed pin lookups** (``missed_lookups.py``): a waiter whose lookup for
  the fork's waiter pins found no hit finds none again until a hash is
  cached or its tokens change.

The scheduler calls ``self.kv_cache_manager.…`` as vLLM's does; the door
skips a settled call, answers a lookup known to find nothing and counts
every call that may change the allocator. What stays at the scheduler's
level, each a call on ``Scheduler.fast_path``: the waiting-loop memo
(``skips_waiting`` / ``waiting_starts`` / ``waiting_ends``, a refused
admission, ``waiter_admitted``), the pin-pass memo (``skips_pin_pass`` /
``unchanged_waiters`` / ``pin_pass_ends``, ``pins.py``), a waiter's change
(``waiting_tokens_change`` / ``waiting_request_changes``, async mode) and
the lanes (``make_lane`` / ``make_async_lane``, the engine cores).

``audit = True`` makes every skipped call anyway and asserts it changed
nothing (the whole allocator state compared, ``allocator_snapshot``), and
counts them in ``audited``: the tests' proof, through a public switch.

The rules the fast path rests on, each with the test that goes red when it
is broken:

1. A call whose positions, widened by the margin, lie strictly inside one
   block of every size the allocator divides by, after a real call in the
   same block, changes nothing (``settled.py``). The hash unit is such a
   size only where the widened span reaches into the prompt: past it a
   call reads the unit only through the count of block hashes, floored to
   a block, and through the prompt's own boundaries (argued: the calls
   the scheduler makes inside a prompt are prefill chunks, never skipped,
   so no trace has shown the unit to matter there; kept as the safe side).
   ``tests/test_fast_path.py::test_the_hash_unit_bounds_a_window_only_inside_the_prompt``
   (the arithmetic); the rig's block flags among the audited cases
   (``tests/helpers/fast_path.py``) for the decodes past the prompt.
   ``tests/test_fast_path.py::test_the_check_catches_a_call_skipped_across_a_boundary``,
   ``::test_a_fast_path_that_skips_across_boundaries_changes_the_frames``.
2. The margin, ``4 * (1 + K) + 16`` tokens (``margin_tokens``), lies well
   past every offset a call adds to the positions it is taken to read (the
   ``K`` lookahead slots, the ``K`` tokens an EAGLE drop or a lookahead hash
   reaches, the ``1 + K`` of a rejected step's rollback): argued, with room
   to spare, not derived to the token; the audit checks it.
   ``tests/test_fast_path.py::test_the_calls_skipped_across_a_block_boundary``
   (the hand count moves with it).
3. Every call that may change the allocator bumps the version: structural,
   the door is the scheduler's only way to the allocator and bumps it for
   each (frees, fenced frees, a copy-on-write's release, an admission, pins
   and yields that change something; a running request's allocation and
   caching move ``allocator_version`` alone, rule 12). ``new_step_starts``
   (clears a per-step set of cached ids) and ``get_computed_blocks`` (a
   lookup: it touches nothing) do not. A new call into the allocator is a
   method of the door, or passes through it unseen: check it here.
   ``tests/test_steady.py::test_the_waiting_memo_holds_only_for_the_same_inputs_and_allocator``.
4. ``_waiting_inputs`` lists everything the waiting loop reads besides its
   head and the allocator: the budget left, the running and waiting counts,
   whether a running request or a prefill was scheduled. A read added to
   ``Scheduler._admit_waiting`` or ``_pads_to_uniform_decode`` must be
   added there. The memo keeps up to ``MAX_INPUTS`` idle loops' inputs
   while the head and the allocator's version stay (async scheduling's
   stagger alternates two budgets): each was idle on the same state.
   ``tests/test_steady.py::test_the_waiting_memo_keeps_idle_loops_of_other_inputs_while_the_allocator_stays``.
   ``tests/test_steady.py::test_the_check_catches_a_waiting_loop_wrongly_skipped``,
   ``::test_a_lane_skipping_every_waiting_loop_changes_the_frames``.
5. A request in the lane has a stale ``Request`` (computed tokens, output
   tokens): read ``Scheduler.requests`` / ``running`` only after
   ``EngineCore.flush``. ``LiveEngine`` (``kvsim serve``) builds its
   ``EngineCore`` with ``steady_lane=False``, so it may read (and abort)
   requests every step.
   ``tests/test_steady.py::test_without_the_hand_over_at_the_horizon_requests_lag``.
6. A kept request's ``limit`` and ``unstoppable`` are computed once, when it
   enters the lane: valid because its settled windows cannot move while its
   calls are skipped (they move only on a real call or a free, and a free
   hands the request back first).
   ``tests/test_steady.py::test_the_check_catches_a_steady_step_across_a_boundary``,
   ``::test_a_lane_that_never_stops_a_request_changes_the_frames``.
7. The lane draws acceptances from the runner's stream in exactly
   ``ModelRunner.execute``'s order (the step's order, one draw per request).
   ``tests/test_steady.py::test_the_conformance_driver_compares_the_lanes_steps``,
   ``::test_a_runners_acceptance_draws_are_its_per_request_draws``.
8. Every step's output passes ``Scheduler.output_arrives`` before any of its
   requests' outputs is applied, the lane's steps too (the fences pass
   first; the pool replay's observer relies on it).
   ``tests/test_fast_path.py::test_every_gate_scenario_gives_the_same_frames_with_and_without_the_fast_path``.

9. In async mode (``AsyncScheduler``; the lane is ``async_steady.py``) a decode's
   ``allocate_slots`` reads back to its processed tokens, behind the
   tokens in flight (vLLM frees skipped blocks there), so its window spans
   from them (``FastPathKVCacheManager.decode_span``); its ``cache_blocks`` calls are at
   the processed tokens. A preempted request's stale output draining
   changes what the waiting loop reads without an allocator call: it voids
   the memo (``waiting_request_changes``). The async lane keeps a decode's
   in-flight tokens, placeholders and stagger; its window is the same span.
   ``tests/test_fast_path.py::test_the_check_catches_an_async_window_blind_to_the_tokens_in_flight``,
   ``tests/test_async_steady.py::test_the_check_catches_an_async_lane_blind_to_the_tokens_in_flight``,
   ``::test_a_lane_that_ignores_the_stagger_fails_the_conformance_gate``.
10. A waiter's pin lookup (``get_computed_blocks``, pin point 3) that found
   no hit finds none again while no (hash, block) pair with one of its own
   block hashes was inserted into the pool's cached-hash map
   (``BlockPool._insert_block_hash``, counted when the map lacked the
   pair: a call for a pair it holds inserts nothing, and a decode's
   caching makes one every step) and the
   request has the same tokens and block hashes: a lookup reads nothing
   else that moves, and removing cached hashes (evictions, a reset) only
   shrinks a hit. The allocator version would be safe too, but it moves
   with every allocation; a hash is inserted only as a block (or, with
   partial hits, a unit) is cached. The audit makes each skipped lookup.
   ``tests/test_fast_path.py::test_the_check_catches_a_pin_lookup_memo_blind_to_new_hashes``,
   ``::test_a_pin_lookup_memo_blind_to_new_hashes_changes_the_frames``,
   ``::test_a_waiter_with_no_hit_is_looked_up_again_once_a_hash_is_cached_or_its_tokens_grow``.
11. A pin pass that pinned nothing pins nothing again, and is skipped
   whole, while no hash was inserted, the waiting queue holds the same
   entries (by identity) in the same order, no waiting request took tokens
   (``waiting_tokens_change``: a stale output lands, async mode) and the
   same waiters are pinned: each waiter meets it as before (pinned, past
   the bound, or known to find no hit, rule 10). A waiter's computed tokens
   and status change only as it enters or leaves the queue.
   When only the queue changed (an arrival, an admission), a pass passes
   over the waiters of the last idle pass and examines only the others
   (by identity; the audit makes each passed-over waiter's pin call and
   asserts it pins nothing). The scheduler's queue (``queues.WaitingQueue``)
   counts every call of ``deque`` that may put an entry in it: with none
   since the idle pass (no call, or only removals: admissions pop the head),
   every waiter left met the idle pass, without reading its entries, so
   with none forgotten the pass would pass over all of them and is skipped
   whole.
   With hashes inserted since, a pass still passes over the idle pass's
   waiters if that pass met only waiters rule 10 remembers (each reported
   otherwise by the doors ``pin_waiting_hit``): an insertion changes such a
   waiter only by forgetting it, and the forgotten ones are examined. An
   admitted waiter is examined again too (``waiter_admitted``: preempted,
   it comes back as the same object with more tokens).
   ``tests/test_fast_path.py::test_a_pin_pass_is_known_idle_only_with_the_same_queue_pins_hashes_and_tokens``,
   ``tests/test_values_fast_path.py::test_a_pass_after_an_idle_one_examines_only_the_waiters_it_did_not_meet``,
   ``::test_the_waiting_queue_counts_every_call_of_deque_that_may_insert``,
   ``::test_after_insertions_a_pass_passes_over_the_remembered_waiters_not_forgotten``,
   ``::test_a_pin_call_that_pins_nothing_and_finds_a_hit_is_not_remembered``,
   ``::test_the_scheduler_reports_each_admitted_waiter_to_rule_11``,
   ``::test_a_queue_only_taken_from_since_an_idle_pass_is_known_idle``.
12. A waiting loop that admitted nobody, whose lookup of its head found
   nothing in any group (no token, no block, no shared-prefix boundary),
   admits nobody again with the same head and inputs while the only calls
   since were running requests' allocations and caching
   (the door moves ``allocator_version`` alone for them; every other change bumps the release
   version too: frees, fenced frees, admissions, pins, preemptions, a
   waiter's stale output), none of the head's hashes was inserted (rule
   10's memo of the head is still the one it had at that lookup: a pin
   lookup remembers a forgotten head anew on no tokens hit, though a
   group's blocks may be found) and the pool has no more free blocks.
   Argued: with no hit, what ``allocate_slots`` counts for a waiting
   request reads only the request (it holds no blocks), the flags, and
   the packed rings' free slots (claimed at admission, released at a
   free); it refuses when that need exceeds the free blocks, which have
   not grown; the fork's head guard (0097) compares a shortfall that has
   only grown with pins that have not changed. The hit stays empty: each
   group's hit, and the boundary (one group's longer hit), grow only with
   the head's own hashes inserted. A running request's allocation may
   free its own skipped blocks: the free count catches that.
   ``tests/test_steady.py::test_a_head_that_found_nothing_stays_refused_while_running_requests_only_take_blocks``,
   ``::test_a_head_whose_own_hash_is_inserted_is_looked_up_again``,
   ``::test_a_head_forgotten_then_remembered_again_by_a_pin_lookup_is_looked_up_again``,
   ``::test_a_lookup_found_nothing_only_with_no_block_no_token_and_no_boundary``,
   ``::test_the_check_catches_a_head_taken_as_refused_after_blocks_came_free``.

Every rule is also checked whole, in both engine modes: every gate scenario's frames are the same
with the fast path off, and the conformance driver steps the lane against
vLLM's own ``Scheduler``. Glossary: ``docs/fast-path.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sim.sched.async_steady import AsyncSteadyDecode
from sim.sched.fast_path_manager import AuditCounts, FastPathKVCacheManager
from sim.sched.steady import SKIP, SteadyDecode

if TYPE_CHECKING:
    from sim.kv_cache_manager import KVCacheManager
    from sim.sched.model_runner import ModelRunner
    from sim.sched.scheduler import Scheduler, SchedulerConfig, _StepState
    from sim.vllm_bridge import Request


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
        head, kept = waiting[0], (inputs,)
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
            assert self.door._audit(attempt, "refused admission") is None, f"{request.request_id}: admitted"
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
        self.door._audit(lambda: pins(scheduler._waiting_requests()), "pin pass")
        self.audited.pin_passes += 1

    def _audit_waiting(self, step: _StepState) -> None:
        """Run the skipped waiting loop on a copy of the step's inputs."""
        probe = type(step)(
            token_budget=step.token_budget,
            running_scheduled=step.running_scheduled,
            prefill_scheduled=step.prefill_scheduled,
        )
        self.door._audit(lambda: self.scheduler._schedule_waiting(probe), "waiting loop")
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

    def skips_refused_admission(self, request: Request, num_new: int, attempt: Callable[[], object]) -> bool:
        return False

    def admission_refused(self, request: Request, num_new: int) -> None:
        return None

    def waiting_request_changes(self) -> None:
        return None

    def skips_waiting(self, step: _StepState) -> bool:
        return False

    def waiting_starts(self, step: _StepState) -> tuple:
        return ()

    def waiting_ends(self, inputs: tuple, admitted: bool) -> None:
        return None

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


class FastPathScheduling:
    """The scheduler's side of the fast path (a base of ``Scheduler``,
    ``scheduler.py``, holding no state of its own): the running loop's
    steady-lane share of a step."""

    config: SchedulerConfig
    running: list[Request]
    kv_cache_manager: KVCacheManager
    fast_path: FastPath | NoFastPath

    if TYPE_CHECKING:

        def _long_prefill_threshold(self) -> int: ...

    def _take_steady(self, index: int, step: _StepState) -> int:
        """Schedule the lane's decodes for the running requests from
        ``index`` on, each as it is, while the running loop would: the
        budget holds it whole and no long-prefill threshold clips it (its
        allocation is settled and the clip to ``max_model_len`` leaves it
        whole: the lane's part). Stops at the first request the lane did not
        offer, or hands that one back for the ordinary path (also when no
        budget is left: the running loop then stops, and an offered request
        the ordinary path could reach is always handed back first). Returns
        the index of the first request not taken. (A run at a time: it runs
        for every request of every step.)"""
        steady = step.steady
        running, items, scheduled, taken = self.running, steady.items, step.scheduled, steady.taken
        # The running loop preempts nobody here, so the threshold holds throughout.
        threshold = self.config.long_prefill_token_threshold and self._long_prefill_threshold()
        num_running = len(running)  # the loop takes requests, it never removes one
        while index < num_running:
            request_id = running[index].request_id
            item = items.get(request_id)
            if item is None:
                break
            if item is SKIP:  # async: its stagger holds it back, as the running loop's skip would
                index += 1
                continue
            num_new = item.num_scheduled_tokens
            if step.token_budget < num_new or 0 < threshold < num_new:
                steady.hand_over(running[index])
                break
            scheduled[request_id] = item
            taken.add(request_id)
            step.token_budget -= num_new
            step.running_scheduled = True
            index += 1
        return index
