"""pandas frames from a simulation's recording, and metrics as pure
functions of frames. Column names carry units and follow vLLM's metric
names where one exists (``num_requests_running``, ``kv_cache_usage_perc``,
``num_preemptions``, ``prefix_cache_hits``). No twin in vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from sim.metrics import CUMULATIVE, GAIN_METRICS, Frame, columns

if TYPE_CHECKING:  # frames only read a recording: no engine (nor vLLM) at import
    from sim.engine import Recording


# The columns of a step row (``Simulation._record_step``): a run with no
# step (every request rejected, or a horizon before the first arrival) still
# has them, so figures and summaries read the same columns from every run.
STEP_COLUMNS = (
    "step",
    "time_s",
    "step_time_s",
    "num_requests_running",
    "num_requests_waiting",
    "num_scheduled_requests",
    "num_scheduled_tokens",
    "num_prefill_tokens",
    "num_decode_tokens",
    "num_admitted",
    "num_resumed",
    "num_preemptions",
    "num_finished",
    "num_generation_tokens",
    "num_draft_tokens",
    "num_accepted_tokens",
    "num_free_blocks",
    "num_deferred_blocks",
    "kv_cache_usage_perc",
    "prefix_cache_queries_tokens",
    "prefix_cache_hits_tokens",
    "prefix_cache_evicted_blocks",
    "num_retained_checkpoints",
)


def steps_frame(recording: Recording) -> pd.DataFrame:
    """One row per engine step, gauges as after the step, plus running totals."""
    frame = pd.DataFrame(recording.steps.to_dict())
    if frame.empty:  # a run with no step: numeric columns, so summaries and plots read it
        frame = frame.astype("float64")
    for column, total in CUMULATIVE.items():
        frame[total] = frame[column].cumsum() if len(frame) else pd.Series(dtype="int64")
    frame.insert(0, "layout", recording.layout)
    frame.insert(0, "scenario", recording.scenario)
    return frame


def samples_frame(recording: Recording) -> pd.DataFrame:
    """The gauges at a fixed simulated-time interval (time-uniform curves)."""
    frame = pd.DataFrame(recording.samples.to_dict())
    frame.insert(0, "layout", recording.layout)
    frame.insert(0, "scenario", recording.scenario)
    return frame


def requests_frame(recording: Recording) -> pd.DataFrame:
    """One row per arrival: its fate and its latencies."""
    frame = pd.DataFrame.from_records(list(recording.requests.values()))
    if frame.empty:
        return frame
    frame["admitted"] = frame["admitted_s"].notna()
    frame["finished"] = frame["finished_s"].notna()
    frame["ttft_s"] = frame["first_token_s"] - frame["arrival_s"]
    frame["queue_s"] = frame["admitted_s"] - frame["arrival_s"]
    frame["e2e_s"] = frame["finished_s"] - frame["arrival_s"]
    frame.insert(0, "layout", recording.layout)
    frame.insert(0, "scenario", recording.scenario)
    return frame


def time_weighted(series: pd.Series) -> float:
    """Mean of a step series indexed by time: each value holds to the next."""
    if len(series) < 2:
        return float(series.mean()) if len(series) else 0.0
    durations = np.diff(series.index.to_numpy(float))
    if durations.sum() <= 0:
        return float(series.mean())
    return float(np.dot(series.to_numpy(float)[:-1], durations) / durations.sum())


def time_weighted_mean(steps: pd.DataFrame, column: str) -> float:
    """Mean of a gauge over time: each step's value holds until the next."""
    if steps.empty:  # a run that scheduled nothing has no gauge columns
        return 0.0
    return time_weighted(steps.set_index("time_s")[column])


def _percentile(values: pd.Series, q: float) -> float:
    values = values.dropna()
    return float(np.percentile(values, q)) if len(values) else float("nan")


def summarise(steps: pd.DataFrame, requests: pd.DataFrame, recording: Recording) -> dict[str, Any]:
    """The run in one row: admissions, concurrency, preemptions, latency."""
    duration = float(recording.end_time_s)
    finished = requests[requests["finished"]] if len(requests) else requests
    queries = int(steps["prefix_cache_queries_tokens"].sum()) if len(steps) else 0
    hits = int(steps["prefix_cache_hits_tokens"].sum()) if len(steps) else 0
    running_now = int(steps["num_requests_running"].iloc[-1]) if len(steps) else 0
    waiting_now = int(steps["num_requests_waiting"].iloc[-1]) if len(steps) else 0
    generated = int(steps["num_generation_tokens"].sum()) if len(steps) else 0
    values = {
        "scenario": recording.scenario,
        "layout": recording.layout,
        "kv_cache_tokens": recording.plan["kv_cache_tokens"],
        "num_gpu_blocks": recording.plan["num_blocks"],
        "num_requests": len(requests),
        "num_rejected": int(requests["rejected"].sum()) if len(requests) else 0,
        "num_admitted": int(requests["admitted"].sum()) if len(requests) else 0,
        "num_finished": int(requests["finished"].sum()) if len(requests) else 0,
        "num_running_at_end": running_now,
        "num_waiting_at_end": waiting_now,
        "peak_concurrency": int(steps["num_requests_running"].max()) if len(steps) else 0,
        "mean_concurrency": time_weighted_mean(steps, "num_requests_running"),
        "mean_waiting": time_weighted_mean(steps, "num_requests_waiting"),
        "num_preemptions": int(steps["num_preemptions"].sum()) if len(steps) else 0,
        "prefix_cache_queries_tokens": queries,
        "prefix_cache_hits_tokens": hits,
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "prefix_cache_evicted_blocks": int(steps["prefix_cache_evicted_blocks"].sum()) if len(steps) else 0,
        "num_steps": len(steps),
        "stalled": recording.stalled,
        "samples_truncated": recording.samples_truncated,
        "duration_s": duration,
        "output_throughput_tokens_per_s": generated / duration if duration else 0.0,
        "ttft_p50_s": _percentile(finished["ttft_s"], 50) if len(finished) else float("nan"),
        "ttft_p90_s": _percentile(finished["ttft_s"], 90) if len(finished) else float("nan"),
        "ttft_p99_s": _percentile(finished["ttft_s"], 99) if len(finished) else float("nan"),
        "e2e_mean_s": float(finished["e2e_s"].mean()) if len(finished) else float("nan"),
    }
    return in_registry_order("summary", values)


def in_registry_order(frame: Frame, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` in the registry's column order; a column computed but not
    registered, or registered but not computed, is a bug here."""
    names = columns(frame)
    assert set(values) == set(names), (
        f"{frame}: unregistered {set(values) - set(names)}, missing {set(names) - set(values)}"
    )
    return {name: values[name] for name in names}


def frames(recording: Recording) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, dict[str, Any]]:
    steps = steps_frame(recording)
    requests = requests_frame(recording)
    return steps, requests, samples_frame(recording), summarise(steps, requests, recording)


def comparison_table(summary: pd.DataFrame) -> pd.DataFrame:
    """Metrics by layout side by side, with the new layout's gain."""
    table = summary.set_index("layout")[list(GAIN_METRICS)].T
    if {"off", "on"} <= set(table.columns):
        table["gain"] = table["on"] - table["off"]
        with np.errstate(divide="ignore", invalid="ignore"):
            table["gain_perc"] = np.where(table["off"] != 0, 100 * table["gain"] / table["off"], np.nan)
    return table
