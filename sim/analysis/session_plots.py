"""The layouts' gain in a closed loop, in the workload's own terms.

In a closed loop (agent sessions: a turn is sent when the one before it
ends) the layout that finishes turns faster has *fewer* requests running at
once, so the open-loop gain figure (running on - off) reads as a loss
exactly where the layout helps. This figure shows what a session gains
instead: turns completed over time, the follow-up TTFT distribution, and
reuse with the full re-prefills that break it. Every sentence on it says
which layout is ahead from the figures themselves. No twin in vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from sim.analysis.agent_bench import admitted_followups, full_reprefills
from sim.analysis.frames import followup_figures
from sim.analysis.plots import LAYOUT_COLORS, TIME_LABEL, _finish, _label, _styled, layouts_of, scenario_of


def _layouts(requests: pd.DataFrame) -> list[str]:
    return [layout for layout in layouts_of(requests) if layout in LAYOUT_COLORS]


def ahead(counts: Mapping[str, float], noun: str, *, more_is_better: bool = True) -> str:
    """Which layout is ahead on a count, in words taken from the counts.

    >>> ahead({"off": 77, "on": 102}, "turns")
    'on completes 25 more turns than off (102 against 77, +32 %)'
    >>> ahead({"off": 9, "on": 9}, "turns")
    'both layouts complete 9 turns'
    >>> ahead({"off": 7, "on": 5}, "full re-prefills", more_is_better=False)
    'on has 2 fewer full re-prefills than off (5 against 7)'
    """
    on, off = counts.get("on", 0), counts.get("off", 0)
    if on == off:
        return (
            f"both layouts complete {on:g} {noun}" if more_is_better else f"both layouts have {on:g} {noun}"
        )
    if more_is_better:
        leader, other = ("on", "off") if on > off else ("off", "on")
        change = f", {100 * (counts[leader] - counts[other]) / counts[other]:+.0f} %" if counts[other] else ""
        return (
            f"{leader} completes {abs(on - off):g} more {noun} than {other} "
            f"({counts[leader]:g} against {counts[other]:g}{change})"
        )
    leader, other = ("on", "off") if on < off else ("off", "on")
    fewer = abs(on - off)
    return f"{leader} has {fewer:g} fewer {noun} than {other} ({counts[leader]:g} against {counts[other]:g})"


def _cumulative(ax: Axes, times_by_layout: dict[str, np.ndarray], ylabel: str) -> None:
    """A count over time per layout, from 0 at 0; off wider, underneath."""
    for width, (layout, times_s) in zip((2.6, 1.4), times_by_layout.items(), strict=False):
        times_s = np.sort(times_s)
        ax.plot(
            np.concatenate([[0.0], times_s]),
            np.arange(len(times_s) + 1),
            drawstyle="steps-post",
            color=LAYOUT_COLORS[layout],
            linewidth=width,
            label=_label(layout),
        )
    ax.set_ylabel(ylabel)
    ax.set_xlabel(TIME_LABEL)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def _draw_turns(ax: Axes, requests: pd.DataFrame) -> None:
    finished = {
        layout: rows.loc[rows["finished"], "finished_s"].to_numpy(float)
        for layout, rows in ((name, requests[requests["layout"] == name]) for name in _layouts(requests))
    }
    _cumulative(ax, finished, "turns completed,\ncumulative (requests)")
    ax.set_title(ahead({name: len(times) for name, times in finished.items()}, "turns"), loc="left")


def _draw_ttft(ax: Axes, requests: pd.DataFrame) -> None:
    """Each layout's follow-up TTFTs as a distribution (log time axis)."""
    parts = []
    for layout in _layouts(requests):
        rows = requests[(requests["layout"] == layout) & (requests["turn"] > 0) & requests["finished"]]
        ttft_s = np.sort(rows["ttft_s"].to_numpy(float))
        if len(ttft_s):
            fraction = np.arange(1, len(ttft_s) + 1) / len(ttft_s)
            ax.step(ttft_s, fraction, where="post", color=LAYOUT_COLORS[layout], label=_label(layout))
            p50, p90 = np.percentile(ttft_s, [50, 90])
            parts.append(f"{layout} p50 {p50:.2f} s, p90 {p90:.1f} s")
    ax.set_xscale("log")
    ax.set_xlabel("follow-up TTFT (s, log scale)")
    ax.set_ylabel("follow-ups at or under\n(fraction)")
    ax.set_ylim(0, 1.02)
    ax.set_title("follow-up TTFT: " + ("; ".join(parts) or "no finished follow-up"), loc="left")


def _draw_reuse(ax: Axes, requests: pd.DataFrame) -> None:
    """Full re-prefills as they are admitted; the title gives reuse too."""
    by_layout = {name: requests[requests["layout"] == name] for name in _layouts(requests)}
    reprefilled = {
        name: full_reprefills(rows)["admitted_s"].to_numpy(float) for name, rows in by_layout.items()
    }
    _cumulative(ax, reprefilled, "full re-prefills, cumulative\n(follow-ups < 50 % cached)")
    reuse = ", ".join(
        f"{name} {100 * followup_figures(rows)['followup_prefix_hit_rate']:.1f} %"
        for name, rows in by_layout.items()
        if len(admitted_followups(rows))
    )
    counts = {name: len(times) for name, times in reprefilled.items()}
    ax.set_title(f"reuse {reuse}; {ahead(counts, 'full re-prefills', more_is_better=False)}", loc="left")


@_styled
def closed_loop_gain_figure(requests: pd.DataFrame) -> Figure:
    """Turns completed, follow-up TTFT, reuse and re-prefills by layout."""
    fig = Figure(figsize=(10.0, 1.4 + 3.0 * 3), layout="constrained")
    axes = fig.subplots(3, 1, squeeze=False)
    _draw_turns(axes[0, 0], requests)
    _draw_ttft(axes[1, 0], requests)
    _draw_reuse(axes[2, 0], requests)
    axes[2, 0].set_xlim(axes[0, 0].get_xlim())  # one time axis for turns and re-prefills
    handles = [Line2D([], [], color=LAYOUT_COLORS[name], label=_label(name)) for name in _layouts(requests)]
    title = (
        f"{scenario_of(requests)}: closed-loop gain of the side-cache layout (turns, follow-up TTFT, reuse)"
    )
    return _finish(fig, axes, title, handles)
