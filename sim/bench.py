"""``kvsim bench``: how fast the simulator runs, per layout.

A benchmark, not a test: it prints figures (simulated seconds per wall
second, engine steps per second, peak memory) and asserts nothing. Each
layout runs in a fresh process so its peak memory is its own.
"""

from __future__ import annotations

import multiprocessing
import resource
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass


@dataclass(frozen=True, kw_only=True)
class BenchFigures:
    layout: str
    import_s: float
    simulated_s: float
    wall_s: float
    steps: int
    requests: int
    peak_rss_mib: float

    @property
    def sim_s_per_wall_s(self) -> float:
        return self.simulated_s / self.wall_s if self.wall_s else float("nan")

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.wall_s if self.wall_s else float("nan")


def _measure(scenario_name: str, overrides: list[str], layout: str) -> dict:
    started = time.perf_counter()
    from sim.analysis.runs import scenario_workload
    from sim.engine import simulate
    from sim.scenario import load_scenario

    scenario = load_scenario(scenario_name, overrides)
    workload = scenario_workload(scenario)
    imported = time.perf_counter()
    recording = simulate(scenario, layout, workload)  # type: ignore[arg-type]
    finished = time.perf_counter()
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return asdict(
        BenchFigures(
            layout=layout,
            import_s=imported - started,
            simulated_s=recording.end_time_s,
            wall_s=finished - imported,
            steps=len(recording.steps),
            requests=len(recording.requests),
            peak_rss_mib=peak_kib / 1024,
        )
    )


def run_bench(scenario_name: str, overrides: list[str], layouts: tuple[str, ...]) -> list[BenchFigures]:
    context = multiprocessing.get_context("spawn")
    figures = []
    for layout in layouts:
        with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
            figures.append(BenchFigures(**pool.submit(_measure, scenario_name, overrides, layout).result()))
    return figures


def format_bench(scenario_name: str, figures: list[BenchFigures]) -> str:
    header = (
        f"{'layout':<7}{'simulated s':>12}{'wall s':>9}{'sim s/wall s':>14}"
        f"{'steps':>8}{'steps/s':>9}{'requests':>10}{'peak MiB':>10}{'import s':>10}"
    )
    rows = [
        f"{f.layout:<7}{f.simulated_s:>12.1f}{f.wall_s:>9.2f}{f.sim_s_per_wall_s:>14.1f}"
        f"{f.steps:>8}{f.steps_per_s:>9.0f}{f.requests:>10}{f.peak_rss_mib:>10.0f}{f.import_s:>10.1f}"
        for f in figures
    ]
    return "\n".join([f"kvsim bench: scenario {scenario_name}", header, *rows])
