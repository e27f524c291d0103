"""Regression gates: they pass on their baselines, fail (exit 1, one clear
line per failure) when the allocator gets worse or the pool shrinks,
--update records new baselines that the next run passes, bad gate files are
one-line errors, and the shipped gates' baselines are current."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml
from helpers.scenarios import pre_rig

import sim.engine_assembly
from sim.analysis import gates
from sim.analysis.gates import DEFAULT_GATES, judge, parse_tolerance, rewrite_baselines, run_gates
from sim.commands import gate as gate_command
from sim.config import ConfigError, load_yaml_text
from sim.paths import DEFAULT_MODEL

# 6K-token prompts arriving fast: the pool stops admitting at ~16 requests
# in the old layout and ~22 in the new; the run stops at 30 s with a queue.
# A linear clock (the gate machinery is under test, not the rig's clock):
# 15 ms a step and 0.2 ms a token.
TINY = {
    "name": "tiny-gate",
    "seed": 0,
    "model": str(DEFAULT_MODEL),
    "deployment": {"max_num_seqs": 32},
    "workload": {
        "trace": "synthetic",
        "arrival": {"process": "poisson", "rate_per_s": 10.0},
        "prompt": {"distribution": "fixed", "tokens": 6000},
        "output": {"distribution": "fixed", "tokens": 600},
        "num_requests": 30,
    },
    "step_time": {"seconds_per_token": 0.0002, "step_overhead_s": 0.015},
    "simulation": {"max_time_s": 30},
}
GATES = """\
# Tiny gates for the tests (this comment must survive --update).
gates:
  tiny:
    scenario: tiny.yaml          # next to this file
    baselines:
      num_admitted:              # recorded by --update
      peak_concurrency: {on: }
      num_preemptions: ~
    tolerance:
      num_preemptions: 1         # absolute
"""


def write_gates(directory: Path, text: str = GATES) -> Path:
    (directory / "tiny.yaml").write_text(yaml.safe_dump(pre_rig(TINY), sort_keys=False))
    path = directory / "gates.yaml"
    path.write_text(text)
    return path


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="kvsim")
    gate_command.register(parser.add_subparsers())
    args = parser.parse_args(["gate", *argv])
    return args.func(args)


@pytest.fixture(scope="module")
def baselined(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny gates with baselines recorded by --update."""
    path = write_gates(tmp_path_factory.mktemp("baselined"))
    assert cli(str(path), "--update", "--report", str(path.parent / "report")) == 0
    return path


@pytest.fixture
def gates_file(baselined: Path, tmp_path: Path) -> Path:
    """A private copy of the baselined gates, to run or break."""
    for name in ("gates.yaml", "tiny.yaml"):
        shutil.copy(baselined.parent / name, tmp_path / name)
    return tmp_path / "gates.yaml"


def report(directory: Path) -> dict:
    return json.loads((directory / "gates.json").read_text())


# --------------------------------------------------------- the lifecycle
def test_new_gates_are_recorded_by_update_then_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_gates(tmp_path)
    assert cli(str(path), "--report", str(tmp_path / "r1")) == 0
    verdicts = {(r["layout"], r["metric"]): r["verdict"] for r in report(tmp_path / "r1")["rows"]}
    assert verdicts == {
        ("off", "num_admitted"): "new",
        ("on", "num_admitted"): "new",
        ("on", "peak_concurrency"): "new",
        ("off", "num_preemptions"): "new",
        ("on", "num_preemptions"): "new",
        ("on-vs-off", "num_admitted"): "pass",
    }
    assert "no baseline yet" in capsys.readouterr().out

    assert cli(str(path), "--update", "--report", str(tmp_path / "r2")) == 0
    out = capsys.readouterr().out
    assert "5 baselines updated" in out and "tiny [on] num_admitted: baseline - -> 22" in out
    text = path.read_text()
    assert "# Tiny gates for the tests (this comment must survive --update)." in text
    assert re.search(r"\n      num_admitted: \{off: 16, on: 22\} +# recorded by --update\n", text)
    assert "num_preemptions: {off: 2, on: 0}" in text and "num_preemptions: 1         # absolute" in text
    assert load_yaml_text(text)["gates"]["tiny"]["baselines"]["peak_concurrency"] == {"on": 22}

    assert cli(str(path), "--report", str(tmp_path / "r3")) == 0
    assert {r["verdict"] for r in report(tmp_path / "r3")["rows"]} == {"pass"}


def test_baselined_gates_pass(gates_file: Path, tmp_path: Path) -> None:
    assert cli(str(gates_file), "--report", str(tmp_path / "report")) == 0
    data = report(tmp_path / "report")
    assert data["ok"] and data["num_checks"] == 6 and data["num_failed"] == 0
    assert {(s["gate"], s["layout"]) for s in data["summaries"]} == {("tiny", "off"), ("tiny", "on")}


# ------------------------------------------------------------ controls
def _off_layout_for_both(real=sim.engine_assembly.plan_kv_cache):
    """A deliberately broken allocator: the side-cache layout loses its gain."""
    return lambda model, deployment, *, side_cache_layout, **kw: real(
        model, deployment, side_cache_layout=False, **kw
    )


def test_a_worse_allocator_fails_the_gate(
    gates_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sim.engine_assembly, "plan_kv_cache", _off_layout_for_both())
    assert cli(str(gates_file), "--report", str(tmp_path)) == 1
    err = capsys.readouterr().err.splitlines()
    assert (
        "kvsim gate: FAIL tiny [on] num_admitted: baseline 22, now 16 (-6, allowed ±0): "
        "a drop is a regression" in err
    )
    assert any(
        line.startswith("kvsim gate: FAIL tiny [on] peak_concurrency: baseline 22, now 16") for line in err
    )
    assert (
        "kvsim gate: FAIL tiny [on] num_preemptions: baseline 0, now 2 (+2, allowed ±1): "
        "a rise is a regression" in err
    )
    failed = {(r["layout"], r["metric"]) for r in report(tmp_path)["rows"] if r["verdict"] == "fail"}
    # The old layout is untouched, and both now admit the same: on-vs-off passes.
    assert failed == {("on", "num_admitted"), ("on", "peak_concurrency"), ("on", "num_preemptions")}


def test_a_lowered_pool_fails_the_gate(
    gates_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scenario = gates_file.parent / "tiny.yaml"
    data = yaml.safe_load(scenario.read_text())
    data["deployment"]["kv_cache_memory_bytes"] = 2_000_000_000
    scenario.write_text(yaml.safe_dump(data))
    assert cli(str(gates_file), "--report", str(tmp_path)) == 1
    failed = {(r["layout"], r["metric"]) for r in report(tmp_path)["rows"] if r["verdict"] == "fail"}
    assert {("off", "num_admitted"), ("on", "num_admitted")} <= failed
    assert "a drop is a regression" in capsys.readouterr().err


def test_new_layout_admitting_fewer_fails_even_under_update(
    gates_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = sim.engine_assembly.plan_kv_cache

    def smaller_on_pool(model, deployment, *, side_cache_layout, **kw):
        plan = real(model, deployment, side_cache_layout=side_cache_layout, **kw)
        if not side_cache_layout:
            return plan
        return real(model, deployment, side_cache_layout=True, num_gpu_blocks_override=plan.num_blocks // 3)

    monkeypatch.setattr(sim.engine_assembly, "plan_kv_cache", smaller_on_pool)
    assert cli(str(gates_file), "--update", "--report", str(tmp_path)) == 1
    (row,) = [r for r in report(tmp_path)["rows"] if r["layout"] == "on-vs-off"]
    assert row["verdict"] == "fail" and row["now"] < row["baseline"] == 16
    assert f"the new layout admits {row['now']:g} requests, the old 16" in capsys.readouterr().err


def test_junit_xml_has_a_failure_per_failing_row(
    gates_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sim.engine_assembly, "plan_kv_cache", _off_layout_for_both())
    assert cli(str(gates_file), "--report", str(tmp_path)) == 1
    suite = ET.parse(tmp_path / "gates.junit.xml").getroot().find("testsuite")
    assert suite is not None and suite.get("tests") == "6" and suite.get("failures") == "3"
    cases = {case.get("name"): case for case in suite.iter("testcase")}
    assert set(cases) == {
        "off num_admitted",
        "on num_admitted",
        "on peak_concurrency",
        "off num_preemptions",
        "on num_preemptions",
        "on-vs-off num_admitted",
    }
    failure = cases["on num_admitted"].find("failure")
    assert failure is not None and "baseline 22, now 16" in failure.get("message", "")
    assert cases["off num_admitted"].find("failure") is None


def test_only_runs_the_named_gate(gates_file: Path, tmp_path: Path) -> None:
    text = gates_file.read_text().replace(
        "gates:\n", "gates:\n  broken:\n    scenario: missing.yaml\n    baselines: {num_admitted: }\n"
    )
    gates_file.write_text(text)
    assert run_gates(gates_file, only=["tiny"]).ok
    with pytest.raises(ConfigError, match="--only nope: no such gate .*gates: broken, tiny"):
        run_gates(gates_file, only=["nope"])


# --------------------------------------------------------- bad gate files
@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (("scenario: tiny.yaml", "scenaro: tiny.yaml"), "unknown key 'gates.tiny.scenaro'"),
        (("gates:\n", "gate:\n"), "unknown key 'gate'"),
        (("num_admitted:  ", "num_admited:  "), "unknown metric 'num_admited'"),
        (("{on: }", "{of: }"), "gates.tiny.baselines.peak_concurrency"),
        (("num_preemptions: 1 ", "num_preemptions: 5 percent"), "expected a number >= 0 or a percentage"),
        (("num_preemptions: 1 ", "num_finished: 1 "), "tolerance.num_finished: not a metric under baselines"),
        (("scenario: tiny.yaml", "scenario: nowhere.yaml"), "gate tiny: nowhere.yaml: no such scenario file"),
    ],
)
def test_bad_gates_file_is_one_line_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edit: tuple[str, str], says: str
) -> None:
    path = write_gates(tmp_path, GATES.replace(*edit))
    monkeypatch.setattr(gates, "simulate_gates", lambda *a: pytest.fail("a gate ran"))
    with pytest.raises(ConfigError, match=says) as error:
        cli(str(path), "--report", str(tmp_path / "report"))
    assert "\n" not in str(error.value) and (str(path) in str(error.value) or "gate tiny" in str(error.value))
    assert not (tmp_path / "report").exists()


def test_unknown_key_in_a_gate_scenario_names_gate_and_file(tmp_path: Path) -> None:
    path = write_gates(tmp_path)
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump({**TINY, "deploymnet": {}}))
    with pytest.raises(ConfigError, match=r"gates.yaml: gate tiny: .*tiny.yaml: unknown key 'deploymnet'"):
        run_gates(path)


# ------------------------------------------------------ pure functions
@pytest.mark.parametrize(
    ("baseline", "now", "direction", "allowed", "verdict"),
    [
        (10, 10, "higher", 0, "pass"),
        (10, 9, "higher", 0, "fail"),  # fewer admitted
        (10, 11, "higher", 0, "improved"),
        (10, 9, "higher", 1, "pass"),
        (3, 4, "lower", 0, "fail"),  # more preemptions
        (3, 2, "lower", 0, "improved"),
        (3, 4, "lower", 1, "pass"),
        (5, 6, "either", 0, "fail"),
        (5, 4, "either", 0, "fail"),
        (None, 4, "higher", 0, "new"),
        (float("nan"), float("nan"), "lower", 0, "pass"),
        (1.5, float("nan"), "lower", 0, "fail"),
    ],
)
def test_judge(baseline, now, direction, allowed, verdict) -> None:
    assert judge(baseline, now, direction, allowed) == verdict


@pytest.mark.parametrize(
    ("value", "parsed"),
    [(0, (0, 0)), (2, (2, 0)), (0.5, (0.5, 0)), ("5%", (0, 0.05)), (" 12.5% ", (0, 0.125))],
)
def test_parse_tolerance(value, parsed) -> None:
    assert parse_tolerance(value, "t") == parsed


@pytest.mark.parametrize("value", [-1, "5", "-5%", "x%", float("inf")])
def test_parse_tolerance_rejects(value) -> None:
    with pytest.raises(ValueError, match="t: expected"):
        parse_tolerance(value, "t")


def test_rewrite_changes_only_the_values() -> None:
    text = """\
# head comment
gates:
  a:   # gate a
    baselines:
      m1:
      m2: ~          # null
      m3: {}
      m4: {off: 1, on: 2}  # flow
      m5:
        off: 3       # block
        on: null
    scenario: x.yaml
"""
    values = {
        "a": {
            "m1": {"off": 10, "on": 11},
            "m2": {"off": 0.5, "on": float("nan")},
            "m3": {"on": 1e-05},
            "m4": {"on": 20},
            "m5": {"off": 30, "on": 31},
        }
    }
    new = rewrite_baselines(text, values)
    assert (
        new
        == """\
# head comment
gates:
  a:   # gate a
    baselines:
      m1: {off: 10, on: 11}
      m2: {off: 0.5, on: .nan}          # null
      m3: {on: 1.0e-05}
      m4: {off: 1, on: 20}  # flow
      m5:
        off: 30       # block
        on: 31
    scenario: x.yaml
"""
    )


# ------------------------------------------------------- shipped gates
def test_shipped_gates_baselines_are_current() -> None:
    """If this fails after an intended change: kvsim gate --update."""
    result = run_gates(DEFAULT_GATES)
    assert set(result.rows["verdict"]) == {"pass"}, result.rows[result.rows["verdict"] != "pass"].to_string()
    assert (result.rows["layout"] == "on-vs-off").sum() == len(gates.load_gates(DEFAULT_GATES).gates)
