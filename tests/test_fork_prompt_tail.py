"""The prompt-tail checkpoint at a hash unit finer than the block (the fork's
patch 0094 and its tests in ``test_partial_prefix_cache_hits.py``): block 32,
hash unit 8, K = 3 with the EAGLE drop, retention interval 0.

vLLM 0.33.0 already keys a prompt tail that lands on a block end (its
``MambaManager._cache_partial_tail_block`` keys the prompt's last hash-unit
boundary whatever its alignment), so 0094 is upstream behaviour on kvsim's
base and has no switch here; the fork's values come out of 0.33.0's
machinery with the fork's retention (0086) holding the tail state. The
failing control is retention off: a burst then evicts it.
"""

from __future__ import annotations

import pytest
from helpers.fork import BLOCK, decode, hybrid_manager, partial_hit_split, prefill, tokens

from sim.fork.patches import ForkPatches
from sim.vllm_bridge import Request, SamplingParams, get_request_block_hasher, sha256

UNIT = 8
MAMBA = 1


def _request(request_id: str, token_ids: list[int], unit: int = UNIT) -> Request:
    params = SamplingParams(max_tokens=4096)
    params.update_from_generation_config({}, eos_token_id=100_000)
    hasher = get_request_block_hasher(unit, sha256)
    return Request(request_id, token_ids, params, None, block_hasher=hasher)


def _prefill(manager, req: Request, unit: int = UNIT) -> list[int]:
    chunks: list[int] = []
    prefill(manager, req, split=partial_hit_split(unit), chunks=chunks)
    return chunks


@pytest.mark.parametrize("retain", [True, False], ids=["retain-on", "retain-off-control"])
def test_a_block_aligned_tail_is_keyed_held_and_hit(retain):
    """136 tokens: tail key 136 // 8 * 8 - 8 = 128 = 4 blocks, replay
    boundary 96. The split stops at 96 and at the tail (chunks 96, 32, 8);
    state@128 is keyed and (fork) held while A1 decodes; a burst takes every
    free block; the next turn hits 128 (fork) or 0."""
    manager = hybrid_manager(
        96, ForkPatches(mamba_retain_checkpoint=retain), num_mamba_groups=1, hash_block_size=UNIT
    )
    pool = manager.block_pool
    a1 = _request("A1", tokens(1, 136))
    assert _prefill(manager, a1) == [96, 32, 8]
    decode(manager, a1, steps=4)
    [tail_block] = pool.get_cached_block(a1.block_hashes[128 // UNIT - 1], [MAMBA])
    assert tail_block.block_hash_num_tokens == 128
    assert tail_block.ref_cnt == (1 if retain else 0)
    if retain:
        assert manager.managers[MAMBA]._retained_checkpoints["A1"] == (128, tail_block)

    taken = pool.get_new_blocks(pool.get_num_free_blocks())
    assert (tail_block.block_hash is not None) is retain
    pool.free_blocks(taken)
    manager.free(a1)
    a2 = _request("A2", list(a1.all_token_ids) + tokens(3, 20))
    assert manager.get_computed_blocks(a2)[1] == (128 if retain else 0)
    # No leak: everything but the null block is free again.
    assert pool.get_num_free_blocks() == 95


def test_at_the_block_unit_only_the_replay_boundary_is_hashed():
    """Unit = block (32): the same prompt is cut at 96 then 40, and the
    hashed Mamba states are exactly [96] (the fork's block-unit value)."""
    manager = hybrid_manager(64, ForkPatches(), num_mamba_groups=1, hash_block_size=BLOCK)
    req = _request("R", tokens(1, 136), unit=BLOCK)
    assert _prefill(manager, req, unit=BLOCK) == [96, 40]
    hashed = [
        i * BLOCK
        for i in range(1, 136 // BLOCK + 1)
        if manager.block_pool.get_cached_block(req.block_hashes[i - 1], [MAMBA])
    ]
    assert hashed == [96]
