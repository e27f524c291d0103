"""The engine core without a clock: one engine step, or one call of the
batch-queue loop, split where vLLM blocks on the workers.

Twin of ``vllm/v1/engine/core.py``'s ``EngineCore`` (0.33.0), reduced to
the scheduler and the simulated model runner:

- ``EngineCore`` is ``EngineCore.step`` (``engine.mode: sync``): schedule,
  execute, apply the output; one step in flight;
- ``BatchQueueEngineCore`` is ``step_with_batch_queue`` (``engine.mode:
  async``, ``AsyncScheduler``): up to ``max_concurrent_batches`` (pp + 1)
  micro-batches in flight; a call schedules one whenever the scheduler has
  requests and blocks on the oldest only when the queue is full or nothing
  was left to schedule.

vLLM's call blocks on ``future.result()`` between handing a step to the
workers and applying the oldest step's output. Each core splits its call
there: ``begin_step`` (up to the block) and ``end_step`` (after it), so the
one engine loop (``engine_loop.py``) lets the step's time pass in between,
on whatever clock its caller keeps (``engine_loop.make_call`` makes the
whole call at once, for callers without a clock). Whether a call leaves the
engine idle is the loop's judgement (``engine_loop.idle_after``); a core
says only what is in flight and lets it complete. Steady decode steps take
kvsim's fast lane (``fast_path/steady.py``; ``fast_path/async_steady.py`` in
the batch queue) when the fast path is on. Plain Python: no SimPy.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from sim.sched.async_scheduler import AsyncScheduler
from sim.sched.model_runner import ModelRunner
from sim.sched.output import ModelRunnerOutput, SchedulerOutput, StepOutcome
from sim.sched.scheduler import Scheduler
from sim.vllm_bridge import Request


@dataclass(frozen=True)
class ScheduledStep:
    """A step handed to the workers, with each running request's token
    count as scheduled (before the step's output arrives)."""

    output: SchedulerOutput
    token_counts: dict[str, int]
    # The requests whose decodes the steady lane kept aside in it.
    num_steady: int = 0


@dataclass(slots=True)
class EngineCall:
    """One call of the engine core (vLLM's ``step_fn``): the step it
    dispatched to the workers (None: none) and, once ``end_step`` ran, the
    step whose output it processed (None: it did not block). Not
    ``scheduled``: that is a step's scheduled requests
    (``SchedulerOutput.scheduled``)."""

    dispatched: SchedulerOutput | None = None
    # Some request of ``dispatched`` samples a token (the pipeline clock's broadcast).
    samples: bool = True
    # The call blocks on the oldest step in flight; ``end_step`` follows.
    waits: bool = False
    processed: SchedulerOutput | None = None
    outcome: StepOutcome | None = None
    # The processed step's sampled tokens (None: the steady lane kept them).
    sampled: ModelRunnerOutput | None = None
    # Nothing but a new request can change the engine now (set by the
    # engine loop's idle rule, ``engine_loop.idle_after``).
    idle: bool = False


class EngineCore:
    """``EngineCore.step``: one step in flight. ``steady_lane=False`` keeps
    every request's ``Request`` current after each step (fast-path rule 5:
    a caller that reads requests between steps, or aborts them)."""

    def __init__(self, scheduler: Scheduler, model_runner: ModelRunner, *, steady_lane: bool = True) -> None:
        self.scheduler = scheduler
        self.model_runner = model_runner
        self.lane = scheduler.fast_path.make_lane(model_runner) if steady_lane else None
        self._in_flight: ScheduledStep | None = None

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def begin_step(self) -> EngineCall:
        """Schedule and hand the step to the workers. An empty step is not
        run (the call hands the workers nothing)."""
        scheduled = self.schedule()
        if scheduled.output.is_empty:
            return EngineCall()
        self._in_flight = scheduled
        return EngineCall(dispatched=scheduled.output, waits=True)

    def end_step(self, call: EngineCall) -> None:
        """The step's output landed: apply it."""
        step, self._in_flight = self._in_flight, None
        assert step is not None and step.output is call.dispatched, "end the step begun"
        call.processed = step.output
        call.sampled, call.outcome = self._complete(step)

    def schedule(self) -> ScheduledStep:
        if self.lane is not None:
            output = self.lane.schedule()
            return ScheduledStep(output, {}, num_steady=self.lane.num_taken)
        output = self.scheduler.schedule()
        counts = {} if output.is_empty else self.scheduler.token_counts()
        return ScheduledStep(output, counts)

    def complete(self, step: ScheduledStep) -> StepOutcome:
        """The workers ran ``step``: apply what they sampled."""
        return self._complete(step)[1]

    def _complete(self, step: ScheduledStep) -> tuple[ModelRunnerOutput | None, StepOutcome]:
        if self.lane is not None:  # it scheduled every step, so it completes them
            return None, self.lane.sample_and_apply(step.output)
        sampled = self.model_runner.execute(step.output, step.token_counts)
        return sampled, self.scheduler.update_from_output(step.output, sampled)

    def only_empty_in_flight(self) -> bool:
        return self._in_flight is None or self._in_flight.output.is_empty

    def complete_in_flight_steps(self) -> bool:
        """The steps the scheduler still counts in flight complete (with
        ``max_concurrent_batches`` > 1 its fence trails the applied step)."""
        return self.scheduler.complete_in_flight_steps()

    def flush(self) -> None:
        """Hand the steady requests their tokens (call this before reading
        the requests between steps)."""
        if self.lane is not None:
            self.lane.flush()


class BatchQueueEngineCore:
    """Twin of ``EngineCore.step_with_batch_queue`` (``vllm/v1/engine/core.py``,
    0.33.0): up to ``max_concurrent_batches`` steps in flight; a call
    schedules a step whenever the scheduler has requests (an empty step
    takes a slot too) and returns without waiting unless the queue is full
    or nothing is left to schedule; then it waits for the oldest step and
    applies its output. The workers sample a step when it is handed to
    them (the draws follow the schedule order, as the outputs do)."""

    def __init__(
        self,
        scheduler: AsyncScheduler,
        model_runner: ModelRunner,
        max_concurrent_batches: int,
        *,
        steady_lane: bool = True,
    ) -> None:
        self.scheduler = scheduler
        self.model_runner = model_runner
        self.max_concurrent_batches = max_concurrent_batches
        self.batch_queue: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        # The async steady lane (``async_steady.py``; rule 5 as in sync mode).
        self.lane = scheduler.fast_path.make_async_lane() if steady_lane else None

    def has_work(self) -> bool:
        return self.scheduler.has_requests() or bool(self.batch_queue)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def begin_step(self) -> EngineCall:
        scheduler = self.scheduler
        if not scheduler.has_requests():
            return EngineCall(None, waits=bool(self.batch_queue))
        lane = self.lane
        scheduled = scheduler.schedule() if lane is None else lane.schedule()
        self.batch_queue.appendleft((scheduled, self._execute(scheduled)))
        samples = any(scheduler.last_samples.values())
        if len(self.batch_queue) < self.max_concurrent_batches and (
            not scheduled.is_empty or scheduler.has_requests()
        ):
            return EngineCall(scheduled, samples)
        return EngineCall(scheduled, samples, waits=True)

    def end_step(self, call: EngineCall) -> None:
        """The oldest step's output landed: apply it."""
        output, sampled = self.batch_queue.pop()
        call.processed, call.sampled = output, sampled
        if self.lane is None:
            call.outcome = self.scheduler.update_from_output(output, sampled)
        else:
            call.outcome = self.lane.update_from_output(output, sampled)

    def only_empty_in_flight(self) -> bool:
        return all(output.is_empty for output, _ in self.batch_queue)

    def complete_in_flight_steps(self) -> bool:
        """Nothing to force: a step in the batch queue completes when its
        output is applied (``end_step``), as in vLLM."""
        return False

    def flush(self) -> None:
        """Hand the steady requests their state (call this before reading
        the requests between calls)."""
        if self.lane is not None:
            self.lane.flush()

    def num_output_placeholders(self, request: Request) -> int:
        """``request``'s output placeholders, the steady lane's if it keeps them."""
        if self.lane is None:
            return request.num_output_placeholders
        return self.lane.num_output_placeholders(request)

    def _execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """What the workers will sample: a request samples unless its chunk
        ends short of the prompt (judged when scheduled)."""
        return self.model_runner.execute_sampling(output, self.scheduler.last_samples)
