"""Patch 0088's layout pass (``sim/fork/side_cache_layout.py``) on groupings
laid out by hand, where Flash-Next's own pool (``tests/test_layout.py``,
``tests/test_fork_deployment.py``) never goes: a fold whose lowest valid
target is not the first group, a replicated group that stays apart, a worker
with no layers, a ring whose best slot count is 2 or odd, a pool the rings
fill. Every expected value is worked out by hand in the test's docstring
from 0088's rules (as the twin's module docstring states them: a replicated
Mamba group joins the lowest sharded group of its schedule that widens no
worker's block; a ring takes the largest S up to 1,024 of 256-aligned slots
that hold its pages, and costs cdiv(max_num_seqs, S) blocks), vLLM's block
stride (the widest group's pages) and the fork's published pool (317 blocks,
97 per 262,144-token request, 8 sequences, 853,994 tokens)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from sim.fork import side_cache_layout as side
from sim.fork.side_cache_rings import as_slot_packed, group_slots_per_block
from sim.kv_cache_interface import group_layer_specs
from sim.kv_cache_plan import plan_kv_cache
from sim.vllm_bridge import (
    CircularBufferSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    KVCacheTensor,
    MambaSpec,
    UniformTypeKVCacheSpecs,
    planning,
)

BLOCK_OUTERMOST = KVCacheLayout.BLHNC
PAGE = 256  # one float32 state of 64 values: every Mamba page below


def _mamba(*, replicated: bool = False, spec_blocks: int = 0, numel: int = 64) -> MambaSpec:
    """A Mamba state; ``spec_blocks`` changes its schedule key only."""
    return MambaSpec(
        block_size=16,
        shapes=((numel,),),
        dtypes=(torch.float32,),
        tp_replicated=replicated,
        num_speculative_blocks=spec_blocks,
    )


def _group(names: str, spec, *, eagle: bool = False) -> KVCacheGroupSpec:
    layers = names.split()
    specs = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=dict.fromkeys(layers, spec))
    return KVCacheGroupSpec(layers, specs, is_eagle_group=eagle)


def _one_worker(groups: list[KVCacheGroupSpec]) -> list[dict]:
    return [
        {name: spec for g in groups for name, spec in zip(g.layer_names, group_layer_specs(g), strict=True)}
    ]


def _fold(groups: list[KVCacheGroupSpec]) -> tuple[list[list[str]], list[str]]:
    folded, notes = side.fold_replicated_mamba_groups(groups, _one_worker(groups), BLOCK_OUTERMOST)
    return [g.layer_names for g in folded], notes


def test_a_replicated_group_joins_the_lowest_sharded_group_of_its_own_schedule_and_draft_flag():
    """Groups: 0 a sharded Mamba group of another schedule (one speculative
    block), 1 one of the same schedule in the MTP draft's group, 2 the
    replicated pair r1 r2, 3 the same schedule sharded (1 layer), 4 the same
    (4 layers, the widest: a 4-page block, 1,024 B). 0088: a replicated
    group joins a sharded Mamba group with the same scheduling parameters
    and the lowest index that widens no block: group 3 (1 + 2 = 3 pages).
    Groups 0 and 1 would not widen it either; they are the wrong schedule
    and the wrong draft flag."""
    other, key = _mamba(spec_blocks=1), _mamba()
    groups = [
        _group("d", other),
        _group("e", key, eagle=True),
        _group("r1 r2", _mamba(replicated=True)),
        _group("t", key),
        _group("w1 w2 w3 w4", key),
    ]
    layers, notes = _fold(groups)
    assert layers == [["d"], ["e"], ["t", "r1", "r2"], ["w1", "w2", "w3", "w4"]]
    assert notes == [
        "folded replicated Mamba group 2 (r1, r2) into Mamba group 3 (now 3 layers); "
        "per-worker block bytes unchanged [1024]"
    ]


def test_a_replicated_group_with_no_target_stays_apart_and_the_pass_goes_on():
    """Groups: 0 replicated p0, 1 sharded t, 2 sharded u1 u2, 3 replicated x
    of another schedule (no sharded group shares it), 4 replicated p, 5
    sharded w1-w4 (4 pages, 1,024 B). p0 joins t, the first valid group (2
    layers; the grouping is now t+p0, u, x, p, w). x, now group 2, stays
    apart with its note. p, now group 3, cannot join t+p0 (a target holds
    sharded layers only) nor w (5 pages would widen the block): it joins u,
    group 1, before it (3 layers)."""
    key = _mamba()
    groups = [
        _group("p0", _mamba(replicated=True)),
        _group("t", key),
        _group("u1 u2", key),
        _group("x", _mamba(replicated=True, spec_blocks=1)),
        _group("p", _mamba(replicated=True)),
        _group("w1 w2 w3 w4", key),
    ]
    layers, notes = _fold(groups)
    assert layers == [["t", "p0"], ["u1", "u2", "p"], ["x"], ["w1", "w2", "w3", "w4"]]
    assert notes == [
        "folded replicated Mamba group 0 (p0) into Mamba group 1 (now 2 layers); "
        "per-worker block bytes unchanged [1024]",
        "replicated Mamba group 2 (1 layer(s)) kept separate: "
        "no sharded group has a spare page on every worker",
        "folded replicated Mamba group 3 (p) into Mamba group 1 (now 3 layers); "
        "per-worker block bytes unchanged [1024]",
    ]


def test_a_replicated_group_whose_layers_disagree_on_the_schedule_is_left_alone():
    """r_a and r_b are replicated but one has a speculative block: the group
    has no one schedule to share, so it is no replicated Mamba group to the
    pass (no fold, no note), though t shares r_a's schedule."""
    specs = {"r_a": _mamba(replicated=True), "r_b": _mamba(replicated=True, spec_blocks=1)}
    mixed = KVCacheGroupSpec(["r_a", "r_b"], UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=specs))
    groups = [mixed, _group("t", _mamba()), _group("w1 w2 w3", _mamba())]
    assert _fold(groups) == ([["r_a", "r_b"], ["t"], ["w1", "w2", "w3"]], [])


def test_a_merged_group_keeps_its_targets_table_flag_and_block_size():
    """The merged group is the target's: the MTP draft's flag (0060) and the
    block size its schedule key carries."""
    key = _mamba(replicated=False)
    merged = side.merge_groups(_group("t", key, eagle=True), _group("r", _mamba(replicated=True), eagle=True))
    assert merged.layer_names == ["t", "r"]
    assert merged.is_eagle_group is True
    assert merged.kv_cache_spec.block_size == 16


def test_a_worker_with_no_layers_has_a_zero_stride_and_the_workers_after_it_count():
    """vLLM's stride is the widest group's pages: 2 pages (512 B) on the
    worker with t, w1 and w2; 0 on one with no layer; 1 page on one with t
    alone (w projects empty there)."""
    groups = [_group("t", _mamba()), _group("w1 w2", _mamba())]
    [full] = _one_worker(groups)
    workers = [full, {}, {"t": full["t"]}]
    assert side.worker_strides(groups, workers, BLOCK_OUTERMOST) == [2 * PAGE, 0, PAGE]


def _ring_grouping() -> list[KVCacheGroupSpec]:
    """A 4,096 B Mamba state (the stride), a ring of 512 B pages (K and V,
    16 x 1 head x 8 x fp16) and a 256 B Mamba state."""
    ring = CircularBufferSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16)
    return [
        KVCacheGroupSpec(["big"], _mamba(numel=1024)),
        KVCacheGroupSpec(["ring"], ring),
        KVCacheGroupSpec(["small"], _mamba()),
    ]


def test_only_ring_groups_get_slots_on_a_single_worker():
    """Slots S of the 4,096 B stride: 256-aligned (S in 1, 2, 4, 8, 16) and
    at least the ring's 512 B (S <= 8): S = 8. The small Mamba state would
    fit 16 slots; it is no ring. A second worker with no layer (vLLM's
    projection onto it is empty) changes nothing; no worker: nothing to
    pack."""
    groups = _ring_grouping()
    assert side.choose_ring_slots([groups], BLOCK_OUTERMOST) == {1: 8}
    empty = planning._project_kv_cache_groups_to_worker(groups, {})
    assert not any(g.layer_names for g in empty)
    assert side.choose_ring_slots([groups, empty], BLOCK_OUTERMOST) == {1: 8}
    assert side.choose_ring_slots([], BLOCK_OUTERMOST) == {}


@pytest.mark.parametrize(
    "stride, ring_bytes, slots",
    [
        (512, 256, 2),  # 512 / S a multiple of 256: S = 1 or 2
        (768, 256, 3),  # S = 1 or 3: an odd count
        (512, 257, None),  # S = 2 leaves 256 B < 257 B
    ],
)
def test_the_largest_slot_count_is_tried_down_to_two(stride, ring_bytes, slots):
    assert side._largest_slots([(stride, ring_bytes)]) == slots


def test_the_blocker_names_each_reason(flash_next, reference):
    """The reason the plan's note gives, one per blocking setting; None for
    the rig (block-outermost, no connector, HiSparse or DCP)."""
    engine = plan_kv_cache(flash_next, reference, side_cache_layout=True).engine
    assert side.side_cache_layout_blocker(engine) is None

    def blocked(**changes) -> str | None:
        parts = {
            "kv_transfer_config": None,
            "attention_config": SimpleNamespace(hisparse_config=None),
            "parallel_config": SimpleNamespace(decode_context_parallel_size=1),
            "cache_config": SimpleNamespace(get_resolved_kv_cache_layout=lambda: BLOCK_OUTERMOST),
        }
        return side.side_cache_layout_blocker(SimpleNamespace(**{**parts, **changes}))

    assert blocked() is None
    assert blocked(kv_transfer_config=object()) == "a KV connector is configured"
    assert blocked(attention_config=SimpleNamespace(hisparse_config=object())) == "HiSparse is enabled"
    dcp = SimpleNamespace(decode_context_parallel_size=2)
    assert blocked(parallel_config=dcp) == "decode context parallelism is enabled"


@pytest.fixture(scope="module")
def shipped_pool():
    """The rig's scheduler-side pool with the layout on: the fork's 317
    blocks, one ring group at 800 slots."""
    from sim.config import DeploymentConfig, load_model
    from sim.paths import DEFAULT_MODEL

    plan = plan_kv_cache(load_model(DEFAULT_MODEL), DeploymentConfig(), side_cache_layout=True)
    config = plan.scheduler_config()
    assert (
        config.num_blocks == 317
        and [group_slots_per_block(g) for g in config.kv_cache_groups].count(800) == 1
    )
    return plan.engine, config


def test_rings_at_two_slots_cost_half_the_sequences_in_blocks(shipped_pool):
    """At S = 2 the ring of 8 sequences costs cdiv(8, 2) = 4 blocks, leaving
    313 for requests of 97 blocks: 313 / 97 = 3.2268 requests of 262,144
    tokens = 845,887 tokens (at S = 800: 316 / 97, the fork's 853,994)."""
    engine, config = shipped_pool
    two = replace(
        config,
        kv_cache_groups=[
            replace(g, kv_cache_spec=as_slot_packed(g.kv_cache_spec, 2))
            if group_slots_per_block(g) > 1
            else g
            for g in config.kv_cache_groups
        ],
    )
    assert side.shared_ring_blocks(engine, two) == 4
    assert side.get_kv_cache_capacity(engine, two) == (262_144 * 313 // 97, 313 / 97)
    assert side.get_kv_cache_capacity(engine, config) == (853_994, 316 / 97)  # CONTROL: the fork's figure


def test_a_pool_the_rings_fill_holds_no_request(shipped_pool):
    """One block, taken by the ring's 8 slots: no token for a request."""
    engine, config = shipped_pool
    assert side.get_kv_cache_capacity(engine, replace(config, num_blocks=1)) == (0, 0.0)


def test_a_packed_ring_tensor_is_the_same_memory_cut_into_slots():
    """A worker whose ring group has one layer (its tensor holds one ring
    page a slot), at an offset in host memory: packed at S = 8 of a 4,096 B
    block, each view block is a 512 B slot (a whole byte count: torch's
    ``as_strided`` takes integers) holding the one 512 B page; size,
    offset and residency are the tensor's own, the layer's group carries S."""
    groups = _ring_grouping()
    big = KVCacheTensor(size=10 * 4096, layers=["big", "small"], layer_stride=1024, block_stride=4096)
    ring = KVCacheTensor(
        size=10 * 4096, layers=["ring"], layer_stride=512, block_stride=4096, offset=8192, host_resident=True
    )
    config = KVCacheConfig(num_blocks=10, kv_cache_tensors=[big, ring], kv_cache_groups=groups)
    packed = side.pack_ring_slots(config, {1: 8}, BLOCK_OUTERMOST)
    assert [group_slots_per_block(g) for g in packed.kv_cache_groups] == [1, 8, 1]
    assert packed.kv_cache_tensors[0] is big
    view = packed.kv_cache_tensors[1]
    assert (view.size, view.layers, view.offset, view.host_resident) == (10 * 4096, ["ring"], 8192, True)
    assert (view.slots_per_block, view.block_stride, view.layer_stride) == (8, 512, 512)
    assert type(view.block_stride) is int
