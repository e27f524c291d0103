"""Golden frames: the fork's own Scheduler's steps, recorded by ``kvsim
conform --fork ... --record FILE`` and committed as test data (figures the
fork produced, not its code), so CI checks kvsim's fork mode against the
fork step by step without building the fork.

A file is gzip'd JSON lines: a header (the resolved scenario it ran, every
key, and the file and overrides it came from, the layout, the engine mode, the fork's scheduler-side blob ids,
the command, the clock's answers in the order they were asked), then one
object per executed step (engine call, for the batch queue). The waiting queue, which can hold
hundreds of ids, is kept as its length and a digest; every other column is
kept as is.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sim.conformance.backends import ComparedStep
from sim.conformance.driver import Trajectory

FORMAT = "kvsim fork golden frames 1"


def encode_state(state: ComparedStep, time_s: float, step_s: float) -> dict[str, Any]:
    """A step as the golden file keeps it (JSON types only): when it ended
    and how long the clock gave it, then the comparison's columns."""
    record: dict[str, Any] = {"time_s": time_s, "step_s": step_s}
    for field in dataclasses.fields(state):
        value = getattr(state, field.name)
        if field.name == "waiting":
            value = {"n": len(value), "sha1": hashlib.sha1("\n".join(value).encode()).hexdigest()[:16]}
        record[field.name] = _plain(value)
    return record


def _plain(value: Any) -> Any:
    """Tuples as lists, recursively (what a JSON round trip gives)."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def encoded_steps(trajectory: Trajectory) -> list[dict[str, Any]]:
    return [
        encode_state(state, time_s, step_s)
        for state, time_s, step_s in zip(
            trajectory.steps, trajectory.times_s, trajectory.steps_s, strict=True
        )
    ]


@dataclass(frozen=True, kw_only=True)
class GoldenFrames:
    header: dict[str, Any]
    steps: tuple[dict[str, Any], ...]

    @property
    def stalled(self) -> bool:
        return bool(self.header["stalled"])


def write_golden(path: Path, header: dict[str, Any], trajectory: Trajectory) -> None:
    """Written whole to a temporary name, then renamed (never half a file)."""
    first = {
        "format": FORMAT,
        **header,
        "stalled": trajectory.stalled,
        "steps": len(trajectory.steps),
        "clock_tape": list(trajectory.clock_tape),
    }
    lines = [json.dumps(first), *(json.dumps(record) for record in encoded_steps(trajectory))]
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with gzip.open(partial, "wt", encoding="utf-8") as out:
        out.write("\n".join(lines) + "\n")
    partial.replace(path)


def read_golden(path: Path) -> GoldenFrames:
    """A complete recording, or a ValueError naming the file."""
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        header = json.loads(next(lines))
        steps = tuple(json.loads(line) for line in lines)
    if header.get("format") != FORMAT or len(steps) != header.get("steps"):
        raise ValueError(f"{path}: not a complete golden-frames file")
    return GoldenFrames(header=header, steps=steps)


@dataclass(frozen=True, kw_only=True)
class GoldenDifference:
    """The first step (1-based) where kvsim leaves the golden frames."""

    step: int
    columns: tuple[str, ...]
    kvsim: dict[str, Any] | None
    fork: dict[str, Any] | None


def first_difference(golden: GoldenFrames, trajectory: Trajectory) -> GoldenDifference | None:
    """None when every step and the stall agree."""
    ours = iter(encoded_steps(trajectory))
    for step, (mine, theirs) in enumerate(_pairs(ours, iter(golden.steps)), start=1):
        if mine != theirs:
            columns = tuple(k for k in (mine or theirs or {}) if (mine or {}).get(k) != (theirs or {}).get(k))
            return GoldenDifference(step=step, columns=columns, kvsim=mine, fork=theirs)
    if trajectory.stalled != golden.stalled:
        return GoldenDifference(step=len(golden.steps) + 1, columns=("stalled",), kvsim=None, fork=None)
    return None


def _pairs(
    left: Iterator[dict[str, Any]], right: Iterator[dict[str, Any]]
) -> Iterator[tuple[dict[str, Any] | None, dict[str, Any] | None]]:
    while True:
        a, b = next(left, None), next(right, None)
        if a is None and b is None:
            return
        yield a, b


def kvsim_against_golden(golden: GoldenFrames, overrides: tuple[str, ...] = ()) -> Trajectory:
    """kvsim's fork mode on the recording's own scenario record, layout,
    engine and clock (``overrides``: ``--set`` items on top, e.g. a patch
    turned off)."""
    from sim.analysis.runs import scenario_workload
    from sim.config import apply_overrides
    from sim.conformance.fork_conformance import ClockTape, kvsim_trajectory
    from sim.paths import PROJECT_ROOT
    from sim.scenario import scenario_from_record

    header = golden.header
    data = dict(header["scenario"])
    data["model"], data["base_dir"] = str(PROJECT_ROOT / data["model"]), str(PROJECT_ROOT / data["base_dir"])
    scenario = scenario_from_record(apply_overrides(data, list(overrides)), "golden frames")
    workload = scenario_workload(scenario)
    return kvsim_trajectory(
        scenario,
        header["layout"],
        workload.requests,
        ClockTape(values=header["clock_tape"]),
        workload.follow_ups_until_s,
        header["engine"],
    )


COVERAGE_COLUMNS = (
    "recording",
    "engine",
    "steps",
    "admitted",
    "preempted",
    "resumed",
    "finished",
    "hit tokens",
    "max graces",
    "max waiter pins",
    "max retained",
    "max fenced blocks",
)


def coverage_row(name: str, golden: GoldenFrames) -> tuple[Any, ...]:
    """What the fork's frames of one recording show at work (for the table
    in ``docs/fork-patches.md``)."""
    steps = golden.steps
    fork = [dict(step["fork_state"]) for step in steps]
    return (
        name,
        golden.header["engine"],
        len(steps),
        sum(len(s["admitted"]) for s in steps),
        sum(len(s["preempted"]) for s in steps),
        sum(len(s["resumed"]) for s in steps),
        sum(len(s["finished"]) for s in steps),
        sum(s["prefix_cache_hits_tokens"] for s in steps),
        max(len(f["graces"]) for f in fork),
        max(len(f["pinned_waiters"]) for f in fork),
        max(max(f["retained"], default=0) for f in fork),
        max(f["num_deferred_frees"] for f in fork),
    )


def coverage_table(folder: Path) -> str:
    """One markdown row per recording in ``folder``."""
    rows = [COVERAGE_COLUMNS, tuple("---" for _ in COVERAGE_COLUMNS)]
    for path in sorted(folder.glob("*.jsonl.gz")):
        rows.append(coverage_row(path.name.removesuffix(".jsonl.gz"), read_golden(path)))
    return "\n".join(
        "| " + " | ".join(f"{v:,}" if isinstance(v, int) else str(v) for v in row) + " |" for row in rows
    )
