"""One engine, built once for every caller: the KV cache plan, the
allocator, the scheduler, the engine core, the model runner and the clock,
for a scenario, a side-cache layout and an engine mode.

Every kvsim engine comes from ``build_engine``: the simulation
(``sim/engine.py``, and through it ``kvsim serve`` and ``kvsim bench``) and
both conformance harnesses (``sim/conformance/``). ``engine.mode`` picks
the parts (``_ENGINES``): ``sync`` is vLLM's ``EngineCore.step`` over its
``Scheduler`` on a clock that runs one step at a time; ``async`` is
``step_with_batch_queue`` over ``AsyncScheduler`` (a decode stagger of pp,
pp + 1 micro-batches) on the pipeline clock. The engine loop that drives
them is ``sim/sched/engine_loop.py``. Plain Python: no SimPy. No twin in
vLLM (its ``EngineCore.__init__`` builds the same parts from a
``VllmConfig``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from sim.config import ModelConfig
from sim.kv_cache_manager import KVCacheManager, MTPHashing, build_kv_cache_manager
from sim.kv_cache_plan import KVCachePlan, plan_kv_cache
from sim.pipeline_clock import PipelineClock, SerialClock
from sim.scenario import AllocatorSection, EngineMode, Scenario, SideCacheSwitch
from sim.sched.async_scheduler import AsyncScheduler
from sim.sched.engine_core import BatchQueueEngineCore, EngineCore
from sim.sched.fast_path.kv_cache_manager import FastPathKVCacheManager
from sim.sched.model_runner import AcceptanceModel, ModelRunner
from sim.sched.output import SchedulerOutput
from sim.sched.scheduler import Scheduler, SchedulerConfig
from sim.step_time import StepTimeModel


class StepTimeSource(Protocol):
    """What the clocks ask of a step-time model (``StepTimeModel``, or a
    recording of its answers: ``fork_conformance.ClockTape``)."""

    def step_time_s(self, output: SchedulerOutput) -> float: ...
    def stage_s(self, output: SchedulerOutput, stage: int) -> float: ...
    def handoff_s(self, output: SchedulerOutput) -> float: ...


@dataclass(frozen=True)
class EngineParts:
    """One engine's parts. ``scheduler`` is an ``AsyncScheduler`` and
    ``core`` a ``BatchQueueEngineCore`` in async mode."""

    plan: KVCachePlan
    kv_cache_manager: KVCacheManager
    model_runner: ModelRunner
    scheduler: Scheduler
    core: EngineCore | BatchQueueEngineCore
    clock: SerialClock | PipelineClock


def build_engine(
    scenario: Scenario,
    layout: SideCacheSwitch,
    *,
    mode: EngineMode | None = None,
    steady_lane: bool = True,
    step_time: StepTimeSource | None = None,
    decode_stagger: int | None = None,
    max_concurrent_batches: int | None = None,
    plan: KVCachePlan | None = None,
) -> EngineParts:
    """The engine for ``scenario`` under ``layout``, in ``mode`` (the
    scenario's ``engine.mode`` unless a harness drives one mode).

    ``steady_lane=False``: the engine core without the fast path's steady
    lane (a caller that reads requests between steps: ``kvsim serve``).
    ``step_time``: what the clock asks (the scenario's step-time model by
    default). ``decode_stagger`` and ``max_concurrent_batches`` change the
    batch queue only (the async conformance's controls; pp and pp + 1)."""
    model = scenario.load_model()
    plan = plan if plan is not None else plan_for(scenario, layout)
    config = scheduler_config(scenario, model, plan)
    manager = kv_cache_manager_for(scenario, plan, config)
    # The scheduler's way to the allocator: the fast path's door when on.
    door = FastPathKVCacheManager(manager, config) if scenario.simulation.fast_path else manager
    runner = model_runner(scenario.mtp.acceptance_rates, scenario.seed)
    times = step_time if step_time is not None else step_time_model(scenario, plan)
    parts = _ENGINES[mode or scenario.engine.mode](
        _Wanted(scenario, config, door, runner, times, steady_lane, decode_stagger, max_concurrent_batches)
    )
    return EngineParts(plan, manager, runner, *parts)


@dataclass(frozen=True)
class _Wanted:
    """What a mode's builder builds its parts from."""

    scenario: Scenario
    config: SchedulerConfig
    kv_cache_manager: KVCacheManager | FastPathKVCacheManager  # the scheduler's
    model_runner: ModelRunner
    step_time: StepTimeSource
    steady_lane: bool
    decode_stagger: int | None
    max_concurrent_batches: int | None


_Parts = tuple[Scheduler, EngineCore | BatchQueueEngineCore, SerialClock | PipelineClock]


def _sync_engine(wanted: _Wanted) -> _Parts:
    """vLLM's ``EngineCore.step``: one step at a time."""
    scheduler = Scheduler(wanted.config, wanted.kv_cache_manager)
    core = EngineCore(scheduler, wanted.model_runner, steady_lane=wanted.steady_lane)
    return scheduler, core, SerialClock(wanted.step_time.step_time_s)


def _batch_queue_engine(wanted: _Wanted) -> _Parts:
    """The rig's loop: ``AsyncScheduler`` with a decode stagger of pp, a
    batch queue of pp + 1 micro-batches, the pipeline clock."""
    scenario = wanted.scenario
    pp = scenario.deployment.pipeline_parallel_size
    scheduler = AsyncScheduler(
        wanted.config,
        wanted.kv_cache_manager,
        decode_stagger=wanted.decode_stagger or pp,
    )
    depth = wanted.max_concurrent_batches or scenario.max_concurrent_batches
    core = BatchQueueEngineCore(scheduler, wanted.model_runner, depth, steady_lane=wanted.steady_lane)
    return scheduler, core, pipeline_clock(scenario, wanted.step_time)


# Each engine mode's parts (``EngineSection.mode``).
_ENGINES: dict[EngineMode, Callable[[_Wanted], _Parts]] = {"sync": _sync_engine, "async": _batch_queue_engine}


def pipeline_clock(scenario: Scenario, step_time: StepTimeSource) -> PipelineClock:
    """The async engine's clock: one stage per pipeline rank."""
    return PipelineClock(scenario.deployment.pipeline_parallel_size, step_time.stage_s, step_time.handoff_s)


def step_time_model(scenario: Scenario, plan: KVCachePlan) -> StepTimeModel:
    """The scenario's step-time model, told the block the planner resolved
    (a deployment without ``block_size`` gets the computed one)."""
    config = scenario.step_time_config()
    if config.block_size is None:
        config = config.model_copy(update={"block_size": plan.block_size})
    return StepTimeModel(config)


def plan_for(scenario: Scenario, layout: SideCacheSwitch) -> KVCachePlan:
    """The KV cache plan of the scenario's model and deployment under ``layout``."""
    return plan_kv_cache(scenario.load_model(), scenario.deployment, side_cache_layout=layout == "on")


def model_runner(acceptance_rates: tuple[float, ...], seed: int) -> ModelRunner:
    """The workers' stand-in: the MTP acceptance model on the engine's own
    RNG stream, derived from the scenario seed and independent of the
    workload's (so every backend compared draws the same numbers)."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 1]))
    return ModelRunner(AcceptanceModel(conditional_rates=acceptance_rates), rng)


def kv_cache_manager_for(scenario: Scenario, plan: KVCachePlan, config: SchedulerConfig) -> KVCacheManager:
    """kvsim's ``KVCacheManager``: the scenario's ``allocator:`` section
    (``allocator_options``), its fork patches, the config's hashing."""
    return build_kv_cache_manager(
        plan,
        **allocator_options(scenario.allocator),
        fork=scenario.fork.patches(),
        mtp_hashing=config.mtp_hashing,
    )


def scheduler_config(scenario: Scenario, model: ModelConfig, plan: KVCachePlan) -> SchedulerConfig:
    """The scheduler's flags: every field of the scenario's ``scheduler:``
    section by name (a section field the scheduler lacks is a TypeError here,
    not a silently ignored key), the rest from the deployment, plan and model."""
    section = scenario.scheduler.model_dump()
    section["max_concurrent_batches"] = scenario.max_concurrent_batches
    patches = scenario.fork.patches()
    # The hashing mode is a name in the scenario; the scheduler takes what it
    # derives to for this engine (vLLM's derivation, in MTPHashing).
    mtp_hashing = MTPHashing.for_engine(
        section.pop("mtp_hash_mode"),
        plan.engine,
        enable_prefix_caching=scenario.allocator.enable_prefix_caching,
    )
    return SchedulerConfig(
        **section,
        mtp_hashing=mtp_hashing,
        max_num_seqs=scenario.deployment.max_num_seqs,
        max_model_len=scenario.deployment.max_model_len,
        block_size=plan.block_size,
        num_speculative_tokens=model.mtp.num_speculative_tokens,
        threshold_caps_lone_request=patches.threshold_caps_lone_request,
        caches_after_sampling=not patches.caches_at_allocation_only,
    )


# The ``allocator:`` section's fields -> ``build_kv_cache_manager``'s arguments.
_ALLOCATOR_ARGUMENTS = {
    "enable_prefix_caching": "enable_caching",
}


def allocator_options(section: AllocatorSection) -> dict[str, Any]:
    """``build_kv_cache_manager``'s keyword arguments from every field of the
    section (a new field without an argument is a KeyError, not ignored)."""
    return {_ALLOCATOR_ARGUMENTS[name]: value for name, value in section.model_dump().items()}
