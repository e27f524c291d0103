"""Async scheduling: the scheduler the rig runs (PP 2, Model Runner V2).

Twin of ``vllm/v1/core/sched/async_scheduler.py`` (0.33.0) together with
the async branches of vLLM's ``Scheduler`` it relies on: a step is
scheduled while the steps before it are still in flight, so

- a scheduled request's computed tokens advance at once and its in-flight
  tokens with them; a decode adds ``1 + K`` output placeholders and ``K``
  placeholder drafts (-1), as if every in-flight draft were accepted;
- a decode is eligible again only ``decode_stagger`` (= pp) schedule calls
  later (``next_decode_eligible_step``), so decodes alternate between
  micro-batches; a non-final prefill chunk is not staggered;
- a request sure to reach ``max_tokens`` with its in-flight step is not
  scheduled again;
- when an output lands, rejected drafts roll back the computed tokens and
  the placeholders, and blocks are cached only up to the tokens no longer
  in flight;
- a preempted request's in-flight output is stale: still appended, the
  counters left alone; it is not readmitted while stale output is in flight;
- fenced frees pass with each processed output (vLLM's
  ``processed_step_seq += 1``): with ``max_concurrent_batches`` = pp + 1 the
  fence lags the schedule by pp micro-batches.

The fast path (``fast_path/``) works here too, its steady lane as
``fast_path/async_steady.py`` (it keeps the counters above aside for its requests;
``_finish_schedule`` leaves the decodes it took to it): a decode's settled
``allocate_slots`` calls span from its
processed tokens (behind those in flight, where vLLM frees skipped blocks)
to its lookahead; its ``cache_blocks`` calls are at the processed tokens;
and a preempted request whose stale output drains voids the known-idle
waiting loop (fast-path rule 9).
"""

from __future__ import annotations

from collections import deque

from sim.kv_cache_manager import KVCacheManager
from sim.sched.output import ScheduledRequest, SchedulerOutput, StepTally, reaches_max_tokens
from sim.sched.scheduler import Scheduler, SchedulerConfig
from sim.vllm_bridge import Request, RequestStatus, check_stop


class AsyncScheduler(Scheduler):
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        *,
        decode_stagger: int,
    ) -> None:
        super().__init__(config, kv_cache_manager)
        self.decode_stagger = decode_stagger
        self._placeholder_drafts = [-1] * config.num_speculative_tokens
        # The fence sequence number of each step in flight (non-empty steps count).
        self._step_seqs: deque[tuple[int, int]] = deque()
        # Requests finished since the last schedule() (vLLM's finished_req_ids).
        self._finished_since_schedule = False
        # Whether each request of the last step samples (not a non-final chunk).
        self.last_samples: dict[str, bool] = {}

    # ------------------------------------------------------------- schedule
    def has_requests(self) -> bool:
        """vLLM's ``has_requests``: unfinished requests, or finished ones the
        next schedule still has to report."""
        return self.has_unfinished_requests() or self._finished_since_schedule

    def _skips_running(self, request: Request) -> bool:
        """The running loop skips a request whose in-flight step is sure to
        reach ``max_tokens`` even if all its drafts are rejected, and one
        not yet eligible for its next decode (the stagger)."""
        max_tokens_end = request.num_prompt_tokens + request.max_tokens
        if reaches_max_tokens(request.num_computed_tokens, request.num_output_placeholders, max_tokens_end):
            return True
        # step_index counts the schedule() calls before this one.
        return self.step_index + 1 < request.next_decode_eligible_step

    def _skips_waiting(self, request: Request) -> bool:
        """Stale output still in flight: resuming now could resample a
        position it delivers later (it drains within the pipeline depth)."""
        return request.num_stale_output_tokens > 0

    def _finish_schedule(self, step) -> SchedulerOutput:  # type: ignore[no-untyped-def]
        output = super()._finish_schedule(step)
        self._finished_since_schedule = False
        self._step_seqs.append((output.step_index, self.sched_step_seq))
        # The steady lane's decodes sample, and it keeps their counters.
        self.last_samples = dict.fromkeys(step.scheduled, True)
        taken = step.offer.taken
        for item in output.scheduled:
            if item.request_id in taken:
                continue
            request = self.requests[item.request_id]
            request.num_in_flight_tokens += item.num_scheduled_tokens
            self.last_samples[item.request_id] = not request.is_prefill_chunk
            if request.is_prefill_chunk:
                continue
            request.num_output_placeholders += 1 + item.num_spec_tokens
            request.spec_token_ids = self._placeholder_drafts
            request.next_decode_eligible_step = output.step_index + self.decode_stagger
        return output

    def _preempt(self, request: Request) -> None:
        super()._preempt(request)
        # Its in-flight output is stale (assigned: it includes any stale share).
        request.num_stale_output_tokens = request.num_in_flight_tokens
        request.num_output_placeholders = 0

    # --------------------------------------------------------------- output
    def output_arrives(self, output: SchedulerOutput) -> None:
        """The oldest step's output landed: its fence passes."""
        step_index, seq = self._step_seqs.popleft()
        assert step_index == output.step_index, "outputs land in schedule order"
        if self.config.defer_block_free and not output.is_empty:
            self._advance_processed(seq)

    def apply_sampled(self, item: ScheduledRequest, sampled: list[int], tally: StepTally) -> None:
        request = self.requests.get(item.request_id)
        if request is None:
            return
        request.num_in_flight_tokens -= item.num_scheduled_tokens
        stale = request.num_stale_output_tokens > 0
        if stale:
            self.fast_path.waiting_tokens_change()  # a waiter's tokens may grow (rule 11)
            request.num_stale_output_tokens -= item.num_scheduled_tokens
            assert request.num_stale_output_tokens >= 0
            if request.num_stale_output_tokens == 0:
                self.fast_path.waiting_request_changes()
        if request.is_finished() or not sampled:
            return
        running = request.status == RequestStatus.RUNNING
        had_placeholders = request.num_output_placeholders > 0
        if item.num_spec_tokens:
            self._roll_back_rejected(request, item.num_spec_tokens, len(sampled) - 1, stale, tally)
        if request.num_output_tokens == 0:
            tally.first_token_request_ids.append(request.request_id)
        appended, stopped = self._append_sampled(request, sampled, stale)
        tally.num_generated_tokens += appended
        if not stale and running and (had_placeholders or self.config.num_speculative_tokens):
            self._cache_blocks(request, request.num_computed_tokens - request.num_in_flight_tokens)
        if stopped:
            self._finish_stopped(request, running)
            tally.finished[request.request_id] = request.num_output_tokens

    @staticmethod
    def _roll_back_rejected(
        request: Request, num_drafts: int, num_accepted: int, stale: bool, tally: StepTally
    ) -> None:
        """Rejected drafts leave the computed tokens and the placeholders
        (a stale count predates the preemption's reset: not applied)."""
        num_rejected = num_drafts - num_accepted
        if not stale:
            if request.num_computed_tokens > 0:
                request.num_computed_tokens -= num_rejected
            if request.num_output_placeholders > 0:
                request.num_output_placeholders -= num_rejected
        tally.num_draft_tokens += num_drafts
        tally.num_accepted_tokens += num_accepted

    def _append_sampled(self, request: Request, sampled: list[int], stale: bool) -> tuple[int, bool]:
        """vLLM's ``_update_request_with_output``: append up to the stop; the
        returned tokens (trimmed ones included) resolve placeholders."""
        stopped, count = False, 0
        for token in sampled:
            request.append_output_token_ids(token)
            count += 1
            stopped = check_stop(request, self.config.max_model_len)
            if stopped:
                if not stale:
                    request.num_computed_tokens -= len(sampled) - count
                break
        if not stale and request.num_output_placeholders > 0:
            request.num_output_placeholders -= len(sampled)
            assert request.num_output_placeholders >= 0
        return count, stopped

    def _free_request(self, request: Request) -> None:
        """vLLM's ``_free_request`` adds every finished request, stopped or
        aborted, to ``finished_req_ids``, which keeps ``has_requests`` true
        until the next schedule reports it."""
        super()._free_request(request)
        self._finished_since_schedule = True

    def _finish_stopped(self, request: Request, was_running: bool) -> None:
        """A stale output can stop a preempted request in the waiting queue."""
        if was_running:
            self._finish(request)
            return
        self.waiting.remove(request)
        self._free_request(request)
