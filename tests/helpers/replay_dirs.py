"""Stand-in replay directories for the validate and calibrate tests: a
``kvsim run`` result relabelled as a replay (source "replay", no steps
frame, as ``kvsim replay`` writes), so these tests need no server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from sim.analysis.runs import RunResult
from sim.results import write_frame, write_json, write_results

REPLAY_FRAMES = ("requests", "samples", "summary")


def write_sim_dir(out_dir: Path, result: RunResult, scenario: dict[str, Any]) -> Path:
    write_results(out_dir, result.frames(), scenario)
    return out_dir


def write_replay_dir(
    out_dir: Path, result: RunResult, scenario: dict[str, Any], layouts: tuple[str, ...] = ("off", "on")
) -> Path:
    """``result``'s frames of ``layouts`` as a replay of ``scenario`` (the
    scenario the replay ran, which need not be the one that made the frames:
    a rig whose step times differ from the model's)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    frames = result.frames()
    for name in REPLAY_FRAMES:
        frame = frames[name][frames[name]["layout"].isin(layouts)]
        write_frame(out_dir / f"{name}.parquet", relabel(frame))
    write_json(out_dir / "scenario.json", scenario)
    manifest = {"frames": [f"{name}.parquet" for name in REPLAY_FRAMES], "scenario": scenario.get("name")}
    write_json(out_dir / "manifest.json", manifest)
    return out_dir


def relabel(frame: pd.DataFrame) -> pd.DataFrame:
    """A replay measures no engine internals: admission times, per-request
    preemptions and prefix hits are NaN there."""
    frame = frame.assign(source="replay")
    for column in ("admitted_s", "queue_s", "num_preemptions", "prefix_hit_tokens"):
        if column in frame and "request_id" in frame:
            frame[column] = float("nan")
    return frame


# The step-time coefficients calibration starts from, and a rig that differs.
DEFAULTS = {"compute_efficiency": 0.74, "memory_efficiency": 0.78}  # docs/step-time-model.md
# The rig: prefill 30 % slower than modelled, decode 25 % slower.
RIG = {"compute_efficiency": 0.74 * 0.7, "memory_efficiency": 0.78 * 0.75}
