"""``sim.analysis.calibrate`` values: which latencies it fits (TTFT and
end-to-end from the requests frame, by hand), the residual's scale and
floor, the bounds, the screen's finite differences against a hand-made
error function, which pairs are "alike", what wins when a scenario already
sets a coefficient, and a run where one coefficient is unidentifiable and
the other must still be recovered."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from helpers.scenarios import scenario as make_scenario

from sim.analysis import calibrate as c
from sim.analysis.runs import run_scenario, scenario_workload
from sim.config import ConfigError


# ------------------------------------------------------------ the targets
def test_finished_times_are_ttft_and_e2e_from_arrival_of_finished_requests():
    requests = pd.DataFrame(
        {
            "layout": ["on", "on", "off"],
            "request_id": [7, 8, 7],
            "arrival_s": [1.0, 2.0, 0.5],
            "first_token_s": [1.5, 2.25, 0.75],
            "finished_s": [4.0, np.nan, 1.5],
        }
    )
    times = c.finished_times(requests)
    assert list(times.index) == [("on", "7"), ("off", "7")]
    assert list(times["ttft_s"]) == [0.5, 0.25] and list(times["e2e_s"]) == [3.0, 1.0]
    with pytest.raises(ConfigError, match="requests: no column first_token_s, finished_s"):
        c.finished_times(requests.drop(columns=["first_token_s", "finished_s"]))


def test_residuals_are_relative_to_the_measurement_floored_at_ten_ms():
    index = pd.MultiIndex.from_tuples([("on", "a"), ("on", "b"), ("on", "c")])
    measured = pd.DataFrame({"ttft_s": [0.010, 0.005, 1.0], "e2e_s": [0.02, 0.5, 2.0]}, index=index)
    simulated = pd.DataFrame({"ttft_s": [0.012, 0.006, 1.0], "e2e_s": [0.01, 0.25, 2.5]}, index=index)
    expected = [0.2, 0.1, 0.0, -0.5, -0.5, 0.25]  # TTFTs first, then e2e; b's TTFT over 10 ms, not 5
    assert c.relative_residuals(simulated, measured) == pytest.approx(expected)
    assert c.LATENCY_FLOOR_S == 0.010 and c.MISSING_RESIDUAL == 1.0


def test_rms_of_hand_residuals():
    assert c.rms(np.array([3.0, 4.0])) == pytest.approx(math.sqrt(12.5))
    assert math.isnan(c.rms(np.array([])))


# ---------------------------------------------------------------- bounds
@pytest.mark.parametrize(
    ("name", "start", "low", "high"),
    [
        ("compute_efficiency", 0.12, 0.012, 1.0),  # a decade down, capped at 1 up
        ("memory_efficiency", 0.05, 0.005, 0.5),  # a decade each way, inside (0, 1]
        ("step_overhead_s", 0.005, 0.0005, 0.05),  # ge=0 allows a decade down
        ("compute_efficiency", 1.0, 0.1, 1.0),  # at the cap: cannot move up
    ],
)
def test_log_bounds_are_a_decade_each_way_within_the_fields_limits(name, start, low, high):
    low_x, high_x = c.log_bounds(name, start)
    assert start * math.exp(low_x) == pytest.approx(low, rel=1e-6)
    assert start * math.exp(high_x) == pytest.approx(high, rel=1e-6)
    assert start * math.exp(high_x) <= 1.0 or name == "step_overhead_s"


def test_a_coefficient_starting_at_zero_cannot_be_fitted():
    with pytest.raises(
        ConfigError, match="step_time: step_overhead_s: cannot fit from 0.0; start it above 0"
    ):
        c.log_bounds("step_overhead_s", 0.0)


def test_the_fit_list_must_name_something():
    with pytest.raises(ConfigError, match="--fit: cannot fit nothing; choose among"):
        c.check_coefficients(())
    assert c.check_coefficients(["step_overhead_s"]) == ("step_overhead_s",)
    assert "tensor_parallel_size" not in c.fittable_coefficients()
    assert {"compute_efficiency", "memory_efficiency", "step_overhead_s"} <= set(c.fittable_coefficients())


# ------------------------------------------------------------- the screen
class QuadraticError:
    """Residuals ``[x0, x1 ** 2, 0]``: coefficient 0 acts linearly, 1 as a
    square (its central difference is 0 about the start, its one-sided one
    is not)."""

    names = ("linear", "square")

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return np.array([x[0], x[1] ** 2, 0.0])


def test_screening_moves_each_coefficient_ten_percent_each_way_within_its_bounds():
    step = math.log(1.1)
    wide = [(-1.0, 1.0), (-1.0, 1.0)]
    effects = c.screen(QuadraticError(), wide)
    assert effects["linear"] == pytest.approx([1.0, 0.0, 0.0])
    assert effects["square"] == pytest.approx([0.0, 0.0, 0.0])  # (s^2 - s^2) / 2s
    # At its lower bound (start = the bound): moved up only, (s^2 - 0) / s = s.
    effects = c.screen(QuadraticError(), [(-1.0, 1.0), (0.0, 1.0)])
    assert effects["square"] == pytest.approx([0.0, step, 0.0])
    # Pinned (both bounds at the start): no effect, not a division by zero.
    effects = c.screen(QuadraticError(), [(0.0, 0.0), (-1.0, 1.0)])
    assert effects["linear"] == pytest.approx([0.0, 0.0, 0.0])


def test_alike_pairs_are_parallel_or_opposite_effects_of_coefficients_that_act():
    effects = {
        "a": np.array([1.0, 0.0]),
        "b": np.array([2.0, 0.0]),  # parallel to a
        "c": np.array([0.0, 1.0]),  # orthogonal
        "d": np.array([-1.0, -0.01]),  # nearly opposite to a: alike too
        "e": np.array([1e-6, 0.0]),  # no effect: never alike
    }
    pairs = {(a, b): cosine for a, b, cosine in c.alike_pairs(effects)}
    assert set(pairs) == {("a", "b"), ("a", "d"), ("b", "d")}
    assert pairs[("a", "b")] == pytest.approx(1.0) and pairs[("a", "d")] == pytest.approx(-0.99995, abs=1e-5)


def test_the_alike_threshold_is_a_cosine_of_095_inclusive():
    angle = math.acos(0.95)
    below = math.acos(0.95) + 1e-3
    at = {"a": np.array([1.0, 0.0]), "b": np.array([math.cos(angle - 1e-9), math.sin(angle - 1e-9)])}
    past = {"a": np.array([1.0, 0.0]), "b": np.array([math.cos(below), math.sin(below)])}
    assert len(c.alike_pairs(at)) == 1 and c.alike_pairs(past) == ()


# ------------------------------------------------- the scenario's own values
def test_a_coefficient_the_scenario_sets_is_the_start_and_the_fit_wins_over_it(tmp_path):
    sc = make_scenario(
        tmp_path, "set", ["step_time.step_overhead_s=0.004"], workload=DECODE_ONLY, layouts=["on"]
    )
    assert c.with_step_time(sc, {"step_overhead_s": 0.007}).step_time["step_overhead_s"] == 0.007
    assert c.with_step_time(sc, {"compute_efficiency": 0.2}).step_time == {
        "step_overhead_s": 0.004,
        "compute_efficiency": 0.2,
    }
    fitted = c.Calibration(
        start={},
        fitted={"step_overhead_s": 0.006},
        sensitivity={},
        unidentifiable=(),
        alike=(),
        at_bound=(),
        rms_error_start=0.0,
        rms_error_fitted=0.0,
        num_simulations=0,
        budget_spent=False,
    )
    assert fitted.step_time({"step_overhead_s": 0.004, "memory_efficiency": 0.3}) == {
        "step_overhead_s": 0.006,
        "memory_efficiency": 0.3,
    }


# --------------------------------------------------- a fit with one unknown
# Prompts of a few dozen tokens: the compute efficiency moves no request time
# (every step is memory- or overhead-bound); the step overhead moves all.
DECODE_ONLY = {
    "trace": "synthetic",
    "num_requests": 8,
    "arrival": {"process": "poisson", "rate_per_s": 4.0},
    "prompt": {"distribution": "uniform", "lo": 16, "hi": 48},
    "output": {"distribution": "uniform", "lo": 10, "hi": 30},
}


def test_an_unidentifiable_coefficient_stays_at_its_start_and_the_other_is_recovered(tmp_path):
    """The rig's step overhead is 6 ms; the scenario says 4 ms (so 4 ms is
    the start, not the model's 1 ms default). The compute efficiency,
    listed first, is unidentifiable: it is left at its start, out of
    ``fitted``, and the overhead, second, is recovered."""
    modelled = make_scenario(
        tmp_path, "m", ["step_time.step_overhead_s=0.004"], workload=DECODE_ONLY, layouts=["on"]
    )
    rig = make_scenario(
        tmp_path, "m", ["step_time.step_overhead_s=0.006"], workload=DECODE_ONLY, layouts=["on"]
    )
    measured = run_scenario(rig).requests
    assert scenario_workload(modelled).requests == scenario_workload(rig).requests
    result = c.calibrate(modelled, measured, ["compute_efficiency", "step_overhead_s"], max_simulations=60)
    # 0.74: the default the rig's clock fitted (docs/step-time-model.md).
    assert result.start == {"compute_efficiency": 0.74, "step_overhead_s": 0.004}
    assert result.unidentifiable == ("compute_efficiency",)
    assert (
        result.sensitivity["compute_efficiency"] < c.MIN_SENSITIVITY < result.sensitivity["step_overhead_s"]
    )
    assert set(result.fitted) == {"step_overhead_s"}
    assert result.fitted["step_overhead_s"] == pytest.approx(0.006, rel=0.03)
    assert result.rms_error_fitted < result.rms_error_start / 5
    assert result.at_bound == () and result.alike == () and not result.budget_spent
    assert 5 <= result.num_simulations <= 60
