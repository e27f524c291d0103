"""The two scheduler backends ``kvsim conform`` runs, behind one interface.

Both see the same requests at the same simulated times, produce kvsim's
``SchedulerOutput`` (what the step-time model reads), and sample through
the same ``ModelRunner`` (same acceptance model, same seeded RNG, requests in
scheduling order), so identical schedules draw identical numbers. After each
step a backend reports a ``ComparedStep``: what the comparison looks at.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from sim.engine_assembly import EngineParts
from sim.fork.patches import ForkPatches
from sim.fork.pins import PinningKVCacheManager
from sim.fork.retention import RetainingMambaManager
from sim.fork.side_cache_rings import RingCircularBufferManager
from sim.kv_cache_manager import (
    MTPHashing,
    scheduler_kv_cache_config,
)
from sim.kv_cache_plan import KVCachePlan
from sim.sched.engine_core import EngineCore, ScheduledStep
from sim.sched.fast_path.kv_cache_manager import unwrapped
from sim.sched.model_runner import ModelRunner
from sim.sched.output import ScheduledRequest, SchedulerOutput, is_decoding
from sim.sched.scheduler import DRAFT_TOKEN_ID, RequestSpec, Scheduler
from sim.vllm_bridge import MambaManager
from sim.vllm_bridge.fork_server import free_queue_digest, num_fenced_blocks


@dataclass(frozen=True, kw_only=True)
class ComparedStep:
    """One executed step as the comparison sees it (ids in queue order)."""

    # (request, computed tokens before the step, tokens scheduled), in order.
    scheduled_tokens: tuple[tuple[str, int, int], ...]
    admitted: tuple[str, ...]
    resumed: tuple[str, ...]
    preempted: tuple[str, ...]
    finished: tuple[str, ...]
    running: tuple[str, ...]
    waiting: tuple[str, ...]
    num_free_blocks: int
    prefix_cache_queries_tokens: int
    prefix_cache_hits_tokens: int
    # The fork's additions (pins, graces, retained checkpoints, fenced
    # frees), compared only against the fork's own Scheduler.
    fork_state: tuple[tuple[str, Any], ...] | None = None


def _scheduled_tokens(output: SchedulerOutput) -> tuple[tuple[str, int, int], ...]:
    return tuple((r.request_id, r.num_computed_tokens, r.num_scheduled_tokens) for r in output.scheduled)


def scheduled_request(request: Any, num_scheduled: int, num_spec: int, is_padded: bool) -> ScheduledRequest:
    """kvsim's record of a vLLM request's share of the step just scheduled
    (``schedule()`` advanced its computed tokens already)."""
    computed = request.num_computed_tokens - num_scheduled
    return ScheduledRequest(
        request_id=request.request_id,
        num_scheduled_tokens=num_scheduled,
        num_computed_tokens=computed,
        num_spec_tokens=num_spec,
        num_prompt_tokens_left=0 if is_decoding(computed, request.num_tokens) else num_scheduled - num_spec,
        is_padded=is_padded,
    )


class Backend(Protocol):
    name: str

    def add_request(self, spec: RequestSpec) -> bool: ...
    def has_unfinished_requests(self) -> bool: ...
    def schedule(self) -> SchedulerOutput: ...
    def complete_in_flight_steps(self) -> bool: ...
    def execute(self, output: SchedulerOutput) -> ComparedStep: ...


class KvsimBackend:
    """kvsim's own scheduler over kvsim's ``KVCacheManager``."""

    name = "kvsim"
    # Report the fork's columns too (compared with the fork's own Scheduler).
    reports_fork_state = False

    def __init__(self, engine: EngineParts, *, reports_fork_state: bool = False) -> None:
        self.reports_fork_state = reports_fork_state
        self.kv_cache_manager = engine.kv_cache_manager
        self.scheduler = engine.scheduler
        # The engine's own step, so steady steps take the lane they take in
        # a run (``sim/sched/fast_path/steady.py``) and are compared too.
        assert isinstance(engine.core, EngineCore), "the synchronous engine core"
        self.core = engine.core
        self._scheduled: ScheduledStep | None = None

    def add_request(self, spec: RequestSpec) -> bool:
        return self.scheduler.add_request(spec)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def schedule(self) -> SchedulerOutput:
        self._scheduled = self.core.schedule()
        return self._scheduled.output

    def complete_in_flight_steps(self) -> bool:
        return self.scheduler.complete_in_flight_steps()

    def execute(self, output: SchedulerOutput) -> ComparedStep:
        assert self._scheduled is not None and self._scheduled.output is output, "execute the step scheduled"
        outcome = self.core.complete(self._scheduled)
        return ComparedStep(
            scheduled_tokens=_scheduled_tokens(output),
            admitted=output.new_request_ids,
            resumed=output.resumed_request_ids,
            preempted=tuple(sorted(output.preempted_request_ids)),
            finished=tuple(sorted(outcome.finished)),
            running=tuple(r.request_id for r in self.scheduler.running),
            waiting=tuple(w.request_id for w in self.scheduler.waiting),
            num_free_blocks=self.kv_cache_manager.block_pool.get_num_free_blocks(),
            prefix_cache_queries_tokens=output.prefix_cache_queries,
            prefix_cache_hits_tokens=output.prefix_cache_hits,
            fork_state=kvsim_fork_state(self.scheduler) if self.reports_fork_state else None,
        )


# Where each fork-state column is twinned (``sim/fork/``) and the patches it
# shows, so that a ``kvsim conform --fork`` difference names what to read.
FORK_STATE_TWINS: dict[str, str] = {
    "pinned_waiters": "sim/fork/pins.py, sim/fork/scheduler_pins.py (0095, 0096)",
    "graces": "sim/fork/pins.py, sim/fork/scheduler_pins.py (0097)",
    "num_grace_pinned_blocks": "sim/fork/pins.py (0097)",
    "retained": "sim/fork/retention.py (0086, 0087, 0093)",
    "num_deferred_frees": "sim/fork/frees.py (0018, 0023)",
    "free_queue": "sim/fork/frees.py (0023, 0086: the order blocks are freed in)",
}


def fork_state_twins(kvsim: Any, fork: Any) -> list[str]:
    """Each fork-state column that differs between two steps' ``fork_state``
    (pairs of column and value), with its twin and patches."""
    mine, theirs = dict(kvsim or ()), dict(fork or ())
    return [f"{key}: {twin}" for key, twin in FORK_STATE_TWINS.items() if mine.get(key) != theirs.get(key)]


def kvsim_fork_state(scheduler: Scheduler) -> tuple[tuple[str, Any], ...]:
    """kvsim's twin of what the fork's server reports (``fork_server.fork_state``):
    waiter pins, graces in release order, retained checkpoints per Mamba
    group, blocks waiting behind a fence."""
    manager = unwrapped(scheduler.kv_cache_manager)
    state: dict[str, Any] = {"pinned_waiters": (), "graces": (), "num_grace_pinned_blocks": 0}
    if isinstance(manager, PinningKVCacheManager):
        state["pinned_waiters"] = tuple(sorted(manager.pinned_waiter_ids()))
        state["graces"] = tuple(manager.grace_order())
        state["num_grace_pinned_blocks"] = manager.num_grace_pinned_blocks
    state["retained"] = tuple(
        len(m.retained_checkpoints()) if isinstance(m, RetainingMambaManager) else 0
        for m in manager.coordinator.single_type_managers
        if isinstance(m, MambaManager)
    )
    state["num_deferred_frees"] = num_fenced_blocks(entry[1] for entry in scheduler.deferred_frees)
    state["free_queue"] = free_queue_digest(manager.block_pool)
    return tuple(sorted(state.items()))


class VllmBackend:
    """vLLM 0.33.0's own ``Scheduler``, built from a real ``VllmConfig`` and
    given kvsim's scheduler-side ``KVCacheConfig`` of the plan (its kvsim
    spec types make vLLM's own ``KVCacheManager`` build kvsim's ring and
    retaining Mamba managers, as in kvsim), driven one step at a time."""

    name = "vllm"

    def __init__(
        self,
        plan: KVCachePlan,
        settings: Any,
        runner: ModelRunner,
        *,
        fork: ForkPatches,
    ) -> None:
        from sim.vllm_bridge import scheduler as vllm_scheduler

        self._api = vllm_scheduler
        self.vllm_config = vllm_scheduler.build_vllm_config(settings)
        kv_cache_config = scheduler_kv_cache_config(plan, fork=fork)
        self.scheduler = vllm_scheduler.build_vllm_scheduler(self.vllm_config, kv_cache_config)
        self._hasher = vllm_scheduler.request_block_hasher(self.vllm_config, self.scheduler.hash_block_size)
        self.runner = runner
        self.max_model_len = settings.max_model_len
        self.num_speculative_tokens = settings.num_speculative_tokens
        self._vllm_output: Any = None
        self._token_counts: dict[str, int] = {}

    def mtp_hashing(self) -> MTPHashing:
        """What vLLM's Scheduler derived from the config (for the report)."""
        return MTPHashing(
            use_eagle_block_drop=self.scheduler.use_eagle_block_drop,
            num_hash_lookahead_tokens=self.scheduler.num_hash_lookahead_tokens,
            num_prefill_lookahead_tokens=self.scheduler.num_prefill_lookahead,
        )

    def uses_ring_slot_packing(self) -> bool:
        managers = self.scheduler.kv_cache_manager.coordinator.single_type_managers
        return any(isinstance(m, RingCircularBufferManager) and m.slot_pool is not None for m in managers)

    def add_request(self, spec: RequestSpec) -> bool:
        # vLLM's input processor rejects a prompt that leaves no room for
        # one output token; the Scheduler never sees it.
        if spec.prompt_len >= self.max_model_len:
            return False
        self.scheduler.add_request(
            self._api.make_request(
                request_id=spec.request_id,
                prompt_token_ids=spec.prompt_token_ids(),
                max_tokens=spec.output_len,
                arrival_s=spec.arrival_s,
                block_hasher=self._hasher,
            )
        )
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def complete_in_flight_steps(self) -> bool:
        return False  # steps run one at a time; vLLM frees at once (no connector)

    def schedule(self) -> SchedulerOutput:
        self._vllm_output = out = self.scheduler.schedule()
        self._token_counts = {
            rid: self.scheduler.requests[rid].num_tokens for rid in out.num_scheduled_tokens
        }
        return SchedulerOutput(
            step_index=self.scheduler.current_step,
            scheduled=tuple(self._scheduled(rid, n) for rid, n in out.num_scheduled_tokens.items()),
            new_request_ids=tuple(r.req_id for r in out.scheduled_new_reqs),
            resumed_request_ids=tuple(
                rid
                for rid in out.scheduled_cached_reqs.req_ids
                if rid in out.scheduled_cached_reqs.resumed_req_ids
            ),
            preempted_request_ids=tuple(sorted(out.preempted_req_ids or ())),
        )

    def _scheduled(self, request_id: str, num_scheduled: int) -> ScheduledRequest:
        """kvsim's record of one request's share (the step-time model's input)."""
        spec_token_ids = self._vllm_output.scheduled_spec_decode_tokens.get(request_id, ())
        # vLLM's uniform-decode padding schedules -1 placeholder drafts.
        padded = bool(spec_token_ids) and all(token == -1 for token in spec_token_ids)
        return scheduled_request(
            self.scheduler.requests[request_id], num_scheduled, len(spec_token_ids), padded
        )

    def execute(self, output: SchedulerOutput) -> ComparedStep:
        out = self._vllm_output
        sampled = self.runner.execute(output, self._token_counts).sampled_token_ids
        req_ids = list(out.num_scheduled_tokens)
        runner_output = self._api.ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=[sampled.get(rid, []) for rid in req_ids],
        )
        engine_outputs = self.scheduler.update_from_output(out, runner_output)
        finished = sorted(
            o.request_id
            for eco in engine_outputs.values()
            for o in eco.outputs
            if o.finish_reason is not None
        )
        self._propose_drafts([rid for rid in req_ids if sampled.get(rid) and rid not in finished])
        stats = next(eco.scheduler_stats for eco in engine_outputs.values() if eco.scheduler_stats)
        prefix = stats.prefix_cache_stats
        return ComparedStep(
            scheduled_tokens=_scheduled_tokens(output),
            admitted=output.new_request_ids,
            resumed=output.resumed_request_ids,
            preempted=output.preempted_request_ids,
            finished=tuple(finished),
            running=tuple(r.request_id for r in self.scheduler.running),
            waiting=tuple(
                r.request_id for r in (*self.scheduler.kv_holding_waiting, *self.scheduler.waiting)
            ),
            num_free_blocks=self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
            prefix_cache_queries_tokens=prefix.queries + prefix.preempted_queries,
            prefix_cache_hits_tokens=prefix.hits + prefix.preempted_hits,
        )

    def _propose_drafts(self, request_ids: list[str]) -> None:
        """The drafter's K drafts for each request that sampled (the engine
        core hands them over after ``update_from_output``)."""
        if not self.num_speculative_tokens or not request_ids:
            return
        drafts = [[DRAFT_TOKEN_ID] * self.num_speculative_tokens for _ in request_ids]
        self.scheduler.update_draft_token_ids(
            self._api.DraftTokenIds(req_ids=request_ids, draft_token_ids=drafts)
        )
