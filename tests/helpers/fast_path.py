"""What the fast path's tests share (``tests/test_fast_path.py``,
``tests/test_steady.py``): the checked cases, one-request simulations, the
fast path's audit switched on, and a run's frames with the fast path on or
off."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from helpers import scenarios
from sim.analysis.runs import scenario_workload
from sim.engine import Simulation
from sim.paths import SCENARIOS_DIR
from sim.scenario import load_scenario
from sim.sched.engine_core import BatchQueueEngineCore, EngineCore
from sim.sched.fast_path.memos import FastPath


def one_request(tmp_path: Path, prompt: int, output: int, *overrides: str) -> Simulation:
    """One request, drafts never accepted (one token a step; each decode
    step schedules 1 + K = 4 tokens with K = 3 lookahead slots)."""
    workload = {
        "trace": "synthetic",
        "num_requests": 1,
        "arrival": {"process": "constant", "rate_per_s": 1.0},
        "prompt": {"distribution": "fixed", "tokens": prompt},
        "output": {"distribution": "fixed", "tokens": output},
    }
    scenario = scenarios.scenario(
        tmp_path,
        overrides=[
            "mtp.acceptance_rates=[0, 0, 0]",
            "simulation.sample_interval_s=null",
            CACHES_AFTER_SAMPLING,
            *overrides,
        ],
        workload=workload,
    )
    return Simulation(scenario, "off", scenario_workload(scenario))


def audited(simulation: Simulation, *, lane: bool) -> Counter[str]:
    """Step ``simulation`` with the fast path's audit on: every call it
    skips is made anyway and asserted to change nothing. ``lane``: with the
    steady lane (off: the lane would take most settled decodes past the
    scheduler's own calls, which this then checks)."""
    fast_path = simulation.scheduler.fast_path
    assert isinstance(fast_path, FastPath)
    fast_path.door.audit = True
    fast_path.use_lane = lane
    # Rebuilt so the core makes its lane (or none) with the switch as set.
    core = simulation.core
    if isinstance(core, EngineCore):
        simulation.core = EngineCore(simulation.scheduler, simulation.model_runner)
    else:
        simulation.core = BatchQueueEngineCore(core.scheduler, core.model_runner, core.max_concurrent_batches)
    return fast_path.door.audited


# The fast path's caching rule (rule 1 for ``cache_blocks``) acts where the
# scheduler caches after each sampled step: vLLM 0.33.0's synchronous
# scheduler and both versions' async ones. The fork's synchronous Scheduler
# (0.30.0) caches at allocation only (``fork.caches_at_allocation_only``, on
# in fork mode), which leaves the rule nothing to skip; these checks pin the
# rule where it runs. Fork mode's sync lane is checked by the golden frames
# (tests/test_fork_golden.py, fast path on) and test_steady.
CACHES_AFTER_SAMPLING = "fork.caches_at_allocation_only=false"


def checked_simulation(name: str, overrides: list[str], layout: str, tmp_path: Path) -> Simulation:
    overrides = [CACHES_AFTER_SAMPLING, *overrides]
    if name == "decode-across-boundaries":
        scenario = scenarios.scenario(tmp_path, name, overrides, workload=DECODE_ACROSS_BOUNDARIES)
    else:
        scenario = load_scenario(name, overrides)
    return Simulation(scenario, layout, scenario_workload(scenario))  # type: ignore[arg-type]


# 3,000-token prompts with 500-token outputs: every decode crosses the
# 3,200-token block boundary (a new attention block, a new Mamba state,
# the old state freed two steps later); 12 such requests fill the pool.
DECODE_ACROSS_BOUNDARIES = {
    "trace": "synthetic",
    "num_requests": 12,
    "arrival": {"process": "poisson", "rate_per_s": 20.0},
    "prompt": {"distribution": "fixed", "tokens": 3000},
    "output": {"distribution": "fixed", "tokens": 500},
}


RIG_BLOCK_FLAGS = [
    "deployment.block_size=4096",
    "deployment.prefix_match_unit=64",
    "deployment.use_replayssm=true",
]

CHECKED_CASES = [
    ("decode-across-boundaries", ["deployment.max_num_seqs=16"]),
    # Pool-bound decode: the case the fast path is for.
    ("saturated-decode", ["workload.max_requests=40", "deployment.max_num_seqs=16"]),
    # Preemptions and resumes, prefix hits, long chunked prompts; both hashings.
    (str(SCENARIOS_DIR / "conformance" / "heavy-preemption.yaml"), []),
    (str(SCENARIOS_DIR / "conformance" / "prefix-hits.yaml"), ["scheduler.mtp_hash_mode=lookahead"]),
    (str(SCENARIOS_DIR / "conformance" / "long-chunked.yaml"), []),
    # The rig: 4,096-token blocks, the 64-token hash unit
    # (partial prefix hits), RecoverSSM; the unit bounds windows only inside
    # the prompt (rule 1).
    (
        str(SCENARIOS_DIR / "conformance" / "prefix-hits.yaml"),
        [*RIG_BLOCK_FLAGS, "scheduler.max_num_batched_tokens=1024", "scheduler.mtp_hash_mode=lookahead"],
    ),
]


def frames_with_fast_path(scenario, layout: str, fast_path: bool) -> dict[str, Any]:
    scenario = scenario.model_copy(
        update={"simulation": scenario.simulation.model_copy(update={"fast_path": fast_path})}
    )
    recording = Simulation(scenario, layout, scenario_workload(scenario)).run()  # type: ignore[arg-type]
    return {
        "steps": recording.steps.to_dict(),
        "samples": recording.samples.to_dict(),
        "requests": recording.requests,
        "end_time_s": recording.end_time_s,
        "stalled": recording.stalled,
    }
