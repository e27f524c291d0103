"""Overlay figures for ``kvsim validate``: per layout, the simulated and the
measured curves on one figure (running requests, KV-cache usage, finished
requests). Built like the standard figures (``sim.analysis.plots``): no
pyplot, the layout's colour for the simulation, black for the measurement.
Samples are point readings, so they are drawn as lines through the readings
(the same reading ``curve_error`` makes). No twin in vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from sim.analysis.plots import LAYOUT_COLORS, _axes, _finish, _styled, scenario_of, write_figure
from sim.analysis.validate import curve_error
from sim.config import FIGURE_FORMATS

# (samples column, y label, scale, unit of the RMSE): the gauges drawn.
OVERLAY_PANELS = (
    ("num_requests_running", "running (requests)", 1.0, "requests"),
    ("kv_cache_usage_perc", "KV cache usage (%)", 100.0, "% of the pool"),
)
TIME_LABEL = "time since the workload's start (s)"
REPLAY_COLOR = "black"
# The simulation drawn wider, underneath: where they agree it edges the measurement.
SIM_WIDTH, REPLAY_WIDTH = 2.6, 1.2


def _samples_of(frames: dict[str, pd.DataFrame], layout: str) -> pd.DataFrame:
    samples = frames["samples"]
    if samples.empty or "layout" not in samples:
        return samples
    return samples[samples["layout"] == layout].sort_values("time_s", kind="stable")


def _finished_curve(frames: dict[str, pd.DataFrame], layout: str) -> tuple[np.ndarray, np.ndarray]:
    requests = frames["requests"]
    if requests.empty or "finished_s" not in requests:
        return np.array([]), np.array([])
    times_s = np.sort(requests.loc[requests["layout"] == layout, "finished_s"].dropna().to_numpy(float))
    return times_s, np.arange(1, len(times_s) + 1)


def _draw_pair(
    ax: Axes, sim: pd.DataFrame, replay: pd.DataFrame, panel: tuple[str, str, float, str], color: str
) -> None:
    column, ylabel, scale, unit = panel
    for rows, line_color, width in ((sim, color, SIM_WIDTH), (replay, REPLAY_COLOR, REPLAY_WIDTH)):
        if column in rows and len(rows):
            ax.plot(rows["time_s"], scale * rows[column].astype(float), color=line_color, lw=width)
    error = curve_error(sim, replay, column)
    if error["num_points"]:
        ax.set_title(f"RMSE {scale * error['rmse']:.3g} {unit}", loc="left", fontsize=10)
    ax.set_ylabel(ylabel)


@_styled
def overlay_figure(sim: dict[str, pd.DataFrame], replay: dict[str, pd.DataFrame], layout: str) -> Figure:
    """Simulated (layout colour) and measured (black) curves of one layout."""
    color = LAYOUT_COLORS.get(layout, "grey")
    sim_samples, replay_samples = _samples_of(sim, layout), _samples_of(replay, layout)
    fig, axes = _axes(len(OVERLAY_PANELS) + 1)
    for ax, panel in zip(axes[:, 0], OVERLAY_PANELS, strict=False):
        _draw_pair(ax, sim_samples, replay_samples, panel, color)
    finished_ax = axes[-1, 0]
    for frames, line_color, width in ((sim, color, SIM_WIDTH), (replay, REPLAY_COLOR, REPLAY_WIDTH)):
        times_s, counts = _finished_curve(frames, layout)
        finished_ax.plot(times_s, counts, drawstyle="steps-post", color=line_color, lw=width)
    finished_ax.set_ylabel("finished, cumulative\n(requests)")
    finished_ax.set_xlabel(TIME_LABEL)
    handles = [
        Line2D([], [], color=color, lw=SIM_WIDTH, label=f"simulated ({layout})"),
        Line2D([], [], color=REPLAY_COLOR, lw=REPLAY_WIDTH, label=f"measured ({layout})"),
    ]
    title = f"{scenario_of(sim['summary'])} [{layout}]: simulated vs measured"
    return _finish(fig, axes, title, handles)


def write_overlay_figures(
    out_dir: Path,
    sim: dict[str, pd.DataFrame],
    replay: dict[str, pd.DataFrame],
    layouts: Iterable[str],
    formats: Iterable[str] = FIGURE_FORMATS,
) -> list[Path]:
    formats = tuple(formats)
    return [
        path
        for layout in layouts
        for path in write_figure(
            overlay_figure(sim, replay, layout), Path(out_dir) / f"overlay-{layout}", formats
        )
    ]
