"""``kvsim validate``: simulated against measured. Identical runs compare
with zero error; known differences give the errors derived by hand; what a
side cannot measure is "-", not an error."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
from helpers.replay_dirs import write_replay_dir, write_sim_dir
from helpers.scenarios import scenario as make_scenario

from sim.analysis import validate as v
from sim.analysis.runs import run_scenario
from sim.cli import main
from sim.scenario import scenario_to_dict

SMALL = {
    "trace": "synthetic",
    "num_requests": 16,
    "arrival": {"process": "poisson", "rate_per_s": 4.0},
    "prompt": {"distribution": "uniform", "lo": 500, "hi": 3000},
    "output": {"distribution": "uniform", "lo": 20, "hi": 80},
}
SAMPLED = {"sample_interval_s": 0.25}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A simulation of both layouts, the same relabelled as a replay, and a
    replay of a rig with 2 ms more overhead per step (another step_time)."""
    tmp = tmp_path_factory.mktemp("validate")
    scenario = make_scenario(tmp, "small", workload=SMALL, simulation=SAMPLED)
    slower = make_scenario(
        tmp, "small", ["step_time.step_overhead_s=0.007"], workload=SMALL, simulation=SAMPLED
    )
    result = run_scenario(scenario)
    data = scenario_to_dict(scenario)
    return {
        "sim": write_sim_dir(tmp / "sim", result, data),
        "same": write_replay_dir(tmp / "same", result, data),
        "slower": write_replay_dir(tmp / "slower", run_scenario(slower), data),
        "off": write_replay_dir(tmp / "off", result, data, ("off",)),
        "on": write_replay_dir(tmp / "on", result, data, ("on",)),
    }


def _report(capsys, runs, replay: str, tmp_path) -> dict:
    out = tmp_path / "validate"
    assert main(["validate", str(runs["sim"]), str(runs[replay]), "--out", str(out)]) == 0
    capsys.readouterr()
    return json.loads((out / "validate.json").read_text())


def test_identical_runs_have_zero_error(runs, capsys, tmp_path):
    report = _report(capsys, runs, "same", tmp_path)
    assert report["layouts"] == ["off", "on"]
    errors = [row["error"] for row in report["metrics"] if row["error"] is not None]
    assert len(errors) >= 2 * 10 and all(error == 0 for error in errors)
    assert all(row["rmse"] == 0 and row["num_points"] > 5 for row in report["curves"])
    assert sorted(p.name for p in (tmp_path / "validate" / "plots").glob("*.png")) == [
        "overlay-off.png",
        "overlay-on.png",
    ]


def test_a_slower_rig_shows_as_error(runs, capsys, tmp_path):
    """Failing control of the zero-error test: the same workload on a rig
    whose steps take 2 ms longer finishes later, and validate says so."""
    rows = {(r["layout"], r["metric"]): r for r in _report(capsys, runs, "slower", tmp_path)["metrics"]}
    for layout in ("off", "on"):
        assert rows[(layout, "e2e_p50_s")]["error"] < 0  # simulated faster than measured
        assert rows[(layout, "ttft_p50_s")]["error_perc"] < 0
        assert rows[(layout, "num_finished")]["error"] == 0


def test_nan_on_one_side_prints_a_dash_and_is_no_error(runs, capsys, tmp_path):
    """A replay that cannot count preemptions: "-" in the table, null in the JSON."""
    summary_path = runs["same"] / "summary.parquet"
    summary = pd.read_parquet(summary_path)
    changed = tmp_path / "replay"
    changed.mkdir()
    for path in runs["same"].iterdir():
        if path.is_file():
            (changed / path.name).write_bytes(path.read_bytes())
    summary.assign(num_preemptions=np.nan).to_parquet(changed / "summary.parquet", index=False)
    out = tmp_path / "out"
    assert main(["validate", str(runs["sim"]), str(changed), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    line = next(line for line in printed.splitlines() if line.startswith("num_preemptions"))
    assert line.split()[2:] == ["-", "-", "-"]
    rows = json.loads((out / "validate.json").read_text())["metrics"]
    preemptions = [r for r in rows if r["metric"] == "num_preemptions"]
    assert all(r["replay"] is None and r["error"] is None and r["sim"] is not None for r in preemptions)


def _samples(times_s, values, column="num_requests_running") -> pd.DataFrame:
    return pd.DataFrame({"time_s": np.asarray(times_s, float), column: np.asarray(values, float)})


@pytest.mark.parametrize(
    ("sim", "replay", "rmse", "mape_perc"),
    [
        # The same ramp, one reading late: errors 0, 2, 2, 2, 2.
        (
            (range(5), [0, 2, 4, 6, 8]),
            (range(5), [0, 0, 2, 4, 6]),
            math.sqrt(16 / 5),
            100 * (1 + 1 / 2 + 1 / 3) / 3,
        ),
        # Off by one everywhere: RMSE 1; MAPE 1/2, 1/3, 1/4 of 2, 3, 4.
        ((range(3), [1, 2, 3]), (range(3), [2, 3, 4]), 1.0, 100 * (1 / 2 + 1 / 3 + 1 / 4) / 3),
        # The same ramp read between the other's readings: interpolated, equal.
        ((range(5), [0, 2, 4, 6, 8]), (np.arange(5) + 0.5, [1, 3, 5, 7, 9]), 0.0, 0.0),
        # No measured reading is non-zero: MAPE means nothing.
        ((range(3), [1, 1, 1]), (range(3), [0, 0, 0]), 1.0, float("nan")),
    ],
)
def test_curve_error_matches_hand_derivation(sim, replay, rmse, mape_perc):
    error = v.curve_error(_samples(*sim), _samples(*replay), "num_requests_running")
    assert error["rmse"] == pytest.approx(rmse)
    assert error["mape_perc"] == pytest.approx(mape_perc, nan_ok=True)


def test_a_run_that_stops_early_is_charged_for_the_rest():
    """The replay's readings start 2 s later and end 1 s earlier than the
    simulation's (both a ramp equal to the time): it read 0 before and after,
    so the errors are 0, 1 (t = 1), 0 ... 0, 9 (t = 9) on the grid 0..9."""
    sim, replay = _samples(range(10), range(10)), _samples(range(2, 9), range(2, 9))
    assert list(v.common_grid(sim, replay, "num_requests_running")) == list(range(10))
    error = v.curve_error(sim, replay, "num_requests_running")
    assert error["rmse"] == pytest.approx(math.sqrt((1 + 81) / 10))


def test_a_missing_source_column_reads_as_the_simulator():
    frame = pd.DataFrame({"layout": ["on"]})
    assert list(v.with_source(frame)["source"]) == ["sim"]
    assert list(v.with_source(frame.assign(source="replay"))["source"]) == ["replay"]


def test_runs_without_a_common_layout_are_a_one_line_error(runs, capsys, tmp_path):
    only_on = tmp_path / "on"
    result = pd.read_parquet(runs["same"] / "summary.parquet")
    for path in runs["same"].iterdir():
        if path.is_file():
            (only_on / path.name).parent.mkdir(exist_ok=True)
            (only_on / path.name).write_bytes(path.read_bytes())
    result.assign(layout="mystery").to_parquet(only_on / "summary.parquet", index=False)
    assert main(["validate", str(runs["sim"]), str(only_on)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvsim: error: ") and "no layout in both runs" in err and err.count("\n") == 1
    assert main(["validate", str(runs["sim"]), str(tmp_path / "nowhere")]) == 2
    assert "not a kvsim results directory" in capsys.readouterr().err


def test_one_replay_per_layout(runs, capsys, tmp_path):
    """The rig how-to replays each layout into its own directory."""
    out = tmp_path / "validate"
    assert main(["validate", str(runs["sim"]), str(runs["off"]), str(runs["on"]), "--out", str(out)]) == 0
    report = json.loads((out / "validate.json").read_text())
    assert report["layouts"] == ["off", "on"]
    assert all(row["error"] in (0, None) for row in report["metrics"])
    assert main(["validate", str(runs["sim"]), str(runs["on"]), str(runs["same"])]) == 2
    assert "a layout is in more than one replay" in capsys.readouterr().err


def test_arrivals_too_dense_for_per_request_comparison(runs, capsys):
    """Two requests sent a millisecond apart (the server may take them in
    either order): the reorder-sensitive percentiles are shown but not
    compared (error NaN), the note says why and what is compared instead;
    the bursts' figures are compared. Control: with no reorder window, the
    same frames compare every metric."""
    from sim.commands.validate import print_validation
    from sim.results import read_run

    sim = read_run(runs["sim"])[0]
    replay = read_run(runs["same"])[0]
    requests = replay["requests"].copy()
    requests["sent_s"] = requests["arrival_s"]
    first = requests.index[requests["request_id"] == requests["request_id"].iloc[0]]
    second = requests.index[requests["request_id"] == requests["request_id"].iloc[1]]
    requests.loc[second, "sent_s"] = requests.loc[first, "sent_s"].to_numpy() + 0.001
    replay = {**replay, "requests": requests}
    table = v.metric_table(sim, replay, 0.002).set_index(["layout", "metric"])
    for layout in ("off", "on"):
        for metric in v.REORDER_SENSITIVE:
            assert not table.loc[(layout, metric), "comparable"] and math.isnan(
                table.loc[(layout, metric), "error"]
            )
        for metric in ("ttft_p99_s", *v.BURST_METRICS):
            assert table.loc[(layout, metric), "comparable"]
            assert not math.isnan(table.loc[(layout, metric), "sim"])
    report = v.validation_report(sim, replay, 0.002)
    assert report["burst_share"] == {"off": 2 / 16, "on": 2 / 16}
    control = v.metric_table(sim, replay, 0.0)
    assert control["comparable"].all()
    print_validation(sim, replay, 0.002)
    printed = capsys.readouterr().out
    assert "12 % of the requests reached the server within 0.002 s of another: too dense" in printed
    assert "not compared: ttft_p50_s, ttft_p90_s, e2e_p50_s" in printed
