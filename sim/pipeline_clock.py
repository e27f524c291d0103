"""The engine's clock under pipeline parallelism: a pipeline of stages, one
micro-batch (an engine step) at a time on each. No twin in vLLM (the real
engine measures time; kvsim models it).

A micro-batch scheduled at ``t`` enters stage 0 when stage 0 is free and,
if the step ``pp`` before it sampled anything, when that step's output has
landed (the last stage broadcasts the sampled tokens a decode continues
from; vLLM's worker consumes step T's at step T + pp, and skips the
broadcast of a step of non-final prefill chunks only:
``vllm/v1/worker/gpu/pp_utils.py``); it enters each later stage after the
hand-off, when that stage is free; its output lands when the last stage
finishes:

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
        self._in_flight: deque[float] = deque()

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
        self._in_flight.append(end_s)
        return end_s

    def wait(self) -> float:
        """The engine blocks on the oldest step in flight: time passes to
        its landing."""
        self.now_s = max(self.now_s, self._in_flight.popleft())
        return self.now_s

    def idle_until(self, at_s: float) -> None:
        """Nothing to run: the engine waits for the next arrival."""
        self.now_s = max(self.now_s, at_s)
