"""The async engine loop, step for step: kvsim's batch-queue engine core and
``AsyncScheduler`` against vLLM 0.33.0's own ``EngineCore.step_with_batch_queue``
over its real ``AsyncScheduler`` (``sim/vllm_bridge/engine_core.py``).

Both run under kvsim's one engine loop (``sim/sched/engine_loop.py``) and
the conformance driver's I/O (``driver.TraceDriver``) on one pipeline clock
(``sim/pipeline_clock.py``): requests are added between engine calls once
the clock has reached their arrival; a call that waits on the oldest step
moves the clock to its landing. When a call schedules nothing, applies
nothing and only empty steps are in flight, nothing but an arrival can
change the engine: the clock jumps to the next arrival (the real engine
would spin on empty steps meanwhile), or the run has stalled. Each engine
makes its whole call at once (vLLM's cannot be split where it blocks; its
workers answer at once), and the clock then says how long it blocked.
Both sample through the same ``ModelRunner`` at schedule time, in schedule
order.

Each engine call is one record (``ComparedEngineCall``): the step it
scheduled (requests, computed tokens before, tokens, output placeholders
after), admissions, preemptions, the step whose output it applied, the
requests that finished, the queues, free blocks, and the prefix-cache
counts as the applied output's stats report them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sim.conformance.backends import ComparedStep, scheduled_request
from sim.conformance.driver import (
    Comparison,
    TraceDriver,
    Trajectory,
    compare,
    conformance_scenario,
    plan_for,
    vllm_settings,
    vllm_unavailable_as_one_line,
)
from sim.engine_assembly import EngineParts, StepTimeSource, build_engine, model_runner, pipeline_clock
from sim.kv_cache_manager import MTPHashMode, scheduler_kv_cache_config
from sim.kv_cache_plan import KVCachePlan
from sim.pipeline_clock import PipelineClock
from sim.scenario import Scenario, SideCacheSwitch
from sim.sched.async_scheduler import AsyncScheduler
from sim.sched.engine_core import BatchQueueEngineCore, EngineCall
from sim.sched.engine_loop import make_call
from sim.sched.model_runner import ModelRunner
from sim.sched.output import ScheduledRequest, SchedulerOutput
from sim.sched.scheduler import RequestSpec
from sim.step_time import StepTimeModel


@dataclass(frozen=True, kw_only=True)
class ComparedEngineCall(ComparedStep):
    """One engine call as the comparison sees it: the synchronous step's
    view of the step it scheduled, the placeholders each scheduled request
    holds after the call, and which step's output the call applied."""

    step: int  # the engine step scheduled (vLLM's current_step), 0: none
    # (request, computed tokens before, tokens scheduled, placeholders after).
    scheduled_tokens: tuple[tuple[str, int, int, int], ...]  # type: ignore[assignment]
    processed_step: int  # the step whose output was applied, 0: none


class _KvsimEngine:
    """kvsim's ``BatchQueueEngineCore`` over its ``AsyncScheduler``."""

    name = "kvsim"

    def __init__(self, engine: EngineParts) -> None:
        assert isinstance(engine.scheduler, AsyncScheduler) and isinstance(engine.core, BatchQueueEngineCore)
        self.scheduler = engine.scheduler
        self.core = engine.core
        self._prefix = (0, 0)

    def add_request(self, spec: RequestSpec) -> bool:
        return self.scheduler.add_request(spec)

    def has_work(self) -> bool:
        return self.core.has_work()

    def only_empty_in_flight(self) -> bool:
        return self.core.only_empty_in_flight()

    def step(self) -> tuple[EngineCall, ComparedEngineCall]:
        call = make_call(self.core)
        dispatched = call.dispatched
        if dispatched is not None:
            queries, hits = self._prefix
            self._prefix = (queries + dispatched.prefix_cache_queries, hits + dispatched.prefix_cache_hits)
        reported = (0, 0)
        if call.processed is not None:
            reported, self._prefix = self._prefix, (0, 0)
        s = self.scheduler
        state = compared_call(
            call,
            placeholders={
                rid: self.core.num_output_placeholders(s.requests[rid])
                for rid in _ids(dispatched)
                if rid in s.requests
            },
            finished=sorted(call.outcome.finished) if call.outcome else [],
            running=[r.request_id for r in s.running],
            waiting=[w.request_id for w in s.waiting],
            num_free_blocks=s.kv_cache_manager.block_pool.get_num_free_blocks(),
            prefix=reported,
        )
        return call, state


def _ids(output: SchedulerOutput | None) -> list[str]:
    return [] if output is None else [item.request_id for item in output.scheduled]


def compared_call(
    call: EngineCall,
    *,
    placeholders: dict[str, int],
    finished: list[str],
    running: list[str],
    waiting: list[str],
    num_free_blocks: int,
    prefix: tuple[int, int],
) -> ComparedEngineCall:
    out = call.dispatched
    return ComparedEngineCall(
        step=out.step_index if out is not None else 0,
        scheduled_tokens=tuple(
            (r.request_id, r.num_computed_tokens, r.num_scheduled_tokens, placeholders.get(r.request_id, 0))
            for r in (out.scheduled if out is not None else ())
        ),
        admitted=(*out.new_request_ids, *out.resumed_request_ids) if out is not None else (),
        resumed=out.resumed_request_ids if out is not None else (),
        preempted=tuple(sorted(out.preempted_request_ids)) if out is not None else (),
        processed_step=call.processed.step_index if call.processed is not None else 0,
        finished=tuple(finished),
        running=tuple(running),
        waiting=tuple(waiting),
        num_free_blocks=num_free_blocks,
        prefix_cache_queries_tokens=prefix[0],
        prefix_cache_hits_tokens=prefix[1],
    )


class _VllmEngine:
    """vLLM's ``EngineCore.step_with_batch_queue`` over its ``AsyncScheduler``."""

    name = "vllm"

    def __init__(self, scenario: Scenario, plan: KVCachePlan, runner: ModelRunner, settings: Any) -> None:
        from sim.vllm_bridge import engine_core as bridge
        from sim.vllm_bridge import scheduler as vllm_scheduler

        self._api, self._scheduler_api = bridge, vllm_scheduler
        vllm_config = vllm_scheduler.build_vllm_config(settings)
        bridge.enable_async_scheduling(vllm_config)
        kv_cache_config = scheduler_kv_cache_config(plan, fork=scenario.fork.patches())
        self.core = bridge.build_engine_core(
            vllm_config, kv_cache_config, bridge.FakeExecutor(self._sample, self._on_schedule)
        )
        self.scheduler: Any = self.core.scheduler  # vLLM's AsyncScheduler
        # On the scheduler's hash block (the prefix-match unit), as the sync backend's.
        self._hasher = vllm_scheduler.request_block_hasher(vllm_config, self.scheduler.hash_block_size)
        self.runner = runner
        self.max_model_len = settings.max_model_len
        self._in_flight: deque[SchedulerOutput] = deque()
        self._scheduled: SchedulerOutput | None = None
        self._samples = False

    def add_request(self, spec: RequestSpec) -> bool:
        if spec.prompt_len >= self.max_model_len:
            return False  # the input processor rejects it; the engine never sees it
        request = self._scheduler_api.make_request(
            request_id=spec.request_id,
            prompt_token_ids=spec.prompt_token_ids(),
            max_tokens=spec.output_len,
            arrival_s=spec.arrival_s,
            block_hasher=self._hasher,
        )
        self.core.add_request(request)
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_requests() or bool(self.core.batch_queue)

    def only_empty_in_flight(self) -> bool:
        return all(output.is_empty for output in self._in_flight)

    def _on_schedule(self, out: Any) -> None:
        self._scheduled = converted = self._convert(out)
        self._in_flight.append(converted)

    def _sample(self, out: Any) -> Any:
        """The workers' output for the step just scheduled."""
        converted = self._scheduled
        assert converted is not None
        samples = {rid: not self.scheduler.requests[rid].is_prefill_chunk for rid in out.num_scheduled_tokens}
        self._samples = any(samples.values())
        sampled = self.runner.execute_sampling(converted, samples).sampled_token_ids
        req_ids = list(out.num_scheduled_tokens)
        return self._api.ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=[sampled.get(rid, []) for rid in req_ids],
        )

    def _convert(self, out: Any) -> SchedulerOutput:
        """kvsim's record of vLLM's step (the clock's and the runner's input).
        Model Runner V2 lists resumed requests among the new ones."""
        new_ids = [r.req_id for r in out.scheduled_new_reqs]
        resumed = tuple(rid for rid in new_ids if self.scheduler.requests[rid].num_preemptions > 0)
        return SchedulerOutput(
            step_index=self.scheduler.current_step,
            scheduled=tuple(
                self._item(out, rid, n, rid in new_ids) for rid, n in out.num_scheduled_tokens.items()
            ),
            new_request_ids=tuple(rid for rid in new_ids if rid not in resumed),
            resumed_request_ids=resumed,
            preempted_request_ids=tuple(sorted(out.preempted_req_ids or ())),
        )

    def _item(self, out: Any, request_id: str, num_scheduled: int, admitted: bool) -> ScheduledRequest:
        num_spec = len(out.scheduled_spec_decode_tokens.get(request_id, ()))
        # Under async every draft is a -1 placeholder; an admitted request's
        # are padding (the worker has none to fill in).
        return scheduled_request(
            self.scheduler.requests[request_id], num_scheduled, num_spec, admitted and num_spec > 0
        )

    def step(self) -> tuple[EngineCall, ComparedEngineCall]:
        self._scheduled, self._samples = None, False
        outputs, executed = self.core.step_with_batch_queue()
        self.core.post_step(executed)
        scheduled = self._scheduled
        processed = self._in_flight.popleft() if outputs is not None else None
        call = EngineCall(scheduled, self._samples, waits=processed is not None, processed=processed)
        finished, prefix = _finished_and_prefix(outputs)
        s = self.scheduler
        state = compared_call(
            call,
            placeholders={
                rid: s.requests[rid].num_output_placeholders for rid in _ids(scheduled) if rid in s.requests
            },
            finished=finished,
            running=[r.request_id for r in s.running],
            waiting=[r.request_id for r in (*s.kv_holding_waiting, *s.waiting)],
            num_free_blocks=s.kv_cache_manager.block_pool.get_num_free_blocks(),
            prefix=prefix,
        )
        return call, state


def _finished_and_prefix(outputs: dict | None) -> tuple[list[str], tuple[int, int]]:
    if outputs is None:
        return [], (0, 0)
    finished = sorted(
        o.request_id for eco in outputs.values() for o in eco.outputs if o.finish_reason is not None
    )
    stats = next((eco.scheduler_stats for eco in outputs.values() if eco.scheduler_stats), None)
    if stats is None or stats.prefix_cache_stats is None:
        return finished, (0, 0)
    p = stats.prefix_cache_stats
    return finished, (p.queries + p.preempted_queries, p.hits + p.preempted_hits)


class _EngineCalls:
    """An engine making its whole call at once, as the engine loop drives
    a core (``engine_loop.LoopCore``): the call is made before the
    clock blocks, and nothing is left to do after it."""

    def __init__(self, engine: _KvsimEngine | _VllmEngine | Any) -> None:
        self.engine = engine
        self._state: ComparedEngineCall | None = None

    def has_work(self) -> bool:
        return self.engine.has_work()

    def has_unfinished_requests(self) -> bool:
        return bool(self.engine.scheduler.has_unfinished_requests())

    def begin_step(self) -> EngineCall:
        call, self._state = self.engine.step()
        return call

    def end_step(self, call: EngineCall) -> None:
        """Made already."""

    def only_empty_in_flight(self) -> bool:
        return self.engine.only_empty_in_flight()

    def complete_in_flight_steps(self) -> bool:
        """A batch queue's steps complete only when applied (as vLLM's)."""
        return False

    def take_state(self) -> ComparedEngineCall | None:
        state, self._state = self._state, None
        return state


def drive_engine(
    engine: _KvsimEngine | _VllmEngine | Any,
    requests: Iterable[RequestSpec],
    clock: PipelineClock,
    max_time_s: float | None = None,
    follow_ups_until_s: float | None = None,
) -> Trajectory:
    """Run ``engine`` over the trace until it drains (or the horizon); a
    state per engine call."""
    driver = TraceDriver(requests, clock, engine.add_request, max_time_s, follow_ups_until_s)
    return driver.run(_EngineCalls(engine), engine.name)


def async_clock(scenario: Scenario, step_time: StepTimeSource) -> PipelineClock:
    return pipeline_clock(scenario, step_time)


def kvsim_engine(scenario: Scenario, layout: SideCacheSwitch, *, depth: int, stagger: int) -> _KvsimEngine:
    """kvsim's batch-queue engine for the scenario (``build_engine``), with
    ``depth`` micro-batches in flight and a decode stagger of ``stagger``."""
    return _KvsimEngine(
        build_engine(scenario, layout, mode="async", decode_stagger=stagger, max_concurrent_batches=depth)
    )


def vllm_engine(scenario: Scenario, plan: KVCachePlan, settings: Any) -> _VllmEngine:
    return _VllmEngine(scenario, plan, model_runner(scenario.mtp.acceptance_rates, scenario.seed), settings)


def max_concurrent_batches(scenario: Scenario) -> int:
    """vLLM's derivation with async scheduling on Model Runner V2: pp + 1
    (``vllm/config/vllm.py``, ``max_concurrent_batches``)."""
    return scenario.deployment.pipeline_parallel_size + 1


def run_async_conformance(
    scenario: Scenario,
    layout: SideCacheSwitch,
    requests: Iterable[RequestSpec],
    *,
    mtp_hash_mode: MTPHashMode | None = None,
    stagger: int | None = None,
    depth: int | None = None,
    fenced: bool = False,
) -> Comparison:
    """kvsim's async engine loop against vLLM's on the same trace. Fenced
    frees are off, as in vLLM without a KV-consumer connector; ``fenced``
    turns on vLLM's own deferral (``defer_block_free``, what it does with a
    KV-consumer connector under overlapping batches) and kvsim's fence
    (the fork's). ``stagger`` and ``depth`` change kvsim's side only (the
    controls)."""
    compared = conformance_scenario(scenario, mtp_hash_mode)
    if fenced:
        section = compared.scheduler.model_copy(update={"defer_block_free": True})
        compared = compared.model_copy(update={"scheduler": section})
    requests = tuple(requests)
    plan = plan_for(compared, layout)
    pp = compared.deployment.pipeline_parallel_size
    with vllm_unavailable_as_one_line("EngineCore"):
        vllm = vllm_engine(compared, plan, vllm_settings(compared, plan))
    vllm.scheduler.defer_block_free = fenced
    kvsim = kvsim_engine(
        compared, layout, depth=depth or max_concurrent_batches(compared), stagger=stagger or pp
    )
    step_time = StepTimeModel(compared.step_time_config())
    horizon_s = compared.simulation.max_time_s
    return compare(
        drive_engine(kvsim, requests, async_clock(compared, step_time), horizon_s),
        drive_engine(vllm, requests, async_clock(compared, step_time), horizon_s),
    )
