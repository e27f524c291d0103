"""``sim.analysis.validate`` against hand frames: every figure of the
validate table derived by hand or by numpy (the oracle), never by the code
under test. Each column, each request filter and each denominator is one
that a swapped column, an unfinished request let in or an error relative to
the simulation would change."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from helpers.values import hand_run, numpy_percentile

from sim.analysis import validate as v

NAN = float("nan")
# Finished requests' times, and two unfinished ones whose huge TTFTs would
# move every percentile if they were counted.
SIM_TTFT_S = [0.10, 0.40, 0.20, 0.80, 0.30, 1.60, 0.50, 0.70, 3.20, 0.90]
SIM_E2E_S = [2.0, 3.5, 2.5, 6.0, 3.0, 9.0, 4.0, 5.0, 12.0, 7.0]
REPLAY_TTFT_S = [0.15, 0.35, 0.25, 0.95, 0.45, 1.20, 0.55, 0.65, 2.40, 1.05]
REPLAY_E2E_S = [2.2, 3.1, 2.9, 6.5, 3.3, 8.0, 4.4, 5.5, 10.0, 7.7]


def _requests(ttft_s: list[float], e2e_s: list[float]) -> dict[str, list]:
    finished = [1.0 + e for e in e2e_s]
    return {
        "request_id": [str(i) for i in range(len(ttft_s) + 2)],
        "arrival_s": [1.0] * (len(ttft_s) + 2),
        "first_token_s": [1.0 + t for t in [*ttft_s, 50.0, 60.0]],
        "ttft_s": [*ttft_s, 50.0, 60.0],
        "e2e_s": [*e2e_s, NAN, NAN],
        "finished_s": [*finished, NAN, NAN],
    }


SIM = {
    "summary": {
        "num_admitted": 12,
        "num_finished": 10,
        "num_preemptions": 3,
        "prefix_cache_hit_rate": 0.25,
        "output_throughput_tokens_per_s": 120.0,
        "peak_concurrency": 99,
        "mean_concurrency": 98.0,
    },
    "requests": _requests(SIM_TTFT_S, SIM_E2E_S),
    # Readings at uneven times: the gauge holds 2 for 1 s, 4 for 2 s, 1 for 3 s.
    "samples": {"time_s": [0.0, 1.0, 3.0, 6.0], "num_requests_running": [2, 4, 1, 0]},
}
REPLAY = {
    "summary": {
        "num_admitted": 11,
        "num_finished": 10,
        "num_preemptions": 4,
        "prefix_cache_hit_rate": 0.20,
        "output_throughput_tokens_per_s": 100.0,
        "peak_concurrency": 97,
        "mean_concurrency": 96.0,
    },
    "requests": _requests(REPLAY_TTFT_S, REPLAY_E2E_S),
    # 3 for 2 s, 5 for 2 s, 2 for 4 s.
    "samples": {"time_s": [0.0, 2.0, 4.0, 8.0], "num_requests_running": [3, 5, 2, 0]},
}


def _hand_values(side: dict, ttft_s: list[float], e2e_s: list[float], peak: float, mean: float) -> dict:
    summary = side["summary"]
    return {
        "num_admitted": summary["num_admitted"],
        "num_finished": summary["num_finished"],
        "peak_running": peak,
        "mean_running": mean,
        "num_preemptions": summary["num_preemptions"],
        "prefix_cache_hit_rate": summary["prefix_cache_hit_rate"],
        "ttft_p50_s": numpy_percentile(ttft_s, 50),
        "ttft_p90_s": numpy_percentile(ttft_s, 90),
        "ttft_p99_s": numpy_percentile(ttft_s, 99),
        "e2e_p50_s": numpy_percentile(e2e_s, 50),
        "e2e_p99_s": numpy_percentile(e2e_s, 99),
        # A simulated stand-in's requests are each their own burst: the
        # means of the finished requests' TTFT and e2e.
        "burst_last_ttft_mean_s": sum(ttft_s) / len(ttft_s),
        "burst_last_e2e_mean_s": sum(e2e_s) / len(e2e_s),
        "output_throughput_tokens_per_s": summary["output_throughput_tokens_per_s"],
    }


def own_bursts(layout: str, num_requests: int) -> pd.Series:
    """Every request its own burst (by id)."""
    ids = [str(i) for i in range(num_requests)]
    return pd.Series(ids, index=pd.MultiIndex.from_product([[layout], ids]))


SIM_VALUES = _hand_values(SIM, SIM_TTFT_S, SIM_E2E_S, 4, (2 * 1 + 4 * 2 + 1 * 3) / 6)
REPLAY_VALUES = _hand_values(REPLAY, REPLAY_TTFT_S, REPLAY_E2E_S, 5, (3 * 2 + 5 * 2 + 2 * 4) / 8)


def test_the_oracle_percentiles_differ_so_a_swapped_column_or_percentile_shows():
    """The hand data are chosen so every latency metric has its own value."""
    latencies = [SIM_VALUES[m] for m in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s")]
    assert len(set(latencies)) == 5
    assert SIM_VALUES["ttft_p90_s"] == pytest.approx(1.76)  # by hand: 1.60 + 0.9 * (3.20 - 1.60) * 0.1
    assert SIM_VALUES["e2e_p50_s"] == pytest.approx(4.5)


def test_run_metrics_reads_each_metric_from_its_own_column():
    frames = hand_run({"on": SIM})
    values = v.run_metrics(frames, "on", own_bursts("on", 12))
    assert list(values) == list(v.METRICS)
    assert values == pytest.approx(SIM_VALUES)


def test_only_finished_requests_enter_the_percentiles():
    """Failing control: counting the two unfinished requests moves p90 and p99."""
    frames = hand_run({"on": SIM})
    with_unfinished = numpy_percentile([*SIM_TTFT_S, 50.0, 60.0], 90)
    assert v.run_metrics(frames, "on")["ttft_p90_s"] != pytest.approx(with_unfinished)
    everyone = {**SIM, "requests": {**SIM["requests"], "finished_s": [1.0] * 12}}
    assert v.run_metrics(hand_run({"on": everyone}), "on")["ttft_p90_s"] == pytest.approx(with_unfinished)


def test_the_running_gauge_falls_back_to_the_summary_without_samples():
    """No readings: the summary's step-based peak and mean, not NaN and not 0."""
    unsampled = {key: value for key, value in SIM.items() if key != "samples"}
    values = v.run_metrics(hand_run({"on": unsampled}), "on")
    assert (values["peak_running"], values["mean_running"]) == (99, 98.0)


def test_a_missing_summary_column_is_nan_not_zero():
    no_preemptions = {**SIM, "summary": {k: x for k, x in SIM["summary"].items() if k != "num_preemptions"}}
    values = v.run_metrics(hand_run({"on": no_preemptions}), "on")
    assert math.isnan(values["num_preemptions"]) and values["num_admitted"] == 12


def test_the_table_error_is_simulated_minus_measured_relative_to_the_measurement():
    table = v.metric_table(hand_run({"on": SIM}), hand_run({"on": REPLAY}))
    assert list(table.columns) == ["layout", "metric", "sim", "replay", "error", "error_perc", "comparable"]
    assert table["comparable"].all()
    assert list(table["metric"]) == list(v.METRICS) and set(table["layout"]) == {"on"}
    for row in table.itertuples():
        simulated, measured = SIM_VALUES[row.metric], REPLAY_VALUES[row.metric]
        assert (row.sim, row.replay) == pytest.approx((simulated, measured))
        assert row.error == pytest.approx(simulated - measured)
        assert row.error_perc == pytest.approx(100 * (simulated - measured) / measured)
    # By hand, one row: 120 tokens/s simulated against 100 measured is +20 %.
    throughput = table[table["metric"] == "output_throughput_tokens_per_s"].iloc[0]
    assert (throughput["error"], throughput["error_perc"]) == pytest.approx((20.0, 20.0))
    admitted = table[table["metric"] == "num_admitted"].iloc[0]
    assert admitted["error_perc"] == pytest.approx(100 / 11)


def test_a_measured_zero_has_an_error_but_no_percentage():
    measured_zero = {**REPLAY, "summary": {**REPLAY["summary"], "num_preemptions": 0}}
    table = v.metric_table(hand_run({"on": SIM}), hand_run({"on": measured_zero}))
    row = table[table["metric"] == "num_preemptions"].iloc[0]
    assert row["error"] == 3 and math.isnan(row["error_perc"])
    # A simulated zero against a measurement is -100 %, not NaN.
    simulated_zero = {**SIM, "summary": {**SIM["summary"], "num_preemptions": 0}}
    table = v.metric_table(hand_run({"on": simulated_zero}), hand_run({"on": REPLAY}))
    assert table[table["metric"] == "num_preemptions"].iloc[0]["error_perc"] == pytest.approx(-100.0)


def test_a_measured_nan_has_no_error_and_no_percentage():
    unmeasured = {**REPLAY, "summary": {**REPLAY["summary"], "num_preemptions": NAN}}
    row = v._compared("on", "num_preemptions", 3.0, NAN)
    assert math.isnan(row["error"]) and math.isnan(row["error_perc"])
    table = v.metric_table(hand_run({"on": SIM}), hand_run({"on": unmeasured}))
    assert math.isnan(table[table["metric"] == "num_preemptions"].iloc[0]["error_perc"])


def test_layouts_compared_are_those_in_both_runs_off_then_on_then_by_name():
    sim = hand_run({name: SIM for name in ("zeta", "on", "alpha", "off", "sim-only")})
    replay = hand_run({name: REPLAY for name in ("alpha", "off", "zeta", "on", "replay-only")})
    assert v.layouts_in_both(sim, replay) == ["off", "on", "alpha", "zeta"]
    table = v.metric_table(sim, replay)
    assert list(dict.fromkeys(table["layout"])) == ["off", "on", "alpha", "zeta"]
    assert len(table) == 4 * len(v.METRICS)


def test_each_layout_is_read_from_its_own_rows():
    """Two layouts with different values: neither borrows the other's rows."""
    other = {
        "summary": {**SIM["summary"], "num_admitted": 7},
        "requests": _requests([5.0] * 10, [9.0] * 10),
        "samples": {"time_s": [0.0, 1.0], "num_requests_running": [9, 9]},
    }
    frames = hand_run({"off": other, "on": SIM})
    assert v.run_metrics(frames, "on", own_bursts("on", 12)) == pytest.approx(SIM_VALUES)
    off = v.run_metrics(frames, "off")
    assert (off["num_admitted"], off["ttft_p50_s"], off["peak_running"], off["mean_running"]) == (
        7,
        5.0,
        9,
        9,
    )


def test_curve_table_compares_each_gauge_per_layout():
    """The running gauge as above; the KV usage gauge its own hand ramp."""
    sim_samples = {
        "time_s": [0.0, 1.0, 2.0],
        "num_requests_running": [1, 2, 3],
        "kv_cache_usage_perc": [0.1, 0.2, 0.3],
    }
    replay_samples = {
        "time_s": [0.0, 1.0, 2.0],
        "num_requests_running": [1, 2, 5],
        "kv_cache_usage_perc": [0.2, 0.2, 0.2],
    }
    sim = hand_run({"on": {"summary": {}, "samples": sim_samples}})
    replay = hand_run({"on": {"summary": {}, "samples": replay_samples}})
    table = v.curve_table(sim, replay).set_index("curve")
    assert list(table.index) == ["running", "kv_cache_usage"]
    running, usage = table.loc["running"], table.loc["kv_cache_usage"]
    assert running["rmse"] == pytest.approx(math.sqrt(4 / 3))
    assert running["mape_perc"] == pytest.approx(100 * (2 / 5) / 3)
    assert usage["rmse"] == pytest.approx(float(np.sqrt(np.mean(np.square([-0.1, 0.0, 0.1])))))
    assert usage["mape_perc"] == pytest.approx(100 * np.mean([0.5, 0.0, 0.5]))
    assert (running["num_points"], running["start_s"], running["end_s"]) == (3, 0.0, 2.0)


def test_the_grid_steps_at_the_simulations_median_interval():
    """Sim readings every 0.5 s (one gap of 2 s): the median spacing, 0.5 s,
    from the earlier start (the replay's, -1) to the later end (the sim's, 4)."""
    sim = pd.DataFrame({"time_s": [0.0, 0.5, 1.0, 1.5, 3.5, 4.0], "g": [1.0] * 6})
    replay = pd.DataFrame({"time_s": [-1.0, 2.0], "g": [1.0, 1.0]})
    grid = v.common_grid(sim, replay, "g")
    assert grid == pytest.approx(np.arange(-1.0, 4.0 + 1e-9, 0.5))
    # Too few simulated readings to have an interval: nothing to compare.
    assert len(v.common_grid(sim.iloc[:1], replay, "g")) == 0
    assert v.curve_error(sim.iloc[:1], replay, "g")["num_points"] == 0


def test_unreadable_readings_are_dropped_and_readings_are_sorted():
    sim = pd.DataFrame({"time_s": [2.0, 0.0, 1.0, 3.0], "g": [4.0, 0.0, 2.0, None]})
    replay = pd.DataFrame({"time_s": [0.0, 1.0, 2.0], "g": [0.0, 2.0, 4.0]})
    error = v.curve_error(sim, replay, "g")
    assert (error["rmse"], error["num_points"], error["end_s"]) == (0.0, 3, 2.0)


def test_the_report_is_json_with_nan_as_null():
    unmeasured = {**REPLAY, "summary": {**REPLAY["summary"], "num_preemptions": NAN}}
    report = v.validation_report(hand_run({"on": SIM}), hand_run({"on": unmeasured}))
    assert report["layouts"] == ["on"]
    rows = {row["metric"]: row for row in report["metrics"]}
    assert rows["num_preemptions"]["replay"] is None and rows["num_preemptions"]["error"] is None
    assert rows["num_admitted"] == {
        "layout": "on",
        "metric": "num_admitted",
        "sim": 12,
        "replay": 11,
        "error": 1,
        "error_perc": pytest.approx(100 / 11),
        "comparable": True,
    }
    assert report["burst_share"] == {"on": 0.0} and report["reorder_window_s"] == 0.0
    assert [row["curve"] for row in report["curves"]] == ["running", "kv_cache_usage"]


# ------------------------------------------------- frames missing a part
def test_frames_without_their_columns_read_as_unmeasured():
    """Samples without a layout column or without the running gauge fall
    back to the summary; requests without ``finished_s`` or without a
    latency column give NaN for what they lack, not an error."""
    no_layout = hand_run({"on": {k: x for k, x in SIM.items() if k != "samples"}})
    no_layout["samples"] = pd.DataFrame({"time_s": [0.0, 1.0], "num_requests_running": [5, 5]})
    assert (
        v.run_metrics(no_layout, "on")["peak_running"],
        v.run_metrics(no_layout, "on")["mean_running"],
    ) == (99, 98.0)
    usage_only = {**SIM, "samples": {"time_s": [0.0, 1.0], "kv_cache_usage_perc": [0.1, 0.2]}}
    assert v.run_metrics(hand_run({"on": usage_only}), "on")["peak_running"] == 99
    unfinished = {**SIM, "requests": {k: x for k, x in SIM["requests"].items() if k != "finished_s"}}
    assert math.isnan(v.run_metrics(hand_run({"on": unfinished}), "on")["ttft_p50_s"])
    no_e2e = {**SIM, "requests": {k: x for k, x in SIM["requests"].items() if k != "e2e_s"}}
    values = v.run_metrics(hand_run({"on": no_e2e}), "on")
    assert math.isnan(values["e2e_p50_s"]) and values["ttft_p50_s"] == pytest.approx(SIM_VALUES["ttft_p50_s"])


def test_no_finished_request_gives_nan_percentiles():
    nobody = {**SIM, "requests": {**SIM["requests"], "finished_s": [NAN] * 12}}
    values = v.run_metrics(hand_run({"on": nobody}), "on")
    assert all(math.isnan(values[m]) for m, _, _ in v.LATENCY_METRICS)


def test_unreadable_values_are_dropped_not_fatal():
    """A cell that is not a number (a replay's text) is NaN: dropped from a
    percentile, NaN as a summary value."""
    garbled = {
        **SIM,
        "summary": {**SIM["summary"], "num_preemptions": "n/a"},
        "requests": {**SIM["requests"], "ttft_s": ["n/a", *SIM_TTFT_S[1:], 50.0, 60.0]},
    }
    values = v.run_metrics(hand_run({"on": garbled}), "on")
    assert math.isnan(values["num_preemptions"])
    assert values["ttft_p50_s"] == pytest.approx(numpy_percentile(SIM_TTFT_S[1:], 50))
    sim = pd.DataFrame({"time_s": [0.0, 1.0, 2.0], "g": [1.0, "n/a", 1.0]})
    assert v.curve_error(sim, sim.iloc[[0, 2]], "g")["rmse"] == 0.0


def test_tables_of_runs_without_a_common_layout_keep_their_columns():
    sim, replay = hand_run({"on": SIM}), hand_run({"off": REPLAY})
    assert list(v.metric_table(sim, replay).columns) == [
        "layout",
        "metric",
        "sim",
        "replay",
        "error",
        "error_perc",
        "comparable",
    ]
    assert list(v.curve_table(sim, replay).columns) == [
        "layout",
        "curve",
        "rmse",
        "mape_perc",
        "num_points",
        "start_s",
        "end_s",
    ]
    table = v.curve_table(hand_run({"off": SIM, "on": SIM}), hand_run({"off": REPLAY, "on": REPLAY}))
    assert list(table["layout"]) == ["off", "off", "on", "on"]


def test_a_curve_without_a_grid_is_all_nan_and_no_points():
    sim = pd.DataFrame({"time_s": [0.0], "g": [1.0]})
    error = v.curve_error(sim, sim, "g")
    assert error["num_points"] == 0 and set(error) == {"rmse", "mape_perc", "num_points", "start_s", "end_s"}
    assert all(math.isnan(error[k]) for k in ("rmse", "mape_perc", "start_s", "end_s"))


def test_the_fewest_readings_that_make_a_grid():
    """Two simulated readings and one measured one are enough."""
    sim = pd.DataFrame({"time_s": [0.0, 1.0], "g": [2.0, 2.0]})
    replay = pd.DataFrame({"time_s": [1.0], "g": [2.0]})
    assert list(v.common_grid(sim, replay, "g")) == [0.0, 1.0]
    assert v.curve_error(sim, replay, "g")["rmse"] == pytest.approx(
        math.sqrt(4 / 2)
    )  # 0 read before the replay's first


def test_the_grid_ends_at_the_measured_runs_last_reading():
    sim = pd.DataFrame({"time_s": [0.0, 1.0, 2.0], "g": [1.0] * 3})
    replay = pd.DataFrame({"time_s": [0.0, 1.0, 2.0, 5.0], "g": [1.0] * 4})
    assert list(v.common_grid(sim, replay, "g")) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_simulated_readings_all_at_one_time_have_no_interval_and_no_grid():
    sim = pd.DataFrame({"time_s": [1.0, 1.0, 1.0], "g": [1.0] * 3})
    replay = pd.DataFrame({"time_s": [0.0, 3.0], "g": [1.0] * 2})
    assert len(v.common_grid(sim, replay, "g")) == 0


def test_a_measurement_of_zero_everywhere_gives_nan_mape_without_a_warning():
    import warnings

    sim = pd.DataFrame({"time_s": [0.0, 1.0], "g": [1.0, 1.0]})
    replay = pd.DataFrame({"time_s": [0.0, 1.0], "g": [0.0, 0.0]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert math.isnan(v.curve_error(sim, replay, "g")["mape_perc"])


def test_the_report_keeps_fifteen_significant_digits():
    precise = {**SIM, "summary": {**SIM["summary"], "num_admitted": 0.123456789012345}}
    report = v.validation_report(hand_run({"on": precise}), hand_run({"on": REPLAY}))
    row = next(r for r in report["metrics"] if r["metric"] == "num_admitted")
    assert row["sim"] == 0.123456789012345
