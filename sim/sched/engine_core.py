"""One engine step without a clock: schedule, execute, apply.

Twin of ``vllm/v1/engine/core.py``'s ``EngineCore.step`` (0.33.0), reduced
to the scheduler and the simulated model runner. The step is split where
the model runs (``schedule`` / ``complete``) so the SimPy engine loop can
let the step's duration pass in between; ``step`` does both at once for
callers without a clock (the scheduler tests). Steady decode steps take
kvsim's fast lane (``steady.py``) when the fast path is on. Plain Python:
no SimPy.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from sim.sched.async_scheduler import AsyncScheduler
from sim.sched.model_runner import ModelRunner
from sim.sched.output import ModelRunnerOutput, SchedulerOutput, StepOutcome
from sim.sched.scheduler import Scheduler


@dataclass(frozen=True)
class ScheduledStep:
    """A step handed to the workers, with each running request's token
    count as scheduled (before the step's output arrives)."""

    output: SchedulerOutput
    token_counts: dict[str, int]
    # The requests whose decodes the steady lane kept aside in it.
    num_steady: int = 0


class EngineCore:
    def __init__(self, scheduler: Scheduler, model_runner: ModelRunner) -> None:
        self.scheduler = scheduler
        self.model_runner = model_runner
        self.steady = scheduler.fast_path.make_lane(model_runner)

    def schedule(self) -> ScheduledStep:
        if self.steady is not None:
            output = self.steady.schedule()
            return ScheduledStep(output, {}, num_steady=self.steady.num_taken)
        output = self.scheduler.schedule()
        counts = {} if output.is_empty else self.scheduler.token_counts()
        return ScheduledStep(output, counts)

    def complete(self, step: ScheduledStep) -> StepOutcome:
        """The workers ran ``step``: apply what they sampled."""
        if self.steady is not None:  # it scheduled every step, so it completes them
            return self.steady.complete(step.output)
        sampled = self.model_runner.execute(step.output, step.token_counts)
        return self.scheduler.update_from_output(step.output, sampled)

    def step(self) -> tuple[SchedulerOutput, StepOutcome | None]:
        """Schedule and complete one step at once. An empty step lets the
        steps in flight complete (their fenced frees return) and has no
        outcome."""
        scheduled = self.schedule()
        if scheduled.output.is_empty:
            self.scheduler.complete_in_flight_steps()
            return scheduled.output, None
        return scheduled.output, self.complete(scheduled)

    def flush(self) -> None:
        """Hand the steady requests their tokens (call this before reading
        the requests between steps)."""
        if self.steady is not None:
            self.steady.flush()


@dataclass(frozen=True)
class BatchStep:
    """One call of the batch-queue loop: the step it scheduled (None when
    nothing was left to schedule) and the oldest step whose output it
    applied (None when it did not wait)."""

    scheduled: SchedulerOutput | None
    processed: SchedulerOutput | None = None
    outcome: StepOutcome | None = None


class BatchQueueEngineCore:
    """Twin of ``EngineCore.step_with_batch_queue`` (``vllm/v1/engine/core.py``,
    0.33.0): up to ``max_concurrent_batches`` steps in flight; a call
    schedules a step whenever the scheduler has requests (an empty step
    takes a slot too) and returns without waiting unless the queue is full
    or nothing is left to schedule; then it waits for the oldest step and
    applies its output. The workers sample a step when it is handed to
    them (the draws follow the schedule order, as the outputs do)."""

    def __init__(
        self, scheduler: AsyncScheduler, model_runner: ModelRunner, max_concurrent_batches: int
    ) -> None:
        self.scheduler = scheduler
        self.model_runner = model_runner
        self.max_concurrent_batches = max_concurrent_batches
        self.batch_queue: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()

    def has_work(self) -> bool:
        return self.scheduler.has_requests() or bool(self.batch_queue)

    def step(self) -> BatchStep:
        scheduled = None
        if self.scheduler.has_requests():
            scheduled = self.scheduler.schedule()
            self.batch_queue.appendleft((scheduled, self._execute(scheduled)))
            if len(self.batch_queue) < self.max_concurrent_batches and (
                not scheduled.is_empty or self.scheduler.has_requests()
            ):
                return BatchStep(scheduled)
        elif not self.batch_queue:
            return BatchStep(None)
        output, sampled = self.batch_queue.pop()
        return BatchStep(scheduled, output, self.scheduler.update_from_output(output, sampled))

    def idle(self, call: BatchStep) -> bool:
        """The call scheduled and applied nothing, and only empty steps are
        in flight: nothing but a new request can change the engine now."""
        scheduled, processed = call.scheduled, call.processed
        return (
            (scheduled is None or scheduled.is_empty)
            and (processed is None or processed.is_empty)
            and all(output.is_empty for output, _ in self.batch_queue)
        )

    def flush(self) -> None:
        """Nothing kept aside (no steady lane in async mode)."""

    def _execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """What the workers will sample: a request samples unless its chunk
        ends short of the prompt (judged when scheduled)."""
        samples = self.scheduler.last_samples
        return self.model_runner.execute(output, sampling_counts(output, samples))


def sampling_counts(output: SchedulerOutput, samples: dict[str, bool]) -> dict[str, int]:
    """The token counts ``ModelRunner.execute`` judges sampling by, given
    which requests sample: the position each reaches, or one past it."""
    counts = {}
    for item in output.scheduled:
        reached = item.num_computed_tokens + item.num_scheduled_tokens - item.num_spec_tokens
        counts[item.request_id] = reached if samples[item.request_id] else reached + 1
    return counts
