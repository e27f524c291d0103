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


# The ``source`` column: frames from ``kvsim run`` say "sim", frames from
# ``kvsim replay`` (a live server) say "replay"; always the last column.
SIM_SOURCE = "sim"
REPLAY_SOURCE = "replay"


def _label(frame: pd.DataFrame, scenario: str, layout: str, source: str = SIM_SOURCE) -> pd.DataFrame:
    """Scenario and layout first, source last: the columns every frame shares."""
    frame.insert(0, "layout", layout)
    frame.insert(0, "scenario", scenario)
    frame["source"] = source
    return frame


def steps_frame(recording: Recording) -> pd.DataFrame:
    """One row per engine step, gauges as after the step, plus running totals."""
    frame = pd.DataFrame(recording.steps.to_dict())
    if frame.empty:  # a run with no step: numeric columns, so summaries and plots read it
        frame = frame.astype("float64")
    for column, total in CUMULATIVE.items():
        frame[total] = frame[column].cumsum() if len(frame) else pd.Series(dtype="int64")
    return _label(frame, recording.scenario, recording.layout)


def samples_frame(recording: Recording) -> pd.DataFrame:
    """The gauges at a fixed simulated-time interval (time-uniform curves)."""
    frame = pd.DataFrame(recording.samples.to_dict())
    return _label(frame, recording.scenario, recording.layout)


def requests_frame(recording: Recording) -> pd.DataFrame:
    """One row per arrival: its fate and its latencies."""
    frame = pd.DataFrame.from_records(list(recording.requests.values()))
    if frame.empty:
        return frame
    frame["admitted"] = frame["admitted_s"].notna()
    add_latencies(frame)
    return _label(frame, recording.scenario, recording.layout)


def add_latencies(frame: pd.DataFrame) -> None:
    """``finished``, TTFT, queueing and end-to-end latency from the stamps."""
    frame["finished"] = frame["finished_s"].notna()
    frame["ttft_s"] = frame["first_token_s"] - frame["arrival_s"]
    frame["queue_s"] = frame["admitted_s"] - frame["arrival_s"]
    frame["e2e_s"] = frame["finished_s"] - frame["arrival_s"]


def time_weighted(series: pd.Series) -> float:
    """Mean of a step series indexed by time: each value holds to the next."""
    if len(series) < 2:
        return float(series.mean()) if len(series) else 0.0
    durations = np.diff(series.index.to_numpy(float))
    if durations.sum() <= 0:
        return float(series.mean())
    return float(np.dot(series.to_numpy(float)[:-1], durations) / durations.sum())


def step_values(
    times_s: np.ndarray, values: np.ndarray, grid_s: np.ndarray, before: float = np.nan
) -> np.ndarray:
    """A step series read at ``grid_s``: the last value at or before each
    grid time (``before`` where no step has ended yet). ``times_s`` ascend.

    >>> times_s, values = np.array([1.0, 3.0]), np.array([5, 7])
    >>> step_values(times_s, values, np.array([0.0, 1.0, 2.0, 3.0, 9.0]), before=0)
    array([0., 5., 5., 7., 7.])
    """
    index = np.searchsorted(times_s, grid_s, side="right") - 1
    if not len(values):
        return np.full(len(grid_s), before, dtype=float)
    picked = np.asarray(values, dtype=float)[np.clip(index, 0, None)]
    return np.where(index >= 0, picked, before)


def time_weighted_mean(steps: pd.DataFrame, column: str) -> float:
    """Mean of a gauge over time: each step's value holds until the next."""
    if steps.empty:  # a run that scheduled nothing has no gauge columns
        return 0.0
    return time_weighted(steps.set_index("time_s")[column])


def _percentile(values: pd.Series, q: float) -> float:
    values = values.dropna()
    return float(np.percentile(values, q)) if len(values) else float("nan")


def request_counts(requests: pd.DataFrame) -> dict[str, Any]:
    """Counts from the requests frame (the same for a simulation and a replay)."""
    return {
        "num_requests": len(requests),
        "num_rejected": int(requests["rejected"].sum()) if len(requests) else 0,
        "num_admitted": int(requests["admitted"].sum()) if len(requests) else 0,
        "num_finished": int(requests["finished"].sum()) if len(requests) else 0,
    }


def latency_percentiles(requests: pd.DataFrame) -> dict[str, float]:
    """TTFT percentiles and mean end-to-end latency over finished requests."""
    finished = requests[requests["finished"]] if len(requests) else requests
    if not len(finished):
        return dict.fromkeys(("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "e2e_mean_s"), float("nan"))
    return {
        "ttft_p50_s": _percentile(finished["ttft_s"], 50),
        "ttft_p90_s": _percentile(finished["ttft_s"], 90),
        "ttft_p99_s": _percentile(finished["ttft_s"], 99),
        "e2e_mean_s": float(finished["e2e_s"].mean()),
    }


def followup_figures(requests: pd.DataFrame) -> dict[str, float]:
    """The fork's agent bench figures over follow-up turns (``turn`` >= 1):
    TTFT of the finished ones, and reuse: cached over prompt tokens summed
    over the admitted ones (a first turn counts in neither). NaN where no
    follow-up qualifies."""
    nan = float("nan")
    follow_ups = requests[requests["turn"] > 0] if len(requests) else requests
    finished = follow_ups[follow_ups["finished"]] if len(follow_ups) else follow_ups
    admitted = follow_ups[follow_ups["admitted"]] if len(follow_ups) else follow_ups
    reused = float(admitted["prefix_hit_tokens"].sum()) if len(admitted) else 0.0
    prompt = float(admitted["prompt_tokens"].sum()) if len(admitted) else 0.0
    return {
        "num_followups": len(follow_ups),
        "followup_ttft_p50_s": _percentile(finished["ttft_s"], 50) if len(finished) else nan,
        "followup_ttft_p90_s": _percentile(finished["ttft_s"], 90) if len(finished) else nan,
        "followup_reused_tokens": reused,
        "followup_prefix_hit_rate": reused / prompt if prompt else nan,
    }


def summarise(steps: pd.DataFrame, requests: pd.DataFrame, recording: Recording) -> dict[str, Any]:
    """The run in one row: admissions, concurrency, preemptions, latency."""
    duration = float(recording.end_time_s)
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
        **request_counts(requests),
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
        **latency_percentiles(requests),
        "peak_kv_cache_usage_perc": float(steps["kv_cache_usage_perc"].max()) if len(steps) else 0.0,
        **followup_figures(requests),
        "source": SIM_SOURCE,
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


def counter_increase(samples: pd.DataFrame, column: str) -> float:
    """How much a cumulative counter rose over the samples (NaN when the
    server never reported it): last value minus first, so a server that had
    served before the replay started does not count its past."""
    values = samples[column].dropna() if column in samples else pd.Series(dtype=float)
    return float(values.iloc[-1] - values.iloc[0]) if len(values) else float("nan")


def _gauge_stat(samples: pd.DataFrame, column: str, stat: str) -> float:
    values = samples.dropna(subset=[column]) if column in samples else samples.iloc[0:0]
    if not len(values):
        return float("nan")
    if stat == "max":
        return float(values[column].max())
    if stat == "last":
        return float(values[column].iloc[-1])
    return time_weighted(values.set_index("time_s")[column])


def summarise_replay(
    requests: pd.DataFrame,
    samples: pd.DataFrame,
    *,
    scenario: str,
    layout: str,
    kv_cache_tokens: float,
    num_gpu_blocks: float,
    duration_s: float,
) -> dict[str, Any]:
    """A replay in one row with ``summarise``'s keys: the request metrics as
    the simulator's, the gauges and counters from the scraped ``/metrics``
    samples, NaN where a metric needs the engine's steps (a live server does
    not expose them) or the server lacked the metric."""
    nan = float("nan")
    queries = counter_increase(samples, "prefix_cache_queries_total_tokens")
    hits = counter_increase(samples, "prefix_cache_hits_total_tokens")
    generated = float(requests["generated_tokens"].sum()) if len(requests) else 0.0
    return {
        "scenario": scenario,
        "layout": layout,
        "kv_cache_tokens": kv_cache_tokens,
        "num_gpu_blocks": num_gpu_blocks,
        **request_counts(requests),
        "num_running_at_end": _gauge_stat(samples, "num_requests_running", "last"),
        "num_waiting_at_end": _gauge_stat(samples, "num_requests_waiting", "last"),
        "peak_concurrency": _gauge_stat(samples, "num_requests_running", "max"),
        "mean_concurrency": _gauge_stat(samples, "num_requests_running", "mean"),
        "mean_waiting": _gauge_stat(samples, "num_requests_waiting", "mean"),
        "num_preemptions": counter_increase(samples, "num_preemptions_total"),
        "prefix_cache_queries_tokens": queries,
        "prefix_cache_hits_tokens": hits,
        "prefix_cache_hit_rate": hits / queries if queries else nan,
        "prefix_cache_evicted_blocks": nan,
        "num_steps": nan,
        "stalled": nan,
        "duration_s": duration_s,
        "output_throughput_tokens_per_s": generated / duration_s if duration_s else 0.0,
        **latency_percentiles(requests),
        "peak_kv_cache_usage_perc": _gauge_stat(samples, "kv_cache_usage_perc", "max"),
        **followup_figures(requests),
        "source": REPLAY_SOURCE,
    }


def label_replay_frame(frame: pd.DataFrame, scenario: str, layout: str) -> pd.DataFrame:
    """Scenario and layout first, ``source`` = replay last."""
    return _label(frame, scenario, layout, REPLAY_SOURCE)


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
