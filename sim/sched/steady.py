"""Steady decode steps: the engine's fast lane through runs of alike steps.

No twin in vLLM (its engine runs every step the same way); this is kvsim's
second fast path, on top of the settled allocator calls (``settled.py``). In
a long or pool-bound decode most steps change nothing but token counts:
every running request decodes ``1 + K`` tokens inside blocks whose allocator
calls are settled, and the waiting loop admits nobody. Such a step is
*steady*. The lane schedules it as ``Scheduler.schedule`` would (the same
``SchedulerOutput``), draws the same acceptances from the runner's stream in
the same order, and keeps each request's new tokens aside until the run of
steady steps ends; then one append per request gives the ``Request`` it
would have had (the sampled ids are consecutive positions). A request that
this step's tokens may stop is handed its tokens at once and takes them the
scheduler's way (``Scheduler.take_sampled``: it may finish, and the run
ends with the step).

A step is steady when, before it:

- the fast path is on (fenced frees may wait: the step returns them, as
  ``update_from_output`` does, and the next step sees it);
- every running request decodes (it computed all its tokens but the last,
  with K drafts queued), and even if it accepts every draft it stays inside
  its settled allocation and caching windows and the ``max_model_len``
  clip leaves it ``1 + K`` tokens;
- the token budget holds every request's ``1 + K`` tokens and no
  long-prefill threshold clips them;
- the waiting loop admits nobody: it does not start, or it is the loop the
  scheduler remembers admitting nobody with the same inputs, head and
  allocator state (``Scheduler.waiting_admits_nobody``).

The argument is checked: every gate scenario gives identical frames with the
fast path off (``tests/test_fast_path.py``), the conformance driver steps
kvsim through this lane against vLLM's own ``Scheduler``, and the tests in
``tests/test_steady.py`` pin each condition with a failing control.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.sched.model_runner import ModelRunner
from sim.sched.output import ScheduledRequest, SchedulerOutput, StepOutcome
from sim.sched.scheduler import Scheduler
from sim.vllm_bridge import Request


@dataclass
class _Run:
    """A run of steady steps: the running requests (in order) and, per
    request, its computed tokens and tokens as the scheduler would have
    them, the most computed tokens it may have at a steady step's start
    and the most with which the step cannot stop it, and its tokens when
    the ``Request`` last took them."""

    requests: list[Request]
    request_ids: list[str]
    computed: list[int]
    num_tokens: list[int]
    limits: list[int]
    unstoppable: list[int]
    handed_over: list[int]


class SteadyDecode:
    def __init__(self, scheduler: Scheduler, model_runner: ModelRunner) -> None:
        self.scheduler = scheduler
        self.model_runner = model_runner
        self.num_spec = scheduler.config.num_speculative_tokens
        self.step_tokens = 1 + self.num_spec
        self._run: _Run | None = None
        # The request that kept the last run from starting: checked first,
        # as it usually still does.
        self._blocker: Request | None = None

    # ---------------------------------------------------------------- a step
    def schedule(self) -> SchedulerOutput | None:
        """The next step when it is steady; None (the run's tokens handed to
        the requests) when it must be scheduled the ordinary way."""
        run = self._run if self._run is not None else self._start_run()
        if run is None or not self._waiting_admits_nobody(run):
            self.flush()
            return None
        items = []
        for request_id, computed, limit in zip(run.request_ids, run.computed, run.limits, strict=True):
            if computed > limit:
                self.flush()
                return None
            items.append(
                ScheduledRequest(
                    request_id=request_id,
                    num_scheduled_tokens=self.step_tokens,
                    num_computed_tokens=computed,
                    num_spec_tokens=self.num_spec,
                    num_prompt_tokens_left=0,
                )
            )
        # Scheduled tokens count as computed until the step's output says
        # which drafts were rejected (as in ``Scheduler.schedule``).
        run.computed = [computed + self.step_tokens for computed in run.computed]
        step_index = self.scheduler.start_steady_step(run.request_ids)
        return SchedulerOutput(step_index=step_index, scheduled=tuple(items))

    def complete(self, output: SchedulerOutput) -> StepOutcome:
        """The workers ran a steady step: each request keeps its bonus token
        and accepted drafts (drawn in the step's order, as the runner does)."""
        run = self._run
        assert run is not None and len(output.scheduled) == len(run.computed), "a steady step of this run"
        self.scheduler.complete_steady_step()
        computed, num_tokens, unstoppable = run.computed, run.num_tokens, run.unstoppable
        num_spec, started = self.num_spec, self.step_tokens
        finished: dict[str, int] = {}
        accepted = generated = 0
        for index in range(len(computed)):
            num_accepted = self.model_runner.num_accepted(num_spec)
            accepted += num_accepted
            if computed[index] - started <= unstoppable[index]:
                computed[index] -= num_spec - num_accepted
                num_tokens[index] += num_accepted + 1
                generated += num_accepted + 1
            else:
                generated += self._take_at_once(run, index, num_accepted, finished)
        return StepOutcome(
            finished=finished,
            num_generated_tokens=generated,
            num_draft_tokens=self.num_spec * len(computed),
            num_accepted_tokens=accepted,
        )

    def _take_at_once(self, run: _Run, index: int, num_accepted: int, finished: dict[str, int]) -> int:
        """A request the step's tokens may stop takes them now, as
        ``update_from_output`` gives them (the rejected drafts rolled back
        first). Returns the tokens it appended."""
        self._hand_over(run, index)
        request = run.requests[index]
        request.num_computed_tokens -= self.num_spec - num_accepted
        sampled = self.model_runner.sampled_token_ids(request.num_tokens, num_accepted + 1)
        appended, stopped = self.scheduler.take_sampled(request, sampled)
        if stopped:
            finished[request.request_id] = request.num_output_tokens
        run.computed[index] = request.num_computed_tokens
        run.num_tokens[index] = run.handed_over[index] = request.num_tokens
        return appended

    def flush(self) -> None:
        """End the run: every request takes the tokens it sampled in it."""
        run, self._run = self._run, None
        if run is not None:
            for index in range(len(run.requests)):
                self._hand_over(run, index)

    def _hand_over(self, run: _Run, index: int) -> None:
        """One request takes its computed tokens as they stand and the
        tokens it sampled since it last took them."""
        request, num_tokens, handed_over = run.requests[index], run.num_tokens[index], run.handed_over[index]
        request.num_computed_tokens = run.computed[index]
        if num_tokens > handed_over:
            sampled = self.model_runner.sampled_token_ids(handed_over, num_tokens - handed_over)
            request.append_output_token_ids(sampled)
            run.handed_over[index] = num_tokens

    # ------------------------------------------------------------ conditions
    def _start_run(self) -> _Run | None:
        scheduler = self.scheduler
        running = scheduler.running
        if not scheduler.fast_path or not running:
            return None
        if len(running) * self.step_tokens > scheduler.config.max_num_batched_tokens:
            return None
        if 0 < scheduler.config.long_prefill_token_threshold < self.step_tokens:
            return None
        blocker = self._blocker
        if blocker is not None and self._limit(blocker) is None and any(r is blocker for r in running):
            return None
        limits = []
        for request in running:
            limit = self._limit(request)
            if limit is None:
                self._blocker = request
                return None
            limits.append(limit)
        self._blocker = None
        num_tokens = [r.num_tokens for r in running]
        self._run = _Run(
            requests=list(running),
            request_ids=[r.request_id for r in running],
            computed=[r.num_computed_tokens for r in running],
            num_tokens=num_tokens,
            limits=limits,
            unstoppable=[self._unstoppable(r) for r in running],
            handed_over=list(num_tokens),
        )
        return self._run

    def _limit(self, request: Request) -> int | None:
        """The most computed tokens ``request`` may have at a steady step's
        start; None when it is not decoding or a call of its next step is
        real (its settled window starts after it)."""
        computed, num_spec = request.num_computed_tokens, self.num_spec
        if computed != request.num_tokens - 1 or len(request.spec_token_ids) != num_spec:
            return None
        settled = self.scheduler.settled_allocations
        assert settled is not None, "steady steps need the fast path"
        bounds = settled.bounds(request.request_id)
        # The step allocates for positions computed .. computed + 1 + 2K.
        if bounds is None or bounds[0] > computed:
            return None
        limit = bounds[1] - (1 + 2 * num_spec)
        if num_spec:  # then the step caches at computed + 1 .. computed + 1 + K
            caching = self.scheduler.settled_caching
            assert caching is not None
            bounds = caching.bounds(request.request_id)
            if bounds is None or bounds[0] > computed + 1:
                return None
            limit = min(limit, bounds[1] - (1 + num_spec))
        # The max_model_len clip leaves 1 + K tokens (the split leaves a
        # decode's alone, and the budget is checked for the whole batch).
        limit = min(limit, self.scheduler.config.max_model_len - num_spec - 2)
        return limit if computed <= limit else None

    def _unstoppable(self, request: Request) -> int:
        """The most computed tokens at a step's start with which the step
        cannot stop ``request``: after it (1 + K more tokens at most) it
        stays below both length limits (``check_stop``)."""
        num_spec = self.num_spec
        return min(
            request.max_tokens + request.num_prompt_tokens - num_spec - 3,
            self.scheduler.config.max_model_len - num_spec - 3,
        )

    def _waiting_admits_nobody(self, run: _Run) -> bool:
        scheduler = self.scheduler
        if len(scheduler.running) != len(run.computed):
            return False
        budget_left = scheduler.config.max_num_batched_tokens - len(run.computed) * self.step_tokens
        return scheduler.waiting_admits_nobody(budget_left)
