"""Value tests for the async steady lane (``sim/sched/fast_path/async_steady.py``,
issue 26 mutation): two decoding requests driven call by call through the
batch-queue core (PP 2: a queue of 3 micro-batches, a decode stagger of 2),
with the fast path and without; the ordinary path (the ``AsyncScheduler``
twin, conformance-checked against vLLM's ``step_with_batch_queue``) gives
the expected steps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from helpers.fast_path import audited, one_request
from helpers.scheduler import tiny_spec

from sim.sched.engine_core import BatchQueueEngineCore
from sim.sched.engine_loop import make_call
from sim.sched.fast_path.async_steady import AsyncSteadyLane, _KeptAsync
from sim.sched.output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput, StepOutcome


def _simulation(tmp_path, overrides: list[str], *, fast_path: bool, prompt: int = 40):
    """Two ``prompt``-token prompts decoding 30 tokens each, in async mode
    (the default scenario's PP 2), drafts never accepted."""
    simulation = one_request(
        tmp_path, 100, 10, "engine.mode=async", *overrides, f"simulation.fast_path={str(fast_path).lower()}"
    )
    assert isinstance(simulation.core, BatchQueueEngineCore)
    for index in range(2):
        simulation.scheduler.add_request(tiny_spec(index, prompt, output=30))
    return simulation


def _drive(simulation) -> list[tuple]:
    """Call by call, without a clock: each call's scheduled step, the step
    it applied and that step's outcome, and how many decodes the lane took."""
    core = simulation.core
    calls = []
    while core.has_work() and len(calls) < 500:
        call = make_call(core)
        taken = core.lane.num_taken if core.lane is not None else 0
        calls.append((call.dispatched, call.processed, call.outcome, taken))
    return calls


def _calls(tmp_path, overrides: list[str], *, fast_path: bool, prompt: int = 40) -> list[tuple]:
    return _drive(_simulation(tmp_path, overrides, fast_path=fast_path, prompt=prompt))


def _as_step_by_step(tmp_path, overrides: list[str], prompt: int = 40) -> list[tuple]:
    """``_calls`` with the fast path, checked call for call (the step
    scheduled, the step applied, its outcome) against the run without it."""
    fast = _calls(tmp_path, overrides, fast_path=True, prompt=prompt)
    step_by_step = _calls(tmp_path, overrides, fast_path=False, prompt=prompt)
    assert [call[:3] for call in fast] == [call[:3] for call in step_by_step]
    return fast


def test_async_lane_decodes_are_scheduled_as_the_ordinary_path_schedules_them(tmp_path):
    """Each lane decode is a plain decode of 1 + K = 4 tokens: no prompt
    token among them (the step-time model reads ``num_prompt_tokens_left``),
    as the ordinary path's; two requests decoding side by side, two decodes
    of one request in flight at each of its schedules (stagger 2, 3
    micro-batches), and every call equal to the run without the lane."""
    fast = _as_step_by_step(tmp_path, [])
    lane_shares = {
        (item.num_scheduled_tokens, item.num_prompt_tokens_left)
        for scheduled, _, _, taken in fast
        if taken
        for item in scheduled.scheduled
    }
    assert lane_shares == {(4, 0)}
    assert sum(call[3] for call in fast) > 20  # control: the lane took decodes


def test_a_long_prefill_threshold_below_an_async_decode_hands_it_back(tmp_path):
    """long_prefill_token_threshold 3 clips each decode to 3 tokens (1 + 2
    drafts): the lane offers its 1 + K = 4 and the take loop hands each
    back; no decode is taken as it is, every call equals the run without
    the lane (vLLM's running loop clips a decode by the threshold too)."""
    fast = _as_step_by_step(tmp_path, ["scheduler.long_prefill_token_threshold=3"])
    decodes = [
        item.num_scheduled_tokens
        for scheduled, _, _, _ in fast
        if scheduled is not None
        for item in scheduled.scheduled
        if item.num_prompt_tokens_left == 0
    ]
    assert decodes and set(decodes) <= {1, 3}
    assert sum(call[3] for call in fast) == 0


def _request_states(tmp_path, *, fast_path: bool) -> list[tuple]:
    """``_calls``' two requests, each call's running requests as a reader
    between calls sees them (the core's lane flushed first): computed
    tokens, tokens in flight, placeholders, the call they may decode at."""
    simulation = _simulation(tmp_path, [], fast_path=fast_path)
    core = simulation.core
    states = []
    while core.has_work() and len(states) < 500:
        make_call(core)
        core.flush()
        states.append(
            [
                (
                    r.request_id,
                    r.num_computed_tokens,
                    r.num_in_flight_tokens,
                    r.num_output_placeholders,
                    r.next_decode_eligible_step,
                )
                for r in simulation.scheduler.running
            ]
        )
    return states


def test_a_flushed_async_lane_hands_back_what_the_scheduler_would_hold(tmp_path):
    """Flushed after every call (a reader between calls), the lane's
    requests hold the counters the ordinary path's hold. With stagger 2
    and 3 micro-batches a decode is taken while the request's previous one
    is still in flight (8 tokens in flight at the schedule, 1 + K = 4 left
    once the older lands): a lane that sets, not adds, the taken decode's
    tokens in flight hands back 0."""
    fast = _request_states(tmp_path, fast_path=True)
    assert fast == _request_states(tmp_path, fast_path=False)
    in_flight = {state[2] for states in fast for state in states if state[1] > 40}
    assert in_flight == {4}  # every decode's previous one landed, this one in flight


def test_the_audit_counts_each_schedule_whose_decodes_it_checked(tmp_path):
    """With the audit on, ``audited["lane step"]`` counts the schedule calls in
    which the lane took decodes (their skipped allocations made and
    checked): one per such call, read off the calls themselves."""
    simulation = _simulation(tmp_path, [], fast_path=True)
    counts = audited(simulation, lane=True)
    calls_with_lane_decodes = sum(1 for call in _drive(simulation) if call[3])
    assert calls_with_lane_decodes > 20
    assert counts["lane step"] == calls_with_lane_decodes


def _placeholders_read(tmp_path, *, fast_path: bool) -> tuple[list, int]:
    """The running requests' placeholders as the core reports them without
    a flush (the async conformance harness's reading), each call between
    its schedule and the oldest step's landing, and how many readings
    differ from the ``Request``'s own field."""
    simulation = _simulation(tmp_path, [], fast_path=fast_path)
    core, readings, stale = simulation.core, [], 0
    while core.has_work() and len(readings) < 500:
        call = core.begin_step()
        running = simulation.scheduler.running
        readings.append([core.num_output_placeholders(r) for r in running])
        stale += sum(core.num_output_placeholders(r) != r.num_output_placeholders for r in running)
        if call.waits:
            core.end_step(call)
    return readings, stale


def test_the_core_reads_a_kept_requests_placeholders_from_the_lane(tmp_path):
    """While a kept request's decodes are in flight its ``Request`` holds
    stale placeholders; the core reports the lane's, which are the
    ordinary path's (1 + K = 4 a decode in flight)."""
    fast, stale = _placeholders_read(tmp_path, fast_path=True)
    step_by_step, _ = _placeholders_read(tmp_path, fast_path=False)
    assert fast == step_by_step
    assert stale > 0  # control: the Request's own field would differ


# ------------------------------------------- one kept output, by hand
def _applied(tokens: list[int], cache: tuple[int, int], item: ScheduledRequest | None = None) -> tuple:
    """A kept decode (K = 3) with 104 computed (101 known plus 3 drafts),
    its one decode of 4 tokens in flight (4 placeholders), its output
    landing with ``tokens`` (``update_from_output``, the scheduler a stand-in):
    whether the lane applied it, the kept counters and the step's tally
    (generated, drafted, accepted tokens)."""
    kept = _KeptAsync(
        request=None, computed=104, in_flight=4, placeholders=4, eligible=0, num_tokens=101,
        cache_low=cache[0], cache_high=cache[1], stop_at=200,
    )  # fmt: skip
    applied, outcome = _completed(kept, tokens, item or ScheduledRequest("r", 4, 100, 3, 0))
    counters = (kept.computed, kept.in_flight, kept.placeholders, kept.num_tokens, kept.pending)
    tally = (outcome.num_generated_tokens, outcome.num_draft_tokens, outcome.num_accepted_tokens)
    return applied, counters, tally


def _completed(kept: _KeptAsync, tokens: list[int], item: ScheduledRequest) -> tuple[bool, StepOutcome]:
    """``kept`` (request "r", K = 3) in a stand-in lane whose one step's
    output lands with ``tokens``: whether the lane applied them, and the
    step's outcome."""
    lane = object.__new__(AsyncSteadyLane)
    lane.num_spec, lane.step_tokens, lane.door = 3, 4, SimpleNamespace(audit=False)
    lane._kept = {"r": kept}
    ordinary: list[str] = []  # requests handed back and applied the ordinary way
    lane._leave = lambda request: ordinary.append("left")  # type: ignore[method-assign]
    lane.scheduler = SimpleNamespace(  # type: ignore[assignment]
        output_arrives=lambda output: None,
        apply_sampled=lambda item, tokens, tally: ordinary.append("applied"),
    )
    output = SchedulerOutput(step_index=1, scheduled=(item,))
    sampled = ModelRunnerOutput(sampled_token_ids={"r": tokens} if tokens else {})
    outcome = lane.update_from_output(output, sampled)
    assert ordinary in ([], ["left", "applied"])
    return not ordinary, outcome


UNCHANGED = ((104, 4, 4, 101, []), (0, 0, 0))


@pytest.mark.parametrize(
    ("tokens", "cache", "expected"),
    [
        # Two tokens back (one draft accepted, two rejected): vLLM's
        # apply_sampled rolls the computed tokens and placeholders back by
        # the 2 rejected, the 2 returned resolve placeholders: computed
        # 102, nothing in flight, processed 102, placeholders 4 - 2 - 2 = 0.
        ([7, 8], (90, 150), (True, (102, 0, 0, 103, [7, 8]), (2, 3, 1))),
        ([7, 8], (102, 150), (True, (102, 0, 0, 103, [7, 8]), (2, 3, 1))),  # the window holds its ends
        ([7, 8], (90, 102), (True, (102, 0, 0, 103, [7, 8]), (2, 3, 1))),
        ([7, 8], (103, 150), (False, *UNCHANGED)),  # processed outside the settled window
        ([7, 8], (90, 101), (False, *UNCHANGED)),
        # Every draft rejected: one token, computed 104 - 3 = 101.
        ([7], (90, 150), (True, (101, 0, 0, 102, [7]), (1, 3, 0))),
        ([], (90, 150), (False, *UNCHANGED)),  # nothing sampled: the ordinary way
    ],
)
def test_a_kept_output_is_applied_as_vllms_apply_sampled_would_inside_its_window(tokens, cache, expected):
    assert _applied(tokens, cache) == expected


@pytest.mark.parametrize(
    "item",
    [
        ScheduledRequest("r", 4, 100, 0, 4),  # a 4-token recompute chunk: no drafts to roll back
        ScheduledRequest("r", 4, 100, 3, 0, is_padded=True),  # padded drafts, never accepted
        ScheduledRequest("r", 3, 100, 2, 0),  # a decode clipped to 1 + 2 drafts
    ],
)
def test_an_item_not_the_lanes_own_goes_the_ordinary_way(item):
    assert _applied([7], (90, 150), item) == (False, *UNCHANGED)


def test_a_step_tallies_the_lanes_decodes_on_top_of_the_ordinary_ones():
    """A step of two decodes (K = 3): "o" not in the lane, applied the
    ordinary way (a stand-in that tallies 3 generated, 3 drafted, 2
    accepted), then the kept "r" landing with two tokens (2 generated, 3
    drafted, 1 accepted): the step's outcome is their sums, 5, 6 and 3."""
    lane = object.__new__(AsyncSteadyLane)
    lane.num_spec, lane.step_tokens, lane.door = 3, 4, SimpleNamespace(audit=False)
    lane._kept = {
        "r": _KeptAsync(
            request=None, computed=104, in_flight=4, placeholders=4, eligible=0, num_tokens=101,
            cache_low=90, cache_high=150, stop_at=200,
        )
    }  # fmt: skip

    def ordinary(item, tokens, tally):
        tally.num_generated_tokens += 3
        tally.num_draft_tokens += 3
        tally.num_accepted_tokens += 2

    lane.scheduler = SimpleNamespace(output_arrives=lambda output: None, apply_sampled=ordinary)  # type: ignore[assignment]
    items = (ScheduledRequest("o", 4, 200, 3, 0), ScheduledRequest("r", 4, 100, 3, 0))
    sampled = ModelRunnerOutput(sampled_token_ids={"o": [1, 2, 3], "r": [7, 8]})
    outcome = lane.update_from_output(SchedulerOutput(step_index=1, scheduled=items), sampled)
    assert (outcome.num_generated_tokens, outcome.num_draft_tokens, outcome.num_accepted_tokens) == (5, 6, 3)


def test_with_two_decodes_in_flight_the_processed_tokens_lie_behind_the_newer_one():
    """108 computed, two decodes (8 tokens, 8 placeholders) in flight; the
    older lands with two tokens: computed 106, 4 still in flight, so 102
    processed (not 110): inside a window ending at 102."""
    kept = _KeptAsync(
        request=None, computed=108, in_flight=8, placeholders=8, eligible=0, num_tokens=101,
        cache_low=90, cache_high=102, stop_at=200,
    )  # fmt: skip
    assert _completed(kept, [7, 8], ScheduledRequest("r", 4, 100, 3, 0))[0]
    assert (kept.computed, kept.in_flight, kept.placeholders, kept.num_tokens) == (106, 4, 4, 103)


# ------------------------------------------- entry and hand-over, by hand
def _lane_with_limits(limits: dict[str, tuple[int, int, int] | None]) -> AsyncSteadyLane:
    """A stand-in lane (K = 3): ``_limit`` read off ``limits`` by request
    id, the stop room 12 tokens for every request."""
    lane = object.__new__(AsyncSteadyLane)
    lane.num_spec, lane.step_tokens, lane._kept = 3, 4, {}
    lane.scheduler = SimpleNamespace(stop_room=lambda request: {"r": 12}[request.request_id])
    lane._limit = lambda request: limits[request.request_id]
    return lane


def _decoding(**changes) -> SimpleNamespace:
    """A request decoding with K = 3: a 40-token prompt, 21 outputs (61
    known), one decode of 4 in flight (4 placeholders, 4 tokens in flight),
    so 61 + 4 - 1 = 64 computed; 3 drafts queued; max_tokens 50."""
    request = SimpleNamespace(
        request_id="r", is_prefill_chunk=False, num_output_tokens=21, num_stale_output_tokens=0,
        num_tokens=61, num_output_placeholders=4, num_computed_tokens=64, spec_token_ids=[0, 0, 0],
        num_in_flight_tokens=4, next_decode_eligible_step=9, num_prompt_tokens=40, max_tokens=50,
    )  # fmt: skip
    for name, value in changes.items():
        setattr(request, name, value)
    return request


def test_a_decoding_request_enters_the_lane_with_what_the_scheduler_holds_on_it():
    """Kept as the scheduler holds it: computed 64, 4 in flight, 4
    placeholders, eligible at call 9, 61 tokens; its limit and caching
    window as ``_limit`` gives them (120; 90 to 110); a length stop at 61 +
    12 = 73 tokens; the running loop's skip at 40 + 50 = 90."""
    lane = _lane_with_limits({"r": (120, 90, 110)})
    request = _decoding()
    kept = lane._enter(request)
    assert kept is not None and lane._kept == {"r": kept}
    assert kept.request is request
    assert (kept.computed, kept.in_flight, kept.placeholders, kept.eligible, kept.num_tokens) == (
        64,
        4,
        4,
        9,
        61,
    )
    assert (kept.limit, kept.cache_low, kept.cache_high) == (120, 90, 110)
    assert (kept.stop_at, kept.max_tokens_end, kept.pending) == (73, 90, [])


def test_a_request_with_one_output_enters_the_lane():
    """One output (prompt 40, 41 known, 44 computed with the decode of 4 in
    flight): a decode like any other."""
    lane = _lane_with_limits({"r": (120, 90, 110)})
    assert lane._enter(_decoding(num_output_tokens=1, num_tokens=41, num_computed_tokens=44)) is not None


@pytest.mark.parametrize(
    "changes",
    [
        {"is_prefill_chunk": True},  # a prompt chunk, its outputs notwithstanding
        {"num_output_tokens": 0},  # no output yet (nothing stale either)
        {"num_stale_output_tokens": 1},  # a stale output to drain (known tokens as a decode's)
        {"num_computed_tokens": 63},  # 61 + 4 - 63 = 2 tokens to compute, K drafts queued
        {"num_computed_tokens": 65},  # 61 + 4 - 65 = 0: nothing left to compute
        {"spec_token_ids": [0, 0]},  # two drafts queued, not K
        {"request_id": "s"},  # outside a settled window (``_limit`` None)
    ],
)
def test_a_request_not_a_steady_decode_stays_out_of_the_lane(changes):
    """Each condition alone keeps the request out (the rest as a decode's)."""
    lane = _lane_with_limits({"r": (120, 90, 110), "s": None})
    assert lane._enter(_decoding(**changes)) is None
    assert lane._kept == {}


def test_a_handed_over_request_takes_the_lanes_counters_and_ids():
    """The request takes computed 106, 4 in flight, 4 placeholders,
    eligible 12 and the pending ids [7, 8] appended once; the lane's list
    is emptied (an audit hands a kept request over and keeps it)."""
    appended: list[list[int]] = []
    request = SimpleNamespace(append_output_token_ids=lambda ids: appended.append(list(ids)))
    kept = _KeptAsync(request=request, computed=106, in_flight=4, placeholders=4, eligible=12, num_tokens=103)
    kept.pending = [7, 8]
    AsyncSteadyLane._hand_over(kept)
    assert (
        request.num_computed_tokens,
        request.num_in_flight_tokens,
        request.num_output_placeholders,
        request.next_decode_eligible_step,
    ) == (106, 4, 4, 12)
    assert appended == [[7, 8]] and kept.pending == []
    AsyncSteadyLane._hand_over(kept)
    assert appended == [[7, 8]]  # nothing pending: nothing appended again


def test_a_new_lane_reads_k_and_the_stagger_off_its_scheduler():
    """K = 3 drafts: a decode of 1 + 3 = 4 tokens; stagger 2; nothing kept
    or taken yet."""
    scheduler = SimpleNamespace(config=SimpleNamespace(num_speculative_tokens=3), decode_stagger=2)
    door = SimpleNamespace(audit=False)
    lane = AsyncSteadyLane(scheduler, door)
    assert lane.scheduler is scheduler and lane.door is door
    assert (lane.num_spec, lane.step_tokens, lane.decode_stagger) == (3, 4, 2)
    assert (lane._kept, lane.num_taken) == ({}, 0)


def test_the_audit_makes_a_taken_decodes_allocation_as_the_running_loop_would(tmp_path):
    """Under the audit each decode the lane took has its skipped allocation
    made as the scheduler's running loop makes it (``_allocate_or_preempt``):
    1 + K new tokens and the K = 3 lookahead slots, none of them allocating
    (control: the audit's calls are among those seen, and each is the same
    call the ordinary path makes)."""
    simulation = _simulation(tmp_path, [], fast_path=True)
    audited(simulation, lane=True)
    manager = simulation.kv_cache_manager
    real, seen = manager.allocate_slots, []

    def recording(request, num_new_tokens, *args, **kwargs):
        seen.append((num_new_tokens, args, kwargs))
        return real(request, num_new_tokens, *args, **kwargs)

    manager.allocate_slots = recording
    calls = _drive(simulation)
    assert sum(call[3] for call in calls) > 20
    decodes = [entry for entry in seen if entry[0] == 4]
    assert len(decodes) >= sum(call[3] for call in calls)
    assert all(entry == (4, (), {"num_lookahead_tokens": 3}) for entry in decodes)


def _cachings(simulation) -> list[tuple[str, int]]:
    """Every cache_blocks call the allocator itself gets (behind the door,
    if any), call by call: each request and the computed tokens it caches at."""
    manager = simulation.kv_cache_manager
    real, seen = manager.cache_blocks, []

    def recording(request, num_computed_tokens):
        seen.append((request.request_id, num_computed_tokens))
        return real(request, num_computed_tokens)

    manager.cache_blocks = recording
    _drive(simulation)
    return seen


def test_the_audit_makes_each_kept_outputs_caching_as_the_ordinary_path_does(tmp_path):
    """Under the audit, each kept output applied inside its caching window
    has its skipped caching made, at the tokens it has processed: the calls
    the allocator gets are those of the run without the fast path, each
    once at least (issue 42's mutation run: an audit making no caching call
    passed). Control: without the audit the lane skips some of them."""
    expected = set(_cachings(_simulation(tmp_path, [], fast_path=False)))
    simulation = _simulation(tmp_path, [], fast_path=True)
    audited(simulation, lane=True)
    assert set(_cachings(simulation)) == expected
    assert set(_cachings(_simulation(tmp_path, [], fast_path=True))) < expected
