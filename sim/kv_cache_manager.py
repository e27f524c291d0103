"""vLLM's ``KVCacheManager`` built from a layout's plan, as the fork's
scheduler builds it (prefix caching on, MTP as EAGLE), with kvsim's ring and
Mamba managers selected through vLLM's spec registry.

Twin of ``vllm/v1/core/kv_cache_manager.py``: the only addition is the ring
claim record (``take_new_ring_block_ids``), which the fork's scheduler hands
to the workers once per step so they clear the new rings' tag words.
"""

from __future__ import annotations

import copy
from dataclasses import replace

from sim.kv_cache_interface import (
    RetainedCheckpointMambaSpec,
    RingSlotsSpec,
    convert_spec,
    group_slots_per_block,
)
from sim.kv_cache_plan import KVCachePlan
from sim.single_type_kv_cache_manager import (
    RetainingMambaManager,
    RingCircularBufferManager,
    RingSlotPool,
)
from sim.vllm_bridge import (
    CircularBufferSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SingleTypeKVCacheManager,
    init_none_hash,
    sha256,
)
from sim.vllm_bridge import KVCacheManager as _VllmKVCacheManager


class KVCacheManager(_VllmKVCacheManager):
    """vLLM's manager plus the fork's ring claim record."""

    @property
    def managers(self) -> tuple[SingleTypeKVCacheManager, ...]:
        return self.coordinator.single_type_managers

    @property
    def ring_managers(self) -> list[RingCircularBufferManager]:
        return [m for m in self.managers if isinstance(m, RingCircularBufferManager)]

    @property
    def ring_slot_pools(self) -> list[RingSlotPool]:
        return [m.slot_pool for m in self.ring_managers if m.slot_pool is not None]

    def take_new_ring_block_ids(self) -> list[int]:
        """Ring ids claimed since the last call, in claim order (the worker
        clears their tag words before the step that first writes them)."""
        return [i for m in self.ring_managers for i in m.take_new_ring_block_ids()]

    @property
    def num_free_blocks(self) -> int:
        """Free pool blocks (evictable cached ones included), as the
        admission check counts them."""
        return self.block_pool.get_num_free_blocks()

    def num_retained_checkpoints(self) -> int:
        return sum(len(m.retained_blocks()) for m in self.managers if isinstance(m, RetainingMambaManager))


def _scheduler_group(group: KVCacheGroupSpec, retain_mamba_checkpoint: bool) -> KVCacheGroupSpec:
    """One group of the scheduler's view with kvsim's scheduler-side spec type."""
    spec = group.kv_cache_spec
    if isinstance(spec, CircularBufferSpec):
        spec = convert_spec(spec, RingSlotsSpec, slots_per_block=group_slots_per_block(group))
    elif isinstance(spec, MambaSpec) and retain_mamba_checkpoint:
        spec = convert_spec(spec, RetainedCheckpointMambaSpec)
    return replace(group, kv_cache_spec=spec)


def scheduler_kv_cache_config(
    plan: KVCachePlan, *, retain_mamba_checkpoint: bool = True, num_gpu_blocks: int | None = None
) -> KVCacheConfig:
    """The scheduler's view of ``plan`` (vLLM's ``generate_scheduler_kv_cache_config``)
    with every ring served by kvsim's ring manager and, when the fork's retain
    switch is on, every Mamba group by kvsim's retaining manager.

    ``num_gpu_blocks`` overrides the pool size (tests size pools exactly).
    """
    config = copy.copy(plan.scheduler_config())
    config.kv_cache_groups = [
        _scheduler_group(group, retain_mamba_checkpoint) for group in config.kv_cache_groups
    ]
    if num_gpu_blocks is not None:
        config.num_blocks = num_gpu_blocks
    config.prefix_cache_retention_interval = 0
    return config


def build_kv_cache_manager(
    plan: KVCachePlan,
    *,
    retain_mamba_checkpoint: bool = True,
    enable_caching: bool = True,
    num_gpu_blocks: int | None = None,
    log_stats: bool = True,
) -> KVCacheManager:
    """The fork scheduler's ``KVCacheManager`` for ``plan``.

    Hash block = block (the deployment's prefix-cache granularity, so no
    partial hits and no copy-on-write), MTP drafts as EAGLE (``use_eagle``),
    one-module MTP (no prefill lookahead).
    """
    init_none_hash(sha256)
    config = scheduler_kv_cache_config(
        plan, retain_mamba_checkpoint=retain_mamba_checkpoint, num_gpu_blocks=num_gpu_blocks
    )
    max_model_len = int(plan.engine.model_config.max_model_len)
    return KVCacheManager(
        config,
        max_model_len=max_model_len,
        scheduler_block_size=plan.block_size,
        hash_block_size=plan.block_size,
        enable_caching=enable_caching,
        use_eagle=plan.engine.speculative_config is not None,
        log_stats=log_stats,
        # vLLM's KV events are how kvsim counts prefix-cache evictions
        # (BlockRemoved when a cached block is reused).
        enable_kv_cache_events=log_stats,
    )
