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

from dataclasses import dataclass

from sim.sched.model_runner import ModelRunner
from sim.sched.output import SchedulerOutput, StepOutcome
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
