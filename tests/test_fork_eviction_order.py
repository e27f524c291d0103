"""Patch 0023 (port of vLLM #48532): a deferred free (the fence's
``pop_blocks_for_free``, drained reversed as vLLM's scheduler drains it)
evicts a request's blocks in the same order as an immediate ``free``: each
group's tail first, group after group. The fork's test value: two groups
holding blocks 1-3 and 4-6 evict as [3, 2, 1, 6, 5, 4]; upstream 0.33.0's
flat reversal gives [6, 5, 4, 3, 2, 1] (the failing control)."""

from __future__ import annotations

import pytest
import torch
from helpers.fork import BLOCK, decode, free_queue_ids, hybrid_manager, prefill, request, tokens

from sim.fork.frees import BlockObserver, fork_defers_block_free
from sim.fork.patches import AS_SHIPPED, ForkPatches
from sim.kv_cache_manager import KVCacheManager
from sim.vllm_bridge import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, init_none_hash, sha256


def _two_attention_groups(eviction_order: bool) -> KVCacheManager:
    init_none_hash(sha256)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float16)
    groups = [KVCacheGroupSpec(["a"], spec), KVCacheGroupSpec(["b"], spec)]
    manager = KVCacheManager(
        KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups),
        max_model_len=1024,
        scheduler_block_size=BLOCK,
        hash_block_size=BLOCK,
    )
    manager.deferred_free_eviction_order = eviction_order
    return manager


def _freed_order(manager: KVCacheManager, deferred: bool) -> list[int]:
    req = request("R", tokens(1, 3 * BLOCK))
    assert manager.allocate_slots(req, 3 * BLOCK) is not None
    assert manager.get_block_ids("R") == ([1, 2, 3], [4, 5, 6])
    before = len(free_queue_ids(manager))
    if deferred:
        manager.block_pool.free_blocks(reversed(manager.pop_blocks_for_free(req)))
    else:
        manager.free(req)
    return free_queue_ids(manager)[before:]


@pytest.mark.parametrize(
    "eviction_order, deferred_order", [(True, [3, 2, 1, 6, 5, 4]), (False, [6, 5, 4, 3, 2, 1])]
)
def test_a_deferred_free_evicts_group_by_group(eviction_order, deferred_order):
    manager = _two_attention_groups(eviction_order)
    assert _freed_order(manager, deferred=True) == deferred_order
    # An immediate free is the same in both worlds.
    assert _freed_order(_two_attention_groups(eviction_order), deferred=False) == [3, 2, 1, 6, 5, 4]


@pytest.mark.parametrize(
    "retain, eviction_order",
    [(True, True), (False, True), (True, False)],
    ids=["as-shipped", "retain-off", "upstream-order-control"],
)
def test_the_fence_and_free_agree_on_the_fork_hybrid(retain, eviction_order):
    """On the fork's hybrid (attention + two Mamba groups, retained
    checkpoints freed last) the fenced free queues the cached blocks (the
    LRU part of the free queue) exactly as the immediate one does. Uncached
    blocks go to the queue's head in each ``free_blocks`` call's order, so
    one drain call and one call per group place them differently, in the
    fork as here. CONTROL: upstream's order with checkpoints held (two
    groups with cached blocks at the end) differs."""
    orders = []
    for deferred in (False, True):
        fork = ForkPatches(mamba_retain_checkpoint=retain, deferred_free_eviction_order=eviction_order)
        manager = hybrid_manager(64, fork)
        a = request("A", tokens(1, 150))
        prefill(manager, a)
        decode(manager, a, steps=4)
        if deferred:
            manager.block_pool.free_blocks(reversed(manager.pop_blocks_for_free(a)))
        else:
            manager.free(a)
        pool = manager.block_pool
        orders.append([i for i in free_queue_ids(manager) if pool.blocks[i].block_hash is not None])
    assert (orders[0] == orders[1]) is eviction_order


def test_the_observer_sees_each_request_while_its_blocks_are_still_held():
    """The pool replay's observer (``BlockObserver.blocks_freed``) is told
    which request is leaving before ``free`` or the fence's
    ``pop_blocks_for_free`` takes its blocks: it reads the request's block
    table at that moment (ids from vLLM's own ``get_block_ids``)."""
    manager = hybrid_manager(64, ForkPatches())
    seen: list[tuple[str, tuple[list[int], ...]]] = []

    class Recorder(BlockObserver):
        def blocks_freed(self, request) -> None:
            seen.append((request.request_id, manager.get_block_ids(request.request_id)))

    manager.observer = Recorder()
    a, b = request("A", tokens(1, 150)), request("B", tokens(2, 100))
    prefill(manager, a)
    prefill(manager, b)
    held = {r.request_id: manager.get_block_ids(r.request_id) for r in (a, b)}
    manager.free(a)
    manager.block_pool.free_blocks(reversed(manager.pop_blocks_for_free(b)))
    assert seen == [("A", held["A"]), ("B", held["B"])]
    assert all(any(ids) for ids in held["A"])  # CONTROL: each group held blocks when told


@pytest.mark.parametrize(("max_concurrent_batches", "defers"), [(1, False), (2, True), (3, True)])
def test_the_fork_fences_frees_whenever_more_than_one_batch_is_in_flight(max_concurrent_batches, defers):
    """Patch 0018's gate in the fork's ``Scheduler.__init__``: a block freed
    while another batch may still read it waits for that batch's output
    (one batch in flight: no other reader, an immediate free)."""
    assert fork_defers_block_free(max_concurrent_batches) is defers


@pytest.mark.parametrize("deferred", [False, True], ids=["free", "fence"])
def test_checkpoints_go_back_after_the_attention_prefix_even_with_the_mamba_groups_first(deferred):
    """Patch 0086: a finished request's retained checkpoints return to the
    pool after every group's table, so they are evicted after the attention
    prefix they resume. In Flash-Next's order (Mamba groups first) a
    group-by-group free would return each checkpoint with its own group,
    ahead of the attention blocks (the fork's hybrid helper, attention
    first, cannot tell the two apart)."""
    manager = hybrid_manager(64, AS_SHIPPED, attention_last=True)  # Flash-Next's group order
    a = request("A", tokens(1, 150))
    prefill(manager, a)
    decode(manager, a, steps=4)
    checkpoints = [
        b.block_id for m in manager.managers if hasattr(m, "retained_blocks") for b in m.retained_blocks()
    ]
    attention = {
        b for b in manager.get_block_ids("A")[2] if manager.block_pool.blocks[b].block_hash is not None
    }
    assert len(checkpoints) == 2 and len(attention) == 150 // BLOCK  # the prompt's full blocks
    if deferred:
        manager.block_pool.free_blocks(reversed(manager.pop_blocks_for_free(a)))
    else:
        manager.free(a)
    pool = manager.block_pool
    hashed = [i for i in free_queue_ids(manager) if pool.blocks[i].block_hash is not None]
    assert hashed[-2:] == checkpoints and set(hashed[:-2]) >= attention
