"""The gates' file, run, report and --update paths on a gate small enough
to run in a fraction of a second (issue 10: the mutation run reaches them
without the multi-second gate scenarios of tests/test_gates.py).

The tiny gate's scenario is the engine timeline tests' hand-computable
one: Flash-Next with a step time of 0.2 s + 1 ms per scheduled token,
three 300-token prompts with one output token each, arriving 1 s apart
(constant rate 1/s). Each request is prefilled alone in one 0.5 s step and
finishes there, so in both layouts: 3 requests, 3 admitted, 3 finished,
3 steps, no preemption; the pools are the seed's 806,792 tokens (old
layout) and 853,994 (new).
"""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path

import pandas as pd
import pytest
import yaml
from helpers.scenarios import HAND_STEP_TIME, RecordingBar, pre_rig

from sim.analysis import gates
from sim.analysis.gates import GateReport, load_gates, run_gates, select, write_report
from sim.config import ConfigError
from sim.paths import DEFAULT_MODEL

TINY = {
    "name": "tiny",
    "seed": 0,
    "model": str(DEFAULT_MODEL),
    "workload": {
        "trace": "synthetic",
        "arrival": {"process": "constant", "rate_per_s": 1.0},
        "prompt": {"distribution": "fixed", "tokens": 300},
        "output": {"distribution": "fixed", "tokens": 1},
        "num_requests": 3,
    },
    "mtp": {"acceptance_rates": [0.0, 0.0, 0.0]},
    "simulation": {"sample_interval_s": None},
    "step_time": HAND_STEP_TIME,
}
# One metric per verdict: num_admitted passes; num_finished (off only)
# fails, 3 against 4; num_preemptions improves on off (0 against 1, fewer
# is better) and passes on on; num_steps (on only) is 1 off its baseline 2,
# inside 50 % of it; kv_cache_tokens has no baseline yet.
GATES = """\
# a comment --update keeps
gates:
  tiny:
    scenario: tiny.yaml   # next to this file
    baselines:
      num_admitted: {off: 3, on: 3}
      num_finished: {off: 4}
      num_preemptions: {off: 1, on: 0}
      num_steps: {on: 2}
      kv_cache_tokens:    # recorded by --update
    tolerance:
      num_steps: 50%
"""
FAIL_MESSAGE = "tiny [off] num_finished: baseline 4, now 3 (-1, allowed ±0): a drop is a regression"
NEW_MESSAGE = "no baseline yet: run kvsim gate --update to record it"
IMPROVED_MESSAGE = "better than the baseline: run kvsim gate --update to lock it in"
# (layout, metric, baseline, now, change, allowed, verdict, message)
EXPECTED_ROWS = [
    ("off", "num_admitted", 3, 3, 0, 0.0, "pass", ""),
    ("on", "num_admitted", 3, 3, 0, 0.0, "pass", ""),
    ("off", "num_finished", 4, 3, -1, 0.0, "fail", FAIL_MESSAGE),
    ("off", "num_preemptions", 1, 0, -1, 0.0, "improved", IMPROVED_MESSAGE),
    ("on", "num_preemptions", 0, 0, 0, 0.0, "pass", ""),
    ("on", "num_steps", 2, 3, 1, 1.0, "pass", ""),
    ("off", "kv_cache_tokens", None, 806_792, None, 0.0, "new", NEW_MESSAGE),
    ("on", "kv_cache_tokens", None, 853_994, None, 0.0, "new", NEW_MESSAGE),
    ("on-vs-off", "num_admitted", 3, 3, 0, 0.0, "pass", ""),
]


def write_gates(directory: Path, text: str = GATES) -> Path:
    (directory / "tiny.yaml").write_text(yaml.safe_dump(pre_rig(TINY), sort_keys=False))
    path = directory / "gates.yaml"
    path.write_text(text)
    return path


def _rows(report: GateReport) -> list[tuple]:
    def plain(value):
        return None if value is None or pd.isna(value) else value

    return [
        (r.layout, r.metric, plain(r.baseline), r.now, plain(r.change), r.allowed, r.verdict, r.message)
        for r in report.rows.itertuples(index=False)
    ]


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory: pytest.TempPathFactory) -> GateReport:
    return run_gates(write_gates(tmp_path_factory.mktemp("tiny")))


def test_a_tiny_gate_runs_both_layouts_and_judges_every_row(tiny_report: GateReport) -> None:
    assert _rows(tiny_report) == EXPECTED_ROWS
    assert set(tiny_report.rows["gate"]) == {"tiny"} and tiny_report.gates_path.name == "gates.yaml"
    assert not tiny_report.ok and not tiny_report.updated
    assert tiny_report.failures["metric"].tolist() == ["num_finished"]
    summaries = tiny_report.summaries
    assert summaries[["gate", "layout"]].values.tolist() == [["tiny", "off"], ["tiny", "on"]]
    assert summaries["num_finished"].tolist() == [3, 3] and summaries["num_steps"].tolist() == [3, 3]


def test_the_report_as_a_dict(tiny_report: GateReport) -> None:
    data = tiny_report.to_dict()
    assert data["gates_file"] == str(tiny_report.gates_path) and data["gates_file"].endswith("gates.yaml")
    assert (data["ok"], data["updated"], data["num_checks"], data["num_failed"]) == (False, False, 9, 1)
    assert [(r["layout"], r["metric"], r["verdict"]) for r in data["rows"]] == [
        (layout, metric, verdict) for layout, metric, _, _, _, _, verdict, _ in EXPECTED_ROWS
    ]
    assert data["rows"][6]["baseline"] is None and data["rows"][2]["message"] == FAIL_MESSAGE
    assert [(s["gate"], s["layout"], s["num_admitted"]) for s in data["summaries"]] == [
        ("tiny", "off", 3),
        ("tiny", "on", 3),
    ]


def test_the_junit_report_has_a_testcase_per_row(tiny_report: GateReport) -> None:
    """One testsuite: 9 cases, 1 failure (with the message and the values),
    2 skipped (no baseline), the improved row's advice as system-out, the
    passing rows bare."""
    xml = tiny_report.junit_xml()
    assert xml.startswith("<?xml version='1.0' encoding='utf-8'?>\n<testsuites name=\"kvsim gate\">\n  <")
    assert xml.endswith("</testsuites>\n")
    root = ET.fromstring(xml)
    (suite,) = list(root)
    assert suite.tag == "testsuite" and suite.attrib == {
        "name": "kvsim gate gates.yaml",
        "tests": "9",
        "failures": "1",
        "errors": "0",
        "skipped": "2",
    }
    cases = list(suite)
    assert {c.tag for c in cases} == {"testcase"}
    assert [(c.get("classname"), c.get("name")) for c in cases] == [
        ("gates.tiny", f"{layout} {metric}") for layout, metric, *_ in EXPECTED_ROWS
    ]
    children = [[(child.tag, dict(child.attrib), child.text) for child in case] for case in cases]
    assert children == [
        [],
        [],
        [("failure", {"message": FAIL_MESSAGE, "type": "regression"}, "baseline 4, now 3")],
        [("system-out", {}, IMPROVED_MESSAGE)],
        [],
        [],
        [("skipped", {"message": NEW_MESSAGE}, None)],
        [("skipped", {"message": NEW_MESSAGE}, None)],
        [],
    ]


def test_write_report_writes_both_files_whole(tiny_report: GateReport, tmp_path: Path) -> None:
    """gates.json is the report's dict, gates.junit.xml its XML; a partial
    write a kill left behind is removed first."""
    out = tmp_path / "report"
    out.mkdir()
    stale = out / ".gates.json.abc123.tmp"
    stale.write_text("half")
    write_report(tiny_report, out)
    assert json.loads((out / "gates.json").read_text()) == json.loads(json.dumps(tiny_report.to_dict()))
    assert (out / "gates.junit.xml").read_text() == tiny_report.junit_xml()
    assert sorted(p.name for p in out.iterdir()) == ["gates.json", "gates.junit.xml"]


UPDATED = """\
# a comment --update keeps
gates:
  tiny:
    scenario: tiny.yaml   # next to this file
    baselines:
      num_admitted: {off: 3, on: 3}
      num_finished: {off: 3}
      num_preemptions: {off: 0, on: 0}
      num_steps: {on: 3}
      kv_cache_tokens: {off: 806792, on: 853994}    # recorded by --update
    tolerance:
      num_steps: 50%
"""


def test_update_rewrites_the_moved_baselines_and_keeps_the_rest(tmp_path: Path) -> None:
    """Under --update every moved baseline row (failed, improved, new, and
    num_steps, inside its tolerance but not equal) is 'updated' with old ->
    new; unmoved rows pass silently; the on-vs-off row is judged as always.
    The file keeps its comments and its mode; a second run passes."""
    path = write_gates(tmp_path)
    path.chmod(0o640)
    report = run_gates(path, update=True)
    assert report.updated and report.ok
    assert [(r[0], r[1], r[6], r[7]) for r in _rows(report)] == [
        ("off", "num_admitted", "pass", ""),
        ("on", "num_admitted", "pass", ""),
        ("off", "num_finished", "updated", "baseline 4 -> 3"),
        ("off", "num_preemptions", "updated", "baseline 1 -> 0"),
        ("on", "num_preemptions", "pass", ""),
        ("on", "num_steps", "updated", "baseline 2 -> 3"),
        ("off", "kv_cache_tokens", "updated", "baseline - -> 806792"),
        ("on", "kv_cache_tokens", "updated", "baseline - -> 853994"),
        ("on-vs-off", "num_admitted", "pass", ""),
    ]
    assert path.read_text() == UPDATED
    assert os.stat(path).st_mode & 0o777 == 0o640
    again = run_gates(path, update=True)
    assert set(again.rows["verdict"]) == {"pass"} and path.read_text() == UPDATED


def test_an_update_with_nothing_moved_leaves_the_file_alone(tmp_path: Path, monkeypatch) -> None:
    path = write_gates(tmp_path, UPDATED)
    monkeypatch.setattr(gates, "atomic_write", lambda *a: pytest.fail("the file was rewritten"))
    assert run_gates(path, update=True).ok


def test_only_selects_gates_in_file_order(tmp_path: Path) -> None:
    text = GATES.replace(
        "gates:\n", "gates:\n  other:\n    scenario: x.yaml\n    baselines: {num_admitted: }\n"
    )
    path = write_gates(tmp_path, text)
    loaded = load_gates(path)
    assert select(loaded, None, path) == ["other", "tiny"] == select(loaded, [], path)
    assert select(loaded, ["tiny", "other"], path) == ["other", "tiny"]
    assert select(loaded, ["tiny"], path) == ["tiny"]
    with pytest.raises(ConfigError, match=rf"^--only nope: no such gate in {path} \(gates: other, tiny\)$"):
        select(loaded, ["tiny", "nope"], path)
    report = run_gates(path, only=["tiny"])  # the other gate's scenario is never loaded
    assert set(report.rows["gate"]) == {"tiny"}
    with pytest.raises(ConfigError, match=rf"^--only nope: no such gate in {path} "):
        run_gates(path, only=["nope"])
    with pytest.raises(ConfigError, match=rf"^{path}: gate other: x.yaml: "):
        run_gates(path)


ONE_GATE = "gates:\n  g:\n    scenario: tiny.yaml\n    baselines: "


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("- just a list\n", "expected a mapping with a 'gates' key"),
        ("gates: {}\n", "expected at least one gate"),
        ("gates:\n  g:\n    scenario: tiny.yaml\n    baselines: {}\n", "expected at least one metric"),
        (
            "gates:\n  g:\n    scenario: tiny.yaml\n    baselines: {num_admitted: {off: .nan}}\n",
            "is not a baseline",
        ),
    ],
)
def test_a_bad_gates_file_names_itself(tmp_path: Path, text: str, says: str) -> None:
    path = write_gates(tmp_path, text)
    with pytest.raises(ConfigError, match=says) as error:
        load_gates(path)
    assert str(path) in str(error.value)


def test_a_latency_baseline_may_be_nan(tmp_path: Path) -> None:
    """No request finished: a TTFT has no value, and --update records NaN."""
    path = write_gates(
        tmp_path, "gates:\n  g:\n    scenario: tiny.yaml\n    baselines: {ttft_p50_s: {off: .nan}}\n"
    )
    value = load_gates(path).gates["g"].baselines["ttft_p50_s"]["off"]
    assert value != value


def test_a_gate_names_a_shipped_scenario_or_a_file_beside_it(tmp_path: Path) -> None:
    """A scenario beside the gates file wins; otherwise a shipped name; a
    scenario that fails to load names the gates file and the gate."""
    path = write_gates(tmp_path)
    spec = load_gates(path).gates["tiny"]
    assert gates.gate_scenario(path, "tiny", spec).name == "tiny"
    shipped = spec.model_copy(update={"scenario": "chat-slice", "set": ("seed=7",)})
    assert gates.gate_scenario(path, "g", shipped).seed == 7
    broken = spec.model_copy(update={"scenario": "nowhere.yaml"})
    with pytest.raises(ConfigError, match=rf"^{path}: gate g: .*nowhere.yaml"):
        gates.gate_scenario(path, "g", broken)


@pytest.mark.parametrize(("progress", "disable"), [(None, None), (True, False), (False, True)])
def test_the_gate_runs_share_one_runner_and_count_on_one_bar(
    tmp_path: Path, monkeypatch, progress, disable
) -> None:
    """Both layouts of every gate go to one runner with at most as many
    workers as runs (2 here, even when 8 are asked), in this process for
    1; the bar counts the runs: auto (a terminal only) unless asked."""
    opened = []
    real = gates.open_runner

    def recording_runner(kind, workers):
        opened.append((kind, workers))
        return real(kind, 1)

    monkeypatch.setattr(gates, "open_runner", recording_runner)
    monkeypatch.setattr(gates, "tqdm", RecordingBar)
    RecordingBar.made = []
    path = write_gates(tmp_path)
    run_gates(path, workers=8, progress=progress)
    run_gates(path)
    assert opened == [("local", 2), ("local", 1)]
    bar = RecordingBar.made[0]
    assert bar.kwargs == {"total": 2, "unit": "run", "desc": "gates", "disable": disable} and bar.n == 2
    assert RecordingBar.made[1].kwargs["disable"] is None
