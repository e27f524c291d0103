"""The engine's clock, in SimPy's own test style: exact (time, event)
sequences for small hand-computed cases (issue 10).

Every case runs the shipped Flash-Next model with a ``step_time:`` override
that makes a step's duration hand-computable. With TP = PP = 1 there is one
micro-batch; no dense or MoE weights, no attention, GDN or PLE state means
the stage reads no bytes; two FLOPs per active parameter (0.5) per token
over 1,000 FLOP/s at full efficiency is 1 ms per scheduled token; the
interconnect is so fast that the hand-off adds < 1e-26 s; the overhead is
0.2 s. So (docs/step-time-model.md's formula with these coefficients):

    step_s = 0.2 + num_scheduled_tokens / 1000

Draft acceptance is 0 (MTP drafts are never accepted), so every decode step
schedules 1 + K = 4 tokens (0.204 s) and yields exactly one output token.
Prompts are shorter than one 3,200-token block and the token budget (8,192)
holds them, so each prefill is one step. Expected times are derived by hand
in each docstring, never by calling the step-time model.

The events come from the public frames only (the requests frame's
``arrival_s``/``admitted_s``/``first_token_s``/``finished_s``, the steps
frame's ``time_s``/``step_time_s``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest
import yaml
from helpers.scenarios import HAND_STEP_TIME, RecordingBar, pre_rig

import sim.engine
import sim.engine_assembly
from sim.analysis.frames import frames
from sim.engine import Simulation, simulate
from sim.kv_cache_plan import plan_kv_cache
from sim.scenario import Scenario, load_scenario
from sim.sched.fast_path.memos import FastPath
from sim.step_time import StepTimeModel
from sim.workloads.spec import FreshIds, Workload, WorkloadRequest

STEP_OVERHEAD_S = HAND_STEP_TIME["step_overhead_s"]
# Ties at one instant, in causal order: a step ends and its tokens land, then
# arrivals are handled, then the engine admits and starts the next step.
_KIND_ORDER = {"step end": 0, "first token": 1, "finish": 2, "arrive": 3, "admit": 4, "step start": 5}


@pytest.fixture(scope="module")
def hand_scenario_file(tmp_path_factory) -> Path:
    path: Path = tmp_path_factory.mktemp("timeline") / "timeline.yaml"
    path.write_text(
        yaml.safe_dump(
            pre_rig(
                {
                    "name": "timeline",
                    "seed": 0,
                    "mtp": {"acceptance_rates": [0.0, 0.0, 0.0]},
                    "simulation": {"sample_interval_s": None, "check_invariants": True},
                    "step_time": HAND_STEP_TIME,
                }
            )
        )
    )
    return path


@pytest.fixture(scope="module")
def hand_scenario(hand_scenario_file) -> Scenario:
    return load_scenario(str(hand_scenario_file))


def _workload(*requests: tuple[str, float, int, int]) -> Workload:
    """(request id, arrival s, prompt tokens, output tokens); fresh prompt
    content, so no prefix hits change the work."""
    ids = FreshIds()
    specs = tuple(
        WorkloadRequest(
            request_id=rid,
            arrival_s=arrival_s,
            prompt_len=prompt,
            output_len=output,
            prefix_ids=ids.take(-(-prompt // 512)),
            prefix_unit=512,
        )
        for rid, arrival_s, prompt, output in requests
    )
    return Workload(name="timeline", source="hand-built", requests=specs)


def _run(scenario: Scenario, workload: Workload) -> tuple[pd.DataFrame, pd.DataFrame]:
    steps, requests, _, _ = frames(simulate(scenario, "off", workload))
    return steps, requests


def _timeline(steps: pd.DataFrame, requests: pd.DataFrame) -> list[tuple[float, str]]:
    """Every event the frames record, as SimPy would log it: (time, what)."""
    events = []
    for row in requests.itertuples():
        for kind, time_s in (
            ("arrive", row.arrival_s),
            ("admit", row.admitted_s),
            ("first token", row.first_token_s),
            ("finish", row.finished_s),
        ):
            if not pd.isna(time_s):
                events.append((round(float(time_s), 9), kind, row.request_id))
    for row in steps.itertuples():
        events.append((round(float(row.time_s - row.step_time_s), 9), "step start", f"{row.step}"))
        events.append((round(float(row.time_s), 9), "step end", f"{row.step}"))
    events.sort(key=lambda e: (e[0], _KIND_ORDER[e[1]], e[2]))
    return [(time_s, f"{kind} {who}") for time_s, kind, who in events]


def test_an_idle_engine_admits_at_the_arrival_and_a_step_ends_at_start_plus_step_time(hand_scenario):
    """r0 (1,000-token prompt, 2 outputs) arrives at 1.0 on an idle engine:
    admitted at 1.0; its prefill step takes 0.2 + 1000/1000 = 1.2 s, ending
    at 2.2 (first token); one decode step of 4 tokens, 0.204 s, ends at 2.404
    (second token: finished). The engine then idles until r1 (300-token
    prompt, 1 output) arrives at 10.0: admitted at 10.0, its prefill takes
    0.2 + 0.3 = 0.5 s, first token and finish at 10.5."""
    steps, requests = _run(hand_scenario, _workload(("r0", 1.0, 1000, 2), ("r1", 10.0, 300, 1)))
    assert _timeline(steps, requests) == [
        (1.0, "arrive r0"),
        (1.0, "admit r0"),
        (1.0, "step start 1"),
        (2.2, "step end 1"),
        (2.2, "first token r0"),
        (2.2, "step start 2"),
        (2.404, "step end 2"),
        (2.404, "finish r0"),
        (10.0, "arrive r1"),
        (10.0, "admit r1"),
        (10.0, "step start 3"),
        (10.5, "step end 3"),
        (10.5, "first token r1"),
        (10.5, "finish r1"),
    ]
    by_id = requests.set_index("request_id")
    # queue_s = admitted - arrival; ttft_s = first token - arrival; e2e.
    assert by_id["queue_s"].tolist() == [0.0, 0.0]
    assert by_id["ttft_s"].tolist() == pytest.approx([1.2, 0.5], abs=1e-12)
    assert by_id["e2e_s"].tolist() == pytest.approx([1.404, 0.5], abs=1e-12)
    assert steps["step_time_s"].tolist() == pytest.approx([1.2, 0.204, 0.5], abs=1e-12)


def test_an_arrival_during_a_step_waits_for_the_next_step(hand_scenario):
    """r0 (1,000 tokens, 3 outputs) arrives at 0.0 and is prefilled in step 1
    (0.0 -> 1.2). r1 (500 tokens, 2 outputs) arrives at 0.5, mid-step: it is
    admitted when step 2 starts, at 1.2 (queue 0.7 s). Step 2 carries r0's
    decode (4 tokens) and r1's prefill (500): 0.2 + 0.504 = 0.704 s, ending
    at 1.904 (r0's second token, r1's first: TTFT 1.404). Step 3: two
    decodes, 8 tokens, 0.208 s, ending at 2.112: r0's third token and r1's
    second, both finish."""
    steps, requests = _run(hand_scenario, _workload(("r0", 0.0, 1000, 3), ("r1", 0.5, 500, 2)))
    assert _timeline(steps, requests) == [
        (0.0, "arrive r0"),
        (0.0, "admit r0"),
        (0.0, "step start 1"),
        (0.5, "arrive r1"),
        (1.2, "step end 1"),
        (1.2, "first token r0"),
        (1.2, "admit r1"),
        (1.2, "step start 2"),
        (1.904, "step end 2"),
        (1.904, "first token r1"),
        (1.904, "step start 3"),
        (2.112, "step end 3"),
        (2.112, "finish r0"),
        (2.112, "finish r1"),
    ]
    by_id = requests.set_index("request_id")
    assert by_id["queue_s"].tolist() == pytest.approx([0.0, 0.7], abs=1e-12)
    assert by_id["ttft_s"].tolist() == pytest.approx([1.2, 1.404], abs=1e-12)
    assert steps["num_scheduled_tokens"].tolist() == [1000, 504, 8]
    assert steps["num_admitted"].tolist() == [1, 1, 0]


def test_arrivals_at_one_instant_join_the_same_step(hand_scenario):
    """r0 (400 tokens) and r1 (600 tokens), one output each, both arrive at
    3.0 on an idle engine. The arrivals process hands both to the scheduler
    before the engine (woken by the first) runs, so one step prefills both:
    1,000 tokens, 1.2 s, both first tokens (and finishes) at 4.2."""
    steps, requests = _run(hand_scenario, _workload(("r0", 3.0, 400, 1), ("r1", 3.0, 600, 1)))
    assert _timeline(steps, requests) == [
        (3.0, "arrive r0"),
        (3.0, "arrive r1"),
        (3.0, "admit r0"),
        (3.0, "admit r1"),
        (3.0, "step start 1"),
        (4.2, "step end 1"),
        (4.2, "first token r0"),
        (4.2, "first token r1"),
        (4.2, "finish r0"),
        (4.2, "finish r1"),
    ]


def test_control_halved_step_times_move_every_event(hand_scenario, monkeypatch):
    """FAILING CONTROL: a step-time model that halves every step (the
    mutant the issue names) shifts the first token of the idle-engine case
    from 2.2 to 1.6 (1.0 + 1.2 / 2), and the timeline assertion sees it."""
    original = StepTimeModel.step_time_s
    monkeypatch.setattr(StepTimeModel, "step_time_s", lambda self, output: original(self, output) / 2)
    steps, requests = _run(hand_scenario, _workload(("r0", 1.0, 1000, 2)))
    assert (1.6, "first token r0") in _timeline(steps, requests)
    assert (2.2, "first token r0") not in _timeline(steps, requests)


def test_each_step_row_records_what_the_step_did(hand_scenario):
    """The steps frame of the mid-step-arrival case, column by column (hand
    count): step 1 prefills r0 (1,000 prompt tokens, 1 token sampled) while
    r1 waits; step 2 decodes r0 (4 tokens: 1 + 3 drafts, none accepted) and
    prefills r1 (500), 2 tokens sampled; step 3 decodes both (8 tokens, 6
    drafts), 2 sampled, both finish and nothing is left running. Step 1's
    waiting gauge is 0: r1 arrived while it ran, and vLLM's engine core adds
    arrivals between steps, so its stats do not count r1 yet."""
    steps, requests = _run(hand_scenario, _workload(("r0", 0.0, 1000, 3), ("r1", 0.5, 500, 2)))
    columns = [
        "step",
        "num_requests_running",
        "num_requests_waiting",
        "num_scheduled_requests",
        "num_prefill_tokens",
        "num_decode_tokens",
        "num_admitted",
        "num_resumed",
        "num_preemptions",
        "num_finished",
        "num_generation_tokens",
        "num_draft_tokens",
        "num_accepted_tokens",
    ]
    assert steps[columns].values.tolist() == [
        [1, 1, 0, 1, 1000, 0, 1, 0, 0, 0, 1, 0, 0],
        [2, 2, 0, 2, 500, 4, 1, 0, 0, 0, 2, 3, 0],
        [3, 0, 0, 2, 0, 8, 0, 0, 0, 2, 2, 6, 0],
    ]
    by_id = requests.set_index("request_id")
    assert by_id["generated_tokens"].tolist() == [3, 2]
    assert by_id["prompt_tokens"].tolist() == [1000, 500] and by_id["output_tokens"].tolist() == [3, 2]
    assert not by_id["rejected"].any() and by_id["num_preemptions"].tolist() == [0, 0]
    assert by_id["prefix_hit_tokens"].tolist() == [0, 0]


def test_the_sampler_reads_the_gauges_each_interval_until_the_engine_stops(hand_scenario_file):
    """Sampling every 1 s over the mid-step-arrival case: at 0.0 r0 is
    already admitted (the processes start in the order arrivals, engine,
    sampler); at 1.0 r0 runs and r1 (arrived 0.5) waits; at 2.0 both run
    (step 3, 1.904 -> 2.112). The engine stops at 2.112, so there is no
    sample at 3.0."""
    sampled = load_scenario(str(hand_scenario_file), ["simulation.sample_interval_s=1.0"])
    recording = simulate(sampled, "off", _workload(("r0", 0.0, 1000, 3), ("r1", 0.5, 500, 2)))
    _, _, samples, summary = frames(recording)
    columns = ["time_s", "num_requests_running", "num_requests_waiting"]
    assert samples[columns].values.tolist() == [[0.0, 1, 0], [1.0, 1, 1], [2.0, 2, 0]]
    assert summary["num_rejected"] == 0 and not summary["stalled"]
    # The run lasts until the engine stops (2.112), not until the sampler's
    # next tick (3.0): 5 output tokens / 2.112 s, whatever the interval.
    assert summary["duration_s"] == pytest.approx(2.112, abs=1e-12)
    assert summary["output_throughput_tokens_per_s"] == pytest.approx(5 / 2.112, abs=1e-9)


@pytest.mark.parametrize("interval_s", [None, 0.3, 5.0])
def test_the_duration_does_not_depend_on_the_sampling_interval(hand_scenario_file, interval_s):
    """Same case, sampled every 0.3 s, every 5 s (one sample, at 0.0: the
    next tick falls long after the end) or not at all: 2.112 s each time."""
    sampled = load_scenario(str(hand_scenario_file), [f"simulation.sample_interval_s={interval_s or 'null'}"])
    recording = simulate(sampled, "off", _workload(("r0", 0.0, 1000, 3), ("r1", 0.5, 500, 2)))
    assert recording.end_time_s == pytest.approx(2.112, abs=1e-12)


def test_a_horizon_ends_the_run_while_the_engine_still_runs(hand_scenario_file):
    """max_time_s 1.5 cuts the same case mid-step 2 (1.2 -> 1.904): the run
    lasts 1.5 s."""
    cut = load_scenario(str(hand_scenario_file), ["simulation.max_time_s=1.5"])
    recording = simulate(cut, "off", _workload(("r0", 0.0, 1000, 3), ("r1", 0.5, 500, 2)))
    assert recording.end_time_s == 1.5


def test_a_prompt_too_long_is_rejected_at_its_arrival(hand_scenario):
    """A prompt of max_model_len tokens (262,144) leaves no room for an
    output token: rejected on arrival, never admitted, counted once."""
    steps, requests = _run(hand_scenario, _workload(("r0", 0.0, 262_144, 1), ("r1", 1.0, 300, 1)))
    by_id = requests.set_index("request_id")
    assert by_id["rejected"].tolist() == [True, False]
    assert pd.isna(by_id.loc["r0", "admitted_s"]) and by_id.loc["r1", "admitted_s"] == 1.0
    # The rejected request keeps its arrival record: nothing happened to it.
    rejected = by_id.loc["r0"]
    assert pd.isna(rejected["first_token_s"]) and pd.isna(rejected["finished_s"])
    assert (rejected["generated_tokens"], rejected["prefix_hit_tokens"], rejected["num_preemptions"]) == (
        0,
        0,
        0,
    )
    assert set(requests.columns) == {
        "scenario", "layout", "request_id", "arrival_s", "prompt_tokens", "output_tokens", "rejected",
        "admitted_s", "first_token_s", "finished_s", "num_preemptions", "prefix_hit_tokens",
        "generated_tokens", "turn", "admitted", "finished", "ttft_s", "queue_s", "e2e_s", "source",
    }  # fmt: skip


@pytest.mark.parametrize("layout, kv_cache_tokens", [("off", 806_792), ("on", 853_994)])
def test_each_layout_simulates_its_own_pool(hand_scenario, layout, kv_cache_tokens):
    """The simulation plans the pool of the layout it is asked for: the
    seed's figures, 806,792 tokens in the old layout and 853,994 in the new;
    the frames carry the layout and the scenario's name."""
    recording = simulate(hand_scenario, layout, _workload(("r0", 0.0, 300, 1)))
    steps, requests, _, summary = frames(recording)
    assert summary["kv_cache_tokens"] == kv_cache_tokens
    assert set(steps["layout"]) == set(requests["layout"]) == {layout} == {summary["layout"]}
    assert set(requests["scenario"]) == {"timeline"}


def _readme_columns(frame: str) -> set[str]:
    """The backticked column names the Outputs section of
    docs/scenarios-and-outputs.md lists for ``frame`` (its bullet runs to
    the next bullet)."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "scenarios-and-outputs.md").read_text()
    section = text[text.index("## Outputs") :]
    bullet = section[section.index(f"- `{frame}`:") :]
    bullet = bullet[: bullet.index("\n- ", 3)]
    names = set(re.findall(r"`([a-z0-9_]+)`", bullet)) - {frame, "sample_interval_s"}
    return names


def test_the_frames_have_the_columns_the_readme_documents(hand_scenario_file):
    """Every column the docs name for the steps and requests frames is
    recorded, and the samples frame carries the steps frame's gauges
    (the README: "the gauges every sample_interval_s")."""
    sampled = load_scenario(str(hand_scenario_file), ["simulation.sample_interval_s=1.0"])
    steps, requests, samples, _ = frames(simulate(sampled, "off", _workload(("r0", 0.0, 1000, 3))))
    steps_named, requests_named = _readme_columns("steps"), _readme_columns("requests")
    assert len(steps_named) >= 15 and len(requests_named) >= 10  # the parser found the lists
    assert steps_named <= set(steps.columns), steps_named - set(steps.columns)
    assert requests_named <= set(requests.columns), requests_named - set(requests.columns)
    gauges = {"num_requests_running", "num_requests_waiting", "num_free_blocks", "num_deferred_blocks"}
    assert gauges | {"time_s", "kv_cache_usage_perc"} <= set(samples.columns)


# ------------------------------------------------------- issue 10, round 2
def test_the_clock_stops_at_the_horizon_even_mid_step(hand_scenario_file):
    """The idle-engine case under ``simulation.max_time_s = 2.3``: step 1
    (1.0 -> 2.2) ends, step 2 (2.2 -> 2.404) is still running at 2.3 and
    never ends, and r1 (due at 10.0) never arrives. The clock reads 2.3."""
    stopped = load_scenario(str(hand_scenario_file), ["simulation.max_time_s=2.3"])
    recording = simulate(stopped, "off", _workload(("r0", 1.0, 1000, 2), ("r1", 10.0, 300, 1)))
    steps, requests, _, summary = frames(recording)
    assert _timeline(steps, requests) == [
        (1.0, "arrive r0"),
        (1.0, "admit r0"),
        (1.0, "step start 1"),
        (2.2, "step end 1"),
        (2.2, "first token r0"),
    ]
    assert recording.end_time_s == 2.3 and summary["duration_s"] == 2.3


def test_a_run_stopped_at_its_horizon_can_be_continued(hand_scenario_file):
    """After ``run`` stops at 2.3 a caller may advance the same clock on:
    step 2 ends at 2.404 and r1's step at 10.5, as without a horizon."""
    stopped = load_scenario(str(hand_scenario_file), ["simulation.max_time_s=2.3"])
    simulation = Simulation(stopped, "off", _workload(("r0", 1.0, 1000, 2), ("r1", 10.0, 300, 1)))
    assert simulation.run().end_time_s == 2.3
    simulation.env.run()
    recording = simulation.finish()
    assert [round(t, 9) for t in recording.steps.to_dict()["time_s"]] == [2.2, 2.404, 10.5]
    assert recording.end_time_s == 10.5


def test_the_samples_carry_the_running_totals(hand_scenario_file):
    """The mid-step-arrival case sampled every 1 s. At 0.0 and 1.0 no step
    has ended: every total is 0. At 2.0 steps 1 (r0's prefill, 1 token) and
    2 (r0's decode + r1's prefill, 2 tokens, 3 drafts from r0's decode, none
    accepted) have ended: prompts 1,000 + 500 counted at their first tokens,
    3 tokens generated, 3 drafts, no preemption."""
    sampled = load_scenario(str(hand_scenario_file), ["simulation.sample_interval_s=1.0"])
    _, _, samples, _ = frames(simulate(sampled, "off", _workload(("r0", 0.0, 1000, 3), ("r1", 0.5, 500, 2))))
    columns = [
        "num_prompt_total_tokens",
        "num_generation_total_tokens",
        "num_draft_total_tokens",
        "num_accepted_total_tokens",
        "num_preemptions_total",
    ]
    assert samples[columns].values.tolist() == [[0, 0, 0, 0, 0], [0, 0, 0, 0, 0], [1500, 3, 3, 0, 0]]


def test_the_sampler_stops_at_the_row_cap_and_says_so(hand_scenario_file, monkeypatch):
    """With the cap at 2 rows the sampler records 0.0 and 1.0, then stops
    (the engine runs on to 2.112) and marks the samples truncated."""
    monkeypatch.setattr(sim.engine, "MAX_SAMPLE_ROWS", 2)
    sampled = load_scenario(str(hand_scenario_file), ["simulation.sample_interval_s=1.0"])
    steps, _, samples, summary = frames(
        simulate(sampled, "off", _workload(("r0", 0.0, 1000, 3), ("r1", 0.5, 500, 2)))
    )
    assert samples["time_s"].tolist() == [0.0, 1.0] and summary["samples_truncated"]
    assert steps["time_s"].round(9).tolist() == [1.2, 1.904, 2.112]


def test_a_sampler_started_before_the_engine_is_refused(hand_scenario):
    """The sampler reads the engine process's life: started alone it fails
    loudly instead of sampling forever."""
    simulation = Simulation(hand_scenario, "off", _workload(("r0", 0.0, 300, 1)))
    with pytest.raises(AssertionError, match=r"^start\(\) registers the engine before the sampler$"):
        next(simulation.sampler(1.0))


def test_a_caller_may_advance_the_clock_itself(hand_scenario):
    """``start`` then ``env.run`` a little at a time (no progress bar): at 2.0
    r0's prefill (0.0 -> 1.2) has ended and step 2 (1.2 -> 1.904) too; the
    rest runs to 2.112; ``finish`` stamps the clock and the rejections
    (r2's prompt is max_model_len long)."""
    workload = _workload(("r0", 0.0, 1000, 3), ("r1", 0.5, 500, 2), ("r2", 0.6, 262_144, 1))
    simulation = Simulation(hand_scenario, "off", workload)
    simulation.start()
    simulation.env.run(until=2.0)
    assert len(simulation.recording.steps) == 2
    simulation.env.run()
    recording = simulation.finish()
    assert recording.end_time_s == pytest.approx(2.112, abs=1e-12)
    assert recording.num_rejected == 1 and not recording.stalled


@pytest.mark.parametrize("progress", [True, False, None], ids=["asked", "not-asked", "default"])
def test_the_progress_bar_counts_requests_done(hand_scenario, monkeypatch, progress):
    """The bar (stderr only, off unless asked, shown after 3 s of wall time,
    not left behind) counts the work: requests done out of the workload's 2.
    In the mid-step case (r1 arriving at 0.25, during step 1) both finish in
    step 3, at 2.112: one update of 2, and it reads 2 of 2. Labelled with
    the scenario and the layout. The default is off, for ``simulate`` and
    ``Simulation`` alike."""
    monkeypatch.setattr(sim.engine, "tqdm", RecordingBar)
    RecordingBar.made = []
    workload = _workload(("r0", 0.0, 1000, 3), ("r1", 0.25, 500, 2))
    if progress is None:
        Simulation(hand_scenario, "off", workload).run()
        simulate(hand_scenario, "off", workload)
    else:
        simulate(hand_scenario, "off", workload, progress=progress)
    bar = RecordingBar.made[-1]
    assert len(RecordingBar.made) == (1 if progress is not None else 2)
    assert all(made.kwargs["disable"] is (not progress) for made in RecordingBar.made)
    assert bar.kwargs == {
        "total": 2,
        "unit": "req",
        "delay": 3,
        "disable": not progress,
        "desc": "timeline [off]",
        "leave": False,
    }
    assert bar.updates == [2] and bar.n == 2


def test_the_progress_bar_counts_rejections_and_stops_short_at_a_horizon(
    hand_scenario, hand_scenario_file, monkeypatch
):
    """A prompt of max_model_len tokens is rejected at its arrival (0.0):
    done, +1. r1 (1.0, 1,000 tokens, 2 outputs) is prefilled 1.0 -> 2.2 and
    would finish at 2.404, past the 2.3 horizon; r2 arrives at 10.0, after
    it. The bar reads 1 of 3."""
    monkeypatch.setattr(sim.engine, "tqdm", RecordingBar)
    RecordingBar.made = []
    stopped = load_scenario(str(hand_scenario_file), ["simulation.max_time_s=2.3"])
    workload = _workload(("r0", 0.0, 262_144, 1), ("r1", 1.0, 1000, 2), ("r2", 10.0, 300, 1))
    simulate(stopped, "on", workload, progress=True)
    (bar,) = RecordingBar.made
    assert (bar.kwargs["total"], bar.kwargs["desc"], bar.updates) == (3, "timeline [on]", [1])


def test_a_pool_no_request_fits_stalls_the_engine(hand_scenario, monkeypatch):
    """A 10-block pool holds no 3,100-token request (it needs an attention
    block, a ring block and a block per Mamba group, far over 10): nothing
    is ever scheduled. r0 (0.0) waits; r1 (5.0) wakes the engine, which
    finds nothing fits, sees no arrival left and stops: stalled, with both
    requests unadmitted and no step; the clock ends at 5.0. (The validated
    plans always fit a max_model_len request; this is the safety net.)"""
    real = sim.engine_assembly.build_kv_cache_manager
    monkeypatch.setattr(
        sim.engine_assembly, "build_kv_cache_manager", lambda plan, **kw: real(plan, **kw, num_gpu_blocks=10)
    )
    no_check = hand_scenario.model_copy(
        update={"simulation": hand_scenario.simulation.model_copy(update={"check_invariants": False})}
    )
    recording = simulate(no_check, "off", _workload(("r0", 0.0, 3100, 1), ("r1", 5.0, 3100, 1)))
    steps, requests, _, summary = frames(recording)
    assert summary["stalled"] and recording.stalled and len(steps) == 0
    assert requests["admitted_s"].isna().all() and recording.end_time_s == 5.0


# Two 7,000-token prompts with the same content, one output token each: r0
# at 0.0, r1 at 20.0 (r0 long finished). Hand derivation (vLLM 0.33.0's
# Mamba "align" split and MTP hashing, K = 3, 3,200-token blocks):
# - eagle-drop, caching on: a prefill chunk ends at the last cacheable block
#   boundary, floor(7000 / 3200) = 2 blocks less the EAGLE-dropped one =
#   3,200: r0 runs 3,200 (0.2 + 3.2 = 3.4 s) then 3,800 (4.0 s, to 7.4). r1
#   hits the 2 matched blocks less the dropped one, 3,200 tokens, and
#   computes 3,800 in one step: 20.0 -> 24.0.
# - lookahead, caching on: a hash also covers the next token, the
#   checkpoint is floor(6999 / 3200) blocks = 6,400 and nothing is dropped:
#   r0 runs 6,400 (6.6 s) then 600 (0.8 s, to 7.4); r1 hits 6,400 and
#   computes 600: 20.0 -> 20.8.
# - caching off (either mode): vLLM turns the lookahead hashes off without
#   caching, so the split is eagle-drop's; no hit: r1 repeats r0's two
#   steps, 20.0 -> 23.4 -> 27.4.
SWITCH_CASES = {
    "eagle-drop": ([], [3.4, 7.4, 24.0], 3200),
    "lookahead": (["scheduler.mtp_hash_mode=lookahead"], [6.6, 7.4, 20.8], 6400),
    "no-caching": (["allocator.enable_prefix_caching=false"], [3.4, 7.4, 23.4, 27.4], 0),
    "no-caching-lookahead": (
        ["allocator.enable_prefix_caching=false", "scheduler.mtp_hash_mode=lookahead"],
        [3.4, 7.4, 23.4, 27.4],
        0,
    ),
}


def _same_prompt_twice() -> Workload:
    prompt = FreshIds().take(14)  # 14 x 512 >= 7,000 tokens, shared
    return Workload(
        name="timeline",
        source="hand-built",
        requests=tuple(
            WorkloadRequest(
                request_id=rid,
                arrival_s=at,
                prompt_len=7000,
                output_len=1,
                prefix_ids=prompt,
                prefix_unit=512,
            )
            for rid, at in (("r0", 0.0), ("r1", 20.0))
        ),
    )


@pytest.mark.parametrize("case", list(SWITCH_CASES))
def test_the_prefix_caching_switches_move_the_repeated_prompts_steps(hand_scenario_file, case):
    """The scenario's hashing mode and prefix-caching switch reach both the
    scheduler and the allocator: the step ends and r1's hit move as derived
    above (SWITCH_CASES)."""
    overrides, step_ends_s, hit_tokens = SWITCH_CASES[case]
    scenario = load_scenario(str(hand_scenario_file), overrides)
    steps, requests = _run(scenario, _same_prompt_twice())
    assert steps["time_s"].round(9).tolist() == step_ends_s
    by_id = requests.set_index("request_id")
    assert by_id["prefix_hit_tokens"].tolist() == [0, hit_tokens]
    assert by_id.loc["r1", "ttft_s"] == pytest.approx(step_ends_s[-1] - 20.0, abs=1e-9)


@pytest.mark.parametrize("case", list(SWITCH_CASES))
def test_vllms_scheduler_takes_the_derived_steps(hand_scenario_file, case):
    """The independent check of SWITCH_CASES: vLLM 0.33.0's own Scheduler,
    driven by the conformance clock over the same trace, ends its steps at
    the derived times and reports the derived hit."""
    from sim.conformance.driver import drive, plan_for, vllm_backend

    overrides, step_ends_s, hit_tokens = SWITCH_CASES[case]
    scenario = load_scenario(str(hand_scenario_file), ["scheduler.defer_block_free=false", *overrides])
    trajectory = drive(
        vllm_backend(scenario, plan_for(scenario, "off")),
        _same_prompt_twice().requests,
        StepTimeModel(scenario.step_time_config()),
    )
    assert [round(t, 9) for t in trajectory.times_s] == step_ends_s
    assert sum(step.prefix_cache_hits_tokens for step in trajectory.steps) == hit_tokens


def test_preemptions_and_sampled_drafts_are_vllms(hand_scenario_file, monkeypatch):
    """A 40-block pool (max_model_len 6,400), three 3,100-token prompts with
    200 outputs 0.1 s apart, drafts accepted with probability 0.5: outputs
    cross the 3,200-token block boundary and the pool runs out, so the
    newest running request is preempted and resumed, again and again.
    vLLM's own Scheduler (fences off, as vLLM without a connector), driven
    by the conformance clock with the engine's RNG stream for the seed (the
    stream both backends share, ``sim.conformance.backends.model_runner``),
    is the expected value: every step ends at the same instant, and each
    request's preemption count is the number of steps that preempted it
    (r1 five times, measured on vLLM)."""
    from sim.conformance.driver import drive, vllm_backend

    scenario = load_scenario(
        str(hand_scenario_file),
        [
            "deployment.max_model_len=6400",
            "mtp.acceptance_rates=[0.5,0.5,0.5]",
            "scheduler.defer_block_free=false",
            # vLLM's own Scheduler is the oracle for upstream only.
            "fork=upstream",
        ],
    )
    plan = plan_kv_cache(
        scenario.load_model(), scenario.deployment, side_cache_layout=False, num_gpu_blocks_override=40
    )
    monkeypatch.setattr(sim.engine_assembly, "plan_kv_cache", lambda *args, **kwargs: plan)
    ids = FreshIds()
    workload = Workload(
        name="timeline",
        source="hand-built",
        requests=tuple(
            WorkloadRequest(
                request_id=f"r{i}",
                arrival_s=0.1 * i,
                prompt_len=3100,
                output_len=200,
                prefix_ids=ids.take(7),
                prefix_unit=512,
            )
            for i in range(3)
        ),
    )
    steps, requests = _run(scenario, workload)
    vllm = drive(vllm_backend(scenario, plan), workload.requests, StepTimeModel(scenario.step_time_config()))
    assert steps["time_s"].round(9).tolist() == [round(t, 9) for t in vllm.times_s]
    preempted = [r for step in vllm.steps for r in step.preempted]
    expected = {rid: preempted.count(rid) for rid in ("r0", "r1", "r2")}
    assert expected == {"r0": 0, "r1": 5, "r2": 0}
    assert dict(zip(requests["request_id"], requests["num_preemptions"], strict=True)) == expected
    assert steps["num_accepted_tokens"].sum() > 0  # the draws mattered


def test_fenced_frees_the_engine_waits_out_match_the_conformance_clock():
    """The conformance heavy-preemption shape (a quarter-size pool, 24
    requests crossing block boundaries) with the fork's fenced frees on:
    once, every running request needs blocks that only a preempted
    victim's fenced free returns, so nothing can be scheduled until the
    steps in flight complete. The engine must then complete them and go
    on, not stop: its steps are those of the conformance driver's clock
    (``sim.conformance.driver.drive``, the same engine model written
    without SimPy) over kvsim's scheduler, and every request finishes."""
    from sim.analysis.runs import scenario_workload
    from sim.conformance.driver import drive, kvsim_backend
    from sim.paths import SCENARIOS_DIR

    scenario = load_scenario(str(SCENARIOS_DIR / "conformance" / "heavy-preemption.yaml"))
    assert scenario.scheduler.defer_block_free
    workload = scenario_workload(scenario)
    steps, requests = _run(scenario, workload)
    expected = drive(
        kvsim_backend(scenario, "off"),
        workload.requests,
        StepTimeModel(scenario.step_time_config()),
    )
    assert not expected.stalled and len(expected.steps) > 100
    assert steps["time_s"].round(9).tolist() == [round(t, 9) for t in expected.times_s]
    assert requests["finished_s"].notna().all() and len(requests) == 24


@pytest.mark.parametrize("fast_path", [True, False])
def test_the_fast_path_switch_reaches_the_scheduler(hand_scenario_file, fast_path):
    """``simulation.fast_path`` decides whether the scheduler keeps settled
    windows (the frames are the same either way: tests/test_fast_path.py),
    and the timeline with it off is the one the cases above derive."""
    scenario = load_scenario(str(hand_scenario_file), [f"simulation.fast_path={str(fast_path).lower()}"])
    simulation = Simulation(scenario, "off", _workload(("r0", 0.0, 1000, 3), ("r1", 0.5, 500, 2)))
    assert isinstance(simulation.scheduler.fast_path, FastPath) is fast_path
    steps, _, _, summary = frames(simulation.run())
    assert steps["time_s"].tolist() == pytest.approx([1.2, 1.904, 2.112], abs=1e-12)
    assert summary["duration_s"] == pytest.approx(2.112, abs=1e-12)
