"""Regenerate docs/rig-defaults.md's tables and figures: what making the rig
as shipped kvsim's default changed (issue 21.1).

    PYTHONPATH=. KVSIM_VENV=... nice python scripts/rig_defaults.py   # about 5 minutes on one core

Rewrites the blocks between ``<!-- rig-defaults:NAME -->`` markers in
docs/rig-defaults.md and writes docs/figures/sync-vs-async.png and
docs/figures/async-timeline.png. Every number comes from a fresh run of a
shipped scenario; nothing is typed by hand.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pandas as pd

from sim.analysis.runs import run_scenario, scenario_workload
from sim.config import validate
from sim.engine import Simulation
from sim.paths import PROJECT_ROOT, SCENARIOS_DIR
from sim.pipeline_clock import PipelineClock
from sim.scenario import load_scenario
from sim.workloads import WorkloadConfig

DOC = PROJECT_ROOT / "docs" / "rig-defaults.md"
FIGURES = PROJECT_ROOT / "docs" / "figures"
METRICS = {
    "num_admitted": "admitted",
    "peak_concurrency": "peak running",
    "mean_concurrency": "mean running",
    "num_preemptions": "preemptions",
    "ttft_p50_s": "TTFT p50 (s)",
    "ttft_p99_s": "TTFT p99 (s)",
    "output_throughput_tokens_per_s": "throughput (tok/s)",
}
# The default and three gates (their own horizons, 32 sequences).
SYNC_VS_ASYNC = ("chat-slice", "gates/long-prompts", "gates/prefix-shared", "gates/overload")
LOOPS = ("sync", "async")
TIMELINE_PROMPT_TOKENS = 8192


def _load(name: str, overrides: list[str] | None = None):
    path = SCENARIOS_DIR / f"{name}.yaml"
    return load_scenario(str(path), overrides)


def _cell(value: float) -> str:
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.2f}"


def before_after() -> str:
    """The default comparison on the old defaults and on the rig's."""
    old, new = (
        run_scenario(_load(name)).summary.set_index("layout") for name in ("old-defaults", "chat-slice")
    )
    lines = [
        "| metric | before, off | before, on | after, off | after, on |",
        "|---|---:|---:|---:|---:|",
        f"| KV pool (tokens) | {_cell(old.kv_cache_tokens['off'])} | {_cell(old.kv_cache_tokens['on'])} "
        f"| {_cell(new.kv_cache_tokens['off'])} | {_cell(new.kv_cache_tokens['on'])} |",
    ]
    for key, label in METRICS.items():
        row = [old[key]["off"], old[key]["on"], new[key]["off"], new[key]["on"]]
        lines.append(f"| {label} | " + " | ".join(_cell(v) for v in row) + " |")
    return "\n".join(lines)


def _moved(sync: pd.DataFrame, asynchronous: pd.DataFrame) -> str:
    """Which admissions move: requests admitted by the horizon under one
    loop only, and the median shift of the admission time of the rest."""
    s = sync.set_index("request_id")
    a = asynchronous.set_index("request_id")
    only_async = int((a.admitted & ~s.admitted.reindex(a.index, fill_value=False)).sum())
    only_sync = int((s.admitted & ~a.admitted.reindex(s.index, fill_value=False)).sum())
    both = s.index[s.admitted & a.admitted.reindex(s.index, fill_value=False)]
    shift = (a.admitted_s[both] - s.admitted_s[both]).median() if len(both) else float("nan")
    return f"+{only_async} / -{only_sync}, {shift:+.1f} s"


def sync_vs_async() -> tuple[str, pd.DataFrame]:
    """Each scenario under both loops, layout on."""
    rows, lines = [], []
    lines.append(
        "| scenario | loop | " + " | ".join(METRICS.values()) + " | admitted only here (async/sync), "
        "median admission shift |"
    )
    lines.append("|---|---|" + "---:|" * (len(METRICS) + 1))
    for name in SYNC_VS_ASYNC:
        runs = {mode: run_scenario(_load(name, [f"engine.mode={mode}"]), ["on"]) for mode in LOOPS}
        moved = _moved(runs["sync"].requests, runs["async"].requests)
        for mode, run in runs.items():
            summary = run.summary.iloc[0]
            rows.append({"scenario": name, "loop": mode, **{k: summary[k] for k in METRICS}})
            cells = " | ".join(_cell(summary[k]) for k in METRICS)
            lines.append(f"| {name} | {mode} | {cells} | {moved if mode == 'async' else ''} |")
    return "\n".join(lines), pd.DataFrame(rows)


def sync_vs_async_figure(frame: pd.DataFrame, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 3.6), layout="constrained")
    panels = ("num_admitted", "mean_concurrency", "ttft_p50_s", "output_throughput_tokens_per_s")
    for ax, key in zip(fig.subplots(1, len(panels)), panels, strict=True):
        table = frame.pivot(index="scenario", columns="loop", values=key).reindex(SYNC_VS_ASYNC)
        colors = ["tab:gray", "tab:blue"]
        table[list(LOOPS)].plot.bar(ax=ax, rot=30, color=colors, legend=key == panels[0])
        ax.set_title(METRICS[key])
        ax.set_xlabel("")
    fig.suptitle("sync against async engine loop, layout on (the rig's other settings)")
    fig.savefig(path, dpi=110)


class RecordingClock(PipelineClock):
    """The pipeline clock, keeping each step's (stage, start, end)."""

    def __init__(self, clock: PipelineClock) -> None:
        super().__init__(clock.num_stages, self._timed_stage, clock.handoff_s)
        self._stage_time = clock.stage_s
        self.bars: list[tuple[int, int, float, float, bool]] = []
        self._durations: list[float] = []

    def _timed_stage(self, output, stage: int) -> float:
        seconds = self._stage_time(output, stage)
        self._durations.append(seconds)
        return seconds

    def schedule(self, output, samples: bool = True) -> float:
        self._durations = []
        end_s = super().schedule(output, samples)
        step = len({b[0] for b in self.bars})
        for stage, seconds in enumerate(self._durations):
            ends = self._stage_free_s[stage]
            self.bars.append((step, stage, ends - seconds, ends, output.num_prefill_tokens > 0))
        return end_s


def async_timeline(path: Path) -> str:
    """C=1: one cold prompt on the rig's settings, the async loop; each
    step's time on each pipeline stage."""
    workload = validate(
        WorkloadConfig,
        {
            "trace": "synthetic",
            "num_requests": 1,
            "arrival": {"process": "constant", "rate_per_s": 1.0},
            "prompt": {"distribution": "fixed", "tokens": TIMELINE_PROMPT_TOKENS},
            "output": {"distribution": "fixed", "tokens": 12},
        },
        "timeline",
    )
    ttft = {}
    for mode in ("sync", "async"):
        scenario = _load("chat-slice", [f"engine.mode={mode}", "simulation.sample_interval_s=null"])
        scenario = scenario.model_copy(update={"workload": workload})
        sim = Simulation(scenario, "on", scenario_workload(scenario))
        if mode == "async":
            sim.clock = clock = RecordingClock(sim.clock)
        (request,) = sim.run().requests.values()
        ttft[mode] = request["first_token_s"] - request["arrival_s"]
    _draw_timeline(clock.bars, ttft, path)
    return (
        f"One {TIMELINE_PROMPT_TOKENS:,}-token prompt, 12 output tokens: time to first token "
        f"{ttft['async']:.3f} s on the async loop, {ttft['sync']:.3f} s on the synchronous one."
    )


def _draw_timeline(bars, ttft: dict[str, float], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 2.8), layout="constrained")
    ax = fig.add_subplot()
    start = min(b[2] for b in bars)
    for step, stage, begin, end, prefill in bars:
        color = "tab:blue" if prefill else "tab:orange"
        ax.barh(stage, end - begin, left=begin - start, color=color, edgecolor="white", height=0.6)
        if prefill and end - begin > 0.05:  # the chunk's number, where it fits
            ax.text((begin + end) / 2 - start, stage, str(step), ha="center", va="center", fontsize=7)
    ax.axvline(ttft["async"], color="black", lw=0.8, ls="--")
    ax.set_yticks([0, 1], ["stage 0 (PP0)", "stage 1 (PP1)"])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since arrival (blue: prefill chunks of 1,024 tokens; orange: decode steps)")
    ax.set_title(
        f"async loop, one {TIMELINE_PROMPT_TOKENS:,}-token prompt: chunk n+1 runs on stage 0 while chunk n "
        f"runs on stage 1 (dashed: first token, {ttft['async']:.2f} s; sync {ttft['sync']:.2f} s)",
        fontsize=9,
    )
    fig.savefig(path, dpi=110)


def replace_block(text: str, name: str, body: str) -> str:
    pattern = re.compile(rf"(<!-- rig-defaults:{name} -->\n).*?(<!-- /rig-defaults:{name} -->)", re.S)
    if not pattern.search(text):
        sys.exit(f"{DOC}: no <!-- rig-defaults:{name} --> block")
    return pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)


def main() -> int:
    text = DOC.read_text()
    text = replace_block(text, "timeline", async_timeline(FIGURES / "async-timeline.png"))
    text = replace_block(text, "before-after", before_after())
    table, frame = sync_vs_async()
    sync_vs_async_figure(frame, FIGURES / "sync-vs-async.png")
    text = replace_block(text, "sync-vs-async", table)
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(PROJECT_ROOT)} and docs/figures/{{async-timeline,sync-vs-async}}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
