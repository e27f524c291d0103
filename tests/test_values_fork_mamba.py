"""Value tests for the fork's Mamba checkpoint holds (patches 0086/0087,
``RetainingMambaManager``; 0093, ``PartialTailHoldingMambaManager``),
written against the survivors of ``scripts/mutation.sh partial_tail``.

The rules, from the fork's patches, worked by hand on single blocks of the
fork tests' hybrid rig (block 32, ``tests/helpers/fork.py``): a request
holds at most one hashed state, the newest by token position, a
superseded one is freed; admission reserves one block for a checkpoint it
does not hold yet (0086), none when its hit or its table already has one
(0087); a hold on a moved source follows it to the copy, the owner's own
excluded (0093).
"""

from __future__ import annotations

import pytest
from helpers.fork import (
    BLOCK,
    MAMBA_GROUPS,
    K,
    drain_copies,
    hybrid_manager,
    partial_hit_split,
    tokens,
    unit_attention_manager,
    unit_request,
)

from sim.fork.patches import ForkPatches
from sim.fork.retention import PartialTailHoldingMambaManager, RetainingMambaManager
from sim.vllm_bridge import MambaManager

RETAIN_ONLY = ForkPatches(mamba_hold_partial_tail=False)
UNIT_RIG_MAMBA = 1  # the Mamba group of ``unit_attention_manager``


def _mamba(fork: ForkPatches = RETAIN_ONLY):
    manager = hybrid_manager(64, fork, hash_block_size=8)
    return manager.managers[MAMBA_GROUPS[0]], manager.block_pool


def _hashed(pool, position: int):
    """A fresh block keyed at ``position`` tokens (ref 1, out of the queue)."""
    [block] = pool.get_new_blocks(1)
    block.set_block_hash(bytes([position % 256]) * 36, position)  # never looked up: any key
    return block


def test_a_request_holds_only_a_newer_state_and_frees_the_one_it_supersedes():
    mamba, pool = _mamba()
    assert type(mamba) is RetainingMambaManager
    b64, same64, b32, b96 = (_hashed(pool, p) for p in (64, 64, 32, 96))
    assert mamba._hold_checkpoint("T", b64) is True and b64.ref_cnt == 2
    assert mamba._hold_checkpoint("T", b64) is False  # held already
    assert mamba._hold_checkpoint("T", same64) is False  # not newer
    assert mamba._hold_checkpoint("T", b32) is False  # older
    assert mamba.retained_checkpoints() == {"T": b64} and same64.ref_cnt == b32.ref_cnt == 1
    assert mamba._hold_checkpoint("T", b96) is True
    assert mamba.retained_checkpoints() == {"T": b96} and b64.ref_cnt == 1
    # A direct free pops the hold first (freed last of its group, in reverse).
    assert mamba.pop_blocks_for_free("T")[0] is b96 and mamba.retained_checkpoints() == {}


@pytest.mark.parametrize("fork", [RETAIN_ONLY, ForkPatches()], ids=["0086-0087", "with-0093"])
def test_admission_reserves_a_checkpoint_only_where_none_is_held_or_hit(fork):
    """Past one block (33 tokens) a fresh request reserves 1; 0 when it
    holds a checkpoint, when its hit has a state or when its table has a
    hashed state; null hit blocks and an unhashed table block count for
    nothing. (0093 changes only partial hits and one-block prompts.)"""
    mamba, pool = _mamba(fork)
    null = pool.null_block
    reserve = mamba.retained_checkpoint_blocks_to_reserve
    assert reserve("T", BLOCK + 1) == 1
    assert reserve("T", BLOCK + 1, [null, null]) == 1
    assert reserve("T", BLOCK + 1, [null, _hashed(pool, 64)], BLOCK * 2) == 0
    [unhashed] = pool.get_new_blocks(1)
    mamba.req_to_blocks["T"] = [null, unhashed]
    assert reserve("T", BLOCK + 1) == 1
    mamba.req_to_blocks["T"] = [null, _hashed(pool, 32)]
    assert reserve("T", BLOCK + 1) == 0
    del mamba.req_to_blocks["T"]
    mamba._hold_checkpoint("T", _hashed(pool, 64))
    assert reserve("T", BLOCK + 1) == 0
    # One block or less: 0086 reserves nothing; 0093 holds its moved tail
    # when the unit (8) is finer than the block.
    assert reserve("U", BLOCK) == (0 if type(mamba) is RetainingMambaManager else 1)


def test_only_a_hashed_state_is_held_and_a_moved_source_is_followed_by_others_only():
    mamba, pool = _mamba(ForkPatches())
    assert type(mamba) is PartialTailHoldingMambaManager
    [unhashed] = pool.get_new_blocks(1)
    mamba._hold_if_hashed("T", unhashed)
    assert mamba.retained_checkpoints() == {}
    own, source, other = _hashed(pool, 40), _hashed(pool, 72), _hashed(pool, 104)
    copy = _hashed(pool, 73)
    for request_id, block in (("O", own), ("S", source), ("U", other)):
        mamba._hold_if_hashed(request_id, block)
    mamba._follow_moved_hash("O", own, copy)  # the owner moved its own tail: nobody else held it
    mamba._follow_moved_hash("O", source, copy)
    assert mamba.retained_checkpoints() == {"O": own, "S": copy, "U": other}
    assert (source.ref_cnt, copy.ref_cnt) == (1, 2)


def test_the_checkpoint_term_is_added_at_the_full_sequence_gate_only():
    """vLLM's own Mamba estimate is the expected value: a step's count is
    upstream's, the gate's (``apply_admission_cap``) upstream's plus the
    checkpoint a fresh 64-token request will hold (0086)."""
    mamba, _ = _mamba()
    args = dict(
        request_id="T",
        num_tokens=2 * BLOCK,
        new_computed_blocks=[],
        total_computed_tokens=0,
        num_local_computed_tokens=0,
        num_tokens_main_model=2 * BLOCK,
    )
    upstream = MambaManager.get_num_blocks_to_allocate(mamba, **args)
    gate = MambaManager.get_num_blocks_to_allocate(mamba, **args, apply_admission_cap=True)
    assert mamba.get_num_blocks_to_allocate(**args) == upstream
    assert mamba.get_num_blocks_to_allocate(**args, apply_admission_cap=True) == gate + 1


def _chunk(manager, req, split, num_hit: int = 0, computed=None) -> None:
    """One prefill chunk as the scheduler cuts it, then its copies run."""
    start = req.num_computed_tokens + num_hit
    num_new = split(req, req.num_tokens - start, num_hit)
    assert manager.allocate_slots(req, num_new, num_hit, computed, num_lookahead_tokens=K)
    req.num_computed_tokens = start + num_new
    manager.new_step_starts()
    drain_copies(manager)


@pytest.mark.parametrize(
    "owner_holds_source", [True, False], ids=["owner-holds-it", "control-owner-does-not"]
)
def test_the_owner_of_a_moved_tail_keeps_its_own_hold_while_others_follow(owner_holds_source):
    """0093 through vLLM's allocation (unit 8, block 32, no EAGLE drop): P
    (150 tokens) stops at its tail 144, keyed on its running block; C hits
    144 there and holds that block. Here P is made to hold its own running
    block too (by hand). P's next chunk moves the key into a copy: C, another
    holder, follows it; P, the owner, is excluded, and the copy, keyed at the
    same 144, is not newer, so P keeps its hold. Once the copies have run:
    the running block has P's table and P's hold (2), the copy C's hold (1).
    Control: P holding nothing, P holds the copy as its moved tail (the
    running block back to its table's 1, the copy at 2)."""
    manager = unit_attention_manager(96, ForkPatches(), unit=8, use_eagle=False)
    mamba, pool = manager.managers[UNIT_RIG_MAMBA], manager.block_pool
    split = partial_hit_split(8, use_eagle_block_drop=False)
    producer = unit_request("P", tokens(1, 150), 8)
    while producer.num_computed_tokens < 144:
        _chunk(manager, producer, split)
    [live] = pool.get_cached_block(producer.block_hashes[144 // 8 - 1], [UNIT_RIG_MAMBA])
    consumer = unit_request("C", list(producer.prompt_token_ids) + tokens(2, 30), 8)
    computed, num_hit = manager.get_computed_blocks(consumer)[:2]
    assert num_hit == 144
    _chunk(manager, consumer, split, num_hit, computed)
    assert mamba.retained_checkpoints() == {"C": live} and live.ref_cnt == 2
    if owner_holds_source:
        assert mamba._hold_checkpoint("P", live) is True
    _chunk(manager, producer, split)
    [moved] = pool.get_cached_block(producer.block_hashes[144 // 8 - 1], [UNIT_RIG_MAMBA])
    assert moved is not live and live.block_hash is None
    expected_p = live if owner_holds_source else moved
    assert mamba.retained_checkpoints() == {"C": moved, "P": expected_p}
    assert (live.ref_cnt, moved.ref_cnt) == ((2, 1) if owner_holds_source else (1, 2))
