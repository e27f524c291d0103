"""Value tests for the async engine (issue 26, item 3): the clocks
(``sim/pipeline_clock.py``) against timelines derived by hand from given
stage and hand-off times, and the one engine loop
(``sim/sched/engine_loop.py``) driving stand-in cores, its yields and
records derived by hand from vLLM's busy loop (``EngineCore.run_busy_loop``
over ``step_with_batch_queue``)."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import numpy as np
import pytest
from helpers.allocator import K, tiny_plan
from helpers.scenarios import conformance_shape
from helpers.scheduler import MAX_LEN, tiny_spec

from sim.conformance.async_engine import run_async_conformance
from sim.kv_cache_manager import build_kv_cache_manager
from sim.pipeline_clock import PipelineClock, SerialClock
from sim.sched.async_scheduler import AsyncScheduler
from sim.sched.engine_core import BatchQueueEngineCore, EngineCall
from sim.sched.engine_loop import IDLE, make_call, run_engine
from sim.sched.fast_path.async_steady import AsyncSteadyLane
from sim.sched.fast_path.kv_cache_manager import FastPathKVCacheManager
from sim.sched.fast_path.memos import FastPath, NoFastPath
from sim.sched.model_runner import AcceptanceModel, ModelRunner
from sim.sched.output import ScheduledRequest, SchedulerOutput, StepTally, reaches_max_tokens
from sim.sched.scheduler import Scheduler, SchedulerConfig
from sim.vllm_bridge import RequestStatus
from sim.workloads import WorkloadRequest


def _output(step: int, tokens: int = 1) -> SchedulerOutput:
    item = ScheduledRequest("r", tokens, 0, 0, tokens)
    return SchedulerOutput(step_index=step, scheduled=(item,) if tokens else ())


# ------------------------------------------------------------ the clocks
def test_the_serial_clock_lands_a_step_its_time_after_the_engine_schedules_it():
    """Step time 2 s per scheduled token. Idle until 5, a 3-token step: it
    lands at 11, and the engine waits all 6 s of it."""
    clock = SerialClock(lambda output: 2.0 * output.total_num_scheduled_tokens)
    clock.idle_until(5.0)
    assert clock.now_s == 5.0
    assert clock.schedule(_output(1, tokens=3), samples=False) == 11.0
    assert clock.now_s == 5.0  # scheduling lets no time pass
    assert clock.block() == (6.0, 5.0, 6.0)
    assert clock.now_s == 11.0
    clock.idle_until(3.0)  # an arrival in the past moves nothing
    assert clock.now_s == 11.0
    with pytest.raises(AssertionError, match="^one step in flight$"):
        clock.block()  # blocked on already


def test_a_fresh_serial_clock_starts_at_zero_with_nothing_in_flight():
    """Before any step: blocking is a caller's error (one line), and the
    first step, scheduled at 0, lands after its own time."""
    clock = SerialClock(lambda output: 2.0)
    with pytest.raises(AssertionError, match="^one step in flight$"):
        clock.block()
    assert clock.schedule(_output(1)) == 2.0
    assert clock.block() == (2.0, 0.0, 2.0)


def _three_stages() -> PipelineClock:
    """Stage times 1, 2 and 1 s per token (stages 0, 1, 2), hand-off 0.5 s
    per token: a stand-in for the step-time model's per-stage times."""
    per_token = (1.0, 2.0, 1.0)
    return PipelineClock(
        3,
        lambda output, stage: per_token[stage] * output.total_num_scheduled_tokens,
        lambda output: 0.5 * output.total_num_scheduled_tokens,
    )


# (tokens, samples, lands at): the seven steps of the hand timeline below.
HAND_TIMELINE = [(1, True, 5.0), (2, False, 11.0), (1, True, 12.0), (1, True, 13.5), (1, True, 15.5),
                 (0, False, 15.5), (1, True, 18.5)]  # fmt: skip


def test_three_stages_by_hand():
    """start_0(S) = max(t, end_0(S-1), end_2(S-3) if S-3 sampled);
    end_i(S) = max(end_{i-1}(S) + handoff, end_i(S-1)) + stage_i. All
    scheduled at t = 0 (end of stage 0 / 1 / 2):
    S1 (1 token): 1 / max(1.5, 0) + 2 = 3.5 / max(4, 0) + 1 = 5.
    S2 (2 tokens, a non-final chunk: samples nothing): max(0, 1) + 2 = 3 /
    max(4, 3.5) + 4 = 8 / max(9, 5) + 2 = 11.
    S3 (1): 4 / max(4.5, 8) + 2 = 10 / max(10.5, 11) + 1 = 12.
    S4 (1): waits for S1's broadcast, landed at 5: 6 / max(6.5, 10) + 2 =
    12 / max(12.5, 12) + 1 = 13.5.
    S5 (1): S2 broadcast nothing, so max(0, 6) + 1 = 7 / max(7.5, 12) + 2
    = 14 / max(14.5, 13.5) + 1 = 15.5 (had S2 sampled: 16).
    S6 (empty): costs nothing, lands after the last stage's last step: 15.5.
    S7 (1): waits for S4's broadcast (13.5; S6 in the ring is S4's
    successor's successor): 14.5 / max(15, 14) + 2 = 17 / max(17.5, 15.5)
    + 1 = 18.5. The empty step S6 left the stages as they were."""
    clock = _three_stages()
    landed = [
        clock.schedule(_output(s, tokens), samples) for s, (tokens, samples, _) in enumerate(HAND_TIMELINE)
    ]
    assert landed == [lands for _, _, lands in HAND_TIMELINE]


def test_the_engine_blocks_on_the_oldest_step_and_waits_only_for_what_is_left():
    """The hand timeline's landings; the engine blocks on each in turn: it
    waits 5, 6, 1, 1.5, 2, then 0 (the empty step landed with S5), 3 s."""
    clock = _three_stages()
    for step, (tokens, samples, _) in enumerate(HAND_TIMELINE):
        clock.schedule(_output(step, tokens), samples)
    blocks = [clock.block() for _ in HAND_TIMELINE]
    assert blocks == [(5.0, 0.0, 5.0), (6.0, 0.0, 11.0), (1.0, 0.0, 12.0), (1.5, 0.0, 13.5),
                      (2.0, 0.0, 15.5), (0.0, 0.0, 15.5), (3.0, 0.0, 18.5)]  # fmt: skip
    assert clock.now_s == 18.5


def test_a_step_scheduled_late_starts_when_the_engine_schedules_it():
    """After the hand timeline, the engine idles until 30 and schedules a
    1-token step: the stages are free, the broadcast it waits for (S5's,
    15.5) long landed: 31 / 31.5 + 2 = 33.5 / 34 + 1 = 35. ``wait`` returns
    the clock's time after each block; the last one is 35 (5 s after 30)."""
    clock = _three_stages()
    for step, (tokens, samples, _) in enumerate(HAND_TIMELINE):
        clock.schedule(_output(step, tokens), samples)
    assert [clock.wait() for _ in HAND_TIMELINE][-1] == 18.5
    clock.idle_until(30.0)
    clock.idle_until(20.0)  # never backwards
    assert clock.schedule(_output(8)) == 35.0
    assert clock.block() == (5.0, 30.0, 5.0)


def test_a_step_of_non_final_chunks_holds_back_nobody():
    """Two stages of 1 s, a 2 s hand-off (``test_the_pipeline_clock_by_hand``'s).
    S1 [0, 1] [3, 4]; S2 [1, 2] [4, 5]; S3 waits for S1's broadcast only if
    S1 sampled: [4, 5] [7, 8]; with S1 a non-final chunk (no broadcast) it
    starts when stage 0 is free: [2, 3], then max(3 + 2, 5) = 5: [5, 6]."""

    def landings(first_samples: bool) -> list[float]:
        clock = PipelineClock(2, lambda output, stage: 1.0, lambda output: 2.0)
        return [clock.schedule(_output(s), s != 1 or first_samples) for s in (1, 2, 3)]

    assert landings(True) == [4.0, 5.0, 8.0]
    assert landings(False) == [4.0, 5.0, 6.0]


def test_a_silent_step_holds_back_nobody_even_at_time_zero():
    """Two stages of 0.25 s, no hand-off, S1 a non-final chunk: S1 [0, 0.25]
    [0.25, 0.5]; S2 [0.25, 0.5] [0.5, 0.75]; S3 waits for nothing from S1:
    [0.5, 0.75] [0.75, 1]."""
    clock = PipelineClock(2, lambda output, stage: 0.25, lambda output: 0.0)
    assert [clock.schedule(_output(s), s != 1) for s in (1, 2, 3)] == [0.5, 0.75, 1.0]


# -------------------------------------------------------- the engine loop
class _ScriptedCore:
    """An engine core whose calls are given: work while calls are left.
    ``in_flight``: whether a non-empty step is in flight; ``completes``:
    what letting the steps in flight complete answers, in turn."""

    def __init__(
        self,
        calls: list[EngineCall],
        unfinished: bool = False,
        *,
        in_flight: bool = False,
        completes: tuple[bool, ...] = (),
    ) -> None:
        self.calls = deque(calls)
        self.unfinished = unfinished
        self.in_flight = in_flight
        self.completes = deque(completes)
        self.log: list[tuple[str, EngineCall | None]] = []

    def has_work(self) -> bool:
        return bool(self.calls)

    def has_unfinished_requests(self) -> bool:
        return self.unfinished

    def begin_step(self) -> EngineCall:
        call = self.calls.popleft()
        self.log.append(("begin", call))
        return call

    def end_step(self, call: EngineCall) -> None:
        self.log.append(("end", call))

    def only_empty_in_flight(self) -> bool:
        return not self.in_flight

    def complete_in_flight_steps(self) -> bool:
        self.log.append(("complete", None))
        return self.completes.popleft() if self.completes else False


class _IO:
    """The caller: a clock that moves by what the loop yields."""

    def __init__(self, now_s: float = 0.0, ended: bool = True, stop_after: int | None = None) -> None:
        self.now_s, self.ended, self.stop_after = now_s, ended, stop_after
        self.records: list[tuple[EngineCall, float, float]] = []

    def start_s(self) -> float:
        return self.now_s

    def arrivals_ended(self) -> bool:
        return self.ended

    def stopped(self) -> bool:
        return self.stop_after is not None and len(self.records) >= self.stop_after

    def record(self, call: EngineCall, started_s: float, step_s: float) -> None:
        self.records.append((call, started_s, step_s))


class _StubClock:
    """A clock whose blocks are given; it logs what it is asked."""

    def __init__(self, blocks: list[tuple[float, float, float]]) -> None:
        self.now_s = -1.0
        self.blocks = deque(blocks)
        self.scheduled: list[tuple[float, SchedulerOutput, bool]] = []

    def schedule(self, output: SchedulerOutput, samples: bool = True) -> float:
        self.scheduled.append((self.now_s, output, samples))
        return 0.0

    def block(self) -> tuple[float, float, float]:
        return self.blocks.popleft()


def _drive(loop, io: _IO, on_idle=None) -> tuple[list, bool]:
    """Run the loop to its end as the simulation does: time passes by each
    yielded wait; at each ``IDLE`` ``on_idle`` delivers what arrives."""
    pauses = []
    while True:
        try:
            pause = next(loop)
        except StopIteration as stop:
            return pauses, stop.value
        pauses.append(pause)
        if pause is IDLE:
            assert on_idle is not None, "idle with nothing to deliver"
            on_idle()
        else:
            io.now_s += pause


def test_the_loop_waits_out_each_step_from_the_time_the_call_starts():
    """Serial clock, 2 s a step, the engine starting at 1 s: the steps are
    scheduled at 1 and 3 and the loop yields 2 s for each; each record
    names when its step was scheduled and its time; no work and no
    arrivals left: it returns False (not stalled)."""
    first, second = (EngineCall(dispatched=_output(s), waits=True) for s in (1, 2))
    core, io = _ScriptedCore([first, second]), _IO(now_s=1.0)
    pauses, stalled = _drive(run_engine(core, SerialClock(lambda output: 2.0), io), io)
    assert (pauses, stalled) == ([2.0, 2.0], False)
    assert io.records == [(first, 1.0, 2.0), (second, 3.0, 2.0)]
    assert core.log == [("begin", first), ("end", first), ("begin", second), ("end", second)]


def test_a_call_that_does_not_block_is_recorded_with_no_step_and_not_ended():
    """The batch queue not full: the call hands its step (samples False) to
    the clock at the call's start and returns; recorded as (0, 0), no
    ``end_step``. A call that blocks on a step landed already (wait 0)
    yields nothing but ends and records the clock's times (here the second
    waits 0.25 s, the third 0). A call that schedules nothing hands the
    clock nothing."""
    handed = EngineCall(dispatched=_output(1), samples=False)
    landed = EngineCall(dispatched=_output(2), waits=True)
    nothing = EngineCall(waits=True)
    core, io = _ScriptedCore([handed, landed, nothing]), _IO(now_s=7.0)
    clock = _StubClock([(0.25, 1.5, 3.0), (0.0, 2.0, 4.0)])
    pauses, stalled = _drive(run_engine(core, clock, io), io)
    assert (pauses, stalled) == ([0.25], False)
    assert clock.scheduled == [(7.0, handed.dispatched, False), (7.0, landed.dispatched, True)]
    assert io.records == [(handed, 0.0, 0.0), (landed, 1.5, 3.0), (nothing, 2.0, 4.0)]
    assert core.log == [
        ("begin", handed),
        ("begin", landed),
        ("end", landed),
        ("begin", nothing),
        ("end", nothing),
        ("complete", None),  # it ran and applied nothing: the idle rule asks
    ]
    assert clock.now_s == 7.25  # set from the caller's time before each call


def test_an_idle_engine_sleeps_until_an_arrival_and_ends_when_arrivals_do():
    """No work, arrivals open: IDLE; the arrival brings a step; no work
    again: IDLE; arrivals end: the loop returns False."""
    core, io = _ScriptedCore([]), _IO(ended=False)
    step = EngineCall(dispatched=_output(1), waits=True)
    arrivals = [lambda: core.calls.append(step), lambda: setattr(io, "ended", True)]
    pauses, stalled = _drive(
        run_engine(core, SerialClock(lambda output: 1.0), io), io, lambda: arrivals.pop(0)()
    )
    assert (pauses, stalled) == ([IDLE, 1.0, IDLE], False)
    assert io.records == [(step, 0.0, 1.0)]
    assert repr(IDLE) == "IDLE"


@pytest.mark.parametrize("settle", [None, True])
def test_only_a_loop_told_to_settle_at_rest_completes_its_steps_in_flight_before_it_sleeps(settle):
    """No work, arrivals open: a simulation's loop (the default) sleeps with
    its steps in flight left to its next step, as vLLM's busy loop waits on
    its input queue; ``kvsim serve``'s (``settle_at_rest=True``) lets them
    complete first, once per rest. CONTROL: the two logs differ."""
    core, io = _ScriptedCore([]), _IO(ended=False)
    arrivals = [lambda: None, lambda: setattr(io, "ended", True)]
    loop = (
        run_engine(core, _StubClock([]), io)
        if settle is None
        else run_engine(core, _StubClock([]), io, settle_at_rest=settle)
    )
    pauses, stalled = _drive(loop, io, lambda: arrivals.pop(0)())
    assert (pauses, stalled) == ([IDLE, IDLE], False)
    assert core.log == ([] if settle is None else [("complete", None), ("complete", None)])


@pytest.mark.parametrize(("unfinished", "stalled"), [(True, True), (False, False)])
def test_an_idle_call_with_arrivals_over_is_a_stall_only_with_requests_left(unfinished, stalled):
    """An idle call (nothing scheduled, nothing to wait for) is recorded;
    with arrivals over and unfinished requests the run stalled (True);
    without them the loop goes on, finds no work and returns False
    (control). A second call left in the script shows the loop stopped at
    the first: a stall returns at once."""
    idle, after = EngineCall(), EngineCall()
    core, io = _ScriptedCore([idle, after], unfinished=unfinished), _IO()
    pauses, result = _drive(run_engine(core, _StubClock([]), io), io)
    assert (pauses, result) == ([], stalled)
    assert io.records == ([(idle, 0.0, 0.0)] if stalled else [(idle, 0.0, 0.0), (after, 0.0, 0.0)])


def test_an_idle_call_with_arrivals_open_sleeps_until_one():
    idle = EngineCall()
    core, io = _ScriptedCore([idle], unfinished=True), _IO(ended=False)
    pauses, stalled = _drive(run_engine(core, _StubClock([]), io), io, lambda: setattr(io, "ended", True))
    assert (pauses, stalled) == ([IDLE], False)
    assert io.records == [(idle, 0.0, 0.0)]


@pytest.mark.parametrize(
    ("in_flight", "completes", "idle", "asked"),
    [(False, (False,), True, 1), (False, (True,), False, 1), (True, (False,), False, 0)],
    ids=["nothing-changed", "a-fence-passed", "a-step-in-flight"],
)
def test_the_loop_judges_an_empty_call_idle_once_for_every_core(in_flight, completes, idle, asked):
    """The idle rule (``engine_loop.idle_after``): a call that ran and
    applied nothing, with only empty steps in flight, lets the steps in
    flight complete; it is idle only if that changed nothing. Controls: a
    fence that passed (the engine changed: not idle) and a non-empty step
    in flight (not asked to complete, not idle)."""
    call = EngineCall()
    core, io = _ScriptedCore([call], unfinished=True, in_flight=in_flight, completes=completes), _IO()
    pauses, stalled = _drive(run_engine(core, _StubClock([]), io), io)
    assert (call.idle, stalled, pauses) == (idle, idle, [])
    assert core.log.count(("complete", None)) == asked


@pytest.mark.parametrize("settle", [True, False], ids=["serve", "simulation-control"])
def test_an_engine_at_rest_settles_its_steps_only_when_asked(settle):
    """No work and arrivals open: with ``settle_at_rest`` (``kvsim serve``)
    the steps in flight complete before the loop idles; without it (a
    simulation) they are left to the next step."""
    core, io = _ScriptedCore([]), _IO(ended=False)
    loop = run_engine(core, _StubClock([]), io, settle_at_rest=settle)
    assert next(loop) is IDLE
    assert core.log == ([("complete", None)] if settle else [])


@pytest.mark.parametrize("stop_after", [0, 1])
def test_a_stopped_caller_gets_no_further_call(stop_after):
    """Stopped before the first call: none made; after one: one made. A
    stop is not a stall (False), with work and requests left."""
    calls = [EngineCall(), EngineCall()]
    core, io = _ScriptedCore(calls, unfinished=True), _IO(ended=False, stop_after=stop_after)
    pauses, stalled = _drive(run_engine(core, _StubClock([]), io), io, lambda: None)
    assert stalled is False
    assert [call for call, _, _ in io.records] == calls[:stop_after]
    assert pauses == [IDLE] * stop_after


# ------------------------------------------------- the AsyncScheduler twin
def _async_scheduler(
    *, fast_path: bool = True, num_blocks: int = 400, num_spec: int = K, defer_block_free: bool = True
) -> AsyncScheduler:
    """The tiny plan's scheduler (budget 64, 32-token blocks, ``num_spec``
    drafts), pp 2: depth 3."""
    manager = build_kv_cache_manager(tiny_plan(True), num_gpu_blocks=num_blocks)
    config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=MAX_LEN,
        block_size=32,
        num_speculative_tokens=num_spec,
        max_concurrent_batches=3,
        defer_block_free=defer_block_free,
    )
    door = FastPathKVCacheManager(manager, config) if fast_path else manager
    return AsyncScheduler(config, door, decode_stagger=2)


def test_the_async_scheduler_takes_the_fast_path_switch_and_vllms_placeholders():
    """On by default, off when asked; an idle scheduler has no requests
    (False, not a falsy stand-in); the placeholder drafts are vLLM's
    (``AsyncScheduler._spec_token_placeholders = [-1] * num_spec_tokens``,
    ``vllm/v1/core/sched/async_scheduler.py``, 0.33.0)."""
    scheduler = _async_scheduler()
    assert isinstance(scheduler.fast_path, FastPath)
    assert isinstance(_async_scheduler(fast_path=False).fast_path, NoFastPath)
    assert scheduler.has_requests() is False
    assert scheduler._placeholder_drafts == [-1] * K
    scheduler.schedule()  # an empty step resets the flag the same way
    assert scheduler.has_requests() is False


def test_an_aborted_request_keeps_the_scheduler_busy_until_the_next_schedule():
    """vLLM 0.33.0's ``Scheduler._free_request`` adds an aborted request to
    ``finished_req_ids`` (``finish_requests`` calls it), and ``has_requests``
    reads that set: the last request aborted, the engine still has
    requests until a schedule reports it (control: the flag set only for
    requests stopped by their output)."""
    scheduler = _async_scheduler()
    scheduler.add_request(_spec(0, prompt=40, output=8, arrival_s=0.0))
    scheduler.schedule()
    scheduler.finish_requests("r0", RequestStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.has_requests() is True
    scheduler.schedule()
    assert scheduler.has_requests() is False


def _in_flight(computed: int, placeholders: int, eligible: int = 0, stale: int = 0) -> SimpleNamespace:
    """A running request (prompt 100, ``max_tokens`` 10) as the running
    loop reads it."""
    return SimpleNamespace(
        num_computed_tokens=computed,
        num_output_placeholders=placeholders,
        num_prompt_tokens=100,
        max_tokens=10,
        next_decode_eligible_step=eligible,
        num_stale_output_tokens=stale,
    )


@pytest.mark.parametrize(
    ("computed", "placeholders", "skipped"),
    [
        # vLLM's rule (``Scheduler.schedule``'s running loop): skip when
        # placeholders > 0 and computed + 2 - placeholders >= prompt + max_tokens.
        (109, 1, True),  # a final token in flight: 109 + 2 - 1 = 110
        (108, 1, False),  # 109 < 110: one more step may be needed
        (112, 4, True),  # a decode with 3 drafts in flight: 112 + 2 - 4 = 110
        (111, 4, False),
        (109, 0, False),  # nothing in flight: never skipped on this count
        (110, 0, False),
    ],
)
def test_the_running_loop_skips_a_request_sure_to_reach_max_tokens(computed, placeholders, skipped):
    scheduler = _async_scheduler()
    assert scheduler._skips_running(_in_flight(computed, placeholders)) is skipped


def test_the_running_loop_skips_a_decode_until_its_stagger_has_passed():
    """``step_index`` counts the schedule calls made; a decode eligible at
    call 3 is skipped at calls 1 and 2, taken at 3 (vLLM's
    ``next_decode_eligible_step``)."""
    scheduler = _async_scheduler()
    request = _in_flight(50, 4, eligible=3)
    skips = []
    for _ in range(3):
        skips.append(scheduler._skips_running(request))
        scheduler.step_index += 1
    assert skips == [True, True, False]


@pytest.mark.parametrize(("stale", "skipped"), [(0, False), (1, True), (4, True)])
def test_a_waiting_request_with_any_stale_token_in_flight_is_not_resumed(stale, skipped):
    assert _async_scheduler()._skips_waiting(_in_flight(0, 0, stale=stale)) is skipped


def _spec(index: int, prompt: int, output: int, arrival_s: float) -> WorkloadRequest:
    return WorkloadRequest(
        request_id=f"r{index}",
        arrival_s=arrival_s,
        prompt_len=prompt,
        output_len=output,
        prefix_ids=tuple(range(index * 1000, index * 1000 + -(-prompt // 16))),
        prefix_unit=16,
    )


# Requests of one to five output tokens: their last token is in flight
# while the next schedule runs (a final prefill chunk's one placeholder).
SHORT_OUTPUTS = (
    _spec(0, 100, 2, 0.0),
    _spec(1, 300, 1, 5.0),
    _spec(2, 50, 3, 10.0),
    _spec(3, 70, 5, 10.0),
    _spec(4, 90, 1, 10.0),
)


def _short_outputs_conform():
    shape = conformance_shape("long-chunked")
    return run_async_conformance(shape, "off", SHORT_OUTPUTS, mtp_hash_mode="eagle-drop")


def test_short_outputs_take_vllms_steps(monkeypatch):
    """vLLM's own ``step_with_batch_queue`` as the expected value, on
    requests whose last token is in flight at the next schedule. Control:
    a skip that looks only at decodes with drafts in flight (placeholders
    > 1) schedules a request vLLM skips, and differs at step 9 of 22."""
    comparison = _short_outputs_conform()
    assert (comparison.num_steps, comparison.first_difference, comparison.conforms) == (22, None, True)

    def drafts_only(self, request):
        placeholders = request.num_output_placeholders
        if placeholders > 1 and (
            request.num_computed_tokens + 2 - placeholders >= request.num_prompt_tokens + request.max_tokens
        ):
            return True
        return self.step_index + 1 < request.next_decode_eligible_step

    monkeypatch.setattr(AsyncScheduler, "_skips_running", drafts_only)
    assert _short_outputs_conform().first_difference == 9


# ---------------------------------------------------- the async steady lane
def _lane(allocation, caching, max_model_len: int = 1000) -> AsyncSteadyLane:
    """An async lane (K = 3: a decode step of 4 tokens) over a scheduler
    whose fast path has the given settled windows for request ``r``."""
    windows = {"allocation": allocation, "caching": caching}
    door = SimpleNamespace(
        allocations=SimpleNamespace(bounds=lambda request_id: windows["allocation"]),
        caching=SimpleNamespace(bounds=lambda request_id: windows["caching"]),
        decode_span=FastPathKVCacheManager.decode_span,
    )
    scheduler = SimpleNamespace(config=SimpleNamespace(max_model_len=max_model_len))
    scheduler.clip_room = lambda request: Scheduler.clip_room(scheduler, request)  # the scheduler's own
    lane = object.__new__(AsyncSteadyLane)
    lane.scheduler, lane.door, lane.num_spec, lane.step_tokens = scheduler, door, 3, 4
    return lane


# A decode with 100 tokens computed (101 known) and 8 in flight: it has
# processed 92; a schedule's allocation spans to 1 + 2K = 7 past the
# computed tokens (107), so the allocation window ending at 140 lets the
# computed tokens reach 140 - 7 = 133; the max_model_len clip leaves
# max_model_len - 1 - (1 + K) = max_model_len - 5.
DECODING = SimpleNamespace(request_id="r", num_computed_tokens=100, num_tokens=101, num_in_flight_tokens=8)


@pytest.mark.parametrize(
    ("allocation", "caching", "max_model_len", "expected"),
    [
        ((90, 140), (91, 150), 1000, (133, 91, 150)),
        ((92, 140), (92, 150), 1000, (133, 92, 150)),  # windows starting at the processed tokens
        ((93, 140), (90, 150), 1000, None),  # an allocation window past them
        ((90, 140), (93, 150), 1000, None),  # a caching window past them
        ((90, 140), (90, 150), 130, (125, 90, 150)),  # the clip binds: 130 - 5
        ((90, 140), (90, 150), 105, (100, 90, 150)),  # computed exactly at the limit
        ((90, 140), (90, 150), 104, None),  # one past it
        ((90, 106), (90, 150), 1000, None),  # 106 - 7 = 99 < 100
        (None, (90, 150), 1000, None),
        ((90, 140), None, 1000, None),
    ],
)
def test_the_async_lanes_limit_and_caching_window_by_hand(allocation, caching, max_model_len, expected):
    assert _lane(allocation, caching, max_model_len)._limit(DECODING) == expected


def test_a_request_not_decoding_has_no_async_limit():
    prefilling = SimpleNamespace(
        request_id="r", num_computed_tokens=99, num_tokens=101, num_in_flight_tokens=0
    )
    assert _lane((0, 1000), (0, 1000))._limit(prefilling) is None


def test_outputs_landing_out_of_schedule_order_are_refused_in_one_line():
    """The batch queue applies the oldest step first; an output of any
    other step is a caller's error."""
    scheduler = _async_scheduler()
    _, second = scheduler.schedule(), scheduler.schedule()
    with pytest.raises(AssertionError, match="^outputs land in schedule order$"):
        scheduler.output_arrives(second)
    in_order = _async_scheduler()  # control: in order, both land
    first, second = in_order.schedule(), in_order.schedule()
    in_order.output_arrives(first)
    in_order.output_arrives(second)


def test_a_non_final_chunk_samples_no_first_token():
    """A 100-token prompt under a 64-token budget: the first chunk (64)
    samples nothing (vLLM's workers return no token for it), so no first
    token; the final chunk's token is the first (control: the tally
    records one)."""
    scheduler = _async_scheduler()
    scheduler.add_request(tiny_spec(0, 100, output=5))
    (chunk,) = scheduler.schedule().scheduled
    assert chunk.num_scheduled_tokens == 64
    tally = StepTally()
    scheduler.output_arrives(SchedulerOutput(step_index=1, scheduled=(chunk,)))
    scheduler.apply_sampled(chunk, [], tally)
    assert (tally.first_token_request_ids, tally.num_generated_tokens) == ([], 0)
    (final,) = scheduler.schedule().scheduled
    assert final.num_scheduled_tokens == 36
    scheduler.apply_sampled(final, [7], tally)
    assert (tally.first_token_request_ids, tally.num_generated_tokens) == ([chunk.request_id], 1)


def test_a_batch_queue_core_without_the_lane_reads_the_requests_own_state():
    """``steady_lane=False`` (``kvsim serve``'s choice, fast-path rule 5):
    no lane, ``flush`` does nothing, a request's placeholders are its own."""
    scheduler = _async_scheduler()
    runner = ModelRunner(AcceptanceModel(conditional_rates=(0.8, 0.7, 0.6)), np.random.default_rng(0))
    core = BatchQueueEngineCore(scheduler, runner, 3, steady_lane=False)
    assert core.lane is None
    core.flush()
    request = SimpleNamespace(num_output_placeholders=4)
    assert core.num_output_placeholders(request) == 4
    assert BatchQueueEngineCore(scheduler, runner, 3).lane is not None  # control: the lane by default


def _batch_queue(num_blocks: int = 400, num_spec: int = K) -> tuple[BatchQueueEngineCore, list]:
    """The tiny plan's async scheduler under a batch-queue core without the
    lane (budget 64, 32-token blocks, pp 2: depth 3), fenced frees off (vLLM
    without a KV-consumer connector), every draft accepted; the returned
    list records each ``cache_blocks`` call as (request id, tokens)."""
    scheduler = _async_scheduler(
        fast_path=False, num_blocks=num_blocks, num_spec=num_spec, defer_block_free=False
    )
    manager = scheduler.kv_cache_manager
    runner = ModelRunner(AcceptanceModel(conditional_rates=(1.0,) * num_spec), np.random.default_rng(0))
    cached: list[tuple[str, int]] = []
    cache_blocks = manager.cache_blocks

    def recorded(request, num_computed_tokens):
        cached.append((request.request_id, num_computed_tokens))
        return cache_blocks(request, num_computed_tokens)

    manager.cache_blocks = recorded
    return BatchQueueEngineCore(scheduler, runner, 3, steady_lane=False), cached


def _scheduled(call: EngineCall) -> list[tuple[str, int, int]]:
    return [(item.request_id, item.num_scheduled_tokens, item.num_computed_tokens)
            for item in call.dispatched.scheduled]  # fmt: skip


def test_a_preempted_requests_one_stale_token_drains_and_it_resumes():
    """vLLM's rule (``Scheduler.update_from_output``, 0.33.0): a preempted
    request's in-flight output is stale while its count is positive, and
    each landing output drains its scheduled tokens from it; the request is
    not resumed until the count is 0, and its stale output caches nothing.
    The case no compared trace has: one stale token (a one-token final
    chunk in flight at the preemption).

    37 blocks: r000 (prompt 90) and r001 (prompt 33), 5 output tokens each.
    S1: chunks of 32 each (block-aligned). S2: the final chunks, r000 58,
    r001 1. S3: empty (both decodes eligible at S2 + 2). S4 (S1 landed):
    r000's decode (90 + 4 + 3 lookahead = 97 tokens, a fourth block) does
    not fit: the newest request, r001, is preempted with only S2's one
    token in flight: stale 1, computed 0. S2 lands in the same call: the
    stale token is delivered (r001's first token), the count drains to 0;
    r000's blocks are cached up to its tokens not in flight (94 - 4 = 90),
    r001's not at all. r000 finishes when S4 lands (1 + 4 tokens, call 6);
    S7 resumes r001: its prompt and the delivered token, 34 tokens from 0.
    Kills ``apply_sampled``'s ``stale > 1`` (the count stays 1, r001 is
    never resumed; by hand with mutmut's switch) and the caching condition
    joined with ``or`` (a stale request cached at 0)."""
    core, cached = _batch_queue(num_blocks=37)
    scheduler = core.scheduler
    scheduler.add_request(tiny_spec(0, 90, output=5))
    scheduler.add_request(tiny_spec(1, 33, output=5))
    calls = [make_call(core) for _ in range(3)]
    call = core.begin_step()
    victim = scheduler.requests["r001"]
    assert call.dispatched.preempted_request_ids == ("r001",)
    assert (victim.num_stale_output_tokens, victim.num_computed_tokens) == (1, 0)
    cached.clear()
    core.end_step(call)
    assert call.processed.step_index == 2
    assert cached == [("r000", 90)]
    assert call.outcome.first_token_request_ids == ("r000", "r001")
    assert (victim.num_stale_output_tokens, victim.num_output_tokens, victim.num_computed_tokens) == (0, 1, 0)
    calls += [call] + [make_call(core) for _ in range(7)]
    assert [_scheduled(call) for call in calls[:8]] == [
        [("r000", 32, 0), ("r001", 32, 0)],
        [("r000", 58, 32), ("r001", 1, 32)],
        [],
        [("r000", 4, 90)],
        [],
        [("r000", 4, 94)],
        [("r001", 34, 0)],
        [],
    ]
    assert calls[6].dispatched.resumed_request_ids == ("r001",)
    assert calls[5].outcome.finished == {"r000": 5}
    assert calls[10].outcome.finished == {"r001": 5}


@pytest.mark.parametrize(
    ("computed", "placeholders", "max_tokens_end", "reached"),
    [
        (100, 4, 98, True),  # 100 + 2 - 4 = 98: the step in flight ends it even with 3 drafts rejected
        (100, 4, 99, False),  # one token short: another step is needed
        (97, 1, 98, True),  # one placeholder (no drafts): 97 + 2 - 1 = 98
        (100, 0, 0, False),  # nothing in flight: the running loop schedules it
    ],
)
def test_a_step_in_flight_reaches_max_tokens_as_vllms_running_loop_counts(
    computed, placeholders, max_tokens_end, reached
):
    """vLLM 0.33.0's ``Scheduler.schedule`` skips a running request when
    ``num_output_placeholders > 0 and num_computed_tokens + 2 -
    num_output_placeholders >= num_prompt_tokens + max_tokens``: the computed
    tokens count the placeholders, so the step in flight's one sure token
    (drafts all rejected) is +1, and the token after it +1 more."""
    assert reaches_max_tokens(computed, placeholders, max_tokens_end) is reached


def test_a_stale_token_that_reaches_max_tokens_finishes_the_waiting_request():
    """As above with r001 asking one output token: at S4 it is not
    scheduled (its one token is in flight: vLLM's skip) but is still the
    newest request, so the victim. Its stale token, delivered when S2
    lands, reaches ``max_tokens``: it finishes from the waiting queue
    (vLLM's ``stopped_preempted_reqs``), its blocks freed, never resumed."""
    core, _ = _batch_queue(num_blocks=37)
    scheduler = core.scheduler
    scheduler.add_request(tiny_spec(0, 90, output=5))
    scheduler.add_request(tiny_spec(1, 33, output=1))
    calls = [make_call(core) for _ in range(4)]
    assert calls[3].dispatched.preempted_request_ids == ("r001",)
    assert calls[3].outcome.finished == {"r001": 1}
    assert "r001" not in scheduler.requests and list(scheduler.waiting) == []
    calls += [make_call(core) for _ in range(2)]
    assert [_scheduled(call) for call in calls[3:]] == [[("r000", 4, 90)], [], [("r000", 4, 94)]]
    assert calls[5].outcome.finished == {"r000": 5}


def test_a_steps_outcome_sums_its_requests_and_trims_a_stop_within_the_drafts():
    """Two 30-token prompts in S1 (final chunks: one first token each), both
    decoding at S3 (4 tokens each, every draft accepted). r000 asks 5
    tokens: 1 + 4, it stops at the last. r001 asks 3: it stops at the
    second of its 4 and the 2 after it leave its computed tokens
    (vLLM's ``_update_request_with_output``): 34 - 2 = 32. S3's outcome:
    4 + 2 tokens generated, 3 + 3 drafts, 3 + 3 accepted; each landed
    output caches the blocks up to the tokens no longer in flight: 30 each
    after S1, then 34 and 32."""
    core, cached = _batch_queue()
    scheduler = core.scheduler
    scheduler.add_request(tiny_spec(0, 30, output=5))
    scheduler.add_request(tiny_spec(1, 30, output=3))
    calls = [make_call(core) for _ in range(5)]
    assert [_scheduled(call) for call in calls] == [
        [("r000", 30, 0), ("r001", 30, 0)],
        [],
        [("r000", 4, 30), ("r001", 4, 30)],
        [],
        [("r000", 4, 34), ("r001", 4, 34)],
    ]
    outcome = calls[4].outcome
    assert calls[4].processed.step_index == 3
    assert outcome.finished == {"r000": 5, "r001": 3}
    assert (outcome.num_generated_tokens, outcome.num_draft_tokens, outcome.num_accepted_tokens) == (6, 6, 6)
    assert calls[2].outcome.first_token_request_ids == ("r000", "r001")
    assert cached == [("r000", 30), ("r001", 30), ("r000", 34), ("r001", 32)]


def test_without_drafts_a_landed_output_caches_because_it_had_placeholders():
    """No MTP (K = 0): vLLM caches after an output only for a request that
    had output placeholders (``has_output_placeholders or num_spec_tokens
    > 0``); every landed decode had one. One-token decodes on alternate
    steps: 30, 31, 32 for both, then r000 alone (r001 stopped at 3): 33, 34."""
    core, cached = _batch_queue(num_spec=0)
    scheduler = core.scheduler
    scheduler.add_request(tiny_spec(0, 30, output=5))
    scheduler.add_request(tiny_spec(1, 30, output=3))
    while core.has_work():
        make_call(core)
    assert cached == [("r000", 30), ("r001", 30), ("r000", 31), ("r001", 31),
                      ("r000", 32), ("r001", 32), ("r000", 33), ("r000", 34)]  # fmt: skip


def test_the_batch_queue_calls_block_only_when_full_or_out_of_requests():
    """``step_with_batch_queue`` (vLLM 0.33.0): a call with requests
    schedules a step (an empty one too) and returns at once while fewer
    than 3 are in flight; else it blocks on the oldest. ``samples``: some
    request of the step samples; ``idle``: nothing scheduled or an empty
    step, nothing processed or an empty step, only empty steps in flight.
    The two prompts of the outcome test: S1 (final chunks, sampling), S2
    empty (staggered decodes), S3 decodes (full: blocks on S1), S4 empty
    (on S2), S5 decodes (on S3: both finish), S6 empty (the finished ids'
    step, on S4), then no requests: two calls block on S5 and S6, the last
    idle (nothing left in flight)."""
    core, _ = _batch_queue()
    core.scheduler.add_request(tiny_spec(0, 30, output=5))
    core.scheduler.add_request(tiny_spec(1, 30, output=3))
    calls = []
    while core.has_work():
        calls.append(make_call(core))
    assert [(None if c.dispatched is None else c.dispatched.step_index, c.samples, c.waits, c.idle,
             None if c.processed is None else c.processed.step_index) for c in calls] == [
        (1, True, False, False, None),
        (2, False, False, False, None),
        (3, True, True, False, 1),
        (4, False, True, False, 2),
        (5, True, True, False, 3),
        (6, False, True, False, 4),
        (None, True, True, False, 5),
        (None, True, True, True, 6),
    ]  # fmt: skip


def test_a_request_that_never_fits_leaves_the_batch_queue_idle():
    """A 400-token prompt in a 16-block pool is never admitted: each call
    schedules an empty step; the first two return at once, idle (only
    empty steps in flight); the third fills the queue and blocks on the
    first, idle too. A non-final chunk's step samples nothing: a 100-token
    prompt's first chunk (64) in a pool that fits it."""
    core, _ = _batch_queue(num_blocks=16)
    core.scheduler.add_request(tiny_spec(0, 400, output=5))
    calls = [make_call(core) for _ in range(3)]
    assert [(c.dispatched.is_empty, c.samples, c.waits, c.idle) for c in calls] == [
        (True, False, False, True),
        (True, False, False, True),
        (True, False, True, True),
    ]
    chunked, _ = _batch_queue()
    chunked.scheduler.add_request(tiny_spec(0, 100, output=5))
    call = make_call(chunked)
    assert (_scheduled(call), call.samples, call.waits, call.idle) == ([("r000", 64, 0)], False, False, False)
