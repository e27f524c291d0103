"""Shared builders for the value tests (tests/test_values_*.py): hand-made
frames whose expected figures a test derives with numpy, not with the code
under test. One module so the imports can be re-pointed in one place."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd


def hand_run(layouts: dict[str, dict[str, Any]]) -> dict[str, pd.DataFrame]:
    """A run's frames from per-layout hand values: ``summary`` (a dict of
    summary columns), ``requests`` (a dict of request columns, one list per
    column) and ``samples`` (``time_s`` and gauge columns)."""
    frames: dict[str, list[pd.DataFrame]] = {"summary": [], "requests": [], "samples": []}
    for layout, parts in layouts.items():
        frames["summary"].append(pd.DataFrame([{**parts.get("summary", {}), "layout": layout}]))
        for name in ("requests", "samples"):
            if name in parts:
                frames[name].append(pd.DataFrame(parts[name]).assign(layout=layout))
    return {
        name: pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
        for name, parts in frames.items()
    }


def numpy_percentile(values: list[float], q: float) -> float:
    """The oracle: numpy's default (linear) percentile of the values given."""
    return float(np.percentile(np.asarray(values, float), q))


def compared_step(**changes: Any) -> Any:
    """A conformance ``ComparedStep`` with every field at a neutral value but
    those given."""
    from sim.conformance.backends import ComparedStep

    fields: dict[str, Any] = {
        "scheduled_tokens": (),
        "admitted": (),
        "resumed": (),
        "preempted": (),
        "finished": (),
        "running": (),
        "waiting": (),
        "num_free_blocks": 0,
        "prefix_cache_queries_tokens": 0,
        "prefix_cache_hits_tokens": 0,
    }
    return ComparedStep(**{**fields, **changes})


def trajectory(name: str, free_blocks: list[int], stalled: bool = False) -> Any:
    """A hand trajectory: one step per entry, told apart by its free blocks."""
    from sim.conformance.driver import Trajectory

    steps = tuple(compared_step(num_free_blocks=n) for n in free_blocks)
    return Trajectory(backend=name, steps=steps, times_s=tuple(range(len(steps))), stalled=stalled)
