"""The clock both backends run under, and the step-by-step comparison.

Both backends run under kvsim's one engine loop (``sim/sched/engine_loop.py``)
with a clock that jumps instead of SimPy's (``TraceDriver``): requests
arrive at their trace times and join the waiting queue before the next
engine call; a step lasts what kvsim's step-time model says of its output;
the engine idles until the next arrival when nothing can run. Here steps
run one after another (``EngineCore.step``: no PP batch queue, no async
scheduling); ``async_engine.py`` drives the batch queue the same way.

Fenced frees are off for the comparison (``defer_block_free=false``): vLLM
0.33.0 fences only with a KV-consumer connector, which the Flash-Next
deployment has not. ``fence_effect`` measures, on kvsim alone, what the
fork's always-on fence changes.
"""

from __future__ import annotations

import bisect
import contextlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields, replace
from typing import Any, Protocol

from sim.config import ConfigError
from sim.conformance.backends import Backend, ComparedStep, KvsimBackend, VllmBackend
from sim.engine_assembly import allocator_options, build_engine, model_runner, plan_for
from sim.kv_cache_manager import MTPHashing, MTPHashMode
from sim.kv_cache_plan import KVCachePlan
from sim.pipeline_clock import PipelineClock, SerialClock
from sim.scenario import ForkSection, Scenario, SideCacheSwitch
from sim.sched.engine_core import EngineCall
from sim.sched.engine_loop import IDLE, LoopCore, run_engine
from sim.sched.scheduler import RequestSpec
from sim.step_time import StepTimeModel


class BackendUnavailable(ConfigError):
    """vLLM's Scheduler cannot be built here (one line: what failed)."""


@dataclass(frozen=True, kw_only=True)
class Trajectory:
    """One backend's run: a state per executed step."""

    backend: str
    steps: tuple[ComparedStep, ...]
    times_s: tuple[float, ...]
    stalled: bool
    # How long each step took (the clock's figure).
    steps_s: tuple[float, ...] = ()
    # The step-time model's answers in the order the clock asked (a
    # recording of the fork's run keeps them; ``fork_conformance.ClockTape``).
    clock_tape: tuple[float, ...] = ()


class RecordingCore(LoopCore, Protocol):
    """An engine core that keeps the comparison's record of each call."""

    def take_state(self) -> ComparedStep | None:
        """The record of the call just made (None: nothing to compare)."""
        ...


class TraceDriver:
    """The engine loop's clock and I/O for a trace (``engine_loop.EngineIO``):
    requests join before the next call once the clock has reached their
    arrival (in arrival, then id, order); an idle engine jumps to the next
    arrival; the run ends at the horizon (a step that would end past it
    never ends; none starts at or after it). A closed-loop turn (a session's
    follow-up, ``follows`` set) arrives its think time after the turn it
    follows finishes or is refused, as in a simulation (``sim/engine.py``),
    unless that is past ``follow_ups_until_s``: then it and the turns after
    it never come."""

    def __init__(
        self,
        requests: Iterable[RequestSpec],
        clock: SerialClock | PipelineClock,
        add_request: Callable[[RequestSpec], Any],
        max_time_s: float | None,
        follow_ups_until_s: float | None = None,
    ) -> None:
        requests = tuple(requests)
        self.follow_ups = {_follows(r): r for r in requests if _follows(r) is not None}
        self.follow_ups_until_s = follow_ups_until_s
        first_turns = [r for r in requests if _follows(r) is None]
        self.pending = deque(sorted(first_turns, key=_arrival_order))
        self.clock = clock
        self.add_request = add_request
        self.max_time_s = max_time_s
        self.states: list[ComparedStep] = []
        self.times_s: list[float] = []
        self.steps_s: list[float] = []
        self._core: RecordingCore | None = None

    def run(self, core: RecordingCore, name: str) -> Trajectory:
        self._core = core
        self._deliver()
        steps = run_engine(core, self.clock, self)
        stalled = False
        try:
            while not self._past_horizon(next(steps)):
                self._deliver()
        except StopIteration as end:
            stalled = end.value
        return Trajectory(
            backend=name,
            steps=tuple(self.states),
            times_s=tuple(self.times_s),
            stalled=stalled,
            steps_s=tuple(self.steps_s),
        )

    def _past_horizon(self, pause: object) -> bool:
        if pause is IDLE:
            self.clock.idle_until(self.pending[0].arrival_s)
        return self.max_time_s is not None and self.clock.now_s > self.max_time_s

    def _deliver(self) -> None:
        pending, now_s = self.pending, self.clock.now_s
        while pending and pending[0].arrival_s <= now_s:
            spec = pending.popleft()
            if not self.add_request(spec):
                self._turn_ended(spec.request_id)

    def _turn_ended(self, request_id: str) -> None:
        follow_up = self.follow_ups.pop(request_id, None)
        if follow_up is None:
            return
        arrival_s = self.clock.now_s + getattr(follow_up, "think_s", 0.0)
        if self.follow_ups_until_s is not None and arrival_s > self.follow_ups_until_s:
            return  # the turns after it are never released either
        spec: Any = replace(follow_up, arrival_s=arrival_s)  # type: ignore[type-var]
        keys = [_arrival_order(r) for r in self.pending]
        self.pending.insert(bisect.bisect(keys, _arrival_order(spec)), spec)

    def start_s(self) -> float:
        return self.clock.now_s

    def arrivals_ended(self) -> bool:
        return not self.pending

    def stopped(self) -> bool:
        return self.max_time_s is not None and self.clock.now_s >= self.max_time_s

    def record(self, call: EngineCall, started_s: float, step_s: float) -> None:
        assert self._core is not None
        state = self._core.take_state()
        if state is not None:
            self.states.append(state)
            self.times_s.append(self.clock.now_s)
            self.steps_s.append(step_s)
            for request_id in state.finished:
                self._turn_ended(request_id)


def _follows(spec: RequestSpec) -> str | None:
    """The turn a session's follow-up follows (open-loop specs have none)."""
    return getattr(spec, "follows", None)


def _arrival_order(spec: RequestSpec) -> tuple[float, str]:
    return (spec.arrival_s, spec.request_id)


class _BackendCore:
    """A ``Backend`` as ``EngineCore.step`` drives it (``engine_core.py``):
    one step at a time, an empty one not run; a step's state is taken when
    its output is applied."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._state: ComparedStep | None = None

    def has_work(self) -> bool:
        return self.backend.has_unfinished_requests()

    def has_unfinished_requests(self) -> bool:
        return self.backend.has_unfinished_requests()

    def begin_step(self) -> EngineCall:
        output = self.backend.schedule()
        if output.is_empty:
            return EngineCall()
        return EngineCall(output, waits=True)

    def end_step(self, call: EngineCall) -> None:
        assert call.dispatched is not None
        call.processed = call.dispatched
        self._state = self.backend.execute(call.dispatched)

    def only_empty_in_flight(self) -> bool:
        return True  # a step is applied in the call that hands it over

    def complete_in_flight_steps(self) -> bool:
        return self.backend.complete_in_flight_steps()

    def take_state(self) -> ComparedStep | None:
        state, self._state = self._state, None
        return state


def drive(
    backend: Backend,
    requests: Iterable[RequestSpec],
    step_time: StepTimeModel | Any,
    max_time_s: float | None = None,
    follow_ups_until_s: float | None = None,
) -> Trajectory:
    """Run ``backend`` over the trace until it drains (or the horizon)."""
    clock = SerialClock(step_time.step_time_s)
    driver = TraceDriver(requests, clock, backend.add_request, max_time_s, follow_ups_until_s)
    return driver.run(_BackendCore(backend), backend.name)


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """Two trajectories, step by step (steps numbered from 1)."""

    left: Trajectory
    right: Trajectory

    @property
    def num_steps(self) -> int:
        return max(len(self.left.steps), len(self.right.steps))

    def identical(self, index: int) -> bool:
        return index < min(len(self.left.steps), len(self.right.steps)) and (
            self.left.steps[index] == self.right.steps[index]
        )

    @property
    def num_identical_steps(self) -> int:
        return sum(self.identical(i) for i in range(self.num_steps))

    @property
    def identical_share(self) -> float:
        return self.num_identical_steps / self.num_steps if self.num_steps else 1.0

    @property
    def first_difference(self) -> int | None:
        """The first differing step (1-based), None when all are identical."""
        return next((i + 1 for i in range(self.num_steps) if not self.identical(i)), None)

    @property
    def conforms(self) -> bool:
        return self.first_difference is None and self.left.stalled == self.right.stalled

    def differing_fields(self, step: int) -> list[str]:
        left, right = self.state(self.left, step), self.state(self.right, step)
        if left is None or right is None:
            return ["(step missing)"]
        return [f.name for f in fields(left) if getattr(left, f.name) != getattr(right, f.name)]

    @staticmethod
    def state(trajectory: Trajectory, step: int) -> Any:
        return trajectory.steps[step - 1] if step <= len(trajectory.steps) else None


def compare(left: Trajectory, right: Trajectory) -> Comparison:
    return Comparison(left=left, right=right)


# ------------------------------------------------------------------ set-up
def kvsim_backend(
    scenario: Scenario, layout: SideCacheSwitch, *, reports_fork_state: bool = False
) -> KvsimBackend:
    """kvsim's synchronous engine for the scenario (``build_engine``)."""
    return KvsimBackend(build_engine(scenario, layout, mode="sync"), reports_fork_state=reports_fork_state)


def vllm_backend(scenario: Scenario, plan: KVCachePlan) -> VllmBackend:
    """vLLM's Scheduler for the scenario; ``BackendUnavailable`` (one line)
    when this vLLM cannot build it."""
    with vllm_unavailable_as_one_line("Scheduler"):
        return VllmBackend(
            plan,
            vllm_settings(scenario, plan),
            model_runner(scenario.mtp.acceptance_rates, scenario.seed),
            fork=scenario.fork.patches(),
        )


@contextlib.contextmanager
def vllm_unavailable_as_one_line(what: str) -> Iterator[None]:
    """Any failure of a vLLM we cannot drive, as ``BackendUnavailable``."""
    try:
        yield
    except Exception as error:
        first_line = (str(error).strip().splitlines() or [""])[0][:200]
        raise BackendUnavailable(
            f"vLLM's {what} cannot be built ({type(error).__name__}: {first_line})"
        ) from None


def vllm_settings(scenario: Scenario, plan: KVCachePlan) -> Any:
    """The engine arguments vLLM is started with for ``scenario``."""
    from sim.vllm_bridge.scheduler import VllmSchedulerSettings

    d, s = scenario.deployment, scenario.scheduler
    # The allocator's settings as the simulation maps them; vLLM's config
    # carries only prefix caching, so a new allocator field must be placed.
    allocator = allocator_options(scenario.allocator)
    enable_caching = allocator.pop("enable_caching")
    assert not allocator, f"allocator options vLLM's settings do not carry: {sorted(allocator)}"
    return VllmSchedulerSettings(
        max_model_len=d.max_model_len,
        max_num_seqs=d.max_num_seqs,
        max_num_batched_tokens=s.max_num_batched_tokens,
        long_prefill_token_threshold=s.long_prefill_token_threshold,
        scheduler_reserve_full_isl=s.scheduler_reserve_full_isl,
        tensor_parallel_size=d.tensor_parallel_size,
        pipeline_parallel_size=d.pipeline_parallel_size,
        block_size=plan.block_size,
        num_speculative_tokens=scenario.load_model().mtp.num_speculative_tokens,
        enable_prefix_caching=enable_caching,
        mtp_hash_mode=s.mtp_hash_mode,
        prefix_match_unit=d.prefix_match_unit,
    )


def conformance_scenario(scenario: Scenario, mtp_hash_mode: MTPHashMode | None = None) -> Scenario:
    """The scenario as compared: fenced frees off (vLLM fences only with a
    KV-consumer connector), the requested MTP hashing mode, and upstream
    vLLM 0.33.0 (every fork patch off: vLLM's Scheduler is the oracle only
    for what vLLM itself does; the fork's patches are pinned by their own
    tests, ``tests/test_fork_*.py``)."""
    section = scenario.scheduler.model_copy(
        update={"defer_block_free": False, **({"mtp_hash_mode": mtp_hash_mode} if mtp_hash_mode else {})}
    )
    return scenario.model_copy(update={"scheduler": section, "fork": ForkSection(base="upstream")})


@dataclass(frozen=True, kw_only=True)
class ConformanceResult:
    comparison: Comparison
    kvsim_hashing: MTPHashing
    vllm_hashing: MTPHashing
    # vLLM's own KVCacheManager serves the rings with kvsim's slot pool.
    vllm_ring_slot_packing: bool
    fence: Comparison | None = None


def run_conformance(
    scenario: Scenario,
    layout: SideCacheSwitch,
    requests: Iterable[RequestSpec],
    *,
    mtp_hash_mode: MTPHashMode | None = None,
    with_fence_effect: bool = False,
) -> ConformanceResult:
    """kvsim against vLLM's Scheduler on the same trace (fence off)."""
    compared = conformance_scenario(scenario, mtp_hash_mode)
    requests = tuple(requests)
    plan = plan_for(compared, layout)
    vllm = vllm_backend(compared, plan)
    kvsim = kvsim_backend(compared, layout)
    step_time = StepTimeModel(compared.step_time_config())
    horizon_s = compared.simulation.max_time_s
    comparison = compare(
        drive(kvsim, requests, step_time, horizon_s), drive(vllm, requests, step_time, horizon_s)
    )
    fence = fence_effect(compared, layout, requests, step_time) if with_fence_effect else None
    return ConformanceResult(
        comparison=comparison,
        kvsim_hashing=kvsim.scheduler.config.mtp_hashing,
        vllm_hashing=vllm.mtp_hashing(),
        vllm_ring_slot_packing=vllm.uses_ring_slot_packing(),
        fence=fence,
    )


def fence_effect(
    scenario: Scenario, layout: SideCacheSwitch, requests: tuple[RequestSpec, ...], step_time: StepTimeModel
) -> Comparison:
    """kvsim with fenced frees off against kvsim with them on (the fork's)."""
    fenced_section = scenario.scheduler.model_copy(update={"defer_block_free": True})
    fenced = scenario.model_copy(update={"scheduler": fenced_section})
    horizon_s = scenario.simulation.max_time_s
    off = drive(kvsim_backend(scenario, layout), requests, step_time, horizon_s)
    on = drive(kvsim_backend(fenced, layout), requests, step_time, horizon_s)
    return compare(replace(off, backend="fence off"), replace(on, backend="fence on"))
