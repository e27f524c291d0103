"""Simulated against measured: one run of ``kvsim run`` (source "sim") and
one of ``kvsim replay`` (source "replay") of the same scenario, compared per
layout. Pure functions of the two runs' frames; no twin in vLLM (the anchors
are BLIS's observe/replay/calibrate loop and SGLang's simulator validation
tables).

Every metric is computed the same way on both sides, from frames both sides
write: counts, preemptions, prefix hit rate and throughput from ``summary``;
latency percentiles over finished requests from ``requests``; peak and mean
running from ``samples`` (a replay only sees the server through its
``/metrics`` scrape, so the simulator is read through the same instrument).
A metric one side cannot measure is NaN there and its error NaN: shown as
"-", never an error. ``error`` is simulated minus measured; ``error_perc``
is that relative to the measurement (NaN where the measurement is 0).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pandas as pd

from sim.analysis.frames import time_weighted
from sim.analysis.replayed_arrivals import arrivals_and_bursts, burst_times

SOURCE_SIM = "sim"
SOURCE_REPLAY = "replay"

# (metric, summary column): read straight from the run's summary row.
SUMMARY_METRICS = (
    ("num_admitted", "num_admitted"),
    ("num_finished", "num_finished"),
    ("num_preemptions", "num_preemptions"),
    ("prefix_cache_hit_rate", "prefix_cache_hit_rate"),
    ("output_throughput_tokens_per_s", "output_throughput_tokens_per_s"),
)
# (metric, requests column, percentile) over finished requests.
LATENCY_METRICS = (
    ("ttft_p50_s", "ttft_s", 50),
    ("ttft_p90_s", "ttft_s", 90),
    ("ttft_p99_s", "ttft_s", 99),
    ("e2e_p50_s", "e2e_s", 50),
    ("e2e_p99_s", "e2e_s", 99),
)
# Per burst of requests that reached the server within the reorder window
# of one another (``sim.analysis.replayed_arrivals``): its last first token
# and its last finish from its first arrival, averaged over bursts. A
# reorder inside a burst moves neither; a request alone is its own burst.
BURST_METRICS = ("burst_last_ttft_mean_s", "burst_last_e2e_mean_s")
# What a reorder inside a burst moves: compared only where no request
# reached the server within the reorder window of another.
REORDER_SENSITIVE = ("ttft_p50_s", "ttft_p90_s", "e2e_p50_s")
METRICS = (
    "num_admitted",
    "num_finished",
    "peak_running",
    "mean_running",
    "num_preemptions",
    "prefix_cache_hit_rate",
    *(name for name, _, _ in LATENCY_METRICS),
    *BURST_METRICS,
    "output_throughput_tokens_per_s",
)
# (curve, samples column): the gauges compared over time.
CURVES = (
    ("running", "num_requests_running"),
    ("kv_cache_usage", "kv_cache_usage_perc"),
)


def with_source(frame: pd.DataFrame, default: str = SOURCE_SIM) -> pd.DataFrame:
    """``frame`` with a ``source`` column: a results directory written before
    kvsim labelled its frames holds simulated ones."""
    if "source" in frame.columns:
        return frame
    return frame.assign(source=default)


def layouts_in_both(sim: dict[str, pd.DataFrame], replay: dict[str, pd.DataFrame]) -> list[str]:
    """Layouts both runs summarised, off before on."""
    both = set(sim["summary"]["layout"]) & set(replay["summary"]["layout"])
    return sorted(both, key=lambda name: (name != "off", name != "on", name))


def _of_layout(frame: pd.DataFrame, layout: str) -> pd.DataFrame:
    if frame.empty or "layout" not in frame:
        return frame.iloc[0:0]
    return frame[frame["layout"] == layout]


def _percentile(values: pd.Series, q: float) -> float:
    values = pd.to_numeric(values, errors="coerce").dropna()
    return float(np.percentile(values, q)) if len(values) else float("nan")


def _summary_value(summary: pd.DataFrame, column: str) -> float:
    if summary.empty or column not in summary:
        return float("nan")
    value = pd.to_numeric(summary[column], errors="coerce").iloc[0]
    return float(value)


def _finished(requests: pd.DataFrame) -> pd.DataFrame:
    if requests.empty or "finished_s" not in requests:
        return requests.iloc[0:0]
    return requests[requests["finished_s"].notna()]


def _running_metrics(samples: pd.DataFrame, summary: pd.DataFrame) -> tuple[float, float]:
    """Peak and time-weighted mean of the running gauge as sampled; the
    summary's step-based values when the run recorded no samples."""
    if samples.empty or "num_requests_running" not in samples:
        return _summary_value(summary, "peak_concurrency"), _summary_value(summary, "mean_concurrency")
    series = samples.sort_values("time_s").set_index("time_s")["num_requests_running"].astype(float)
    return float(series.max()), time_weighted(series)


def run_metrics(
    frames: dict[str, pd.DataFrame], layout: str, burst_of: pd.Series | None = None
) -> dict[str, float]:
    """The validation metrics of one layout of one run (NaN where unknown);
    ``burst_of``: (layout, request id) to its burst, as the replay made them
    (none: the bursts' figures are unknown)."""
    summary = _of_layout(frames["summary"], layout)
    requests = _of_layout(frames["requests"], layout)
    samples = _of_layout(frames["samples"], layout)
    values = {metric: _summary_value(summary, column) for metric, column in SUMMARY_METRICS}
    values["peak_running"], values["mean_running"] = _running_metrics(samples, summary)
    finished = _finished(requests)
    for metric, column, q in LATENCY_METRICS:
        values[metric] = _percentile(finished[column], q) if column in finished else float("nan")
    values.update(_burst_metrics(finished, burst_of))
    return {metric: values[metric] for metric in METRICS}


def _burst_metrics(finished: pd.DataFrame, burst_of: pd.Series | None) -> dict[str, float]:
    if burst_of is None or burst_of.empty or finished.empty or "arrival_s" not in finished:
        return dict.fromkeys(BURST_METRICS, float("nan"))
    times = burst_times(finished, burst_of)
    return dict(
        zip(BURST_METRICS, (float(times["ttft_s"].mean()), float(times["e2e_s"].mean())), strict=True)
    )


def replay_bursts(
    replay: dict[str, pd.DataFrame], layout: str, window_s: float
) -> tuple[pd.Series, pd.DataFrame]:
    """The replay's requests of ``layout`` grouped in bursts (by the
    arrivals it made: the server's, else the send times), and those
    requests with ``arrival_s`` the arrival it made."""
    requests = _of_layout(replay["requests"], layout)
    if requests.empty or not {"request_id", "arrival_s"} <= set(requests.columns):
        return pd.Series(dtype=object), requests
    arrival, burst, _ = arrivals_and_bursts(requests, window_s)
    ids = requests["request_id"].astype(str)
    index = pd.MultiIndex.from_product([[layout], burst.index])
    arrived = requests[ids.isin(arrival.index)].assign(arrival_s=ids.map(arrival))
    return pd.Series(burst.to_numpy(), index=index), arrived


def dense_share(burst_of: pd.Series) -> float:
    """The share of requests in a burst of more than one."""
    if burst_of.empty:
        return 0.0
    return float(burst_of.map(burst_of.value_counts()).gt(1).mean())


def metric_table(
    sim: dict[str, pd.DataFrame], replay: dict[str, pd.DataFrame], reorder_window_s: float = 0.0
) -> pd.DataFrame:
    """One row per (layout, metric): sim, replay, error, error_perc, and
    ``comparable``: False for a reorder-sensitive metric (its error NaN)
    where requests reached the server within ``reorder_window_s`` of one
    another (the simulation ran them in the trace's order)."""
    rows = []
    for layout in layouts_in_both(sim, replay):
        burst_of, arrived = replay_bursts(replay, layout, reorder_window_s)
        simulated = run_metrics(sim, layout, burst_of)
        measured = run_metrics({**replay, "requests": arrived}, layout, burst_of)
        dense = dense_share(burst_of) > 0
        for metric in METRICS:
            comparable = not (dense and metric in REORDER_SENSITIVE)
            rows.append(_compared(layout, metric, simulated[metric], measured[metric], comparable))
    columns = ["layout", "metric", "sim", "replay", "error", "error_perc", "comparable"]
    return pd.DataFrame(rows, columns=columns)


def _compared(
    layout: str, metric: str, simulated: float, measured: float, comparable: bool = True
) -> dict[str, Any]:
    error = simulated - measured if comparable else float("nan")
    relative = 100 * error / measured if measured == measured and measured != 0 else float("nan")
    return {
        "layout": layout,
        "metric": metric,
        "sim": simulated,
        "replay": measured,
        "error": error,
        "error_perc": relative,
        "comparable": comparable,
    }


def curve_error(sim_samples: pd.DataFrame, replay_samples: pd.DataFrame, column: str) -> dict[str, float]:
    """RMSE and MAPE of a sampled gauge, simulated against measured, on a
    common time grid.

    Samples are point readings (a scrape), so between readings the gauge is
    read by linear interpolation, and outside a run's readings as 0: a run
    stops reading when its last request has finished (or at the scenario's
    ``max_time_s``, which both sides share), so a run that finishes later is
    charged for the time it still ran. The grid steps at the simulation's
    sample interval from the earlier start to the later end. MAPE is over the grid points
    where the measurement is not 0 (a percentage of 0 means nothing); NaN
    when there are none.

    >>> sim = pd.DataFrame({"time_s": [0.0, 1, 2, 3, 4], "g": [0, 2, 4, 6, 8]})
    >>> replay = pd.DataFrame({"time_s": [0.0, 1, 2, 3, 4], "g": [0, 0, 2, 4, 6]})
    >>> {k: round(v, 4) for k, v in curve_error(sim, replay, "g").items()}
    {'rmse': 1.7889, 'mape_perc': 61.1111, 'num_points': 5, 'start_s': 0.0, 'end_s': 4.0}
    """
    grid = common_grid(sim_samples, replay_samples, column)
    if not len(grid):
        return {"rmse": np.nan, "mape_perc": np.nan, "num_points": 0, "start_s": np.nan, "end_s": np.nan}
    simulated = _read_at(sim_samples, column, grid)
    measured = _read_at(replay_samples, column, grid)
    error = simulated - measured
    nonzero = measured != 0
    mape = 100 * float(np.mean(np.abs(error[nonzero] / measured[nonzero]))) if nonzero.any() else np.nan
    return {
        "rmse": float(np.sqrt(np.mean(error**2))),
        "mape_perc": mape,
        "num_points": len(grid),
        "start_s": float(grid[0]),
        "end_s": float(grid[-1]),
    }


def _readings(samples: pd.DataFrame, column: str) -> pd.DataFrame:
    if samples.empty or column not in samples:
        return pd.DataFrame({"time_s": [], column: []})
    rows = samples[["time_s", column]].apply(pd.to_numeric, errors="coerce").dropna()
    return rows.sort_values("time_s", kind="stable")


def common_grid(sim_samples: pd.DataFrame, replay_samples: pd.DataFrame, column: str) -> np.ndarray:
    """Times from the earlier start to the later end of the two runs'
    readings, at the simulation's sample interval (its median spacing)."""
    sim_rows, replay_rows = _readings(sim_samples, column), _readings(replay_samples, column)
    if len(sim_rows) < 2 or len(replay_rows) < 1:
        return np.array([])
    start_s = min(sim_rows["time_s"].iloc[0], replay_rows["time_s"].iloc[0])
    end_s = max(sim_rows["time_s"].iloc[-1], replay_rows["time_s"].iloc[-1])
    interval_s = float(np.median(np.diff(sim_rows["time_s"].to_numpy(float))))
    if end_s < start_s or interval_s <= 0:
        return np.array([])
    # A hair past the end so an end that is a whole number of intervals is kept.
    return start_s + interval_s * np.arange(int(np.floor((end_s - start_s) / interval_s + 1e-9)) + 1)


def _read_at(samples: pd.DataFrame, column: str, grid_s: np.ndarray) -> np.ndarray:
    rows = _readings(samples, column)
    return np.interp(
        grid_s, rows["time_s"].to_numpy(float), rows[column].to_numpy(float), left=0.0, right=0.0
    )


def curve_table(sim: dict[str, pd.DataFrame], replay: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """One row per (layout, curve): RMSE, MAPE and the grid compared."""
    rows = []
    for layout in layouts_in_both(sim, replay):
        sim_samples, replay_samples = (
            _of_layout(sim["samples"], layout),
            _of_layout(replay["samples"], layout),
        )
        for curve, column in CURVES:
            rows.append(
                {"layout": layout, "curve": curve, **curve_error(sim_samples, replay_samples, column)}
            )
    columns = ["layout", "curve", "rmse", "mape_perc", "num_points", "start_s", "end_s"]
    return pd.DataFrame(rows, columns=columns)


def validation_report(
    sim: dict[str, pd.DataFrame], replay: dict[str, pd.DataFrame], reorder_window_s: float = 0.0
) -> dict[str, Any]:
    """Both tables as plain records (NaN as None: valid JSON), and per
    layout the share of requests that came in bursts."""
    layouts = layouts_in_both(sim, replay)
    return {
        "layouts": layouts,
        "reorder_window_s": reorder_window_s,
        "burst_share": {
            layout: dense_share(replay_bursts(replay, layout, reorder_window_s)[0]) for layout in layouts
        },
        "metrics": _records(metric_table(sim, replay, reorder_window_s)),
        "curves": _records(curve_table(sim, replay)),
    }


def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    return list(json.loads(frame.to_json(orient="records", double_precision=15)))
