"""Where runs run: in this process, in local worker processes, or on Ray.

A run (``RunSpec``) is one scenario under one layout, named by a hash of
everything that decides its result, so it gives the same summary row on any
executor. Sweeps, capacity searches and gates hand runs to a ``Runner`` from
``open_runner`` and read back ``(spec, summary)`` pairs as runs finish; none
of them needs another's module for that. No twin in vLLM.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import signal
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import resource_tracker
from typing import Any, Literal, Protocol

import yaml

from sim.config import ConfigError
from sim.paths import PROJECT_ROOT
from sim.results import plain_value
from sim.scenario import Scenario, SideCacheSwitch, scenario_to_dict

Executor = Literal["local", "ray"]
LAYOUT_KEY = "layout"
RAY_MISSING = (
    "--executor ray needs Ray, an optional extra: "
    "pip install 'kvsim[ray]' (or pip install 'ray[default]>=2.9')"
)


def yaml_inline(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=float("inf"))
    return text.removesuffix("\n...\n").strip()


@dataclass(frozen=True)
class RunSpec:
    """One scenario under one layout; ``params`` are the swept values."""

    run_id: str
    params: dict[str, Any]
    scenario: Scenario
    layout: SideCacheSwitch


def run_id_for(scenario: Scenario, layout: SideCacheSwitch) -> str:
    """A hash of what decides the run's result: the resolved scenario (less
    where its file lies, its description and its layout list), the model's
    content and the layout."""
    identity = scenario_to_dict(scenario)
    for key in ("base_dir", "description", "layouts"):
        del identity[key]
    identity["model"] = scenario.load_model().model_dump(mode="json")
    identity["run_layout"] = layout
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def make_spec(scenario: Scenario, layout: SideCacheSwitch, params: dict[str, Any]) -> RunSpec:
    return RunSpec(run_id_for(scenario, layout), {**params, LAYOUT_KEY: layout}, scenario, layout)


def run_one(spec: RunSpec) -> dict[str, Any]:
    """Simulate one run; the summary row as plain Python values."""
    from sim.analysis.runs import run_scenario  # imports vLLM: only where runs run

    try:
        row = run_scenario(spec.scenario, [spec.layout]).summary.iloc[0]
    except ConfigError as error:  # e.g. a pool too small for max_model_len
        raise ConfigError(f"run {describe(spec.params)}: {error}") from None
    return {str(key): plain_value(value) for key, value in row.items()}


def describe(params: dict[str, Any]) -> str:
    return " ".join(f"{key}={yaml_inline(value)}" for key, value in params.items())


def _run_pair(spec: RunSpec) -> tuple[str, dict[str, Any]]:
    return spec.run_id, run_one(spec)


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


@contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Start processes with Ctrl-C blocked, so they inherit the block: the
    forkserver (importing vLLM) and each worker before its initializer runs
    would otherwise print a KeyboardInterrupt traceback. A Ctrl-C pressed
    meanwhile (another thread of this process may take it) is only noted,
    and raised on leaving, once the pool is assigned and can be terminated:
    a pool interrupted half-built would leave workers unpickling its
    removed semaphores."""
    if threading.current_thread() is not threading.main_thread():  # signals are the main thread's
        yield
        return
    # The resource tracker unblocks SIGINT after starting itself: start it first.
    resource_tracker.ensure_running()
    pressed: list[int] = []
    handler = signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)  # a pending Ctrl-C lands in pressed
        signal.signal(signal.SIGINT, handler)
    if pressed:
        raise KeyboardInterrupt


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
            with _sigint_deferred():
                self._pool = context.Pool(self.workers, initializer=_init_worker)
        return self._pool

    def run(self, specs: Sequence[RunSpec]) -> Iterator[tuple[RunSpec, dict[str, Any]]]:
        if not specs:
            return
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
    runner starts (and stops) with ``workers`` CPUs, at its first run. Ray
    keeps its worker processes, so each pays the vLLM import once."""

    def __init__(self, workers: int, address: str | None) -> None:
        self.ray = import_ray()
        self.workers, self.address = workers, address
        self.owns = False
        self.task: Any = None
        self.pending: list[Any] = []

    def _start(self) -> Any:
        if self.task is None:
            if not self.ray.is_initialized():
                where: dict[str, Any] = (
                    {"address": self.address}
                    if self.address
                    else {
                        "num_cpus": self.workers,
                        "runtime_env": {"env_vars": {"PYTHONPATH": _python_path()}},
                    }
                )
                self.ray.init(**where, include_dashboard=False, logging_level="WARNING")
                self.owns = True
            self.task = self.ray.remote(num_cpus=1)(_run_pair)
        return self.task

    def run(self, specs: Sequence[RunSpec]) -> Iterator[tuple[RunSpec, dict[str, Any]]]:
        if not specs:
            return
        task = self._start()
        by_ref = {task.remote(spec): spec for spec in specs}
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


def parallel_runs(workers: int | None, num_runs: int) -> int:
    """Worker count: as asked (default all cores), but no more than runs."""
    return max(1, min(workers or os.cpu_count() or 1, num_runs))


@contextmanager
def open_runner(
    executor: Executor = "local", workers: int | None = None, address: str | None = None
) -> Iterator[Runner]:
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
