"""Sweeps: one scenario over a grid of settings, and capacity search.

A sweep runs the cartesian product of ``--grid key=v1,v2,...`` axes over one
scenario; each point is applied as ``--set`` overrides, and each point runs
once per layout (``--grid layout=off,on``; default: the scenario's layouts).
A *run* is one scenario under one layout. Its id is a hash of everything
that decides its result (the resolved scenario, the model, the layout), so
it depends neither on the grid's order nor on which runs came before, and a
run gives the same summary row on any executor.

Files under OUT, written only by the driver process, each atomically::

    OUT/sweep.json             the plan (scenario, grid, run ids); "complete" at the end
    OUT/runs/<run_id>.json     one finished run: its parameters and summary row
    OUT/sweep.parquet          every run of the plan, one row each, rebuilt at the end
    OUT/max_rate.parquet|json  the capacity search's answer (sim.analysis.capacity)

A run's file is written the moment the run finishes, so an interrupted
sweep (Ctrl-C, kill -9) keeps every finished run and ``--resume`` runs only
the missing ones. No twin in vLLM.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import yaml
from tqdm import tqdm

from sim.analysis.executors import (
    LAYOUT_KEY,
    Executor,
    Runner,
    RunSpec,
    describe,
    make_spec,
    open_runner,
    parallel_runs,
    yaml_inline,
)
from sim.config import ConfigError, load_yaml_text, read_text
from sim.results import remove_partial_writes, write_frame, write_json
from sim.scenario import Scenario, SideCacheSwitch, load_scenario

RATE_KEY = "workload.rate_scale"
_KEY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


# ------------------------------------------------------------------ the grid
@dataclass(frozen=True)
class GridAxis:
    key: str
    values: tuple[Any, ...]


def parse_grid(text: str) -> GridAxis:
    """``key=v1,v2,...`` -> an axis; values are read as YAML (``4.1e9`` too).

    >>> parse_grid("workload.rate_scale=0.5,1,2.0")
    GridAxis(key='workload.rate_scale', values=(0.5, 1, 2))
    >>> parse_grid("workload.window_s=[0,300],[300,600]").values
    ([0, 300], [300, 600])
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not _KEY.fullmatch(key):
        raise ConfigError(f"--grid {text!r}: expected key=v1,v2,... with a dotted scenario key")
    parts = _split_top_level(raw)
    if any(not part for part in parts):
        raise ConfigError(f"--grid {text!r}: empty value")
    values = tuple(parse_grid_value(part) for part in parts)
    if len({_canonical(v) for v in values}) < len(values):
        raise ConfigError(f"--grid {text!r}: a value is repeated")
    if key == LAYOUT_KEY and not set(values) <= {"off", "on"}:
        raise ConfigError(f"--grid {text!r}: layouts are off and on")
    return GridAxis(key, values)


def parse_grid_value(raw: str) -> Any:
    """A YAML value; numbers YAML 1.1 reads as strings (``4.1e9``) become
    numbers, and whole floats become ints, so ``2`` and ``2.0`` are one value."""
    try:
        value = load_yaml_text(raw)
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    return value


def _split_top_level(raw: str) -> list[str]:
    """Split on commas outside brackets, so list values keep their commas."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(raw):
        depth += (char in "[{") - (char in "]}")
        if char == "," and depth == 0:
            parts.append(raw[start:index].strip())
            start = index + 1
    parts.append(raw[start:].strip())
    return parts


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def check_axes(axes: Sequence[GridAxis]) -> None:
    seen = [axis.key for axis in axes]
    for key in seen:
        if seen.count(key) > 1:
            raise ConfigError(f"--grid {key}: given more than once")


def load_point(scenario_ref: str, overrides: Sequence[str], params: dict[str, Any]) -> Scenario:
    """The scenario at one grid point; errors name the point."""
    sets = [*overrides, *(f"{key}={yaml_inline(value)}" for key, value in params.items())]
    try:
        return load_scenario(scenario_ref, sets)
    except ConfigError as error:
        raise ConfigError(f"--grid {describe(params)}: {error}") from None


def grid_points(axes: Sequence[GridAxis]) -> list[dict[str, Any]]:
    keys = [axis.key for axis in axes]
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*(a.values for a in axes))]


def split_layouts(
    axes: Sequence[GridAxis], default: Sequence[SideCacheSwitch]
) -> tuple[tuple[SideCacheSwitch, ...], list[GridAxis]]:
    check_axes(axes)
    layouts = next((a.values for a in axes if a.key == LAYOUT_KEY), tuple(default))
    return layouts, [a for a in axes if a.key != LAYOUT_KEY]


def plan_runs(scenario_ref: str, overrides: Sequence[str], axes: Sequence[GridAxis]) -> list[RunSpec]:
    """Every run of the grid, validated before any runs: each axis value on
    its own first (so an error names the axis), then every point."""
    base = load_scenario(scenario_ref, list(overrides))
    layouts, others = split_layouts(axes, base.layouts)
    for axis in others:
        for value in axis.values:
            load_point(scenario_ref, overrides, {axis.key: value})
    specs = [
        make_spec(scenario, layout, params)
        for params in grid_points(others)
        for scenario in [load_point(scenario_ref, overrides, params)]
        for layout in layouts
    ]
    ids = [spec.run_id for spec in specs]
    if len(set(ids)) < len(ids):
        raise ConfigError("--grid: two grid points resolve to the same scenario")
    return specs


# ------------------------------------------------------- finished-run files
def load_finished(runs_dir: Path) -> dict[str, dict[str, Any]]:
    """The run files under ``runs_dir``, by run id. Writes are atomic, so a
    file is whole or absent; a file that is not a finished run (does not
    parse, or lacks its parameters or summary) counts as not run: it is run
    again and overwritten. Summaries hold null where JSON has no NaN."""
    records: dict[str, dict[str, Any]] = {}
    for path in sorted(runs_dir.glob("*.json")):
        try:
            record = json.loads(read_text(path))
        except (ConfigError, ValueError, RecursionError):
            continue
        if is_run_record(record, path.stem):
            summary = {k: math.nan if v is None else v for k, v in record["summary"].items()}
            records[path.stem] = {**record, "summary": summary}
    return records


def unfinished_run_files(runs_dir: Path) -> list[Path]:
    """Run files that ``load_finished`` does not count (they are run again)."""
    finished = load_finished(runs_dir) if runs_dir.is_dir() else {}
    return [path for path in sorted(runs_dir.glob("*.json")) if path.stem not in finished]


def is_run_record(record: Any, run_id: str) -> bool:
    return (
        isinstance(record, dict)
        and record.get("run_id") == run_id
        and isinstance(record.get("params"), dict)
        and isinstance(record.get("summary"), dict)
    )


def run_cached(
    specs: Sequence[RunSpec],
    runs_dir: Path,
    runner: Runner,
    *,
    progress: bool | None = None,
    desc: str = "runs",
) -> dict[str, dict[str, Any]]:
    """Records of ``specs``: finished ones read back, the rest run, each
    written the moment it finishes."""
    records = {k: v for k, v in load_finished(runs_dir).items() if k in {s.run_id for s in specs}}
    pending = list({s.run_id: s for s in specs if s.run_id not in records}.values())
    with tqdm(
        total=len(records) + len(pending),
        initial=len(records),
        unit="run",
        desc=desc,
        disable=None if progress is None else not progress,
    ) as bar:
        for spec, summary in runner.run(pending):
            record = {"run_id": spec.run_id, "params": spec.params, "summary": summary}
            write_json(runs_dir / f"{spec.run_id}.json", record)
            records[spec.run_id] = record
            bar.update(1)
    return records


def prepare_out(out_dir: Path, *, resume: bool) -> Path:
    runs_dir = out_dir / "runs"
    finished = len(load_finished(runs_dir)) if runs_dir.is_dir() else 0
    if finished and not resume:
        raise ConfigError(
            f"{out_dir}: already holds {finished} finished runs; "
            "pass --resume to continue that sweep, or choose another --out"
        )
    runs_dir.mkdir(parents=True, exist_ok=True)
    for directory in (out_dir, runs_dir):
        remove_partial_writes(directory)
    return runs_dir


def sweep_frame(specs: Sequence[RunSpec], runs_dir: Path) -> pd.DataFrame:
    """One row per run of the plan, in plan order, read from the run files:
    run id, the swept keys, then the summary row."""
    records = load_finished(runs_dir)
    rows = []
    for spec in specs:
        record = records[spec.run_id]
        params = {k: v for k, v in record["params"].items() if k != LAYOUT_KEY}
        rows.append({"run_id": spec.run_id, **params, **record["summary"]})
    return pd.DataFrame.from_records(rows)


def run_sweep(
    specs: Sequence[RunSpec],
    out_dir: Path,
    *,
    resume: bool = False,
    executor: Executor = "local",
    workers: int | None = None,
    address: str | None = None,
    progress: bool | None = None,
    plan: dict[str, Any] | None = None,
) -> pd.DataFrame:
    """Run the plan (skipping finished runs with ``resume``) and write
    ``sweep.parquet``; the frame does not depend on execution order."""
    runs_dir = prepare_out(out_dir, resume=resume)
    (out_dir / "sweep.parquet").unlink(missing_ok=True)  # whole again only at the end
    manifest = {**(plan or {}), "run_ids": [s.run_id for s in specs]}
    write_json(out_dir / "sweep.json", {**manifest, "complete": False})
    finished = load_finished(runs_dir)
    pending = len({s.run_id for s in specs} - set(finished))
    with open_runner(executor, parallel_runs(workers, pending), address) as runner:
        run_cached(specs, runs_dir, runner, progress=progress, desc="sweep")
    frame = sweep_frame(specs, runs_dir)
    write_frame(out_dir / "sweep.parquet", frame)
    write_json(out_dir / "sweep.json", {**manifest, "complete": True})
    return frame
