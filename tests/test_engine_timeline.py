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

from sim.analysis.frames import frames
from sim.engine import simulate
from sim.scenario import Scenario, load_scenario
from sim.step_time import StepTimeModel
from sim.workloads.spec import FreshIds, RequestSpec, Workload

STEP_OVERHEAD_S = 0.2
HAND_STEP_TIME = {
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "step_overhead_s": STEP_OVERHEAD_S,
    "gpu_peak_flops": 1000.0,
    "compute_efficiency": 1.0,
    "active_params_per_token": 0.5,
    "dense_params": 0,
    "num_moe_layers": 0,
    "num_attention_layers": 0,
    "num_gdn_layers": 0,
    "ple_state_bytes": 0,
    "interconnect_bandwidth_bytes_per_s": 1e30,
    "pp_send_latency_s": 0,
    "allreduce_latency_s": 0,
    "hidden_size": 1,
    "activation_bytes": 1,
}
# Ties at one instant, in causal order: a step ends and its tokens land, then
# arrivals are handled, then the engine admits and starts the next step.
_KIND_ORDER = {"step end": 0, "first token": 1, "finish": 2, "arrive": 3, "admit": 4, "step start": 5}


@pytest.fixture(scope="module")
def hand_scenario_file(tmp_path_factory) -> Path:
    path: Path = tmp_path_factory.mktemp("timeline") / "timeline.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": "timeline",
                "seed": 0,
                "mtp": {"acceptance_rates": [0.0, 0.0, 0.0]},
                "simulation": {"sample_interval_s": None, "check_invariants": True},
                "step_time": HAND_STEP_TIME,
            }
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
        RequestSpec(
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
        "generated_tokens", "admitted", "finished", "ttft_s", "queue_s", "e2e_s", "source",
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
    """The backticked column names README.md's Outputs section lists for
    ``frame`` (its bullet runs to the next bullet)."""
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = text[text.index("## Outputs") : text.index("## Regression gates")]
    bullet = section[section.index(f"- `{frame}`:") :]
    bullet = bullet[: bullet.index("\n- ", 3)]
    names = set(re.findall(r"`([a-z0-9_]+)`", bullet)) - {frame, "sample_interval_s"}
    return names


def test_the_frames_have_the_columns_the_readme_documents(hand_scenario_file):
    """Every column README.md names for the steps and requests frames is
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
