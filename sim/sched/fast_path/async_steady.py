"""The steady lane in async mode: steady decodes kept aside under
``AsyncScheduler`` and the batch queue.

No twin in vLLM (its engine runs every request through every step the same
way). The sync lane (``steady.py``) assumes each step's output is applied
before the next schedule; here up to pp + 1 micro-batches are in flight,
so a kept request carries what ``AsyncScheduler`` keeps on its ``Request``
between a schedule and its output:

- its computed tokens, counted optimistically (the in-flight drafts taken
  as accepted), its tokens in flight and its output placeholders;
- its decode stagger: the schedule call from which it may decode again
  (``next_decode_eligible_step``); before it, the lane offers the scheduler
  a ``SKIP`` for it, which the running loop passes over as it would;
- the sampled ids it has not taken yet (the workers' ids, which start at
  the optimistic position: not consecutive when drafts are rejected).

The workers still sample every item (``BatchQueueEngineCore._execute``),
so the acceptance draws are the runner's own, in the schedule's order
(fast-path rule 7). When an output lands, the lane applies a kept decode's
tokens as ``AsyncScheduler.apply_sampled`` would (rejected drafts roll back
the computed tokens and the placeholders; the in-flight tokens drain; the
returned tokens resolve placeholders), skipping its ``cache_blocks`` call,
which lies in its settled window. Anything else hands the request back
first (its ``Request`` takes the counters and ids) and goes the ordinary
way: a step whose tokens may stop it, a cache position outside its window,
an item of another shape, a schedule past its allocation window or the
``max_model_len`` clip, or one the running loop would skip as sure to
reach ``max_tokens``.

Checked like the sync lane: the audit makes every skipped call
(``tests/test_fast_path.py``, ``tests/test_steady.py``), every gate
scenario gives the same frames with the fast path off, and the async
conformance driver compares the lane's steps with vLLM's own
``step_with_batch_queue`` (``tests/test_async_conformance.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sim.sched.fast_path.steady import SKIP, SteadyItems, SteadyLane, _each
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
    """A request in the async lane: what ``AsyncScheduler`` would hold on it."""

    request: Request
    computed: int
    in_flight: int
    placeholders: int
    # The first schedule call (``step_index``) at which it may decode again.
    eligible: int
    num_tokens: int
    # Sampled ids not yet appended to its ``Request``.
    pending: list[int] = field(default_factory=list)
    # The most computed tokens at a steady schedule (allocation window, clip).
    limit: int = 0
    # Its settled caching window (the processed positions it may cache at).
    cache_low: int = 0
    cache_high: int = 0
    # Its token count at which a length limit stops it.
    stop_at: int = 0
    # Its prompt plus ``max_tokens`` (the running loop's skip).
    max_tokens_end: int = 0


class AsyncSteadyDecode(SteadyLane[_KeptAsync]):
    """The steady lane for ``BatchQueueEngineCore`` (one per engine core)."""

    scheduler: AsyncScheduler

    def __init__(self, scheduler: AsyncScheduler, door: FastPathKVCacheManager) -> None:
        super().__init__(scheduler, door)
        # The scheduler's decode stagger (pp): a taken decode's next is that
        # many schedule calls later.
        self.decode_stagger = scheduler.decode_stagger
        # The decodes the scheduler took in the last schedule.
        self.num_taken = 0

    # ---------------------------------------------------------------- a step
    def schedule(self) -> SchedulerOutput:
        """The scheduler's step, offered the kept requests' decodes (and a
        ``SKIP`` for each one its stagger holds back)."""
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
        steady = SteadyItems(items=items, hand_over=self._leave)  # type: ignore[arg-type]
        output = scheduler.schedule(steady)
        if self.door.audit and steady.taken:
            self._audit_allocations(steady.taken)
        # ``AsyncScheduler._finish_schedule``'s share, for the taken decodes.
        eligible = output.step_index + self.decode_stagger
        for request_id in steady.taken:
            kept = kept_by_id[request_id]
            kept.computed += step_tokens
            kept.in_flight += step_tokens
            kept.placeholders += step_tokens
            kept.eligible = eligible
        self.num_taken = len(steady.taken)
        return output

    def update_from_output(self, output: SchedulerOutput, sampled: ModelRunnerOutput) -> StepOutcome:
        """The oldest step's output landed: the fences pass first (rule 8),
        then each request's tokens: a kept decode's in the lane, as
        ``AsyncScheduler.apply_sampled`` would apply them, when they cannot
        stop it and its caching is settled (rejected drafts roll back the
        computed tokens and the placeholders, the in-flight tokens drain,
        the returned tokens resolve placeholders); else it leaves the lane
        and its tokens go the ordinary way. The lane's decodes are tallied
        once. (Written as one loop: it runs for every decode of every step.)"""
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
        """``request``'s placeholders as the scheduler would have them."""
        kept = self._kept.get(request.request_id)
        return request.num_output_placeholders if kept is None else kept.placeholders

    # ------------------------------------------------------- entry and exit
    @staticmethod
    def _hand_over(kept: _KeptAsync) -> None:  # type: ignore[override]
        """The request takes the counters and the ids kept aside."""
        request = kept.request
        request.num_computed_tokens = kept.computed
        request.num_in_flight_tokens = kept.in_flight
        request.num_output_placeholders = kept.placeholders
        request.next_decode_eligible_step = kept.eligible
        if kept.pending:
            request.append_output_token_ids(kept.pending)
            kept.pending = []

    def _enter(self, request: Request) -> _KeptAsync | None:
        """Keep ``request`` if it decodes with all its known tokens but the
        last computed (placeholders counted as known), K drafts queued, no
        stale output, and its next step's calls lie in settled windows."""
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
        window (fixed at entry: fast-path rule 6), or None. A schedule's
        ``allocate_slots`` spans from the processed tokens (they only grow)
        to ``1 + 2K`` past the computed ones; the clip leaves it ``1 + K``."""
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
    def _audit_allocations(self, taken: set[str]) -> None:
        """Make the allocation each taken decode skipped (``audit``), with
        its ``Request`` as the running loop would have seen it."""
        kept = [self._kept[request_id] for request_id in taken]
        self.door.check_unchanged(lambda: _each(self._audit_taken, kept), "steady allocation")
        self.door.audited.lane_steps += 1

    def _audit_taken(self, kept: _KeptAsync) -> None:
        self._hand_over(kept)
        self._audit_allocation(kept.request)

    def _audit_caching(self, kept: _KeptAsync, processed: int) -> None:
        """Make the caching a kept decode's output skipped (``audit``)."""
        self._hand_over(kept)
        self.door.check_unchanged(
            lambda: self.door.wrapped.cache_blocks(kept.request, processed), "steady caching"
        )
