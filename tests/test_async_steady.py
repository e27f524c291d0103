"""The steady lane in async mode (``sim/sched/fast_path/async_steady.py``): every call
it skips, made anyway, changes nothing; the async conformance gate runs
through it (``tests/test_async_conformance.py`` compares every step with
vLLM's own ``step_with_batch_queue``); and a lane that ignores the decode
stagger, the optimistic computed tokens' rollback, the placeholders or the
tokens in flight goes red there or in the check. (The frames with the fast
path on and off are compared in async mode in ``tests/test_fast_path.py``.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.fast_path import CHECKED_CASES, audited, checked_simulation, frames_with_fast_path
from helpers.scenarios import conformance_requests, conformance_shape

from sim.conformance.async_engine import run_async_conformance
from sim.scenario import load_scenario
from sim.sched.fast_path import async_steady
from sim.sched.fast_path.async_steady import AsyncSteadyLane
from sim.sched.fast_path.kv_cache_manager import FastPathKVCacheManager
from sim.sched.output import ModelRunnerOutput

ASYNC = "engine.mode=async"


def _case_id(value) -> str:
    return Path(str(value)).stem if isinstance(value, str) else ""


# --------------------------------------- every skipped call, made anyway


@pytest.mark.parametrize("layout", ["off", "on"])
@pytest.mark.parametrize(("name", "overrides"), CHECKED_CASES, ids=_case_id)
def test_every_call_the_async_lane_skips_changes_nothing(name, overrides, layout, tmp_path):
    """The audit with the lane, in async mode: each taken decode's
    ``allocate_slots`` (its ``Request`` as the running loop would see it)
    and each kept output's ``cache_blocks`` are made anyway."""
    simulation = checked_simulation(name, [*overrides, ASYNC], layout, tmp_path)
    counts = audited(simulation, lane=True)
    simulation.run()
    # Control: the lane took decodes here, so the check had work.
    assert counts["lane step"] > 0


@pytest.mark.parametrize("layout", ["off", "on"])
def test_every_waiting_call_a_pool_bound_async_decode_skips_changes_nothing(layout, tmp_path):
    """The audit in the case rule 12 is for: a pool-bound decode in async
    mode, whose refused heads found no prefix hit while running requests
    took blocks. Each known-idle waiting loop, skipped lookup and skipped
    admission is made anyway (and must admit nobody, change nothing)."""
    simulation = checked_simulation("saturated-decode", ["workload.max_requests=60", ASYNC], layout, tmp_path)
    counts = audited(simulation, lane=True)
    simulation.run()
    # Control: each kind of skip happened here, so the check had work.
    assert counts["waiting loop"] > 0 and counts["lookup"] > 0 and counts["refused admission"] > 0


def _limit_without_windows_ends(self, request):
    """A lane blind to where its allocation and caching windows end."""
    caching = self.door.caching.bounds(request.request_id)
    return None if caching is None else (1 << 40, caching[0], 1 << 40)


def test_the_check_catches_an_async_lane_across_a_boundary(monkeypatch, tmp_path):
    """Failing control: the lane keeps decoding past its windows (past the
    allocation window alone, the caching window's end hands it back inside
    the margin), and the audit catches a call it skipped."""
    monkeypatch.setattr(AsyncSteadyLane, "_limit", _limit_without_windows_ends)
    simulation = checked_simulation(*CHECKED_CASES[0][:1], [*CHECKED_CASES[0][1], ASYNC], "off", tmp_path)
    audited(simulation, lane=True)
    with pytest.raises(AssertionError, match="allocates|changed the allocator"):
        simulation.run()


def _span_blind_to_tokens_in_flight(request, num_tokens):
    """``FastPathKVCacheManager.decode_span`` from the computed tokens, as if none were in flight."""
    computed = request.num_computed_tokens
    return None if computed < request.num_tokens - 1 else (computed, computed + num_tokens)


def test_the_check_catches_an_async_lane_blind_to_the_tokens_in_flight(monkeypatch, tmp_path):
    """Failing control (fast-path rule 9, through the lane): a lane whose
    window starts at the computed tokens, not the processed ones behind
    those in flight, keeps a decode whose ``allocate_slots`` frees a block."""
    monkeypatch.setattr(FastPathKVCacheManager, "decode_span", staticmethod(_span_blind_to_tokens_in_flight))
    name, overrides = CHECKED_CASES[1]  # pool-bound decode
    simulation = checked_simulation(name, [*overrides, ASYNC], "off", tmp_path)
    audited(simulation, lane=True)
    with pytest.raises(AssertionError, match="allocates|changed the allocator"):
        simulation.run()


# ------------------------------------------------------- conformance


def _conform(shape: str):
    return run_async_conformance(
        conformance_shape(shape), "on", conformance_requests(shape), mtp_hash_mode="eagle-drop"
    )


def test_the_conformance_gate_runs_through_the_lane(monkeypatch):
    """Control for the gate: most of its decodes are the lane's."""
    taken: list[int] = []
    schedule = AsyncSteadyLane.schedule

    def counted(self):
        output = schedule(self)
        taken.append(self.num_taken)
        return output

    monkeypatch.setattr(AsyncSteadyLane, "schedule", counted)
    comparison = _conform("prefix-hits")
    assert comparison.first_difference is None
    assert sum(taken) > 300


def test_a_lane_that_ignores_the_stagger_fails_the_conformance_gate(monkeypatch):
    """Failing control: the lane's decodes eligible every micro-batch
    (stagger 1), and the first steady decode after its entry differs."""
    init = AsyncSteadyLane.__init__

    def unstaggered(self, *args):
        init(self, *args)
        self.decode_stagger = 1

    monkeypatch.setattr(AsyncSteadyLane, "__init__", unstaggered)
    comparison = _conform("prefix-hits")
    assert comparison.first_difference is not None
    assert "scheduled_tokens" in comparison.differing_fields(comparison.first_difference)


def test_a_lane_that_never_rolls_back_a_draft_fails_the_conformance_gate(monkeypatch):
    """Failing control: the lane applies each kept output as if every
    draft were accepted (its optimistic computed tokens never rolled back),
    and a later decode's computed tokens differ from vLLM's."""
    update_from_output = AsyncSteadyLane.update_from_output

    def all_accepted(self, output, sampled):
        tokens_by_id = {
            request_id: tokens[:1] * self.step_tokens if request_id in self._kept and tokens else tokens
            for request_id, tokens in sampled.sampled_token_ids.items()
        }
        return update_from_output(self, output, ModelRunnerOutput(sampled_token_ids=tokens_by_id))

    monkeypatch.setattr(AsyncSteadyLane, "update_from_output", all_accepted)
    comparison = _conform("prefix-hits")
    assert comparison.first_difference is not None
    assert "scheduled_tokens" in comparison.differing_fields(comparison.first_difference)


# ------------------------------------------------------------- frames


class _KeptBlindToTokensInFlight(async_steady._KeptAsync):
    """A kept request whose tokens in flight always read 0 (none counted)."""

    @property  # type: ignore[override]
    def in_flight(self) -> int:
        return 0

    @in_flight.setter
    def in_flight(self, value: int) -> None:
        pass


def test_a_lane_blind_to_the_tokens_in_flight_changes_the_frames(monkeypatch):
    """Failing control for the async frames comparison in
    ``tests/test_fast_path.py``: a lane that counts no tokens in flight
    hands its requests back with none, and the ordinary path then caches and
    frees as if their outputs had all landed. (On ``old-defaults``: the rig's
    8 sequences never fill the pool, so nothing is freed under pressure.)"""
    scenario = load_scenario("old-defaults", ["workload.max_requests=60", ASYNC])
    step_by_step = frames_with_fast_path(scenario, "on", False)
    assert frames_with_fast_path(scenario, "on", True) == step_by_step
    monkeypatch.setattr(async_steady, "_KeptAsync", _KeptBlindToTokensInFlight)
    assert frames_with_fast_path(scenario, "on", True)["steps"] != step_by_step["steps"]
