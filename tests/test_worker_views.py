"""Worker views and KV zeroing (seed patch 0088, section 3): every rank's pool
is allocated on the CPU through vLLM's own ``allocate_kv_cache`` and its
zeroing table read from vLLM's own ``KVBlockZeroer``.

The plans have 24 blocks (23 is the least that passes the boot memory check
for one 3,200-token request); the pools allocated hold 3 of them (~35 MB),
enough for block 0 and the two blocks the checks look at.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import pairwise

import pytest
import torch

from sim.config import DeploymentConfig, ModelConfig
from sim.fork.side_cache_rings import group_slots_per_block
from sim.kv_cache_interface import config_layer_specs
from sim.kv_cache_plan import KVCachePlan, plan_kv_cache
from sim.pool_replay.views import (
    LayerView,
    WorkerViews,
    allocate_kv_cache,
    allocate_worker_views,
    byte_range,
    with_num_blocks,
    without_unowned_tensors,
    zeroed_segments,
)
from sim.vllm_bridge import KVCacheLayout, MambaSpec

PLAN_BLOCKS = 24
POOL_BLOCKS = 3
MAX_MODEL_LEN = 3200
RANKS = pytest.mark.parametrize("rank", [0, 2], ids=["pp0", "pp1"])
PLE = "language_model.model.layers.2.ple"
SLOTS = 800  # ring slots per pool block on Flash-Next, both stages


def small_plan(model: ModelConfig, reference: DeploymentConfig, on: bool, num_blocks: int) -> KVCachePlan:
    """The reference deployment at ``MAX_MODEL_LEN``, with a pinned pool."""
    deployment = reference.model_copy(update={"max_model_len": MAX_MODEL_LEN})
    return plan_kv_cache(model, deployment, side_cache_layout=on, num_gpu_blocks_override=num_blocks)


@pytest.fixture(scope="module")
def plans(flash_next, reference) -> dict[bool, KVCachePlan]:
    return {on: small_plan(flash_next, reference, on, PLAN_BLOCKS) for on in (False, True)}


@pytest.fixture(scope="module")
def views(plans):
    """``views(on, rank)``: that rank's small pool, allocated once."""
    pools: dict[tuple[bool, int], WorkerViews] = {}

    def get(on: bool, rank: int) -> WorkerViews:
        if (on, rank) not in pools:
            pools[on, rank] = allocate_worker_views(plans[on], rank, num_blocks=POOL_BLOCKS)
        return pools[on, rank]

    return get


def ring_views(pool: WorkerViews) -> dict[str, torch.Tensor]:
    return {
        name: view
        for name, view in pool.views.items()
        if name.endswith("raw_key_cache") and isinstance(view, torch.Tensor)
    }


def assert_slots_inside_their_block(
    pool: WorkerViews,
    rings: Mapping[str, torch.Tensor],
    slots: int,
    pool_blocks: tuple[int, ...] = (1, 2),
) -> None:
    """Slots 0, 1 and S-1 of every ring layer lie inside their pool block,
    and no two of those pages overlap."""
    for block in pool_blocks:
        lo_block, hi_block = pool.block_bytes(block)
        spans = []
        for slot in (0, 1, slots - 1):
            for name, view in rings.items():
                lo, hi = byte_range(view, block * slots + slot, pool.base)
                assert lo_block <= lo < hi <= hi_block, f"{name} slot {slot} of block {block} at [{lo}, {hi})"
                spans.append((lo, hi))
        spans.sort()
        assert all(a[1] <= b[0] for a, b in pairwise(spans)), "slots overlap"


def assert_clear_of(
    span: tuple[int, int],
    others: Mapping[str, LayerView],
    pool: WorkerViews,
    block: int,
) -> None:
    """``span`` lies inside pool block ``block`` and overlaps no state of
    ``others`` in that block."""
    lo_block, hi_block = pool.block_bytes(block)
    lo, hi = span
    assert lo_block <= lo < hi <= hi_block
    for name, view in others.items():
        for state in view if isinstance(view, tuple) else (view,):
            state_lo, state_hi = byte_range(state, block, pool.base)
            assert state_hi <= lo or state_lo >= hi, f"overlaps {name}"


# ---------------------------------------------------------------------------
# Where the views lie.
# ---------------------------------------------------------------------------
@RANKS
def test_ring_slots_stay_inside_their_pool_block(views, rank):
    pool = views(True, rank)
    rings = ring_views(pool)
    assert len(rings) == (6 if rank == 0 else 7)
    [ring_group] = [g for g in pool.config.kv_cache_groups if group_slots_per_block(g) > 1]
    assert group_slots_per_block(ring_group) == SLOTS
    assert all(v.shape[0] == POOL_BLOCKS * SLOTS for v in rings.values())
    assert_slots_inside_their_block(pool, rings, SLOTS)


@RANKS
def test_slot_check_catches_the_other_stages_slot_stride(views, rank):
    """CONTROL: block ids are global, slot strides are per stage. A ring view
    strided by the other stage's slot puts pool block 1's slots in block 0
    (PP1) or past block 1 (PP0), and the same check says so."""
    pool, other = views(True, rank), views(True, 2 - rank)
    other_slot_bytes = next(iter(ring_views(other).values())).stride(0)
    wrong = {
        name: view.as_strided(
            (2 * SLOTS, *view.shape[1:]),
            (other_slot_bytes, *view.stride()[1:]),
            view.storage_offset(),
        )
        for name, view in ring_views(pool).items()
    }
    with pytest.raises(AssertionError, match="slot"):
        assert_slots_inside_their_block(pool, wrong, SLOTS, pool_blocks=(1,))


def test_folded_ple_page_stays_clear_of_its_gdn_pages(views):
    pool = views(True, 0)
    [group] = [g for g in pool.config.kv_cache_groups if PLE in g.layer_names]
    gdn = {n: pool.views[n] for n in group.layer_names if n != PLE}
    assert len(gdn) == 6 and isinstance(pool.views[PLE], tuple)
    assert_clear_of(byte_range(pool.views[PLE], 1, pool.base), gdn, pool, block=1)
    # CONTROL: the PLE page where its own group put it in the old layout
    # (page 0 of the block, same stride on PP0) overlaps a GDN state.
    old = views(False, 0)
    assert old.block_stride_bytes == pool.block_stride_bytes
    with pytest.raises(AssertionError, match="overlaps"):
        assert_clear_of(byte_range(old.views[PLE], 1, old.base), gdn, pool, block=1)


def test_mamba_layers_bind_their_states_inside_their_page(views):
    """A Mamba layer's raw page is split into its spec's states, packed from
    the start of the page (vLLM's ``MambaBase.bind_kv_cache``)."""
    pool = views(True, 0)
    specs = config_layer_specs(pool.config)
    mamba = [n for n, s in specs.items() if isinstance(s, MambaSpec)]
    assert PLE in mamba and len(mamba) == 19 + 1
    for name in mamba:
        spec, states = specs[name], pool.views[name]
        assert isinstance(spec, MambaSpec) and isinstance(states, tuple)
        assert [s.shape[1:] for s in states] == [torch.Size(x) for x in spec.shapes]
        assert [s.dtype for s in states] == list(spec.dtypes)
        page_lo, page_hi = byte_range(pool.kv_caches[name], 2, pool.base)
        lo, hi = byte_range(states, 2, pool.base)
        assert lo == page_lo and hi - lo == spec.real_page_size_bytes
        assert hi <= page_hi


# ---------------------------------------------------------------------------
# What the KV zeroer clears.
# ---------------------------------------------------------------------------
# rank -> block bytes, bytes zeroed per block, segments (old, new, no skip)
ZEROING = {
    0: (11_468_800, 11_059_200, (17, 12, 4810)),
    2: (12_902_400, 12_902_400, (20, 14, 5613)),
}


@RANKS
def test_zeroer_clears_the_same_bytes_in_both_layouts(views, rank):
    stride, zeroed, (num_old, num_new, _) = ZEROING[rank]
    old = zeroed_segments(views(False, rank).config, views(False, rank).views)
    new = zeroed_segments(views(True, rank).config, views(True, rank).views)
    assert old.block_stride_bytes == new.block_stride_bytes == stride
    # The attention pages (compressed keys, then main KV) fill the block
    # from byte 0 up to `zeroed`; the rest of PP0's block is GDN state.
    assert new.ranges == old.ranges == ((0, zeroed),)
    # The old ring pages sat inside the first compressed-key pages; the new
    # table drops them. The zeroer merges segments that start at one address,
    # so the first ring layer (offset 0, like the first compressed-key layer)
    # never had a segment of its own: rings - 1 fewer.
    rings = len(ring_views(views(True, rank)))
    assert new.num_segments <= old.num_segments
    assert (old.num_segments, new.num_segments) == (num_old, num_new)
    assert old.num_segments - new.num_segments == rings - 1


@RANKS
def test_zeroer_without_the_slot_skip(views, rank):
    """CONTROL: fed the slot-packed ring group, 0.33.0's zeroer reads its
    ``num_blocks * S`` view blocks as S virtual blocks per pool block and
    gives every slot of every ring layer a segment of its own, except where a
    slot page starts on an attention page's first byte (the zeroer merges
    segments that start at one address).

    On PP0 that clears bytes the old layout never cleared: the slots past
    the attention pages lie in the block's last page, which the Mamba groups
    hold (GDN group 0's seventh layer, the folded PLE). On PP1 the attention
    pages cover the whole block, so the bytes happen to be equal and only
    the segment count gives the missing skip away."""
    stride, zeroed, (_, num_new, num_unskipped) = ZEROING[rank]
    pool = views(True, rank)
    new = zeroed_segments(pool.config, pool.views)
    unskipped = zeroed_segments(pool.config, pool.views, skip_slot_packed=False)
    assert (new.num_segments, unskipped.num_segments) == (num_new, num_unskipped)
    rings = ring_views(pool)
    slot_starts = [byte_range(view, slot, pool.base)[0] for view in rings.values() for slot in range(SLOTS)]
    on_attention = set(slot_starts) & {seg.offset_bytes for seg in new.segments}
    assert len(on_attention) == (2 if rank == 0 else 1)  # slot 0 (and 200 on PP0)
    extra_segments = unskipped.num_segments - new.num_segments
    assert extra_segments == SLOTS * len(rings) - len(on_attention)
    if rank == 0:
        assert unskipped.ranges != new.ranges
        assert unskipped.ranges[0][0] == 0 and unskipped.ranges[-1][1] <= stride
        assert all(lo >= zeroed for lo, _ in unskipped.ranges[1:])
        extra_bytes = unskipped.bytes_per_block - new.bytes_per_block
        assert extra_bytes == 394_752  # all in [zeroed, stride)
    else:
        assert unskipped.ranges == new.ranges == ((0, stride),)


# ---------------------------------------------------------------------------
# The views are vLLM's.
# ---------------------------------------------------------------------------
def geometry(view: torch.Tensor) -> tuple:
    """Everything of a view but its block count and buffer."""
    return (
        view.dtype,
        tuple(view.shape[1:]),
        view.stride(),
        view.storage_offset() * view.element_size(),
    )


@RANKS
def test_old_layout_views_are_vllms_own(plans, views, rank):
    """The small CPU pool's views equal vLLM's own views of the plan's full
    pool (allocated on the meta device: no memory), block count aside."""
    plan, pool = plans[False], views(False, rank)
    config, unowned = without_unowned_tensors(plan.worker_configs[rank])
    assert pool.unowned_layers == unowned == (() if rank == 0 else (PLE,))
    layout = KVCacheLayout.BLNHC
    if unowned:
        # vLLM 0.33.0 places a tensor for the PLE layer on PP1 too (its group
        # projects empty there but keeps its spec) and then cannot bind it.
        with pytest.raises(StopIteration):
            allocate_kv_cache(plan.worker_configs[rank], torch.device("meta"), layout)
    full = allocate_kv_cache(config, torch.device("meta"), layout)
    assert full.keys() == pool.kv_caches.keys()
    for name, view in full.items():
        assert view.shape[0] == PLAN_BLOCKS and pool.kv_caches[name].shape[0] == POOL_BLOCKS
        assert geometry(pool.kv_caches[name]) == geometry(view), name
    # CONTROL: the comparison sees the layout change, and nothing else: the
    # new layout moves exactly the ring layers and (on PP0) the PLE page.
    new = views(True, rank)
    moved = {name for name, view in new.kv_caches.items() if geometry(view) != geometry(full[name])}
    assert moved == set(ring_views(new)) | ({PLE} if rank == 0 else set())


@pytest.mark.parametrize("on", [False, True], ids=["old", "new"])
def test_a_small_pool_is_the_planners_own(flash_next, reference, plans, on):
    """Shrinking a 24-block plan to 23 blocks gives exactly the planner's
    23-block configs, slot-packed tensors included."""
    smaller = small_plan(flash_next, reference, on, 23)
    kv_cache_layout = KVCacheLayout.BLNHC
    for config, expected in zip(plans[on].worker_configs, smaller.worker_configs, strict=True):
        assert with_num_blocks(config, 23, kv_cache_layout) == expected
        assert type(with_num_blocks(config, 23, kv_cache_layout)) is type(expected)


def test_bad_pool_sizes_are_value_errors(plans):
    config = plans[True].worker_configs[0]
    with pytest.raises(ValueError, match="num_blocks"):
        with_num_blocks(config, 0, KVCacheLayout.BLNHC)
    with pytest.raises(ValueError, match="num_blocks"):
        with_num_blocks(config, 3, KVCacheLayout.LBNHC)
    with pytest.raises(ValueError, match="rank"):
        allocate_worker_views(plans[True], 4, num_blocks=3)
