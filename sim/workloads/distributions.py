"""Arrival processes and length distributions for synthetic workloads.

No twin in vLLM (its benchmark client draws Poisson or gamma inter-arrival
times the same way: ``--request-rate`` with ``--burstiness`` = gamma shape).

Every sampler takes the ``numpy.random.Generator`` it draws from; none holds
one, so two simulations never share a random stream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from sim.config import MAX_REQUEST_TOKENS

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

# Standard normal quantile at 0.9: a log-normal's p90 is exp(mu + Z90 * sigma).
Z90 = 1.2815515655446004


def _check_rate(rate_per_s: float) -> None:
    if not (math.isfinite(rate_per_s) and rate_per_s > 0):
        raise ValueError(f"rate_per_s: expected a finite rate > 0, got {rate_per_s}")


class ArrivalProcess(Protocol):
    """A renewal process: i.i.d. gaps between arrivals, mean ``1 / rate_per_s``."""

    @property
    def rate_per_s(self) -> float: ...

    def inter_arrival_s(self, num: int, rng: np.random.Generator) -> FloatArray: ...


def arrival_times_s(process: ArrivalProcess, num: int, rng: np.random.Generator) -> FloatArray:
    """Arrival times of ``num`` requests; the clock starts at 0, so the first
    request arrives after one gap (not at 0), as in a renewal process.

    >>> arrival_times_s(Constant(rate_per_s=2.0), 3, np.random.default_rng(0))
    array([0.5, 1. , 1.5])
    """
    return np.cumsum(process.inter_arrival_s(num, rng))


@dataclass(frozen=True, kw_only=True, slots=True)
class Poisson:
    """Exponential gaps: memoryless arrivals, CV of the gaps = 1."""

    rate_per_s: float

    def __post_init__(self) -> None:
        _check_rate(self.rate_per_s)

    def inter_arrival_s(self, num: int, rng: np.random.Generator) -> FloatArray:
        return rng.exponential(1.0 / self.rate_per_s, size=num)


@dataclass(frozen=True, kw_only=True, slots=True)
class Gamma:
    """Gamma gaps with coefficient of variation ``cv``: bursty when cv > 1.

    Shape ``k = 1 / cv**2`` and scale ``1 / (rate * k)`` keep the mean gap at
    ``1 / rate`` whatever the burstiness; cv = 1 is exactly Poisson.
    """

    rate_per_s: float
    cv: float

    def __post_init__(self) -> None:
        _check_rate(self.rate_per_s)
        if not (math.isfinite(self.cv) and self.cv > 0):
            raise ValueError(f"cv: expected a finite value > 0, got {self.cv}")

    def inter_arrival_s(self, num: int, rng: np.random.Generator) -> FloatArray:
        shape = 1.0 / self.cv**2
        return rng.gamma(shape, 1.0 / (self.rate_per_s * shape), size=num)


@dataclass(frozen=True, kw_only=True, slots=True)
class Constant:
    """Evenly spaced arrivals (CV 0): the no-queueing-noise baseline."""

    rate_per_s: float

    def __post_init__(self) -> None:
        _check_rate(self.rate_per_s)

    def inter_arrival_s(self, num: int, rng: np.random.Generator) -> FloatArray:
        return np.full(num, 1.0 / self.rate_per_s)


class LengthDistribution(Protocol):
    """Token counts, always >= 1."""

    def sample(self, num: int, rng: np.random.Generator) -> IntArray: ...


def _too_many_tokens(name: str, value: float) -> str:
    return f"{name}: {value:.3g} is more than {MAX_REQUEST_TOKENS:,} tokens (no model serves more)"


def _check_positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
    if value > MAX_REQUEST_TOKENS:
        raise ValueError(_too_many_tokens(name, value))


@dataclass(frozen=True, kw_only=True, slots=True)
class Fixed:
    """Every request has ``tokens`` tokens."""

    tokens: int

    def __post_init__(self) -> None:
        _check_positive_int("tokens", self.tokens)

    def sample(self, num: int, rng: np.random.Generator) -> IntArray:
        return np.full(num, self.tokens, dtype=np.int64)


@dataclass(frozen=True, kw_only=True, slots=True)
class Uniform:
    """Integers uniform on ``[lo, hi]``, both ends included."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        _check_positive_int("lo", self.lo)
        _check_positive_int("hi", self.hi)
        if self.hi < self.lo:
            raise ValueError(f"hi: expected >= lo ({self.lo}), got {self.hi}")

    def sample(self, num: int, rng: np.random.Generator) -> IntArray:
        return rng.integers(self.lo, self.hi, size=num, endpoint=True, dtype=np.int64)


@dataclass(frozen=True, kw_only=True, slots=True)
class LogNormal:
    """Log-normal lengths given by their median ``p50`` and 90th percentile ``p90``.

    Percentiles rather than (mu, sigma) because that is how trace tables
    describe lengths (see ``sim/data/README.md``): ``mu = ln p50`` and
    ``sigma = ln(p90 / p50) / z_0.9``. Draws are rounded to whole tokens and
    floored at 1 and capped at ``MAX_REQUEST_TOKENS`` (the far tail of a wide
    distribution would otherwise overflow int64); p90 == p50 gives a fixed length.

    >>> round(LogNormal(p50=1000, p90=3000).sigma, 4)
    0.8573
    """

    p50: float
    p90: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.p50) and self.p50 >= 1):
            raise ValueError(f"p50: expected >= 1 token, got {self.p50}")
        if not (math.isfinite(self.p90) and self.p90 >= self.p50):
            raise ValueError(f"p90: expected >= p50 ({self.p50}), got {self.p90}")
        if self.p90 > MAX_REQUEST_TOKENS:
            raise ValueError(_too_many_tokens("p90", self.p90))

    @property
    def sigma(self) -> float:
        return math.log(self.p90 / self.p50) / Z90

    def sample(self, num: int, rng: np.random.Generator) -> IntArray:
        draws = rng.lognormal(math.log(self.p50), self.sigma, size=num)
        return np.clip(np.rint(draws), 1, MAX_REQUEST_TOKENS).astype(np.int64)


@dataclass(frozen=True, kw_only=True, slots=True, repr=False)
class Empirical:
    """Lengths drawn with replacement from observed ``values``.

    >>> Empirical(values=(1, 2, 6))
    Empirical(3 values, mean 3)
    """

    values: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.values:
            raise ValueError("values: expected at least one length")
        for value in self.values:
            _check_positive_int("values", value)

    def __repr__(self) -> str:
        """Short, because it goes into a workload's ``source`` line."""
        mean = sum(self.values) / len(self.values)
        return f"Empirical({len(self.values)} values, mean {mean:g})"

    def sample(self, num: int, rng: np.random.Generator) -> IntArray:
        return rng.choice(np.asarray(self.values, dtype=np.int64), size=num)
