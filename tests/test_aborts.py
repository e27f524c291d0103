"""Aborts as vLLM's engine core makes them (``EngineCore.abort_requests`` ->
``Scheduler.finish_requests(ids, FINISHED_ABORTED)``): kvsim's scheduler
and vLLM 0.33.0's own Scheduler abort the same requests at the same step
of a heavy-preemption trace (running ones, a preempted one, one never
scheduled, an unknown id) and take identical steps afterwards, free blocks
included; a scheduler that forgets to free an aborted request's blocks
drifts (the control). Also: the zeroing record vLLM drains every step stays
drained over a run of many requests."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

import pytest

from sim.analysis.runs import scenario_workload
from sim.conformance.backends import ComparedStep
from sim.conformance.driver import compare, conformance_scenario, drive, kvsim_backend, plan_for, vllm_backend
from sim.paths import SCENARIOS_DIR
from sim.scenario import load_scenario
from sim.sched.scheduler import Scheduler
from sim.step_time import StepTimeModel
from sim.vllm_bridge import RequestStatus

ABORT_AT_STEP = 12


@dataclass
class Aborting:
    """A conformance backend that, after step ``at_step``, aborts the
    first and last running requests, the first and last waiting ones and
    an unknown id, through its scheduler's ``finish_requests``."""

    backend: Any
    at_step: int
    steps: int = 0
    aborted: tuple[str, ...] = ()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    def execute(self, output: Any) -> ComparedStep:
        state = self.backend.execute(output)
        self.steps += 1
        if self.steps == self.at_step:
            ids = [*state.running[:1], *state.running[-1:], *state.waiting[:1], *state.waiting[-1:], "nobody"]
            finished = self.backend.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            assert all(r.status == RequestStatus.FINISHED_ABORTED for r in finished)
            self.aborted = tuple(r.request_id for r in finished)
        return state


@cache
def _setup() -> tuple[Any, Any, tuple, StepTimeModel]:
    scenario = conformance_scenario(
        load_scenario(str(SCENARIOS_DIR / "conformance" / "heavy-preemption.yaml"))
    )
    plan = plan_for(scenario, "on")
    return scenario, plan, scenario_workload(scenario).requests, StepTimeModel(scenario.step_time_config())


def _run(backend: Any) -> tuple[Aborting, Any]:
    _, _, requests, step_time = _setup()
    aborting = Aborting(backend, ABORT_AT_STEP)
    return aborting, drive(aborting, requests, step_time)


def _kvsim_as_served() -> Any:
    """kvsim as ``kvsim serve`` steps it: the scheduler alone (settled
    allocations on), without the engine's steady lane."""
    scenario, plan, _, _ = _setup()
    backend = kvsim_backend(scenario, "on")
    backend.core.lane = None
    return backend


def test_finish_requests_takes_the_steps_vllms_scheduler_takes():
    scenario, plan, _, _ = _setup()
    kvsim, kvsim_run = _run(_kvsim_as_served())
    vllm, vllm_run = _run(vllm_backend(scenario, plan))
    state = vllm_run.steps[ABORT_AT_STEP - 1]
    # The abort point exercises what it claims: several running, some waiting
    # (a preempted one among them: the trace preempts from step 1 on).
    assert len(state.running) >= 2 and len(state.waiting) >= 2
    assert sorted(kvsim.aborted) == sorted(vllm.aborted) and len(vllm.aborted) == 4
    comparison = compare(kvsim_run, vllm_run)
    assert comparison.conforms, comparison.first_difference
    assert len(kvsim_run.steps) > ABORT_AT_STEP + 10
    assert not set(vllm.aborted) & {
        r for s in vllm_run.steps[ABORT_AT_STEP:] for r, _, _ in s.scheduled_tokens
    }


def test_control_an_abort_that_keeps_the_blocks_drifts(monkeypatch):
    scenario, plan, _, _ = _setup()
    _, vllm_run = _run(vllm_backend(scenario, plan))

    def leak(self: Scheduler, request: Any) -> None:
        del self.requests[request.request_id]

    monkeypatch.setattr(Scheduler, "_free_request", leak)
    _, kvsim_run = _run(_kvsim_as_served())
    first = compare(kvsim_run, vllm_run).first_difference
    assert first is not None and first > ABORT_AT_STEP


def test_an_abort_between_synchronous_steps_never_meets_a_step_in_flight(monkeypatch):
    """vLLM's abort keeping the blocks of a request with a step in flight
    changes nothing here: a synchronous step has none in flight when the
    abort comes. Why tests/test_async_conformance.py aborts under the batch
    queue (where the same mutant fails the gate)."""
    from helpers import vllm_mutants

    vllm_mutants.abort_in_flight_keeps_blocks().apply(monkeypatch)
    scenario, plan, _, _ = _setup()
    _, kvsim_run = _run(_kvsim_as_served())
    vllm, vllm_run = _run(vllm_backend(scenario, plan))
    assert len(vllm.aborted) == 4
    assert compare(kvsim_run, vllm_run).conforms


@pytest.mark.parametrize("drain", [True, False])
def test_the_zeroing_record_is_drained_every_step(drain, monkeypatch):
    """A Mamba model needs KV zeroing, so vLLM's full-attention managers
    record every new block id, and vLLM's scheduler drains the record each
    step. Over 120 short requests the record stays within the pool (one
    step's allocations at most); without the drain (the control) it keeps
    every allocation ever made, several times the pool's blocks."""
    from sim.kv_cache_manager import KVCacheManager

    if not drain:
        monkeypatch.setattr(KVCacheManager, "take_new_block_ids", lambda self: [])
    scenario = load_scenario(
        str(SCENARIOS_DIR / "conformance" / "heavy-preemption.yaml"),
        ["workload.num_requests=120", "workload.output.lo=4", "workload.output.hi=8"],
    )
    plan = plan_for(scenario, "on")
    backend = kvsim_backend(scenario, "on")
    recorders = [m for m in backend.kv_cache_manager.managers if m.records_new_block_ids]
    assert recorders, "the model's attention groups record blocks for zeroing"
    trajectory = drive(
        backend, scenario_workload(scenario).requests, StepTimeModel(scenario.step_time_config())
    )
    assert sum(len(s.finished) for s in trajectory.steps) == 120
    recorded = sum(len(m.new_block_ids) for m in recorders)
    if drain:
        assert recorded <= plan.num_blocks
    else:
        assert recorded > 3 * plan.num_blocks
