"""``kvsim calibrate``: a replay measured on a rig whose step-time
coefficients differ from the model's (here: a simulation run with perturbed
coefficients, relabelled as a replay of the unperturbed scenario) gives back
those coefficients; a coefficient that does not move the request times is
reported as unidentifiable, never "recovered"."""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from helpers.replay_dirs import DEFAULTS, RIG, write_replay_dir
from helpers.scenarios import scenario as make_scenario

from sim.analysis import calibrate_error as ce
from sim.analysis.runs import run_scenario
from sim.cli import main
from sim.scenario import scenario_to_dict

# Prefill-heavy enough that time to first token is compute-bound (2-6 K
# prompts queue behind each other's prefills) and long enough outputs that
# the decode (memory-bound) shows in end-to-end latency: the two
# efficiencies are the coefficients these requests' times depend on most.
PREFILL_AND_DECODE = {
    "trace": "synthetic",
    "num_requests": 24,
    "arrival": {"process": "poisson", "rate_per_s": 1.0},
    "prompt": {"distribution": "uniform", "lo": 2000, "hi": 6000},
    "output": {"distribution": "uniform", "lo": 100, "hi": 250},
}
# Prompts of a few dozen tokens: every step reads more bytes than it
# computes, so the compute efficiency moves nothing.
DECODE_ONLY = {
    "trace": "synthetic",
    "num_requests": 12,
    "arrival": {"process": "poisson", "rate_per_s": 4.0},
    "prompt": {"distribution": "uniform", "lo": 16, "hi": 48},
    "output": {"distribution": "uniform", "lo": 20, "hi": 60},
}


def _replay_of(tmp_path, workload, rig: dict[str, float], name: str = "rig"):
    """The scenario as modelled, and a replay of it measured on ``rig``."""
    modelled = make_scenario(tmp_path, name, workload=workload, layouts=["on"])
    overrides = [f"step_time.{key}={value!r}" for key, value in rig.items()]
    measured = run_scenario(make_scenario(tmp_path, name, overrides, workload=workload, layouts=["on"]))
    return modelled, write_replay_dir(tmp_path / "replay", measured, scenario_to_dict(modelled))


def test_calibrate_recovers_the_rigs_coefficients(tmp_path, capsys):
    """The default fit (overhead, memory and compute efficiency): both
    efficiencies recovered, each with its interval, which holds the truth;
    the step overhead, which this replay cannot pin down, is flagged with
    its reason, left at its start and kept out of the written block."""
    _, replay = _replay_of(tmp_path, PREFILL_AND_DECODE, RIG)
    out = tmp_path / "fitted.yaml"
    assert main(["calibrate", str(replay), "--out", str(out), "--max-simulations", "100"]) == 0
    printed = capsys.readouterr().out
    assert "--- before" in printed and "--- after" in printed and "ttft_p50_s" in printed
    text = out.read_text()
    fitted = yaml.safe_load(text)["step_time"]
    assert set(fitted) == set(RIG)
    for name, truth in RIG.items():
        # Control: the model's value is no answer (the rig differs by >= 25 %).
        assert abs(DEFAULTS[name] / truth - 1) > 0.2
        assert fitted[name] == pytest.approx(truth, rel=0.05), name
        line = next(line for line in text.splitlines() if line.startswith(f"  {name}: "))
        low, high = (float(v) for v in line.split("# 95 % interval ")[1].split(" (")[0].split(" .. "))
        assert low <= truth <= high and high / low < 1.21, line
    assert "step_time:" in printed
    assert "# step_overhead_s: not identifiable from this replay (" in text
    assert "not written, 0.001 in the simulations" in text


def test_a_coefficient_without_effect_is_unidentifiable(tmp_path, capsys):
    """Decode-only load: the compute efficiency changes no request time. The
    command refuses to report it fitted, and writes nothing."""
    _, replay = _replay_of(tmp_path, DECODE_ONLY, {"compute_efficiency": 0.12 * 0.7})
    out = tmp_path / "fitted.yaml"
    assert main(["calibrate", str(replay), "--fit", "compute_efficiency", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert (
        "compute_efficiency: not identifiable from this replay: decode is 8" in captured.out
        and "% of busy time; prefills cannot identify compute_efficiency" in captured.out
    )
    assert captured.err.startswith("kvsim: error: ") and "none is identifiable" in captured.err
    assert not out.exists()


def test_screening_sees_a_coefficient_that_has_an_effect(tmp_path):
    """Control of the test above: on the same load the step overhead moves
    every request's time, and the screen says so."""
    modelled, replay = _replay_of(tmp_path, DECODE_ONLY, {"step_overhead_s": 0.006})
    from sim.results import read_run

    requests = read_run(replay)[0]["requests"]
    names = ("step_overhead_s", "compute_efficiency")
    start = {"step_overhead_s": 0.005, "compute_efficiency": 0.74}
    error = ce.RequestTimeError(modelled, ce.finished_times(requests), names, start)
    bounds = [ce.log_bounds(name, start[name]) for name in names]
    effects = ce.screen(error, bounds)
    assert ce.rms(effects["step_overhead_s"]) > 100 * ce.MIN_SENSITIVITY
    assert ce.rms(effects["compute_efficiency"]) == 0.0


def test_coefficients_that_act_alike_are_reported(tmp_path):
    """The kernel gaps and the all-reduce latency are both a fixed time per
    layer: their effects are parallel (cosine 1), so a replay cannot tell
    them apart. Control: the compute efficiency acts on prefills, not alike."""
    modelled, replay = _replay_of(tmp_path, PREFILL_AND_DECODE, RIG)
    from sim.results import read_run

    names = ("kernel_overhead_per_layer_s", "allreduce_latency_s", "compute_efficiency")
    start = {"kernel_overhead_per_layer_s": 40e-6, "allreduce_latency_s": 18e-6, **DEFAULTS}
    error = ce.RequestTimeError(modelled, ce.finished_times(read_run(replay)[0]["requests"]), names, start)
    effects = ce.screen(error, [ce.log_bounds(name, start[name]) for name in names])
    pairs = ce.alike_pairs(effects)
    assert [(a, b) for a, b, _ in pairs] == [("kernel_overhead_per_layer_s", "allreduce_latency_s")]
    # Nearly parallel, not exactly: chunks of 8 MiB and more go to NCCL's
    # ring, which the custom all-reduce's latency does not price.
    assert pairs[0][2] == pytest.approx(1.0, abs=2e-3)


def test_residuals_are_relative_and_count_unfinished_requests():
    import pandas as pd

    index = pd.MultiIndex.from_tuples([("on", "a"), ("on", "b")])
    measured = pd.DataFrame({"ttft_s": [0.5, 0.001], "e2e_s": [2.0, 4.0]}, index=index)
    simulated = pd.DataFrame({"ttft_s": [0.6], "e2e_s": [1.0]}, index=index[:1])
    # a: (0.6-0.5)/0.5, (1-2)/2; b (not finished in the simulation): 1, 1.
    expected = [0.2, ce.MISSING_RESIDUAL, -0.5, ce.MISSING_RESIDUAL]
    assert np.allclose(ce.relative_residuals(simulated, measured), expected)


def test_bad_fit_lists_are_one_line_errors(tmp_path, capsys):
    replay = tmp_path / "nowhere"
    for fit, message in (
        ("tensor_parallel_size", "cannot fit tensor_parallel_size"),
        ("step_overhead_s,step_overhead_s", "named twice"),
        ("qsa_topk_tokens", "cannot fit qsa_topk_tokens"),
    ):
        assert main(["calibrate", str(replay), "--fit", fit]) == 2
        err = capsys.readouterr().err
        assert err.startswith("kvsim: error: --fit") and message in err and err.count("\n") == 1


def test_bounds_keep_an_efficiency_at_most_one():
    low, high = ce.log_bounds("memory_efficiency", 0.5)
    assert 0.5 * np.exp(high) == pytest.approx(1.0) and 0.5 * np.exp(low) == pytest.approx(0.05)
    low, high = ce.log_bounds("step_overhead_s", 0.005)
    assert 0.005 * np.exp(high) == pytest.approx(0.05)


def test_a_replay_without_its_scenario_is_a_one_line_error(tmp_path, capsys):
    from helpers.scenarios import run

    replay = write_replay_dir(tmp_path / "replay", run(tmp_path, workload=DECODE_ONLY, layouts=["on"]), {})
    out = tmp_path / "fitted.yaml"
    assert main(["calibrate", str(replay), "--fit", "step_overhead_s", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvsim: error: ") and "no scenario recorded" in err and not out.exists()


PREFILL_ONLY = {
    "trace": "synthetic",
    "num_requests": 8,
    "arrival": {"process": "poisson", "rate_per_s": 1.0},
    "prompt": {"distribution": "uniform", "lo": 4000, "hi": 12000},
    "output": {"distribution": "uniform", "lo": 2, "hi": 8},
}


@pytest.mark.parametrize(
    ("workload", "identifiable", "not_identifiable", "reason"),
    [
        (
            DECODE_ONLY,
            "memory_efficiency",
            "compute_efficiency",
            "prefills cannot identify compute_efficiency",
        ),
        (
            PREFILL_ONLY,
            "compute_efficiency",
            "memory_efficiency",
            "decode steps cannot identify memory_efficiency",
        ),
    ],
)
def test_plan_tells_which_replay_identifies_which_coefficient(
    tmp_path, capsys, workload, identifiable, not_identifiable, reason
):
    """``--plan``: no rig, no fit. A decode-only load pins down the memory
    efficiency and not the compute efficiency; a prefill-only load the
    reverse; each coefficient not identifiable comes with its reason and
    what to replay instead (the load that does identify it)."""
    path = tmp_path / "planned.yaml"
    path.write_text(yaml.safe_dump({"name": "planned", "workload": workload}))
    assert main(["calibrate", "--plan", str(path), "--speed", "4"]) == 0
    printed = capsys.readouterr().out
    rows = {
        line.split()[0]: line for line in printed.splitlines() if line.split()[:1] and "_" in line.split()[0]
    }
    assert rows[identifiable].endswith(" identifiable") and "not identifiable" not in rows[identifiable]
    assert rows[not_identifiable].endswith("not identifiable")
    remedy = "decode-heavy slice" if not_identifiable == "memory_efficiency" else "cold long prompt"
    line = next(line for line in printed.splitlines() if line.startswith(f"kvsim: {not_identifiable}: "))
    assert reason in line and remedy in line


def test_plan_and_replay_dirs_are_exclusive(tmp_path, capsys):
    assert main(["calibrate", "--plan", "default", str(tmp_path)]) == 2
    assert "--plan: takes a scenario, not REPLAY_DIR" in capsys.readouterr().err
    assert main(["calibrate"]) == 2
    assert "name a REPLAY_DIR, or --plan SCENARIO" in capsys.readouterr().err
