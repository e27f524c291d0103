"""``kvsim bench``: how fast the simulator runs, per layout.

A benchmark, not a test: it prints figures (simulated seconds per wall
second, engine steps per second, microseconds per step, peak memory) and
asserts nothing. Each measurement runs in a fresh process so its peak
memory is its own, ``repeats`` times in turn with the others; its figures
are its least disturbed run's. Speed targets are ratios within one run
(the machine's load cancels): against kvsim without its fast path
(``step-by-step``), and against vLLM 0.33.0's own ``Scheduler`` stepping
the same trace (``vllm``, the conformance backend, with fenced frees off as
vLLM frees at once: a handful of steps differ from kvsim's fenced run, and
the ratio is per step).
"""

from __future__ import annotations

import inspect
import multiprocessing
import os
import resource
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

# What a measurement runs: kvsim's simulation (fast path on or off),
# vLLM's own Scheduler driven by the conformance driver, or kvsim timing the
# allocator's calls it makes (``allocator``: what no skip outside them saves).
BACKENDS = ("kvsim", "step-by-step", "vllm", "allocator")
# Those run on their own scenario and compared with kvsim per step (the
# ``allocator`` backend is kvsim itself, timed inside).
COMPARED_BACKENDS = ("step-by-step", "vllm")

# The speed targets (docs/speed.md): simulated seconds per CPU second on the
# scenarios that name one, and how many times fewer CPU microseconds per
# step than vLLM's own engine stepping the same trace.
REAL_TIME_TARGETS = {"saturated-decode": 300.0, "chat-slice": 1000.0}
STEP_COST_TARGET = 8.0


@dataclass(frozen=True, kw_only=True)
class BenchFigures:
    layout: str
    import_s: float
    simulated_s: float
    wall_s: float
    steps: int
    requests: int
    peak_rss_mib: float
    backend: str = "kvsim"
    # The run's CPU time in this process (the same span as wall_s): wall
    # time on a loaded machine counts the others' work too, so the ratios
    # are taken on CPU time.
    cpu_s: float = float("nan")
    # Fresh-process runs measured; the figures are the one with the least
    # CPU time, and cpu_s_max the most (how much the machine moved them).
    runs: int = 1
    cpu_s_max: float | None = None
    # Resident memory when a tenth of the requests have arrived and at the
    # end (kvsim backends): growth between them beyond the frames' rows is
    # a leak (docs/speed.md).
    rss_10pct_mib: float = float("nan")
    rss_100pct_mib: float = float("nan")
    # The ``allocator`` backend: seconds inside the KV cache manager's calls
    # and the requests' block hashing (``AllocatorTimer``).
    allocator_s: float = float("nan")

    @property
    def us_per_step(self) -> float:
        return self.wall_s / self.steps * 1e6 if self.steps else float("nan")

    @property
    def cpu_us_per_step(self) -> float:
        return self.cpu_s / self.steps * 1e6 if self.steps else float("nan")

    @property
    def allocator_us_per_step(self) -> float:
        return self.allocator_s / self.steps * 1e6 if self.steps else float("nan")

    @property
    def sim_s_per_cpu_s(self) -> float:
        return self.simulated_s / self.cpu_s if self.cpu_s else float("nan")

    @property
    def sim_s_per_wall_s(self) -> float:
        return self.simulated_s / self.wall_s if self.wall_s else float("nan")

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.wall_s if self.wall_s else float("nan")


def _measure(scenario_name: str, overrides: list[str], layout: str, backend: str = "kvsim") -> dict:
    started = time.perf_counter()
    from sim.analysis.runs import scenario_workload
    from sim.scenario import load_scenario

    scenario = load_scenario(scenario_name, overrides)
    if backend in COMPARED_BACKENDS:
        scenario = _compared_scenario(scenario, backend)
    workload = scenario_workload(scenario)
    rss_mib: list[float] = []
    timer = AllocatorTimer() if backend == "allocator" else None
    if backend == "vllm":
        simulated_s, steps, wall_s, cpu_s = _run_vllm(scenario, layout, workload)
    else:
        simulated_s, steps, wall_s, cpu_s = _run_kvsim(scenario, layout, workload, rss_mib, timer)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return asdict(
        BenchFigures(
            layout=layout,
            backend=backend,
            import_s=time.perf_counter() - started - wall_s,  # imports, the trace, building
            simulated_s=simulated_s,
            wall_s=wall_s,
            steps=steps,
            requests=len(workload.requests),
            peak_rss_mib=peak_kib / 1024,
            cpu_s=cpu_s,
            rss_10pct_mib=rss_mib[0] if rss_mib else float("nan"),
            rss_100pct_mib=rss_mib[-1] if rss_mib else float("nan"),
            allocator_s=timer.seconds if timer is not None else float("nan"),
        )
    )


def _compared_scenario(scenario, backend: str):  # noqa: ANN001, ANN202 (scenario types load late)
    """The scenario as the comparison runs it: without the fast path, or
    with fenced frees off (vLLM's Scheduler frees at once)."""
    if backend == "step-by-step":
        section = scenario.simulation.model_copy(update={"fast_path": False})
        return scenario.model_copy(update={"simulation": section})
    from sim.conformance.driver import conformance_scenario

    return conformance_scenario(scenario)


def _run_kvsim(  # noqa: ANN001 (scenario types load late)
    scenario, layout: str, workload, rss_mib: list[float], timer: AllocatorTimer | None = None
) -> tuple[float, int, float, float]:
    from sim.engine import Simulation

    simulation = Simulation(scenario, layout, workload)  # type: ignore[arg-type]
    if timer is not None:
        timer.attach(simulation.scheduler)
    recording, wall_s, cpu_s = _timed(lambda: run_reading_rss(simulation, rss_mib))
    return recording.end_time_s, len(recording.steps), wall_s, cpu_s


class AllocatorTimer:
    """Times what kvsim asks of the allocator: every call of the scheduler's
    KV cache manager (vLLM's ``KVCacheManager`` with the fork's twin on
    top) and of its requests' block hasher, outermost calls only (the
    manager calls itself). A floor under kvsim's cost per step: these are
    vLLM's (and the fork's) own work, which no skip outside them saves, so
    the simulator can run at most ``simulated s / seconds`` real time while
    it makes them. Wall time within the calls (``perf_counter``: a CPU-time
    clock read costs ten times as much, about the cost of a short call);
    calls the manager's parts get directly (the block pool, say) are not
    counted, so the floor is if anything low."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._depth = 0

    def attach(self, scheduler) -> None:  # noqa: ANN001 (scheduler types load late)
        """Time ``scheduler``'s manager and hasher from now on (before any
        request is built: requests take the hasher when they are)."""
        # The allocator itself: behind the fast path's door, if on (a skipped call costs it nothing).
        from sim.sched.fast_path.kv_cache_manager import unwrapped

        manager = unwrapped(scheduler.kv_cache_manager)
        for name in dir(manager):
            method = getattr(manager, name) if not name.startswith("__") else None
            if inspect.ismethod(method):
                setattr(manager, name, self.timed(method))
        scheduler.block_hasher = self.timed(scheduler.block_hasher)

    def timed(self, call: Callable[..., T]) -> Callable[..., T]:
        def timed_call(*args: object, **kwargs: object) -> T:
            if self._depth:
                return call(*args, **kwargs)
            self._depth += 1
            begun = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - begun
                self._depth -= 1

        return timed_call


def run_reading_rss(simulation, rss_mib: list[float]):  # noqa: ANN001, ANN201 (engine types load late)
    """``simulation`` to its end as ``Simulation.run`` takes it, pausing
    once when a tenth of its requests have arrived to append the resident
    memory to ``rss_mib``, and again at the end. (SimPy stops a run before
    the events at its ``until``, so the pause changes nothing.)"""
    simulation.start()
    requests = simulation.workload.requests
    horizon_s = simulation.scenario.simulation.max_time_s
    tenth_s = requests[len(requests) // 10].arrival_s if requests else 0.0
    if tenth_s > 0 and (horizon_s is None or tenth_s < horizon_s):
        simulation.env.run(until=tenth_s)
    rss_mib.append(current_rss_mib())
    simulation.env.run(until=horizon_s)
    rss_mib.append(current_rss_mib())
    return simulation.finish()


def current_rss_mib() -> float:
    """This process's resident memory now (Linux's /proc; NaN elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return float("nan")
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _run_vllm(scenario, layout: str, workload) -> tuple[float, int, float, float]:  # noqa: ANN001
    """vLLM's Scheduler over the trace, timed without building it (async
    mode: its ``EngineCore`` with the batch queue over its ``AsyncScheduler``)."""
    from sim.conformance.driver import drive, plan_for, vllm_backend
    from sim.step_time import StepTimeModel

    if scenario.engine.batch_queue:
        return _run_vllm_engine(scenario, layout, workload)
    backend = vllm_backend(scenario, plan_for(scenario, layout))  # type: ignore[arg-type]
    step_time = StepTimeModel(scenario.step_time_config())
    trajectory, wall_s, cpu_s = _timed(
        lambda: drive(backend, workload.requests, step_time, scenario.simulation.max_time_s)
    )
    simulated_s = trajectory.times_s[-1] if trajectory.times_s else 0.0
    return simulated_s, len(trajectory.steps), wall_s, cpu_s


def _run_vllm_engine(scenario, layout: str, workload) -> tuple[float, int, float, float]:  # noqa: ANN001
    """vLLM's ``step_with_batch_queue`` over the trace on the pipeline clock;
    its steps are the engine calls that scheduled something (kvsim's rows
    are the micro-batches that ran something)."""
    from sim.conformance.async_engine import async_clock, drive_engine, vllm_engine
    from sim.conformance.driver import plan_for, vllm_settings, vllm_unavailable_as_one_line
    from sim.step_time import StepTimeModel

    plan = plan_for(scenario, layout)  # type: ignore[arg-type]
    with vllm_unavailable_as_one_line("EngineCore"):
        engine = vllm_engine(scenario, plan, vllm_settings(scenario, plan))
    engine.scheduler.defer_block_free = False  # as kvsim conform --engine async compares it
    clock = async_clock(scenario, StepTimeModel(scenario.step_time_config()))
    trajectory, wall_s, cpu_s = _timed(
        lambda: drive_engine(engine, workload.requests, clock, scenario.simulation.max_time_s)
    )
    simulated_s = trajectory.times_s[-1] if trajectory.times_s else 0.0
    steps = sum(1 for state in trajectory.steps if state.scheduled_tokens)
    return simulated_s, steps, wall_s, cpu_s


def _timed(work: Callable[[], T]) -> tuple[T, float, float]:
    """``work()``'s result, wall seconds and this process's CPU seconds."""
    begun, cpu_begun = time.perf_counter(), time.process_time()
    result = work()
    return result, time.perf_counter() - begun, time.process_time() - cpu_begun


def run_bench(
    scenario_name: str,
    overrides: list[str],
    layouts: tuple[str, ...],
    against: tuple[str, ...] = (),
    repeats: int = 1,
) -> list[BenchFigures]:
    """kvsim per layout, then each backend in ``against`` per layout, each
    measured ``repeats`` times in turn (all of them once, then again), so a
    drift of the machine's speed reaches every backend alike."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    measured: dict[tuple[str, str], list[BenchFigures]] = {}
    for _ in range(repeats):
        for backend in ("kvsim", *against):
            for layout in layouts:
                figures = _measure_in_fresh_process(scenario_name, overrides, layout, backend)
                measured.setdefault((backend, layout), []).append(figures)
    return [least_disturbed(runs) for runs in measured.values()]


def _measure_in_fresh_process(
    scenario_name: str, overrides: list[str], layout: str, backend: str
) -> BenchFigures:
    """One run in a process of its own (its peak memory is its own, and no
    run warms the next one's caches)."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return BenchFigures(**pool.submit(_measure, scenario_name, overrides, layout, backend).result())


def least_disturbed(runs: list[BenchFigures]) -> BenchFigures:
    """Of one measurement's runs, the one with the least CPU time (and the
    highest peak memory of them all): the work is the same in each (same
    scenario, same seed, same steps), so the extra CPU time of the others
    is the machine's (another process sharing the core's caches, frequency
    changes), as ``timeit`` reasons."""
    least = min(runs, key=lambda f: f.cpu_s)
    return replace(
        least,
        runs=len(runs),
        cpu_s_max=max(f.cpu_s for f in runs),
        peak_rss_mib=max(f.peak_rss_mib for f in runs),  # memory: the worst run's
    )


def format_bench(scenario_name: str, figures: list[BenchFigures]) -> str:
    header = (
        f"{'backend':<13}{'layout':<7}{'simulated s':>12}{'wall s':>9}{'sim s/wall s':>14}{'steps':>8}"
        f"{'steps/s':>9}{'us/step':>9}{'cpu s':>8}{'sim s/cpu s':>13}{'cpu us/step':>13}"
        f"{'requests':>10}{'peak MiB':>10}{'RSS 10% MiB':>12}{'RSS 100% MiB':>13}{'import s':>10}{'runs':>6}"
        f"{'max cpu s':>11}"
    )
    rows = [
        f"{f.backend:<13}{f.layout:<7}{f.simulated_s:>12.1f}{f.wall_s:>9.2f}{f.sim_s_per_wall_s:>14.1f}"
        f"{f.steps:>8}{f.steps_per_s:>9.0f}{f.us_per_step:>9.0f}{f.cpu_s:>8.1f}{f.sim_s_per_cpu_s:>13.1f}"
        f"{f.cpu_us_per_step:>13.0f}{f.requests:>10}{f.peak_rss_mib:>10.0f}{f.rss_10pct_mib:>12.0f}"
        f"{f.rss_100pct_mib:>13.0f}"
        f"{f.import_s:>10.1f}{f.runs:>6}{'-' if f.cpu_s_max is None else f'{f.cpu_s_max:.1f}':>11}"
        for f in figures
    ]
    lines = [f"kvsim bench: scenario {scenario_name}", header, *rows, *_ratios(figures)]
    return "\n".join([*lines, *target_lines(scenario_name, figures)])


def target_lines(scenario_name: str, figures: list[BenchFigures]) -> list[str]:
    """Where each speed target that applies stands: the scenario's real-time
    target per kvsim layout, the step-cost one per layout compared with vLLM;
    a missed one is said out of reach where the allocator's calls alone
    (the ``allocator`` backend, same layout) leave no room for it."""
    lines = []
    real_time = REAL_TIME_TARGETS.get(Path(scenario_name).stem)
    floors = {layout: f for layout, f in _by_layout(figures, "allocator").items() if f.allocator_s > 0}
    for f in figures:
        if real_time is not None and f.backend == "kvsim":
            floor = floors.get(f.layout)
            ceiling = floor.simulated_s / floor.allocator_s if floor else None
            line = _target_line("simulated s per CPU s", real_time, f.sim_s_per_cpu_s, f.layout, ceiling)
            lines.append(line)
    vllm = _by_layout(figures, "vllm")
    for layout, ratio in step_cost_ratios(figures).get("vllm", {}).items():
        floor = floors.get(layout)
        ceiling = vllm[layout].cpu_us_per_step / floor.allocator_us_per_step if floor else None
        line = _target_line("fewer CPU us per step than vllm", STEP_COST_TARGET, ratio, layout, ceiling)
        lines.append(line)
    return lines


def _target_line(what: str, target: float, value: float, layout: str, ceiling: float | None = None) -> str:
    """``ceiling``: the best ``value`` while kvsim makes the allocator's calls."""
    verdict = "met" if value >= target else "missed"
    if ceiling is not None and value < target:
        reach = "out of reach" if ceiling < target else "within reach"
        verdict += f" ({reach}: the allocator's calls alone allow at most {ceiling:.1f}x)"
    return f"target >= {target:g}x {what} [{layout}]: {value:.1f}x, {verdict}"


def step_cost_ratios(figures: list[BenchFigures]) -> dict[str, dict[str, float]]:
    """Per compared backend and layout: its CPU microseconds per step over
    kvsim's (how many times fewer kvsim takes), from the same run."""
    kvsim = _by_layout(figures, "kvsim")
    ratios: dict[str, dict[str, float]] = {}
    for f in figures:
        if f.backend in COMPARED_BACKENDS and f.layout in kvsim:
            ratios.setdefault(f.backend, {})[f.layout] = f.cpu_us_per_step / kvsim[f.layout].cpu_us_per_step
    return ratios


def _ratios(figures: list[BenchFigures]) -> list[str]:
    return [
        f"kvsim takes {ratio:.1f}x fewer CPU us per step than {backend} [{layout}]"
        for backend, by_layout in step_cost_ratios(figures).items()
        for layout, ratio in by_layout.items()
    ] + _allocator_shares(figures)


def _allocator_shares(figures: list[BenchFigures]) -> list[str]:
    """Per layout timed (``allocator``): the allocator's share of kvsim's step."""
    kvsim = _by_layout(figures, "kvsim")
    return [
        f"the allocator's calls take {f.allocator_us_per_step:.0f} of kvsim's "
        f"{kvsim[f.layout].cpu_us_per_step:.0f} CPU us per step [{f.layout}]"
        for f in figures
        if f.backend == "allocator" and f.layout in kvsim
    ]


def _by_layout(figures: list[BenchFigures], backend: str) -> dict[str, BenchFigures]:
    """``backend``'s figures by layout."""
    return {f.layout: f for f in figures if f.backend == backend}
