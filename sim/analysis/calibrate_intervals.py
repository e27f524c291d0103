"""What a replay can identify: each fitted coefficient's 95 % confidence
interval, and why a coefficient the replay cannot pin down is not fitted.

The interval is the linearised profile of the fit's error (Gauss-Newton):
with ``J`` the residuals' derivatives in the log coefficients at the best
point and ``sigma`` the residuals' noise, ``sigma^2 (J^T J)^-1`` is the
covariance of the log coefficients, so the half-width of coefficient ``i``
is ``1.96 sqrt(cov_ii)``. The inverse's diagonal is the profile's: the
other coefficients re-fitted at each value, so two coefficients that move
the times alike both get wide intervals. Why this and not a bootstrap: a
bootstrap refits per resample (a hundred fits of a hundred simulations),
and one over requests would take a burst's correlated errors for
independent ones all the same; this costs two simulations per coefficient.

``sigma`` is the fit's own residual RMS (what the model leaves unexplained:
the replay's noise and any misfit), never below ``NOISE_FLOOR``: a replay
timed over HTTP cannot be trusted to better than that, and a simulated
stand-in (which fits exactly) must not make every coefficient look exact.
A coefficient whose half-width passes ``MAX_HALF_WIDTH`` is not fitted.
No twin in vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

# Residual noise (relative) below which no replay is trusted: a replay's
# client timestamps carry the event loop's and HTTP's few milliseconds,
# multiplied by --speed, on request times of seconds.
NOISE_FLOOR = 0.005
# Two-sided 95 % (normal).
Z95 = 1.96
# Fitted only when the 95 % interval is within +-5 % of the value: what
# kvsim's figures are asked to match, a coefficient must be known to.
MAX_HALF_WIDTH = math.log(1.05)
# Set aside before the fit: even a replay as exact as the floor would leave
# the interval wider than x2 either way (fitting it would only wander).
HOPELESS_HALF_WIDTH = math.log(2.0)
# The Jacobian's step (log space): +-5 %, within the bounds.
JACOBIAN_STEP = math.log(1.05)

FITTED = "fitted"
NOT_IDENTIFIABLE = "not identifiable from this replay"
AT_BOUND = "at a bound"


def noise(residuals: np.ndarray, num_free: int) -> float:
    """The residuals' noise: their RMS over the degrees of freedom left,
    floored at ``NOISE_FLOOR``."""
    dof = max(len(residuals) - num_free, 1)
    return max(math.sqrt(float(np.sum(residuals**2)) / dof), NOISE_FLOOR)


def half_widths(jacobian: np.ndarray, sigma: float) -> np.ndarray:
    """95 % half-widths (log space) of the coefficients the Jacobian's
    columns are; infinite when the columns do not pin them down (a column
    of zeros, or columns that are parallel).

    >>> half_widths(np.array([[1.0, 0.0], [0.0, 2.0], [0.0, 0.0]]), 0.1).round(4).tolist()
    [0.196, 0.098]
    >>> half_widths(np.array([[1.0, 2.0], [1.0, 2.0]]), 0.1).tolist()
    [inf, inf]
    """
    if jacobian.shape[1] == 0:
        return np.zeros(0)
    information = jacobian.T @ jacobian
    scale = np.sqrt(np.diag(information))
    if not np.all(scale > 0):
        return np.full(jacobian.shape[1], math.inf)
    normalised = information / np.outer(scale, scale)  # unit diagonal: the condition is the shape's
    if np.linalg.cond(normalised) > 1e10:
        return np.full(jacobian.shape[1], math.inf)
    covariance = sigma**2 * np.linalg.inv(normalised) / np.outer(scale, scale)
    return np.asarray(Z95 * np.sqrt(np.maximum(np.diag(covariance), 0.0)))


def jacobian(
    error: Callable[[np.ndarray], np.ndarray],
    at: np.ndarray,
    columns: Sequence[int],
    bounds: Sequence[tuple[float, float]],
) -> np.ndarray:
    """The residuals' derivatives in the log coefficients ``columns`` at
    ``at``: central differences of ``JACOBIAN_STEP``, one-sided at a bound."""
    derivatives = []
    for i in columns:
        low = max(at[i] - JACOBIAN_STEP, bounds[i][0])
        high = min(at[i] + JACOBIAN_STEP, bounds[i][1])
        down, up = at.copy(), at.copy()
        down[i], up[i] = low, high
        derivatives.append((error(up) - error(down)) / (high - low) if high > low else error(at) * 0)
    return np.column_stack(derivatives) if derivatives else np.zeros((len(error(at)), 0))


@dataclass(frozen=True)
class BusyTime:
    """Where a simulation's engine spent its time: steps that carry a
    prefill chunk, decode-only steps, and the fixed overhead of all steps."""

    busy_s: float
    prefill_s: float
    num_steps: int
    overhead_s: float

    @property
    def prefill_share(self) -> float:
        return self.prefill_s / self.busy_s if self.busy_s > 0 else math.nan

    @property
    def overhead_share(self) -> float:
        return self.overhead_s / self.busy_s if self.busy_s > 0 else math.nan


def busy_time(steps: pd.DataFrame, step_overhead_s: float) -> BusyTime:
    """``steps``: the steps frames of a simulation (every layout)."""
    if steps.empty or "step_time_s" not in steps:
        return BusyTime(0.0, 0.0, 0, 0.0)
    time_s = steps["step_time_s"].astype(float)
    prefill_s = float(time_s[steps["num_prefill_tokens"] > 0].sum())
    return BusyTime(float(time_s.sum()), prefill_s, len(steps), len(steps) * step_overhead_s)


# A coefficient that scales less than this share of the busy time is set
# aside before the fit: a +-5 % interval on it would need the request times
# known to a part in 200 of the share (a few parts in 10^4 at 3 %), far
# below the replay's noise, and where a step end crosses an arrival the
# finite differences take the jump for a steep slope and the fit then
# claims an interval it does not have (seen on a decode-heavy replay: the
# step overhead at 3 % of busy time "fitted" 29 % off, +-2.5 %).
MIN_PHASE_SHARE = 0.1


def phase_share(name: str, busy: BusyTime) -> float | None:
    """The share of busy time ``name`` scales (None: not one of the three
    the busy time splits into, or nothing was busy)."""
    if busy.busy_s <= 0:
        return None
    shares = {
        "compute_efficiency": busy.prefill_share,
        "memory_efficiency": 1 - busy.prefill_share,
        "step_overhead_s": busy.overhead_share,
    }
    return shares.get(name)


def too_small_a_share(name: str, busy: BusyTime) -> bool:
    share = phase_share(name, busy)
    return share is not None and share < MIN_PHASE_SHARE


def phase_reason(name: str, busy: BusyTime) -> str | None:
    """Why ``name`` cannot be identified, from where the engine spent its
    time; None when the phase it acts on is not the lesser one."""
    prefill = 100 * busy.prefill_share
    if name == "memory_efficiency" and prefill >= 50:
        return f"prefill is {prefill:.0f} % of busy time; decode steps cannot identify memory_efficiency"
    if name == "compute_efficiency" and prefill <= 50:
        return f"decode is {100 - prefill:.0f} % of busy time; prefills cannot identify compute_efficiency"
    if name == "step_overhead_s" and busy.overhead_share < 0.1:
        return (
            f"the step overhead is {100 * busy.overhead_share:.1f} % of busy time ({busy.num_steps} steps); "
            "too little to identify step_overhead_s"
        )
    return None


def reason_weak(sensitivity: float, sigma: float) -> str:
    if sensitivity == 0:
        return "moving it 10 % moves no request time"
    return (
        f"moving it 10 % moves the request times {100 * math.log(1.1) * sensitivity:.2g} % (RMS) "
        f"against the replay's noise of {100 * sigma:.2g} %"
    )


def reason_alike(other: str, cosine: float) -> str:
    return (
        f"moves the request times as {other} does (cosine {cosine:+.2f}): the replay fixes their combination"
    )
