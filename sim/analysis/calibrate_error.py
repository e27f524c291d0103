"""The error a calibration minimises: the replay's figures against a
simulation's at candidate step-time coefficients (log space), and the
fit's building blocks: the screen of each coefficient's effect, the pairs
that act alike, the bounded Nelder-Mead. ``sim.analysis.calibrate`` runs
them. No twin in vLLM.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from sim.analysis.frames import requests_frame
from sim.analysis.replayed_arrivals import REQUEST_COLUMNS, burst_times
from sim.analysis.runs import scenario_workload
from sim.config import ConfigError
from sim.engine import Recording, simulate
from sim.scenario import Scenario
from sim.step_time import StepTimeConfig
from sim.workloads import Workload

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


def relative_residuals(
    simulated: pd.DataFrame, measured: pd.DataFrame, floor_s: float = LATENCY_FLOOR_S
) -> np.ndarray:
    """One residual per measured request and time (TTFT, then e2e): the
    same length whatever the simulation finished, so candidates compare."""
    aligned = simulated.reindex(measured.index)
    scale = np.maximum(measured.to_numpy(float), floor_s)
    residuals = (aligned.to_numpy(float) - measured.to_numpy(float)) / scale
    return np.nan_to_num(residuals, nan=MISSING_RESIDUAL).ravel(order="F")


class BudgetSpent(Exception):
    """The fit reached its limit of simulations or of wall time."""


@dataclass
class RequestTimeError:
    """The residuals of a scenario's simulation, as a function of the fitted
    coefficients in log space; remembers every evaluation and the best.

    ``workloads``: per layout, the requests at the arrivals the replay made
    (default: the scenario's own). ``burst_of``: (layout, request id) to its
    burst, compared by its last first token and last finish (default:
    every request matched by itself)."""

    scenario: Scenario
    measured: pd.DataFrame
    names: tuple[str, ...]
    start: dict[str, float]
    deadline_s: float = math.inf
    max_simulations: int = 1_000_000
    evaluations: dict[tuple[float, ...], np.ndarray] = field(default_factory=dict)
    workloads: dict[str, Workload] | None = None
    burst_of: pd.Series | None = None
    floor_s: float = LATENCY_FLOOR_S  # the residuals' scale below which a time is compared absolutely

    def __post_init__(self) -> None:
        self.layouts = tuple(dict.fromkeys(self.measured.index.get_level_values(0)))
        if self.workloads is None:
            workload = scenario_workload(self.scenario)
            self.workloads = dict.fromkeys(self.layouts, workload)

    def values(self, x: np.ndarray) -> dict[str, float]:
        return {name: self.start[name] * math.exp(float(v)) for name, v in zip(self.names, x, strict=True)}

    def __call__(self, x: np.ndarray) -> np.ndarray:
        key = tuple(np.round(np.asarray(x, float), 12))
        if key not in self.evaluations:
            if time.monotonic() > self.deadline_s or len(self.evaluations) >= self.max_simulations:
                raise BudgetSpent
            simulated = self.simulated_times(self.values(x))
            self.evaluations[key] = relative_residuals(simulated, self.measured, self.floor_s)
        return self.evaluations[key]

    def simulated_times(self, values: dict[str, float]) -> pd.DataFrame:
        requests = pd.concat([requests_frame(r) for r in self.simulate(values)], ignore_index=True)
        if self.burst_of is None:
            return finished_times(requests)
        return burst_times(requests, self.burst_of)

    def simulate(self, values: dict[str, float]) -> list[Recording]:
        """One simulation per layout at ``values`` (not counted: for reports)."""
        assert self.workloads is not None
        scenario = with_step_time(self.scenario, values)
        return [simulate(scenario, layout, self.workloads[layout]) for layout in self.layouts]


def with_step_time(scenario: Scenario, values: dict[str, float]) -> Scenario:
    return scenario.model_copy(update={"step_time": {**scenario.step_time, **values}})


def rms(residuals: np.ndarray) -> float:
    return float(np.sqrt(np.mean(residuals**2))) if len(residuals) else float("nan")


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


def fit_free(
    error: RequestTimeError,
    free: list[int],
    bounds: list[tuple[float, float]],
    start: np.ndarray | None = None,
    fatol: float = 1e-6,
) -> bool:
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

    x0 = np.zeros(len(free)) if start is None else np.asarray(start, float)[free]
    x0 = np.clip(x0, [bounds[i][0] for i in free], [bounds[i][1] for i in free])
    simplex = np.vstack([x0, x0 + SIMPLEX_STEP * np.eye(len(free))])
    try:
        minimize(
            lambda x_free: float(np.sum(error(embedded(x_free)) ** 2)),
            x0,
            method="Nelder-Mead",
            bounds=[bounds[i] for i in free],
            options={"initial_simplex": simplex, "xatol": X_TOLERANCE, "fatol": fatol, "maxfev": 10**6},
        )
    except BudgetSpent:
        return True
    return False


def best_with(error: RequestTimeError, free: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The best evaluation that moved only free coefficients (screening
    also moved the unidentifiable ones, which stay at their start)."""
    fixed = [i for i in range(len(error.names)) if i not in free]
    candidates = {k: r for k, r in error.evaluations.items() if all(k[i] == 0 for i in fixed)}
    key = min(candidates, key=lambda k: float(np.sum(candidates[k] ** 2)))
    return np.array(key), candidates[key]
