"""Plots (issue: plotting layer): figure conventions (both layouts in the
legend, units on every axis, the scenario in the title, step series drawn as
steps, one colour per layout), the step-function resampling behind the gain,
the preemption-onset marker of sweeps, atomic figure files and ``kvsim plot``.

Each check that matters has a failing control next to it: the same assertion
applied to a deliberately wrong input, showing it would catch the bug.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import numpy as np
import pandas as pd
import pytest
from matplotlib.figure import Figure

from sim.analysis import plots
from sim.analysis.frames import time_weighted
from sim.commands import plot as plot_command
from sim.config import ConfigError
from sim.results import write_results

# Prompts of 8,000 tokens and long outputs: with 32 sequences the KV pool
# binds within 40 s and the layouts differ (off preempts, on admits more);
# with 8 sequences the cap binds first and the layouts run identically.
TINY_SCENARIO = """\
name: tiny
seed: 0
deployment: {max_num_seqs: 32, block_size: null, prefix_match_unit: null, use_replayssm: false}
# kvsim's old defaults (tests/helpers/scenarios.py PRE_RIG), where the
# figures' shapes were drawn.
scheduler: {max_num_batched_tokens: 8192}
engine: {mode: sync}
mtp: {acceptance_rates: [0.8, 0.7, 0.6]}
workload:
  trace: synthetic
  num_requests: 40
  arrival: {process: poisson, rate_per_s: 2.0}
  prompt: {distribution: fixed, tokens: 8000}
  output: {distribution: fixed, tokens: 2000}
simulation: {max_time_s: 40}
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The tiny scenario where the pool binds (32 seqs) and where it does not (8)."""
    from sim.analysis.runs import run_scenario
    from sim.scenario import load_scenario

    path = tmp_path_factory.mktemp("scenario") / "tiny.yaml"
    path.write_text(TINY_SCENARIO)
    return {
        "binds": run_scenario(load_scenario(str(path))),
        "capped": run_scenario(load_scenario(str(path), ["deployment.max_num_seqs=8"])),
    }


@pytest.fixture(scope="module")
def steps(runs: dict[str, object]) -> pd.DataFrame:
    return runs["binds"].steps  # type: ignore[attr-defined]


def convention_problems(fig: Figure, scenario: str) -> list[str]:
    """What a reader would miss: a layout in the legend, a unit on an axis
    label, the scenario in the title."""
    problems = []
    legend = " ".join(t.get_text() for lg in fig.legends for t in lg.get_texts())
    problems += [f"legend lacks {name}" for name in ("off", "on") if not re.search(rf"\b{name}\b", legend)]
    for ax in fig.axes:
        labels = [label for label in (ax.get_xlabel(), ax.get_ylabel()) if label]
        problems += [f"no unit in {label!r}" for label in labels if not re.search(r"\(.+\)", label)]
        if not ax.get_ylabel() and ax.get_subplotspec().colspan.start == 0:
            problems.append("an unlabelled y axis")
    if not any(ax.get_xlabel() for ax in fig.axes):
        problems.append("no x label")
    title = fig.get_suptitle()
    if scenario not in title:
        problems.append(f"title {title!r} does not name {scenario}")
    return problems


def _bad_figure() -> Figure:
    fig = Figure()
    ax = fig.subplots()
    ax.plot([0, 1], [0, 1], label="layout a")
    ax.set_ylabel("running")
    fig.legend()
    return fig


@pytest.mark.parametrize("build", [plots.admission_figure, plots.eviction_figure, plots.gain_figure])
def test_step_figures_follow_conventions(build, steps: pd.DataFrame) -> None:
    fig = build(steps)
    assert convention_problems(fig, "tiny") == []
    # Control: a figure without layouts, units or title fails every check.
    assert len(convention_problems(_bad_figure(), "tiny")) >= 4


def test_sweep_figure_follows_conventions(hand_sweep: pd.DataFrame) -> None:
    fig = plots.sweep_figure(hand_sweep, "workload.rate_scale")
    assert convention_problems(fig, "hand") == []
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "off first preempts at x = 1" in legend
    assert "on first preempts at x = 4" in legend


@pytest.mark.parametrize("build", [plots.admission_figure, plots.eviction_figure])
def test_step_series_are_drawn_as_steps_in_layout_colours(build, steps) -> None:
    fig = build(steps)
    lines = [line for ax in fig.axes for line in ax.get_lines()]
    assert lines and all(line.get_drawstyle() == "steps-post" for line in lines)
    for line in lines:
        layout = line.get_label().split()[0]
        assert line.get_color() == plots.LAYOUT_COLORS[layout]
    assert plots.LAYOUT_COLORS["off"] != plots.LAYOUT_COLORS["on"]
    # Control: matplotlib's default would interpolate between steps.
    assert Figure().subplots().plot([0, 1], [0, 1])[0].get_drawstyle() == "default"


# --- resampling ---------------------------------------------------------------


HAND_STEPS = pd.DataFrame(
    {
        "scenario": "hand",
        "layout": ["off", "off", "on", "on"],
        "time_s": [1.0, 3.0, 2.0, 4.0],
        "num_requests_running": [2, 5, 4, 1],
    }
)


def test_resampling_holds_the_last_value_at_or_before_each_time() -> None:
    table = plots.resample_steps(HAND_STEPS, "num_requests_running", before=0.0)
    assert list(table.index) == [1.0, 2.0, 3.0, 4.0]
    assert list(table["off"]) == [2, 2, 5, 5]
    assert list(table["on"]) == [0, 4, 4, 1]
    grid = np.array([0.5, 1.0, 2.9, 3.0, 10.0])
    assert list(plots.step_values(np.array([1.0, 3.0]), np.array([2, 5]), grid, 0)) == [0, 2, 2, 5, 5]
    # Controls: interpolation, or taking the value just before a step ends,
    # gives other numbers at exactly these points.
    assert list(np.interp(grid, [1.0, 3.0], [2, 5])) != [0, 2, 2, 5, 5]
    left = np.searchsorted([1.0, 3.0], grid, side="left") - 1
    assert list(np.where(left >= 0, np.array([2, 5])[left], 0)) != [0, 2, 2, 5, 5]


def test_gain_on_a_hand_made_example() -> None:
    """Off's run ends at 3 s (its last step), so the gain stops there; the
    closing row at 3 s holds the state just before (off 2, on 4)."""
    table = plots.concurrency_gain(HAND_STEPS)
    assert list(table.index) == [1.0, 2.0, 3.0]
    assert list(table["gain"]) == [-2, 2, 2]
    assert list(table["ratio"]) == [0.0, 2.0, 2.0]
    # Mean over [1, 3]: (-2 * 1 + 2 * 1) / 2; the closing value has no duration.
    assert time_weighted(table["gain"]) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="layout: .*missing \\['on'\\]"):
        plots.concurrency_gain(HAND_STEPS[HAND_STEPS["layout"] == "off"])


# The new layout runs one more request than the old at every moment, then
# drains at 3 s; the old layout runs on (its queue drains at 10 s).
EARLY_END = pd.DataFrame(
    {
        "scenario": "hand",
        "layout": ["on"] * 3 + ["off"] * 10,
        "time_s": [1.0, 2.0, 3.0, *np.arange(1.0, 11.0)],
        "num_requests_running": [3, 3, 0, *[2] * 9, 0],
    }
)


def test_a_layout_that_finishes_early_shows_no_false_loss() -> None:
    table = plots.concurrency_gain(EARLY_END)
    assert table.index[-1] == 3.0  # the span both runs cover
    assert (table["gain"] == 1).all()
    title = plots.gain_figure(EARLY_END).axes[0].get_title(loc="left")
    assert "most +1, least +1" in title
    # CONTROL: compared past the early end (the old figure), the drained
    # run's 0 reads as a loss of 2 that no moment of both runs had.
    naive = plots.resample_steps(EARLY_END, "num_requests_running", before=0.0)
    assert (naive["on"] - naive["off"]).min() == -2


def test_the_gain_figure_draws_a_rolling_mean_over_the_noisy_steps(steps) -> None:
    fig = plots.gain_figure(steps)
    (trend,) = [ln for ax in fig.axes for ln in ax.get_lines() if ln.get_gid() == "gain_rolling_mean"]
    raw = _gain_line(fig)
    smoothed = np.asarray(trend.get_ydata(), dtype=float)
    # A mean never leaves the range of what it averages, and it is calmer.
    assert raw.min() <= smoothed.min() and smoothed.max() <= raw.max()
    assert np.abs(np.diff(smoothed)).max() < np.abs(np.diff(raw)).max()


def _gain_line(fig: Figure) -> np.ndarray:
    (line,) = [ln for ax in fig.axes for ln in ax.get_lines() if ln.get_gid() == "gain"]
    return np.asarray(line.get_ydata(), dtype=float)


def test_gain_is_zero_everywhere_when_the_layouts_agree(runs, steps) -> None:
    off = steps[steps["layout"] == "off"]
    twins = pd.concat([off, off.assign(layout="on")], ignore_index=True)
    assert (_gain_line(plots.gain_figure(twins)) == 0).all()
    capped = runs["capped"].steps
    assert (plots.concurrency_gain(capped)["gain"] == 0).all()
    assert (_gain_line(plots.gain_figure(capped)) == 0).all()
    # Control: where the pool binds, the new layout runs more at some moment.
    assert _gain_line(plots.gain_figure(steps)).max() > 0


# --- sweeps ---------------------------------------------------------------------


@pytest.fixture
def hand_sweep() -> pd.DataFrame:
    """Two seeds per rate, rows shuffled: off first preempts at 1 (seed 1
    only), on at 4; the first row with preemptions is at x = 2."""
    rows = [
        (2.0, "off", 0, 7),
        (4.0, "on", 0, 3),
        (0.5, "off", 0, 0),
        (1.0, "off", 0, 0),
        (1.0, "off", 1, 2),
        (0.5, "on", 1, 0),
        (2.0, "on", 0, 0),
        (1.0, "on", 0, 0),
        (4.0, "off", 1, 9),
        (0.5, "off", 1, 0),
        (0.5, "on", 0, 0),
        (1.0, "on", 1, 0),
        (2.0, "off", 1, 5),
        (2.0, "on", 1, 0),
        (4.0, "off", 0, 8),
        (4.0, "on", 1, 0),
    ]
    frame = pd.DataFrame(rows, columns=["workload.rate_scale", "layout", "seed", "num_preemptions"])
    frame["scenario"] = "hand"
    for column in ("num_admitted", "mean_concurrency", "peak_concurrency", "output_throughput_tokens_per_s"):
        frame[column] = frame["workload.rate_scale"] * (frame["layout"] == "on") + 10
    return frame


def _onset_lines(fig: Figure, layout: str) -> set[float]:
    return {
        float(line.get_xdata()[0])
        for ax in fig.axes
        for line in ax.get_lines()
        if line.get_gid() == f"onset-{layout}"
    }


def test_preemption_onset_is_the_first_x_with_preemptions(hand_sweep) -> None:
    x = "workload.rate_scale"
    assert plots.preemption_onset(hand_sweep, x) == {"off": 1.0, "on": 4.0}
    fig = plots.sweep_figure(hand_sweep, x)
    assert _onset_lines(fig, "off") == {1.0}
    assert _onset_lines(fig, "on") == {4.0}
    # Controls: the first preempting row in frame order, or the mean over seeds
    # rounded, would mark another x; a sweep without preemptions marks none.
    assert hand_sweep[hand_sweep["num_preemptions"] > 0][x].iloc[0] != 1.0
    calm = hand_sweep.assign(num_preemptions=0)
    assert plots.preemption_onset(calm, x) == {"off": None, "on": None}
    assert _onset_lines(plots.sweep_figure(calm, x), "off") == set()


def test_sweep_gain_is_on_minus_off_averaged_over_seeds(hand_sweep) -> None:
    means = plots.sweep_means(hand_sweep, "workload.rate_scale")
    off = means[(means["layout"] == "off") & (means["workload.rate_scale"] == 2.0)]
    assert off["num_preemptions"].item() == 6.0
    with pytest.raises(ValueError, match="x: no column 'nope'"):
        plots.sweep_means(hand_sweep, "nope")


# --- files ------------------------------------------------------------------------


def _leftovers(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.startswith(".") or p.suffix == ".tmp"]


def test_write_standard_figures_writes_png_and_svg_atomically(runs, tmp_path) -> None:
    written = plots.write_standard_figures(tmp_path, runs["binds"].frames())
    plot_dir = tmp_path / "plots"
    assert sorted(p.name for p in written) == sorted(
        f"{name}.{fmt}" for name in ("admission", "eviction", "gain") for fmt in ("png", "svg")
    )
    assert all(p.parent == plot_dir for p in written)
    pngs = [p for p in written if p.suffix == ".png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in pngs)
    for svg in plot_dir.glob("*.svg"):
        assert ElementTree.parse(svg).getroot().tag.endswith("svg")
    assert _leftovers(plot_dir) == []


def test_a_failed_write_leaves_the_old_file_and_no_temp_file(runs, tmp_path) -> None:
    (plot_dir := tmp_path / "plots").mkdir()
    (plot_dir / "admission.png").write_bytes(b"old")
    fig = plots.admission_figure(runs["binds"].steps)

    def broken_savefig(*args, **kwargs):
        Path(args[0]).write_bytes(b"half a PNG")
        raise OSError("disk full")

    fig.savefig = broken_savefig  # type: ignore[method-assign]
    with pytest.raises(OSError, match="disk full"):
        plots.write_figure(fig, plot_dir / "admission", ["png"])
    assert (plot_dir / "admission.png").read_bytes() == b"old"
    assert _leftovers(plot_dir) == []


def test_one_layout_gets_no_gain_figure(runs, tmp_path) -> None:
    frames = {name: frame[frame["layout"] == "on"] for name, frame in runs["binds"].frames().items()}
    written = plots.write_standard_figures(tmp_path, frames, ["png"])
    assert sorted(p.name for p in written) == ["admission.png", "eviction.png"]


# --- kvsim plot ------------------------------------------------------------------


def _plot(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    plot_command.register(parser.add_subparsers())
    args = parser.parse_args(["plot", *argv])
    return args.func(args)


def test_kvsim_plot_on_a_non_results_dir_is_a_one_line_error(tmp_path) -> None:
    (tmp_path / "notes.txt").write_text("not results")
    with pytest.raises(ConfigError) as error:
        _plot(str(tmp_path))
    assert "not a kvsim results directory" in str(error.value)
    assert "\n" not in str(error.value)
    assert not (tmp_path / "plots").exists()


def test_kvsim_plot_on_an_incomplete_results_dir_is_a_one_line_error(runs, tmp_path) -> None:
    write_results(tmp_path, runs["binds"].frames(), {"name": "tiny"})
    (tmp_path / "steps.parquet").unlink()  # as in a directory from an older kvsim
    with pytest.raises(ConfigError, match=r"incomplete results directory: no steps\.parquet$"):
        _plot(str(tmp_path))
    assert not (tmp_path / "plots").exists()


def test_kvsim_plot_draws_a_results_dir_and_its_sweep(runs, hand_sweep, tmp_path, capsys) -> None:
    result = runs["binds"]
    write_results(tmp_path, result.frames(), {"name": "tiny"})
    assert _plot(str(tmp_path), "--format", "png") == 0
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "admission.png",
        "eviction.png",
        "gain.png",
    ]
    assert "plots written" in capsys.readouterr().out
    hand_sweep.to_parquet(tmp_path / plots.SWEEP_FRAME)
    assert _plot(str(tmp_path), "--format", "svg") == 0
    assert (tmp_path / "plots" / "sweep.svg").exists()


def test_kvsim_plot_sweep_only_dir_and_ambiguous_sweeps(hand_sweep, tmp_path) -> None:
    hand_sweep.to_parquet(tmp_path / plots.SWEEP_FRAME)
    assert _plot(str(tmp_path), "--format", "png") == 0
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["sweep.png"]
    hand_sweep.assign(**{"deployment.max_num_seqs": hand_sweep["seed"] + 8}).to_parquet(
        tmp_path / plots.SWEEP_FRAME
    )
    with pytest.raises(ConfigError, match="cannot tell the swept column.*--x"):
        _plot(str(tmp_path))
    assert _plot(str(tmp_path), "--x", "workload.rate_scale", "--format", "png") == 0


def test_kvsim_plot_rejects_unknown_formats(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        _plot(str(tmp_path), "--format", "png,gif")
    assert stop.value.code == 2
    assert "expected formats among png,svg,pdf" in capsys.readouterr().err


def test_plots_import_neither_vllm_nor_the_engine() -> None:
    """``kvsim plot`` only reads frames: it must not pay vLLM's import time."""
    code = (
        "import sys, sim.analysis.plots; heavy = ('vllm', 'torch', 'sim.engine'); "
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
