"""Figures over kvsim's frames: thin functions, one ``Figure`` each.

Every figure draws both layouts in the same colours (``LAYOUT_COLORS``),
names the scenario in its title and puts units on its axes. Step series are
gauges that hold from one step's end to the next, so they are drawn as
steps (``drawstyle="steps-post"``), never interpolated. Figures are built
without pyplot (no global figure registry; PNG renders through Agg whatever
the backend), and files are written only by ``write_*`` and ``kvsim plot``,
atomically. No twin in vLLM.

This module imports neither vLLM nor the engine, so ``kvsim plot`` starts fast.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from sim.analysis.frames import step_values, time_weighted
from sim.config import FIGURE_FORMATS
from sim.results import atomic_write

# Okabe-Ito vermillion and blue: told apart with the common colour blindnesses.
LAYOUT_COLORS = {"off": "#D55E00", "on": "#0072B2"}
LAYOUT_LABELS = {"off": "off (old layout)", "on": "on (side-cache layout)"}
SWEEP_FRAME = "sweep.parquet"
TIME_LABEL = "simulated time (s)"

# Figures are built under these settings (fonts are fixed when artists are made).
_styled = matplotlib.rc_context(
    {
        "font.size": 11,
        "axes.titlesize": 12,
        "axes.labelsize": 11,
        "legend.fontsize": 10,
        "figure.titlesize": 14,
        "axes.grid": True,
        "grid.alpha": 0.3,
        "lines.linewidth": 1.6,
    }
)


# --- frames -> series -------------------------------------------------------


def layouts_of(frame: pd.DataFrame) -> list[str]:
    """The layouts in ``frame``: off, then on, then any other in order seen."""
    seen = [str(name) for name in dict.fromkeys(frame["layout"])]
    others = [name for name in seen if name not in LAYOUT_COLORS]
    return [name for name in LAYOUT_COLORS if name in seen] + others


def scenario_of(frame: pd.DataFrame) -> str:
    names = list(dict.fromkeys(frame["scenario"])) if "scenario" in frame else []
    return ", ".join(str(name) for name in names) or "kvsim"


def time_grid(steps: pd.DataFrame) -> np.ndarray:
    """Every step end of every layout: the difference of two step functions
    is itself a step function with breaks only there, so this grid is exact."""
    return np.unique(steps["time_s"].to_numpy(dtype=float))


def resample_steps(
    steps: pd.DataFrame,
    column: str,
    grid_s: np.ndarray | None = None,
    before: float = np.nan,
) -> pd.DataFrame:
    """``column`` of each layout on one time grid, one column per layout."""
    grid = time_grid(steps) if grid_s is None else np.asarray(grid_s, dtype=float)
    series = {}
    for layout in layouts_of(steps):
        rows = steps[steps["layout"] == layout].sort_values("time_s", kind="stable")
        times_s = rows["time_s"].to_numpy(float)
        series[layout] = step_values(times_s, rows[column].to_numpy(), grid, before)
    return pd.DataFrame(series, index=pd.Index(grid, name="time_s"))


def common_end_s(steps: pd.DataFrame) -> float:
    """When the first of the layouts' runs ended (its last step)."""
    return float(steps.groupby("layout")["time_s"].max().min())


def both_running(table: pd.DataFrame, end_s: float) -> pd.DataFrame:
    """``table`` cut to the span both runs cover: the rows before ``end_s``
    and a closing row at ``end_s`` holding the state just before it. After
    its last step a run has ended (typically with 0 running), so comparing
    past it would read as a loss (or gain) that no moment of both runs had.

    >>> table = pd.DataFrame({"x": [1, 2, 0]}, index=pd.Index([0.0, 1.0, 2.0], name="time_s"))
    >>> both_running(table, 2.0)["x"].tolist(), both_running(table, 2.0).index.tolist()
    ([1, 2, 2], [0.0, 1.0, 2.0])
    """
    before = table[table.index < end_s]
    if before.empty:
        return table[table.index <= end_s]
    closing = before.iloc[[-1]].set_axis(pd.Index([end_s], name=table.index.name))
    return pd.concat([before, closing])


def concurrency_gain(steps: pd.DataFrame, column: str = "num_requests_running") -> pd.DataFrame:
    """Off, on, ``gain`` (on - off) and ``ratio`` (on / off, NaN where off is
    0) of a request count on the common grid, over the span both runs cover
    (``both_running``). Before its first step a layout runs nothing, so
    counts start at 0."""
    missing = {"off", "on"} - set(steps["layout"])
    if missing:
        raise ValueError(f"layout: the gain needs off and on; missing {sorted(missing)}")
    both = steps[steps["layout"].isin(["off", "on"])]
    table = resample_steps(both, column, before=0.0)[["off", "on"]]
    table = both_running(table, common_end_s(both))
    table["gain"] = table["on"] - table["off"]
    table["ratio"] = table["on"] / table["off"].where(table["off"] != 0)
    return table


def sweep_means(sweep: pd.DataFrame, x: str) -> pd.DataFrame:
    """One row per (x, layout): runs that share both (seeds; any other swept
    key, so pick ``x`` as the only one that varies) are averaged."""
    if x not in sweep:
        raise ValueError(f"x: no column {x!r} in the sweep frame")
    numeric = sweep.select_dtypes("number").columns.difference([x, "seed"])
    return sweep.groupby([x, "layout"], sort=True)[list(numeric)].mean().reset_index()


def preemption_onset(sweep: pd.DataFrame, x: str) -> dict[str, float | None]:
    """Per layout, the first (smallest) ``x`` at which any run preempts."""
    onset: dict[str, float | None] = {}
    for layout in layouts_of(sweep):
        rows = sweep[(sweep["layout"] == layout) & (sweep["num_preemptions"] > 0)]
        onset[layout] = float(rows[x].min()) if len(rows) else None
    return onset


# --- drawing ----------------------------------------------------------------

# (column, y label) of each panel; counts are whole numbers from 0.
ADMISSION_PANELS = (
    ("num_requests_running", "running (requests)"),
    ("num_requests_waiting", "waiting (requests)"),
    ("num_admitted_total", "admitted, cumulative\n(requests)"),
)
EVICTION_PANELS = (
    ("num_preemptions_total", "preemptions, cumulative\n(count)"),
    ("prefix_cache_evicted_total_blocks", "prefix-cache evicted,\ncumulative (blocks)"),
    ("num_free_blocks", "free KV cache\n(blocks)"),
)


def _axes(
    nrows: int, ncols: int = 1, *, height_in: float = 2.6, width_in: float = 10.0
) -> tuple[Figure, np.ndarray]:
    fig = Figure(figsize=(width_in, 1.4 + height_in * nrows), layout="constrained")
    return fig, fig.subplots(nrows, ncols, sharex=True, squeeze=False)


def _color(layout: str) -> str | None:
    return LAYOUT_COLORS.get(layout)


def _label(layout: str) -> str:
    return LAYOUT_LABELS.get(layout, str(layout))


def _draw_steps(ax: Axes, steps: pd.DataFrame, column: str, ylabel: str) -> None:
    """Off drawn wider, underneath: where the layouts agree it edges the on line."""
    for width, layout in zip((2.6, 1.4, 1.4), layouts_of(steps), strict=False):
        rows = steps[steps["layout"] == layout].sort_values("time_s", kind="stable")
        ax.plot(
            rows["time_s"],
            rows[column],
            drawstyle="steps-post",
            color=_color(layout),
            linewidth=width,
            label=_label(layout),
        )
    _count_axis(ax, ylabel, flat=bool((steps[column] == 0).all()))


def _count_axis(ax: Axes, ylabel: str, *, flat: bool = False) -> None:
    ax.set_ylabel(ylabel)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    if flat:
        ax.set_ylim(-0.05, 1)
        ax.text(0.5, 0.5, "none in this run", transform=ax.transAxes, ha="center", va="center", color="grey")


def _finish(fig: Figure, axes: np.ndarray, title: str, handles: Sequence[Any] | None = None) -> Figure:
    """One legend for the figure, under the panels, so it hides no curve."""
    for ax in axes[-1]:
        ax.set_xlabel(ax.get_xlabel() or TIME_LABEL)
    if handles is None:
        handles, _ = axes[0][0].get_legend_handles_labels()
    fig.legend(handles=list(handles), loc="outside lower center", ncols=min(len(handles), 4), frameon=False)
    fig.suptitle(title)
    return fig


def _steps_figure(steps: pd.DataFrame, panels: Sequence[tuple[str, str]], title: str) -> Figure:
    fig, axes = _axes(len(panels))
    for ax, (column, ylabel) in zip(axes[:, 0], panels, strict=True):
        _draw_steps(ax, steps, column, ylabel)
    return _finish(fig, axes, f"{scenario_of(steps)}: {title}")


@_styled
def admission_figure(steps: pd.DataFrame) -> Figure:
    """Running and waiting requests, and cumulative admissions, over time."""
    return _steps_figure(steps, ADMISSION_PANELS, "admission by layout")


@_styled
def eviction_figure(steps: pd.DataFrame) -> Figure:
    """Cumulative preemptions and prefix-cache evictions, and free blocks."""
    return _steps_figure(steps, EVICTION_PANELS, "preemption and eviction by layout")


@_styled
def gain_figure(steps: pd.DataFrame, *, ratio: bool = True) -> Figure:
    """Running requests on - off over time (and on / off): where the new
    layout runs more requests at once than the old one. The gain of an
    open loop, where both layouts get the same arrivals; a closed loop's
    is ``session_plots.closed_loop_gain_figure``."""
    table = concurrency_gain(steps)
    fig, axes = _axes(2 if ratio else 1, height_in=3.0)
    _draw_gain(axes[0, 0], table["gain"])
    if ratio:
        _draw_ratio(axes[1, 0], table["ratio"])
    handles = [
        Patch(color=_color(name), alpha=0.4, label=f"{name} runs more requests") for name in ("on", "off")
    ]
    title = f"{scenario_of(steps)}: open-loop gain of the side-cache layout (requests running at once)"
    return _finish(fig, axes, title, handles)


def rolling_mean(series: pd.Series, window_s: float, num_points: int = 401) -> pd.Series:
    """A step series (indexed by time) averaged over a sliding window of
    ``window_s``, read on ``num_points`` evenly spaced times: the trend
    under a gain that flips every few steps.

    >>> flips = pd.Series([1, -1] * 50 + [1], index=np.arange(101.0))  # +1, -1 each second
    >>> float(rolling_mean(flips, 10.0).loc[10:90].abs().max())
    0.0
    """
    times_s = series.index.to_numpy(float)
    grid_s = np.linspace(times_s[0], times_s[-1], num_points)
    values = step_values(times_s, series.to_numpy(float), grid_s)
    spacing_s = (grid_s[-1] - grid_s[0]) / max(num_points - 1, 1)
    width = max(1, round(window_s / spacing_s)) if spacing_s > 0 else 1
    smoothed = pd.Series(values).rolling(width, center=True, min_periods=1).mean()
    return pd.Series(smoothed.to_numpy(), index=pd.Index(grid_s, name=series.index.name))


def _draw_gain(ax: Axes, gain: pd.Series) -> None:
    """Each step's gain thin and pale (it flips every few steps), its
    rolling mean over a twentieth of the span bold on top."""
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.plot(gain.index, gain, drawstyle="steps-post", color="grey", lw=0.6, alpha=0.7, gid="gain")
    span_s = float(gain.index[-1] - gain.index[0]) if len(gain) else 0.0
    if len(gain) > 1 and span_s > 0:
        trend = rolling_mean(gain, span_s / 20)
        ax.plot(trend.index, trend, color="black", lw=1.8, gid="gain_rolling_mean")
    for sign, layout in ((1, "on"), (-1, "off")):
        ax.fill_between(
            gain.index,
            0,
            gain,
            where=sign * gain > 0,
            step="post",
            color=_color(layout),
            alpha=0.3,
            linewidth=0,
        )
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("running, on − off\n(requests)")
    if (gain == 0).all():
        ax.set_ylim(-1, 1)
        ax.text(
            0.5,
            0.75,
            "both layouts run equally many requests throughout",
            transform=ax.transAxes,
            ha="center",
            color="grey",
        )
    mean = f"time-weighted mean {time_weighted(gain):+.2f} requests"
    extremes = f"most {gain.max():+.0f}, least {gain.min():+.0f}"
    span = f"while both run (to {gain.index[-1]:.0f} s); bold: rolling mean" if len(gain) else ""
    ax.set_title(f"{mean}, {extremes} {span}", loc="left")


def _draw_ratio(ax: Axes, ratio: pd.Series) -> None:
    """On / off from 0 up (at least to 2, so 1 sits mid-axis when flat)."""
    ax.axhline(1, color="grey", linewidth=0.8)
    ax.plot(ratio.index, ratio, drawstyle="steps-post", c="black", lw=1.0, gid="ratio")
    ax.set_ylim(-0.05, max(2.0, 1.05 * float(np.nan_to_num(ratio.max(), nan=0.0))))
    ax.set_ylabel("running, on / off\n(ratio)")


SWEEP_METRICS = (
    ("num_admitted", "admitted (requests)"),
    ("mean_concurrency", "mean concurrency\n(requests)"),
    ("peak_concurrency", "peak concurrency\n(requests)"),
    ("num_preemptions", "preemptions\n(count)"),
    ("output_throughput_tokens_per_s", "output throughput\n(tokens/s)"),
)
COUNT_METRICS = ("num_admitted", "peak_concurrency", "num_preemptions")
X_LABELS = {
    "workload.rate_scale": "request rate (× the trace's rate)",
    "workload.arrival.rate_per_s": "arrival rate (requests/s)",
    "workload.time_scale": "time scale (× the trace's times)",
}


@_styled
def sweep_figure(sweep: pd.DataFrame, x: str) -> Figure:
    """Each metric by layout against ``x`` (left) and its gain on - off
    (right); dotted verticals where each layout first preempts."""
    means = sweep_means(sweep, x)
    fig, axes = _axes(len(SWEEP_METRICS), 2, height_in=2.2, width_in=12.0)
    for row, (metric, ylabel) in enumerate(SWEEP_METRICS):
        _draw_sweep_row(axes[row], means, x, metric, ylabel)
    onset = preemption_onset(sweep, x)
    _mark_onset(axes, onset)
    for ax in axes[-1]:
        ax.set_xlabel(X_LABELS.get(x, x))
    repeats = sweep.groupby([x, "layout"]).size().max() > 1
    axes[0, 0].set_title("by layout" + (" (mean of runs at one x)" if repeats else ""), loc="left")
    axes[0, 1].set_title("gain, on − off (same units)", loc="left")
    handles = [
        Line2D([], [], color=_color(name), marker="o", ms=size, label=_label(name))
        for size, name in zip((9, 6, 6), layouts_of(sweep), strict=False)
    ]
    x_max = float(sweep[x].max())
    handles += [_onset_handle(name, value, x_max) for name, value in onset.items()]
    return _finish(fig, axes, f"{scenario_of(sweep)}: sweep over {x}", handles)


def _draw_sweep_row(row: np.ndarray, means: pd.DataFrame, x: str, metric: str, ylabel: str) -> None:
    """Off drawn bigger, underneath, so equal values show both layouts."""
    wide = means.pivot(index=x, columns="layout", values=metric)
    for size, layout in zip((9, 6, 6), layouts_of(means), strict=False):
        row[0].plot(
            wide.index,
            wide[layout],
            marker="o",
            markersize=size,
            linewidth=size / 3,
            color=_color(layout),
            label=_label(layout),
        )
    row[0].set_ylabel(ylabel)
    if {"off", "on"} <= set(wide.columns):
        gain = wide["on"] - wide["off"]
        row[1].plot(wide.index, gain, marker="o", color="black")
        if (gain == 0).all():
            row[1].set_ylim(-1, 1)
    row[1].axhline(0, color="grey", linewidth=0.8)
    if metric in COUNT_METRICS:
        for ax in row:
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def _mark_onset(axes: np.ndarray, onset: dict[str, float | None]) -> None:
    for ax in axes.flat:
        for layout, value in onset.items():
            if value is not None:
                ax.axvline(value, color=_color(layout), linestyle=":", linewidth=1.8, gid=f"onset-{layout}")


def _onset_handle(layout: str, value: float | None, x_max: float) -> Line2D:
    if value is None:
        text = f"{layout} never preempts (up to x = {x_max:g})"
        return Line2D([], [], color=_color(layout), linestyle="none", label=text)
    text = f"{layout} first preempts at x = {value:g}"
    return Line2D([], [], color=_color(layout), linestyle=":", lw=1.8, label=text)


# --- files ------------------------------------------------------------------


def write_figure(fig: Figure, stem: Path, formats: Iterable[str] = FIGURE_FORMATS) -> list[Path]:
    """``stem.png``, ``stem.svg``...: each through a temp file and a rename.
    No date and a fixed hash salt, so the same frames give the same SVG."""
    paths = [stem.with_suffix(f".{fmt}") for fmt in formats]
    for path in paths:
        with matplotlib.rc_context({"svg.hashsalt": "kvsim"}):
            atomic_write(path, functools.partial(_save, fig, path.suffix[1:]))
    return paths


def _save(fig: Figure, fmt: str, tmp: Path) -> None:
    metadata = {"Date": None} if fmt in ("svg", "pdf") else {}
    fig.savefig(tmp, format=fmt, dpi=150, metadata=metadata)


PANEL_COLUMNS = ("layout", "time_s", *(column for column, _ in (*ADMISSION_PANELS, *EVICTION_PANELS)))


def with_panel_columns(steps: pd.DataFrame) -> pd.DataFrame:
    """A run without steps (every request rejected) draws empty panels; a
    frame of an older kvsim may lack their columns then."""
    missing = [column for column in PANEL_COLUMNS if column not in steps]
    if missing and len(steps):
        raise ValueError(f"steps: no column {missing[0]!r}")
    return steps.assign(**{column: pd.Series(dtype="float64") for column in missing})


# A replay's curves: what the server's /metrics gave at each scrape.
MEASURED_PANELS = (
    ("num_requests_running", "running (requests)"),
    ("num_requests_waiting", "waiting (requests)"),
    ("kv_cache_usage_perc", "KV cache usage\n(fraction)"),
    ("num_preemptions_total", "preemptions, cumulative\n(count)"),
)


@_styled
def measured_figure(samples: pd.DataFrame) -> Figure:
    """A replay's scraped gauges and counters over time (no engine steps)."""
    panels = [(column, label) for column, label in MEASURED_PANELS if column in samples]
    fig = _steps_figure(samples, panels, "measured by the replay, by layout")
    fig.axes[len(panels) - 1].set_xlabel("scenario time (s), as replayed")
    return fig


def standard_figures(frames: dict[str, pd.DataFrame]) -> dict[str, Figure]:
    """Admission and eviction for any run; the gain when both layouts ran
    (a closed loop's in turns completed, follow-up TTFT and reuse); a
    replay (no steps frame) gets its measured curves."""
    if "steps" not in frames:
        return {"measured": measured_figure(frames["samples"])}
    steps = with_panel_columns(frames["steps"])
    figures = {"admission": admission_figure(steps), "eviction": eviction_figure(steps)}
    if {"off", "on"} <= set(steps["layout"]):
        figures["gain"] = _gain_of(steps, frames.get("requests"))
    return figures


def _gain_of(steps: pd.DataFrame, requests: pd.DataFrame | None) -> Figure:
    from sim.analysis.agent_bench import is_closed_loop
    from sim.analysis.session_plots import closed_loop_gain_figure  # it builds on this module

    if requests is not None and is_closed_loop(requests):
        return closed_loop_gain_figure(requests)
    return gain_figure(steps)


def write_standard_figures(
    out_dir: Path, frames: dict[str, pd.DataFrame], formats: Iterable[str] = FIGURE_FORMATS
) -> list[Path]:
    formats = tuple(formats)
    return [
        path
        for name, fig in standard_figures(frames).items()
        for path in write_figure(fig, Path(out_dir) / "plots" / name, formats)
    ]


def write_sweep_figures(
    out_dir: Path, sweep: pd.DataFrame, x: str, formats: Iterable[str] = FIGURE_FORMATS
) -> list[Path]:
    return write_figure(sweep_figure(sweep, x), Path(out_dir) / "plots" / "sweep", formats)
