"""``sim.analysis.calibrate`` values: which latencies it fits (TTFT and
end-to-end from the requests frame, by hand), the residual's scale and
floor, the bounds, the screen's finite differences against a hand-made
error function, which pairs are "alike", what wins when a scenario already
sets a coefficient, and a run where one coefficient is unidentifiable and
the other must still be recovered."""

from __future__ import annotations

import math
import warnings
from dataclasses import replace

import annotated_types
import numpy as np
import pandas as pd
import pytest
from helpers.scenarios import scenario as make_scenario
from helpers.scheduler import tiny_spec

from sim.analysis import calibrate as c
from sim.analysis import calibrate_error as ce
from sim.analysis import calibrate_intervals as ci
from sim.analysis import replayed_arrivals as ra
from sim.analysis.runs import run_scenario, scenario_workload
from sim.config import ConfigError
from sim.workloads.spec import Workload


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
    times = ce.finished_times(requests)
    assert list(times.index) == [("on", "7"), ("off", "7")]
    assert list(times["ttft_s"]) == [0.5, 0.25] and list(times["e2e_s"]) == [3.0, 1.0]
    with pytest.raises(ConfigError, match="requests: no column first_token_s, finished_s"):
        ce.finished_times(requests.drop(columns=["first_token_s", "finished_s"]))


def test_residuals_are_relative_to_the_measurement_floored_at_ten_ms():
    index = pd.MultiIndex.from_tuples([("on", "a"), ("on", "b"), ("on", "c")])
    measured = pd.DataFrame({"ttft_s": [0.010, 0.005, 1.0], "e2e_s": [0.02, 0.5, 2.0]}, index=index)
    simulated = pd.DataFrame({"ttft_s": [0.012, 0.006, 1.0], "e2e_s": [0.01, 0.25, 2.5]}, index=index)
    expected = [0.2, 0.1, 0.0, -0.5, -0.5, 0.25]  # TTFTs first, then e2e; b's TTFT over 10 ms, not 5
    assert ce.relative_residuals(simulated, measured) == pytest.approx(expected)
    assert ce.LATENCY_FLOOR_S == 0.010 and ce.MISSING_RESIDUAL == 1.0


def test_rms_of_hand_residuals():
    assert ce.rms(np.array([3.0, 4.0])) == pytest.approx(math.sqrt(12.5))
    assert math.isnan(ce.rms(np.array([])))


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
    low_x, high_x = ce.log_bounds(name, start)
    assert start * math.exp(low_x) == pytest.approx(low, rel=1e-6)
    assert start * math.exp(high_x) == pytest.approx(high, rel=1e-6)
    assert start * math.exp(high_x) <= 1.0 or name == "step_overhead_s"


def test_a_coefficient_starting_at_zero_cannot_be_fitted():
    with pytest.raises(
        ConfigError, match="step_time: step_overhead_s: cannot fit from 0.0; start it above 0"
    ):
        ce.log_bounds("step_overhead_s", 0.0)


def test_the_fit_list_must_name_something():
    with pytest.raises(ConfigError, match="--fit: cannot fit nothing; choose among"):
        ce.check_coefficients(())
    assert ce.check_coefficients(["step_overhead_s"]) == ("step_overhead_s",)
    assert "tensor_parallel_size" not in ce.fittable_coefficients()
    assert {"compute_efficiency", "memory_efficiency", "step_overhead_s"} <= set(ce.fittable_coefficients())


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
    effects = ce.screen(QuadraticError(), wide)
    assert effects["linear"] == pytest.approx([1.0, 0.0, 0.0])
    assert effects["square"] == pytest.approx([0.0, 0.0, 0.0])  # (s^2 - s^2) / 2s
    # At its lower bound (start = the bound): moved up only, (s^2 - 0) / s = s.
    effects = ce.screen(QuadraticError(), [(-1.0, 1.0), (0.0, 1.0)])
    assert effects["square"] == pytest.approx([0.0, step, 0.0])
    # Pinned (both bounds at the start): no effect, not a division by zero.
    effects = ce.screen(QuadraticError(), [(0.0, 0.0), (-1.0, 1.0)])
    assert effects["linear"] == pytest.approx([0.0, 0.0, 0.0])


def test_alike_pairs_are_parallel_or_opposite_effects_of_coefficients_that_act():
    effects = {
        "a": np.array([1.0, 0.0]),
        "b": np.array([2.0, 0.0]),  # parallel to a
        "c": np.array([0.0, 1.0]),  # orthogonal
        "d": np.array([-1.0, -0.01]),  # nearly opposite to a: alike too
        "e": np.array([1e-6, 0.0]),  # no effect: never alike
    }
    pairs = {(a, b): cosine for a, b, cosine in ce.alike_pairs(effects)}
    assert set(pairs) == {("a", "b"), ("a", "d"), ("b", "d")}
    assert pairs[("a", "b")] == pytest.approx(1.0) and pairs[("a", "d")] == pytest.approx(-0.99995, abs=1e-5)


def test_the_alike_threshold_is_a_cosine_of_095_inclusive():
    angle = math.acos(0.95)
    below = math.acos(0.95) + 1e-3
    at = {"a": np.array([1.0, 0.0]), "b": np.array([math.cos(angle - 1e-9), math.sin(angle - 1e-9)])}
    past = {"a": np.array([1.0, 0.0]), "b": np.array([math.cos(below), math.sin(below)])}
    assert len(ce.alike_pairs(at)) == 1 and ce.alike_pairs(past) == ()


# ------------------------------------------------- the scenario's own values
def test_a_coefficient_the_scenario_sets_is_the_start_and_the_fit_wins_over_it(tmp_path):
    sc = make_scenario(
        tmp_path, "set", ["step_time.step_overhead_s=0.004"], workload=DECODE_ONLY, layouts=["on"]
    )
    assert ce.with_step_time(sc, {"step_overhead_s": 0.007}).step_time["step_overhead_s"] == 0.007
    assert ce.with_step_time(sc, {"compute_efficiency": 0.2}).step_time == {
        "step_overhead_s": 0.004,
        "compute_efficiency": 0.2,
    }
    fitted = c.Calibration(
        coefficients={
            "step_overhead_s": c.Coefficient(0.004, 0.006, c.FITTED, "", 0.01, 1.0),
            # Control: one not identifiable (and one at a bound) stay out of the block.
            "sampling_s": c.Coefficient(0.001, 0.001, c.NOT_IDENTIFIABLE, "why", math.inf, 0.0),
            "compute_efficiency": c.Coefficient(0.5, 1.0, c.AT_BOUND, "bound", 0.01, 1.0),
        },
        alike=(),
        noise=0.005,
        rms_error_start=0.0,
        rms_error_fitted=0.0,
        num_simulations=0,
        budget_spent=False,
    )
    assert fitted.step_time({"step_overhead_s": 0.004, "memory_efficiency": 0.3}) == {
        "step_overhead_s": 0.006,
        "memory_efficiency": 0.3,
    }
    assert fitted.unidentifiable == ("sampling_s",) and fitted.at_bound == ("compute_efficiency",)


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
        result.sensitivity["compute_efficiency"] < ce.MIN_SENSITIVITY < result.sensitivity["step_overhead_s"]
    )
    assert set(result.fitted) == {"step_overhead_s"}
    assert result.fitted["step_overhead_s"] == pytest.approx(0.006, rel=0.03)
    assert result.rms_error_fitted < result.rms_error_start / 5
    assert result.at_bound == () and result.alike == () and not result.budget_spent
    assert 5 <= result.num_simulations <= 60


# ------------------------------------------- the fit on a hand-made model
# The simulation replaced by a model whose request times are closed-form:
# TTFT = (10, 20) x the step overhead, end-to-end = TTFT + (0.1, 0.3) / the
# memory efficiency; the compute efficiency moves nothing. The fit, the
# screen's verdicts, the bound and the budget are then checked against
# these formulas (numpy as the oracle), in milliseconds, not simulations.
TTFT_STEPS = np.array([10.0, 20.0])
DECODE_BYTES = np.array([0.1, 0.3])
FIT = ["compute_efficiency", "step_overhead_s", "memory_efficiency"]


def _model_times(overhead: float, memory_efficiency: float) -> tuple[np.ndarray, np.ndarray]:
    ttft = TTFT_STEPS * overhead
    return ttft, ttft + DECODE_BYTES / memory_efficiency


def _closed_form(self, values):
    # A coefficient not fitted stays at the scenario's value (set below).
    ttft, e2e = _model_times(values.get("step_overhead_s", 0.004), values.get("memory_efficiency", 0.5))
    return pd.DataFrame({"ttft_s": ttft, "e2e_s": e2e}, index=self.measured.index)


def _measured(overhead: float, memory_efficiency: float) -> pd.DataFrame:
    ttft, e2e = _model_times(overhead, memory_efficiency)
    return pd.DataFrame(
        {
            "layout": ["on", "on"],
            "request_id": ["r0", "r1"],
            "arrival_s": [0.0, 0.0],
            "first_token_s": ttft,
            "finished_s": e2e,
        }
    )


def _oracle_residuals(overhead, memory_efficiency, measured_overhead, measured_memory):
    sim, meas = _model_times(overhead, memory_efficiency), _model_times(measured_overhead, measured_memory)
    return np.concatenate([(s - m) / np.maximum(m, 0.010) for s, m in zip(sim, meas, strict=True)])


@pytest.fixture
def closed_form(tmp_path, monkeypatch):
    monkeypatch.setattr(ce.RequestTimeError, "simulated_times", _closed_form)
    return make_scenario(
        tmp_path,
        "closed",
        ["step_time.step_overhead_s=0.004", "step_time.memory_efficiency=0.5"],
        workload=DECODE_ONLY,
        layouts=["on"],
    )


def test_the_fit_recovers_the_closed_form_models_coefficients(closed_form):
    """Truth: overhead 6 ms (start 4), memory efficiency 0.4 (start 0.5).
    Control: the same fit from a measurement made at the start gives the
    start back with zero error."""
    result = c.calibrate(closed_form, _measured(0.006, 0.4), FIT)
    assert result.start == {"compute_efficiency": 0.74, "step_overhead_s": 0.004, "memory_efficiency": 0.5}
    assert result.unidentifiable == ("compute_efficiency",) and result.sensitivity["compute_efficiency"] == 0
    assert set(result.fitted) == {"step_overhead_s", "memory_efficiency"}
    # xatol 0.005 in log space: within 1 % of the truth.
    assert result.fitted["step_overhead_s"] == pytest.approx(0.006, rel=0.01)
    assert result.fitted["memory_efficiency"] == pytest.approx(0.4, rel=0.01)
    start_residuals = _oracle_residuals(0.004, 0.5, 0.006, 0.4)
    assert result.rms_error_start == pytest.approx(float(np.sqrt(np.mean(start_residuals**2))))
    fitted_residuals = _oracle_residuals(
        result.fitted["step_overhead_s"], result.fitted["memory_efficiency"], 0.006, 0.4
    )
    assert result.rms_error_fitted == pytest.approx(float(np.sqrt(np.mean(fitted_residuals**2))))
    assert result.rms_error_fitted < 0.01 < result.rms_error_start
    assert result.at_bound == () and not result.budget_spent
    assert 7 < result.num_simulations < 200
    control = c.calibrate(closed_form, _measured(0.004, 0.5), FIT)
    assert control.fitted == {"step_overhead_s": 0.004, "memory_efficiency": 0.5}
    assert control.rms_error_start == 0.0 == control.rms_error_fitted


def test_a_truth_past_the_bound_is_at_the_bound_not_fitted(closed_form):
    """An overhead 25 times the start stops at 10 times (a decade), flagged
    and out of the fitted block (fitted alone: with the memory efficiency,
    the misfit at the start would keep the overhead out of the fit)."""
    result = c.calibrate(closed_form, _measured(0.1, 0.4), ["step_overhead_s"], max_simulations=400)
    assert result.values["step_overhead_s"] == pytest.approx(0.04, rel=1e-9)
    assert result.at_bound == ("step_overhead_s",) and "step_overhead_s" not in result.fitted
    assert result.coefficients["step_overhead_s"].status == "at a bound"
    # A memory efficiency past 1 stops at 1 (its field's cap), a doubling
    # up from 0.5 against a decade down: flagged, the bounds being asymmetric.
    capped = c.calibrate(closed_form, _measured(0.004, 1.5), ["memory_efficiency"], max_simulations=400)
    assert capped.values["memory_efficiency"] == pytest.approx(1.0, rel=1e-6)
    assert capped.at_bound == ("memory_efficiency",)


def test_a_spent_budget_fits_nothing_it_cannot_bound(closed_form):
    """Seven simulations screen three coefficients (1 + 2 x 3) and leave the
    fit none. The best screened point (the overhead moved up 10 %, by the
    oracle's squared error) still misses by 20 % and more, so no interval
    closes: nothing is reported fitted, each free coefficient says the
    budget ran out, and all stay at their start."""
    result = c.calibrate(closed_form, _measured(0.006, 0.4), FIT, max_simulations=7)
    assert result.budget_spent and result.num_simulations == 7
    best = _oracle_residuals(0.004 * 1.1, 0.5, 0.006, 0.4)
    assert float(np.sqrt(np.mean(best**2))) > 0.2  # control: the misfit the intervals see
    assert result.fitted == {} and result.values == result.start
    for name in ("step_overhead_s", "memory_efficiency"):
        assert result.coefficients[name].reason.startswith("the fit's budget ran out"), name
    with pytest.raises(ConfigError, match="--max-simulations: 6: at least 7 to screen 3"):
        c.calibrate(closed_form, _measured(0.006, 0.4), FIT, max_simulations=6)
    with pytest.raises(ConfigError, match="^--max-seconds: spent before the fit began; allow more$"):
        c.calibrate(closed_form, _measured(0.006, 0.4), FIT, max_seconds=-1.0)


def test_a_replay_with_nothing_finished_cannot_be_calibrated(closed_form):
    unfinished = _measured(0.006, 0.4).assign(finished_s=np.nan)
    with pytest.raises(ConfigError, match="^replay: no finished request to calibrate against$"):
        c.calibrate(closed_form, unfinished, FIT)


def test_the_fit_list_messages_name_every_coefficient_comma_separated():
    allowed = (
        "memory_efficiency, compute_efficiency, p2p_bandwidth_bytes_per_s, allreduce_latency_s, "
        "custom_allreduce_max_bytes, nccl_base_latency_s, nccl_hop_latency_s, nccl_ll_efficiency, "
        "nccl_simple_extra_base_latency_s, nccl_simple_extra_hop_latency_s, "
        "replay_kernel_overhead_per_layer_s, unfused_cut_chunk_per_gdn_layer_s, "
        "pp_send_latency_s, host_read_efficiency, host_gather_latency_s, ple_push_round_trip_s, "
        "kernel_overhead_per_layer_s, sampling_s, step_overhead_s, gdn_flops_per_state_entry"
    )
    # Every float field of StepTimeConfig, in declaration order; not the
    # strings (gpu, quantization), ints (the parallelism, drafts) or optionals.
    assert ", ".join(ce.fittable_coefficients()) == allowed
    with pytest.raises(ConfigError) as unknown:
        ce.check_coefficients(["gpu", "step_overhead_s", "tensor_parallel_size"])
    assert str(unknown.value) == f"--fit: cannot fit gpu, tensor_parallel_size; choose among {allowed}"
    with pytest.raises(ConfigError) as twice:
        ce.check_coefficients(["sampling_s", "sampling_s"])
    assert str(twice.value) == "--fit: a coefficient is named twice: sampling_s, sampling_s"


def test_a_sensitivity_exactly_at_the_threshold_is_fitted_and_alike_is_inclusive(closed_form, monkeypatch):
    """``MIN_SENSITIVITY`` and ``ALIKE_COSINE`` are inclusive: effects of RMS
    exactly 1e-4 (one entry 1e-4: sqrt(mean(1e-8)) = 1e-4 in floats) and a
    cosine of exactly 19/20 (b = (19, 5, 3, 2, 1): |b| = 20)."""
    assert ce.rms(np.array([1e-4, 0.0, 0.0, 0.0])) == 5e-5 and ce.rms(np.array([1e-4])) == ce.MIN_SENSITIVITY
    exact = {"a": np.array([1.0, 0, 0, 0, 0]), "b": np.array([19.0, 5, 3, 2, 1])}
    assert ce.alike_pairs(exact) == (("a", "b", 0.95),)
    at_threshold = {"a": np.array([1e-4]), "b": np.array([2e-4])}
    assert ce.alike_pairs(at_threshold) == (("a", "b", 1.0),)

    # The screen replaced: compute efficiency's effect is exactly at the
    # threshold (four entries of 1e-4), orthogonal to the overhead's (not alike).
    assert ce.rms(np.full(4, 1e-4)) == ce.MIN_SENSITIVITY

    def screen(error, bounds):
        return {"compute_efficiency": np.full(4, 1e-4), "step_overhead_s": np.array([1.0, -1.0, 0.0, 0.0])}

    monkeypatch.setattr(c, "screen", screen)
    for limit in ("MAX_HALF_WIDTH", "HOPELESS_HALF_WIDTH"):  # the intervals' test is another one
        monkeypatch.setattr(c, limit, math.inf)
    result = c.calibrate(closed_form, _measured(0.006, 0.4), ["compute_efficiency", "step_overhead_s"])
    # Both enter the fit (the compute efficiency, flat, may wander to its bound).
    assert result.unidentifiable == () and "step_overhead_s" in result.fitted


class RecordingBowl:
    """Residuals ``scale * (x - minimum)``: a bowl whose minimum is known;
    records every point asked, as ``RequestTimeError`` does."""

    def __init__(self, minimum: list[float], scale: float) -> None:
        self.names = tuple(f"c{i}" for i in range(len(minimum)))
        self.minimum, self.scale = np.array(minimum), scale
        self.evaluations: dict[tuple[float, ...], np.ndarray] = {}
        self.asked: list[np.ndarray] = []

    def __call__(self, x: np.ndarray) -> np.ndarray:
        self.asked.append(np.array(x))
        self.evaluations[tuple(np.round(x, 12))] = residuals = self.scale * (np.asarray(x) - self.minimum)
        return residuals


def test_the_fit_starts_from_a_25_percent_simplex_and_leaves_fixed_coefficients_at_zero():
    """Nelder-Mead's first simplex: the start and +log(1.25) on each free
    coefficient (coefficient 1 fixed, never moved). Control: scipy's own
    default simplex (5 % of a nonzero start, 0.00025 at zero) differs."""
    bowl = RecordingBowl([0.1, 0.0, -0.1], scale=1.0)
    wide = [(-1.0, 1.0)] * 3
    assert ce.fit_free(bowl, [0, 2], wide) is False
    step = math.log(1.25)
    first = {tuple(np.round(x, 12)) for x in bowl.asked[:3]}
    assert first == {(0.0, 0.0, 0.0), (round(step, 12), 0.0, 0.0), (0.0, 0.0, round(step, 12))}
    assert all(x[1] == 0.0 for x in bowl.asked)
    best, residuals = ce.best_with(bowl, [0, 2])
    assert best == pytest.approx([0.1, 0.0, -0.1], abs=0.005)
    assert residuals == pytest.approx(bowl.scale * (best - bowl.minimum))


def test_the_fit_stops_at_half_a_percent_where_the_error_is_flat():
    """A flat bowl (squared error 1e-6 x distance^2: below ``fatol`` 1e-6
    at once): only the simplex size stops the fit, at 0.005 (log space):
    the best point is within it of the minimum but not much finer.
    Control: scipy's default xatol (1e-4) would land within 2e-4."""
    bowl = RecordingBowl([0.3, -0.2], scale=1e-3)
    ce.fit_free(bowl, [0, 1], [(-1.0, 1.0)] * 2)
    best, _ = ce.best_with(bowl, [0, 1])
    distance = float(np.max(np.abs(best - bowl.minimum)))
    assert 2e-4 < distance < 0.005


def test_the_fit_goes_on_while_the_error_moves_more_than_fatol():
    """A steep bowl in four coefficients (squared error 1e4 x distance^2):
    the simplex reaches 0.005 long before the error's spread is under
    1e-6, so the fit goes on to ~1e-5; it takes more than 60 simulations
    (scipy's maxfev is 10^6 here, the budget is kvsim's)."""
    bowl = RecordingBowl([0.2, -0.3, 0.1, 0.4], scale=100.0)
    assert ce.fit_free(bowl, [0, 1, 2, 3], [(-1.0, 1.0)] * 4) is False
    best, _ = ce.best_with(bowl, [0, 1, 2, 3])
    # 1e4 x d^2 spread below 1e-6: d ~ 1e-5 (scipy's default fatol, 1e-4,
    # stops near 8e-5).
    assert float(np.max(np.abs(best - bowl.minimum))) < 2e-5
    assert len(bowl.evaluations) > 60


@pytest.mark.parametrize(
    ("limits", "low", "high"),
    [
        # Strict limits (Gt, Lt) and inclusive ones (Ge, Le) both bind, a
        # part in 1e9 inside; no StepTimeConfig field has a lower limit
        # above 0 or an Lt today, so one field's limits are swapped in.
        ([annotated_types.Gt(0.5), annotated_types.Lt(2.0)], 0.5 * (1 + 1e-9), 2.0 * (1 - 1e-9)),
        ([annotated_types.Ge(0.5), annotated_types.Le(2.0)], 0.5 * (1 + 1e-9), 2.0 * (1 - 1e-9)),
        ([annotated_types.Ge(0.01)], 0.1, 10.0),  # a decade each way, inside the limit
    ],
)
def test_log_bounds_honour_every_kind_of_pydantic_limit(monkeypatch, limits, low, high):
    from sim.step_time import StepTimeConfig

    monkeypatch.setattr(StepTimeConfig.model_fields["sampling_s"], "metadata", limits)
    low_x, high_x = ce.log_bounds("sampling_s", 1.0)
    assert math.exp(low_x) == pytest.approx(low, rel=1e-12) and math.exp(high_x) == pytest.approx(
        high, rel=1e-12
    )


def test_times_and_residuals_are_floats_from_object_columns():
    """A frame built from Python lists with None for "not finished" has
    object columns: the times come out float, and a request the simulation
    did not finish still counts 1 (NaN is replaced only in float arrays)."""
    requests = pd.DataFrame(
        {
            "layout": ["on", "on"],
            "request_id": [1, 2],
            "arrival_s": [0.0, 1.0],
            "first_token_s": [0.5, 1.25],
            "finished_s": [2.0, 3.0],
        },
        dtype=object,
    )
    measured = ce.finished_times(requests)
    assert measured["ttft_s"].dtype == np.float64 and measured["e2e_s"].dtype == np.float64
    simulated = measured.iloc[:1].astype(object)  # request 2 unfinished
    residuals = ce.relative_residuals(simulated, measured.astype(object))
    assert residuals.dtype == np.float64 and list(residuals) == [0.0, 1.0, 0.0, 1.0]


def test_the_rms_of_nothing_is_nan_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert math.isnan(ce.rms(np.array([])))


def test_the_fit_passes_scipy_only_options_it_knows():
    """``_fit_free``'s Nelder-Mead options are all scipy's own: a misspelt
    one (``maxfev`` lost, so the simplex would stop silently at scipy's 200
    evaluations per coefficient) makes scipy warn, which fails here."""

    class Quadratic:
        names = ("a", "b")

        def __call__(self, x: np.ndarray) -> np.ndarray:
            return x - np.array([0.1, 0.0])

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ce.fit_free(Quadratic(), [0], [(-1.0, 1.0), (-1.0, 1.0)]) is False


@pytest.mark.parametrize(("overhead_share", "fitted"), [(0.099, False), (0.1, True)])
def test_a_coefficient_under_a_tenth_of_busy_time_is_set_aside_before_the_fit(
    closed_form, monkeypatch, overhead_share, fitted
):
    """The closed-form model pins the overhead down exactly (the test
    above), yet where the engine spent under 10 % of its busy time on step
    overheads the fit leaves it at its start with the share as its reason
    (on a real replay the finite differences there take a step end crossing
    an arrival for a slope: the overhead "fitted" 29 % off, +-2.5 %).
    Exactly 10 % is fitted."""
    busy = ci.BusyTime(busy_s=1.0, prefill_s=0.0, num_steps=100, overhead_s=overhead_share)
    monkeypatch.setattr(c._Fit, "busy", lambda fit: busy)
    result = c.calibrate(closed_form, _measured(0.006, 0.4), FIT)
    overhead = result.coefficients["step_overhead_s"]
    assert ("step_overhead_s" in result.fitted) == fitted
    if not fitted:
        assert overhead.value == 0.004 and overhead.reason == (
            "the step overhead is 9.9 % of busy time (100 steps); too little to identify step_overhead_s"
        )


def test_the_share_each_coefficient_scales_is_its_phase_of_busy_time():
    """Prefill steps for the compute efficiency, the rest for the memory
    efficiency, steps x overhead for the overhead; no share for others."""
    busy = ci.BusyTime(busy_s=10.0, prefill_s=0.7, num_steps=300, overhead_s=0.3)
    assert ci.phase_share("compute_efficiency", busy) == pytest.approx(0.07)
    assert ci.phase_share("memory_efficiency", busy) == pytest.approx(0.93)
    assert ci.phase_share("step_overhead_s", busy) == pytest.approx(0.03)
    assert ci.phase_share("peak_tflops", busy) is None
    assert ci.phase_share("memory_efficiency", ci.BusyTime(0.0, 0.0, 0, 0.0)) is None
    assert ci.too_small_a_share("compute_efficiency", busy)
    assert not ci.too_small_a_share("memory_efficiency", busy)


# ------------------------------------------------ a burst the server reordered
def _sent_and_taken(**columns) -> pd.DataFrame:
    """Three requests: a long prompt sent at 0.010 s, a short one 1 ms after
    it, one alone at 6.0 s. The server took the short one in first (its clock
    starts elsewhere: 5.239 s after the client's for the fastest transit)."""
    frame = {
        "request_id": ["r000", "r001", "r002"],
        "arrival_s": [0.0, 0.001, 6.0],
        "sent_s": [0.010, 0.011, 6.0],
    }
    return pd.DataFrame({**frame, **columns})


def _order(workload: Workload) -> list[str]:
    return [spec.request_id for spec in workload.requests]


def test_a_burst_the_server_took_in_another_order_is_simulated_in_the_servers_order():
    """The server's arrivals, moved onto the client's clock by the smallest
    transit (r001's: 5.250 - 0.011 = 5.239 s): r000 5.300 - 5.239 = 0.061 s,
    r001 0.011 s, r002 11.260 - 5.239 = 6.021 s; the workload then runs
    r001 before r000. This holds whatever order a live server took a burst in on a
    given run (tests/test_calibrate_replays.py relies on HTTP timing).
    Control: without the server's arrivals the client's send order stands."""
    requests = _sent_and_taken(server_arrival_s=[5.300, 5.250, 11.260])
    arrival, source = ra.replayed_arrival_s(requests)
    assert source == ra.SERVER_ARRIVALS
    assert arrival.round(6).to_dict() == {"r000": 0.061, "r001": 0.011, "r002": 6.021}
    stamped = [(0, 40000, 0.0), (1, 200, 0.001), (2, 3000, 6.0)]
    specs = tuple(replace(tiny_spec(index, prompt), arrival_s=stamp) for index, prompt, stamp in stamped)
    base = Workload(name="burst", source="by hand", requests=specs)
    assert [spec.request_id for spec in ra.replayed_workload(base, arrival).requests] == [
        "r001",
        "r000",
        "r002",
    ]
    sent, control = ra.replayed_arrival_s(_sent_and_taken())
    assert control == ra.SENT_TIMES
    assert [spec.request_id for spec in ra.replayed_workload(base, sent).requests] == ["r000", "r001", "r002"]
