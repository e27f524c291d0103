"""Sweeps: grid parsing, order-independent run ids, the same frame on every
executor, resume after an interruption (Ctrl-C and a real kill -9), and the
capacity search (on a stub with a known threshold and on a real scenario)."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml
from helpers.scenarios import pre_rig
from hypothesis import given
from hypothesis import strategies as st

from sim.analysis import executors
from sim.analysis.capacity import CapacitySearch, find_max_rate, run_capacity_search
from sim.analysis.sweep import GridAxis, parse_grid, plan_runs, run_sweep
from sim.commands.sweep import register as register_cli
from sim.config import ConfigError
from sim.fork.retention import RetainingMambaManager
from sim.paths import DEFAULT_MODEL, PROJECT_ROOT

# Tens of requests on a small pool (116 blocks): a run takes well under a
# second, the pool binds (old layout ~5 at once, new ~6) and the run stops
# at 30 s with a queue.
TINY = {
    "name": "tiny",
    "seed": 0,
    "model": str(DEFAULT_MODEL),
    "deployment": {"max_num_seqs": 16, "kv_cache_memory_bytes": 1_500_000_000},
    "workload": {
        "trace": "synthetic",
        "arrival": {"process": "poisson", "rate_per_s": 1.0},
        "prompt": {"distribution": "uniform", "lo": 4000, "hi": 16000},
        "output": {"distribution": "fixed", "tokens": 64},
        "num_requests": 30,
    },
    "simulation": {"max_time_s": 30},
}
GRID = ["workload.rate_scale=0.5,0.75,1", "layout=off,on"]
NUM_RUNS = 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("scenario") / "tiny.yaml"
    path.write_text(yaml.safe_dump(pre_rig(TINY), sort_keys=False))
    return path


def plan(tiny: Path, grid: list[str] = GRID) -> list[executors.RunSpec]:
    return plan_runs(str(tiny), [], [parse_grid(text) for text in grid])


@pytest.fixture(scope="module")
def reference(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> pd.DataFrame:
    """The uninterrupted sweep, run in this process."""
    return run_sweep(plan(tiny), tmp_path_factory.mktemp("reference"), workers=1)


def by_run_id(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.sort_values("run_id").reset_index(drop=True)


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="kvsim")
    register_cli(parser.add_subparsers())
    args = parser.parse_args(["sweep", *argv])
    return args.func(args)


# ----------------------------------------------------------------- grid
@pytest.mark.parametrize(
    ("text", "key", "values"),
    [
        ("workload.rate_scale=0.5,1,2.0", "workload.rate_scale", (0.5, 1, 2)),
        (
            "deployment.kv_cache_memory_bytes=4.1e9,3e9",
            "deployment.kv_cache_memory_bytes",
            (4_100_000_000, 3_000_000_000),
        ),
        ("seed=0,1", "seed", (0, 1)),
        ("layout=on,off", "layout", ("on", "off")),
        ("workload.window_s=[0,300],[300, 600]", "workload.window_s", ([0, 300], [300, 600])),
        ("workload.trace=default", "workload.trace", ("default",)),
    ],
)
def test_parse_grid(text: str, key: str, values: tuple) -> None:
    assert parse_grid(text) == GridAxis(key, values)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("workload.rate_scale", "expected key=v1,v2"),
        ("=1,2", "expected key=v1,v2"),
        ("rate scale=1", "expected key=v1,v2"),
        ("seed=", "empty value"),
        ("seed=1,,2", "empty value"),
        ("seed=1,1.0", "repeated"),
        ("layout=off,maybe", "layouts are off and on"),
    ],
)
def test_malformed_grid_is_one_line_error(text: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as error:
        parse_grid(text)
    assert text in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("grid", "says"),
    [
        (["workload.rate_scal=1,2"], "--grid workload.rate_scal=1: .*unknown key 'workload.rate_scal'"),
        (["deployment.max_num_seqs=8,-1"], "--grid deployment.max_num_seqs=-1: .*max_num_seqs"),
        (["seed=0,1", "seed=2"], "--grid seed: given more than once"),
        (["workload.rate_scale"], "--grid 'workload.rate_scale': expected key=v1,v2"),
    ],
)
def test_bad_grid_fails_before_any_run(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, grid: list[str], says: str
) -> None:
    monkeypatch.setattr(executors, "run_one", lambda spec: pytest.fail("a run started"))
    argv = [str(tiny), "--out", str(tmp_path / "out"), "--workers", "1"]
    with pytest.raises(ConfigError, match=says) as error:
        cli(*argv, *(f"--grid={g}" for g in grid))
    assert "\n" not in str(error.value)
    assert not (tmp_path / "out").exists()


def test_ray_executor_without_ray_is_one_line_error(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(ConfigError, match=r"needs Ray.*pip install 'kvsim\[ray\]'"):
        cli(str(tiny), "--executor", "ray", "--out", str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------- run ids
def test_run_id_depends_on_parameters_not_order(tiny: Path, tmp_path: Path) -> None:
    forward = {json.dumps(s.params, sort_keys=True): s.run_id for s in plan(tiny)}
    backward = plan(tiny, ["layout=on,off", "workload.rate_scale=1,0.75,0.5"])
    assert {json.dumps(s.params, sort_keys=True): s.run_id for s in backward} == forward
    assert len(set(forward.values())) == NUM_RUNS
    # Where the scenario file lies is no parameter; 1 and 1.0 are one value.
    moved = tmp_path / "elsewhere.yaml"
    moved.write_text(tiny.read_text())
    assert {s.run_id for s in plan(moved, ["workload.rate_scale=0.5,0.75,1.0"])} == set(forward.values())


# ------------------------------------------------------------- executors
def test_local_processes_give_the_in_process_frame(
    tiny: Path, tmp_path: Path, reference: pd.DataFrame
) -> None:
    frame = run_sweep(plan(tiny), tmp_path, workers=2)
    pd.testing.assert_frame_equal(by_run_id(frame), by_run_id(reference))
    assert list(frame.columns[:3]) == ["run_id", "workload.rate_scale", "scenario"]
    assert json.loads((tmp_path / "sweep.json").read_text())["complete"] is True


def test_ray_gives_the_in_process_frame(tiny: Path, tmp_path: Path, reference: pd.DataFrame) -> None:
    pytest.importorskip("ray")
    frame = run_sweep(plan(tiny), tmp_path, executor="ray", workers=2)
    pd.testing.assert_frame_equal(by_run_id(frame), by_run_id(reference))


# ---------------------------------------------------------------- resume
def test_interrupted_sweep_resumes_without_loss_or_duplicates(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference: pd.DataFrame
) -> None:
    real_run_one, calls = executors.run_one, []

    def interrupted(spec: executors.RunSpec) -> dict:
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(spec.run_id)
        return real_run_one(spec)

    monkeypatch.setattr(executors, "run_one", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(plan(tiny), tmp_path, workers=1)
    assert sorted(p.stem for p in (tmp_path / "runs").glob("*.json")) == sorted(calls)
    assert not (tmp_path / "sweep.parquet").exists()
    with pytest.raises(ConfigError, match="pass --resume"):
        run_sweep(plan(tiny), tmp_path, workers=1)

    resumed: list[str] = []
    monkeypatch.setattr(executors, "run_one", lambda spec: resumed.append(spec.run_id) or real_run_one(spec))
    frame = run_sweep(plan(tiny), tmp_path, workers=1, resume=True)
    assert len(resumed) == NUM_RUNS - 2 and not set(resumed) & set(calls)
    assert len(list((tmp_path / "runs").glob("*.json"))) == NUM_RUNS
    pd.testing.assert_frame_equal(by_run_id(frame), by_run_id(reference))


CHILD = """
import argparse, sys
from sim.commands.sweep import register as register_cli
parser = argparse.ArgumentParser()
register_cli(parser.add_subparsers())
args = parser.parse_args(sys.argv[1:])
sys.exit(args.func(args))
"""


def test_kill_9_mid_sweep_then_resume(tiny: Path, tmp_path: Path, reference: pd.DataFrame) -> None:
    """A real SIGKILL of a sweep process the moment its first run file
    appears: the finished runs are whole, --resume completes the rest."""
    runs, log = tmp_path / "out" / "runs", tmp_path / "child.log"
    argv = ["sweep", str(tiny), *(f"--grid={g}" for g in GRID), "--out", str(runs.parent), "--workers", "1"]
    with log.open("wb") as stderr:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, *argv],
            cwd=PROJECT_ROOT,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    try:
        deadline = time.monotonic() + 180
        while not list(runs.glob("*.json")) and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
    finally:
        child.wait()
    finished = len(list(runs.glob("*.json")))
    assert child.returncode == -signal.SIGKILL, log.read_text()[-2000:]
    assert 1 <= finished < NUM_RUNS
    assert cli(*argv[1:], "--resume") == 0
    frame = pd.read_parquet(runs.parent / "sweep.parquet")
    assert json.loads((runs.parent / "sweep.json").read_text())["complete"] is True
    assert len(list(runs.glob("*.json"))) == NUM_RUNS and not list(runs.glob(".*"))
    pd.testing.assert_frame_equal(by_run_id(frame), by_run_id(reference))


def test_cli_sweep_writes_the_frame(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], reference: pd.DataFrame
) -> None:
    rc = cli(
        str(tiny),
        "--grid",
        "workload.rate_scale=1",
        "--grid",
        "layout=on",
        "--out",
        str(tmp_path),
        "--workers",
        "1",
    )
    assert rc == 0 and "1 runs written" in capsys.readouterr().out
    frame = pd.read_parquet(tmp_path / "sweep.parquet")
    expected = reference[(reference["workload.rate_scale"] == 1) & (reference["layout"] == "on")]
    pd.testing.assert_frame_equal(frame, expected.reset_index(drop=True), check_dtype=False)


# ------------------------------------------------------- capacity search
@pytest.mark.parametrize(
    ("threshold", "max_rate", "capped"),
    [
        (1.37, 1.37, False),
        (20.0, 10.0, True),
        (0.05, None, False),
    ],
)
def test_find_max_rate_on_a_stub(threshold: float, max_rate: float | None, capped: bool) -> None:
    seen: list[float] = []
    result = find_max_rate(lambda rate: seen.append(rate) or rate <= threshold, 0.1, 10.0, 0.01)
    assert result.capped == capped and result.num_evaluations == len(seen)
    if max_rate is None:
        assert result.max_rate is None and seen == [0.1]
    elif capped:
        assert result.max_rate == 10.0 and seen == [0.1, 10.0]
    else:
        assert result.lo <= threshold < result.hi <= result.lo * 1.01
        assert result.max_rate == result.lo
        # Log-space bisection: ceil(log2(ln(100) / ln(1.01))) steps after the bounds.
        assert len(seen) == 2 + math.ceil(math.log2(math.log(100) / math.log(1.01)))


@given(threshold=st.floats(0.5, 50.0), precision=st.floats(0.001, 0.5))
def test_find_max_rate_brackets_any_threshold(threshold: float, precision: float) -> None:
    result = find_max_rate(lambda rate: rate <= threshold, 0.5, 50.0, precision)
    assert result.capped == (threshold >= 50.0)
    if not result.capped:
        assert result.lo <= threshold < result.hi <= result.lo * (1 + precision)


def test_find_max_rate_on_a_real_scenario(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The search needs a rate that preempts below 2x: with the fork's
    # checkpoint reserve at admission (patch 0086) the tiny scenario never
    # preempts, so admission here holds checkpoints without reserving them.
    monkeypatch.setattr(RetainingMambaManager, "retained_checkpoint_blocks_to_reserve", lambda *args: 0)
    search = CapacitySearch(str(tiny), (), (parse_grid("layout=off"),), 0.05, 2.0, 0.1)
    frame = run_capacity_search(search, tmp_path, workers=1)
    (row,) = frame.itertuples()
    assert not row.capped and row.bracket_hi <= row.bracket_lo * 1.1 and row.max_rate_scale == row.bracket_lo
    runs = [json.loads(p.read_text()) for p in (tmp_path / "runs").glob("*.json")]
    preemptions = {r["params"]["workload.rate_scale"]: r["summary"]["num_preemptions"] for r in runs}
    assert preemptions[row.bracket_lo] == 0 and preemptions[row.bracket_hi] > 0
    assert len(runs) == row.num_evaluations
    # Every evaluation is a cached run: resuming replays the search with no new run.
    monkeypatch.setattr(executors, "run_one", lambda spec: pytest.fail("a run started"))
    again = run_capacity_search(search, tmp_path, workers=1, resume=True)
    pd.testing.assert_frame_equal(again, frame)


def test_capacity_search_rejects_a_swept_rate(tiny: Path, tmp_path: Path) -> None:
    search = CapacitySearch(str(tiny), (), (parse_grid("workload.rate_scale=1,2"),), 0.1, 1.0)
    with pytest.raises(ConfigError, match="--find-max-rate sets the rate itself"):
        run_capacity_search(search, tmp_path, workers=1)
