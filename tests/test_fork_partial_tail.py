"""The fork's partial-tail hold (patch 0093, under
``VLLM_E2_MAMBA_RETAIN_CHECKPOINT``; kvsim key ``mamba_hold_partial_tail``),
reproduced through kvsim's managers with the values the fork's own tests
assert (``test_partial_prefix_cache_hits.py``, the tail section: full
attention at the hash unit 8, one align-mode Mamba group at block 32, K = 3,
96 blocks, retention interval 0).

Each test runs the fork as shipped and two failing controls: the hold off
with retention on (the fork before 0093, v2.5.0) and retention off (vLLM
0.33.0's own Mamba manager).

Hand derivation of the turns (tail key = prompt // 8 * 8 - 8 under the
EAGLE drop): A0 has 150 prompt tokens, tail 136 (inside block 4); after 5
outputs A1 is 155 + 26 = 181 tokens, tail 168, resuming at 136; after 5
more A2 is 186 + 22 = 208 tokens (the first length past 206 whose tail,
200, lies inside a block above the last cacheable block end).
"""

from __future__ import annotations

import pytest
from helpers.fork import (
    BLOCK,
    K,
    decode,
    drain_copies,
    hybrid_manager,
    partial_hit_split,
    prefill,
    tokens,
    unit_attention_manager,
    unit_request,
)

from sim.allocator_invariants import check_allocator
from sim.fork.patches import ForkPatches

UNIT = 8
ATTN, MAMBA = 0, 1
NUM_BLOCKS = 96
VARIANTS = {
    "as-shipped": ForkPatches(),
    "hold-off-control": ForkPatches(mamba_hold_partial_tail=False),
    "retain-off-control": ForkPatches(mamba_retain_checkpoint=False),
}


@pytest.fixture(params=list(VARIANTS), ids=list(VARIANTS))
def fork(request) -> ForkPatches:
    return VARIANTS[request.param]


def _holds(fork: ForkPatches) -> bool:
    return fork.mamba_retain_checkpoint and fork.mamba_hold_partial_tail


def _settle(manager) -> None:
    """After a step or a free: release the copy refs as vLLM's scheduler
    does, then check every allocator invariant (each held checkpoint is
    one ref of its block; an unhashed block has one owner)."""
    drain_copies(manager)
    check_allocator(manager)


def _tail_position(num_prompt_tokens: int) -> int:
    return num_prompt_tokens // UNIT * UNIT - UNIT


def _follow_up(prev, user_tokens: int, seed: int):
    """The next turn: everything ``prev`` saw plus new text, lengthened
    until its tail key lies strictly inside a block above the last
    cacheable block end (the deployed partial-tail case)."""
    while True:
        prompt = len(prev.all_token_ids) + user_tokens
        tail = _tail_position(prompt)
        if tail % BLOCK and prompt - prompt % BLOCK - BLOCK < tail:
            break
        user_tokens += 1
    return unit_request(prev.request_id + "+", list(prev.all_token_ids) + tokens(seed, user_tokens), UNIT)


def _run(manager, req, steps: int) -> int:
    """Prefill in the scheduler's chunks, then ``steps`` MTP decode steps,
    releasing copy refs after each step as vLLM's scheduler does."""
    num_hit = prefill(
        manager, req, split=partial_hit_split(UNIT), trace=lambda: _settle(manager), check=False
    )
    decode(manager, req, steps=steps, trace=lambda: _settle(manager), check=False)
    return num_hit


def _finish(manager, req) -> None:
    manager.free(req)
    _settle(manager)


def _cached_mamba(manager, req, position: int):
    cached = manager.block_pool.get_cached_block(req.block_hashes[position // UNIT - 1], [MAMBA])
    return None if cached is None else cached[0]


def _free_ids(manager) -> set[int]:
    return {b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()}


def _assert_pool_clean(manager) -> None:
    pool, mamba = manager.block_pool, manager.managers[MAMBA]
    assert pool.get_num_free_blocks() == NUM_BLOCKS - 1  # all but the null block
    assert all(block.ref_cnt == 0 for block in pool.blocks[1:])
    assert not getattr(mamba, "_retained_checkpoints", {})
    assert not mamba._partial_hit_reqs and not mamba.req_to_blocks


def _first_two_turns(manager, a0_steps: int = 4):
    a0 = unit_request("A0", tokens(1, 150), UNIT)
    assert _run(manager, a0, steps=a0_steps) == 0
    _finish(manager, a0)
    return a0, _follow_up(a0, 26, seed=2)


def test_the_turn_after_a_partial_tail_resume_hits_its_tail(fork):
    """A1 resumes at A0's tail (136, not a multiple of 32); a burst takes
    every free block while A1 decodes; A2 then resumes at A1's tail (168)
    with the hold, and at 0 without, though A1's whole attention prefix is
    still cached either way."""
    manager = unit_attention_manager(NUM_BLOCKS, fork, unit=UNIT)
    pool = manager.block_pool
    _, a1 = _first_two_turns(manager)
    assert a1.num_prompt_tokens == 181
    assert _run(manager, a1, steps=4) == 136
    pool.free_blocks(pool.get_new_blocks(pool.get_num_free_blocks()))  # the burst
    _finish(manager, a1)

    a2 = _follow_up(a1, 20, seed=3)
    assert a2.num_prompt_tokens == 208
    assert all(pool.get_cached_block(a1.block_hashes[i], [ATTN]) for i in range(181 // UNIT))
    assert manager.get_computed_blocks(a2)[1] == (168 if _holds(fork) else 0)


def test_a_partial_tail_resume_holds_its_moved_tail_until_freed(fork):
    """The structure behind the hit: A1 keys no block-end state of its own
    above its resume point; its tail state is moved out of its table into
    a copy-on-write block, which the hold keeps at ref 1 (keyed at 168)
    while A1 decodes. Without the hold it is cached-free, and the burst
    evicts it. The next turn then runs to completion and nothing leaks."""
    manager = unit_attention_manager(NUM_BLOCKS, fork, unit=UNIT)
    pool, mamba = manager.block_pool, manager.managers[MAMBA]
    _, a1 = _first_two_turns(manager)
    num_hit = prefill(manager, a1, split=partial_hit_split(UNIT), trace=lambda: _settle(manager), check=False)
    tail = _cached_mamba(manager, a1, 168)
    assert num_hit == 136 and tail is not None
    assert tail not in mamba.req_to_blocks["A0+"] and tail.block_hash_num_tokens == 168
    assert all(_cached_mamba(manager, a1, p) is None for p in range(160, 168, BLOCK))
    decode(manager, a1, steps=4, trace=lambda: _settle(manager), check=False)
    if _holds(fork):
        assert mamba._retained_checkpoints["A0+"] == (168, tail)
        assert tail.ref_cnt == 1 and tail.block_id not in _free_ids(manager)
    else:
        assert tail.ref_cnt == 0 and tail.block_hash is not None and tail.block_id in _free_ids(manager)

    taken = pool.get_new_blocks(pool.get_num_free_blocks())
    assert (tail.block_hash is not None) is _holds(fork)
    pool.free_blocks(taken)
    _finish(manager, a1)
    a2 = _follow_up(a1, 20, seed=3)
    assert manager.get_computed_blocks(a2)[1] == (168 if _holds(fork) else 0)
    _run(manager, a2, steps=2)
    _finish(manager, a2)
    _assert_pool_clean(manager)


def test_admitting_a_partial_hit_reserves_the_tail_swap(fork):
    """Full-sequence admission of A1 (a 136-token partial hit) needs one
    block per Mamba group above the per-step estimate with the hold (the
    held source and the moved tail coexist for a step); none without."""
    manager = unit_attention_manager(NUM_BLOCKS, fork, unit=UNIT)
    a0 = unit_request("A0", tokens(1, 150), UNIT)
    _run(manager, a0, steps=2)
    _finish(manager, a0)
    a1 = _follow_up(a0, 26, seed=2)
    computed, num_hit = manager.get_computed_blocks(a1)[:2]
    assert num_hit == 136

    def need(apply_admission_cap: bool) -> int:
        return manager.coordinator.get_num_blocks_to_allocate(
            request_id=a1.request_id,
            num_tokens=a1.num_tokens,
            new_computed_blocks=computed.blocks,
            num_encoder_tokens=0,
            total_computed_tokens=num_hit,
            num_local_computed_tokens=num_hit,
            num_tokens_main_model=a1.num_tokens,
            apply_admission_cap=apply_admission_cap,
        )

    assert need(True) == need(False) + int(_holds(fork))


@pytest.mark.parametrize(("unit", "num_tokens"), [(8, 20), (8, 32), (32, 20)])
def test_a_one_block_prompt_reserves_its_tail_when_the_unit_is_finer(fork, unit, num_tokens):
    """Hand-derived from 0093's admission rule: a fresh prompt of at most
    one block retires no state (0086 reserves nothing), but with a unit
    finer than the block its tail is moved and held: +1 with the hold.
    At the block unit (32/32) there is no partial tail: +0."""
    if unit < BLOCK:
        manager = unit_attention_manager(NUM_BLOCKS, fork, unit=unit)
    else:  # a unit equal to the block: attention at the block too
        manager = hybrid_manager(NUM_BLOCKS, fork, num_mamba_groups=1, hash_block_size=unit)
    req = unit_request("R", tokens(4, num_tokens), unit)

    def need(apply_admission_cap: bool) -> int:
        return manager.coordinator.get_num_blocks_to_allocate(
            request_id="R",
            num_tokens=num_tokens,
            new_computed_blocks=manager.empty_kv_cache_blocks.blocks,
            num_encoder_tokens=0,
            total_computed_tokens=0,
            num_local_computed_tokens=0,
            num_tokens_main_model=req.num_tokens,
            apply_admission_cap=apply_admission_cap,
        )

    assert need(True) - need(False) == int(_holds(fork) and unit < BLOCK)


@pytest.mark.parametrize("deferred", [False, True], ids=["free", "pop_blocks_for_free"])
@pytest.mark.parametrize("stop_at", ["after-hit-copy", "after-tail-copy"])
def test_freed_with_its_copy_still_queued_a_resume_leaks_nothing(fork, deferred, stop_at):
    """A1 is freed (finish, abort, preemption: either free path) while a
    copy is still queued, right after the hit's copy or after its own
    tail's. The hold took the hit source (at 136) and, at the tail, the
    copy (at 168), letting the source age at ref 0; whatever the release
    order, every block ends at ref 0."""
    manager = unit_attention_manager(NUM_BLOCKS, fork, unit=UNIT)
    pool, mamba = manager.block_pool, manager.managers[MAMBA]
    a0 = unit_request("A0", tokens(1, 150), UNIT)
    _run(manager, a0, steps=2)
    _finish(manager, a0)
    a1 = _follow_up(a0, 26, seed=2)
    computed, num_hit = manager.get_computed_blocks(a1)[:2]
    source = _cached_mamba(manager, a0, 136)
    assert num_hit == 136 and source is not None and source.ref_cnt == 0

    split = partial_hit_split(UNIT)
    num_new = split(a1, a1.num_tokens - num_hit, num_hit)
    assert manager.allocate_slots(a1, num_new, num_hit, computed, num_lookahead_tokens=K)
    a1.num_computed_tokens = num_hit + num_new
    manager.new_step_starts()
    if _holds(fork):
        assert mamba._retained_checkpoints["A0+"] == (136, source)
    if stop_at == "after-tail-copy":
        _settle(manager)
        while a1.num_computed_tokens <= 168:
            num_new = split(a1, a1.num_tokens - a1.num_computed_tokens, 0)
            assert manager.allocate_slots(a1, num_new, num_lookahead_tokens=K)
            a1.num_computed_tokens += num_new
            manager.new_step_starts()
            if a1.num_computed_tokens <= 168:
                _settle(manager)
        tail = _cached_mamba(manager, a1, 168)
        if _holds(fork):
            assert mamba._retained_checkpoints["A0+"] == (168, tail)
            assert source.ref_cnt == 0 and source.block_hash is not None

    if deferred:
        pool.free_blocks(manager.pop_blocks_for_free(a1))
    else:
        manager.free(a1)
    assert "A0+" not in getattr(mamba, "_retained_checkpoints", {})
    _settle(manager)
    assert source.ref_cnt == 0
    _assert_pool_clean(manager)


def _chunk(manager, req, split, num_hit: int = 0, computed=None) -> None:
    start = req.num_computed_tokens + num_hit
    num_new = split(req, req.num_tokens - start, num_hit)
    assert manager.allocate_slots(req, num_new, num_hit, computed, num_lookahead_tokens=K)
    req.num_computed_tokens = start + num_new


def test_a_siblings_hold_follows_the_producers_moved_tail(fork):
    """Without the EAGLE drop, producer P (150 tokens) stops at its tail
    144 with the state keyed on its running block; consumer C hits 144
    there and holds P's running block. P's next chunk moves the key into
    a copy: C's hold follows it (both hold the copy at 144) and P's
    running block is back to P's table's one ref. Both free cleanly."""
    manager = unit_attention_manager(NUM_BLOCKS, fork, unit=UNIT, use_eagle=False)
    mamba = manager.managers[MAMBA]
    split = partial_hit_split(UNIT, use_eagle_block_drop=False)
    producer = unit_request("P", tokens(1, 150), UNIT)
    while producer.num_computed_tokens < 144:
        _chunk(manager, producer, split)
        assert producer.num_computed_tokens <= 144
        manager.new_step_starts()
        _settle(manager)
    live = _cached_mamba(manager, producer, 144)
    assert live is not None and live in mamba.req_to_blocks["P"]

    consumer = unit_request("C", list(producer.prompt_token_ids) + tokens(2, 30), UNIT)
    computed, num_hit = manager.get_computed_blocks(consumer)[:2]
    assert num_hit == 144
    _chunk(manager, consumer, split, num_hit, computed)
    if _holds(fork):
        assert mamba._retained_checkpoints["C"] == (144, live)

    manager.new_step_starts()
    _settle(manager)
    _chunk(manager, producer, split)
    moved = _cached_mamba(manager, producer, 144)
    assert moved is not live and live.block_hash is None
    if _holds(fork):
        assert mamba._retained_checkpoints["C"] == mamba._retained_checkpoints["P"] == (144, moved)
        assert manager.num_retained_checkpoints() == 1  # one block, two holds
    manager.new_step_starts()
    _settle(manager)
    assert live.ref_cnt == 1

    decode(manager, producer, steps=2, trace=lambda: _settle(manager), check=False)
    _finish(manager, producer)
    while consumer.num_computed_tokens < consumer.num_tokens:
        _chunk(manager, consumer, split)
        manager.new_step_starts()
        _settle(manager)
    decode(manager, consumer, steps=2, trace=lambda: _settle(manager), check=False)
    _finish(manager, consumer)
    _assert_pool_clean(manager)
