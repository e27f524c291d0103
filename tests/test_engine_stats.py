"""The engine's step gauges follow vLLM's semantics, and the MTP hashing
mode reaches vLLM's classes through the scenario.

vLLM's engine core adds arrivals between steps and makes a step's
``SchedulerStats`` at the end of ``update_from_output``, so a step's
``num_requests_waiting`` is the queue before the requests that arrived while
the step ran. The expected count is read off the requests frame (arrival and
admission times), not from the engine.
"""

from __future__ import annotations

import numpy as np
from helpers.scenarios import run, scenario

from sim.analysis.runs import scenario_workload
from sim.engine import Simulation
from sim.workloads.spec import WorkloadRequest

# A queue that builds (4 sequences, arrivals faster than service) and no
# preemption, so a request waits from arrival to admission exactly once.
QUEUEING = {
    "trace": "synthetic",
    "num_requests": 30,
    "arrival": {"process": "poisson", "rate_per_s": 6.0},
    "prompt": {"distribution": "uniform", "lo": 500, "hi": 3000},
    "output": {"distribution": "uniform", "lo": 20, "hi": 60},
}


def test_waiting_gauge_counts_the_queue_at_schedule_time_not_arrivals_during_the_step(tmp_path):
    result = run(tmp_path, layouts=("on",), workload=QUEUEING, deployment={"max_num_seqs": 4})
    steps, requests = result.steps, result.requests[~result.requests["rejected"]]
    assert steps["num_preemptions"].sum() == 0
    arrival = requests["arrival_s"].to_numpy()
    admitted = requests["admitted_s"].to_numpy()
    arrived_during_a_step = 0
    for end_s, step_s, waiting in steps[["time_s", "step_time_s", "num_requests_waiting"]].itertuples(
        index=False
    ):
        start_s = end_s - step_s
        # start_s is rebuilt by a subtraction: a request admitted at this
        # step's start may read a rounding error later than it.
        not_admitted = np.isnan(admitted) | (admitted > start_s + 1e-9)
        expected = int(((arrival <= start_s) & not_admitted).sum())
        assert waiting == expected, (start_s, end_s)
        arrived_during_a_step += int(((arrival > start_s) & (arrival <= end_s)).sum())
    # CONTROL: arrivals do land inside steps, where counting them (the old
    # gauge) would differ from vLLM's.
    assert arrived_during_a_step > 0


def test_mtp_hash_mode_reaches_vllms_classes(tmp_path):
    """vLLM's VllmConfig derives, for MTP K=3 with prefix caching, hash
    lookahead 1 and no block drop (lookahead), or 0 and the drop (the
    EAGLE drop, kvsim's default)."""
    expected = {"eagle-drop": (True, 0), "lookahead": (False, 1)}
    for mode, (drop, lookahead) in expected.items():
        scene = scenario(tmp_path, overrides=[f"scheduler.mtp_hash_mode={mode}"], workload=QUEUEING)
        simulation = Simulation(scene, "on", scenario_workload(scene))
        assert simulation.kv_cache_manager.block_pool.num_hash_lookahead_tokens == lookahead
        assert simulation.scheduler.split._scheduler.use_eagle_block_drop == drop
        # The request hasher: a hash covers its block and, with lookahead,
        # the next token too, so a prompt of exactly two blocks has two
        # hashes, or one (its last block has no next token yet).
        block = simulation.plan.block_size
        spec = WorkloadRequest(
            request_id="two-blocks",
            arrival_s=0.0,
            prompt_len=2 * block,
            output_len=1,
            prefix_ids=(1,),
            prefix_unit=2 * block,
        )
        assert len(simulation.scheduler._materialize(spec).block_hashes) == 2 - lookahead
    default = Simulation(scenario(tmp_path, workload=QUEUEING), "on", scenario_workload(scene))
    assert default.scheduler.config.mtp_hashing.use_eagle_block_drop
