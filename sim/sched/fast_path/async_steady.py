"""The steady lane in async mode (rules 5-9): a kept request carries what
``AsyncScheduler`` keeps on its ``Request`` between a schedule and its output."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sim.sched.fast_path.steady import SKIP, SteadyLane
from sim.sched.output import ScheduledRequest, StepTally, reaches_max_tokens
from sim.vllm_bridge import Request

if TYPE_CHECKING:
    from sim.sched.async_scheduler import AsyncScheduler
    from sim.sched.fast_path.kv_cache_manager import FastPathKVCacheManager
    from sim.sched.output import ModelRunnerOutput, SchedulerOutput, StepOutcome


_new_item = tuple.__new__  # a ``ScheduledRequest`` without its Python-level ``__new__`` (every decode)


@dataclass(slots=True)
class _KeptAsync:
    """What ``AsyncScheduler`` would hold on the request, and what is fixed at entry (rule 6)."""

    request: Request
    computed: int
    in_flight: int
    placeholders: int
    eligible: int  # the first schedule call at which it may decode again
    num_tokens: int
    pending: list[int] = field(default_factory=list)  # sampled ids not appended
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
        self.decode_stagger = scheduler.decode_stagger  # a taken decode's next: that many calls later

    def schedule(self) -> SchedulerOutput:
        """The scheduler's step, offered the kept requests' decodes (or ``SKIP``)."""
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
        output = self._offer(items)
        # ``AsyncScheduler._finish_schedule``'s share, for the taken decodes.
        eligible = output.step_index + self.decode_stagger
        for request_id in self._taken:
            kept = kept_by_id[request_id]
            kept.computed += step_tokens
            kept.in_flight += step_tokens
            kept.placeholders += step_tokens
            kept.eligible = eligible
        return output

    def update_from_output(self, output: SchedulerOutput, sampled: ModelRunnerOutput) -> StepOutcome:
        """A kept decode's tokens applied as ``AsyncScheduler.apply_sampled`` would
        where they cannot stop it and its caching is settled, else it leaves first."""
        scheduler = self.scheduler
        scheduler.output_arrives(output)  # the fences pass first (rule 8)
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
                            self._audit_each(self._audit_cache, [kept], "steady caching")
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

    def num_output_placeholders(self, request: Request) -> int:  # as the scheduler would have them
        kept = self._kept.get(request.request_id)
        return request.num_output_placeholders if kept is None else kept.placeholders

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
        """Kept if it decodes next, has no stale output and its calls are settled."""
        if (
            request.is_prefill_chunk
            or request.num_output_tokens == 0
            or request.num_stale_output_tokens
            or not self._decodes_next(request)
            or (limit := self._limit(request)) is None
        ):
            return None
        kept = _KeptAsync(
            request=request,
            computed=request.num_computed_tokens,
            in_flight=request.num_in_flight_tokens,
            placeholders=request.num_output_placeholders,
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
        """The allocation limit and the caching window (rule 6), or None."""
        limit = self._allocation_limit(request)
        caching = self.door.caching.bounds(request.request_id)
        processed = request.num_computed_tokens - request.num_in_flight_tokens  # where it caches (rule 9)
        if limit is None or caching is None or caching[0] > processed:
            return None
        return limit, caching[0], caching[1]
