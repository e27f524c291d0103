"""Regression gates: named scenarios whose summary metrics must hold.

A gates file (``scenarios/gates.yaml``) names gates; each is a scenario
(a file, with optional ``set:`` overrides) and, per metric, the baseline
value for each layout and the change allowed::

    gates:
      bursty-azure:
        scenario: gates/bursty-azure.yaml    # relative to the gates file
        set: [simulation.max_time_s=300]     # optional --set style overrides
        baselines:                           # metric -> layout -> value
          num_admitted: {off: 334, on: 336}
          num_preemptions: {on: 0}           # only the layouts listed are checked
          peak_concurrency:                  # empty: not recorded yet ("new")
        tolerance:                           # optional; default exact
          num_preemptions: 2                 # absolute, or "5%" (relative)

Every gate runs both layouts. Each metric has a direction
(``DIRECTIONS``): fewer admitted, more preemptions, a later TTFT are
regressions; a change past the tolerance the other way is ``improved``
(passes, and asks for ``--update``). Besides its baselines each gate checks
that the new layout admits no fewer requests than the old (``on-vs-off``).

``--update`` rewrites only the baseline values in the file, character for
character everywhere else, so comments and formatting survive. No twin in vLLM.
"""

from __future__ import annotations

import json
import math
import os
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal, cast

import pandas as pd
import yaml
from pydantic import ConfigDict, field_validator, model_validator
from tqdm import tqdm

from sim.analysis.executors import make_spec, open_runner
from sim.config import ConfigError, StrictModel, YamlLoader, load_yaml_text, read_yaml, validate
from sim.metrics import DIRECTIONS, Direction
from sim.paths import DEFAULT_GATES
from sim.results import atomic_write, plain_value, remove_partial_writes, write_json
from sim.scenario import Scenario, SideCacheSwitch, load_scenario

LAYOUTS: tuple[SideCacheSwitch, ...] = ("off", "on")
ON_VS_OFF = "on-vs-off"
Verdict = Literal["pass", "fail", "new", "improved", "updated"]

# Which way is better for each summary metric: ``DIRECTIONS``, from the
# metric registry (``sim.metrics``).
Baselines = dict[str, dict[str, dict[SideCacheSwitch, Any]]]  # gate -> metric -> layout -> value
_WORSE = {"higher": "a drop", "lower": "a rise", "either": "any change"}


# ----------------------------------------------------------------- the file
class GateSpec(StrictModel):
    # A latency's baseline may be NaN (no request finished): _known_metrics
    # allows it for those metrics only.
    model_config = ConfigDict(allow_inf_nan=True)

    description: str = ""
    scenario: str
    set: tuple[str, ...] = ()
    baselines: dict[str, dict[SideCacheSwitch, float | None] | None]
    tolerance: dict[str, float | str] = {}

    @field_validator("baselines")
    @classmethod
    def _known_metrics(cls, baselines: dict[str, Any]) -> dict[str, Any]:
        if not baselines:
            raise ValueError("expected at least one metric, e.g. num_admitted:")
        for metric, by_layout in baselines.items():
            if metric not in DIRECTIONS:
                raise ValueError(f"unknown metric {metric!r} (known: {', '.join(DIRECTIONS)})")
            for layout, value in (by_layout or {}).items():
                if value is not None and not _baseline_ok(metric, value):
                    raise ValueError(f"{metric}.{layout}: {value} is not a baseline of {metric}")
        return baselines

    @field_validator("tolerance")
    @classmethod
    def _tolerances(cls, tolerance: dict[str, float | str]) -> dict[str, float | str]:
        for metric, allowed in tolerance.items():
            parse_tolerance(allowed, f"tolerance.{metric}")
        return tolerance

    @model_validator(mode="after")
    def _tolerance_of_checked_metrics(self) -> GateSpec:
        for metric in self.tolerance:
            if metric not in self.baselines:
                raise ValueError(f"tolerance.{metric}: not a metric under baselines")
        return self

    def layouts(self, metric: str) -> tuple[SideCacheSwitch, ...]:
        """The layouts a metric is checked on: those listed, else both."""
        listed = self.baselines[metric] or {}
        return tuple(layout for layout in LAYOUTS if layout in listed) or LAYOUTS

    def baseline(self, metric: str, layout: SideCacheSwitch) -> float | None:
        return (self.baselines[metric] or {}).get(layout)

    def allowed(self, metric: str, baseline: float) -> float:
        absolute, relative = parse_tolerance(self.tolerance.get(metric, 0), metric)
        return absolute + relative * abs(baseline)


# Metrics with no value (NaN) when no request finished: only these may have a
# NaN baseline (what --update records for them); every other is finite.
NAN_WHEN_NONE_FINISHED = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "e2e_mean_s")


def _baseline_ok(metric: str, value: float) -> bool:
    return math.isfinite(value) or (math.isnan(value) and metric in NAN_WHEN_NONE_FINISHED)


class GatesFile(StrictModel):
    gates: dict[str, GateSpec]

    @field_validator("gates")
    @classmethod
    def _some_gates(cls, gates: dict[str, GateSpec]) -> dict[str, GateSpec]:
        if not gates:
            raise ValueError("expected at least one gate")
        return gates


def parse_tolerance(value: float | str, where: str) -> tuple[float, float]:
    """(absolute, relative): ``2`` -> (2, 0); ``"5%"`` -> (0, 0.05).

    >>> parse_tolerance("2.5%", "x"), parse_tolerance(3, "x")
    ((0.0, 0.025), (3.0, 0.0))
    """
    try:
        if isinstance(value, str):
            relative = float(value.strip().removesuffix("%")) / 100
            if not value.strip().endswith("%") or not relative >= 0:
                raise ValueError
            return 0.0, relative
        if not value >= 0 or math.isinf(value):
            raise ValueError
        return float(value), 0.0
    except ValueError:
        raise ValueError(
            f"{where}: expected a number >= 0 or a percentage like '5%', got {value!r}"
        ) from None


def load_gates(path: Path) -> GatesFile:
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping with a 'gates' key")
    return validate(GatesFile, data, str(path))


def gate_scenario(gates_path: Path, name: str, gate: GateSpec) -> Scenario:
    """The gate's scenario: a path relative to the gates file, or a shipped name."""
    local = gates_path.parent / gate.scenario
    try:
        return load_scenario(str(local) if local.exists() else gate.scenario, list(gate.set))
    except ConfigError as error:
        raise ConfigError(f"{gates_path}: gate {name}: {error}") from None


def select(gates: GatesFile, only: Sequence[str] | None, source: Path) -> list[str]:
    for name in only or []:
        if name not in gates.gates:
            raise ConfigError(f"--only {name}: no such gate in {source} (gates: {', '.join(gates.gates)})")
    return [name for name in gates.gates if not only or name in only]


# ---------------------------------------------------------------- judging
@dataclass(frozen=True, kw_only=True)
class GateRow:
    gate: str
    layout: str
    metric: str
    baseline: float | None
    now: float
    change: float | None
    allowed: float
    verdict: Verdict
    message: str


def judge(baseline: float | None, now: float, direction: Direction, allowed: float) -> Verdict:
    """pass / fail (worse than allowed) / improved (better than allowed) / new.

    >>> judge(10, 9, "higher", 0), judge(10, 9, "lower", 0), judge(10, 9, "lower", 1)
    ('fail', 'improved', 'pass')
    """
    if baseline is None:
        return "new"
    if math.isnan(baseline) or math.isnan(now):
        return "pass" if math.isnan(baseline) and math.isnan(now) else "fail"
    change = now - baseline
    if abs(change) <= allowed:
        return "pass"
    if direction == "either":
        return "fail"
    return "fail" if (change < 0) == (direction == "higher") else "improved"


def check_row(name: str, gate: GateSpec, layout: SideCacheSwitch, metric: str, now: float) -> GateRow:
    baseline = gate.baseline(metric, layout)
    allowed = gate.allowed(metric, baseline) if baseline is not None else 0.0
    verdict = judge(baseline, now, DIRECTIONS[metric], allowed)
    change = None if baseline is None else now - baseline
    message = {
        "pass": "",
        "new": "no baseline yet: run kvsim gate --update to record it",
        "improved": "better than the baseline: run kvsim gate --update to lock it in",
        "fail": f"{name} [{layout}] {metric}: baseline {_show(baseline)}, now {_show(now)} "
        f"({_signed(change)}, allowed ±{allowed:g}): {_WORSE[DIRECTIONS[metric]]} is a regression",
    }[verdict]
    return GateRow(
        gate=name,
        layout=layout,
        metric=metric,
        baseline=baseline,
        now=now,
        change=change,
        allowed=allowed,
        verdict=verdict,
        message=message,
    )


def on_vs_off_row(name: str, summaries: dict[SideCacheSwitch, dict[str, Any]]) -> GateRow:
    """The new layout must admit no fewer requests than the old one."""
    off, on = summaries["off"]["num_admitted"], summaries["on"]["num_admitted"]
    message = (
        ""
        if on >= off
        else f"{name} [{ON_VS_OFF}] num_admitted: the new layout admits {on} requests, "
        f"the old {off}: the new layout must admit no fewer"
    )
    return GateRow(
        gate=name,
        layout=ON_VS_OFF,
        metric="num_admitted",
        baseline=off,
        now=on,
        change=on - off,
        allowed=0.0,
        verdict="pass" if on >= off else "fail",
        message=message,
    )


def _show(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+g}"


def gate_rows(name: str, gate: GateSpec, summaries: dict[SideCacheSwitch, dict[str, Any]]) -> list[GateRow]:
    rows = [
        check_row(name, gate, layout, metric, summaries[layout][metric])
        for metric in gate.baselines
        for layout in gate.layouts(metric)
    ]
    return [*rows, on_vs_off_row(name, summaries)]


# ------------------------------------------------------------------ report
@dataclass(frozen=True)
class GateReport:
    """One row per (gate, layout, metric) plus each gate's on-vs-off row;
    ``summaries``: the summary row of every run."""

    gates_path: Path
    rows: pd.DataFrame
    summaries: pd.DataFrame
    updated: bool = False

    @property
    def failures(self) -> pd.DataFrame:
        return self.rows[self.rows["verdict"] == "fail"]

    @property
    def ok(self) -> bool:
        return self.failures.empty

    def to_dict(self) -> dict[str, Any]:
        return {
            "gates_file": str(self.gates_path),
            "ok": self.ok,
            "updated": self.updated,
            "num_checks": len(self.rows),
            "num_failed": len(self.failures),
            "rows": _records(self.rows),
            "summaries": _records(self.summaries),
        }

    def junit_xml(self) -> str:
        """JUnit XML: a testcase per row; a failing row has a <failure>, a
        row without a baseline is <skipped>."""
        suite = ET.Element(
            "testsuite",
            name=f"kvsim gate {self.gates_path.name}",
            tests=str(len(self.rows)),
            failures=str(len(self.failures)),
            errors="0",
            skipped=str(int((self.rows["verdict"] == "new").sum())),
        )
        for row in self.rows.itertuples(index=False):
            case = ET.SubElement(
                suite, "testcase", classname=f"gates.{row.gate}", name=f"{row.layout} {row.metric}"
            )
            if row.verdict == "fail":
                failure = ET.SubElement(case, "failure", message=row.message, type="regression")
                failure.text = f"baseline {_show(row.baseline)}, now {_show(row.now)}"
            elif row.verdict == "new":
                ET.SubElement(case, "skipped", message=row.message)
            elif row.message:
                ET.SubElement(case, "system-out").text = row.message
        root = ET.Element("testsuites", name="kvsim gate")
        root.append(suite)
        ET.indent(root)
        return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    return json.loads(frame.to_json(orient="records"))


def write_report(report: GateReport, out_dir: Path) -> None:
    xml = report.junit_xml()
    remove_partial_writes(out_dir)

    def write_xml(tmp: Path) -> None:
        tmp.write_text(xml)

    write_json(out_dir / "gates.json", report.to_dict())
    atomic_write(out_dir / "gates.junit.xml", write_xml)


# ----------------------------------------------------------------- running
def run_gates(
    gates_path: Path | str = DEFAULT_GATES,
    *,
    update: bool = False,
    only: Sequence[str] | None = None,
    workers: int = 1,
    progress: bool | None = None,
) -> GateReport:
    """Run the gates (every scenario validated before any run); with
    ``update``, write the values that moved as the new baselines."""
    path = Path(gates_path)
    gates = load_gates(path)
    names = select(gates, only, path)
    scenarios = {name: gate_scenario(path, name, gates.gates[name]) for name in names}
    summaries = simulate_gates(scenarios, workers, progress)
    rows = [row for name in names for row in gate_rows(name, gates.gates[name], summaries[name])]
    if update:
        rows = [_as_update(row) for row in rows]
        write_baselines(path, moved_baselines(rows))
    frame = pd.DataFrame([asdict(row) for row in rows])
    runs = pd.DataFrame([{"gate": n, **summaries[n][layout]} for n in names for layout in LAYOUTS])
    return GateReport(path, frame, runs, updated=update)


def simulate_gates(
    scenarios: dict[str, Scenario], workers: int, progress: bool | None = None
) -> dict[str, dict[SideCacheSwitch, dict[str, Any]]]:
    """Both layouts of every gate; in this process for ``workers`` 1."""
    specs = [
        make_spec(scenario, layout, {"gate": name})
        for name, scenario in scenarios.items()
        for layout in LAYOUTS
    ]
    results: dict[str, dict[SideCacheSwitch, dict[str, Any]]] = {name: {} for name in scenarios}
    with (
        open_runner("local", min(workers, len(specs))) as runner,
        tqdm(
            total=len(specs), unit="run", desc="gates", disable=None if progress is None else not progress
        ) as bar,
    ):
        for spec, summary in runner.run(specs):
            results[spec.params["gate"]][spec.layout] = summary
            bar.update(1)
    return results


def moved_baselines(rows: Sequence[GateRow]) -> Baselines:
    values: Baselines = {}
    for row in rows:
        if row.verdict == "updated":
            layout = cast(SideCacheSwitch, row.layout)
            values.setdefault(row.gate, {}).setdefault(row.metric, {})[layout] = row.now
    return values


def _as_update(row: GateRow) -> GateRow:
    """Under --update a baseline row passes; it is 'updated' if it moved."""
    if row.layout == ON_VS_OFF:
        return row
    moved = row.baseline is None or judge(row.baseline, row.now, "either", 0) != "pass"
    if not moved:
        return replace(row, verdict="pass", message="")
    return replace(row, verdict="updated", message=f"baseline {_show(row.baseline)} -> {_show(row.now)}")


# ------------------------------------------------------- baseline rewrite
def write_baselines(path: Path, values: Baselines) -> None:
    """Rewrite the baselines in ``path`` atomically, keeping its mode."""
    if not values:
        return
    text = rewrite_baselines(path.read_text(), values)
    mode = path.stat().st_mode & 0o7777

    def write(tmp: Path) -> None:
        tmp.write_text(text)

    atomic_write(path, write)
    # After the rename: atomic_write gives the new file the umask's mode
    # once ``write`` returns, so a mode set inside ``write`` would be lost.
    os.chmod(path, mode)


def rewrite_baselines(text: str, values: Baselines) -> str:
    """``text`` with the given baseline values put in place; every other
    character (comments, order, spacing) stays. A metric's empty or null
    baseline becomes a flow mapping ``{off: .., on: ..}``."""
    gates = _child(yaml.compose(text, Loader=YamlLoader), "gates")
    edits = []
    for gate, metrics in values.items():
        baselines = _child(_child(gates, gate), "baselines")
        for metric, by_layout in metrics.items():
            edits.extend(_edits(_child(baselines, metric), by_layout))
    for start, end, new in sorted(edits, reverse=True):
        text = text[:start] + new + text[end:]
    check = load_yaml_text(text)["gates"]
    assert all(
        _same(check[gate]["baselines"][metric][layout], value)
        for gate, metrics in values.items()
        for metric, by_layout in metrics.items()
        for layout, value in by_layout.items()
    ), "the rewrite must read back as written"
    return text


def _child(node: Any, key: str) -> Any:
    assert isinstance(node, yaml.MappingNode), f"expected a mapping above {key!r}"
    return next(value for name, value in node.value if name.value == key)


def _edits(node: Any, by_layout: dict[SideCacheSwitch, Any]) -> list[tuple[int, int, str]]:
    """Edits (start, end, text): each listed layout's value in place, or the
    whole empty / null baseline as a flow mapping."""
    if isinstance(node, yaml.MappingNode) and node.value:
        return [
            _replace(value, _scalar(by_layout[key.value]))
            for key, value in node.value
            if key.value in by_layout
        ]
    items = ", ".join(f"{layout}: {_scalar(value)}" for layout, value in by_layout.items())
    return [_replace(node, "{" + items + "}")]


def _replace(node: Any, text: str) -> tuple[int, int, str]:
    """An empty value (``key:``) sits right after the colon: keep a space."""
    start, end = node.start_mark.index, node.end_mark.index
    return start, end, text if end > start else f" {text}"


def _scalar(value: Any) -> str:
    """A YAML scalar that reads back as ``value`` (``1.0e-05``, ``.nan``)."""
    return yaml.safe_dump(plain_value(value), default_flow_style=True).removesuffix("\n...\n").strip()


def _same(read: Any, written: Any) -> bool:
    return bool(read == written or (read != read and written != written))  # NaN reads back as NaN
