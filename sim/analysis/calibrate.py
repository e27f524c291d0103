"""Fit step-time coefficients (``sim.step_time``) to a replay: re-simulate
the replay's scenario with candidate coefficients and minimise the error of
every finished request's time to first token and end-to-end latency against
the measured ones. No twin in vLLM (BLIS's calibrate step is the anchor).

The fit works on ``log(coefficient / start)`` (coefficients span decades;
a step is a percentage), bounded to a tenth and ten times the start and to
the coefficient's own limits (an efficiency is at most 1). Residuals are
relative errors, ``(simulated - measured) / max(measured, 10 ms)``, so a
request that waited a minute counts no more than one served at once; a
request the measurement finished and the simulation did not counts 1 (100 %).

A coefficient that does not move the simulated request times (an efficiency
of a bound the load never reaches: compute on a decode-only load) cannot be
fitted: it is found before the fit, by moving it 10 % each way, reported as
unidentifiable and left at its start, never "recovered". The fit is bounded
in simulations and in wall time; what it has at the limit is returned and
marked.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from sim.analysis.frames import requests_frame
from sim.analysis.runs import scenario_workload
from sim.config import ConfigError
from sim.engine import simulate
from sim.scenario import Scenario
from sim.step_time import StepTimeConfig

LATENCY_FLOOR_S = 0.010
MISSING_RESIDUAL = 1.0
# The fit moves each coefficient within [start / RANGE, start * RANGE].
RANGE = 10.0
# Screening moves a coefficient by this much in log space (about 10 %).
SCREEN_STEP = math.log(1.1)
# Below this RMS change of the relative residuals per unit of log
# coefficient, a coefficient does not move the request times.
MIN_SENSITIVITY = 1e-4
# Two coefficients whose effects have a cosine beyond this are "alike".
ALIKE_COSINE = 0.95
# The fit's first simplex spans +25 % on each coefficient; it stops when
# the simplex has shrunk to 0.5 % (log space).
SIMPLEX_STEP = math.log(1.25)
X_TOLERANCE = 0.005


def fittable_coefficients() -> tuple[str, ...]:
    """The float coefficients (counts and the parallelism are not fitted)."""
    return tuple(
        name
        for name, info in StepTimeConfig.model_fields.items()
        if info.annotation is float and name not in ("tensor_parallel_size", "pipeline_parallel_size")
    )


def check_coefficients(names: Sequence[str]) -> tuple[str, ...]:
    """``names`` if each can be fitted; else a one-line error."""
    allowed = fittable_coefficients()
    unknown = [name for name in names if name not in allowed]
    if unknown or not names:
        raise ConfigError(
            f"--fit: cannot fit {', '.join(unknown) or 'nothing'}; choose among {', '.join(allowed)}"
        )
    if len(set(names)) != len(names):
        raise ConfigError(f"--fit: a coefficient is named twice: {', '.join(names)}")
    return tuple(names)


def log_bounds(name: str, start: float) -> tuple[float, float]:
    """Bounds of ``log(value / start)``: a decade each way, within the field's own limits."""
    if not start > 0:
        raise ConfigError(f"step_time: {name}: cannot fit from {start}; start it above 0")
    low, high = start / RANGE, start * RANGE
    for limit in StepTimeConfig.model_fields[name].metadata:  # pydantic's Le, Lt, Ge, Gt
        upper, lower = (
            getattr(limit, "le", getattr(limit, "lt", None)),
            getattr(limit, "ge", getattr(limit, "gt", None)),
        )
        if upper is not None:
            high = min(high, float(upper) * (1 - 1e-9))
        if lower is not None:
            low = max(low, float(lower) * (1 + 1e-9))
    return math.log(low / start), max(math.log(high / start), 0.0)


REQUEST_COLUMNS = ("layout", "request_id", "arrival_s", "first_token_s", "finished_s")


def finished_times(requests: pd.DataFrame) -> pd.DataFrame:
    """TTFT and end-to-end latency of each finished request, by (layout, request_id)."""
    missing = [column for column in REQUEST_COLUMNS if column not in requests]
    if missing:
        raise ConfigError(f"requests: no column {', '.join(missing)}: cannot time the requests")
    finished = requests[requests["finished_s"].notna()]
    ttft = finished["first_token_s"] - finished["arrival_s"]
    e2e = finished["finished_s"] - finished["arrival_s"]
    return pd.DataFrame(
        {"ttft_s": ttft.to_numpy(float), "e2e_s": e2e.to_numpy(float)},
        index=pd.MultiIndex.from_arrays([finished["layout"], finished["request_id"].astype(str)]),
    )


def relative_residuals(simulated: pd.DataFrame, measured: pd.DataFrame) -> np.ndarray:
    """One residual per measured request and time (TTFT, then e2e): the
    same length whatever the simulation finished, so candidates compare."""
    aligned = simulated.reindex(measured.index)
    scale = np.maximum(measured.to_numpy(float), LATENCY_FLOOR_S)
    residuals = (aligned.to_numpy(float) - measured.to_numpy(float)) / scale
    return np.nan_to_num(residuals, nan=MISSING_RESIDUAL).ravel(order="F")


class BudgetSpent(Exception):
    """The fit reached its limit of simulations or of wall time."""


@dataclass
class RequestTimeError:
    """The residuals of a scenario's simulation, as a function of the fitted
    coefficients in log space; remembers every evaluation and the best."""

    scenario: Scenario
    measured: pd.DataFrame
    names: tuple[str, ...]
    start: dict[str, float]
    deadline_s: float = math.inf
    max_simulations: int = 1_000_000
    evaluations: dict[tuple[float, ...], np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.workload = scenario_workload(self.scenario)
        self.layouts = tuple(dict.fromkeys(self.measured.index.get_level_values(0)))

    def values(self, x: np.ndarray) -> dict[str, float]:
        return {name: self.start[name] * math.exp(float(v)) for name, v in zip(self.names, x, strict=True)}

    def __call__(self, x: np.ndarray) -> np.ndarray:
        key = tuple(np.round(np.asarray(x, float), 12))
        if key not in self.evaluations:
            if time.monotonic() > self.deadline_s or len(self.evaluations) >= self.max_simulations:
                raise BudgetSpent
            self.evaluations[key] = relative_residuals(self.simulated_times(self.values(x)), self.measured)
        return self.evaluations[key]

    def simulated_times(self, values: dict[str, float]) -> pd.DataFrame:
        scenario = with_step_time(self.scenario, values)
        frames = [requests_frame(simulate(scenario, layout, self.workload)) for layout in self.layouts]
        return finished_times(pd.concat(frames, ignore_index=True))


def with_step_time(scenario: Scenario, values: dict[str, float]) -> Scenario:
    return scenario.model_copy(update={"step_time": {**scenario.step_time, **values}})


def rms(residuals: np.ndarray) -> float:
    return float(np.sqrt(np.mean(residuals**2))) if len(residuals) else float("nan")


@dataclass(frozen=True)
class Calibration:
    start: dict[str, float]
    fitted: dict[str, float]  # the identifiable coefficients only
    sensitivity: dict[str, float]  # RMS residual change per unit log change
    unidentifiable: tuple[str, ...]
    alike: tuple[tuple[str, str, float], ...]  # (a, b, cosine): only a combination is fitted
    at_bound: tuple[str, ...]
    rms_error_start: float
    rms_error_fitted: float
    num_simulations: int
    budget_spent: bool  # stopped by --max-simulations or --max-seconds

    def step_time(self, base: dict[str, Any]) -> dict[str, Any]:
        """The scenario's ``step_time:`` block with the fitted values."""
        return {**base, **self.fitted}


def screen(error: RequestTimeError, bounds: list[tuple[float, float]]) -> dict[str, np.ndarray]:
    """Each coefficient's effect on the residuals, per unit of its log:
    moved ~10 % each way (within its bounds)."""
    effects = {}
    for index, name in enumerate(error.names):
        low, high = max(-SCREEN_STEP, bounds[index][0]), min(SCREEN_STEP, bounds[index][1])
        moved = [np.zeros(len(error.names)) for _ in range(2)]
        moved[0][index], moved[1][index] = low, high
        change = error(moved[1]) - error(moved[0])
        effects[name] = change / (high - low) if high > low else np.zeros_like(change)
    return effects


def alike_pairs(effects: dict[str, np.ndarray]) -> tuple[tuple[str, str, float], ...]:
    """Pairs of coefficients whose effects on the request times are (nearly)
    parallel, with the cosine between them: the replay then pins down a
    combination of the two, not each (e.g. the peak FLOPs and the compute
    efficiency only ever act as their product: cosine 1)."""
    names = [name for name, effect in effects.items() if rms(effect) >= MIN_SENSITIVITY]
    pairs = []
    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            a, b = effects[first], effects[second]
            cosine = float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))
            if abs(cosine) >= ALIKE_COSINE:
                pairs.append((first, second, cosine))
    return tuple(pairs)


def calibrate(
    scenario: Scenario,
    measured_requests: pd.DataFrame,
    names: Sequence[str],
    *,
    max_simulations: int = 100,
    max_seconds: float = 600.0,
) -> Calibration:
    """Fit ``names`` so the scenario's simulation reproduces the measured
    requests' TTFT and end-to-end latency (see the module docstring)."""
    names = check_coefficients(names)
    measured = finished_times(measured_requests)
    if measured.empty:
        raise ConfigError("replay: no finished request to calibrate against")
    config = scenario.step_time_config()
    start = {name: float(getattr(config, name)) for name in names}
    bounds = [log_bounds(name, start[name]) for name in names]
    error = RequestTimeError(
        scenario, measured, names, start, time.monotonic() + max_seconds, max_simulations
    )
    if max_simulations < 1 + 2 * len(names):
        raise ConfigError(
            f"--max-simulations: {max_simulations}: at least {1 + 2 * len(names)} to screen {len(names)}"
        )
    try:
        rms_start = rms(error(np.zeros(len(names))))
        effects = screen(error, bounds)
    except BudgetSpent:
        raise ConfigError("--max-seconds: spent before the fit began; allow more") from None
    sensitivity = {name: rms(effect) for name, effect in effects.items()}
    free = [i for i, name in enumerate(names) if sensitivity[name] >= MIN_SENSITIVITY]
    budget_spent = bool(free) and _fit_free(error, free, bounds)
    best, residuals = _best_with(error, free)
    fitted = {names[i]: start[names[i]] * math.exp(best[i]) for i in free}
    at_bound = tuple(names[i] for i in free if min(abs(best[i] - b) for b in bounds[i]) < 1e-6)
    return Calibration(
        start=start,
        fitted=fitted,
        sensitivity=sensitivity,
        unidentifiable=tuple(name for name in names if sensitivity[name] < MIN_SENSITIVITY),
        alike=alike_pairs(effects),
        at_bound=at_bound,
        rms_error_start=rms_start,
        rms_error_fitted=rms(residuals),
        num_simulations=len(error.evaluations),
        budget_spent=budget_spent,
    )


def _fit_free(error: RequestTimeError, free: list[int], bounds: list[tuple[float, float]]) -> bool:
    """Nelder-Mead over the free coefficients, the others at their start;
    True if the budget stopped it.

    Derivative-free on purpose: the error is piecewise smooth (a step end
    that moves past an arrival changes the next batch), and a finite-
    difference gradient takes those jumps for slopes; least squares (trf)
    stalled on them in trials, where the simplex walked over them."""
    from scipy.optimize import minimize

    def embedded(x_free: np.ndarray) -> np.ndarray:
        x = np.zeros(len(error.names))
        x[free] = x_free
        return x

    simplex = np.vstack([np.zeros(len(free)), SIMPLEX_STEP * np.eye(len(free))])
    try:
        minimize(
            lambda x_free: float(np.sum(error(embedded(x_free)) ** 2)),
            np.zeros(len(free)),
            method="Nelder-Mead",
            bounds=[bounds[i] for i in free],
            options={"initial_simplex": simplex, "xatol": X_TOLERANCE, "fatol": 1e-6, "maxfev": 10**6},
        )
    except BudgetSpent:
        return True
    return False


def _best_with(error: RequestTimeError, free: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The best evaluation that moved only free coefficients (screening
    also moved the unidentifiable ones, which stay at their start)."""
    fixed = [i for i in range(len(error.names)) if i not in free]
    candidates = {k: r for k, r in error.evaluations.items() if all(k[i] == 0 for i in fixed)}
    key = min(candidates, key=lambda k: float(np.sum(candidates[k] ** 2)))
    return np.array(key), candidates[key]
