"""The tiny scheduler (32-token blocks, the tiny model) and what drives it:
workload requests with a prefix family, an engine that checks the allocator
after every step, fixed acceptance draws."""

from __future__ import annotations

import numpy as np

from helpers.allocator import K, tiny_plan
from sim.allocator_invariants import check_allocator
from sim.fork.patches import AS_SHIPPED, ForkPatches
from sim.kv_cache_manager import build_kv_cache_manager
from sim.sched.engine_core import EngineCore, ScheduledStep
from sim.sched.engine_loop import make_call
from sim.sched.fast_path.kv_cache_manager import FastPathKVCacheManager
from sim.sched.model_runner import AcceptanceModel, ModelRunner, accepted_drafts
from sim.sched.output import SchedulerOutput, StepOutcome
from sim.sched.scheduler import Scheduler, SchedulerConfig
from sim.workloads import WorkloadRequest

MAX_LEN = 512


def tiny_spec(index: int, prompt: int, output: int = 20, family: int | None = None) -> WorkloadRequest:
    ids = tuple((family if family is not None else 1000 + index) * 100 + i for i in range(-(-prompt // 16)))
    return WorkloadRequest(
        request_id=f"r{index:03d}",
        arrival_s=0.0,
        prompt_len=prompt,
        output_len=output,
        prefix_ids=ids,
        prefix_unit=16,
    )


def tiny_scheduler(
    num_blocks: int = 400,
    *,
    on: bool = True,
    batches: int = 2,
    defer: bool = True,
    budget: int = 64,
    seqs: int = 8,
    fork: ForkPatches = AS_SHIPPED,
) -> Scheduler:
    manager = build_kv_cache_manager(tiny_plan(on), num_gpu_blocks=num_blocks, fork=fork)
    config = SchedulerConfig(
        max_num_seqs=seqs,
        max_num_batched_tokens=budget,
        max_model_len=MAX_LEN,
        block_size=32,
        num_speculative_tokens=K,
        defer_block_free=defer,
        max_concurrent_batches=batches,
    )
    return Scheduler(config, FastPathKVCacheManager(manager, config))


class FixedDraws:
    """An RNG stand-in whose ``random()`` returns the given draws in order."""

    def __init__(self, *draws: float) -> None:
        self.draws = list(draws)

    def random(self) -> float:
        return self.draws.pop(0)

    def accepted_drafts(self, rates: tuple[float, ...]) -> int:
        return accepted_drafts(rates, self)

    def accepted_drafts_each(self, rates_each: list[tuple[float, ...]]) -> list[int]:
        return [accepted_drafts(rates, self) for rates in rates_each]


class CheckedEngine(EngineCore):
    """The engine's own call (``EngineCore``) made whole, checking the
    allocator's invariants after each step that ran."""

    def __init__(self, scheduler: Scheduler, rates=(0.8, 0.7, 0.6), seed: int = 0) -> None:
        super().__init__(
            scheduler, ModelRunner(AcceptanceModel(conditional_rates=rates), np.random.default_rng(seed))
        )
        self._scheduled: ScheduledStep | None = None

    def schedule(self) -> ScheduledStep:
        self._scheduled = super().schedule()
        return self._scheduled

    def step(self) -> tuple[SchedulerOutput, StepOutcome | None]:
        """One call (``engine_loop.make_call``: an empty step lets the steps
        in flight complete): the step scheduled, empty when none ran, and
        its outcome (None: none)."""
        call = make_call(self)
        if call.outcome is not None:
            check_allocator(self.scheduler.kv_cache_manager, self.scheduler.deferred_blocks())
        assert self._scheduled is not None
        return self._scheduled.output, call.outcome

    def run(self, max_steps: int = 2000) -> list:
        """Step until every request finished (bounded)."""
        log = []
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                break
            log.append(self.step())
        return log
