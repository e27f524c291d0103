"""The rig's published figures (``scenarios/rig/published.yaml``) run as
simulations: one cold request on the rig's serving settings per prompt
shape, and kvsim's figure beside the rig's. No twin in vLLM.

Prefill and aggregate figures are given twice: as the synchronous engine
times them (one step after the other through both stages) and as the rig's
engine loop runs them (``engine.mode: async``: the batch queue on the
two-stage pipeline clock, consecutive chunks of one prompt, or the
micro-batches of many streams, overlapping across the stages). A decode
step of one request cannot overlap its successor, so single-stream decode
figures are the same both ways and come from the synchronous run.
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
from sim.rig import AcceptanceProfile
from sim.scenario import Scenario
from sim.sched.output import SchedulerOutput
from sim.step_time import StepTimeModel

PUBLISHED = SCENARIOS_DIR / "rig" / "published.yaml"
Metric = Literal[
    "decode_interval_ms",
    "tokens_per_step",
    "decode_tok_s",
    "ttft_s",
    "prefill_tok_s",
    "aggregate_tok_s",
    "pool_tokens",
    "stage0_busy_ms",
    "stage1_busy_ms",
]
# The fork's serving settings (benchmarks/2026-09-17/BENCH-CARD.md, fingerprint).
RIG_SCHEDULER = {"max_num_batched_tokens": 1024}
# The card's deployment (2026-09-17, v2): the planner's computed block
# (pool 806,792), hits on the block, no RecoverSSM; not the scenario
# defaults (v2.5.1's block flags). A figure's ``settings`` change it.
RIG_DEPLOYMENT = {"max_num_seqs": 8, "block_size": None, "prefix_match_unit": None, "use_replayssm": False}
# The aggregate bench (2026-09-05 card, protocol): a 1K prompt, 512 tokens
# with ignore_eos, every stream arriving together.
AGGREGATE_PROMPT_TOKENS = 1024


class Figure(StrictModel):
    id: str
    metric: Metric
    rig: float = Field(gt=0)
    prompt_tokens: int = Field(gt=0)
    output_tokens: int = Field(gt=1)
    # An acceptance profile by name, or the tokens per step the card
    # measured in the figure's cell (MTP K=3), turned into rates the same way.
    acceptance: str | float
    layout: Literal["off", "on"]
    card: str
    date: str
    release: str
    note: bool = False  # in the received note flash-next-rig.md (held to the bound in CI)
    fitted: str | None = None
    # Scenario keys the figure's deployment differs by (dotted, as --set).
    settings: dict[str, Any] = {}
    concurrency: int = Field(1, gt=0)  # streams at once (aggregate figures)
    # The card's run-to-run range of the figure [min, max] (over boots, or
    # sends where that is all it gives); None: one boot, no range printed.
    spread: tuple[float, float] | None = None
    # A lever: ``rig`` is the metric with these settings over the metric
    # without them (the card's arm over its control), and so is kvsim's.
    lever: dict[str, Any] = {}
    # Why the card's data cannot support comparing kvsim with the figure:
    # it is listed, flagged with this reason, and neither run nor judged.
    flag: str | None = None

    @property
    def shape(self) -> tuple[Any, ...]:
        return (
            self.prompt_tokens,
            self.output_tokens,
            self.acceptance,
            self.layout,
            self.concurrency,
            tuple(sorted((k, str(v)) for k, v in self.settings.items())),
        )

    @property
    def spread_pct(self) -> float | None:
        """Half the card's range over the figure, in %."""
        if self.spread is None:
            return None
        return 100 * (self.spread[1] - self.spread[0]) / 2 / self.rig


def load_figures(path: Path = PUBLISHED) -> list[Figure]:
    """The figures, each merged over the file's ``defaults``."""
    data = read_yaml(path)
    if not isinstance(data, dict) or not isinstance(data.get("figures"), list):
        raise ConfigError(f"{path}: expected 'defaults' and a list of 'figures'")
    defaults = data.get("defaults") or {}
    figures = [
        validate(Figure, {**defaults, **entry}, f"{path}: figures[{index}]")
        for index, entry in enumerate(data["figures"])
    ]
    return figures


def rig_scenario(
    figure: Figure, step_time: dict[str, Any] | None = None, engine_mode: str = "sync"
) -> Scenario:
    """One cold request of the figure's shape on the rig's settings (or
    ``concurrency`` of them arriving together), with the figure's own."""
    prompt = AGGREGATE_PROMPT_TOKENS if figure.metric == "aggregate_tok_s" else figure.prompt_tokens
    data = {
        "engine": {"mode": engine_mode},
        "name": f"published-{figure.id}",
        "model": str(DEFAULT_MODEL),
        "layouts": [figure.layout],
        "deployment": dict(RIG_DEPLOYMENT),
        "scheduler": dict(RIG_SCHEDULER),
        "mtp": _acceptance(figure),
        "step_time": dict(step_time or {}),
        "workload": {
            "trace": "synthetic",
            "num_requests": figure.concurrency,
            # Streams of an aggregate arrive together (a microsecond apart).
            "arrival": {"process": "constant", "rate_per_s": 1.0 if figure.concurrency == 1 else 1e6},
            "prompt": {"distribution": "fixed", "tokens": prompt},
            "output": {"distribution": "fixed", "tokens": figure.output_tokens},
        },
        "simulation": {"sample_interval_s": None},
    }
    for key, value in figure.settings.items():
        _set_dotted(data, key, value)
    return validate(Scenario, data, f"published figure {figure.id}")


def _acceptance(figure: Figure) -> dict[str, Any]:
    """The scenario's mtp section: the profile, or the rates of the
    measured tokens per step (one rate per draft of the figure's K)."""
    if isinstance(figure.acceptance, str):
        return {"acceptance_profile": figure.acceptance}
    rate = AcceptanceProfile(tokens_per_step=figure.acceptance, num_speculative_tokens=3).acceptance_rates()[
        0
    ]
    drafts = {**figure.settings}.get("mtp.num_speculative_tokens", 3)
    return {"acceptance_rates": [rate] * max(drafts, 1)}


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """``data[a][b] = value`` for the key ``a.b`` (as ``--set`` does)."""
    *path, last = key.split(".")
    for part in path:
        data = data.setdefault(part, {})
    data[last] = value


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
    runs it, and ``pipelined_*`` for the prefill and aggregate metrics as
    the rig's loop (the async engine) runs them."""
    scenario = rig_scenario(figure, step_time)
    sim = Simulation(scenario, figure.layout, scenario_workload(scenario))
    recorder = _Recorder(sim.step_time)
    sim.clock = SerialClock(recorder.step_time_s)  # the synchronous engine's clock, timing through it
    recording = sim.run()
    n = figure.concurrency
    decode_s = [s for out, s in recorder.steps if not out.num_prefill_tokens and len(out.scheduled) == n]
    if not decode_s:
        raise ConfigError(f"{figure.id}: the requests never decoded together")
    # Per stream: tokens after the first over the steps that decoded them.
    tokens_per_step = (
        n
        * (figure.output_tokens - 1)
        / sum(len(out.scheduled) for out, _ in recorder.steps if not out.num_prefill_tokens)
    )
    interval_s = statistics.median(decode_s)
    values = {
        "decode_interval_ms": interval_s * 1e3,
        "tokens_per_step": tokens_per_step,
        "decode_tok_s": tokens_per_step / interval_s,
        "aggregate_tok_s": n * tokens_per_step / interval_s,
        "pool_tokens": float(sim.plan.kv_cache_tokens),
    } | _stage_busy_ms(sim.step_time, recorder.steps, interval_s)
    pipelined = _async_run(figure, step_time)
    if n == 1:
        ttft_s, pipelined_s = _ttft_s(recording), _ttft_s(pipelined)
        values |= {
            "ttft_s": ttft_s,
            "prefill_tok_s": figure.prompt_tokens / ttft_s,
            "pipelined_ttft_s": pipelined_s,
            "pipelined_prefill_tok_s": figure.prompt_tokens / pipelined_s,
        }
    values["pipelined_aggregate_tok_s"] = _aggregate_tok_s(pipelined, figure.output_tokens)
    return values


def _stage_busy_ms(
    model: StepTimeModel, steps: list[tuple[SchedulerOutput, float]], interval_s: float
) -> dict[str, float]:
    """Each stage's busy time in a decode step of the median interval."""
    decodes = [(out, s) for out, s in steps if not out.num_prefill_tokens]
    output, _ = min(decodes, key=lambda step: abs(step[1] - interval_s))
    stages = range(model.config.pipeline_parallel_size)
    return {f"stage{stage}_busy_ms": model.stage_s(output, stage) * 1e3 for stage in stages}


def _async_run(figure: Figure, step_time: dict[str, Any] | None) -> Recording:
    """The figure's requests on the rig's engine loop (``engine.mode:
    async``: the batch queue keeps pp + 1 steps in flight, so a batch of
    streams fills both stages)."""
    scenario = rig_scenario(figure, step_time, engine_mode="async")
    return Simulation(scenario, figure.layout, scenario_workload(scenario)).run()


def _aggregate_tok_s(recording: Recording, output_tokens: int) -> float:
    """Streams x tokens after the first over each stream's mean decode
    span (first token to last): the rate while every stream decodes."""
    requests = list(recording.requests.values())
    spans = [float(r["finished_s"] - r["first_token_s"]) for r in requests]
    return len(requests) * (output_tokens - 1) / statistics.fmean(spans)


def _ttft_s(recording: Recording) -> float:
    """The lone request's time to first token."""
    (request,) = recording.requests.values()
    return float(request["first_token_s"] - request["arrival_s"])


def published_table(figures: list[Figure], step_time: dict[str, Any] | None = None) -> pd.DataFrame:
    """One row per figure: the rig's value, kvsim's (pipelined for prefill
    metrics), the synchronous engine's, the error of kvsim's in %, and the
    card's run-to-run spread in % (half its range) where it gives one. A
    lever's row is its arm over its control, both run here."""
    measured: dict[tuple[Any, ...], dict[str, float]] = {}

    def value(figure: Figure) -> tuple[float, float]:
        if figure.shape not in measured:
            measured[figure.shape] = measure(figure, step_time)
        values = measured[figure.shape]
        engine = values[figure.metric]
        return values.get(f"pipelined_{figure.metric}", engine), engine

    rows = []
    for figure in figures:
        if figure.flag:  # the data cannot support it: neither run nor judged
            rows.append(_row(figure, float("nan"), float("nan")))
            continue
        kvsim, engine = value(figure)
        if figure.lever:
            arm = figure.model_copy(update={"settings": {**figure.settings, **figure.lever}, "lever": {}})
            arm_kvsim, arm_engine = value(arm)
            kvsim, engine = arm_kvsim / kvsim, arm_engine / engine
        rows.append(_row(figure, kvsim, engine))
    return pd.DataFrame(rows)


def _row(figure: Figure, kvsim: float, engine: float) -> dict[str, Any]:
    """The figure's row of the table; a flagged figure's kvsim, error and
    engine values are NaN (nothing was run)."""
    error_pct = 100 * (kvsim / figure.rig - 1)
    return {
        "figure": figure.id,
        "metric": figure.metric + (" ratio" if figure.lever else ""),
        "prompt_tokens": figure.prompt_tokens,
        "rig": figure.rig,
        "kvsim": kvsim,
        "error_pct": error_pct,
        "spread_pct": figure.spread_pct,
        "verdict": "flagged" if figure.flag else verdict(error_pct, figure.spread_pct),
        "sync_engine": engine,
        "fitted": figure.fitted or "",
        "note": figure.note,
        "card": f"{figure.card} ({figure.date}, {figure.release})",
    }


def verdict(error_pct: float, spread_pct: float | None, bound_pct: float = 10.0) -> str:
    """``ok`` within the bound; a miss inside the card's own run-to-run
    spread is ``in spread``; else ``miss``."""
    if abs(error_pct) <= bound_pct:
        return "ok"
    return "in spread" if spread_pct is not None and abs(error_pct) <= spread_pct else "miss"


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
