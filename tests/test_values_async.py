"""Value tests for the async engine (issue 26, item 3): the pipeline clock
and the one engine loop against timelines derived by hand from given stage
times."""

from __future__ import annotations

from sim.pipeline_clock import PipelineClock, SerialClock
from sim.sched.output import ScheduledRequest, SchedulerOutput


def _output(step: int, tokens: int = 1) -> SchedulerOutput:
    item = ScheduledRequest("r", tokens, 0, 0, tokens)
    return SchedulerOutput(step_index=step, scheduled=(item,) if tokens else ())


def test_placeholder_serial_clock():
    clock = SerialClock(lambda output: 2.0)
    assert clock.schedule(_output(1)) == 2.0
