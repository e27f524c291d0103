"""Design of experiments: before rig time is spent, which coefficients a
replay of a scenario would identify, and what to replay for the others.

The planned replay is simulated once at the scenario's coefficients and
taken as its own measurement, compared as a replay would be (requests that
arrive within the reorder window form bursts); each coefficient is moved
10 % each way, and the intervals a replay with ``PLAN_NOISE`` would leave
are predicted (Gauss-Newton), adding coefficients most sensitive first as
``kvsim calibrate`` does. A coefficient is identifiable when its interval
closes within ``MAX_HALF_WIDTH``. No twin in vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from sim.analysis.calibrate_error import (
    LATENCY_FLOOR_S,
    MIN_SENSITIVITY,
    RequestTimeError,
    alike_pairs,
    check_coefficients,
    log_bounds,
    rms,
    screen,
)
from sim.analysis.calibrate_intervals import (
    MAX_HALF_WIDTH,
    BusyTime,
    busy_time,
    half_widths,
    phase_reason,
    reason_alike,
    reason_weak,
    too_small_a_share,
)
from sim.analysis.frames import requests_frame, steps_frame
from sim.analysis.replayed_arrivals import REORDER_WALL_S, replay_target
from sim.analysis.runs import scenario_workload
from sim.engine import simulate
from sim.scenario import Scenario, SideCacheSwitch

# The relative noise a replay leaves at the true coefficients: what replays
# against kvsim serve left (1-4 %: the server's MTP draws and HTTP timing).
PLAN_NOISE = 0.02
# What to replay for a coefficient this load cannot identify.
REMEDY = {
    "memory_efficiency": "a decode-heavy slice: prompts of a few dozen tokens, outputs of hundreds",
    "compute_efficiency": "a cold long prompt: thousands of tokens, a few output tokens, no shared prefix",
    "step_overhead_s": "a burst of many short requests: many small steps, the fixed cost a large share",
}


@dataclass(frozen=True)
class PlannedCoefficient:
    name: str
    sensitivity: float  # RMS change of the compared times per unit log change
    half_width: float  # the 95 % interval expected (log space; inf: unbounded)
    identifiable: bool
    reason: str  # why not ("" when identifiable)
    remedy: str  # what to replay instead ("" when identifiable)


def plan(
    scenario: Scenario, names: Sequence[str], layout: SideCacheSwitch = "on", speed: float = 1.0
) -> tuple[list[PlannedCoefficient], BusyTime]:
    """Each of ``names`` as a replay of ``scenario`` at ``speed`` would have
    it, and where that replay's engine would spend its time."""
    names = check_coefficients(names)
    recording = simulate(scenario, layout, scenario_workload(scenario))
    requests = requests_frame(recording)
    window_s = REORDER_WALL_S * speed
    # As a replay records it: sent at the stamps, its order unknown.
    target = replay_target(scenario, requests.assign(sent_s=requests["arrival_s"]), window_s)
    start = {name: float(getattr(scenario.step_time_config(), name)) for name in names}
    error = RequestTimeError(
        scenario, target.measured, names, start,
        workloads=target.workloads, burst_of=target.burst_of, floor_s=max(LATENCY_FLOOR_S, target.floor_s),
    )  # fmt: skip
    effects = screen(error, [log_bounds(name, start[name]) for name in names])
    busy = busy_time(steps_frame(recording), scenario.step_time_config().step_overhead_s)
    widths = _predicted_widths(effects, [name for name in names if not too_small_a_share(name, busy)])
    return [_planned(name, effects, widths, busy) for name in names], busy


def _predicted_widths(effects: dict[str, np.ndarray], names: Sequence[str]) -> dict[str, float]:
    """Most sensitive first, each added while every interval stays within
    ``MAX_HALF_WIDTH``; a coefficient not added keeps its interval alone,
    one not among ``names`` (too small a share of busy time) is unbounded."""
    order = sorted(names, key=lambda name: -rms(effects[name]))
    chosen: list[str] = []
    widths = dict.fromkeys(effects, math.inf)
    for name in order:
        if rms(effects[name]) < MIN_SENSITIVITY:
            widths[name] = math.inf
            continue
        trial = [*chosen, name]
        trial_widths = half_widths(np.column_stack([effects[n] for n in trial]), PLAN_NOISE)
        if np.all(trial_widths <= MAX_HALF_WIDTH):
            chosen = trial
            widths.update(zip(trial, map(float, trial_widths), strict=True))
        else:
            widths[name] = float(trial_widths[-1])
    return widths


def _planned(
    name: str, effects: dict[str, np.ndarray], widths: dict[str, float], busy: BusyTime
) -> PlannedCoefficient:
    sensitivity = rms(effects[name])
    identifiable = widths[name] <= MAX_HALF_WIDTH
    reason = ""
    if not identifiable:
        alike = [(a if b == name else b, cos) for a, b, cos in alike_pairs(effects) if name in (a, b)]
        reason = (
            phase_reason(name, busy)
            or (reason_alike(*alike[0]) if alike else None)
            or reason_weak(sensitivity if sensitivity >= MIN_SENSITIVITY else 0.0, PLAN_NOISE)
        )
    remedy = "" if identifiable else REMEDY.get(name, "a load where it is a larger share of the step time")
    return PlannedCoefficient(name, sensitivity, widths[name], identifiable, reason, remedy)


def _interval_text(half_width: float) -> str:
    if not half_width < math.log(10):  # infinite, or beyond a decade (the fit's own bounds)
        return "unbounded"
    return f"+-{100 * math.expm1(half_width):.2g} %"


def plan_table(planned: list[PlannedCoefficient]) -> pd.DataFrame:
    rows = [
        {
            "coefficient": p.name,
            "sensitivity": f"{p.sensitivity:.3g}",
            "expected_interval": _interval_text(p.half_width),
            "verdict": "identifiable" if p.identifiable else "not identifiable",
        }
        for p in planned
    ]
    return pd.DataFrame(rows).set_index("coefficient")
