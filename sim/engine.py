"""The SimPy edge: one simulation = one scenario under one layout.

Three processes, named for what they do: ``arrivals`` feeds the workload's
requests to the scheduler at their arrival times (a closed-loop follow-up
turn instead arrives its think time after the turn it follows ends:
``follow_up``, one short process per turn); ``engine_loop`` runs the
one engine loop (``sim/sched/engine_loop.py``: schedule, let the step's time
pass, apply the sampled tokens) with SimPy as its clock and records each
step applied; ``sampler`` records the gauges at a fixed interval
(time-uniform curves, exact at each instant: the state changes only at
events). The scheduler, the allocator and the step-time model never see
SimPy.
Everything a simulation owns (clock, RNG, allocator, ids) lives in it, so two
simulations in one process do not interfere. No twin in vLLM.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any

import numpy as np
import simpy
from tqdm import tqdm

from sim.allocator_invariants import check_allocator
from sim.engine_assembly import build_engine, plan_for, step_time_model
from sim.kv_cache_plan import KVCachePlan
from sim.metrics import SAMPLE_RECORD, SAMPLED_TOTALS, STEP_RECORD
from sim.scenario import MAX_SAMPLE_ROWS, Scenario, SideCacheSwitch
from sim.sched.engine_core import EngineCall
from sim.sched.engine_loop import IDLE, run_engine
from sim.sched.output import SchedulerOutput, StepOutcome
from sim.sched.stats import Columns, SchedulerGauges, flat_columns, flat_row
from sim.workloads import Workload, WorkloadRequest


@dataclass
class Recording:
    """What a simulation observed: one row per step and per sample (stored
    column-wise, the registry's columns), one record per request."""

    scenario: str
    layout: SideCacheSwitch
    plan: dict[str, Any]
    steps: Columns = field(default_factory=lambda: Columns(STEP_RECORD))
    requests: dict[str, dict[str, Any]] = field(default_factory=dict)
    samples: Columns = field(default_factory=lambda: Columns(SAMPLE_RECORD))
    end_time_s: float = 0.0
    num_rejected: int = 0
    # True when requests remained that could never be scheduled.
    stalled: bool = False
    # True when the samples stopped at MAX_SAMPLE_ROWS before the run ended.
    samples_truncated: bool = False


class Simulation:
    """``steady_lane=False``: the sync engine core without the fast path's
    steady lane (a caller that reads requests between steps: ``kvsim serve``)."""

    def __init__(
        self,
        scenario: Scenario,
        layout: SideCacheSwitch,
        workload: Workload,
        *,
        progress: bool = False,
        steady_lane: bool = True,
    ) -> None:
        self.scenario = scenario
        self.layout = layout
        self.workload = workload
        self.progress = progress
        plan = plan_for(scenario, layout)
        self.step_time = step_time_model(scenario, plan)
        engine = build_engine(scenario, layout, steady_lane=steady_lane, step_time=self.step_time, plan=plan)
        self.plan: KVCachePlan = engine.plan
        self.kv_cache_manager = engine.kv_cache_manager
        self.model_runner = engine.model_runner
        self.scheduler = engine.scheduler
        self.core = engine.core
        self.clock = engine.clock
        self.env = simpy.Environment()
        self._wakeup = self.env.event()
        # The processes are events that trigger when they end.
        self._arrivals: simpy.Process | None = None
        self._engine: simpy.Process | None = None
        self._bar: tqdm | None = None
        self.totals: dict[str, int] = dict.fromkeys(SAMPLED_TOTALS, 0)
        # Closed loop (set by ``start``): turn -> the turn that follows it,
        # and how many follow-ups have neither arrived nor been dropped (the
        # arrivals have not ended while any has not).
        self._follow_ups: dict[str, WorkloadRequest] = {}
        self._num_pending_follow_ups = 0
        self.recording = Recording(scenario=scenario.name, layout=layout, plan=self.plan.to_dict())

    # ------------------------------------------------------------------- run
    def start(self) -> None:
        """Register the processes; ``run`` then advances the clock to the end
        (a caller may instead advance ``env`` itself, a little at a time)."""
        self._follow_ups = self.workload.follow_ups()
        self._num_pending_follow_ups = len(self._follow_ups)
        self._arrivals = self.env.process(self.arrivals())
        self._engine = self.env.process(self.engine_loop())
        if self.scenario.simulation.sample_interval_s:
            self.env.process(self.sampler(self.scenario.simulation.sample_interval_s))

    def finish(self) -> Recording:
        """The recording, ending when the engine stopped (or at the horizon
        while it still ran): the sampler's last tick may come later, and a
        run's duration must not depend on the sampling interval."""
        if self._engine is None or self._engine.is_alive:  # stopped at the horizon
            self.recording.end_time_s = float(self.env.now)
        self.core.flush()
        self.recording.num_rejected = self.scheduler.num_rejected
        return self.recording

    def run(self) -> Recording:
        """To the end; the progress bar (when asked for) counts the work:
        requests done (finished or rejected) out of the workload's."""
        self.start()
        with tqdm(
            total=len(self.workload.requests),
            unit="req",
            delay=3,
            disable=not self.progress,
            desc=f"{self.scenario.name} [{self.layout}]",
            leave=False,
        ) as bar:
            self._bar = bar
            self.env.run(until=self.scenario.simulation.max_time_s)
        self._bar = None
        return self.finish()

    def arrivals(self) -> Generator[simpy.Event, Any, None]:
        for spec in self.workload.requests:
            if spec.follows is not None:  # arrives when its turn before ends
                continue
            if spec.arrival_s > self.env.now:
                yield self.env.timeout(spec.arrival_s - self.env.now)
            self._submit(spec)
        self._wake()  # the engine may be asleep on an empty queue: let it see the end

    def _submit(self, spec: WorkloadRequest) -> None:
        accepted = self.scheduler.add_request(spec)
        self._record_arrival(spec, accepted)
        if not accepted:
            self._advance_bar(1)
            self._turn_ended(spec.request_id)
        self._wake()

    def _turn_ended(self, request_id: str) -> None:
        """A request finished or was refused: its follow-up (if any) is due
        its think time from now, unless that is past the workload's
        ``follow_ups_until_s``; then it and the turns after it never come."""
        follow_up = self._follow_ups.get(request_id)
        if follow_up is None:
            return
        until_s = self.workload.follow_ups_until_s
        if until_s is not None and self.env.now + follow_up.think_s > until_s:
            dropped: WorkloadRequest | None = follow_up
            while dropped is not None:
                self._num_pending_follow_ups -= 1
                dropped = self._follow_ups.get(dropped.request_id)
            self._wake()
            return
        self.env.process(self.follow_up(follow_up))

    def follow_up(self, spec: WorkloadRequest) -> Generator[simpy.Event, Any, None]:
        """Submit ``spec`` after its think time, stamped with the time it
        actually arrives (what the queue and its TTFT count from)."""
        yield self.env.timeout(spec.think_s)
        self._num_pending_follow_ups -= 1
        self._submit(replace(spec, arrival_s=float(self.env.now)))

    def _wake(self) -> None:
        if not self._wakeup.triggered:
            self._wakeup.succeed()

    def _sleep(self) -> simpy.Event:
        self._wakeup = self.env.event()
        return self._wakeup

    def engine_loop(self) -> Generator[simpy.Event, Any, None]:
        """The one engine loop on SimPy's clock: its pauses become timeouts,
        its idle waits a sleep until the next arrival."""
        steps = run_engine(self.core, self.clock, self)
        try:
            while True:
                pause = next(steps)
                yield self._sleep() if pause is IDLE else self.env.timeout(pause)
        except StopIteration as end:
            self.recording.stalled = end.value
        self.recording.end_time_s = float(self.env.now)

    # The engine loop's I/O (``engine_loop.EngineIO``).
    def start_s(self) -> float:
        return self.env.now

    def arrivals_ended(self) -> bool:
        arrivals_done = self._arrivals is not None and not self._arrivals.is_alive
        return arrivals_done and self._num_pending_follow_ups == 0

    def stopped(self) -> bool:
        return False  # SimPy stops the run at the horizon

    def record(self, call: EngineCall, started_s: float, step_s: float) -> None:
        """A row for each step applied that ran something."""
        processed = call.processed
        if processed is not None and not processed.is_empty:
            assert call.outcome is not None
            self._record_step(processed, call.outcome, started_s, step_s)

    def sampler(self, interval_s: float) -> Generator[simpy.Event, Any, None]:
        """Until the engine is done, and at most ``MAX_SAMPLE_ROWS`` rows (a
        drain long past the last arrival stops sampling, and says so)."""
        assert self._engine is not None, "start() registers the engine before the sampler"
        while self._engine.is_alive:
            if len(self.recording.samples) >= MAX_SAMPLE_ROWS:
                self.recording.samples_truncated = True
                return
            self._record_sample(self.scheduler.make_gauges())
            yield self.env.timeout(interval_s)

    # ------------------------------------------------------------- recording
    def _record_arrival(self, spec: WorkloadRequest, accepted: bool) -> None:
        self.recording.requests[spec.request_id] = {
            "request_id": spec.request_id,
            "arrival_s": spec.arrival_s,
            "prompt_tokens": spec.prompt_len,
            "output_tokens": spec.output_len,
            "rejected": not accepted,
            "admitted_s": np.nan,
            "first_token_s": np.nan,
            "finished_s": np.nan,
            "num_preemptions": 0,
            "prefix_hit_tokens": 0,
            "generated_tokens": 0,
            "turn": spec.turn,
        }

    def _record_step(
        self, output: SchedulerOutput, outcome: StepOutcome, started_s: float, step_s: float
    ) -> None:
        now = self.env.now
        requests = self.recording.requests
        for request_id in output.new_request_ids:
            requests[request_id]["admitted_s"] = started_s
            requests[request_id]["prefix_hit_tokens"] = output.admitted_hits[request_id]
        for request_id in output.preempted_request_ids:
            requests[request_id]["num_preemptions"] += 1
        for request_id in outcome.first_token_request_ids:
            requests[request_id]["first_token_s"] = now
        self._add_totals(output, outcome)
        for request_id, num_output_tokens in outcome.finished.items():
            requests[request_id]["finished_s"] = now
            requests[request_id]["generated_tokens"] = num_output_tokens
            self._turn_ended(request_id)
        names, values = flat_row(self.scheduler.make_stats(output, outcome))
        self.recording.steps.append_values(_with_clock(names), (now, step_s, *values))
        if self.scenario.simulation.check_invariants:
            check_allocator(
                self.kv_cache_manager,
                self.scheduler.deferred_blocks(),
                self.scheduler.copy_retained_blocks(),
            )
        self._advance_bar(len(outcome.finished))

    def _advance_bar(self, num_requests_done: int) -> None:
        if self._bar is not None and num_requests_done:
            self._bar.update(num_requests_done)

    def _record_sample(self, gauges: SchedulerGauges) -> None:
        values = flat_columns(gauges)
        row = {"time_s": self.env.now, **self.totals} | {
            name: values[name] for name in SAMPLE_RECORD if name in values
        }
        self.recording.samples.append(row)

    def _add_totals(self, output: SchedulerOutput, outcome: StepOutcome) -> None:
        """vLLM counts a prompt's tokens when its first token comes out."""
        prompt_tokens = sum(
            self.recording.requests[r]["prompt_tokens"] for r in outcome.first_token_request_ids
        )
        totals = self.totals  # one line a total, no loop: it runs for every step
        totals["num_preemptions_total"] += len(output.preempted_request_ids)
        totals["prefix_cache_queries_total_tokens"] += output.prefix_cache_queries
        totals["prefix_cache_hits_total_tokens"] += output.prefix_cache_hits
        totals["num_draft_total_tokens"] += outcome.num_draft_tokens
        totals["num_accepted_total_tokens"] += outcome.num_accepted_tokens
        totals["num_prompt_total_tokens"] += prompt_tokens
        totals["num_generation_total_tokens"] += outcome.num_generated_tokens


@cache
def _with_clock(names: tuple[str, ...]) -> tuple[str, ...]:
    """A step row's names: the clock's, then the scheduler's stats' (one
    tuple per stats shape, so the step columns check it once)."""
    return ("time_s", "step_time_s", *names)


def simulate(
    scenario: Scenario, layout: SideCacheSwitch, workload: Workload, *, progress: bool = False
) -> Recording:
    return Simulation(scenario, layout, workload, progress=progress).run()
