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

The simulations run at the arrivals the replay made, and compare what a
reorder inside a burst does not move (``sim.analysis.replayed_arrivals``).

Every coefficient comes out with a status (``sim.analysis.calibrate_intervals``):
``fitted``, with its 95 % interval; ``not identifiable from this replay``,
left at its start with a one-line reason drawn from the replay (it moves no
request time; it moves them as another coefficient does; it scales under a
tenth of the busy time; or its interval is too wide: "prefill is 93 % of
busy time; decode steps cannot identify memory_efficiency"); ``at a
bound``, where the fit ran to a tenth or ten times its start or to its
field's limit. The fit is bounded in simulations and in wall time; what it
has at the limit is returned and marked.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from sim.analysis.calibrate_error import (
    LATENCY_FLOOR_S,
    MIN_SENSITIVITY,
    BudgetSpent,
    RequestTimeError,
    alike_pairs,
    best_with,
    check_coefficients,
    fit_free,
    log_bounds,
    rms,
    screen,
)
from sim.analysis.calibrate_intervals import (
    AT_BOUND,
    FITTED,
    HOPELESS_HALF_WIDTH,
    MAX_HALF_WIDTH,
    NOISE_FLOOR,
    NOT_IDENTIFIABLE,
    BusyTime,
    busy_time,
    half_widths,
    jacobian,
    noise,
    phase_reason,
    reason_alike,
    reason_weak,
    too_small_a_share,
)
from sim.analysis.frames import steps_frame
from sim.analysis.replayed_arrivals import REORDER_WALL_S, replay_target
from sim.config import ConfigError
from sim.scenario import Scenario


@dataclass(frozen=True)
class Coefficient:
    """One coefficient's outcome. ``value``: fitted, at its bound, or (not
    identifiable) its start. ``half_width``: the 95 % interval's, in log
    space (infinite where the replay does not bound it)."""

    start: float
    value: float
    status: str  # FITTED, NOT_IDENTIFIABLE or AT_BOUND
    reason: str  # one line from the replay; "" when fitted
    half_width: float
    sensitivity: float  # RMS residual change per unit log change, at the start

    @property
    def interval(self) -> tuple[float, float]:
        return self.value * math.exp(-self.half_width), self.value * math.exp(self.half_width)


@dataclass(frozen=True)
class Calibration:
    coefficients: dict[str, Coefficient]
    alike: tuple[tuple[str, str, float], ...]  # (a, b, cosine): only a combination is fitted
    noise: float  # the residuals' noise the intervals assume
    rms_error_start: float
    rms_error_fitted: float
    num_simulations: int
    budget_spent: bool  # stopped by --max-simulations or --max-seconds
    arrivals: str = ""  # what the simulations' arrivals were (ReplayTarget.describe)

    def _with(self, status: str) -> dict[str, Coefficient]:
        return {name: c for name, c in self.coefficients.items() if c.status == status}

    @property
    def start(self) -> dict[str, float]:
        return {name: c.start for name, c in self.coefficients.items()}

    @property
    def fitted(self) -> dict[str, float]:
        """The fitted coefficients only: what the ``step_time:`` block holds."""
        return {name: c.value for name, c in self._with(FITTED).items()}

    @property
    def values(self) -> dict[str, float]:
        """Every coefficient as the best simulation had it."""
        return {name: c.value for name, c in self.coefficients.items()}

    @property
    def sensitivity(self) -> dict[str, float]:
        return {name: c.sensitivity for name, c in self.coefficients.items()}

    @property
    def unidentifiable(self) -> tuple[str, ...]:
        return tuple(self._with(NOT_IDENTIFIABLE))

    @property
    def at_bound(self) -> tuple[str, ...]:
        return tuple(self._with(AT_BOUND))

    def step_time(self, base: dict[str, Any]) -> dict[str, Any]:
        """The scenario's ``step_time:`` block with the fitted values."""
        return {**base, **self.fitted}


def calibrate(
    scenario: Scenario,
    measured_requests: pd.DataFrame,
    names: Sequence[str],
    *,
    max_simulations: int = 100,
    max_seconds: float = 600.0,
    reorder_window_s: float = REORDER_WALL_S,
) -> Calibration:
    """Fit ``names`` so the scenario's simulation, at the arrivals the
    replay made, reproduces the measured request times (see the module
    docstring); each coefficient with its interval and status."""
    names = check_coefficients(names)
    target = replay_target(scenario, measured_requests, reorder_window_s)
    if target.measured.empty:
        raise ConfigError("replay: no finished request to calibrate against")
    config = scenario.step_time_config()
    start = {name: float(getattr(config, name)) for name in names}
    bounds = [log_bounds(name, start[name]) for name in names]
    if max_simulations < 1 + 2 * len(names):
        raise ConfigError(
            f"--max-simulations: {max_simulations}: at least {1 + 2 * len(names)} to screen {len(names)}"
        )
    error = RequestTimeError(
        scenario, target.measured, names, start, time.monotonic() + max_seconds, max_simulations,
        workloads=target.workloads, burst_of=target.burst_of,
        floor_s=max(LATENCY_FLOOR_S, target.floor_s),
    )  # fmt: skip
    try:
        rms_start = rms(error(np.zeros(len(names))))
        effects = screen(error, bounds)
    except BudgetSpent:
        raise ConfigError("--max-seconds: spent before the fit began; allow more") from None
    fit = _Fit(error, bounds, effects, config.step_overhead_s)
    fit.run()
    return Calibration(
        coefficients=fit.coefficients(),
        alike=alike_pairs(effects),
        noise=fit.sigma,
        rms_error_start=rms_start,
        rms_error_fitted=rms(fit.residuals),
        num_simulations=len(error.evaluations),
        budget_spent=fit.budget_spent,
        arrivals=target.describe(),
    )


class _Fit:
    """The fit's phases: coefficients without effect, the weaker of two
    that act alike, and those even an exact replay could not bound within
    x2 (intervals at the noise floor, from the screen) are set aside before
    the fit; the rest join it one by one (``_add_one_by_one``); after it,
    the widest whose interval is too wide is set aside and the rest
    refitted, until every one left is bound. A coefficient set aside stays
    at its start: the best evaluation is always one that did not move it
    (``best_with``)."""

    def __init__(
        self,
        error: RequestTimeError,
        bounds: list[tuple[float, float]],
        effects: dict[str, np.ndarray],
        step_overhead_s: float,
    ) -> None:
        self.error, self.bounds, self.effects = error, bounds, effects
        self.names = error.names
        self.screened = np.column_stack([effects[name] for name in self.names])
        self.step_overhead_s = step_overhead_s
        self.reasons: dict[int, str] = {}
        self.free = [i for i, name in enumerate(self.names) if rms(effects[name]) >= MIN_SENSITIVITY]
        self.budget_spent = False
        self.sigma = NOISE_FLOOR
        self.widths = np.full(len(self.names), math.inf)
        self.best, self.residuals = np.zeros(len(self.names)), np.zeros(0)
        self._busy: BusyTime | None = None
        # The simplex stops once its squared errors differ by less than a
        # part in 10^4 of the start's (or 1e-6): finer is below any noise,
        # and a piecewise error (a step end that crosses an arrival) would
        # keep it polishing to the budget.
        self.fatol = max(1e-6, 1e-4 * float(np.sum(error(np.zeros(len(self.names))) ** 2)))

    def run(self) -> None:
        for i in range(len(self.names)):
            if i not in self.free or too_small_a_share(self.names[i], self.busy()):
                self._set_aside(i, NOISE_FLOOR)
        self._set_aside_alike()
        self._set_aside_wide(self.screened[:, self.free], NOISE_FLOOR, HOPELESS_HALF_WIDTH, refit=False)
        # The fits leave two simulations per coefficient for the last intervals.
        total = self.error.max_simulations
        self.error.max_simulations = max(total - 2 * len(self.free), len(self.error.evaluations))
        try:
            self._add_one_by_one()
        finally:
            self.error.max_simulations = total
        while True:
            self.best, self.residuals = best_with(self.error, self.free)
            self.sigma = noise(self.residuals, len(self.free))
            derivatives = self._jacobian()
            if not self._set_aside_wide(derivatives, self.sigma, MAX_HALF_WIDTH, refit=True):
                self._set_aside_unconverged(derivatives)
                return

    def _half_widths(self, derivatives: np.ndarray, free: list[int], sigma: float) -> np.ndarray:
        """The wider of the intervals from ``derivatives`` and from the
        screen's (+-10 % at the start): a finite difference that straddles
        a jump of the error (a step end crossing an arrival) takes the jump
        for a slope and would make a coefficient look pinned down."""
        return np.maximum(half_widths(derivatives, sigma), half_widths(self.screened[:, free], sigma))

    def _set_aside_unconverged(self, derivatives: np.ndarray) -> None:
        """A fit the budget stopped is no minimum: a coefficient whose
        Gauss-Newton step from the best point is more than half its
        interval is not where the replay puts it, whatever its interval."""
        if not self.budget_spent or not self.free:
            return
        step = np.linalg.lstsq(derivatives, -self.residuals, rcond=None)[0]
        for i, move in zip(list(self.free), step, strict=True):
            if abs(move) > self.widths[i] / 2 and not self._at_bound(i):
                self._set_aside(i, self.sigma)
        self.best, self.residuals = best_with(self.error, self.free)

    def _add_one_by_one(self) -> None:
        """Fit the most sensitive coefficient alone, then add the others,
        most sensitive first, each only if the intervals the fit would then
        have (Gauss-Newton's prediction at the best point so far) all close
        within ``MAX_HALF_WIDTH``: a coefficient the replay cannot pin down
        is never let loose to wander along a flat valley with the others."""
        queue = sorted(self.free, key=lambda i: -rms(self.effects[self.names[i]]))
        self.free = queue[:1]
        if self.free:
            self.budget_spent = fit_free(self.error, self.free, self.bounds, fatol=self.fatol)
        for candidate in queue[1:]:
            if self.budget_spent:
                self._set_aside(candidate, self.sigma)
                continue
            best, residuals = best_with(self.error, self.free)
            trial = [*self.free, candidate]
            try:
                derivatives = jacobian(self.error, best, trial, self.bounds)
            except BudgetSpent:
                self.budget_spent = True
                self._set_aside(candidate, self.sigma)
                continue
            step = np.linalg.lstsq(derivatives, -residuals, rcond=None)[0]
            self.sigma = noise(residuals + derivatives @ step, len(trial))
            widths = self._half_widths(derivatives, trial, self.sigma)
            self.widths[trial] = widths
            if np.all(widths <= MAX_HALF_WIDTH):
                self.free = trial
                self.budget_spent = fit_free(self.error, self.free, self.bounds, best, self.fatol)
            else:
                self._set_aside(candidate, self.sigma)

    def _jacobian(self) -> np.ndarray:
        """At the best point; the screen's at the start once the budget is spent."""
        try:
            return jacobian(self.error, self.best, self.free, self.bounds)
        except BudgetSpent:
            self.budget_spent = True
            return self.screened[:, self.free]

    def _set_aside_wide(self, derivatives: np.ndarray, sigma: float, limit: float, *, refit: bool) -> bool:
        """Set aside the free coefficient with the widest interval past
        ``limit`` (not one at a bound: its interval is one-sided),
        repeatedly when no refit follows; True if one was."""
        columns = {i: k for k, i in enumerate(self.free)}
        while self.free:
            widths = self._half_widths(derivatives[:, [columns[i] for i in self.free]], self.free, sigma)
            self.widths[self.free] = widths
            wide = [i for i, w in zip(self.free, widths, strict=True) if w > limit]
            wide = [i for i in wide if not self._at_bound(i)]
            if not wide:
                return False
            self._set_aside(max(wide, key=lambda i: self.widths[i]), sigma)
            if refit:
                if self.free and not self.budget_spent:
                    self.budget_spent = fit_free(self.error, self.free, self.bounds, self.best, self.fatol)
                return True
        return False

    def _set_aside(self, i: int, sigma: float) -> None:
        """``i`` out of the fit, with its reason: the phase it acts on is
        the lesser; it moves the times as a coefficient still fitted does;
        the budget ran out before its interval closed; or its effect is
        small against the noise."""
        if i in self.free:
            self.free.remove(i)
        name = self.names[i]
        sensitivity = rms(self.effects[name])
        reason = phase_reason(name, self.busy()) or self._alike_reason(name)
        if reason is None and self.budget_spent and math.isfinite(self.widths[i]):
            reason = (
                f"the fit's budget ran out with its interval at +-{100 * math.expm1(self.widths[i]):.3g} %; "
                "allow more simulations"
            )
        # Below what the screen resolves: no effect.
        self.reasons[i] = reason or reason_weak(sensitivity if sensitivity >= MIN_SENSITIVITY else 0.0, sigma)

    def _alike_reason(self, name: str) -> str | None:
        for first, second, cosine in alike_pairs(self.effects):
            other = second if first == name else first if second == name else None
            if other is not None and self.names.index(other) in self.free:
                return reason_alike(other, cosine)
        return None

    def _set_aside_alike(self) -> None:
        """Of two free coefficients that move the times alike, the replay
        fixes only their combination: the less sensitive one is set aside."""
        for first, second, _ in alike_pairs(self.effects):
            pair = [self.names.index(first), self.names.index(second)]
            if all(i in self.free for i in pair):
                weaker = min(pair, key=lambda i: rms(self.effects[self.names[i]]))
                self._set_aside(weaker, NOISE_FLOOR)

    def busy(self) -> BusyTime:
        """Where the simulation at the start spent its time (for reasons)."""
        if self._busy is None:
            recordings = self.error.simulate(self.error.start)
            steps = pd.concat([steps_frame(r) for r in recordings], ignore_index=True)
            self._busy = busy_time(steps, self.step_overhead_s)
        return self._busy

    def _at_bound(self, i: int) -> bool:
        return min(abs(self.best[i] - b) for b in self.bounds[i]) < 1e-6

    def coefficients(self) -> dict[str, Coefficient]:
        outcome = {}
        for i, name in enumerate(self.names):
            start = self.error.start[name]
            status = NOT_IDENTIFIABLE if i in self.reasons else AT_BOUND if self._at_bound(i) else FITTED
            reason = self.reasons.get(i, "")
            if status == AT_BOUND:
                reason = "the fit ran to its bound: the replay asks for a value past it"
            outcome[name] = Coefficient(
                start=start,
                value=start * math.exp(self.best[i]),
                status=status,
                reason=reason,
                half_width=math.inf if status == NOT_IDENTIFIABLE else float(self.widths[i]),
                sensitivity=rms(self.effects[name]),
            )
        return outcome
