"""The rig's published figures (``scenarios/rig/published.yaml``) run as
simulations: one cold request on the rig's serving settings per prompt
shape, and kvsim's figure beside the rig's. No twin in vLLM.

Prefill figures are given twice: as the synchronous engine times them (one
chunk after the other through both stages) and as the rig's engine loop
runs them (``engine.mode: async``: the batch queue on the two-stage
pipeline clock, consecutive chunks of one prompt overlapping across the
stages). A decode step of one request cannot overlap its successor, so
decode figures are the same both ways and come from the synchronous run.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pandas as pd
from pydantic import Field

from sim.analysis.runs import scenario_workload
from sim.config import ConfigError, StrictModel, read_yaml, validate
from sim.engine import Recording, Simulation
from sim.paths import DEFAULT_MODEL, SCENARIOS_DIR
from sim.pipeline_clock import SerialClock
from sim.scenario import Scenario
from sim.sched.output import SchedulerOutput
from sim.step_time import StepTimeModel

PUBLISHED = SCENARIOS_DIR / "rig" / "published.yaml"
Metric = Literal["decode_interval_ms", "tokens_per_step", "decode_tok_s", "ttft_s", "prefill_tok_s"]
# The fork's serving settings (benchmarks/2026-09-17/BENCH-CARD.md, fingerprint).
RIG_SCHEDULER = {"max_num_batched_tokens": 1024}
# The card's deployment (2026-09-17, v2): the planner's computed block
# (pool 806,792), hits on the block, no RecoverSSM; not the scenario
# defaults (v2.5.1's block flags).
RIG_DEPLOYMENT = {"max_num_seqs": 8, "block_size": None, "prefix_match_unit": None, "use_replayssm": False}


class Figure(StrictModel):
    id: str
    metric: Metric
    rig: float = Field(gt=0)
    prompt_tokens: int = Field(gt=0)
    output_tokens: int = Field(gt=1)
    acceptance: str
    layout: Literal["off", "on"]
    card: str
    date: str
    release: str
    note: bool = False  # in the shared note (held to the bound in CI)
    fitted: str | None = None

    @property
    def shape(self) -> tuple[int, int, str, str]:
        return (self.prompt_tokens, self.output_tokens, self.acceptance, self.layout)


def load_figures(path: Path = PUBLISHED) -> list[Figure]:
    """The figures, each merged over the file's ``defaults``."""
    data = read_yaml(path)
    if not isinstance(data, dict) or not isinstance(data.get("figures"), list):
        raise ConfigError(f"{path}: expected 'defaults' and a list of 'figures'")
    defaults = data.get("defaults") or {}
    return [
        validate(Figure, {**defaults, **entry}, f"{path}: figures[{index}]")
        for index, entry in enumerate(data["figures"])
    ]


def rig_scenario(
    figure: Figure, step_time: dict[str, Any] | None = None, engine_mode: str = "sync"
) -> Scenario:
    """One cold request of the figure's shape on the rig's settings."""
    data = {
        "engine": {"mode": engine_mode},
        "name": f"published-{figure.id}",
        "model": str(DEFAULT_MODEL),
        "layouts": [figure.layout],
        "deployment": RIG_DEPLOYMENT,
        "scheduler": RIG_SCHEDULER,
        "mtp": {"acceptance_profile": figure.acceptance},
        "step_time": step_time or {},
        "workload": {
            "trace": "synthetic",
            "num_requests": 1,
            "arrival": {"process": "constant", "rate_per_s": 1.0},
            "prompt": {"distribution": "fixed", "tokens": figure.prompt_tokens},
            "output": {"distribution": "fixed", "tokens": figure.output_tokens},
        },
        "simulation": {"sample_interval_s": None},
    }
    return validate(Scenario, data, f"published figure {figure.id}")


@dataclass
class _Recorder:
    """Stands in for the simulation's step-time model: times every step
    with it and keeps the outputs in order."""

    model: StepTimeModel
    steps: list[tuple[SchedulerOutput, float]] = field(default_factory=list)

    def step_time_s(self, output: SchedulerOutput) -> float:
        seconds = self.model.step_time_s(output)
        self.steps.append((output, seconds))
        return seconds


def measure(figure: Figure, step_time: dict[str, Any] | None = None) -> dict[str, float]:
    """Every metric of the figure's shape: kvsim's as the synchronous engine
    runs it, and ``pipelined_*`` for the prefill metrics as the rig's loop
    (the async engine) runs them."""
    scenario = rig_scenario(figure, step_time)
    sim = Simulation(scenario, figure.layout, scenario_workload(scenario))
    recorder = _Recorder(sim.step_time)
    sim.clock = SerialClock(recorder.step_time_s)  # the synchronous engine's clock, timing through it
    recording = sim.run()
    decode_s = [s for out, s in recorder.steps if not out.num_prefill_tokens]
    if not decode_s:
        raise ConfigError(f"{figure.id}: the request never decoded")
    ttft_s = _ttft_s(recording)
    pipelined_s = _async_ttft_s(figure, step_time)
    tokens_per_step = (figure.output_tokens - 1) / len(decode_s)
    interval_s = statistics.median(decode_s)
    return {
        "decode_interval_ms": interval_s * 1e3,
        "tokens_per_step": tokens_per_step,
        "decode_tok_s": tokens_per_step / interval_s,
        "ttft_s": ttft_s,
        "prefill_tok_s": figure.prompt_tokens / ttft_s,
        "pipelined_ttft_s": pipelined_s,
        "pipelined_prefill_tok_s": figure.prompt_tokens / pipelined_s,
    }


def _async_ttft_s(figure: Figure, step_time: dict[str, Any] | None) -> float:
    """The time to first token of the figure's request on the rig's engine
    loop (``engine.mode: async``)."""
    scenario = rig_scenario(figure, step_time, engine_mode="async")
    return _ttft_s(Simulation(scenario, figure.layout, scenario_workload(scenario)).run())


def _ttft_s(recording: Recording) -> float:
    """The lone request's time to first token."""
    (request,) = recording.requests.values()
    return float(request["first_token_s"] - request["arrival_s"])


def published_table(figures: list[Figure], step_time: dict[str, Any] | None = None) -> pd.DataFrame:
    """One row per figure: the rig's value, kvsim's (pipelined for prefill
    metrics), the synchronous engine's, and the error of kvsim's in %."""
    measured: dict[tuple[int, int, str, str], dict[str, float]] = {}
    rows = []
    for figure in figures:
        if figure.shape not in measured:
            measured[figure.shape] = measure(figure, step_time)
        values = measured[figure.shape]
        engine = values[figure.metric]
        kvsim = values.get(f"pipelined_{figure.metric}", engine)
        rows.append(
            {
                "figure": figure.id,
                "metric": figure.metric,
                "prompt_tokens": figure.prompt_tokens,
                "rig": figure.rig,
                "kvsim": kvsim,
                "error_pct": 100 * (kvsim / figure.rig - 1),
                "sync_engine": engine,
                "fitted": figure.fitted or "",
                "note": figure.note,
                "card": f"{figure.card} ({figure.date}, {figure.release})",
            }
        )
    return pd.DataFrame(rows)


def published_figure(table: pd.DataFrame) -> Any:
    """Each figure's kvsim value over the rig's (1 = exact), the 10 % band
    shaded; the synchronous engine's prefill values as hollow marks."""
    from matplotlib.figure import Figure as PlotFigure

    fig = PlotFigure(figsize=(10, 4.5), layout="constrained")
    ax = fig.add_subplot()
    x = range(len(table))
    ax.axhspan(0.9, 1.1, color="0.9", label="within 10 %")
    ax.axhline(1.0, color="black", lw=0.8)
    colors = ["tab:orange" if fitted else "tab:blue" for fitted in table["fitted"]]
    ax.scatter(
        x, table["kvsim"] / table["rig"], c=colors, zorder=3, label="kvsim / rig (orange: fitted on it)"
    )
    sync = table["sync_engine"] != table["kvsim"]
    ax.scatter(
        [i for i, s in zip(x, sync, strict=True) if s],
        (table["sync_engine"] / table["rig"])[sync],
        facecolors="none",
        edgecolors="tab:red",
        zorder=3,
        label="synchronous engine (no chunk overlap)",
    )
    ax.set_xticks(list(x), table["figure"], rotation=70, fontsize=7)
    ax.set_ylabel("kvsim / rig")
    ax.set_title("The rig's published figures against kvsim (scenarios/rig/published.yaml)")
    ax.legend(fontsize=8, loc="lower left")
    return fig
