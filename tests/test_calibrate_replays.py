"""Calibration a user can trust, against ``kvsim serve`` standing in for a
rig whose step times differ from the model's (all three default
coefficients perturbed): what each replay can identify is fitted within
5 %, what it cannot is flagged with a reason drawn from it and left at its
start, and the error at the rig's true coefficients is within the replay's
noise of 0 -- also where the server took a burst in another order than the
trace sent it.

Three replays, each its own server (127.0.0.1, started and stopped by
``kvsim replay --launch``, every wait bounded):

- a compressed burst: a 40K-token prompt sent a millisecond before six
  short ones (the server parses the long body last, so it takes the short
  ones first), then single requests and a second burst; prefill-bound:
  the compute efficiency is identifiable, the memory efficiency is not;
- a decode-heavy load (prompts of a few dozen tokens, long outputs): the
  memory efficiency is identifiable, the compute efficiency is not;
- a prefill-heavy load (4-12K-token prompts, outputs of a few tokens): the
  compute efficiency is identifiable, the memory efficiency is not.

Failing controls, on the burst: a fit that ignores the intervals (every
coefficient fitted), and a fit on per-request TTFT in trace order (the
replay's arrivals dropped), each break what the test asserts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers.scenarios import write_scenario

from sim.analysis import calibrate as c
from sim.analysis.calibrate_error import RequestTimeError, rms
from sim.analysis.replayed_arrivals import replay_target
from sim.cli import main
from sim.commands.calibrate import DEFAULT_FIT
from sim.commands.validate import reorder_window_s
from sim.results import read_run
from sim.scenario import load_scenario
from sim.step_time import StepTimeConfig

# The model's start (the step-time model's defaults, docs/step-time-model.md)
# and the rig: prefill 30 % slower, decode 25 % slower, half a millisecond
# more per step.
START = {
    name: StepTimeConfig.model_fields[name].default
    for name in ("step_overhead_s", "memory_efficiency", "compute_efficiency")
}
RIG = {
    "step_overhead_s": START["step_overhead_s"] + 0.0005,
    "memory_efficiency": START["memory_efficiency"] * 0.75,
    "compute_efficiency": START["compute_efficiency"] * 0.7,
}
# Scenario seconds per wall second: each replay takes a few wall seconds
# (the server's start-up, ~6 s, dominates).
SPEED = 10.0
TOLERANCE = 0.05
# The error at the truth that is "within noise of 0": a replay's per-request
# times carry the server's MTP draws (another order of random draws than
# the simulation's) and its HTTP timing; measured 0.009-0.036 here.
NOISE = 0.05
BURST_CSV = "\n".join(
    ["arrival_s,input_tokens,output_tokens", "0.000,40000,30"]
    + ["0.001,200,80"] * 6
    + ["6.0,3000,100", "9.0,6000,50", "12.0,800,120", "15.0,24000,20"]
    + ["15.001,300,60"] * 4
)
DECODE_HEAVY = {
    "trace": "synthetic",
    "num_requests": 16,
    "arrival": {"process": "poisson", "rate_per_s": 2.0},
    "prompt": {"distribution": "uniform", "lo": 16, "hi": 48},
    "output": {"distribution": "uniform", "lo": 100, "hi": 300},
}
PREFILL_HEAVY = {
    "trace": "synthetic",
    "num_requests": 12,
    "arrival": {"process": "poisson", "rate_per_s": 1.0},
    "prompt": {"distribution": "uniform", "lo": 4000, "hi": 12000},
    "output": {"distribution": "uniform", "lo": 2, "hi": 8},
}


def _replay(root: Path, name: str, workload: dict) -> tuple[Path, Path]:
    """The scenario (as modelled) and its replay against a rig server."""
    scenario = write_scenario(
        root, name, deployment={"max_num_seqs": 16}, simulation={"sample_interval_s": 0.5}, workload=workload
    )
    rig = " ".join(f"--set step_time.{key}={value!r}" for key, value in RIG.items())
    server = f"{sys.executable} -m sim.cli serve {scenario} --layout on --port {{port}} --speed {SPEED} {rig}"
    out = root / f"{name}-replay"
    argv = ["replay", str(scenario), "--layout", "on", "--launch", "--server-cmd", server]
    argv += ["--speed", str(SPEED), "--out", str(out), "--boot-timeout", "120", "--request-timeout", "120"]
    assert main(argv) == 0, name
    return scenario, out


@pytest.fixture(scope="module")
def replays(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("calibrate-replays")
    (root / "burst.csv").write_text(BURST_CSV + "\n")
    return {
        "burst": _replay(root, "burst", {"trace": str(root / "burst.csv")}),
        "decode": _replay(root, "decode", DECODE_HEAVY),
        "prefill": _replay(root, "prefill", PREFILL_HEAVY),
    }


def _calibrate(
    replay: tuple[Path, Path], requests=None, max_simulations: int = 100
) -> tuple[c.Calibration, float]:
    """The calibration of the default fit, and the RMS error of the same
    comparison at the rig's true coefficients."""
    scenario_path, replay_dir = replay
    scenario = load_scenario(str(scenario_path))
    if requests is None:
        requests = read_run(replay_dir)[0]["requests"]
    window_s = reorder_window_s([replay_dir])
    result = c.calibrate(
        scenario, requests, DEFAULT_FIT, max_simulations=max_simulations, reorder_window_s=window_s
    )
    target = replay_target(scenario, requests, window_s)
    names = tuple(RIG)
    at_truth = RequestTimeError(
        scenario, target.measured, names, RIG,
        workloads=target.workloads, burst_of=target.burst_of, floor_s=max(0.01, target.floor_s),
    )  # fmt: skip
    return result, rms(at_truth(np.zeros(len(names))))


def _problems(result: c.Calibration, rms_at_truth: float, identifiable: set[str]) -> list[str]:
    """What a calibration a user can trust must not do (empty: none)."""
    problems = []
    for name, coefficient in result.coefficients.items():
        if name in identifiable and coefficient.status != "fitted":
            problems.append(f"{name}: {coefficient.status}, not fitted ({coefficient.reason})")
        elif name in identifiable and abs(coefficient.value / RIG[name] - 1) > TOLERANCE:
            problems.append(f"{name}: {coefficient.value:.4g}, not within 5 % of {RIG[name]:.4g}")
        elif name not in identifiable and coefficient.status == "fitted":
            problems.append(f"{name}: fitted ({coefficient.value:.4g}) though this replay cannot identify it")
        elif name not in identifiable and (coefficient.value != START[name] or not coefficient.reason):
            problems.append(f"{name}: moved to {coefficient.value:.4g} or without a reason")
    if not rms_at_truth < NOISE:
        problems.append(f"the error at the truth is {rms_at_truth:.3f}, not within noise ({NOISE}) of 0")
    return problems


def test_the_server_took_the_burst_in_another_order_than_sent(replays):
    """The premise: the short prompts sent after the 40K-token one reached
    the server first (it reports when it took each in). That is HTTP timing:
    on a loaded machine the client may send the next one only after the
    server took the long one in (seen once in CI: 9 ms apart on the wall),
    so a burst taken in order skips, saying so, rather than failing. The
    server's order is then simulated as it came; the reordered case is held
    by hand in tests/test_values_calibrate.py, whatever this run did."""
    requests = read_run(replays["burst"][1])[0]["requests"].set_index("request_id")
    assert requests["server_arrival_s"].notna().all()
    assert requests.loc["r000001", "sent_s"] > requests.loc["r000000", "sent_s"]
    if requests.loc["r000001", "server_arrival_s"] >= requests.loc["r000000", "server_arrival_s"]:
        pytest.skip("the server took this run's burst in the order sent (HTTP timing)")


def test_a_compressed_burst_identifies_the_compute_efficiency_only(replays):
    result, at_truth = _calibrate(replays["burst"])
    assert _problems(result, at_truth, {"compute_efficiency"}) == []
    memory = result.coefficients["memory_efficiency"]
    assert memory.status == "not identifiable from this replay"
    assert memory.reason.startswith("prefill is ") and memory.reason.endswith(
        "% of busy time; decode steps cannot identify memory_efficiency"
    )
    low, high = result.coefficients["compute_efficiency"].interval
    assert high / low < 1.1  # the 95 % interval, +-5 % at most


def test_a_fit_that_ignores_the_intervals_goes_red(replays, monkeypatch):
    """Control: every coefficient with an effect fitted, none set aside
    (neither for its interval, nor for the two acting alike, nor for a
    budget that ran out before it converged, nor for scaling too small a
    share of the busy time)."""
    for limit in ("MAX_HALF_WIDTH", "HOPELESS_HALF_WIDTH"):
        monkeypatch.setattr(c, limit, np.inf)
    monkeypatch.setattr(c, "too_small_a_share", lambda name, busy: False)
    monkeypatch.setattr(c, "alike_pairs", lambda effects: ())
    monkeypatch.setattr(c._Fit, "_set_aside_unconverged", lambda fit, derivatives: None)
    result, at_truth = _calibrate(replays["burst"], max_simulations=50)
    assert _problems(result, at_truth, {"compute_efficiency"}) != []


def test_a_fit_on_per_request_ttft_in_trace_order_goes_red(replays):
    """Control: the replay's own arrivals dropped, so the burst is simulated
    at the trace's stamps, in the trace's order, and matched request by
    request: the error at the truth is far from 0."""
    requests = read_run(replays["burst"][1])[0]["requests"].drop(columns=["sent_s", "server_arrival_s"])
    result, at_truth = _calibrate(replays["burst"], requests)
    assert "requests matched one by one" in result.arrivals
    problems = _problems(result, at_truth, {"compute_efficiency"})
    assert problems != [] and at_truth > 2 * NOISE


def test_a_decode_heavy_replay_identifies_the_memory_efficiency(replays):
    result, at_truth = _calibrate(replays["decode"])
    assert _problems(result, at_truth, {"memory_efficiency"}) == []
    compute = result.coefficients["compute_efficiency"]
    assert compute.reason.startswith("decode is ") and compute.reason.endswith(
        "% of busy time; prefills cannot identify compute_efficiency"
    )


def test_a_prefill_heavy_replay_identifies_the_compute_efficiency(replays):
    result, at_truth = _calibrate(replays["prefill"])
    assert _problems(result, at_truth, {"compute_efficiency"}) == []
    assert result.coefficients["memory_efficiency"].reason.startswith("prefill is ")


def test_the_command_prints_every_interval_and_writes_only_what_it_fitted(replays, tmp_path, capsys):
    out = tmp_path / "fitted.yaml"
    assert main(["calibrate", str(replays["burst"][1]), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    table = printed.split("interval_95")[1].split("RMS relative error")[0]
    for name in DEFAULT_FIT:
        row = next(line for line in table.splitlines() if line.startswith(name))
        assert " .. " in row or "unbounded" in row, row
    assert "memory_efficiency: not identifiable from this replay: prefill is" in printed
    assert set(yaml.safe_load(out.read_text())["step_time"]) == {"compute_efficiency"}
    assert "the server's own arrivals" in out.read_text()
