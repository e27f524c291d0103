"""Steady decodes: the engine's fast lane for requests whose steps are alike.

No twin in vLLM (its engine runs every request through every step the same
way); this is kvsim's second fast path, on top of the settled allocator
calls (``settled.py``). In a long or pool-bound decode most requests' steps
change nothing but token counts: the request decodes ``1 + K`` tokens
inside blocks whose allocator calls are settled, and the step cannot stop
it. Such a request is *steady*. The lane offers the scheduler its decode
(the ``ScheduledRequest`` the running loop would build) and the scheduler
takes it as it is where its running loop would schedule it unchanged
(``Scheduler.schedule(steady=...)``); the other requests, the waiting loop
and preemptions go the ordinary way. When the step's output arrives the
lane draws the same acceptances from the runner's stream, in the step's
order, and keeps each steady request's new tokens aside; a request takes
them (one append: the sampled ids are consecutive positions) when it
leaves the lane, is preempted, may stop, or the run ends.

A request is steady at a step's start when:

- the fast path is on and it decodes: it computed all its tokens but the
  last, with K drafts queued;
- even if it accepts every draft, the step's positions stay inside its
  settled allocation and caching windows (the calls the ordinary path would
  make are settled, so they are skipped anyway), and the ``max_model_len``
  clip leaves it ``1 + K`` tokens.

The scheduler checks the rest where it schedules: the token budget left
holds the ``1 + K`` tokens and no long-prefill threshold clips them. A
request the step's tokens may stop (its length limits within reach) takes
them the scheduler's way (``Scheduler.take_sampled``).

The argument is checked: every gate scenario gives identical frames with
the fast path off (``tests/test_fast_path.py``), the conformance driver
steps kvsim through this lane against vLLM's own ``Scheduler``, and
``tests/test_steady.py`` makes every call the lane skips and compares the
whole allocator state, each with a failing control.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

from sim.sched.model_runner import ModelRunner
from sim.sched.output import ScheduledRequest, SchedulerOutput, StepOutcome, StepTally
from sim.vllm_bridge import Request

if TYPE_CHECKING:
    from sim.sched.fast_path.kv_cache_manager import FastPathKVCacheManager
    from sim.sched.scheduler import Scheduler


@dataclass(frozen=True)
class SteadyItems:
    """The steady lane's offer for a step: a decode for each of its
    requests, made without the allocator; the scheduler fills ``taken`` with
    those its running loop schedules as they are, and calls ``hand_over`` on
    any other of them before it treats that request the ordinary way (the
    lane keeps their tokens aside)."""

    items: dict[str, ScheduledRequest]
    hand_over: Callable[[Request], None]
    taken: set[str] = field(default_factory=set)


# The async lane's offer for a kept request its decode stagger holds back
# this step: the running loop passes over it, as it would (``async_steady.py``).
SKIP = object()

# A step with no steady decodes (never mutated: with no items nothing is taken).
NO_STEADY = SteadyItems(items={}, hand_over=lambda request: None)


K = TypeVar("K")


@dataclass(slots=True)
class _Kept:
    """A request in the lane."""

    request: Request
    # Its computed tokens and tokens as the scheduler would have them.
    computed: int
    num_tokens: int
    # Its tokens when its ``Request`` last took them.
    handed_over: int
    # The most computed tokens it may have at a steady step's start.
    limit: int
    # The most computed tokens at a step's start with which the step cannot stop it.
    unstoppable: int


class SteadyLane(Generic[K]):
    """What both lanes share (this one, ``async_steady.py``'s): the
    requests kept aside, by id, each leaving the lane by taking back what
    it kept (``_hand_over``, the lane's own), and the audit of a taken
    decode's skipped allocation."""

    def __init__(self, scheduler: Scheduler, door: FastPathKVCacheManager) -> None:
        self.scheduler = scheduler
        self.door = door
        self.num_spec = scheduler.config.num_speculative_tokens
        self.step_tokens = 1 + self.num_spec
        self._kept: dict[str, K] = {}

    def flush(self) -> None:
        """Every request in the lane takes its state and leaves it."""
        for kept in list(self._kept.values()):
            self._leave(kept.request)  # type: ignore[attr-defined]

    def _leave(self, request: Request) -> None:
        """``request`` (in the lane) takes its state and leaves it."""
        self._hand_over(self._kept.pop(request.request_id))

    def _hand_over(self, kept: K) -> None:
        raise NotImplementedError

    def _decodes_next(self, request: Request) -> bool:
        """A lane's entry: exactly the last known token left to compute
        (placeholders count as known, async mode), the K drafts queued. (Not
        ``output.is_decoding``, which also holds with a decode's tokens
        still counted as computed.)"""
        known = request.num_tokens + request.num_output_placeholders
        return request.num_computed_tokens == known - 1 and len(request.spec_token_ids) == self.num_spec

    def _audit_allocation(self, request: Request) -> None:
        """Make the allocation a taken decode skipped (``audit``), its
        ``Request`` as the running loop sees it: it must allocate nothing."""
        blocks = self.door.wrapped.allocate_slots(
            request, self.step_tokens, num_lookahead_tokens=self.num_spec
        )
        assert blocks is not None and not any(blocks.blocks), (
            f"{request.request_id}: a steady decode allocates"
        )


class SteadyDecode(SteadyLane[_Kept]):
    def __init__(self, scheduler: Scheduler, door: FastPathKVCacheManager, model_runner: ModelRunner) -> None:
        super().__init__(scheduler, door)
        self.model_runner = model_runner
        # The requests whose decodes the scheduler took in the step in flight.
        self._taken: set[str] = set()

    @property
    def num_taken(self) -> int:
        """Steady decodes in the step in flight."""
        return len(self._taken)

    # ---------------------------------------------------------------- a step
    def schedule(self) -> SchedulerOutput:
        """The scheduler's step, offered the steady requests' decodes."""
        items: dict[str, ScheduledRequest] = {}
        kept_by_id, step_tokens, num_spec = self._kept, self.step_tokens, self.num_spec
        for request in self.scheduler.running:
            request_id = request.request_id
            kept = kept_by_id.get(request_id) or self._enter(request)
            if kept is None:
                continue
            if kept.computed > kept.limit:
                self._leave(request)
                continue
            items[request_id] = ScheduledRequest(request_id, step_tokens, kept.computed, num_spec, 0)
        if not items:
            self._taken = set()
            return self.scheduler.schedule()
        steady = SteadyItems(items=items, hand_over=self._leave)
        output = self.scheduler.schedule(steady)
        # Scheduled tokens count as computed until the step's output says
        # which drafts were rejected (as in ``Scheduler.schedule``).
        for request_id in steady.taken:
            kept_by_id[request_id].computed += step_tokens
        self._taken = steady.taken
        if self.door.audit and steady.taken:
            self._audit_allocations()
        return output

    def sample_and_apply(self, output: SchedulerOutput) -> StepOutcome:
        """The workers ran the step: its requests' outputs in the step's
        order, the steady ones kept aside, the others the scheduler's way.
        (One loop with the common case inline: it runs for every request of
        every step.)"""
        scheduler = self.scheduler
        scheduler.output_arrives(output)
        tally = StepTally()
        taken, kept_by_id = self._taken, self._kept
        if self.door.audit:
            taken = set(taken)  # the audit after the loop reads the step's
        num_spec, step_tokens = self.num_spec, self.step_tokens
        draw = self.model_runner.acceptance_draws(num_spec)
        num_kept = num_accepted_kept = 0  # the kept requests' share of the tally
        for item in output.scheduled:
            if item.request_id not in taken:
                request = scheduler.requests[item.request_id]
                sampled = self.model_runner.sample(item, request.num_tokens)
                scheduler.apply_sampled(item, sampled or [], tally)
                continue
            kept = kept_by_id[item.request_id]
            num_accepted = draw()
            num_kept += 1
            num_accepted_kept += num_accepted
            if kept.computed - step_tokens <= kept.unstoppable:
                kept.computed -= num_spec - num_accepted
                kept.num_tokens += num_accepted + 1
                tally.num_generated_tokens += num_accepted + 1
            else:
                self._take_at_once(kept.request, num_accepted, tally)
        if num_spec:
            tally.num_draft_tokens += num_kept * num_spec
            tally.num_accepted_tokens += num_accepted_kept
        if self.door.audit and self.scheduler.config.caches_after_sampling:
            self._audit_caching(taken)
        return tally.outcome()

    def _take_at_once(self, request: Request, num_accepted: int, tally: StepTally) -> None:
        """The step may stop ``request``: it leaves the lane and takes the
        step's tokens the scheduler's way."""
        self._leave(request)
        request.num_computed_tokens -= self.num_spec - num_accepted
        sampled = self.model_runner.sampled_token_ids(request.num_tokens, num_accepted + 1)
        appended, stopped = self.scheduler.take_sampled(request, sampled)
        tally.num_generated_tokens += appended
        if stopped:
            tally.finished[request.request_id] = request.num_output_tokens

    # ------------------------------------------------------- entry and exit
    def _hand_over(self, kept: _Kept) -> None:
        """The request takes its computed tokens as they stand and the
        tokens it sampled since it last took them."""
        request = kept.request
        request.num_computed_tokens = kept.computed
        new_tokens = kept.num_tokens - kept.handed_over
        if new_tokens:
            request.append_output_token_ids(self.model_runner.sampled_token_ids(kept.handed_over, new_tokens))
            kept.handed_over = kept.num_tokens

    def _enter(self, request: Request) -> _Kept | None:
        limit = self.limit(request)
        if limit is None:
            return None
        kept = _Kept(
            request=request,
            computed=request.num_computed_tokens,
            num_tokens=request.num_tokens,
            handed_over=request.num_tokens,
            limit=limit,
            unstoppable=self.unstoppable(request),
        )
        self._kept[request.request_id] = kept
        return kept

    def limit(self, request: Request) -> int | None:
        """The most computed tokens ``request`` may have at a steady step's
        start (fixed at entry: fast-path rule 6); None when it is not
        decoding or a call of its next step is real (its settled window
        starts after it). The arithmetic is the scheduler's: the span a
        decode allocates for, the room the ``max_model_len`` clip leaves."""
        computed, num_spec, step_tokens = request.num_computed_tokens, self.num_spec, self.step_tokens
        if not self._decodes_next(request):
            return None
        door = self.door
        span = self.door.decode_span(request, step_tokens + num_spec)
        bounds = door.allocations.bounds(request.request_id)
        if span is None or bounds is None or bounds[0] > span[0]:
            return None
        limit = bounds[1] - (span[1] - span[0])
        if num_spec and self.scheduler.config.caches_after_sampling:
            # then the step caches at computed + 1 .. computed + 1 + K
            bounds = door.caching.bounds(request.request_id)
            if bounds is None or bounds[0] > computed + 1:
                return None
            limit = min(limit, bounds[1] - step_tokens)
        # The clip leaves the step whole (the split leaves a decode's alone;
        # the scheduler checks the budget and threshold).
        limit = min(limit, computed + self.scheduler.clip_room(request) - step_tokens)
        return limit if computed <= limit else None

    def unstoppable(self, request: Request) -> int:
        """The most computed tokens at a step's start with which the step
        cannot stop ``request``: its ``1 + K`` tokens at most stay short of
        the scheduler's stop room (``Scheduler.stop_room``, measured here at
        entry, where its tokens are its computed tokens plus one)."""
        return request.num_computed_tokens + self.scheduler.stop_room(request) - self.step_tokens - 1

    # -------------------------------------------------------------- audit
    def _audit_allocations(self) -> None:
        """Make the allocation each taken decode skipped (``audit``)."""
        taken = [self._kept[request_id] for request_id in self._taken]
        self.door.check_unchanged(lambda: _each(self._audit_taken, taken), "steady allocation")
        self.door.audited.lane_steps += 1

    def _audit_taken(self, kept: _Kept) -> None:
        """As the running loop sees it: its tokens taken, the step's not yet
        counted as computed."""
        self._hand_over(kept)
        kept.request.num_computed_tokens -= self.step_tokens
        self._audit_allocation(kept.request)
        kept.request.num_computed_tokens += self.step_tokens

    def _audit_caching(self, taken: set[str]) -> None:
        """Make the caching each kept decode skipped (``audit``); one that
        took its tokens the scheduler's way has left the lane."""
        kept = [self._kept[request_id] for request_id in taken if request_id in self._kept]
        self.door.check_unchanged(lambda: _each(self._audit_cache, kept), "steady caching")

    def _audit_cache(self, kept: _Kept) -> None:
        self._hand_over(kept)
        self.door.wrapped.cache_blocks(kept.request, kept.computed)


def _each(call: Callable[[K], None], kept: list[K]) -> None:
    for one in kept:
        call(one)
