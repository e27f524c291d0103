"""The async conformance gate: kvsim's batch-queue engine core and
``AsyncScheduler`` against vLLM 0.33.0's own ``EngineCore.step_with_batch_queue``
over its real ``AsyncScheduler`` (PP 2, Model Runner V2, queue depth 3) take
identical engine steps on the five conformance shapes x both layouts x both
MTP hashing modes, and with fenced frees on, and across an abort while a
step is in flight; a stagger of 1, a budget per pipeline cycle and a fence
of depth 2 each fail at the step read off vLLM's run alone, and so do
vLLM-side mutants at the edges (budget, block end, hash-unit tail, stale
output at a preemption, an abort in flight).
"""

from __future__ import annotations

import os

import pytest
from helpers import vllm_mutants
from helpers.scenarios import conformance_requests, conformance_shape

from sim.cli import main
from sim.conformance import async_engine
from sim.conformance.async_engine import run_async_conformance
from sim.conformance.driver import (
    Comparison,
    Trajectory,
    compare,
    conformance_scenario,
    plan_for,
    run_conformance,
    vllm_settings,
)
from sim.paths import SCENARIOS_DIR
from sim.sched import scheduler as scheduler_module
from sim.sched.async_scheduler import AsyncScheduler

CONFORMANCE = SCENARIOS_DIR / "conformance"
SHAPES = ("prefix-hits", "heavy-preemption", "long-chunked", "block-budget", "rig-blocks")
BUDGET = 8192  # the 8,192 shapes' max_num_batched_tokens (the scenario default)


_scenario, _requests = conformance_shape, conformance_requests


def _conform(shape: str, layout: str, mode: str, **kwargs) -> Comparison:
    return run_async_conformance(_scenario(shape), layout, _requests(shape), mtp_hash_mode=mode, **kwargs)


_REFERENCES: dict[tuple, Comparison] = {}


def _reference(shape: str, layout: str, mode: str, fenced: bool = False) -> Trajectory:
    key = (shape, layout, mode, fenced)
    if key not in _REFERENCES:
        _REFERENCES[key] = _conform(shape, layout, mode, fenced=fenced)
    return _REFERENCES[key].right  # vLLM's trajectory


# ------------------------------------------------------------------- gate
@pytest.mark.parametrize("mode", ["eagle-drop", "lookahead"])
@pytest.mark.parametrize("layout", ["off", "on"])
@pytest.mark.parametrize("shape", SHAPES)
def test_every_engine_step_is_identical(shape, layout, mode):
    comparison = _REFERENCES[(shape, layout, mode, False)] = _conform(shape, layout, mode)
    assert comparison.num_steps > 0
    assert comparison.first_difference is None, comparison.differing_fields(comparison.first_difference)
    assert comparison.conforms and not comparison.right.stalled


@pytest.mark.parametrize("shape", SHAPES)
def test_every_engine_step_is_identical_with_fenced_frees(shape):
    """vLLM's own deferral (a KV-consumer connector's) against kvsim's fence:
    both pass a fence per applied output, so under depth 3 it lags by 2."""
    comparison = _REFERENCES[(shape, "on", "eagle-drop", True)] = _conform(
        shape, "on", "eagle-drop", fenced=True
    )
    assert comparison.first_difference is None, comparison.differing_fields(comparison.first_difference)
    assert comparison.conforms


def _decode_steps(trajectory: Trajectory) -> dict[str, list[int]]:
    """Each request's steps that were decodes or final chunks (placeholders
    left in flight), in order."""
    steps: dict[str, list[int]] = {}
    for state in trajectory.steps:
        for rid, _, _, placeholders in state.scheduled_tokens:
            if placeholders:
                steps.setdefault(rid, []).append(state.step)
    return steps


def test_the_shapes_exercise_the_async_loop():
    """vLLM's own run shows what the gate is about: decodes two engine steps
    apart, consecutive chunks of one prompt in consecutive steps, outputs
    applied two steps late, empty steps, preemptions with output in flight."""
    chunked = _reference("long-chunked", "off", "eagle-drop")
    gaps = {
        b - a for steps in _decode_steps(chunked).values() for a, b in zip(steps, steps[1:], strict=False)
    }
    assert min(gaps) == 2
    prompts = {r.request_id: r.prompt_len for r in _requests("long-chunked")}
    chunk_steps = sorted(
        (rid, s.step) for s in chunked.steps for rid, c, n, _ in s.scheduled_tokens if c + n < prompts[rid]
    )
    assert any(a == (b[0], b[1] - 1) for a, b in zip(chunk_steps, chunk_steps[1:], strict=False))
    lags = {s.step - s.processed_step for s in chunked.steps if s.step and s.processed_step}
    assert lags == {2}
    preemption = _reference("heavy-preemption", "on", "eagle-drop")
    assert sum(len(s.preempted) for s in preemption.steps) >= 10
    assert any(s.step and not s.scheduled_tokens for s in preemption.steps)


# --------------------------------------------------------------- controls
def _first_index(trajectory: Trajectory, predicate) -> int:
    return next(i + 1 for i, state in enumerate(trajectory.steps) if predicate(i, state))


def test_control_a_stagger_of_one():
    """kvsim staggering decodes by 1 step (not pp = 2) fails at the first
    engine step after one in which a request, not about to finish, was
    scheduled as a decode or final chunk (vLLM skips it then)."""
    reference = _reference("prefix-hits", "off", "eagle-drop")
    decoded_in = {
        s.step: {rid for rid, _, _, p in s.scheduled_tokens if p} for s in reference.steps if s.step
    }
    expected = _first_index(
        reference,
        lambda i, s: s.step > 1 and decoded_in.get(s.step - 1, set()) - set(reference.steps[i - 1].finished),
    )
    comparison = _conform("prefix-hits", "off", "eagle-drop", stagger=1)
    assert comparison.first_difference == expected
    assert comparison.differing_fields(expected)[0] == "scheduled_tokens"


def test_control_a_budget_per_pipeline_cycle(monkeypatch):
    """kvsim giving one token budget to both micro-batches of a pipeline
    cycle (steps 2k-1, 2k) fails at the first even step whose tokens and its
    predecessor's exceed the budget in vLLM's run."""
    reference = _reference("long-chunked", "off", "eagle-drop")
    tokens = {s.step: sum(n for _, _, n, _ in s.scheduled_tokens) for s in reference.steps if s.step}
    expected = _first_index(
        reference, lambda i, s: s.step % 2 == 0 and tokens[s.step] + tokens.get(s.step - 1, 0) > BUDGET
    )
    carried = {"tokens": 0}
    original_state, original_finish = scheduler_module._StepState, AsyncScheduler._finish_schedule

    def cycle_budget(token_budget, offer=None):
        return original_state(token_budget=token_budget - carried["tokens"], offer=offer)

    def finish(self, step):
        output = original_finish(self, step)
        carried["tokens"] = output.total_num_scheduled_tokens if output.step_index % 2 else 0
        return output

    monkeypatch.setattr(scheduler_module, "_StepState", cycle_budget)
    monkeypatch.setattr(AsyncScheduler, "_finish_schedule", finish)
    comparison = _conform("long-chunked", "off", "eagle-drop")
    assert comparison.first_difference == expected
    assert comparison.differing_fields(expected)[0] == "scheduled_tokens"


def test_control_a_fence_of_depth_two(monkeypatch):
    """kvsim passing fences up to one step behind the schedule when an
    output lands (depth 2, the synchronous PP value) fails at the first
    engine call of vLLM's fenced run in which a fence decided otherwise
    than depth 2 would have."""
    reference = _vllm_fenced_run_with_depth_two_views("heavy-preemption")
    expected = next(i + 1 for i, differs in enumerate(reference) if differs)

    def depth_two(self, output):
        self._step_seqs.popleft()
        if self.config.defer_block_free and not output.is_empty:
            self._advance_processed(self.sched_step_seq - 1)

    monkeypatch.setattr(AsyncScheduler, "output_arrives", depth_two)
    comparison = _conform("heavy-preemption", "on", "eagle-drop", fenced=True)
    assert comparison.first_difference == expected
    assert "num_free_blocks" in comparison.differing_fields(expected)


def _vllm_fenced_run_with_depth_two_views(shape: str) -> list[bool]:
    """For each engine call of vLLM's fenced run: whether a fence held
    what depth 2 (fences passed up to one step before the newest scheduled
    when an output lands) would have let go: a request's blocks judged not
    freeable, or a deferred free left waiting. Read off vLLM alone."""
    from sim.conformance import async_engine
    from sim.conformance.driver import conformance_scenario, plan_for, vllm_settings

    scenario = conformance_scenario(_scenario(shape), "eagle-drop")
    section = scenario.scheduler.model_copy(update={"defer_block_free": True})
    scenario = scenario.model_copy(update={"scheduler": section})
    plan = plan_for(scenario, "on")
    engine = async_engine.vllm_engine(scenario, plan, vllm_settings(scenario, plan))
    scheduler = engine.scheduler
    scheduler.defer_block_free = True
    views: list[bool] = []
    seen = {"depth_two": 0, "differs": False}
    update, can_be_freed, step = (
        scheduler.update_from_output,
        scheduler._request_blocks_can_be_freed,
        engine.step,
    )

    def viewed_update(output, runner_output):
        if output.total_num_scheduled_tokens:
            seen["depth_two"] = max(seen["depth_two"], scheduler.sched_step_seq - 1)
        result = update(output, runner_output)
        seen["differs"] |= any(fence <= seen["depth_two"] for fence, _ in scheduler.deferred_frees)
        return result

    def viewed_can_be_freed(request):
        freeable = can_be_freed(request)
        seen["differs"] |= not freeable and request.last_sched_seq <= seen["depth_two"]
        return freeable

    def viewed_step():
        seen["differs"] = False
        result = step()
        views.append(seen["differs"])
        return result

    scheduler.update_from_output = viewed_update
    scheduler._request_blocks_can_be_freed = viewed_can_be_freed
    engine.step = viewed_step
    step_time = async_engine.StepTimeModel(scenario.step_time_config())
    async_engine.drive_engine(engine, _requests(shape), async_engine.async_clock(scenario, step_time))
    return views


# ------------------------------------------------- vLLM-side mutants (issue 41)
def _prompts(shape: str) -> dict[str, int]:
    return {r.request_id: r.prompt_len for r in _requests(shape)}


def _chunk_ending(block: int, budget: int, shape: str):
    prompts = _prompts(shape)
    return {
        "budget_one_short": lambda i, s: any(n == budget for _, _, n, _ in s.scheduled_tokens),
        "block_end_floored_one_early": lambda i, s: any(
            (c + n) % block == 0 and c + n < prompts[rid] for rid, c, n, _ in s.scheduled_tokens
        ),
        "tail_on_the_block": lambda i, s: any(
            (c + n) % block and c + n < prompts[rid] for rid, c, n, _ in s.scheduled_tokens
        ),
    }


@pytest.mark.parametrize(
    "mutant, shape, block, budget",
    [
        (vllm_mutants.budget_one_short, "block-budget", 3200, 6400),
        (vllm_mutants.block_end_floored_one_early, "block-budget", 3200, 6400),
        (vllm_mutants.tail_on_the_block, "rig-blocks", 4096, 8192),
    ],
    ids=lambda v: getattr(v, "__name__", None),
)
@pytest.mark.parametrize("mode", ["eagle-drop", "lookahead"])
def test_a_vllm_mutant_at_an_edge_fails_the_async_gate(mutant, shape, block, budget, mode, monkeypatch):
    """As the synchronous gate's (tests/test_conformance.py): the first
    difference is at the first engine step whose chunk the mutant changes,
    read off vLLM's unmutated run."""
    reference = _reference(shape, "on", mode)
    expected = _first_index(reference, _chunk_ending(block, budget, shape)[mutant.__name__])
    mutant().apply(monkeypatch)
    comparison = _conform(shape, "on", mode)
    assert comparison.first_difference == expected
    assert comparison.differing_fields(expected)[0] == "scheduled_tokens"


@pytest.mark.parametrize("layout", ["off", "on"])
def test_preemption_with_output_in_flight_is_compared(layout, monkeypatch):
    """vLLM's preemption forgetting that the output in flight is stale (a
    batch-queue case: a synchronous step has none in flight) fails the
    async gate on heavy-preemption, no earlier than its first preemption,
    and passes the synchronous gate on the same shape (which cannot reach it)."""
    reference = _reference("heavy-preemption", layout, "eagle-drop")
    first_preemption = _first_index(reference, lambda i, s: bool(s.preempted))
    vllm_mutants.stale_output_forgotten().apply(monkeypatch)
    comparison = _conform("heavy-preemption", layout, "eagle-drop")
    assert comparison.first_difference is not None and comparison.first_difference >= first_preemption
    shape = "heavy-preemption"
    result = run_conformance(_scenario(shape), layout, _requests(shape), mtp_hash_mode="eagle-drop")
    assert result.comparison.conforms


class _Aborting:
    """An async conformance engine that, right after engine call ``at_call``
    (as ``EngineCore.abort_requests`` runs between calls), aborts the first
    and last requests that call scheduled: their step is still in flight
    (its output lands pp calls later)."""

    def __init__(self, engine, at_call: int) -> None:
        self.engine, self.at_call, self.calls = engine, at_call, 0
        self.aborted: tuple[str, ...] = ()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self):
        call, state = self.engine.step()
        self.calls += 1
        if self.calls == self.at_call:
            from sim.vllm_bridge import RequestStatus

            scheduled = [rid for rid, _, _, _ in state.scheduled_tokens]
            ids = sorted({scheduled[0], scheduled[-1]})
            finished = self.engine.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            self.aborted = tuple(sorted(r.request_id for r in finished))
        return call, state


ABORT_AT_CALL = 12


def _aborted_run(shape: str, layout: str) -> tuple[Comparison, tuple[str, ...], Trajectory]:
    compared = conformance_scenario(_scenario(shape), "eagle-drop")
    plan = plan_for(compared, layout)
    vllm = _Aborting(async_engine.vllm_engine(compared, plan, vllm_settings(compared, plan)), ABORT_AT_CALL)
    vllm.scheduler.defer_block_free = False
    pp = compared.deployment.pipeline_parallel_size
    depth = async_engine.max_concurrent_batches(compared)
    kvsim = _Aborting(async_engine.kvsim_engine(compared, layout, depth=depth, stagger=pp), ABORT_AT_CALL)
    step_time = async_engine.StepTimeModel(compared.step_time_config())
    runs = [
        async_engine.drive_engine(engine, _requests(shape), async_engine.async_clock(compared, step_time))
        for engine in (kvsim, vllm)
    ]
    assert kvsim.aborted == vllm.aborted
    return compare(*runs), vllm.aborted, runs[1]


@pytest.mark.parametrize("layout", ["off", "on"])
def test_an_abort_while_a_step_is_in_flight_takes_vllms_steps(layout):
    """Two requests aborted right after the call that scheduled them (their
    output still in flight): every engine step after is vLLM's, the
    aborted requests are never scheduled again, and the output that lands
    for them is dropped."""
    comparison, aborted, vllm_run = _aborted_run("heavy-preemption", layout)
    assert len(aborted) == 2
    assert comparison.first_difference is None, comparison.differing_fields(comparison.first_difference)
    assert comparison.conforms and len(vllm_run.steps) > ABORT_AT_CALL + 10
    later = vllm_run.steps[ABORT_AT_CALL:]
    assert not set(aborted) & {rid for s in later for rid, _, _, _ in s.scheduled_tokens}
    assert not set(aborted) & {rid for s in later for rid in s.finished}


def test_an_abort_in_flight_that_keeps_the_blocks_fails_the_gate(monkeypatch):
    """vLLM's abort keeping the blocks of a request with a step in flight
    (equal to vLLM for an abort between synchronous steps:
    tests/test_aborts.py) fails at the first call after the abort, on the
    free blocks among others."""
    vllm_mutants.abort_in_flight_keeps_blocks().apply(monkeypatch)
    comparison, _, _ = _aborted_run("heavy-preemption", "on")
    assert comparison.first_difference == ABORT_AT_CALL + 1
    assert "num_free_blocks" in comparison.differing_fields(ABORT_AT_CALL + 1)


# -------------------------------------------------------------------- CLI
def test_conform_engine_async_exits_0_when_identical(capsys):
    status = main(["conform", str(CONFORMANCE / "long-chunked.yaml"), "--engine", "async", "--layout", "off"])
    out = capsys.readouterr().out
    assert status == 0
    assert "identical engine steps: 100 of 100 (100.0 %)" in out and "3 micro-batches in flight" in out


def test_conform_engine_async_exits_1_and_prints_the_first_difference(capsys, monkeypatch):
    """CONTROL for the exit status: no stagger, through the CLI (the first
    decode two steps after its final chunk is one step early)."""
    reference = _reference("long-chunked", "on", "eagle-drop")
    decoded = _decode_steps(reference)
    expected = min(steps[0] for steps in decoded.values()) + 1
    monkeypatch.setattr(AsyncScheduler, "_skips_running", lambda self, request: False)
    status = main(["conform", str(CONFORMANCE / "long-chunked.yaml"), "--engine", "async"])
    out = capsys.readouterr().out
    assert status == 1
    assert f"first difference at step {expected}: scheduled_tokens" in out


def test_the_reference_leaves_model_runner_v2_unselected_for_later_schedulers():
    """The engine core selects Model Runner V2 only while it builds its
    scheduler: a synchronous Scheduler built later in the process (the sync
    gate) still lists resumed requests apart from new ones."""
    before = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    _conform("long-chunked", "off", "eagle-drop")
    assert os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == before


# ------------------------------------------------ the rig's deployment
def test_every_engine_step_is_identical_on_the_rigs_block_flags():
    """The rig as shipped hashes on a 64-token prefix-match unit under
    4,096-token blocks with RecoverSSM (``default``). vLLM's requests must be
    hashed on the scheduler's hash block, as its engine core hashes them:
    hashed on the block size, vLLM's own Mamba manager asserts while caching
    a prompt's partial-block state (fewer block hashes than the unit needs),
    which is how ``kvsim bench default --against vllm`` crashed."""
    from sim.analysis.runs import scenario_workload
    from sim.scenario import load_scenario

    scenario = load_scenario("chat-slice", ["fork=upstream", "workload.max_requests=6"])
    assert (scenario.deployment.block_size, scenario.deployment.prefix_match_unit) == (4096, 64)
    comparison = run_async_conformance(scenario, "on", scenario_workload(scenario).requests)
    assert comparison.num_steps > 0
    assert comparison.first_difference is None, comparison.differing_fields(comparison.first_difference)
    assert comparison.conforms and not comparison.right.stalled
