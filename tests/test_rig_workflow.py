"""The rig workflow on a real trace, end to end: a Mooncake slice replayed
against ``kvsim serve`` standing in for a rig whose step times differ from
the model's, then ``validate`` and ``calibrate`` (which gives the rig's
coefficients back); and every command that reads a results directory, on
the directories ``run``, ``compare``, ``replay`` and ``sweep`` wrote for it.

The directories are made once for the module (fixtures) and shared. The
server listens on 127.0.0.1 and ``kvsim replay --launch`` stops it in a
``finally``; every wait has a deadline.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml
from helpers.replay_dirs import DEFAULTS, RIG
from helpers.scenarios import write_scenario

from sim.cli import main
from sim.scenario import load_scenario, scenario_from_record
from sim.step_time import StepTimeConfig

# The shipped Mooncake conversation slice: its first 20 requests, the 3 s
# burst stamps spread (a burst sent over HTTP arrives a few ms apart, so the
# server would batch it differently from the simulation), prompts clamped
# to 2,000 tokens and outputs to 800 so that decode steps (memory-bound)
# weigh in the request times beside prefills (compute-bound): both fitted
# coefficients are identifiable. About 20 s of scenario time.
MOONCAKE_SLICE = {
    "trace": "default",
    "max_requests": 20,
    "max_prompt_len": 2000,
    "max_output_len": 800,
    "spread_bursts": True,
}
# Scenario seconds per wall second. Token delivery over HTTP and the event
# loop add a few wall milliseconds to every request time (~25 ms on a loaded
# 2-core machine), which --speed multiplies into scenario time: at 2 the fit
# lands within 2 % of the rig's coefficients there (5 % allowed, as the
# simulated calibration test allows).
SPEED = 2.0
FIT_TOLERANCE = 0.05


def _kvsim(*argv: str) -> None:
    assert main(list(argv)) == 0, argv


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("workflow")


@pytest.fixture(scope="module")
def scenario_path(root) -> Path:
    return write_scenario(
        root,
        "mooncake-slice",
        deployment={"max_num_seqs": 16},
        simulation={"sample_interval_s": 0.5},
        workload=MOONCAKE_SLICE,
    )


@pytest.fixture(scope="module")
def run_dir(root, scenario_path) -> Path:
    _kvsim("run", str(scenario_path), "--layout", "on", "--out", str(root / "run"))
    return root / "run"


@pytest.fixture(scope="module")
def compare_dir(root, scenario_path) -> Path:
    _kvsim("compare", str(scenario_path), "--out", str(root / "compare"))
    return root / "compare"


@pytest.fixture(scope="module")
def replay_dir(root, scenario_path) -> Path:
    """The slice replayed (layout on) against ``kvsim serve`` started with
    the rig's coefficients: the measurement of a rig the model mis-times."""
    rig = " ".join(f"--set step_time.{key}={value!r}" for key, value in RIG.items())
    server = (
        f"{sys.executable} -m sim.cli serve {scenario_path} --layout on --port {{port}} --speed {SPEED} {rig}"
    )
    out = root / "replay"
    _kvsim(
        "replay", str(scenario_path), "--layout", "on", "--launch", "--server-cmd", server,
        "--speed", str(SPEED), "--out", str(out), "--boot-timeout", "300", "--request-timeout", "120",
    )  # fmt: skip
    return out


@pytest.fixture(scope="module")
def sweep_dir(root, scenario_path) -> Path:
    out = root / "sweep"
    grid = ("--grid", "layout=on", "--grid", "deployment.max_num_seqs=8,16")
    _kvsim("sweep", str(scenario_path), *grid, "--workers", "1", "--out", str(out))
    return out


def test_replay_validate_calibrate_recovers_the_rigs_coefficients(run_dir, replay_dir, tmp_path, capsys):
    manifest = json.loads((replay_dir / "manifest.json").read_text())
    assert manifest["complete"] is True and manifest["pool_plan_check"] == "ok"
    assert main(["validate", str(run_dir), str(replay_dir), "--out", str(tmp_path / "validate")]) == 0
    report = json.loads((tmp_path / "validate" / "validate.json").read_text())
    assert report  # the table, per layout
    capsys.readouterr()
    fitted_path = tmp_path / "fitted.yaml"
    argv = ["calibrate", str(replay_dir), "--fit", "compute_efficiency,memory_efficiency"]
    assert main([*argv, "--out", str(fitted_path), "--max-simulations", "70"]) == 0
    assert "--- before" in capsys.readouterr().out
    fitted = yaml.safe_load(fitted_path.read_text())["step_time"]
    assert set(fitted) == set(RIG)
    for name, truth in RIG.items():
        # Control: the model's own value is no answer (the rig differs by >= 25 %).
        assert abs(DEFAULTS[name] / truth - 1) > 0.2
        assert fitted[name] == pytest.approx(truth, rel=FIT_TOLERANCE), name


def test_each_directory_records_the_scenario_that_ran(scenario_path, run_dir, compare_dir, replay_dir):
    """The replay records the scenario it replayed (the model's), not the
    server's: the rig's step times are what calibrate is to find."""
    ran = load_scenario(str(scenario_path))
    for directory in (run_dir, compare_dir, replay_dir):
        record = json.loads((directory / "scenario.json").read_text())
        assert record["workload"]["prefix_unit"] == 16  # a synthetic key, at its default
        assert scenario_from_record(record, str(directory)) == ran


def test_plot_draws_every_kind_of_directory(run_dir, compare_dir, replay_dir, sweep_dir, capsys):
    expected = {
        run_dir: {"admission", "eviction"},
        compare_dir: {"admission", "eviction", "gain"},
        replay_dir: {"measured"},
        sweep_dir: {"sweep"},
    }
    for directory, figures in expected.items():
        assert main(["plot", str(directory), "--format", "png"]) == 0, directory
        assert {path.stem for path in (directory / "plots").glob("*.png")} == figures, directory
    listed = json.loads((replay_dir / "manifest.json").read_text())["files"]
    assert "plots/measured.png" in listed
    assert "plots written" in capsys.readouterr().out


def test_validate_takes_a_compare_directory(compare_dir, replay_dir, tmp_path, capsys):
    """A compare holds both layouts; validate judges the one replayed."""
    assert main(["validate", str(compare_dir), str(replay_dir), "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "layout on: simulated vs measured" in printed and "layout off" not in printed


def test_calibrate_reads_a_compare_directory(compare_dir, tmp_path, capsys):
    """What ``results/default`` of ``kvsim compare`` could not do: its
    recorded scenario loads, and the fit runs (on the model's own output):
    the step overhead, a small share of this load's busy time, is reported
    not identifiable, with that reason, at its start; nothing is written."""
    out = tmp_path / "fitted.yaml"
    argv = ["calibrate", str(compare_dir), "--fit", "step_overhead_s", "--max-simulations", "4"]
    assert main([*argv, "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert "none is identifiable from this replay" in captured.err and not out.exists()
    start = StepTimeConfig().step_overhead_s  # the default the compare ran with
    reason = "step_overhead_s: not identifiable from this replay: the step overhead is "
    assert reason in captured.out and f"(left at {start:.6g})" in captured.out


def test_sweep_resume_runs_nothing_again(scenario_path, sweep_dir, capsys):
    before = pd.read_parquet(sweep_dir / "sweep.parquet")
    runs = {path: path.stat().st_mtime_ns for path in (sweep_dir / "runs").glob("*.json")}
    assert len(runs) == 2
    grid = ("--grid", "layout=on", "--grid", "deployment.max_num_seqs=8,16")
    argv = ["sweep", str(scenario_path), *grid, "--workers", "1", "--out", str(sweep_dir)]
    assert main(argv) == 2  # control: without --resume the finished runs are not overwritten
    assert "pass --resume" in capsys.readouterr().err
    assert main([*argv, "--resume"]) == 0
    assert {path: path.stat().st_mtime_ns for path in (sweep_dir / "runs").glob("*.json")} == runs
    pd.testing.assert_frame_equal(pd.read_parquet(sweep_dir / "sweep.parquet"), before)
