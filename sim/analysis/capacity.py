"""Capacity search: the highest request rate each layout sustains.

``kvsim sweep --find-max-rate LO,HI`` bisects ``workload.rate_scale`` (in log
space, to a relative precision) per grid point and layout: a rate is
sustained when the run preempts nothing, or, with ``--ttft-p99-max``, when its
TTFT p99 stays under the bound. Every evaluation is an ordinary cached run of
the sweep (``sim.analysis.sweep``), so ``--resume`` replays a search. The
answer is one number per layout and the gain (new / old). No twin in vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from sim.analysis.executors import Executor, RunSpec, make_spec, open_runner, parallel_runs
from sim.analysis.sweep import (
    RATE_KEY,
    GridAxis,
    grid_points,
    load_point,
    plan_runs,
    prepare_out,
    run_cached,
    split_layouts,
)
from sim.config import ConfigError
from sim.results import write_frame, write_json
from sim.scenario import SideCacheSwitch, load_scenario


# -------------------------------------------------------- capacity search
@dataclass(frozen=True)
class MaxRate:
    """The true maximum lies in [lo, hi): ``max_rate`` (= lo) is the highest
    rate seen to sustain; None when not even the lower bound did (lo = 0).
    ``capped``: the upper bound itself sustained (hi = inf)."""

    max_rate: float | None
    lo: float
    hi: float
    capped: bool
    num_evaluations: int


@dataclass
class MaxRateSearch:
    """Bisection, in log space, for the highest rate that sustains: checks
    ``lo``, then ``hi``, then geometric midpoints until hi/lo <= 1 + precision.
    Assumes sustaining is monotone (true below a threshold, false above)."""

    lo: float
    hi: float
    rel_precision: float
    lo_ok: bool | None = None
    hi_ok: bool | None = None
    evaluations: list[tuple[float, bool]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 0 < self.lo < self.hi:
            raise ValueError(f"find-max-rate: expected 0 < lo < hi, got {self.lo}, {self.hi}")
        if not self.rel_precision > 0:
            raise ValueError(f"rel_precision: expected > 0, got {self.rel_precision}")

    def next_rate(self) -> float | None:
        """The rate to evaluate next; None when the search is done."""
        if self.lo_ok is None:
            return self.lo
        if not self.lo_ok:
            return None
        if self.hi_ok is None:
            return self.hi
        if self.hi_ok or self.hi <= self.lo * (1 + self.rel_precision):
            return None
        return math.sqrt(self.lo * self.hi)

    def record(self, rate: float, sustained: bool) -> None:
        self.evaluations.append((rate, sustained))
        if self.lo_ok is None:
            self.lo_ok = sustained
        elif self.hi_ok is None:
            self.hi_ok = sustained
        elif sustained:
            self.lo = rate
        else:
            self.hi = rate

    def result(self) -> MaxRate:
        assert self.next_rate() is None, "the search is not finished"
        count = len(self.evaluations)
        if not self.lo_ok:
            return MaxRate(None, 0.0, self.lo, False, count)
        if self.hi_ok:
            return MaxRate(self.hi, self.hi, math.inf, True, count)
        return MaxRate(self.lo, self.lo, self.hi, False, count)


def find_max_rate(
    sustains: Callable[[float], bool], lo: float, hi: float, rel_precision: float = 0.05
) -> MaxRate:
    """The search driven by a plain function of the rate (one at a time)."""
    search = MaxRateSearch(lo, hi, rel_precision)
    while (rate := search.next_rate()) is not None:
        search.record(rate, sustains(rate))
    return search.result()


def sustains(summary: dict[str, Any], ttft_p99_max_s: float | None = None) -> bool:
    """No preemption; or, given a bound, a TTFT p99 under it (instead)."""
    if ttft_p99_max_s is None:
        return summary["num_preemptions"] == 0
    ttft = summary["ttft_p99_s"]
    return ttft is not None and not math.isnan(ttft) and ttft <= ttft_p99_max_s


@dataclass(frozen=True)
class CapacitySearch:
    """What ``--find-max-rate`` searches: per grid point and layout, the
    highest ``workload.rate_scale`` in [lo, hi] that sustains."""

    scenario_ref: str
    overrides: tuple[str, ...]
    axes: tuple[GridAxis, ...]
    lo: float
    hi: float
    rel_precision: float = 0.05
    ttft_p99_max_s: float | None = None

    def check(self) -> None:
        """Every bad input, before any run."""
        if any(axis.key == RATE_KEY for axis in self.axes):
            raise ConfigError(f"--grid {RATE_KEY}: --find-max-rate sets the rate itself")
        try:
            MaxRateSearch(self.lo, self.hi, self.rel_precision)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        plan_runs(self.scenario_ref, [*self.overrides, f"{RATE_KEY}={self.lo}"], self.axes)

    def spec(self, point: dict[str, Any], layout: SideCacheSwitch, rate: float) -> RunSpec:
        params = {**point, RATE_KEY: rate}
        return make_spec(load_point(self.scenario_ref, self.overrides, params), layout, params)


def run_capacity_search(
    search: CapacitySearch,
    out_dir: Path,
    *,
    resume: bool = False,
    executor: Executor = "local",
    workers: int | None = None,
    address: str | None = None,
    progress: bool | None = None,
) -> pd.DataFrame:
    """The searches of every grid point and layout advance together, one
    evaluation each per round; every evaluation is a cached run, so
    ``resume`` replays a cut-short search from its run files."""
    search.check()
    runs_dir = prepare_out(out_dir, resume=resume)
    base = load_scenario(search.scenario_ref, list(search.overrides))
    layouts, others = split_layouts(search.axes, base.layouts)
    points = grid_points(others)
    searches = {
        (i, layout): MaxRateSearch(search.lo, search.hi, search.rel_precision)
        for i in range(len(points))
        for layout in layouts
    }
    with open_runner(executor, parallel_runs(workers, len(searches)), address) as runner:
        while rates := _next_rates(searches):
            specs = {key: search.spec(points[key[0]], key[1], rate) for key, rate in rates.items()}
            records = run_cached(
                list(specs.values()), runs_dir, runner, progress=progress, desc="find-max-rate"
            )
            for key, spec in specs.items():
                searches[key].record(
                    rates[key], sustains(records[spec.run_id]["summary"], search.ttft_p99_max_s)
                )
    frame = capacity_frame(points, searches)
    write_frame(out_dir / "max_rate.parquet", frame)
    write_json(out_dir / "max_rate.json", frame.to_dict(orient="records"))
    return frame


def _next_rates(
    searches: dict[tuple[int, SideCacheSwitch], MaxRateSearch],
) -> dict[tuple[int, SideCacheSwitch], float]:
    rates = {key: search.next_rate() for key, search in searches.items()}
    return {key: rate for key, rate in rates.items() if rate is not None}


def capacity_frame(
    points: list[dict[str, Any]], searches: dict[tuple[int, SideCacheSwitch], MaxRateSearch]
) -> pd.DataFrame:
    """One row per grid point and layout; ``gain`` is the point's on / off
    max rate (NaN unless both layouts found one)."""
    best = {key: s.result() for key, s in searches.items()}
    rows = [
        {
            "point": index,
            **points[index],
            "layout": layout,
            "max_rate_scale": result.max_rate,
            "bracket_lo": result.lo,
            "bracket_hi": result.hi,
            "capped": result.capped,
            "num_evaluations": result.num_evaluations,
            "gain": _gain(best.get((index, "on")), best.get((index, "off"))),
        }
        for (index, layout), result in best.items()
    ]
    return pd.DataFrame.from_records(rows)


def _gain(on: MaxRate | None, off: MaxRate | None) -> float:
    if on is None or off is None or on.max_rate is None or not off.max_rate:
        return math.nan
    return on.max_rate / off.max_rate
