"""The steady lane in async mode (rules 5-9). A kept request carries what
``AsyncScheduler`` keeps on its ``Request`` between a schedule and its
output; what the lane cannot apply hands the request back first."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sim.sched.fast_path.steady import SKIP, LaneOffer, SteadyLane
from sim.sched.output import (
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    StepOutcome,
    StepTally,
    reaches_max_tokens,
)
from sim.vllm_bridge import Request

if TYPE_CHECKING:
    from sim.sched.async_scheduler import AsyncScheduler
    from sim.sched.fast_path.kv_cache_manager import FastPathKVCacheManager


# ``ScheduledRequest(...)`` without the named tuple's Python-level
# ``__new__`` (every field given): built for every decode of every step.
_new_item = tuple.__new__


@dataclass(slots=True)
class _KeptAsync:
    """What ``AsyncScheduler`` would hold on the request (``eligible``: the
    first schedule call at which it may decode again; ``pending``: sampled
    ids not appended), and what is fixed at entry (rule 6)."""

    request: Request
    computed: int
    in_flight: int
    placeholders: int
    eligible: int
    num_tokens: int
    pending: list[int] = field(default_factory=list)
    limit: int = 0
    cache_low: int = 0
    cache_high: int = 0
    stop_at: int = 0
    max_tokens_end: int = 0


class AsyncSteadyLane(SteadyLane[_KeptAsync]):
    """``BatchQueueEngineCore``'s."""

    scheduler: AsyncScheduler

    def __init__(self, scheduler: AsyncScheduler, door: FastPathKVCacheManager) -> None:
        super().__init__(scheduler, door)
        # A taken decode's next is that many schedule calls later (pp).
        self.decode_stagger = scheduler.decode_stagger
        self.num_taken = 0  # by the last schedule

    # ---------------------------------------------------------------- a step
    def schedule(self) -> SchedulerOutput:
        """The scheduler's step, offered the kept requests' decodes (``SKIP``
        for each its stagger holds back)."""
        scheduler = self.scheduler
        step_index = scheduler.step_index + 1  # the schedule call being made
        items: dict[str, ScheduledRequest | object] = {}
        kept_by_id, step_tokens, num_spec = self._kept, self.step_tokens, self.num_spec
        for request in scheduler.running:
            request_id = request.request_id
            kept = kept_by_id.get(request_id) or self._enter(request)
            if kept is None:
                continue
            if step_index < kept.eligible:
                items[request_id] = SKIP
                continue
            computed = kept.computed
            if computed > kept.limit or reaches_max_tokens(computed, kept.placeholders, kept.max_tokens_end):
                self._leave(request)
                continue
            fields = (request_id, step_tokens, computed, num_spec, 0, False)  # a decode, not padded
            items[request_id] = _new_item(ScheduledRequest, fields)
        if not items:
            self.num_taken = 0
            return scheduler.schedule()
        offer = LaneOffer(items=items, hand_over=self._leave)  # type: ignore[arg-type]
        output = scheduler.schedule(offer)
        if self.door.audit and offer.taken:
            self._audit_each(self._audit_taken, [kept_by_id[i] for i in offer.taken], "steady allocation")
            self.door.audited["lane step"] += 1
        # ``AsyncScheduler._finish_schedule``'s share, for the taken decodes.
        eligible = output.step_index + self.decode_stagger
        for request_id in offer.taken:
            kept = kept_by_id[request_id]
            kept.computed += step_tokens
            kept.in_flight += step_tokens
            kept.placeholders += step_tokens
            kept.eligible = eligible
        self.num_taken = len(offer.taken)
        return output

    def update_from_output(self, output: SchedulerOutput, sampled: ModelRunnerOutput) -> StepOutcome:
        """The fences pass first (rule 8); a kept decode's tokens are applied
        here as ``AsyncScheduler.apply_sampled`` would, where they cannot stop
        it and its caching is settled, else it leaves first. (One loop: it
        runs for every decode of every step.)"""
        scheduler = self.scheduler
        scheduler.output_arrives(output)
        tally = StepTally()
        kept_by_id, tokens_by_id = self._kept, sampled.sampled_token_ids
        step_tokens, num_spec, audit = self.step_tokens, self.num_spec, self.door.audit
        num_applied = num_generated = 0
        for item in output.scheduled:
            request_id, num_scheduled, _, num_spec_scheduled, _, is_padded = item
            tokens = tokens_by_id.get(request_id, [])
            kept = kept_by_id.get(request_id)
            if kept is not None:
                count = len(tokens)
                if (
                    count
                    and num_scheduled == step_tokens
                    and num_spec_scheduled == num_spec
                    and not is_padded
                    and kept.num_tokens + count < kept.stop_at
                ):
                    num_rejected = num_spec - (count - 1)
                    in_flight = kept.in_flight - num_scheduled
                    computed = kept.computed - num_rejected
                    processed = computed - in_flight  # where its blocks are cached
                    if kept.cache_low <= processed <= kept.cache_high:
                        kept.in_flight, kept.computed = in_flight, computed
                        kept.placeholders -= num_rejected + count
                        kept.num_tokens += count
                        kept.pending.extend(tokens)
                        if audit:
                            self._audit_caching(kept, processed)
                        num_applied += 1
                        num_generated += count
                        continue
                self._leave(kept.request)
            scheduler.apply_sampled(item, tokens, tally)
        tally.num_generated_tokens += num_generated
        if num_spec:
            tally.num_draft_tokens += num_applied * num_spec
            tally.num_accepted_tokens += num_generated - num_applied
        return tally.outcome()

    def num_output_placeholders(self, request: Request) -> int:
        """As the scheduler would have them."""
        kept = self._kept.get(request.request_id)
        return request.num_output_placeholders if kept is None else kept.placeholders

    # ------------------------------------------------------- entry and exit
    @staticmethod
    def _hand_over(kept: _KeptAsync) -> None:  # type: ignore[override]
        """The counters and the ids kept aside."""
        request = kept.request
        request.num_computed_tokens = kept.computed
        request.num_in_flight_tokens = kept.in_flight
        request.num_output_placeholders = kept.placeholders
        request.next_decode_eligible_step = kept.eligible
        if kept.pending:
            request.append_output_token_ids(kept.pending)
            kept.pending = []

    def _enter(self, request: Request) -> _KeptAsync | None:
        """Kept if it decodes next, has no stale output, and its next step's
        calls lie in settled windows."""
        computed, placeholders = request.num_computed_tokens, request.num_output_placeholders
        if (
            request.is_prefill_chunk
            or request.num_output_tokens == 0
            or request.num_stale_output_tokens
            or not self._decodes_next(request)
        ):
            return None
        limit = self._limit(request)
        if limit is None:
            return None
        kept = _KeptAsync(
            request=request,
            computed=computed,
            in_flight=request.num_in_flight_tokens,
            placeholders=placeholders,
            eligible=request.next_decode_eligible_step,
            num_tokens=request.num_tokens,
            limit=limit[0],
            cache_low=limit[1],
            cache_high=limit[2],
            stop_at=request.num_tokens + self.scheduler.stop_room(request),
            max_tokens_end=request.num_prompt_tokens + request.max_tokens,
        )
        self._kept[request.request_id] = kept
        return kept

    def _limit(self, request: Request) -> tuple[int, int, int] | None:
        """The most computed tokens at a steady schedule and the caching
        window (rule 6), or None. ``allocate_slots`` spans from the processed
        tokens to ``1 + 2K`` past the computed ones."""
        computed, scheduler = request.num_computed_tokens, self.scheduler
        span = self.door.decode_span(request, self.step_tokens + self.num_spec)
        door, request_id = self.door, request.request_id
        allocation = door.allocations.bounds(request_id)
        caching = door.caching.bounds(request_id)
        if span is None or allocation is None or caching is None:
            return None
        processed = span[0]
        if allocation[0] > processed or caching[0] > processed:
            return None
        # The clip leaves the step whole (its room counts from the tokens computed).
        limit = min(
            allocation[1] - (span[1] - computed), computed + scheduler.clip_room(request) - self.step_tokens
        )
        return (limit, caching[0], caching[1]) if computed <= limit else None

    # -------------------------------------------------------------- audit
    def _audit_taken(self, kept: _KeptAsync) -> None:
        self._hand_over(kept)
        self._audit_allocation(kept.request)

    def _audit_caching(self, kept: _KeptAsync, processed: int) -> None:
        self._hand_over(kept)
        self.door.check_unchanged(
            lambda: self.door.wrapped.cache_blocks(kept.request, processed), "steady caching"
        )
