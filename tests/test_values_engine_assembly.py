"""The one engine assembly (``sim/engine_assembly.py``) by value: what each
argument and each fork switch reaches in the parts it builds. Expected values
come from the arguments themselves and the fork's patch notes
(``docs/fork-patches.md``), never from a run. Each test builds the engine of
the shipped ``reference`` scenario once (planning only: no step runs).
"""

from __future__ import annotations

import pytest

from sim.engine_assembly import build_engine, scheduler_config
from sim.scenario import load_scenario
from sim.sched.async_scheduler import AsyncScheduler
from sim.sched.output import SchedulerOutput


class _Times:
    """A step-time source whose answers name it."""

    def step_time_s(self, output: SchedulerOutput) -> float:
        return 7.0

    def stage_s(self, output: SchedulerOutput, stage: int) -> float:
        return 3.0 + stage

    def handoff_s(self, output: SchedulerOutput) -> float:
        return 0.5


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_clock_asks_the_step_time_source_it_is_given(mode):
    """A harness's source (``fork_conformance.ClockTape``) replaces the
    scenario's model: the serial clock asks its ``step_time_s``, the
    pipeline clock its ``stage_s`` and ``handoff_s`` (one stage per
    pipeline rank). CONTROL: without it the clock asks a ``StepTimeModel``."""
    scenario = load_scenario("reference")
    times = _Times()
    clock = build_engine(scenario, "on", mode=mode, step_time=times).clock
    default = build_engine(scenario, "on", mode=mode).clock
    if mode == "sync":
        assert clock.step_time_s == times.step_time_s and default.step_time_s != times.step_time_s
    else:
        assert (clock.stage_s, clock.handoff_s) == (times.stage_s, times.handoff_s)
        assert clock.num_stages == scenario.deployment.pipeline_parallel_size
        assert default.stage_s != times.stage_s


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("steady_lane", [None, False])
def test_the_core_has_the_steady_lane_unless_told_not_to_and_shares_the_runner(mode, steady_lane):
    """The steady lane is on by default (the fast path's, speed only);
    ``kvsim serve`` builds without it. The parts name the one model runner
    the core samples through (the conformance backends read it)."""
    scenario = load_scenario("reference")
    options = {} if steady_lane is None else {"steady_lane": steady_lane}
    parts = build_engine(scenario, "on", mode=mode, **options)
    assert (parts.core.lane is not None) is (steady_lane is None)
    assert parts.model_runner is parts.core.model_runner


def test_the_batch_queue_takes_a_harness_stagger_and_depth_else_pp_and_pp_plus_one():
    """vLLM's async engine staggers decodes by pp and queues pp + 1
    micro-batches; the async conformance's controls replace each."""
    scenario = load_scenario("reference", ["engine.mode=async"])
    pp = scenario.deployment.pipeline_parallel_size
    default = build_engine(scenario, "on", mode="async")
    assert isinstance(default.scheduler, AsyncScheduler)
    assert (default.scheduler.decode_stagger, default.core.max_concurrent_batches) == (pp, pp + 1)
    controls = build_engine(scenario, "on", mode="async", decode_stagger=1, max_concurrent_batches=pp + 3)
    assert (controls.scheduler.decode_stagger, controls.core.max_concurrent_batches) == (1, pp + 3)


@pytest.mark.parametrize(
    ("overrides", "caps", "after_sampling"),
    [
        ([], True, False),  # the fork as shipped: 0050's cap on, 0023's caching at allocation only
        (["fork=upstream"], False, True),  # vLLM 0.33.0
        (["fork.threshold_caps_lone_request=false"], False, False),
        (["fork.caches_at_allocation_only=false"], True, True),
    ],
)
def test_each_fork_switch_reaches_the_scheduler_config_by_itself(overrides, caps, after_sampling):
    """``threshold_caps_lone_request`` passes as is;
    ``caches_at_allocation_only`` is the negation of vLLM's caching after
    sampling. Each switch moves its own field only."""
    scenario = load_scenario("reference", overrides)
    parts = build_engine(scenario, "on", mode="sync")
    config = scheduler_config(scenario, scenario.load_model(), parts.plan)
    assert (config.threshold_caps_lone_request, config.caches_after_sampling) == (caps, after_sampling)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("fast_path", [True, False])
def test_the_scenarios_fast_path_switch_reaches_either_scheduler(mode, fast_path):
    """``simulation.fast_path: false`` (the A/B check that the fast path
    changes no frame) gives the scheduler the manager itself; on, the
    scheduler calls it through the fast path's door (a wrapper)."""
    scenario = load_scenario("reference", [f"simulation.fast_path={str(fast_path).lower()}"])
    parts = build_engine(scenario, "on", mode=mode)
    assert (parts.scheduler.kv_cache_manager is not parts.kv_cache_manager) is fast_path
