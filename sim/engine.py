"""The SimPy edge: one simulation = one scenario under one layout.

Three processes, named for what they do: ``arrivals`` feeds the workload's
requests to the scheduler at their arrival times; ``engine_loop`` schedules a
step, waits the step's duration, applies the sampled tokens, and records the
step; ``sampler`` records the gauges at a fixed interval (time-uniform
curves, exact at each instant: the state changes only at events). The
scheduler, the allocator and the step-time model never see SimPy.
Everything a simulation owns (clock, RNG, allocator, ids) lives in it, so two
simulations in one process do not interfere. No twin in vLLM.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import simpy
from tqdm import tqdm

from sim.allocator_invariants import check_allocator
from sim.kv_cache_manager import build_kv_cache_manager
from sim.layout import KVCachePlan, plan_kv_cache
from sim.scenario import Layout, Scenario
from sim.sched.model_runner import AcceptanceModel, ModelRunner
from sim.sched.output import SchedulerOutput, StepOutcome
from sim.sched.scheduler import Scheduler, SchedulerConfig
from sim.step_time import StepTimeModel
from sim.workloads import RequestSpec, Workload


@dataclass
class Recording:
    """What a simulation observed: one row per step, one record per request."""

    scenario: str
    layout: Layout
    plan: dict[str, Any]
    steps: list[dict[str, Any]] = field(default_factory=list)
    requests: dict[str, dict[str, Any]] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)
    end_time_s: float = 0.0
    num_rejected: int = 0
    # True when requests remained that could never be scheduled.
    stalled: bool = False


# Running totals the sampler records next to the gauges, named like the
# steps frame's cumulative columns; they mirror vLLM's /metrics counters
# (vllm:num_preemptions, prefix_cache_queries/hits, spec_decode_num_draft/
# accepted_tokens, prompt_tokens, generation_tokens), so a replay's scraped
# counters and a simulation's samples share columns.
SAMPLED_TOTALS = (
    "num_preemptions_total",
    "prefix_cache_queries_total_tokens",
    "prefix_cache_hits_total_tokens",
    "num_draft_total_tokens",
    "num_accepted_total_tokens",
    "num_prompt_total_tokens",
    "num_generation_total_tokens",
)


def _runner_rng(seed: int) -> np.random.Generator:
    """The simulation's own RNG stream, derived from the scenario seed and
    independent of the workload's."""
    return np.random.default_rng(np.random.SeedSequence([seed, 1]))


class Simulation:
    def __init__(
        self, scenario: Scenario, layout: Layout, workload: Workload, *, progress: bool = False
    ) -> None:
        self.scenario = scenario
        self.layout = layout
        self.workload = workload
        self.progress = progress
        self.plan: KVCachePlan = plan_kv_cache(
            scenario.load_model(), scenario.deployment, side_cache_layout=layout == "on"
        )
        self.kv_cache_manager = build_kv_cache_manager(
            self.plan,
            retain_mamba_checkpoint=scenario.allocator.retain_mamba_checkpoint,
            enable_caching=scenario.allocator.enable_prefix_caching,
        )
        self.scheduler = Scheduler(self._scheduler_config(), self.kv_cache_manager)
        acceptance = AcceptanceModel(conditional_rates=scenario.mtp.acceptance_rates)
        self.model_runner = ModelRunner(acceptance, _runner_rng(scenario.seed))
        self.step_time = StepTimeModel(scenario.step_time_config())
        self.env = simpy.Environment()
        self._wakeup = self.env.event()
        self._arrivals_done = False
        self._engine_done = False
        self._bar: tqdm | None = None
        self.totals: dict[str, int] = dict.fromkeys(SAMPLED_TOTALS, 0)
        self.recording = Recording(scenario=scenario.name, layout=layout, plan=self.plan.to_dict())

    def _scheduler_config(self) -> SchedulerConfig:
        s, d = self.scenario.scheduler, self.scenario.deployment
        return SchedulerConfig(
            max_num_seqs=d.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            max_model_len=d.max_model_len,
            block_size=self.plan.block_size,
            num_speculative_tokens=self.scenario.load_model().mtp.num_speculative_tokens,
            long_prefill_token_threshold=s.long_prefill_token_threshold,
            scheduler_reserve_full_isl=s.scheduler_reserve_full_isl,
            defer_block_free=s.defer_block_free,
            max_concurrent_batches=s.max_concurrent_batches,
        )

    # ------------------------------------------------------------------- run
    def start(self) -> None:
        """Register the processes; ``run`` then advances the clock to the end
        (a caller may instead advance ``env`` itself, a little at a time)."""
        self.env.process(self.arrivals())
        self.env.process(self.engine_loop())
        if self.scenario.simulation.sample_interval_s:
            self.env.process(self.sampler(self.scenario.simulation.sample_interval_s))

    def finish(self) -> Recording:
        self.recording.end_time_s = float(self.env.now)
        self.recording.num_rejected = self.scheduler.num_rejected
        return self.recording

    def run(self) -> Recording:
        self.start()
        horizon = self.scenario.simulation.max_time_s
        total = horizon or max(self.workload.duration_s, 1e-9)
        with tqdm(
            total=round(total, 1),
            unit="sim s",
            delay=3,
            disable=not self.progress,
            desc=f"{self.scenario.name} [{self.layout}]",
            leave=False,
        ) as bar:
            self._bar = bar
            self.env.run(until=horizon)
        self._bar = None
        return self.finish()

    def arrivals(self) -> Generator[simpy.Event, Any, None]:
        for spec in self.workload.requests:
            if spec.arrival_s > self.env.now:
                yield self.env.timeout(spec.arrival_s - self.env.now)
            self._record_arrival(spec, accepted=self.scheduler.add_request(spec))
            self._wake()
        self._arrivals_done = True
        self._wake()

    def _wake(self) -> None:
        if not self._wakeup.triggered:
            self._wakeup.succeed()

    def _sleep(self) -> simpy.Event:
        self._wakeup = self.env.event()
        return self._wakeup

    def engine_loop(self) -> Generator[simpy.Event, Any, None]:
        while True:
            if not self.scheduler.has_unfinished_requests():
                if self._arrivals_done:
                    break
                yield self._sleep()
                continue
            started_s = self.env.now
            output = self.scheduler.schedule()
            if output.is_empty:
                # Nothing fits now: let the steps in flight complete; if that
                # returns no blocks, wait for the next arrival.
                if self.scheduler.complete_in_flight_steps():
                    continue
                if self._arrivals_done:
                    self.recording.stalled = True
                    break
                yield self._sleep()
                continue
            token_counts = self.scheduler.token_counts()  # as scheduled, before the output
            step_s = self.step_time.step_time_s(output)
            yield self.env.timeout(step_s)
            outcome = self.scheduler.update_from_output(
                output, self.model_runner.execute(output, token_counts)
            )
            self._record_step(output, outcome, started_s, step_s)
        self._engine_done = True

    def sampler(self, interval_s: float) -> Generator[simpy.Event, Any, None]:
        while not self._engine_done:
            pool = self.kv_cache_manager.block_pool
            self.recording.samples.append(
                {
                    "time_s": self.env.now,
                    "num_requests_running": self.scheduler.num_running,
                    "num_requests_waiting": self.scheduler.num_waiting,
                    "num_free_blocks": pool.get_num_free_blocks(),
                    "num_deferred_blocks": self.scheduler.num_deferred_blocks(),
                    "kv_cache_usage_perc": pool.get_usage(),
                    **self.totals,
                }
            )
            yield self.env.timeout(interval_s)

    # ------------------------------------------------------------- recording
    def _record_arrival(self, spec: RequestSpec, accepted: bool) -> None:
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
        pool = self.kv_cache_manager.block_pool
        self.recording.steps.append(
            {
                "step": output.step_index,
                "time_s": now,
                "step_time_s": step_s,
                "num_requests_running": self.scheduler.num_running,
                "num_requests_waiting": self.scheduler.num_waiting,
                "num_scheduled_requests": len(output.scheduled),
                "num_scheduled_tokens": output.total_num_scheduled_tokens,
                "num_prefill_tokens": output.num_prefill_tokens,
                "num_decode_tokens": output.num_decode_tokens,
                "num_admitted": len(output.new_request_ids),
                "num_resumed": len(output.resumed_request_ids),
                "num_preemptions": len(output.preempted_request_ids),
                "num_finished": len(outcome.finished),
                "num_generation_tokens": outcome.num_generated_tokens,
                "num_draft_tokens": outcome.num_draft_tokens,
                "num_accepted_tokens": outcome.num_accepted_tokens,
                "num_free_blocks": pool.get_num_free_blocks(),
                "num_deferred_blocks": self.scheduler.num_deferred_blocks(),
                "kv_cache_usage_perc": pool.get_usage(),
                "prefix_cache_queries_tokens": output.prefix_cache_queries,
                "prefix_cache_hits_tokens": output.prefix_cache_hits,
                "prefix_cache_evicted_blocks": output.num_evicted_blocks,
                "num_retained_checkpoints": self.kv_cache_manager.num_retained_checkpoints(),
            }
        )
        if self.scenario.simulation.check_invariants:
            check_allocator(self.kv_cache_manager, self.scheduler.deferred_blocks())
        if self._bar is not None:
            self._bar.update(round(now, 1) - self._bar.n)

    def _add_totals(self, output: SchedulerOutput, outcome: StepOutcome) -> None:
        """vLLM counts a prompt's tokens when its first token comes out."""
        prompt_tokens = sum(
            self.recording.requests[r]["prompt_tokens"] for r in outcome.first_token_request_ids
        )
        for key, value in (
            ("num_preemptions_total", len(output.preempted_request_ids)),
            ("prefix_cache_queries_total_tokens", output.prefix_cache_queries),
            ("prefix_cache_hits_total_tokens", output.prefix_cache_hits),
            ("num_draft_total_tokens", outcome.num_draft_tokens),
            ("num_accepted_total_tokens", outcome.num_accepted_tokens),
            ("num_prompt_total_tokens", prompt_tokens),
            ("num_generation_total_tokens", outcome.num_generated_tokens),
        ):
            self.totals[key] += value


def simulate(scenario: Scenario, layout: Layout, workload: Workload, *, progress: bool = False) -> Recording:
    return Simulation(scenario, layout, workload, progress=progress).run()
