"""The engine's clocks: when a step handed to the workers lands. No twin in
vLLM (the real engine measures time; kvsim models it). The engine loop
(``sim/sched/engine_loop.py``) takes either.

``SerialClock`` (``engine.mode: sync``): one step at a time, lasting what
the step-time model says of it.

``PipelineClock`` (``engine.mode: async``): a pipeline of stages, one
micro-batch (an engine step) at a time on each. A micro-batch scheduled at
``t`` enters stage 0 when stage 0 is free and, if the step ``pp`` before it
sampled anything, when that step's output has landed (the last stage
broadcasts the sampled tokens a decode continues from; vLLM's worker
consumes step T's at step T + pp, and skips the broadcast of a step of
non-final prefill chunks only: ``vllm/v1/worker/gpu/pp_utils.py``); it
enters each later stage after the hand-off, when that stage is free; its
output lands when the last stage finishes:

    start_0(S) = max(t_S, end_0(S-1), end_last(S-pp) if S-pp sampled)
    end_i(S)   = max(end_{i-1}(S) + handoff(S), end_i(S-1)) + stage_i(S)

An empty step costs nothing and lands in order. The engine waits only for
the oldest step in flight (``wait``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from sim.sched.output import SchedulerOutput

StageTime = Callable[[SchedulerOutput, int], float]
HandoffTime = Callable[[SchedulerOutput], float]
StepTime = Callable[[SchedulerOutput], float]


class SerialClock:
    """One step at a time: a step scheduled at ``t`` lands at ``t + step_s``."""

    def __init__(self, step_time_s: StepTime) -> None:
        self.step_time_s = step_time_s
        self.now_s = 0.0
        self._in_flight: tuple[float, float] | None = None

    def schedule(self, output: SchedulerOutput, samples: bool = True) -> float:
        step_s = self.step_time_s(output)
        self._in_flight = (self.now_s, step_s)
        return self.now_s + step_s

    def block(self) -> tuple[float, float, float]:
        """The engine waits the step's whole time (``engine_loop.StepClock``)."""
        assert self._in_flight is not None, "one step in flight"
        started_s, step_s = self._in_flight
        self._in_flight = None
        self.now_s = started_s + step_s
        return step_s, started_s, step_s

    def idle_until(self, at_s: float) -> None:
        """Nothing to run: the engine waits for the next arrival."""
        self.now_s = max(self.now_s, at_s)


class PipelineClock:
    def __init__(self, num_stages: int, stage_s: StageTime, handoff_s: HandoffTime) -> None:
        self.num_stages = num_stages
        self.stage_s = stage_s
        self.handoff_s = handoff_s
        self.now_s = 0.0
        self._stage_free_s = [0.0] * num_stages
        # Landing times of the last ``num_stages`` steps that broadcast
        # sampled tokens, 0 for those that did not (the broadcast's ring).
        self._landed_s: deque[float] = deque(maxlen=num_stages)
        # (scheduled at, lands at) of each step in flight, oldest first.
        self._in_flight: deque[tuple[float, float]] = deque()

    def schedule(self, output: SchedulerOutput, samples: bool = True) -> float:
        """Start ``output`` (scheduled now; ``samples``: some request of it
        samples a token); returns when its output lands."""
        ring = self._landed_s[0] if len(self._landed_s) == self.num_stages else 0.0
        free = self._stage_free_s
        if output.is_empty:
            end_s = max(self.now_s, free[-1])
        else:
            end_s = max(self.now_s, free[0], ring)
            handoff_s = self.handoff_s(output)
            for stage in range(self.num_stages):
                if stage:
                    end_s = max(end_s + handoff_s, free[stage])
                end_s += self.stage_s(output, stage)
                free[stage] = end_s
        self._landed_s.append(end_s if samples else 0.0)
        self._in_flight.append((self.now_s, end_s))
        return end_s

    def block(self) -> tuple[float, float, float]:
        """The engine blocks on the oldest step in flight: time passes to
        its landing (``engine_loop.StepClock``)."""
        before_s = self.now_s
        started_s, landed_s = self._in_flight.popleft()
        self.now_s = max(before_s, landed_s)
        wait_s = self.now_s - before_s if self.now_s > before_s else 0.0
        return wait_s, started_s, self.now_s - started_s

    def wait(self) -> float:
        """``block``, returning the clock's time after it."""
        self.block()
        return self.now_s

    def idle_until(self, at_s: float) -> None:
        """Nothing to run: the engine waits for the next arrival."""
        self.now_s = max(self.now_s, at_s)
