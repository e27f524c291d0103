"""vLLM's ``KVCacheManager`` built from a layout's plan, as the fork's
scheduler builds it (prefix caching on, MTP as EAGLE), with kvsim's ring and
Mamba managers selected through vLLM's spec registry.

The manager classes are the fork's twins (``sim/fork/``): ``frees.py``'s
``KVCacheManager`` (vLLM's plus the fork's free paths and ring claim record)
and, with a pin patch on, ``pins.py``'s ``PinningKVCacheManager``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any

from sim.config import MTP_HASH_MODES, MTPHashMode
from sim.fork.frees import KVCacheManager
from sim.fork.patches import AS_SHIPPED, ForkPatches
from sim.fork.pins import PinningKVCacheManager
from sim.fork.retention import retaining_mamba_spec_type
from sim.fork.side_cache_rings import RingSlotsSpec, group_slots_per_block
from sim.kv_cache_interface import convert_spec
from sim.kv_cache_plan import KVCachePlan
from sim.vllm_bridge import (
    CircularBufferSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    init_none_hash,
    sha256,
)


@dataclass(frozen=True, kw_only=True)
class MTPHashing:
    """How MTP drafts shape prefix-cache hashes, in vLLM's terms.

    ``eagle-drop``: hashes cover their block only and the trailing hit block
    is dropped (the drafter's KV at a block's last position reads the next
    token). ``lookahead``: each hash also covers the next
    ``num_hash_lookahead_tokens`` tokens, which proves them, so nothing is
    dropped. ``num_prefill_lookahead_tokens`` is the drafter's prefill runway
    (a chunk never ends within it of the prefill end; 1 makes that a no-op).
    """

    use_eagle_block_drop: bool = True
    num_hash_lookahead_tokens: int = 0
    num_prefill_lookahead_tokens: int = 1

    @classmethod
    def for_hash_mode(
        cls,
        hash_mode: MTPHashMode,
        *,
        num_speculative_tokens: int,
        multi_module_mtp: bool = False,
        enable_prefix_caching: bool = True,
        kv_connector: bool = False,
    ) -> MTPHashing:
        """vLLM 0.33.0's derivation for method "mtp" (``VllmConfig.
        num_prefill_lookahead_tokens`` / ``num_hash_lookahead_tokens``, then
        ``Scheduler.__init__``, which turns the drop off under lookahead
        hashes); ``eagle-drop`` is ``disable_lookahead_block_hashes=True``.

        >>> MTPHashing.for_hash_mode("lookahead", num_speculative_tokens=3)
        MTPHashing(use_eagle_block_drop=False, num_hash_lookahead_tokens=1, num_prefill_lookahead_tokens=1)
        >>> connector = MTPHashing.for_hash_mode("lookahead", num_speculative_tokens=3, kv_connector=True)
        >>> connector.use_eagle_block_drop
        True
        """
        if hash_mode not in MTP_HASH_MODES:
            raise ValueError(f"mtp_hash_mode must be one of {MTP_HASH_MODES}, got {hash_mode!r}")
        if num_speculative_tokens == 0:
            return cls(
                use_eagle_block_drop=False, num_hash_lookahead_tokens=0, num_prefill_lookahead_tokens=0
            )
        prefill_lookahead = num_speculative_tokens if multi_module_mtp else 1
        hash_lookahead = (
            prefill_lookahead
            if hash_mode == "lookahead" and enable_prefix_caching and not kv_connector
            else 0
        )
        return cls(
            use_eagle_block_drop=hash_lookahead == 0,
            num_hash_lookahead_tokens=hash_lookahead,
            num_prefill_lookahead_tokens=prefill_lookahead,
        )

    @classmethod
    def for_engine(
        cls, hash_mode: MTPHashMode, engine: Any, *, enable_prefix_caching: bool = True
    ) -> MTPHashing:
        """The hashing a plan's engine config gives in ``hash_mode``."""
        speculative = engine.speculative_config
        return cls.for_hash_mode(
            hash_mode,
            num_speculative_tokens=speculative.num_speculative_tokens if speculative else 0,
            multi_module_mtp=bool(speculative and speculative.use_multi_module_mtp()),
            enable_prefix_caching=enable_prefix_caching,
            kv_connector=engine.kv_transfer_config is not None,
        )


def _scheduler_group(group: KVCacheGroupSpec, fork: ForkPatches) -> KVCacheGroupSpec:
    """One group of the scheduler's view with kvsim's scheduler-side spec type."""
    spec = group.kv_cache_spec
    if isinstance(spec, CircularBufferSpec):
        spec = convert_spec(spec, RingSlotsSpec, slots_per_block=group_slots_per_block(group))
    elif isinstance(spec, MambaSpec) and fork.mamba_retain_checkpoint:
        spec = convert_spec(spec, retaining_mamba_spec_type(fork))
    return replace(group, kv_cache_spec=spec)


def scheduler_kv_cache_config(
    plan: KVCachePlan, *, fork: ForkPatches = AS_SHIPPED, num_gpu_blocks: int | None = None
) -> KVCacheConfig:
    """The scheduler's view of ``plan`` (vLLM's ``generate_scheduler_kv_cache_config``)
    with every ring served by kvsim's ring manager and, when the fork's
    retention is on, every Mamba group by kvsim's retaining manager (off:
    vLLM's own).

    ``num_gpu_blocks`` overrides the pool size (tests size pools exactly).
    """
    config = copy.copy(plan.scheduler_config())
    config.kv_cache_groups = [_scheduler_group(group, fork) for group in config.kv_cache_groups]
    if num_gpu_blocks is not None:
        config.num_blocks = num_gpu_blocks
    config.prefix_cache_retention_interval = 0
    return config


def build_kv_cache_manager(
    plan: KVCachePlan,
    *,
    fork: ForkPatches = AS_SHIPPED,
    enable_caching: bool = True,
    num_gpu_blocks: int | None = None,
    log_stats: bool = True,
    mtp_hashing: MTPHashing | None = None,
) -> KVCacheManager:
    """The fork scheduler's ``KVCacheManager`` for ``plan``.

    Hash block = the plan's prefix-match unit (vLLM's ``hash_block_size``;
    the block size unless the deployment sets ``prefix_match_unit``, and
    always the block size without prefix caching, as vLLM resolves it);
    MTP hashing as vLLM's scheduler
    passes it (``use_eagle`` = the block drop, the hash and prefill
    lookaheads); default the EAGLE drop, which the fork runs.
    """
    init_none_hash(sha256)
    fork = patches_with_caching(fork, enable_caching)
    if mtp_hashing is None:
        mtp_hashing = MTPHashing.for_engine("eagle-drop", plan.engine, enable_prefix_caching=enable_caching)
    config = scheduler_kv_cache_config(plan, fork=fork, num_gpu_blocks=num_gpu_blocks)
    max_model_len = int(plan.engine.model_config.max_model_len)
    manager = _manager_class(fork)(
        config,
        max_model_len=max_model_len,
        scheduler_block_size=plan.block_size,
        hash_block_size=plan.hash_block_size if enable_caching else plan.block_size,
        enable_caching=enable_caching,
        use_eagle=mtp_hashing.use_eagle_block_drop,
        num_hash_lookahead_tokens=mtp_hashing.num_hash_lookahead_tokens,
        num_prefill_lookahead=mtp_hashing.num_prefill_lookahead_tokens,
        log_stats=log_stats,
        # vLLM's KV events are how kvsim counts prefix-cache evictions
        # (BlockRemoved when a cached block is reused).
        enable_kv_cache_events=log_stats,
        **_pin_arguments(plan, fork),
    )
    manager.deferred_free_eviction_order = fork.deferred_free_eviction_order
    return manager


def patches_with_caching(fork: ForkPatches, enable_caching: bool) -> ForkPatches:
    """The fork retains checkpoints only with prefix caching on (its
    MambaManager's ``_retain_checkpoint`` reads ``enable_caching``): without
    it, vLLM's own Mamba manager and no admission reserve."""
    return fork if enable_caching else replace(fork, mamba_retain_checkpoint=False)


def _manager_class(fork: ForkPatches) -> type[KVCacheManager]:
    """vLLM's manager (plus kvsim's free paths) unless a pin patch is on:
    then the fork's pinning manager (patches 0095-0097)."""
    if not (fork.waiter_pins or fork.grace_pins):
        return KVCacheManager
    return PinningKVCacheManager


def _pin_arguments(plan: KVCachePlan, fork: ForkPatches) -> dict[str, bool]:
    if not (fork.waiter_pins or fork.grace_pins):
        return {}
    return {
        "waiter_pins": fork.waiter_pins,
        "grace_pins": fork.grace_pins,
        "kv_connector": plan.engine.kv_transfer_config is not None,
    }
