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
from helpers.fork import BLOCK, MAMBA_GROUPS, hybrid_manager

from sim.fork_patches import ForkPatches
from sim.single_type_kv_cache_manager import PartialTailHoldingMambaManager, RetainingMambaManager
from sim.vllm_bridge import MambaManager

RETAIN_ONLY = ForkPatches(mamba_hold_partial_tail=False)


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
