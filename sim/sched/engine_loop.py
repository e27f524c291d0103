"""The engine loop, once for every caller: vLLM's busy loop over the
engine core, with the caller's clock and I/O plugged in.

Twin of ``EngineCore.run_busy_loop`` (``vllm/v1/engine/core.py``, 0.33.0):
new requests join between calls; while the engine has work it calls its
step function (``EngineCore.step`` in sync mode, ``step_with_batch_queue``
in async mode: ``engine_core.py``), which blocks on the oldest step's
output before applying it. Here the loop is a generator: where vLLM
blocks, it yields the seconds to let pass, and where vLLM would wait for
input with nothing to do, it yields ``IDLE``. The caller lets the time
pass its own way and delivers the requests that arrive meanwhile:

- the simulation (``sim/engine.py``): SimPy timeouts and a wake-up event;
- the conformance drivers (``sim/conformance/``): a clock that jumps;
- ``kvsim serve`` (``sim/serving/live_engine.py``): the scaled wall clock.

The clock (``StepClock``) says when a step's output lands: one step after
another (``SerialClock``) or a pipeline of stages (``PipelineClock``,
``sim/pipeline_clock.py``). The I/O (``EngineIO``) says what time it is,
whether more requests may come, whether to stop, and records each call.
vLLM spins on empty steps while waiting for a request; an idle engine here
sleeps until one arrives (nothing else can change it). Whether a call left
the engine idle is judged here, once for every core (``idle_after``). The
generator returns whether the run stalled: requests remain that nothing can
schedule.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Final, Protocol

from sim.sched.engine_core import EngineCall
from sim.sched.output import SchedulerOutput


class Idle:
    def __repr__(self) -> str:
        return "IDLE"


# Yielded when nothing but a new request can change the engine.
IDLE: Final = Idle()


class StepClock(Protocol):
    """When the steps handed to the workers land (engine time, seconds)."""

    now_s: float

    def schedule(self, output: SchedulerOutput, samples: bool = True) -> float: ...

    def block(self) -> tuple[float, float, float]:
        """Block on the oldest step in flight: the seconds the engine waits
        for it (0: landed already), when it was scheduled and its time from
        schedule to landing; the clock moves to its landing."""
        ...


class LoopCore(Protocol):
    """An engine core as the loop drives it (``engine_core.py``): its call
    split where it blocks, and what the idle rule (``idle_after``) asks."""

    def has_work(self) -> bool: ...
    def has_unfinished_requests(self) -> bool: ...
    def begin_step(self) -> EngineCall: ...
    def end_step(self, call: EngineCall) -> None: ...

    def only_empty_in_flight(self) -> bool:
        """Every step handed to the workers and not yet applied is empty."""
        ...

    def complete_in_flight_steps(self) -> bool:
        """The engine idles: the steps in flight complete (the frees fenced
        behind them return). True when that changed anything."""
        ...


class EngineIO(Protocol):
    """What the loop's caller supplies besides the clock."""

    def start_s(self) -> float:
        """The time a call made now starts at (the clock is set to it)."""
        ...

    def arrivals_ended(self) -> bool:
        """No request will arrive any more."""
        ...

    def stopped(self) -> bool:
        """Stop before the next call (a horizon, a shutdown)."""
        ...

    def record(self, call: EngineCall, started_s: float, step_s: float) -> None:
        """One call made; ``started_s`` / ``step_s``: when the step it
        applied was scheduled and how long it took (0 when none)."""
        ...


Pause = float | Idle


def run_engine(
    core: LoopCore, clock: StepClock, io: EngineIO, *, settle_at_rest: bool = False
) -> Generator[Pause, None, bool]:
    """Run ``core`` until it has no work left and no request will come
    (returns False), it stalls (True), or ``io`` stops it (False).

    ``settle_at_rest``: an engine left without requests lets its steps in
    flight complete before it waits (``kvsim serve``: a server at rest holds
    no block, and its gauges say so). A simulation leaves them to its next
    step, as vLLM's busy loop waits on its input queue without stepping."""
    while not io.stopped():
        if not core.has_work():
            if io.arrivals_ended():
                return False
            if settle_at_rest:
                core.complete_in_flight_steps()
            yield IDLE
            continue
        clock.now_s = io.start_s()
        call = core.begin_step()
        if call.dispatched is not None:
            clock.schedule(call.dispatched, call.samples)
        started_s = step_s = 0.0
        if call.waits:
            wait_s, started_s, step_s = clock.block()
            if wait_s > 0:
                yield wait_s
            core.end_step(call)
        call.idle = idle_after(core, call)
        io.record(call, started_s, step_s)
        if call.idle:
            if not io.arrivals_ended():
                yield IDLE
            elif core.has_unfinished_requests():
                return True
    return False


def idle_after(core: LoopCore, call: EngineCall) -> bool:
    """The idle rule, for every core: a call that ran nothing (it handed
    the workers no step or an empty one, and applied none or an empty one)
    while only empty steps are in flight lets the steps in flight complete
    (their fenced frees return); if that changed nothing, nothing but a new
    request can change the engine."""
    if not (_is_empty(call.dispatched) and _is_empty(call.processed) and core.only_empty_in_flight()):
        return False
    return not core.complete_in_flight_steps()


def _is_empty(output: SchedulerOutput | None) -> bool:
    return output is None or output.is_empty


def make_call(core: LoopCore) -> EngineCall:
    """One whole call, for callers without a clock: begin it, apply the
    oldest step's output if it waits for one, judge it by the idle rule."""
    call = core.begin_step()
    if call.waits:
        core.end_step(call)
    call.idle = idle_after(core, call)
    return call
