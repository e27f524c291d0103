"""The steady lane: requests whose decode steps change nothing but token
counts (rules 5-8). A request is steady when it decodes with K drafts queued
and its next step's calls lie in its settled windows, with ``1 + K`` tokens
left by the ``max_model_len`` clip. The lane offers the scheduler its decode
(``LaneOffer``), draws the runner's acceptances in the step's order, and
keeps the tokens aside until the request leaves (``hand over``)."""

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
class LaneOffer:
    """A step's decodes, made without the allocator: the scheduler fills
    ``taken`` with those it schedules as they are, and calls ``hand_over``
    on any other before it treats that request the ordinary way."""

    items: dict[str, ScheduledRequest]
    hand_over: Callable[[Request], None]
    taken: set[str] = field(default_factory=set)


# The async lane's offer for a kept request its decode stagger holds back:
# the running loop passes over it, as it would.
SKIP = object()

# A step with nothing offered (never mutated: with no items nothing is taken).
NO_OFFER = LaneOffer(items={}, hand_over=lambda request: None)


K = TypeVar("K")


@dataclass(slots=True)
class _Kept:
    """A request in the lane: its counts as the scheduler would have them,
    its tokens when its ``Request`` last took them, and (rule 6) ``limit``
    and ``unstoppable``."""

    request: Request
    computed: int
    num_tokens: int
    handed_over: int
    limit: int
    unstoppable: int


class SteadyLane(Generic[K]):
    """The requests kept aside, by id, each leaving by taking back what it
    kept (``_hand_over``)."""

    def __init__(self, scheduler: Scheduler, door: FastPathKVCacheManager) -> None:
        self.scheduler = scheduler
        self.door = door
        self.num_spec = scheduler.config.num_speculative_tokens
        self.step_tokens = 1 + self.num_spec
        self._kept: dict[str, K] = {}

    def flush(self) -> None:
        for kept in list(self._kept.values()):
            self._leave(kept.request)  # type: ignore[attr-defined]

    def _leave(self, request: Request) -> None:
        self._hand_over(self._kept.pop(request.request_id))

    def _hand_over(self, kept: K) -> None:
        raise NotImplementedError

    def _decodes_next(self, request: Request) -> bool:
        """The last known token left to compute, K drafts queued. (Not
        ``output.is_decoding``: that holds with a decode's tokens counted.)"""
        known = request.num_tokens + request.num_output_placeholders
        return request.num_computed_tokens == known - 1 and len(request.spec_token_ids) == self.num_spec

    def _audit_allocation(self, request: Request) -> None:
        blocks = self.door.wrapped.allocate_slots(
            request, self.step_tokens, num_lookahead_tokens=self.num_spec
        )
        assert blocks is not None and not any(blocks.blocks), (
            f"{request.request_id}: a steady decode allocates"
        )

    def _audit_each(self, call: Callable[[K], None], kept: list[K], what: str) -> None:
        self.door.check_unchanged(lambda: [call(one) for one in kept], what)


class SyncSteadyLane(SteadyLane[_Kept]):
    """``EngineCore``'s (sync mode)."""

    def __init__(self, scheduler: Scheduler, door: FastPathKVCacheManager, model_runner: ModelRunner) -> None:
        super().__init__(scheduler, door)
        self.model_runner = model_runner
        self._taken: set[str] = set()  # by the step in flight

    @property
    def num_taken(self) -> int:
        return len(self._taken)

    def schedule(self) -> SchedulerOutput:
        """The scheduler's step, offered the kept requests' decodes."""
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
        offer = LaneOffer(items=items, hand_over=self._leave)
        output = self.scheduler.schedule(offer)
        # Scheduled tokens count as computed until the output says which
        # drafts were rejected (as in ``Scheduler.schedule``).
        for request_id in offer.taken:
            kept_by_id[request_id].computed += step_tokens
        self._taken = offer.taken
        if self.door.audit and offer.taken:
            self._audit_each(self._audit_taken, [kept_by_id[i] for i in offer.taken], "steady allocation")
            self.door.audited["lane step"] += 1
        return output

    def sample_and_apply(self, output: SchedulerOutput) -> StepOutcome:
        """The kept requests' tokens aside, the others the scheduler's way.
        (The common case inline: it runs for every request of every step.)"""
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
            # One that took its tokens the scheduler's way has left the lane.
            kept_now = [kept_by_id[i] for i in taken if i in kept_by_id]
            self._audit_each(self._audit_cache, kept_now, "steady caching")
        return tally.outcome()

    def _take_at_once(self, request: Request, num_accepted: int, tally: StepTally) -> None:
        """The step may stop ``request``: it leaves, taking them the scheduler's way."""
        self._leave(request)
        request.num_computed_tokens -= self.num_spec - num_accepted
        sampled = self.model_runner.sampled_token_ids(request.num_tokens, num_accepted + 1)
        appended, stopped = self.scheduler.take_sampled(request, sampled)
        tally.num_generated_tokens += appended
        if stopped:
            tally.finished[request.request_id] = request.num_output_tokens

    def _hand_over(self, kept: _Kept) -> None:
        """Its computed tokens, and the tokens sampled since it last took them."""
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
        num_tokens = request.num_tokens
        kept = _Kept(
            request, request.num_computed_tokens, num_tokens, num_tokens, limit, self.unstoppable(request)
        )
        self._kept[request.request_id] = kept
        return kept

    def limit(self, request: Request) -> int | None:
        """The most computed tokens at a steady step's start (rule 6); None
        when it is not decoding next or a call of its next step is real."""
        computed, num_spec, step_tokens = request.num_computed_tokens, self.num_spec, self.step_tokens
        if not self._decodes_next(request):
            return None
        door = self.door
        span = door.decode_span(request, step_tokens + num_spec)
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
        # The clip leaves the step whole (the scheduler checks the budget and threshold).
        limit = min(limit, computed + self.scheduler.clip_room(request) - step_tokens)
        return limit if computed <= limit else None

    def unstoppable(self, request: Request) -> int:
        """The most computed tokens at a step's start with which its
        ``1 + K`` tokens stay short of ``Scheduler.stop_room`` (rule 6)."""
        return request.num_computed_tokens + self.scheduler.stop_room(request) - self.step_tokens - 1

    def _audit_taken(self, kept: _Kept) -> None:
        """As the running loop sees it: the step's tokens not yet computed."""
        self._hand_over(kept)
        kept.request.num_computed_tokens -= self.step_tokens
        self._audit_allocation(kept.request)
        kept.request.num_computed_tokens += self.step_tokens

    def _audit_cache(self, kept: _Kept) -> None:
        self._hand_over(kept)
        self.door.wrapped.cache_blocks(kept.request, kept.computed)
