"""Patch 0050 (and the cascade test of 0018's ``test_deferred_block_free.py``):
a victim whose step is still in flight is not preempted. vLLM 0.33.0 has the
same rule (upstream #49675's ``_request_blocks_can_be_freed`` pre-check), so
this is upstream behaviour; the fork's cascade values pin kvsim's twin.

Two 48-token requests fill a 6-usable-block pool (block 16, 7 blocks with the
null block); the first one's decode of token 49 needs a 4th block while step 1
is in flight: nobody is preempted, both stay running, nothing is scheduled or
deferred. Once step 1's output is processed the retry preempts the second
with an immediate free and schedules the first.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.fork import tokens

from sim.kv_cache_manager import KVCacheManager, MTPHashing
from sim.sched.engine_core import EngineCore
from sim.sched.model_runner import AcceptanceModel, ModelRunner
from sim.sched.scheduler import Scheduler, SchedulerConfig
from sim.vllm_bridge import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    RequestStatus,
    init_none_hash,
    sha256,
)
from sim.workloads import WorkloadRequest


def _scheduler(defer: bool) -> Scheduler:
    init_none_hash(sha256)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float16)
    config = KVCacheConfig(num_blocks=7, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["a"], spec)])
    manager = KVCacheManager(config, max_model_len=1024, scheduler_block_size=16, hash_block_size=16)
    scheduler_config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=512,
        max_model_len=1024,
        block_size=16,
        num_speculative_tokens=0,
        defer_block_free=defer,
        max_concurrent_batches=2,
        # No drafts (no EAGLE drop), as the fork's test.
        mtp_hashing=MTPHashing.for_hash_mode("eagle-drop", num_speculative_tokens=0),
    )
    return Scheduler(scheduler_config, manager)


def _spec(index: int) -> WorkloadRequest:
    ids = tuple(tokens(index + 1, 3))
    return WorkloadRequest(
        request_id=f"r{index}", arrival_s=0.0, prompt_len=48, output_len=10, prefix_ids=ids, prefix_unit=16
    )


@pytest.mark.parametrize("defer", [True, False], ids=["fenced", "fence-off-control"])
def test_a_fenced_victim_is_not_preempted(defer):
    scheduler = _scheduler(defer)
    core = EngineCore(scheduler, ModelRunner(AcceptanceModel(conditional_rates=()), np.random.default_rng(0)))
    for i in range(2):
        scheduler.add_request(_spec(i))
    # kvsim's Mamba-aligned split runs each prompt as 32 + 16 tokens (the
    # last token is recomputed): the second step fills the pool.
    for _ in range(2):
        step = core.schedule()
        assert [i.request_id for i in step.output.scheduled] == ["r0", "r1"]
        # Its output arrives with the next step in flight (two batches): the
        # step it completes stays behind the fence, as the fork's "out0".
        core.complete(step)
    assert scheduler.kv_cache_manager.num_free_blocks == 0
    first, second = scheduler.running
    step1 = core.schedule()
    if defer:
        assert step1.output.preempted_request_ids == ()
        assert scheduler.running == [first, second]
        assert first.status == second.status == RequestStatus.RUNNING
        assert first.num_preemptions == second.num_preemptions == 0
        assert not scheduler.deferred_frees and scheduler.kv_cache_manager.num_free_blocks == 0
        assert step1.output.scheduled == ()
        scheduler.complete_in_flight_steps()  # step 0 processed: the fence passes
        assert not scheduler.deferred_frees and scheduler.kv_cache_manager.num_free_blocks == 0
        step1 = core.schedule()
    # Past the fence (or unfenced): the second is preempted, freed at once.
    assert step1.output.preempted_request_ids == (second.request_id,)
    assert second.status == RequestStatus.PREEMPTED and second.num_preemptions == 1
    assert not scheduler.deferred_frees
    assert [item.request_id for item in step1.output.scheduled] == [first.request_id]
    assert first.status == RequestStatus.RUNNING and first.num_preemptions == 0
