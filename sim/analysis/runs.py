"""Run a scenario under one or more layouts and collect its frames."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from sim.analysis.frames import comparison_table, frames
from sim.config import ConfigError
from sim.engine import simulate
from sim.scenario import Scenario, SideCacheSwitch, check_sample_rows
from sim.workloads import Workload, build_workload


@dataclass(frozen=True)
class RunResult:
    scenario: Scenario
    steps: pd.DataFrame
    requests: pd.DataFrame
    samples: pd.DataFrame
    summary: pd.DataFrame

    def frames(self) -> dict[str, pd.DataFrame]:
        return {
            "steps": self.steps,
            "requests": self.requests,
            "samples": self.samples,
            "summary": self.summary,
        }

    def comparison(self) -> pd.DataFrame:
        return comparison_table(self.summary)


def scenario_workload(scenario: Scenario) -> Workload:
    """The scenario's workload; a one-line error if sampling its arrivals
    would take more than ``MAX_SAMPLE_ROWS`` rows."""
    workload = build_workload(scenario.workload, base_dir=Path(scenario.base_dir), seed=scenario.seed)
    interval_s = scenario.simulation.sample_interval_s
    # Sampling certainly runs to the last arrival (or the horizon before it).
    span_s = min(workload.duration_s, scenario.simulation.max_time_s or workload.duration_s)
    if interval_s is not None:
        try:
            check_sample_rows(span_s, interval_s, "the last arrival at")
        except ValueError as error:
            raise ConfigError(f"{scenario.name}: simulation.{error}") from None
    return workload


def open_loop_workload(scenario: Scenario, what: str) -> Workload:
    """The scenario's workload for a command that sends requests at fixed
    times (a replay, a timed trace); a one-line error for a closed-loop
    one, whose follow-ups arrive only when the turn before them ends."""
    workload = scenario_workload(scenario)
    if workload.follow_ups():
        raise ConfigError(
            f"{scenario.name}: workload.trace sessions is closed loop (a follow-up arrives when the "
            f"turn before it ends); {what} sends requests at fixed times"
        )
    return workload


def run_scenario(
    scenario: Scenario, layouts: Sequence[SideCacheSwitch] | None = None, *, progress: bool = False
) -> RunResult:
    """Simulate ``scenario`` under each layout on the same workload and seed."""
    workload = scenario_workload(scenario)
    steps, requests, samples, summaries = [], [], [], []
    for layout in layouts or scenario.layouts:
        recording = simulate(scenario, layout, workload, progress=progress)
        step_frame, request_frame, sample_frame, summary = frames(recording)
        steps.append(step_frame)
        requests.append(request_frame)
        samples.append(sample_frame)
        summaries.append(summary)
    return RunResult(
        scenario=scenario,
        steps=pd.concat(steps, ignore_index=True),
        requests=pd.concat(requests, ignore_index=True),
        samples=pd.concat(samples, ignore_index=True),
        summary=pd.DataFrame.from_records(summaries),
    )
