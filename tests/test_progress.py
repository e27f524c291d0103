"""The progress bar counts the work: requests done (finished or rejected)
out of the workload's, not simulated seconds (a run's last arrival says
nothing of how long its drain takes)."""

from __future__ import annotations

import sim_helpers

import sim.engine
from sim.analysis.runs import scenario_workload
from sim.engine import Simulation


class RecordingBar:
    """Stands in for tqdm: keeps the total and every update."""

    bars: list[RecordingBar] = []

    def __init__(self, *, total, unit, disable, **_):
        self.total, self.unit, self.disable, self.updates = total, unit, disable, []
        RecordingBar.bars.append(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n):
        self.updates.append(n)


def test_the_bar_counts_requests_done_out_of_the_workloads(tmp_path, monkeypatch):
    """12 requests with prompts of 2,000 to 6,000 tokens under a
    max_model_len of 4,096: the ones whose prompt leaves no room for an
    output are rejected at arrival. Every request is done at the end,
    finished or rejected, and the bar's total is the workload's 12."""
    workload = {
        "trace": "synthetic",
        "num_requests": 12,
        "arrival": {"process": "poisson", "rate_per_s": 5.0},
        "prompt": {"distribution": "uniform", "lo": 2000, "hi": 6000},
        "output": {"distribution": "fixed", "tokens": 20},
    }
    scenario = sim_helpers.scenario(tmp_path, workload=workload, deployment={"max_model_len": 4096})
    requests = scenario_workload(scenario)
    num_too_long = sum(r.prompt_len >= 4096 for r in requests.requests)
    assert 0 < num_too_long < 12  # the case has both kinds
    RecordingBar.bars.clear()
    monkeypatch.setattr(sim.engine, "tqdm", RecordingBar)
    recording = Simulation(scenario, "on", requests, progress=True).run()
    (bar,) = RecordingBar.bars
    assert (bar.total, bar.unit, bar.disable) == (12, "req", False)
    assert sum(bar.updates) == 12 and all(n > 0 for n in bar.updates)
    assert sum(r["rejected"] for r in recording.requests.values()) == num_too_long


def test_no_bar_unless_asked(tmp_path, monkeypatch):
    scenario = sim_helpers.scenario(tmp_path, workload={**_SMALL})
    RecordingBar.bars.clear()
    monkeypatch.setattr(sim.engine, "tqdm", RecordingBar)
    Simulation(scenario, "off", scenario_workload(scenario)).run()
    assert RecordingBar.bars[0].disable is True


_SMALL = {
    "trace": "synthetic",
    "num_requests": 3,
    "arrival": {"process": "poisson", "rate_per_s": 5.0},
    "prompt": {"distribution": "fixed", "tokens": 500},
    "output": {"distribution": "fixed", "tokens": 5},
}
