"""The steady lane: requests whose decode steps change nothing but token
counts (rules 5-8, argued in ``docs/fast-path.md``). The lane offers the
scheduler their decodes (``LaneOffer``), draws the runner's acceptances in
the step's order, and keeps the tokens aside until the request leaves."""

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


SKIP = object()  # the async lane's offer for a request its stagger holds back: passed over
NO_OFFER = LaneOffer(items={}, hand_over=lambda request: None)  # never mutated: nothing is taken

K = TypeVar("K")


@dataclass(slots=True)
class _Kept:
    """Its counts as the scheduler would have them, and (rule 6) ``limit`` and ``unstoppable``."""

    request: Request
    computed: int
    num_tokens: int
    handed_over: int  # its tokens when its ``Request`` last took them
    limit: int
    unstoppable: int


class SteadyLane(Generic[K]):
    """The requests kept aside, by id, each leaving by ``_hand_over`` (each lane's)."""

    _hand_over: Callable[[K], None]  # the request takes back what it kept

    def __init__(self, scheduler: Scheduler, door: FastPathKVCacheManager) -> None:
        self.scheduler = scheduler
        self.door = door
        self.num_spec = scheduler.config.num_speculative_tokens
        self.step_tokens = 1 + self.num_spec
        self._kept: dict[str, K] = {}
        self._taken: set[str] = set()  # by the last schedule

    @property
    def num_taken(self) -> int:
        return len(self._taken)

    def flush(self) -> None:
        for kept in list(self._kept.values()):
            self._leave(kept.request)  # type: ignore[attr-defined]

    def _leave(self, request: Request) -> None:
        self._hand_over(self._kept.pop(request.request_id))

    def _offer(self, items: dict[str, ScheduledRequest | object]) -> SchedulerOutput:
        """The scheduler's step, offered ``items``; ``_taken``: those it took."""
        if not items:
            self._taken = set()
            return self.scheduler.schedule()
        offer = LaneOffer(items=items, hand_over=self._leave)  # type: ignore[arg-type]
        output = self.scheduler.schedule(offer)
        self._taken = offer.taken
        if self.door.audit and offer.taken:
            self._audit_each(self._audit_taken, [self._kept[i] for i in offer.taken], "steady allocation")
            self.door.audited["lane step"] += 1
        return output

    def _decodes_next(self, request: Request) -> bool:
        """The last known token left to compute, K drafts queued. (Not
        ``output.is_decoding``: that holds with a decode's tokens counted.)"""
        known = request.num_tokens + request.num_output_placeholders
        return request.num_computed_tokens == known - 1 and len(request.spec_token_ids) == self.num_spec

    def _allocation_limit(self, request: Request) -> int | None:
        """``limit`` as the allocation window (spanning the processed tokens to
        ``1 + 2K`` past the computed) and the ``max_model_len`` clip allow it."""
        computed, door = request.num_computed_tokens, self.door
        span = door.decode_span(request, self.step_tokens + self.num_spec)
        allocation = door.allocations.bounds(request.request_id)
        if span is None or allocation is None or allocation[0] > span[0]:
            return None
        # The clip leaves the step whole (the scheduler checks the budget and threshold).
        clip = computed + self.scheduler.clip_room(request) - self.step_tokens
        limit = min(allocation[1] - (span[1] - computed), clip)
        return limit if computed <= limit else None

    def _audit_each(self, call: Callable[[K], None], kept: list[K], what: str) -> None:
        self.door.check_unchanged(lambda: [call(one) for one in kept], what)

    def _audit_taken(self, kept: K) -> None:
        """The running loop's allocation for a taken decode, from the step's start."""
        self._hand_over(kept)
        request, num_spec = kept.request, self.num_spec  # type: ignore[attr-defined]
        blocks = self.door.wrapped.allocate_slots(request, self.step_tokens, num_lookahead_tokens=num_spec)
        allocated = blocks is None or any(blocks.blocks)
        assert not allocated, f"{request.request_id}: a steady decode allocates"

    def _audit_cache(self, kept: K) -> None:
        """The caching after sampling, at the processed tokens (rule 9)."""
        self._hand_over(kept)
        request = kept.request  # type: ignore[attr-defined]
        self.door.wrapped.cache_blocks(request, request.num_computed_tokens - request.num_in_flight_tokens)


class SyncSteadyLane(SteadyLane[_Kept]):
    """``EngineCore``'s (sync mode)."""

    def __init__(self, scheduler: Scheduler, door: FastPathKVCacheManager, model_runner: ModelRunner) -> None:
        super().__init__(scheduler, door)
        self.model_runner = model_runner

    def schedule(self) -> SchedulerOutput:
        """The scheduler's step, offered the kept requests' decodes."""
        items: dict[str, ScheduledRequest | object] = {}
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
        output = self._offer(items)
        # Scheduled tokens count as computed until the output rejects drafts (as ``Scheduler.schedule``).
        for request_id in self._taken:
            kept_by_id[request_id].computed += step_tokens
        return output

    def sample_and_apply(self, output: SchedulerOutput) -> StepOutcome:
        """The kept requests' tokens aside, the others the scheduler's way (the
        common case inline: it runs for every request of every step)."""
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
        if (limit := self.limit(request)) is None:
            return None
        num_tokens = request.num_tokens
        kept = _Kept(
            request, request.num_computed_tokens, num_tokens, num_tokens, limit, self.unstoppable(request)
        )
        self._kept[request.request_id] = kept
        return kept

    def limit(self, request: Request) -> int | None:
        """The most computed tokens at a steady step's start, or None (rule 6)."""
        computed = request.num_computed_tokens
        limit = self._allocation_limit(request) if self._decodes_next(request) else None
        if limit is None or not (self.num_spec and self.scheduler.config.caches_after_sampling):
            return limit
        caching = self.door.caching.bounds(request.request_id)  # it caches computed + 1 .. + 1 + K
        if caching is None or caching[0] > computed + 1:
            return None
        limit = min(limit, caching[1] - self.step_tokens)
        return None if computed > limit else limit

    def unstoppable(self, request: Request) -> int:
        """The most computed tokens at a step's start whose 1 + K tokens cannot stop it (rule 6)."""
        return request.num_computed_tokens + self.scheduler.stop_room(request) - self.step_tokens - 1
