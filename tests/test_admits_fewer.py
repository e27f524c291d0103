"""The shipped scenario where the new layout admits fewer requests than the
old one (scenarios/admits-fewer.yaml; README: "When the new layout admits
fewer"): it fits more requests at once, which then preempt one another."""

from __future__ import annotations

import pytest

from sim.analysis.runs import run_scenario
from sim.scenario import load_scenario

HORIZON_S = 180.0  # the shipped run stops at 300 s; the reversal shows by 180 s


@pytest.fixture(scope="module")
def requests():
    scenario = load_scenario("admits-fewer", [f"simulation.max_time_s={HORIZON_S}"])
    result = run_scenario(scenario)
    return result.requests, result.summary.set_index("layout")


def _admitted_by(requests, layout: str, time_s: float) -> int:
    rows = requests[requests["layout"] == layout]
    return int((rows["admitted_s"] < time_s).sum())


def test_the_new_layout_admits_fewer(requests):
    frame, summary = requests
    assert summary.loc["on", "num_admitted"] < summary.loc["off", "num_admitted"]
    assert _admitted_by(frame, "on", HORIZON_S) < _admitted_by(frame, "off", HORIZON_S)
    # The mechanism: more at once, then preemptions.
    assert summary.loc["on", "peak_concurrency"] > summary.loc["off", "peak_concurrency"]
    assert summary.loc["on", "num_preemptions"] > 2 * summary.loc["off", "num_preemptions"]


def test_before_the_outputs_grow_the_new_layout_admits_more(requests):
    """Control: the reversal is not a constant handicap of the new layout.
    While the first requests still fit their prompt's blocks (admission is
    causal, so counting admissions before 60 s is a 60 s run) it admits more."""
    frame, _ = requests
    assert _admitted_by(frame, "on", 60.0) > _admitted_by(frame, "off", 60.0)
