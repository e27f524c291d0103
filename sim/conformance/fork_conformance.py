"""kvsim's fork mode step for step against the fork's own ``Scheduler``
(``kvsim conform --fork``): the same trace, clock and acceptance draws as
``driver.run_conformance`` (sync) and ``async_engine.run_async_conformance``
(the batch queue), with the fork's scheduler-side code, built from the
user's checkout or combined diff (``fork_venv.py``), as the reference.

The fork's run records the clock's every answer (``ClockTape``), so a golden
recording replays on kvsim with the very step times the fork saw, whatever
kvsim's step-time model says later.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from sim.conformance.async_engine import async_clock, drive_engine, kvsim_engine
from sim.conformance.backends import kvsim_fork_state
from sim.conformance.driver import Comparison, Trajectory, compare, drive, kvsim_backend
from sim.conformance.fork_backend import ForkBackend, ForkEngine, ForkProcess
from sim.engine_assembly import model_runner
from sim.fork.frees import fork_defers_block_free
from sim.scenario import EngineMode, Scenario, SideCacheSwitch
from sim.sched.scheduler import RequestSpec
from sim.step_time import StepTimeModel


class ClockTape:
    """The step-time model's answers, in the order the clock asks: recorded
    around a model, or replayed from a recording (past its end, no time)."""

    def __init__(self, model: StepTimeModel | None = None, values: Iterable[float] = ()) -> None:
        self.model = model
        self.values: list[float] = []
        self._replay = iter(values)

    def _answer(self, compute: Callable[[StepTimeModel], float]) -> float:
        if self.model is None:
            return next(self._replay, 0.0)
        value = compute(self.model)
        self.values.append(value)
        return value

    def step_time_s(self, output: Any) -> float:
        return self._answer(lambda m: m.step_time_s(output))

    def stage_s(self, output: Any, stage: int) -> float:
        return self._answer(lambda m: m.stage_s(output, stage))

    def handoff_s(self, output: Any) -> float:
        return self._answer(lambda m: m.handoff_s(output))


def fork_compared_scenario(scenario: Scenario, engine_mode: EngineMode = "sync") -> Scenario:
    """The scenario as both sides run it. Sync: one step at a time; the
    fork's Scheduler fences frees there too (one batch per pipeline stage),
    and stepped one call at a time each fence passes with its own step's
    output, so kvsim's fence counts no other step in flight. Async: the
    batch queue of pp + 1 micro-batches, fenced as the fork derives it."""
    pp = scenario.deployment.pipeline_parallel_size
    engine = scenario.engine.model_copy(update={"mode": engine_mode})
    if engine_mode == "async":
        update: dict[str, Any] = {"defer_block_free": fork_defers_block_free(pp + 1)}
    else:
        update = {"max_concurrent_batches": 1, "defer_block_free": fork_defers_block_free(pp)}
    section = scenario.scheduler.model_copy(update=update)
    return scenario.model_copy(update={"scheduler": section, "engine": engine})


class _ReportingKvsimEngine:
    """kvsim's batch-queue engine, each call's record with the fork columns."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.name = engine.name
        self.scheduler = engine.scheduler

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def step(self) -> tuple[Any, Any]:
        call, state = self.engine.step()
        return call, dataclasses.replace(state, fork_state=kvsim_fork_state(self.engine.scheduler))


def kvsim_trajectory(
    scenario: Scenario,
    layout: SideCacheSwitch,
    requests: tuple[RequestSpec, ...],
    clock: ClockTape | None = None,
    follow_ups_until_s: float | None = None,
    engine_mode: EngineMode = "sync",
) -> Trajectory:
    """kvsim's fork mode as compared (what the golden frames are checked
    against); ``clock``: a recording's tape, kvsim's step-time model if None."""
    compared = fork_compared_scenario(scenario, engine_mode)
    step_time = clock or StepTimeModel(compared.step_time_config())
    horizon_s = compared.simulation.max_time_s
    if engine_mode == "async":
        pp = compared.deployment.pipeline_parallel_size
        engine = _ReportingKvsimEngine(kvsim_engine(compared, layout, depth=pp + 1, stagger=pp))
        return drive_engine(engine, requests, async_clock(compared, step_time), horizon_s, follow_ups_until_s)
    backend = kvsim_backend(compared, layout, reports_fork_state=True)
    return drive(backend, requests, step_time, horizon_s, follow_ups_until_s)


def fork_trajectory(
    scenario: Scenario,
    layout: SideCacheSwitch,
    requests: tuple[RequestSpec, ...],
    python: Path,
    follow_ups_until_s: float | None = None,
    engine_mode: EngineMode = "sync",
) -> tuple[Trajectory, dict[str, Any]]:
    """The fork's own Scheduler (or engine core) on the same trace, clock and
    draws, with the clock's tape, and what the fork built (its pool, groups
    and switches as it derived them)."""
    compared = fork_compared_scenario(scenario, engine_mode)
    runner = model_runner(compared.mtp.acceptance_rates, compared.seed)
    tape = ClockTape(StepTimeModel(compared.step_time_config()))
    horizon_s = compared.simulation.max_time_s
    with ForkProcess(python) as process:
        if engine_mode == "async":
            engine = ForkEngine(process, compared, layout, runner)
            clock = async_clock(compared, tape)
            trajectory = drive_engine(engine, requests, clock, horizon_s, follow_ups_until_s)
            described = engine.description
        else:
            backend = ForkBackend(process, compared, layout, runner)
            trajectory = drive(backend, requests, tape, horizon_s, follow_ups_until_s)
            described = backend.description
    return dataclasses.replace(trajectory, clock_tape=tuple(tape.values)), described


def run_fork_conformance(
    scenario: Scenario,
    layout: SideCacheSwitch,
    requests: Iterable[RequestSpec],
    python: Path,
    engine_mode: EngineMode = "sync",
) -> Comparison:
    requests = tuple(requests)
    fork, _ = fork_trajectory(scenario, layout, requests, python, engine_mode=engine_mode)
    return compare(kvsim_trajectory(scenario, layout, requests, engine_mode=engine_mode), fork)
