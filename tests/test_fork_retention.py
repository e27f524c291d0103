"""The fork's Mamba checkpoint retention (patches 0086 and 0087,
``VLLM_E2_MAMBA_RETAIN_CHECKPOINT``, default on), reproduced through kvsim's
managers with the values the fork's own tests assert
(``tests/v1/core/test_mamba_checkpoint_retention.py``: block 32, K = 3, one
attention and two align-mode Mamba groups, retention interval 0). Every
test runs with the switch on and off; off is upstream vLLM 0.33.0 and is the
failing control.
"""

from __future__ import annotations

import pytest
from helpers.fork import (
    ATTN,
    BLOCK,
    MAMBA_GROUPS,
    admission_need,
    cached_state,
    decode,
    free_queue_ids,
    hybrid_manager,
    prefill,
    request,
    tokens,
)

from sim.fork.patches import ForkPatches
from sim.fork.retention import RetainingMambaManager


@pytest.fixture(params=[True, False], ids=["retain-on", "retain-off-control"])
def retain(request) -> bool:
    return request.param


def _fork(retain: bool) -> ForkPatches:
    return ForkPatches(mamba_retain_checkpoint=retain)


def _next_turn(prev, seed: int = 3, extra: int = 40):
    return request(prev.request_id + "2", list(prev.all_token_ids) + tokens(seed, extra))


def test_a_concurrent_prefill_cannot_evict_a_running_requests_checkpoint(retain):
    """A (150 tokens: replay boundary 96 under the EAGLE drop) decodes; D
    runs and finishes; a cold prefill then takes every uncached free block
    and two cached ones. Upstream freed A's checkpoint mid-request, the
    oldest cached free block, so it goes and A's next turn hits nothing
    though A's attention prefix survives; the fork held it: hit 96."""
    manager = hybrid_manager(64, _fork(retain))
    pool = manager.block_pool
    a = request("A", tokens(1, 150))
    assert prefill(manager, a) == 0
    decode(manager, a, steps=4)
    checkpoints = [cached_state(manager, a, 96, gid) for gid in MAMBA_GROUPS]
    for block in checkpoints:
        assert block is not None
        assert (block.ref_cnt == 1) is retain and (block.block_id in free_queue_ids(manager)) is not retain

    d = request("D", tokens(2, 200))
    prefill(manager, d)
    decode(manager, d, steps=2)
    manager.free(d)
    uncached = sum(b.block_hash is None for b in pool.free_block_queue.get_all_free_blocks())
    taken = pool.get_new_blocks(uncached + 2)
    assert any(b.block_hash is None for b in checkpoints) is not retain
    pool.free_blocks(taken)

    manager.free(a)
    a2 = _next_turn(a)
    assert all(pool.get_cached_block(a.block_hashes[i], [ATTN]) for i in range(3))
    assert manager.get_computed_blocks(a2)[1] == (96 if retain else 0)


def test_full_sequence_admission_reserves_one_checkpoint_per_mamba_group(retain):
    """The fork's values: a fresh 150-token request's admission is its
    per-step need plus 2 (one per Mamba group) with retention, plus 0
    without; a running request that already holds one reserves nothing."""
    manager = hybrid_manager(64, _fork(retain))
    a = request("A", tokens(1, 150))
    prefill(manager, a)
    decode(manager, a, steps=6)
    assert manager.num_retained_checkpoints() == (2 if retain else 0)

    fresh = request("F", tokens(5, 150))
    per_step = manager.coordinator.get_num_blocks_to_allocate(
        request_id="F",
        num_tokens=fresh.num_tokens,
        new_computed_blocks=manager.empty_kv_cache_blocks.blocks,
        num_encoder_tokens=0,
        total_computed_tokens=0,
        num_local_computed_tokens=0,
        num_tokens_main_model=fresh.num_tokens,
    )
    assert admission_need(manager, fresh) == per_step + (2 if retain else 0)
    running_per_step = manager.coordinator.get_num_blocks_to_allocate(
        request_id="A",
        num_tokens=a.num_tokens,
        new_computed_blocks=manager.empty_kv_cache_blocks.blocks,
        num_encoder_tokens=0,
        total_computed_tokens=a.num_computed_tokens,
        num_local_computed_tokens=a.num_computed_tokens,
        num_tokens_main_model=a.num_tokens,
    )
    assert admission_need(manager, a, num_hit=a.num_computed_tokens) == running_per_step


def test_admission_refuses_a_request_its_checkpoints_would_overcommit(retain):
    """A pool of exactly the managers' own need plus the null block: the
    fork refuses (the request would hold 2 more blocks for its lifetime),
    upstream admits."""
    req = request("R", tokens(6, 150))
    base_need = admission_need(hybrid_manager(256, ForkPatches.upstream()), req)
    assert admission_need(hybrid_manager(256, _fork(True)), req) == base_need + 2
    manager = hybrid_manager(base_need + 1, _fork(retain))
    admitted = manager.allocate_slots(req, BLOCK, full_sequence_must_fit=True)
    assert (admitted is None) is retain


def test_a_short_request_reserves_nothing():
    """``num_tokens <= block_size``: no state behind the running one ever
    retires, so nothing is reserved (32 tokens: 0; 33: 2)."""
    manager = hybrid_manager(64, _fork(True))
    upstream = hybrid_manager(64, ForkPatches.upstream())
    for n, extra in ((32, 0), (33, 2)):
        req = request(f"S{n}", tokens(4, n))
        assert admission_need(manager, req) == admission_need(upstream, req) + extra


@pytest.mark.parametrize("deferred", [False, True], ids=["free", "pop_blocks_for_free"])
def test_finish_releases_the_checkpoints_after_the_attention_blocks(retain, deferred):
    """Freed last (immediate or deferred free: the popped list freed in
    reverse, as vLLM's scheduler drains it): the checkpoints are the
    request's newest free-queue entries, evicted after its attention
    prefix. Upstream queued them mid-request, ahead of it. Nothing is
    evicted here, so the next turn hits 96 either way."""
    manager = hybrid_manager(64, _fork(retain))
    pool = manager.block_pool
    a = request("A", tokens(1, 150))
    prefill(manager, a)
    decode(manager, a, steps=4)
    attention_ids = [b.block_id for b in manager.managers[ATTN].req_to_blocks["A"]]
    checkpoint_ids = [cached_state(manager, a, 96, gid).block_id for gid in MAMBA_GROUPS]
    queued_before = free_queue_ids(manager)
    if deferred:
        blocks = manager.pop_blocks_for_free(a)
        if retain:
            assert [b.block_id for b in blocks[:2]] == checkpoint_ids[::-1]
        pool.free_blocks(reversed(blocks))
    else:
        manager.free(a)
    assert manager.num_retained_checkpoints() == 0
    queue = {block_id: i for i, block_id in enumerate(free_queue_ids(manager))}
    newest_attention = max(queue[b] for b in attention_ids if pool.blocks[b].block_hash)
    for block_id in checkpoint_ids:
        assert pool.blocks[block_id].ref_cnt == 0 and pool.blocks[block_id].block_hash is not None
        assert (queue[block_id] > newest_attention) is retain
        assert (block_id in queued_before) is not retain
    assert manager.get_computed_blocks(_next_turn(a))[1] == 96


@pytest.mark.parametrize("drop_release", [False, True], ids=["real", "leak-control"])
def test_a_preempted_request_releases_its_checkpoints(retain, drop_release, monkeypatch):
    """``free`` is also the preemption path. If the checkpoints were not
    handed back the pool would lose one block per Mamba group: leaked 2."""
    if drop_release:
        monkeypatch.setattr(RetainingMambaManager, "pop_retained_checkpoints", lambda *args: [])
    manager = hybrid_manager(64, _fork(retain))
    a = request("A", tokens(1, 150))
    prefill(manager, a)
    decode(manager, a, steps=2)
    manager.free(a)
    leaked = 63 - manager.block_pool.get_num_free_blocks()  # all but the null block
    assert leaked == (2 if retain and drop_release else 0)


@pytest.mark.parametrize("num_prefill_lookahead", [0, 3])
def test_an_aligned_prompt_holds_only_its_newest_boundary(retain, num_prefill_lookahead):
    """A 128-token prompt (4 blocks) has two replay boundaries under the
    EAGLE drop, 64 and 96; prefilled in 40-token budgets and decoded across
    two block ends with 0..3 drafts accepted, it holds at most one
    checkpoint per group, at the end state@96 (keyed by its token position,
    as patch 0093 keys holds), while
    state@64 ages in the free queue. A burst takes every free block while
    it runs; after it finishes a longer sibling hits 96 (fork) or 0."""
    manager = hybrid_manager(96, _fork(retain), num_prefill_lookahead=num_prefill_lookahead)
    pool = manager.block_pool
    a = request("A", tokens(7, 4 * BLOCK))
    prefill(manager, a, budget=40)

    def at_most_one() -> None:
        for gid in MAMBA_GROUPS:
            assert len(getattr(manager.managers[gid], "_retained_checkpoints", {})) <= 1

    decode(manager, a, steps=24, accepted=lambda step: step % 4, trace=at_most_one)
    assert a.num_computed_tokens > 5 * BLOCK
    for gid in MAMBA_GROUPS:
        low, high = cached_state(manager, a, 64, gid), cached_state(manager, a, 96, gid)
        assert low is not None and low.ref_cnt == 0
        if retain:
            assert manager.managers[gid]._retained_checkpoints["A"] == (3 * BLOCK, high)
            assert high.ref_cnt == 1
        else:
            assert high.ref_cnt == 0
    burst = pool.get_new_blocks(pool.get_num_free_blocks())
    manager.free(a)
    sibling = request("S", list(a.all_token_ids)[: 4 * BLOCK] + tokens(8, BLOCK))
    assert manager.get_computed_blocks(sibling)[1] == (3 * BLOCK if retain else 0)
    pool.free_blocks(burst)


# ------------------------------------------------------------------ 0087
def _followup_after_finish(manager):
    a = request("A", tokens(1, 150))
    prefill(manager, a)
    decode(manager, a, steps=4)
    manager.free(a)
    a2 = _next_turn(a)
    computed, num_hit = manager.get_computed_blocks(a2)[:2]
    assert num_hit == 96
    return a2, computed, num_hit


def test_a_followup_with_a_hit_reserves_no_extra_checkpoint(retain):
    """0087: the hit state is the block the follow-up will hold, already
    counted; the gate adds nothing (fork need == upstream need)."""
    fork_manager = hybrid_manager(64, _fork(retain))
    upstream = hybrid_manager(64, ForkPatches.upstream())
    needs = [admission_need(m, *_followup_after_finish(m)) for m in (fork_manager, upstream)]
    assert needs[0] == needs[1]


def test_a_followup_that_exactly_fits_is_admitted(retain):
    """Leave exactly the follow-up's need free (only uncached blocks taken,
    its cache intact): admitted with its hit."""
    manager = hybrid_manager(64, _fork(retain))
    pool = manager.block_pool
    a2, computed, num_hit = _followup_after_finish(manager)
    need = admission_need(manager, a2, computed, num_hit)
    uncached = sum(b.block_hash is None for b in pool.free_block_queue.get_all_free_blocks())
    surplus = pool.get_num_free_blocks() - need
    assert 0 < surplus <= uncached
    held = pool.get_new_blocks(surplus)
    blocks = manager.allocate_slots(
        a2,
        a2.num_tokens - num_hit,
        num_new_computed_tokens=num_hit,
        new_computed_blocks=computed,
        num_lookahead_tokens=3,
        full_sequence_must_fit=True,
    )
    assert blocks is not None
    pool.free_blocks(held)


def test_without_0087_a_followup_would_be_charged_twice(monkeypatch):
    """CONTROL for 0087: the reserve term ignoring the hit (0086 alone)
    charges the follow-up 2 blocks more than upstream."""

    def reserve_0086(self, request_id, num_tokens, new_computed_blocks=(), num_local_computed_tokens=0):
        held = request_id in self._retained_checkpoints
        return 0 if held or num_tokens <= self.block_size else 1

    monkeypatch.setattr(RetainingMambaManager, "retained_checkpoint_blocks_to_reserve", reserve_0086)
    fork_manager = hybrid_manager(64, _fork(True))
    upstream = hybrid_manager(64, ForkPatches.upstream())
    needs = [admission_need(m, *_followup_after_finish(m)) for m in (fork_manager, upstream)]
    assert needs[0] == needs[1] + 2
