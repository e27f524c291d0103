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
    OUT/max_rate.parquet|json  the capacity search's answer (--find-max-rate)

A run's file is written the moment the run finishes, so an interrupted
sweep (Ctrl-C, kill -9) keeps every finished run and ``--resume`` runs only
the missing ones. No twin in vLLM.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import re
import signal
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import pandas as pd
import yaml
from tqdm import tqdm

from sim.config import ConfigError
from sim.paths import PROJECT_ROOT
from sim.results import write_frame, write_json
from sim.scenario import Layout, Scenario, load_scenario, scenario_to_dict

Executor = Literal["local", "ray"]
LAYOUT_KEY = "layout"
RATE_KEY = "workload.rate_scale"
_KEY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
RAY_MISSING = (
    "--executor ray needs Ray, an optional extra: "
    "pip install 'kvsim[ray]' (or pip install 'ray[default]>=2.9')"
)


# ------------------------------------------------------------------ the grid
@dataclass(frozen=True)
class GridAxis:
    key: str
    values: tuple[Any, ...]

    def describe(self) -> str:
        return f"{self.key}={','.join(_yaml_inline(v) for v in self.values)}"


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
    # layout values stay strings (YAML 1.1 reads off/on as booleans)
    values = tuple(part if key == LAYOUT_KEY else parse_grid_value(part) for part in parts)
    if len({_canonical(v) for v in values}) < len(values):
        raise ConfigError(f"--grid {text!r}: a value is repeated")
    if key == LAYOUT_KEY and not set(values) <= {"off", "on"}:
        raise ConfigError(f"--grid {text!r}: layouts are off and on")
    return GridAxis(key, values)


def parse_grid_value(raw: str) -> Any:
    """A YAML value; numbers YAML 1.1 reads as strings (``4.1e9``) become
    numbers, and whole floats become ints, so ``2`` and ``2.0`` are one value."""
    try:
        value = yaml.safe_load(raw)
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


def _yaml_inline(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=float("inf"))
    return text.removesuffix("\n...\n").strip()


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def check_axes(axes: Sequence[GridAxis]) -> None:
    seen = [axis.key for axis in axes]
    for key in seen:
        if seen.count(key) > 1:
            raise ConfigError(f"--grid {key}: given more than once")


# ------------------------------------------------------------------ the runs
@dataclass(frozen=True)
class RunSpec:
    """One scenario under one layout; ``params`` are the swept values."""

    run_id: str
    params: dict[str, Any]
    scenario: Scenario
    layout: Layout


def run_id_for(scenario: Scenario, layout: Layout) -> str:
    """A hash of what decides the run's result: the resolved scenario (less
    where its file lies), the model's content and the layout."""
    identity = scenario_to_dict(scenario)
    del identity["base_dir"]
    identity["model"] = scenario.load_model().model_dump(mode="json")
    identity["run_layout"] = layout
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def make_spec(scenario: Scenario, layout: Layout, params: dict[str, Any]) -> RunSpec:
    return RunSpec(run_id_for(scenario, layout), {**params, LAYOUT_KEY: layout}, scenario, layout)


def load_point(scenario_ref: str, overrides: Sequence[str], params: dict[str, Any]) -> Scenario:
    """The scenario at one grid point; errors name the point."""
    sets = [*overrides, *(f"{key}={_yaml_inline(value)}" for key, value in params.items())]
    try:
        return load_scenario(scenario_ref, sets)
    except ConfigError as error:
        point = " ".join(f"{k}={_yaml_inline(v)}" for k, v in params.items())
        raise ConfigError(f"--grid {point}: {error}") from None


def grid_points(axes: Sequence[GridAxis]) -> list[dict[str, Any]]:
    keys = [axis.key for axis in axes]
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*(a.values for a in axes))]


def split_layouts(axes: Sequence[GridAxis], default: Sequence[Layout]) -> tuple[tuple[Layout, ...], list[GridAxis]]:
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


def run_one(spec: RunSpec) -> dict[str, Any]:
    """Simulate one run; the summary row as plain Python values."""
    from sim.analysis.runs import run_scenario  # imports vLLM: only where runs run

    row = run_scenario(spec.scenario, [spec.layout]).summary.iloc[0]
    return {str(key): _plain(value) for key, value in row.items()}


def _run_pair(spec: RunSpec) -> tuple[str, dict[str, Any]]:
    return spec.run_id, run_one(spec)


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


# --------------------------------------------------------------- executors
class Runner(Protocol):
    def run(self, specs: Sequence[RunSpec]) -> Iterator[tuple[RunSpec, dict[str, Any]]]: ...

    def close(self, *, abort: bool) -> None: ...


class InProcessRunner:
    """Runs in this process, one after another (``--workers 1``)."""

    def run(self, specs: Sequence[RunSpec]) -> Iterator[tuple[RunSpec, dict[str, Any]]]:
        for spec in specs:
            yield spec, run_one(spec)

    def close(self, *, abort: bool) -> None:
        pass


def _init_worker() -> None:
    """Ctrl-C is the driver's to handle; pay the vLLM import up front."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import sim.analysis.runs  # noqa: F401


class PoolRunner:
    """Local worker processes, kept for the whole sweep so each pays the
    vLLM import once. ``multiprocessing.Pool`` rather than
    ``ProcessPoolExecutor`` because it can ``terminate()`` its workers, so
    Ctrl-C stops a sweep at once instead of after the runs in flight. The
    forkserver imports vLLM once and forks the workers from it."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._pool: Any = None

    def _start(self) -> Any:
        if self._pool is None:
            methods = multiprocessing.get_all_start_methods()
            context = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
            if context.get_start_method() == "forkserver":
                context.set_forkserver_preload(["sim.analysis.runs"])
            self._pool = context.Pool(self.workers, initializer=_init_worker)
        return self._pool

    def run(self, specs: Sequence[RunSpec]) -> Iterator[tuple[RunSpec, dict[str, Any]]]:
        by_id = {spec.run_id: spec for spec in specs}
        for run_id, summary in self._start().imap_unordered(_run_pair, specs):
            yield by_id[run_id], summary

    def close(self, *, abort: bool) -> None:
        if self._pool is not None:
            self._pool.terminate() if abort else self._pool.close()
            self._pool.join()


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError(RAY_MISSING) from None
    return ray


class RayRunner:
    """Ray tasks, on the cluster at ``address`` or on a local instance this
    runner starts (and stops) with ``workers`` CPUs. Ray keeps its worker
    processes, so each pays the vLLM import once."""

    def __init__(self, workers: int, address: str | None) -> None:
        self.ray = import_ray()
        self.owns = not self.ray.is_initialized()
        if self.owns:
            where: dict[str, Any] = {"address": address} if address else {
                "num_cpus": workers, "runtime_env": {"env_vars": {"PYTHONPATH": _python_path()}}}
            self.ray.init(**where, include_dashboard=False, logging_level="WARNING")
        self.task = self.ray.remote(num_cpus=1)(_run_pair)
        self.pending: list[Any] = []

    def run(self, specs: Sequence[RunSpec]) -> Iterator[tuple[RunSpec, dict[str, Any]]]:
        by_ref = {self.task.remote(spec): spec for spec in specs}
        self.pending = list(by_ref)
        while self.pending:
            done, self.pending = self.ray.wait(self.pending, num_returns=1)
            _, summary = self.ray.get(done[0])
            yield by_ref[done[0]], summary

    def close(self, *, abort: bool) -> None:
        for ref in self.pending if abort else []:
            self.ray.cancel(ref, force=True)
        if self.owns:
            self.ray.shutdown()


def _python_path() -> str:
    """A local Ray worker must import ``sim`` even from an uninstalled checkout."""
    return os.pathsep.join(p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH")) if p)


@contextmanager
def open_runner(executor: Executor = "local", workers: int | None = None,
                address: str | None = None) -> Iterator[Runner]:
    """A runner that lives for the whole sweep; on any exception (Ctrl-C
    included) runs in flight are abandoned and workers stopped."""
    count = workers or os.cpu_count() or 1
    runner: Runner
    if executor == "ray":
        runner = RayRunner(count, address)
    else:
        runner = InProcessRunner() if count == 1 else PoolRunner(count)
    try:
        yield runner
    except BaseException:
        runner.close(abort=True)
        raise
    runner.close(abort=False)


# ------------------------------------------------------- finished-run files
def load_finished(runs_dir: Path) -> dict[str, dict[str, Any]]:
    """The run files under ``runs_dir``, by run id. Writes are atomic, so a
    file is whole or absent; a file that does not parse is left to rerun."""
    records: dict[str, dict[str, Any]] = {}
    for path in sorted(runs_dir.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get("run_id") == path.stem:
            records[path.stem] = record
    return records


def remove_partial_writes(runs_dir: Path) -> None:
    """Temporary files of writes that a kill -9 cut short."""
    for tmp in runs_dir.glob(".*.json.*.tmp"):
        tmp.unlink(missing_ok=True)


def run_cached(specs: Sequence[RunSpec], runs_dir: Path, runner: Runner, *,
               progress: bool | None = None, desc: str = "runs") -> dict[str, dict[str, Any]]:
    """Records of ``specs``: finished ones read back, the rest run, each
    written the moment it finishes."""
    records = {k: v for k, v in load_finished(runs_dir).items() if k in {s.run_id for s in specs}}
    pending = list({s.run_id: s for s in specs if s.run_id not in records}.values())
    with tqdm(total=len(records) + len(pending), initial=len(records), unit="run", desc=desc,
              disable=None if progress is None else not progress) as bar:
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
        raise ConfigError(f"{out_dir}: already holds {finished} finished runs; "
                          "pass --resume to continue that sweep, or choose another --out")
    runs_dir.mkdir(parents=True, exist_ok=True)
    remove_partial_writes(runs_dir)
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


def run_sweep(specs: Sequence[RunSpec], out_dir: Path, *, resume: bool = False,
              executor: Executor = "local", workers: int | None = None, address: str | None = None,
              progress: bool | None = None, plan: dict[str, Any] | None = None) -> pd.DataFrame:
    """Run the plan (skipping finished runs with ``resume``) and write
    ``sweep.parquet``; the frame does not depend on execution order."""
    runs_dir = prepare_out(out_dir, resume=resume)
    (out_dir / "sweep.parquet").unlink(missing_ok=True)  # whole again only at the end
    manifest = {**(plan or {}), "run_ids": [s.run_id for s in specs]}
    write_json(out_dir / "sweep.json", {**manifest, "complete": False})
    with open_runner(executor, min(workers or os.cpu_count() or 1, max(len(specs), 1)), address) as runner:
        run_cached(specs, runs_dir, runner, progress=progress, desc="sweep")
    frame = sweep_frame(specs, runs_dir)
    write_frame(out_dir / "sweep.parquet", frame)
    write_json(out_dir / "sweep.json", {**manifest, "complete": True})
    return frame


# -------------------------------------------------------- capacity search
@dataclass(frozen=True)
class MaxRate:
    """``max_rate``: the highest rate seen to sustain (None: not even
    ``lo``); the true maximum lies in [lo, hi), or is >= hi when ``capped``."""

    max_rate: float | None
    lo: float
    hi: float
    capped: bool
    num_evaluations: int


@dataclass
class MaxRateSearch:
    """Bisection, in log space, for the highest rate that sustains: checks
    ``lo``, then ``hi``, then geometric midpoints until hi/lo <= 1 + precision.
    Assumes sustaining is monotone (true below a threshold, false above)."""

    lo: float
    hi: float
    rel_precision: float
    lo_ok: bool | None = None
    hi_ok: bool | None = None
    evaluations: list[tuple[float, bool]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 0 < self.lo < self.hi:
            raise ValueError(f"find-max-rate: expected 0 < lo < hi, got {self.lo}, {self.hi}")
        if not self.rel_precision > 0:
            raise ValueError(f"rel_precision: expected > 0, got {self.rel_precision}")

    def next_rate(self) -> float | None:
        """The rate to evaluate next; None when the search is done."""
        if self.lo_ok is None:
            return self.lo
        if not self.lo_ok:
            return None
        if self.hi_ok is None:
            return self.hi
        if self.hi_ok or self.hi <= self.lo * (1 + self.rel_precision):
            return None
        return math.sqrt(self.lo * self.hi)

    def record(self, rate: float, sustained: bool) -> None:
        self.evaluations.append((rate, sustained))
        if self.lo_ok is None:
            self.lo_ok = sustained
        elif self.hi_ok is None:
            self.hi_ok = sustained
        elif sustained:
            self.lo = rate
        else:
            self.hi = rate

    def result(self) -> MaxRate:
        assert self.next_rate() is None, "the search is not finished"
        best = (self.hi if self.hi_ok else self.lo) if self.lo_ok else None
        return MaxRate(best, self.lo, self.hi, bool(self.hi_ok), len(self.evaluations))


def find_max_rate(sustains: Callable[[float], bool], lo: float, hi: float,
                  rel_precision: float = 0.05) -> MaxRate:
    """The search driven by a plain function of the rate (one at a time)."""
    search = MaxRateSearch(lo, hi, rel_precision)
    while (rate := search.next_rate()) is not None:
        search.record(rate, sustains(rate))
    return search.result()


def sustains(summary: dict[str, Any], ttft_p99_max_s: float | None = None) -> bool:
    """No preemption; or, given a bound, a TTFT p99 under it (instead)."""
    if ttft_p99_max_s is None:
        return summary["num_preemptions"] == 0
    ttft = summary["ttft_p99_s"]
    return ttft is not None and not math.isnan(ttft) and ttft <= ttft_p99_max_s


@dataclass(frozen=True)
class CapacitySearch:
    """What ``--find-max-rate`` searches: per grid point and layout, the
    highest ``workload.rate_scale`` in [lo, hi] that sustains."""

    scenario_ref: str
    overrides: tuple[str, ...]
    axes: tuple[GridAxis, ...]
    lo: float
    hi: float
    rel_precision: float = 0.05
    ttft_p99_max_s: float | None = None

    def check(self) -> None:
        """Every bad input, before any run."""
        if any(axis.key == RATE_KEY for axis in self.axes):
            raise ConfigError(f"--grid {RATE_KEY}: --find-max-rate sets the rate itself")
        try:
            MaxRateSearch(self.lo, self.hi, self.rel_precision)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        plan_runs(self.scenario_ref, [*self.overrides, f"{RATE_KEY}={self.lo}"], self.axes)

    def spec(self, point: dict[str, Any], layout: Layout, rate: float) -> RunSpec:
        params = {**point, RATE_KEY: rate}
        return make_spec(load_point(self.scenario_ref, self.overrides, params), layout, params)


def run_capacity_search(search: CapacitySearch, out_dir: Path, *, resume: bool = False,
                        executor: Executor = "local", workers: int | None = None,
                        address: str | None = None, progress: bool | None = None) -> pd.DataFrame:
    """The searches of every grid point and layout advance together, one
    evaluation each per round; every evaluation is a cached run, so
    ``resume`` replays a cut-short search from its run files."""
    search.check()
    runs_dir = prepare_out(out_dir, resume=resume)
    base = load_scenario(search.scenario_ref, list(search.overrides))
    layouts, others = split_layouts(search.axes, base.layouts)
    points = grid_points(others)
    searches = {(i, layout): MaxRateSearch(search.lo, search.hi, search.rel_precision)
                for i in range(len(points)) for layout in layouts}
    with open_runner(executor, min(workers or os.cpu_count() or 1, len(searches)), address) as runner:
        while rates := _next_rates(searches):
            specs = {key: search.spec(points[key[0]], key[1], rate) for key, rate in rates.items()}
            records = run_cached(list(specs.values()), runs_dir, runner, progress=progress, desc="find-max-rate")
            for key, spec in specs.items():
                searches[key].record(rates[key], sustains(records[spec.run_id]["summary"], search.ttft_p99_max_s))
    frame = capacity_frame(points, searches)
    write_frame(out_dir / "max_rate.parquet", frame)
    write_json(out_dir / "max_rate.json", frame.to_dict(orient="records"))
    return frame


def _next_rates(searches: dict[tuple[int, Layout], MaxRateSearch]) -> dict[tuple[int, Layout], float]:
    rates = {key: search.next_rate() for key, search in searches.items()}
    return {key: rate for key, rate in rates.items() if rate is not None}


def capacity_frame(points: list[dict[str, Any]], searches: dict[tuple[int, Layout], MaxRateSearch]) -> pd.DataFrame:
    """One row per grid point and layout; ``gain`` is the point's on / off
    max rate (NaN unless both layouts found one)."""
    best = {key: s.result() for key, s in searches.items()}
    rows = [
        {"point": index, **points[index], "layout": layout, "max_rate_scale": result.max_rate,
         "bracket_lo": result.lo, "bracket_hi": result.hi, "capped": result.capped,
         "num_evaluations": result.num_evaluations,
         "gain": _gain(best.get((index, "on")), best.get((index, "off")))}
        for (index, layout), result in best.items()
    ]
    return pd.DataFrame.from_records(rows)


def _gain(on: MaxRate | None, off: MaxRate | None) -> float:
    if on is None or off is None or on.max_rate is None or not off.max_rate:
        return math.nan
    return on.max_rate / off.max_rate


# -------------------------------------------------------------------- CLI
def register_cli(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "sweep", help="run a scenario over a grid of settings, or search its capacity",
        description="Run the cartesian product of --grid axes, one run per point and layout; "
                    "results go to OUT/runs/ as each run finishes and to OUT/sweep.parquet at the end.")
    parser.add_argument("scenario", help="a scenario file, or the name of one in scenarios/")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a scenario key for every run; repeatable")
    parser.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,...",
                        help="sweep a dotted scenario key (or layout) over values; repeatable")
    parser.add_argument("--out", metavar="DIR", help="output directory (default results/sweep-SCENARIO)")
    parser.add_argument("--executor", choices=["local", "ray"], default="local",
                        help="local processes (default) or Ray tasks")
    parser.add_argument("--address", help="Ray cluster address (default: start a local Ray)")
    parser.add_argument("--workers", type=int, metavar="N", help="parallel runs (default: all cores)")
    parser.add_argument("--resume", action="store_true", help="keep OUT's finished runs, run the rest")
    parser.add_argument("--progress", action="store_true", help="a progress bar even off a terminal")
    parser.add_argument("--find-max-rate", metavar="LO,HI",
                        help="bisect workload.rate_scale in [LO, HI] for the highest rate without preemption")
    parser.add_argument("--rate-precision", type=float, metavar="REL",
                        help="relative precision of --find-max-rate (default 0.05)")
    parser.add_argument("--ttft-p99-max", type=float, metavar="SECONDS",
                        help="with --find-max-rate: sustain means TTFT p99 <= SECONDS instead")
    parser.set_defaults(func=cmd_sweep)


def _check_flags(args: argparse.Namespace) -> None:
    if args.workers is not None and args.workers < 1:
        raise ConfigError(f"--workers {args.workers}: expected at least 1")
    if args.address and args.executor != "ray":
        raise ConfigError("--address: only with --executor ray")
    if args.find_max_rate is None and (args.rate_precision is not None or args.ttft_p99_max is not None):
        raise ConfigError("--rate-precision and --ttft-p99-max: only with --find-max-rate")
    if args.executor == "ray":
        import_ray()


def _bounds(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"--find-max-rate {text!r}: expected LO,HI (two rates)") from None
    if not 0 < lo < hi:
        raise ConfigError(f"--find-max-rate {text!r}: expected 0 < LO < HI")
    return lo, hi


def cmd_sweep(args: argparse.Namespace) -> int:
    _check_flags(args)
    axes = tuple(parse_grid(text) for text in args.grid)
    base = load_scenario(args.scenario, args.set)
    out_dir = Path(args.out) if args.out else Path("results") / f"sweep-{base.name}"
    how = {"resume": args.resume, "executor": args.executor, "workers": args.workers,
           "address": args.address, "progress": True if args.progress else None}
    if args.find_max_rate is not None:
        lo, hi = _bounds(args.find_max_rate)
        search = CapacitySearch(args.scenario, tuple(args.set), axes, lo, hi,
                                args.rate_precision or 0.05, args.ttft_p99_max)
        search.check()
        print_capacity(run_capacity_search(search, out_dir, **how), args.ttft_p99_max)
        print(f"kvsim sweep: capacity written to {out_dir}/max_rate.parquet")
        return 0
    specs = plan_runs(args.scenario, args.set, axes)
    plan = {"scenario": base.name, "scenario_file": args.scenario, "set": args.set,
            "grid": {axis.key: list(axis.values) for axis in axes}}
    frame = run_sweep(specs, out_dir, plan=plan, **how)
    print_sweep(frame, [a.key for a in axes if a.key != LAYOUT_KEY])
    print(f"kvsim sweep: {len(frame)} runs written to {out_dir}/sweep.parquet")
    return 0


def print_sweep(frame: pd.DataFrame, keys: list[str]) -> None:
    metrics = ["num_admitted", "peak_concurrency", "num_preemptions", "ttft_p99_s",
               "output_throughput_tokens_per_s"]
    with pd.option_context("display.width", 160, "display.max_columns", 20):
        print(frame[["run_id", *keys, "layout", *metrics]].to_string(index=False, float_format=lambda v: f"{v:,.3f}"))


def print_capacity(frame: pd.DataFrame, ttft_p99_max_s: float | None) -> None:
    what = "without preemption" if ttft_p99_max_s is None else f"with TTFT p99 <= {ttft_p99_max_s:g} s"
    print(f"highest {RATE_KEY} {what}:")
    with pd.option_context("display.width", 160, "display.max_columns", 20):
        print(frame.to_string(index=False))
    for point, rows in frame.groupby("point"):
        capped = " (a lower bound: on reached the upper bound)" if rows["capped"].any() else ""
        print(f"gain (on / off max rate), point {point}: {rows['gain'].iloc[0]:.3f}{capped}")
