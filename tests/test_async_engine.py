"""kvsim's async engine loop (``engine.mode: async``): the pipeline clock
against a hand derivation, a lone long prompt pipelined across the stages,
determinism, the checker's view of the allocator, and the engine modes a
deployment cannot run (one line, exit 2)."""

from __future__ import annotations

import math

import pytest

from sim.analysis.runs import scenario_workload
from sim.cli import main
from sim.engine import Simulation
from sim.paths import SCENARIOS_DIR
from sim.pipeline_clock import PipelineClock
from sim.scenario import load_scenario
from sim.sched.output import ScheduledRequest, SchedulerOutput
from sim.step_time import StepTimeModel

CONFORMANCE = SCENARIOS_DIR / "conformance"


def _output(step: int, tokens: int = 1) -> SchedulerOutput:
    item = ScheduledRequest("r", tokens, 0, 0, tokens)
    return SchedulerOutput(step_index=step, scheduled=(item,) if tokens else ())


def test_the_pipeline_clock_by_hand():
    """Each stage takes 1 s, the hand-off 2 s; three steps scheduled at 0.
    Step 1: stage 0 [0, 1], stage 1 [3, 4]. Step 2: stage 0 [1, 2], stage 1
    [4, 5]. Step 3: stage 0 waits for step 1's output (the sampled-token
    broadcast, pp = 2 steps back): [4, 5], stage 1 [7, 8] (without that
    wait: stage 0 [2, 3], landing at 6). An empty step lands in order and
    costs nothing; the engine's clock moves only when it waits."""
    clock = PipelineClock(2, lambda output, stage: 1.0, lambda output: 2.0)
    landed = [clock.schedule(_output(step)) for step in (1, 2, 3)]
    assert landed == [4.0, 5.0, 8.0]
    assert clock.schedule(_output(4, tokens=0)) == 8.0
    assert clock.now_s == 0.0
    assert [clock.wait() for _ in range(4)] == [4.0, 5.0, 8.0, 8.0]


def _lone_prompt(prompt_tokens: int, mode: str, budget: int = 1024):
    return load_scenario(
        str(CONFORMANCE / "long-chunked.yaml"),
        [
            f"engine.mode={mode}",
            f"scheduler.max_num_batched_tokens={budget}",
            "workload.num_requests=1",
            f"workload.prompt={{distribution: empirical, values: [{prompt_tokens}]}}",
            "workload.output={distribution: empirical, values: [8]}",
            "simulation.sample_interval_s=null",
        ],
    )


def _prefill(scenario) -> tuple[float, list[SchedulerOutput]]:
    """The lone request's time to first token and the prefill micro-batches
    the run scheduled (its chunks, in order)."""
    simulation = Simulation(scenario, "on", scenario_workload(scenario))
    chunks: list[SchedulerOutput] = []
    if scenario.engine.mode == "async":
        schedule = simulation.clock.schedule

        def recorded(output, samples=True):
            if output.num_prefill_tokens:
                chunks.append(output)
            return schedule(output, samples)

        simulation.clock.schedule = recorded
    recording = simulation.run()
    (request,) = recording.requests.values()
    return request["first_token_s"] - request["arrival_s"], chunks


@pytest.mark.parametrize("prompt_tokens", [10_000, 100_000])
def test_a_lone_long_prompt_keeps_both_stages_busy(prompt_tokens):
    """Cold prefill at C=1 with a 1,024-token budget: consecutive chunks
    enter consecutive micro-batches (three in flight), so the prompt takes
    about the busier stage's total over its chunks (the most a two-stage
    pipeline allows), not the sum of both stages' (one stage idle at a
    time, as in the synchronous loop): at most the busier stage's total plus
    one chunk through the whole pipeline (filling it). Bounds from the
    step-time model's per-stage times of the chunks the run scheduled."""
    scenario = _lone_prompt(prompt_tokens, "async")
    model = StepTimeModel(scenario.step_time_config())
    ttft_s, chunks = _prefill(scenario)
    assert sum(c.num_prefill_tokens for c in chunks) == prompt_tokens
    busier_s = max(sum(model.stage_s(c, stage) for c in chunks) for stage in (0, 1))
    serial_s = sum(model.stage_s(c, 0) + model.handoff_s(c) + model.stage_s(c, 1) for c in chunks)
    fill_s = max(model.stage_s(c, 0) + model.handoff_s(c) + model.stage_s(c, 1) for c in chunks)
    assert busier_s <= ttft_s <= busier_s + fill_s
    assert ttft_s < 0.6 * serial_s
    # CONTROL: the synchronous loop runs the chunks one after another.
    sync_ttft_s, _ = _prefill(_lone_prompt(prompt_tokens, "sync"))
    assert sync_ttft_s > 0.9 * serial_s


def test_an_async_run_is_deterministic_and_keeps_the_allocator_sound():
    scenario = load_scenario(
        str(CONFORMANCE / "heavy-preemption.yaml"),
        # upstream's admission (no checkpoint reserve) is what makes this shape preempt
        ["engine.mode=async", "simulation.check_invariants=true", "fork.base=upstream"],
    )
    first = Simulation(scenario, "on", scenario_workload(scenario)).run()
    second = Simulation(scenario, "on", scenario_workload(scenario)).run()
    assert len(first.steps) > 0 and not first.stalled
    assert first.steps.to_dict() == second.steps.to_dict()
    finished = [r for r in first.requests.values() if not math.isnan(r["finished_s"])]
    assert len(finished) == len(first.requests)
    assert sum(first.steps.to_dict()["num_preemptions"]) >= 10


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["engine.mode=async", "deployment.kv_connector=true"], "engine.mode: async is not modelled with"),
        (["engine.mode=async", "scheduler.max_concurrent_batches=2"], "scheduler.max_concurrent_batches: 2"),
        (["engine.mode=pipelined"], "engine.mode: Input should be 'sync' or 'async'"),
    ],
)
def test_an_engine_mode_the_deployment_cannot_run_is_one_line_and_exit_2(overrides, key, capsys, tmp_path):
    args = ["run", "chat-slice", "--out", str(tmp_path / "out")]
    for override in overrides:
        args += ["--set", override]
    assert main(args) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and key in lines[0]
    assert not (tmp_path / "out").exists()
