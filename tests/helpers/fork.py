"""Drive a small hybrid ``KVCacheManager`` the way the fork's patch tests do
(``tests/v1/core/test_mamba_checkpoint_retention.py`` of
``halt95/qwen38-flash-next-3090s``): block 32, MTP K=3 with the EAGLE drop,
one attention group and two align-mode Mamba groups, prefix caching with
retention interval 0, prefill chunks cut by vLLM's own Mamba-aligned split,
decode steps of the last token plus K drafts with K lookahead slots.

The manager is kvsim's (``sim.kv_cache_manager.KVCacheManager`` with kvsim's
Mamba manager, built through vLLM's spec registry), configured by
``ForkPatches``; the pool sizes and token counts are the fork tests'.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace

import torch

from helpers import allocator
from helpers.allocator import ALIGNED_SPLIT, BLOCK, K, Split, decode, request, tokens  # noqa: F401 (tests take them)
from sim.fork.patches import ForkPatches
from sim.fork.retention import retaining_mamba_spec_type
from sim.kv_cache_manager import KVCacheManager
from sim.vllm_bridge import (
    FullAttentionSpec,
    KVCacheBlock,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    Request,
    SamplingParams,
    Scheduler,
    get_request_block_hasher,
    init_none_hash,
    sha256,
)

# BLOCK and K (32, 3) are the fork tests' values, the allocator helpers' too.
ATTN = 0
MAMBA_GROUPS = (1, 2)


def mamba_spec(fork: ForkPatches, block_size: int = BLOCK) -> MambaSpec:
    values = dict(
        block_size=block_size,
        shapes=((1, 1),),
        dtypes=(torch.float32,),
        mamba_cache_mode="align",
        num_speculative_blocks=K,
    )
    if not fork.mamba_retain_checkpoint:
        return MambaSpec(**values)
    return retaining_mamba_spec_type(fork)(**values)


def hybrid_manager(
    num_blocks: int,
    fork: ForkPatches,
    *,
    num_mamba_groups: int = 2,
    hash_block_size: int = BLOCK,
    num_prefill_lookahead: int = 0,
    attention_last: bool = False,
) -> KVCacheManager:
    """The fork's tests' hybrid: one attention group, then the Mamba groups
    (``ATTN``, ``MAMBA_GROUPS``); ``attention_last``: Flash-Next's order
    instead (its plan: the GDN groups, the ring, attention)."""
    init_none_hash(sha256)
    attention = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float16)
    groups = [KVCacheGroupSpec([f"gdn_{i}"], mamba_spec(fork)) for i in range(num_mamba_groups)]
    attention_group = KVCacheGroupSpec(["attn"], attention)
    groups = [*groups, attention_group] if attention_last else [attention_group, *groups]
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    manager = KVCacheManager(
        replace(config, prefix_cache_retention_interval=0),
        max_model_len=8192,
        scheduler_block_size=BLOCK,
        hash_block_size=hash_block_size,
        enable_caching=True,
        use_eagle=True,
        num_prefill_lookahead=num_prefill_lookahead,
    )
    manager.deferred_free_eviction_order = fork.deferred_free_eviction_order
    return manager


def prefill(
    manager: KVCacheManager,
    req: Request,
    budget: int = 8192,
    split: Split = ALIGNED_SPLIT,
    chunks: list[int] | None = None,
    trace: allocator.Trace = None,
    check: bool = True,
) -> int:
    """The prompt as the fork's patch tests prefill it: the whole prompt
    per chunk unless ``budget`` is smaller, no whole-sequence admission gate,
    every chunk must fit; returns the prefix hit it was admitted with. The
    loop is ``helpers.allocator.prefill``'s."""
    num_hit = allocator.prefill(
        manager, req, budget, split=split, chunks=chunks, admission_gate=False, trace=trace, check=check
    )
    assert num_hit is not None, "a prefill chunk did not fit"
    return num_hit


def free_queue_ids(manager: KVCacheManager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


def cached_state(
    manager: KVCacheManager, req: Request, num_tokens: int, group_id: int
) -> KVCacheBlock | None:
    """The group's block keyed at ``num_tokens`` of ``req`` (hash unit = block)."""
    cached = manager.block_pool.get_cached_block(req.block_hashes[num_tokens // BLOCK - 1], [group_id])
    return None if cached is None else cached[0]


def admission_need(manager: KVCacheManager, req: Request, computed=None, num_hit: int = 0) -> int:
    """The full-sequence gate's block count (vLLM's ``allocate_slots`` with
    ``full_sequence_must_fit``)."""
    blocks = manager.empty_kv_cache_blocks.blocks if computed is None else computed.blocks
    return manager.coordinator.get_num_blocks_to_allocate(
        request_id=req.request_id,
        num_tokens=req.num_tokens,
        new_computed_blocks=blocks,
        num_encoder_tokens=0,
        total_computed_tokens=num_hit,
        num_local_computed_tokens=num_hit,
        num_tokens_main_model=req.num_tokens,
        apply_admission_cap=True,
    )


def partial_hit_split(
    unit: int, *, block: int = BLOCK, max_num_scheduled_tokens: int = 8192, use_eagle_block_drop: bool = True
) -> Callable[[Request, int, int], int]:
    """vLLM 0.33.0's ``Scheduler._mamba_block_aligned_split`` (Mamba block
    ``block``) with partial hits on, as its Scheduler sets
    ``mamba_partial_cache_hit`` when the hash ``unit`` is below the block: a
    chunk also stops at the prompt's tail key."""
    stub = SimpleNamespace(
        block_size=block,
        hash_block_size=unit,
        cache_config=SimpleNamespace(block_size=block),
        use_eagle_block_drop=use_eagle_block_drop,
        num_hash_lookahead_tokens=0,
        num_prefill_lookahead=0,
        max_num_scheduled_tokens=max_num_scheduled_tokens,
        scheduler_config=SimpleNamespace(long_prefill_token_threshold=0),
        mamba_partial_cache_hit=unit < block,
        mamba_shared_prefix_checkpoint=False,
        mamba_has_prefill_checkpoint_blocks=False,
        mamba_prefill_checkpoint_alignment=None,
    )
    return lambda req, num_new, num_hit: Scheduler._mamba_block_aligned_split(stub, req, num_new, num_hit)


def drain_copies(manager: KVCacheManager) -> None:
    """What vLLM's scheduler does once a step's copy-on-write copies ran:
    release both endpoints' copy refs."""
    _, retained = manager.take_kv_cache_block_copies()
    manager.block_pool.free_blocks(retained)


def unit_attention_manager(
    num_blocks: int, fork: ForkPatches, *, unit: int, use_eagle: bool = True
) -> KVCacheManager:
    """The fork's partial-tail test manager (``_tail_manager`` in
    ``test_partial_prefix_cache_hits.py``): full attention at the hash unit,
    one align-mode Mamba group at ``BLOCK``, K = 3, retention interval 0."""
    init_none_hash(sha256)
    attention = FullAttentionSpec(block_size=unit, num_kv_heads=1, head_size=1, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["full"], attention), KVCacheGroupSpec(["mamba"], mamba_spec(fork))]
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    manager = KVCacheManager(
        replace(config, prefix_cache_retention_interval=0),
        max_model_len=8192,
        scheduler_block_size=BLOCK,
        hash_block_size=unit,
        enable_caching=True,
        use_eagle=use_eagle,
    )
    assert manager.coordinator.enable_partial_hash_hits
    manager.deferred_free_eviction_order = fork.deferred_free_eviction_order
    return manager


def unit_request(request_id: str, token_ids: list[int], unit: int) -> Request:
    """A request hashed every ``unit`` tokens (vLLM's ``hash_block_size``)."""
    params = SamplingParams(max_tokens=4096)
    params.update_from_generation_config({}, eos_token_id=100_000)
    return Request(request_id, token_ids, params, None, block_hasher=get_request_block_hasher(unit, sha256))
