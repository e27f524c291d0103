"""The async conformance harness's records by value (issue 26): what one
engine call is recorded as (``compared_call``), what vLLM's engine outputs say
finished and how many prefix tokens they report (``_finished_and_prefix``,
fed vLLM's own ``EngineCoreOutputs`` and ``PrefixCacheStats``), and the
batch queue's depth against vLLM's own derivation. A mutant here changes
both sides of the gate alike, so the gate cannot see it: these can."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import pytest
from helpers.scenarios import conformance_requests, conformance_shape
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.metrics.stats import PrefixCacheStats, SchedulerStats

from sim.conformance import async_engine
from sim.conformance.driver import BackendUnavailable, conformance_scenario, plan_for, vllm_settings
from sim.sched.engine_core import EngineCall
from sim.sched.engine_loop import idle_after
from sim.sched.output import ScheduledRequest, SchedulerOutput
from sim.workloads.spec import WorkloadRequest


def _output(request_id: str, reason: FinishReason | None) -> EngineCoreOutput:
    return EngineCoreOutput(request_id=request_id, new_token_ids=[1], finish_reason=reason)


def _stats(queries: int, hits: int, preempted_queries: int, preempted_hits: int) -> SchedulerStats:
    prefix = PrefixCacheStats(
        queries=queries, hits=hits, preempted_queries=preempted_queries, preempted_hits=preempted_hits
    )
    return SchedulerStats(prefix_cache_stats=prefix)


def test_the_finished_requests_are_every_client_outputs_with_a_reason_sorted():
    """Two clients' outputs: c, a finished (length, abort), b not: [a, c].
    The prefix counts are the first stats found, preempted requests
    included (kvsim's step records count them: ``PrefixCacheStats``):
    30 + 4 queried, 10 + 2 hit."""
    outputs = {
        0: EngineCoreOutputs(outputs=[_output("c", FinishReason.LENGTH), _output("b", None)]),
        1: EngineCoreOutputs(
            outputs=[_output("a", FinishReason.ABORT)], scheduler_stats=_stats(30, 10, 4, 2)
        ),
    }
    finished, prefix = async_engine._finished_and_prefix(outputs)
    assert finished == ["a", "c"] and prefix == (34, 12)


def test_no_outputs_or_no_stats_report_nothing():
    assert async_engine._finished_and_prefix(None) == ([], (0, 0))
    outputs = {0: EngineCoreOutputs(outputs=[_output("a", FinishReason.STOP)])}
    assert async_engine._finished_and_prefix(outputs) == (["a"], (0, 0))
    without_prefix = {0: EngineCoreOutputs(outputs=[], scheduler_stats=SchedulerStats())}
    assert async_engine._finished_and_prefix(without_prefix) == ([], (0, 0))


def _scheduled(step: int) -> SchedulerOutput:
    return SchedulerOutput(
        step_index=step,
        scheduled=(
            ScheduledRequest("r1", 5, 32, 0, 0),
            ScheduledRequest("r2", 1, 100, 0, 4),
            ScheduledRequest("r3", 4, 0, 3, 0),
        ),
        new_request_ids=("r2",),
        resumed_request_ids=("r3",),
        preempted_request_ids=("r9", "r7"),
    )


def test_an_engine_call_is_recorded_field_by_field():
    """Step 7 scheduled r1 (computed 32, 5 tokens), r2 (100, 1), r3 (0, 4),
    r2 new and r3 resumed, r9 and r7 preempted; it applied step 5. r1 holds
    2 placeholders after, r3 1, r2 none (absent from the map: 0)."""
    call = EngineCall(_scheduled(7), processed=_scheduled(5))
    state = async_engine.compared_call(
        call,
        placeholders={"r1": 2, "r3": 1},
        finished=["r4"],
        running=["r1", "r2", "r3"],
        waiting=["r5"],
        num_free_blocks=11,
        prefix=(64, 32),
    )
    assert state.step == 7 and state.processed_step == 5
    assert state.scheduled_tokens == (("r1", 32, 5, 2), ("r2", 100, 1, 0), ("r3", 0, 4, 1))
    assert state.admitted == ("r2", "r3") and state.resumed == ("r3",)
    assert state.preempted == ("r7", "r9")
    assert state.finished == ("r4",) and state.running == ("r1", "r2", "r3") and state.waiting == ("r5",)
    assert state.num_free_blocks == 11
    assert state.prefix_cache_queries_tokens == 64 and state.prefix_cache_hits_tokens == 32


def test_a_call_that_scheduled_and_applied_nothing_is_step_zero():
    state = async_engine.compared_call(
        EngineCall(),
        placeholders={},
        finished=[],
        running=[],
        waiting=["r1"],
        num_free_blocks=3,
        prefix=(0, 0),
    )
    assert (state.step, state.processed_step) == (0, 0)
    assert state.scheduled_tokens == () and state.admitted == () and state.resumed == ()
    assert state.preempted == () and state.waiting == ("r1",)


@pytest.mark.parametrize("shape", ["long-chunked"])
def test_the_batch_queue_is_as_deep_as_vllm_makes_it(shape):
    """vLLM's engine core, built by the gate with async scheduling on
    Model Runner V2, sizes its batch queue from its own config; kvsim's
    depth (pp + 1) must be that size (PP 2: 3)."""
    scenario = conformance_scenario(conformance_shape(shape), "eagle-drop")
    plan = plan_for(scenario, "off")
    engine = async_engine.vllm_engine(scenario, plan, vllm_settings(scenario, plan))
    assert scenario.deployment.pipeline_parallel_size == 2
    assert engine.core.batch_queue_size == engine.core.batch_queue.maxlen == 3
    assert async_engine.max_concurrent_batches(scenario) == engine.core.batch_queue_size


def test_a_calls_scheduled_ids_are_its_requests_in_order():
    assert async_engine._ids(None) == []
    assert async_engine._ids(_scheduled(3)) == ["r1", "r2", "r3"]


def _engines(shape: str, **deployment: int):
    scenario = conformance_scenario(conformance_shape(shape), "eagle-drop")
    if deployment:
        section = scenario.deployment.model_copy(update=deployment)
        scenario = scenario.model_copy(update={"deployment": section})
    plan = plan_for(scenario, "off")
    vllm_side = async_engine.vllm_engine(scenario, plan, vllm_settings(scenario, plan))
    kvsim_side = async_engine.kvsim_engine(scenario, "off", depth=3, stagger=2)
    return kvsim_side, vllm_side


def test_vllms_side_refuses_a_prompt_of_max_model_len_as_vllms_input_processor_does():
    """vLLM's ``InputProcessor`` refuses a prompt longer than
    ``max_model_len`` and, for a generating model, one exactly as long (no
    room for an output token): 4,096 refused, 4,095 taken, with its
    arrival time."""
    _, engine = _engines("long-chunked", max_model_len=4096)
    for request_id, prompt_len in (("at", 4096), ("under", 4095)):
        engine.add_request(
            WorkloadRequest(
                request_id=request_id,
                arrival_s=2.5,
                prompt_len=prompt_len,
                output_len=4,
                prefix_ids=tuple(range(-(-prompt_len // 64))),
                prefix_unit=64,
            )
        )
    assert set(engine.scheduler.requests) == {"under"}
    assert engine.scheduler.requests["under"].arrival_time == 2.5


def test_both_sides_say_alike_whether_a_call_samples():
    """Whether a call's step samples a token (the pipeline clock's
    broadcast, a field the gate does not compare) is kvsim's engine core's
    own rule on one side and vLLM's requests' ``is_prefill_chunk`` on the
    other: call for call they agree, and both kinds occur (prompt chunks
    that sample nothing, decodes that do)."""
    kvsim_side, vllm_side = _engines("long-chunked")
    for spec in conformance_requests("long-chunked")[:4]:
        kvsim_side.add_request(spec)
        vllm_side.add_request(spec)
    seen = set()
    for _ in range(400):
        if not (kvsim_side.has_work() or vllm_side.has_work()):
            break
        (kvsim_call, _), (vllm_call, _) = kvsim_side.step(), vllm_side.step()
        if kvsim_call.dispatched is not None:
            assert kvsim_call.samples is vllm_call.samples
            seen.add(vllm_call.samples)
    assert seen == {True, False}


def test_a_driven_trajectory_bears_its_engines_name_and_stops_at_the_horizon():
    """The same four requests driven to the end, then with a horizon at the
    time of the full run's middle call: the horizon stops each side after
    fewer calls, none past it; the trajectories are named for their
    engines."""
    requests = conformance_requests("long-chunked")[:4]
    scenario = conformance_scenario(conformance_shape("long-chunked"), "eagle-drop")
    step_time = async_engine.StepTimeModel(scenario.step_time_config())

    def driven(name: str, horizon_s: float | None):
        engine = dict(zip(("kvsim", "vllm"), _engines("long-chunked"), strict=True))[name]
        clock = async_engine.async_clock(scenario, step_time)
        trajectory = async_engine.drive_engine(engine, requests, clock, horizon_s)
        assert trajectory.backend == name and not trajectory.stalled
        return trajectory

    for name in ("kvsim", "vllm"):
        full = driven(name, None)
        horizon_s = full.times_s[len(full.times_s) // 2]
        cut = driven(name, horizon_s)
        assert 0 < len(cut.steps) < len(full.steps)
        assert max(cut.times_s) <= horizon_s


def test_the_gate_stops_both_sides_at_the_scenarios_horizon():
    """``simulation.max_time_s`` is the gate's horizon, on both sides: the
    long-chunked shape cut at its full run's middle call takes fewer steps
    than the full run, and still conforms (both sides stop alike)."""
    shape = conformance_shape("long-chunked")
    requests = conformance_requests("long-chunked")
    full = async_engine.run_async_conformance(shape, "off", requests, mtp_hash_mode="eagle-drop")
    horizon_s = full.right.times_s[len(full.right.times_s) // 2]
    section = shape.simulation.model_copy(update={"max_time_s": horizon_s})
    cut = async_engine.run_async_conformance(
        shape.model_copy(update={"simulation": section}), "off", requests, mtp_hash_mode="eagle-drop"
    )
    assert cut.conforms and 0 < cut.num_steps < full.num_steps
    assert max(cut.left.times_s) <= horizon_s and max(cut.right.times_s) <= horizon_s


def _free_blocks(comparison) -> list[int]:
    return [state.num_free_blocks for state in comparison.right.steps]


def test_the_gate_runs_the_mode_the_layout_and_the_fencing_it_is_given():
    """vLLM's side (the right trajectory) follows each argument: the two
    layouts give other pools, fenced frees hold blocks longer, and the
    default is unfenced (the same run as ``fenced=False``)."""
    shape, requests = conformance_shape("heavy-preemption"), conformance_requests("heavy-preemption")

    def run(layout: str, **kwargs):
        run_async = async_engine.run_async_conformance
        return run_async(shape, layout, requests, mtp_hash_mode="eagle-drop", **kwargs)

    default, unfenced, fenced = run("on"), run("on", fenced=False), run("on", fenced=True)
    assert _free_blocks(default) == _free_blocks(unfenced) != _free_blocks(fenced)
    assert _free_blocks(run("off")) != _free_blocks(default)


def test_the_gate_hashes_in_the_mode_it_is_given():
    """The two MTP hashing modes give vLLM's side other prefix hits on the
    prefix-hits shape."""
    shape, requests = conformance_shape("prefix-hits"), conformance_requests("prefix-hits")
    hits = {
        mode: [
            s.prefix_cache_hits_tokens
            for s in async_engine.run_async_conformance(shape, "on", requests, mtp_hash_mode=mode).right.steps
        ]
        for mode in ("eagle-drop", "lookahead")
    }
    assert hits["eagle-drop"] != hits["lookahead"]


# ------------------------------------- vLLM's side, read from stand-ins
def _vllm_side(**requests) -> async_engine._VllmEngine:
    """vLLM's side over a stand-in engine core (nothing scheduled, nothing
    landing) and scheduler holding ``requests``."""
    engine = object.__new__(async_engine._VllmEngine)
    engine.core = SimpleNamespace(
        step_with_batch_queue=lambda: (None, False), post_step=lambda executed: None
    )
    engine.scheduler = SimpleNamespace(
        requests=requests,
        current_step=5,
        running=[],
        kv_holding_waiting=[],
        waiting=[],
        kv_cache_manager=SimpleNamespace(block_pool=SimpleNamespace(get_num_free_blocks=lambda: 7)),
    )
    engine._in_flight, engine._scheduled, engine._samples = deque(), None, False
    return engine


def test_an_admitted_requests_drafts_are_padding_on_vllms_side():
    """vLLM's async scheduler gives every request -1 placeholder drafts;
    an admitted request's are padding (its worker has none to fill in),
    a running request's are drafts in flight, and an admitted request
    without drafts has nothing padded."""
    admitted = SimpleNamespace(request_id="a", num_computed_tokens=104, num_tokens=101, num_preemptions=0)
    running = SimpleNamespace(request_id="b", num_computed_tokens=204, num_tokens=201, num_preemptions=0)
    plain = SimpleNamespace(request_id="c", num_computed_tokens=50, num_tokens=50, num_preemptions=0)
    engine = _vllm_side(a=admitted, b=running, c=plain)
    out = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="a"), SimpleNamespace(req_id="c")],
        num_scheduled_tokens={"a": 4, "b": 4, "c": 50},
        scheduled_spec_decode_tokens={"a": [-1, -1, -1], "b": [-1, -1, -1]},
        preempted_req_ids=None,
    )
    converted = engine._convert(out)
    assert [(i.request_id, i.num_spec_tokens, i.is_padded) for i in converted.scheduled] == [
        ("a", 3, True),
        ("b", 3, False),
        ("c", 0, False),
    ]
    assert (converted.step_index, converted.new_request_ids) == (5, ("a", "c"))


@pytest.mark.parametrize(("in_flight", "idle"), [((), True), ((0,), True), ((0, 1), False)])
def test_a_vllm_call_that_schedules_and_lands_nothing_is_idle_only_with_nothing_in_flight(in_flight, idle):
    """``step_with_batch_queue`` scheduling nothing and landing nothing:
    idle by the engine loop's rule (``idle_after``) when only empty steps
    (or none) are in flight, not while a step with requests is; it does not
    wait (no output landed)."""
    engine = _vllm_side()
    for tokens in in_flight:
        item = (ScheduledRequest("r", tokens, 0, 0, tokens),) if tokens else ()
        engine._in_flight.append(SchedulerOutput(step_index=1, scheduled=item))
    call, state = engine.step()
    assert (call.dispatched, call.processed, call.waits) == (None, None, False)
    assert idle_after(async_engine._EngineCalls(engine), call) is idle
    assert (state.step, state.num_free_blocks) == (0, 7)


@pytest.mark.parametrize(("unfinished", "expected"), [(2, True), (0, False)])
def test_an_engines_calls_say_whether_requests_are_unfinished(unfinished, expected):
    """The engine loop stalls or ends on this: the scheduler's count as a bool."""
    engine = SimpleNamespace(scheduler=SimpleNamespace(has_unfinished_requests=lambda: unfinished))
    assert async_engine._EngineCalls(engine).has_unfinished_requests() is expected


def test_a_vllm_engine_core_that_cannot_be_built_is_one_line_naming_it(monkeypatch):
    """The failure's type and first line, and what could not be built."""

    def broken(*args):
        raise RuntimeError("no engine here\nsecond line")

    monkeypatch.setattr(async_engine, "vllm_engine", broken)
    with pytest.raises(BackendUnavailable) as raised:
        async_engine.run_async_conformance(
            conformance_shape("long-chunked"), "off", conformance_requests("long-chunked")
        )
    assert str(raised.value) == "vLLM's EngineCore cannot be built (RuntimeError: no engine here)"
