"""The conformance report's figures against hand trajectories: when it says
"conforms", the identical share, the first difference, the clock that
drives both backends, how victims are ordered before they are compared, and
what the fenced-frees line compares. No vLLM: a scripted backend and hand
step states stand in, so each figure is derived by hand."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
from helpers.values import compared_step, trajectory

from sim.commands import conform as conform_command
from sim.conformance.backends import KvsimBackend
from sim.conformance.driver import Comparison, ConformanceResult, Trajectory, compare, drive
from sim.sched.output import ScheduledRequest, SchedulerOutput


# ----------------------------------------------------------- the comparison
@pytest.mark.parametrize(
    ("left", "right", "identical", "share", "first", "conforms"),
    [
        ([3, 2, 1], [3, 2, 1], 3, 1.0, None, True),
        ([3, 2, 1], [3, 9, 1], 2, 2 / 3, 2, False),  # one step differs, later ones match again
        ([3, 2, 1], [3, 2], 2, 2 / 3, 3, False),  # the right side stopped a step early
        ([3, 2], [3, 2, 1, 0], 2, 2 / 4, 3, False),  # the left side did
        ([], [], 0, 1.0, None, True),  # nothing ran on either side
        ([], [5], 0, 0.0, 1, False),
    ],
)
def test_identical_steps_share_and_first_difference(left, right, identical, share, first, conforms):
    comparison = compare(trajectory("kvsim", left), trajectory("vllm", right))
    assert comparison.num_steps == max(len(left), len(right))
    assert comparison.num_identical_steps == identical
    assert comparison.identical_share == pytest.approx(share)
    assert comparison.first_difference == first
    assert comparison.conforms is conforms


@pytest.mark.parametrize(("left_stalled", "right_stalled"), [(True, False), (False, True)])
def test_identical_steps_with_one_backend_stalled_do_not_conform(left_stalled, right_stalled):
    comparison = compare(trajectory("kvsim", [1, 2], left_stalled), trajectory("vllm", [1, 2], right_stalled))
    assert comparison.first_difference is None and comparison.identical_share == 1.0
    assert not comparison.conforms
    both = compare(trajectory("kvsim", [1, 2], True), trajectory("vllm", [1, 2], True))
    assert both.conforms  # both stalled alike: the same behaviour


def test_differing_fields_name_exactly_the_fields_that_differ():
    left = compared_step(preempted=("a",), num_free_blocks=3, waiting=("a",))
    right = compared_step(preempted=("b",), num_free_blocks=3, waiting=("a",), prefix_cache_hits_tokens=64)
    comparison = Comparison(
        left=Trajectory(backend="kvsim", steps=(left,), times_s=(0.0,), stalled=False),
        right=Trajectory(backend="vllm", steps=(right,), times_s=(0.0,), stalled=False),
    )
    assert comparison.differing_fields(1) == ["preempted", "prefix_cache_hits_tokens"]
    short = compare(trajectory("kvsim", [1, 2]), trajectory("vllm", [1]))
    assert short.differing_fields(2) == ["(step missing)"]
    assert short.state(short.right, 2) is None and short.state(short.left, 2).num_free_blocks == 2


# ---------------------------------------------------------------- the clock
class ScriptedBackend:
    """Each request needs ``steps`` steps; every step runs all that arrived
    and have steps left. ``empty_steps`` empty outputs come first, each
    answered by ``complete_in_flight`` (True: a fenced free returned)."""

    name = "scripted"

    def __init__(self, empty_steps: int = 0, complete_in_flight: bool = True, stall: bool = False):
        self.left: dict[str, int] = {}
        self.added: list[str] = []
        self.empty_steps, self.complete_in_flight, self.stall = empty_steps, complete_in_flight, stall

    def add_request(self, spec) -> bool:
        self.added.append(spec.request_id)
        self.left[spec.request_id] = spec.steps
        return True

    def has_unfinished_requests(self) -> bool:
        return any(self.left.values())

    def schedule(self) -> SchedulerOutput:
        if self.stall or self.empty_steps:
            self.empty_steps = max(0, self.empty_steps - 1)
            return SchedulerOutput(step_index=0, scheduled=())
        running = [rid for rid, n in self.left.items() if n]
        return SchedulerOutput(
            step_index=0, scheduled=tuple(ScheduledRequest(r, 1, 0, 0, 0) for r in running)
        )

    def complete_in_flight_steps(self) -> bool:
        return self.complete_in_flight

    def execute(self, output: SchedulerOutput):
        for item in output.scheduled:
            self.left[item.request_id] -= 1
        return compared_step(running=tuple(item.request_id for item in output.scheduled))


HALF_SECOND = SimpleNamespace(step_time_s=lambda output: 0.5)


def _request(request_id: str, arrival_s: float, steps: int):
    return SimpleNamespace(request_id=request_id, arrival_s=arrival_s, steps=steps)


def test_the_clock_runs_steps_back_to_back_and_idles_to_the_next_arrival():
    """r1 (0 s, two steps) ends at 1.0 s; the engine idles to r2's arrival at
    3 s, whose step ends at 3.5 s. r3 arrives exactly as step 1 ends (0.5 s)
    and joins step 2."""
    requests = [_request("r2", 3.0, 1), _request("r3", 0.5, 1), _request("r1", 0.0, 2)]
    backend = ScriptedBackend()
    run = drive(backend, requests, HALF_SECOND)
    assert run.times_s == (0.5, 1.0, 3.5)
    assert [s.running for s in run.steps] == [("r1",), ("r1", "r3"), ("r2",)]
    assert backend.added == ["r1", "r3", "r2"] and run.stalled is False and run.backend == "scripted"


def test_requests_arriving_together_join_in_id_order():
    backend = ScriptedBackend()
    drive(backend, [_request("b", 1.0, 1), _request("a", 1.0, 1), _request("c", 0.0, 1)], HALF_SECOND)
    assert backend.added == ["c", "a", "b"]


@pytest.mark.parametrize(
    ("horizon_s", "times_s"), [(0.9, (0.5,)), (1.0, (0.5, 1.0)), (0.5, (0.5,)), (3.2, (0.5, 1.0))]
)
def test_a_step_that_would_end_past_the_horizon_never_ends(horizon_s, times_s):
    """A step ending exactly at the horizon counts; one ending past it does
    not; none starts at or after the horizon (r2 arrives at 3 s)."""
    run = drive(ScriptedBackend(), [_request("r1", 0.0, 2), _request("r2", 3.0, 1)], HALF_SECOND, horizon_s)
    assert run.times_s == times_s and not run.stalled


def test_an_empty_step_lets_steps_in_flight_complete_without_time_passing():
    run = drive(ScriptedBackend(empty_steps=2), [_request("r1", 0.0, 1)], HALF_SECOND)
    assert run.times_s == (0.5,) and not run.stalled


def test_a_backend_that_schedules_nothing_with_nothing_to_wait_for_has_stalled():
    run = drive(ScriptedBackend(complete_in_flight=False, stall=True), [_request("r1", 0.0, 1)], HALF_SECOND)
    assert run.stalled and run.steps == ()
    # With an arrival still to come the engine waits for it instead, then stalls.
    backend = ScriptedBackend(complete_in_flight=False, stall=True)
    run = drive(backend, [_request("r1", 0.0, 1), _request("r2", 2.0, 1)], HALF_SECOND)
    assert run.stalled and backend.added == ["r1", "r2"]


# ------------------------------------------------------------- the victims
def test_victims_and_finished_requests_are_compared_in_id_order():
    """vLLM reports its preempted requests as a set, so kvsim's backend puts
    its victims (chosen newest first) in id order before comparing; the
    finished ones likewise. Other lists keep queue order."""
    backend = object.__new__(KvsimBackend)
    output = SchedulerOutput(
        step_index=1,
        scheduled=(ScheduledRequest("r9", 1, 10, 0, 0), ScheduledRequest("r1", 2, 4, 0, 0)),
        new_request_ids=("r9",),
        preempted_request_ids=("r7", "r10", "r3"),
        prefix_cache_queries=128,
        prefix_cache_hits=64,
    )
    outcome = SimpleNamespace(finished={"r5": 3, "r2": 8})
    backend._scheduled = SimpleNamespace(output=output)
    backend.core = SimpleNamespace(complete=lambda step: outcome)
    backend.scheduler = SimpleNamespace(
        running=[SimpleNamespace(request_id=r) for r in ("r9", "r1")],
        waiting=[SimpleNamespace(request_id=r) for r in ("r7", "r3")],
    )
    backend.kv_cache_manager = SimpleNamespace(block_pool=SimpleNamespace(get_num_free_blocks=lambda: 17))
    state = backend.execute(output)
    assert state == compared_step(
        scheduled_tokens=(("r9", 10, 1), ("r1", 4, 2)),
        admitted=("r9",),
        preempted=("r10", "r3", "r7"),
        finished=("r2", "r5"),
        running=("r9", "r1"),
        waiting=("r7", "r3"),
        num_free_blocks=17,
        prefix_cache_queries_tokens=128,
        prefix_cache_hits_tokens=64,
    )


# ---------------------------------------------------------------- the report
def _report(monkeypatch, capsys, comparison: Comparison, fence: Comparison | None = None) -> tuple[int, str]:
    hashing = SimpleNamespace(
        use_eagle_block_drop=True, num_hash_lookahead_tokens=0, num_prefill_lookahead_tokens=1
    )
    result = ConformanceResult(
        comparison=comparison,
        kvsim_hashing=hashing,
        vllm_hashing=hashing,
        vllm_ring_slot_packing=True,
        fence=fence,
    )
    scenario = SimpleNamespace(name="hand", scheduler=SimpleNamespace(mtp_hash_mode="eagle-drop"))
    monkeypatch.setattr("sim.scenario.load_scenario", lambda *a, **k: scenario)
    monkeypatch.setattr("sim.analysis.runs.scenario_workload", lambda s: SimpleNamespace(requests=()))
    monkeypatch.setattr("sim.conformance.driver.run_conformance", lambda *a, **k: result)
    args = argparse.Namespace(scenario="hand", set=[], layout="on", mtp_hash_mode=None, engine="sync")
    status = conform_command.cmd_conform(args)
    return status, capsys.readouterr().out


def test_the_report_says_conforms_only_when_every_step_is_identical(monkeypatch, capsys):
    status, out = _report(
        monkeypatch, capsys, compare(trajectory("kvsim", [4, 3]), trajectory("vllm", [4, 3]))
    )
    assert status == 0 and "identical steps: 2 of 2 (100.0 %) (kvsim 2 steps, vllm 2)" in out
    assert out.rstrip().endswith("conforms: every step identical")
    status, out = _report(
        monkeypatch, capsys, compare(trajectory("kvsim", [4, 3, 2]), trajectory("vllm", [4, 5, 2]))
    )
    assert status == 1 and "conforms" not in out
    assert "identical steps: 2 of 3 (66.7 %) (kvsim 3 steps, vllm 3)" in out
    assert "first difference at step 2: num_free_blocks" in out
    assert "  kvsim:\n" in out and "    num_free_blocks: 3" in out and "    num_free_blocks: 5" in out


def test_the_report_names_a_stall_and_a_missing_step(monkeypatch, capsys):
    stalled = compare(trajectory("kvsim", [4], stalled=True), trajectory("vllm", [4]))
    status, out = _report(monkeypatch, capsys, stalled)
    assert status == 1 and "differs: stalled kvsim=True vllm=False" in out
    status, out = _report(monkeypatch, capsys, compare(trajectory("kvsim", [4]), trajectory("vllm", [4, 2])))
    assert status == 1 and "first difference at step 2: (step missing)" in out
    assert out.count("    (no such step)") == 1


def test_the_fenced_frees_line_compares_fence_off_with_fence_on(monkeypatch, capsys):
    """Off: 3 steps, free blocks 5, 2, 4; on: 4 steps, 5, 1, 3, 6 (step 1
    identical): 3 of 4 steps change, first at step 2, min free 2 -> 1."""
    fence = compare(trajectory("fence off", [5, 2, 4]), trajectory("fence on", [5, 1, 3, 6]))
    same = compare(trajectory("kvsim", [1]), trajectory("vllm", [1]))
    _, out = _report(monkeypatch, capsys, same, fence)
    assert (
        "fenced frees (kvsim only, the fork's setting): 3 of 4 steps change (first at step 2); "
        "steps 3 -> 4; min free blocks 2 -> 1"
    ) in out
    unchanged = compare(trajectory("fence off", [5, 2]), trajectory("fence on", [5, 2]))
    _, out = _report(monkeypatch, capsys, same, unchanged)
    assert "0 of 2 steps change (none); steps 2 -> 2; min free blocks 2 -> 2" in out


def test_the_fork_report_prints_the_step_before_the_first_difference(capsys):
    """``--fork``'s difference: the step before (identical on both sides),
    then both sides at the first differing step (it imported a name the
    module does not have, so a fork that differed ended in an ImportError)."""
    conform_command._print_difference(compare(trajectory("kvsim", [4, 3, 2]), trajectory("fork", [4, 3, 5])))
    out = capsys.readouterr().out
    assert out.startswith("step 2 (identical on both sides):\n") and "    num_free_blocks: 3\n" in out
    assert "first difference at step 3: num_free_blocks" in out and "  fork:\n" in out


def test_long_lists_are_cut_to_twelve_with_their_count():
    assert conform_command._short(tuple(range(13))) == f"{list(range(12))} ... (13 in all)"
    assert conform_command._short(tuple(range(12))) == str(list(range(12)))
    assert conform_command._short(7) == "7"


# ------------------------------------------------------- the fence figure
def test_the_fence_effect_is_kvsim_with_fenced_frees_off_against_on():
    """Left: kvsim as compared with vLLM (frees at once), the same steps
    ``drive`` gives it; right: the fork's fenced frees. Until the schedules
    part, the fenced side never has more free blocks (a fenced free returns
    a step later), and at some step it has fewer."""
    from sim.analysis.runs import scenario_workload
    from sim.conformance.driver import conformance_scenario, fence_effect, kvsim_backend
    from sim.paths import SCENARIOS_DIR
    from sim.scenario import load_scenario
    from sim.step_time import StepTimeModel

    scenario = conformance_scenario(
        load_scenario(str(SCENARIOS_DIR / "conformance" / "heavy-preemption.yaml"))
    )
    requests = scenario_workload(scenario).requests
    step_time = StepTimeModel(scenario.step_time_config())
    fence = fence_effect(scenario, "off", requests, step_time)
    assert (fence.left.backend, fence.right.backend) == ("fence off", "fence on")
    assert not scenario.scheduler.defer_block_free
    assert (
        fence.left.steps
        == drive(kvsim_backend(scenario, "off"), requests, step_time, scenario.simulation.max_time_s).steps
    )
    parted = next(
        (
            i
            for i, (a, b) in enumerate(zip(fence.left.steps, fence.right.steps, strict=False))
            if a.scheduled_tokens != b.scheduled_tokens
        ),
        min(len(fence.left.steps), len(fence.right.steps)),
    )
    pairs = list(zip(fence.left.steps[:parted], fence.right.steps[:parted], strict=True))
    assert pairs and all(on.num_free_blocks <= off.num_free_blocks for off, on in pairs)
    assert any(on.num_free_blocks < off.num_free_blocks for off, on in pairs)
    assert fence.first_difference is not None


def _long_chunked():
    from sim.analysis.runs import scenario_workload
    from sim.paths import SCENARIOS_DIR
    from sim.scenario import load_scenario

    scenario = load_scenario(str(SCENARIOS_DIR / "conformance" / "long-chunked.yaml"))
    return scenario, scenario_workload(scenario).requests


def test_the_compared_scenario_turns_fenced_frees_off_and_keeps_or_sets_the_hashing():
    from sim.conformance.driver import conformance_scenario

    scenario, _ = _long_chunked()
    assert scenario.scheduler.defer_block_free
    kept = conformance_scenario(scenario)
    assert kept.scheduler.defer_block_free is False
    assert kept.scheduler.mtp_hash_mode == scenario.scheduler.mtp_hash_mode == "eagle-drop"
    assert conformance_scenario(scenario, "lookahead").scheduler.mtp_hash_mode == "lookahead"


def test_a_conformance_run_stops_both_sides_at_the_horizon_and_adds_the_fence_only_when_asked():
    """The horizon half-way through the full run: both trajectories stop
    there, as ``drive`` stops each; the fence comparison only on request,
    as kvsim fenced off against on."""
    from sim.conformance.driver import run_conformance

    scenario, requests = _long_chunked()
    full = run_conformance(scenario, "off", requests, mtp_hash_mode="lookahead")
    assert full.fence is None and full.comparison.conforms
    horizon_s = full.comparison.left.times_s[len(full.comparison.left.times_s) // 2]
    section = scenario.simulation.model_copy(update={"max_time_s": horizon_s})
    cut = run_conformance(
        scenario.model_copy(update={"simulation": section}),
        "off",
        requests,
        mtp_hash_mode="lookahead",
        with_fence_effect=True,
    )
    for side in (cut.comparison.left, cut.comparison.right):
        assert side.times_s[-1] <= horizon_s < full.comparison.left.times_s[-1]
        assert len(side.steps) == len(full.comparison.left.steps) // 2 + 1
    assert cut.comparison.conforms
    assert cut.fence is not None and (cut.fence.left.backend, cut.fence.right.backend) == (
        "fence off",
        "fence on",
    )
    assert cut.fence.left.steps == cut.comparison.left.steps
    assert max(cut.fence.right.times_s) <= horizon_s


@pytest.mark.parametrize(
    ("error_text", "shown"),
    [
        ("first line\nsecond line", "first line"),
        ("x" * 300, "x" * 200),
        ("", ""),
    ],
    ids=["first-line", "cut-at-200", "empty"],
)
def test_an_unbuildable_scheduler_is_named_by_the_first_line_of_its_error(monkeypatch, error_text, shown):
    import sim.vllm_bridge.scheduler  # noqa: F401  (loaded, so it can be patched)
    from sim.conformance.driver import BackendUnavailable, plan_for, vllm_backend

    def refuse(**kwargs):
        raise TypeError(error_text)

    scenario, _ = _long_chunked()
    plan = plan_for(scenario, "off")
    monkeypatch.setattr("sim.vllm_bridge.scheduler.VllmSchedulerSettings", refuse)
    with pytest.raises(BackendUnavailable) as caught:
        vllm_backend(scenario, plan)
    assert str(caught.value) == f"vLLM's Scheduler cannot be built (TypeError: {shown})"


# ------------------------------------------------ the backends' own records
def test_both_backends_hand_the_step_time_model_the_same_records():
    """What the step-time model reads of each step (every request's
    scheduled, computed, draft and prompt tokens; the step index; who was
    admitted, resumed, preempted) is the same from vLLM's Scheduler as from
    kvsim's, step for step over the long-chunked trace in lookahead mode;
    vLLM's own ``Request`` carries each arrival time, and the hashing vLLM
    derived is kvsim's. The records are not trivially equal: prompt chunks
    (prompt tokens left > 0) and decodes (0) both occur."""
    from sim.conformance.driver import conformance_scenario, kvsim_backend, plan_for, vllm_backend

    scenario, requests = _long_chunked()
    scenario = conformance_scenario(scenario, "lookahead")
    plan = plan_for(scenario, "off")
    kvsim, vllm = kvsim_backend(scenario, "off"), vllm_backend(scenario, plan)
    assert vllm.mtp_hashing() == kvsim.scheduler.config.mtp_hashing
    for request in requests:
        assert kvsim.add_request(request) and vllm.add_request(request)
        assert vllm.scheduler.requests[request.request_id].arrival_time == request.arrival_s
    fields = ("step_index", "scheduled", "new_request_ids", "resumed_request_ids", "preempted_request_ids")
    prompt_rows = decode_rows = 0
    while kvsim.has_unfinished_requests():
        ours, theirs = kvsim.schedule(), vllm.schedule()
        assert [getattr(ours, f) for f in fields] == [getattr(theirs, f) for f in fields], ours.step_index
        prompt_rows += sum(r.num_prompt_tokens_left > 0 for r in theirs.scheduled)
        decode_rows += sum(r.num_prompt_tokens_left == 0 for r in theirs.scheduled)
        kvsim.execute(ours)
        vllm.execute(theirs)
    assert not vllm.has_unfinished_requests() and prompt_rows > 0 and decode_rows > 0
    # Only the step just scheduled may be executed on kvsim's side.
    with pytest.raises(AssertionError, match="^execute the step scheduled$"):
        kvsim.execute(SchedulerOutput(step_index=0, scheduled=()))
    # A prompt that leaves no room for one output token is refused by both
    # (vLLM's input processor; kvsim's scheduler); one token less is taken.
    limit = kvsim.scheduler.config.max_model_len

    def prompt_of(tokens: int) -> SimpleNamespace:
        return SimpleNamespace(
            request_id=f"p{tokens}",
            arrival_s=0.0,
            prompt_len=tokens,
            output_len=1,
            prompt_token_ids=lambda: list(range(tokens)),
        )

    assert not kvsim.add_request(prompt_of(limit)) and not vllm.add_request(prompt_of(limit))
    assert kvsim.add_request(prompt_of(limit - 1)) and vllm.add_request(prompt_of(limit - 1))


def test_the_backends_sample_through_the_engines_own_rng_stream():
    """Draws match a ``kvsim run`` of the same seed: every engine's runner
    (``engine_assembly.model_runner``) draws from the seed's second stream,
    ``SeedSequence([seed, 1])``, not the workload's (``[seed]``)."""
    import numpy as np

    from sim.engine_assembly import model_runner

    stream = np.random.default_rng(np.random.SeedSequence([7, 1])).random(4)
    assert list(model_runner((0.5,), seed=7).uniforms.rng.random(4)) == list(stream)
    assert list(model_runner((0.5,), seed=8).uniforms.rng.random(4)) != list(stream)  # control: another seed


# ------------------------------------- the backends on hand-built traces
def _backends(*overrides: str, mode: str = "eagle-drop"):
    """Both backends for the long-chunked scenario (3,200-token blocks,
    K = 3 drafts) with ``overrides``, as the gate compares them."""
    from sim.conformance.driver import conformance_scenario, kvsim_backend, plan_for, vllm_backend
    from sim.paths import SCENARIOS_DIR
    from sim.scenario import load_scenario

    path = str(SCENARIOS_DIR / "conformance" / "long-chunked.yaml")
    scenario = conformance_scenario(load_scenario(path, list(overrides)), mode)
    plan = plan_for(scenario, "off")
    return kvsim_backend(scenario, "off"), vllm_backend(scenario, plan)


def _prompt(request_id: str, tokens: int, output_len: int) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=request_id,
        arrival_s=0.0,
        prompt_len=tokens,
        output_len=output_len,
        prompt_token_ids=lambda: list(range(1000, 1000 + tokens)),
    )


def _step_both(kvsim, vllm) -> list[tuple]:
    """One step on both; vLLM's records, after checking kvsim's are equal."""
    ours, theirs = kvsim.schedule(), vllm.schedule()
    assert ours.scheduled == theirs.scheduled
    kvsim.execute(ours)
    vllm.execute(theirs)
    return [tuple(r) for r in theirs.scheduled]


def test_a_one_token_admission_beside_a_decode_is_recorded_as_vllms_padded_uniform_decode():
    """r0 (100 tokens) decodes with K = 3 drafts; r1's prompt is one token.
    vLLM pads r1 to 1 + K rows with K placeholder drafts (-1, its own
    output), so r1's record is by hand: 4 tokens, 0 computed, 3 drafts, no
    prompt token left (computed 0 >= 1 - 1), padded; r0's real drafts are
    not padding. Kills the padding mutants of ``_scheduled`` (the -1 test
    mutated or dropped) and ``scheduled_request`` dropping ``is_padded``."""
    kvsim, vllm = _backends()
    for backend in (kvsim, vllm):
        backend.add_request(_prompt("r0", 100, 20))
    assert _step_both(kvsim, vllm) == [("r0", 100, 0, 0, 100, False)]
    assert _step_both(kvsim, vllm) == [("r0", 4, 100, 3, 0, False)]
    for backend in (kvsim, vllm):
        backend.add_request(_prompt("r1", 1, 5))
    ours, theirs = kvsim.schedule(), vllm.schedule()
    assert vllm._vllm_output.scheduled_spec_decode_tokens["r1"] == [-1, -1, -1]
    assert -1 not in vllm._vllm_output.scheduled_spec_decode_tokens["r0"]
    assert theirs.scheduled[1] == ScheduledRequest("r1", 4, 0, 3, 0, True)
    assert not theirs.scheduled[0].is_padded and ours.scheduled == theirs.scheduled


def test_a_prompt_chunk_two_tokens_before_the_prompts_end_counts_both_as_prompt():
    """Lookahead hashing, a 3,202-token prompt: vLLM prefills 3,200 (one
    Mamba block), then a chunk of the last 2 tokens from 3,200 = 3,202 - 2,
    both prompt tokens (only a chunk from 3,202 - 1 on is a decode), then
    decodes with K = 3 drafts. Kills ``computed >= num_tokens - 2``."""
    kvsim, vllm = _backends(mode="lookahead")
    for backend in (kvsim, vllm):
        backend.add_request(_prompt("r0", 3202, 3))
    steps = [_step_both(kvsim, vllm) for _ in range(3)]
    assert steps == [
        [("r0", 3200, 0, 0, 3200, False)],
        [("r0", 2, 3200, 0, 2, False)],
        [("r0", 4, 3202, 3, 0, False)],
    ]


@pytest.mark.parametrize(
    ("computed_after", "num_tokens", "scheduled", "drafts", "prompt_left"),
    [
        (3202, 3202, 2, 0, 2),  # a chunk from num_tokens - 2: both prompt tokens
        (3202, 3202, 1, 0, 0),  # from num_tokens - 1: the decode's token
        (10, 12, 5, 2, 3),  # a prompt chunk carrying drafts: 5 - 2 prompt tokens
        (106, 103, 4, 3, 0),  # a decode with 3 drafts
    ],
)
def test_prompt_tokens_left_are_the_scheduled_tokens_less_the_drafts_before_the_last_token(
    computed_after, num_tokens, scheduled, drafts, prompt_left
):
    """``scheduled_request`` on a hand request (vLLM has already advanced its
    computed tokens): a chunk starting before ``num_tokens - 1`` is prompt,
    drafts excluded. vLLM never schedules drafts with a prompt chunk; the
    third row pins the rule by hand (kills ``num_scheduled + num_spec``)."""
    from sim.conformance.backends import scheduled_request

    request = SimpleNamespace(request_id="r", num_computed_tokens=computed_after, num_tokens=num_tokens)
    record = scheduled_request(request, scheduled, drafts, False)
    assert record == ScheduledRequest("r", scheduled, computed_after - scheduled, drafts, prompt_left)


def test_vllm_hashes_a_request_on_the_prefix_match_unit_not_the_block():
    """The rig's flags: 4,096-token blocks, prefix hits on a 64-token unit.
    vLLM's Scheduler hashes on the unit, so a 300-token prompt gets
    floor(300 / 64) = 4 block hashes (eagle-drop: no lookahead), not the
    0 of a 4,096-token hash block. Kills the hasher given no hash size."""
    _, vllm = _backends(
        "deployment.block_size=4096", "deployment.prefix_match_unit=64", "deployment.use_replayssm=true"
    )
    assert vllm.scheduler.hash_block_size == 64
    assert vllm.add_request(_prompt("r0", 300, 3))
    assert len(vllm.scheduler.requests["r0"].block_hashes) == 4


def test_kvsims_manager_takes_prefix_caching_off_as_vllms_does():
    """``allocator.enable_prefix_caching: false``: vLLM's own KVCacheManager
    (built from its CacheConfig) caches nothing, and kvsim's, built as a
    simulation builds it, neither (control: the default, on, on both).
    Kills building kvsim's manager without the allocator options."""
    kvsim, vllm = _backends("allocator.enable_prefix_caching=false")
    assert vllm.scheduler.kv_cache_manager.enable_caching is False
    assert kvsim.kv_cache_manager.enable_caching is False
    kvsim, vllm = _backends()
    assert vllm.scheduler.kv_cache_manager.enable_caching and kvsim.kv_cache_manager.enable_caching


def test_vllm_without_a_connector_frees_at_once_so_no_step_is_in_flight():
    """vLLM (no KV connector) frees a finished request's blocks inside
    ``update_from_output``: after r0's last step its free blocks are back to
    the start's, and there is no step in flight to complete (the driver asks
    after an empty step). Kills ``complete_in_flight_steps`` returning True."""
    _, vllm = _backends()
    free_at_start = vllm.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    vllm.add_request(_prompt("r0", 100, 1))
    state = vllm.execute(vllm.schedule())
    assert state.finished == ("r0",) and state.num_free_blocks == free_at_start
    assert not vllm.has_unfinished_requests() and vllm.complete_in_flight_steps() is False


def test_a_model_without_drafts_gives_vllms_hashing_without_a_prefill_lookahead(monkeypatch):
    """The fork's deployment minus --speculative-config (no drafter): vLLM's
    config derives no prefill lookahead (``num_prefill_lookahead_tokens``
    is 0 without a speculative config), no hash lookahead, and the Scheduler
    turns the eagle drop off; kvsim's hashing is the same and both schedule
    plain decodes. Kills ``mtp_hashing`` dropping the prefill lookahead
    (``MTPHashing``'s default, 1). Failed before vLLM's config was built
    without a SpeculativeConfig for K = 0 (vLLM refuses zero tokens)."""
    from sim.kv_cache_manager import MTPHashing
    from sim.paths import SCENARIOS_DIR
    from sim.scenario import Scenario, load_scenario

    model = load_scenario(str(SCENARIOS_DIR / "conformance" / "long-chunked.yaml")).load_model()
    without = model.model_copy(
        update={"mtp": model.mtp.model_copy(update={"num_layers": 0, "num_speculative_tokens": 0})}
    )
    monkeypatch.setattr(Scenario, "load_model", lambda self: without)
    kvsim, vllm = _backends()
    assert vllm.vllm_config.num_prefill_lookahead_tokens == 0
    expected = MTPHashing(
        use_eagle_block_drop=False, num_hash_lookahead_tokens=0, num_prefill_lookahead_tokens=0
    )
    assert vllm.mtp_hashing() == expected == kvsim.scheduler.config.mtp_hashing
    for backend in (kvsim, vllm):
        backend.add_request(_prompt("r0", 100, 3))
    steps = [_step_both(kvsim, vllm) for _ in range(3)]
    assert steps == [
        [("r0", 100, 0, 0, 100, False)],
        [("r0", 1, 100, 0, 0, False)],
        [("r0", 1, 101, 0, 0, False)],
    ]
