"""The worker views' edges (``sim.pool_replay.views``) by hand: shrinking a
hand-made config's pool (the backing size is ``bytes per block * blocks``),
dropping the tensors of layers no group names, and what
``allocate_worker_views`` records of the small replay's plan
(``tests/data/pool-replay.yaml``: four ranks, block-outermost; the old
layout places a tensor for the PLE layer on PP1, whose group is empty
there). Milliseconds, except the plan (a third of a second).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from sim.analysis.runs import scenario_workload
from sim.engine import Simulation
from sim.kv_cache_interface import first_layer_spec
from sim.pool_replay.views import (
    WorkerViews,
    _tensors,
    allocate_worker_views,
    with_num_blocks,
    without_unowned_tensors,
    zeroed_segments,
)
from sim.scenario import load_scenario
from sim.vllm_bridge import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    KVCacheTensor,
    MambaSpec,
)

SMALL = Path(__file__).parent / "data" / "pool-replay.yaml"
PLE = "language_model.model.layers.2.ple"
BLOCK_BYTES = 96  # per pool block, every tensor of the hand config


def tensor(*layers: str, blocks: int = 4) -> KVCacheTensor:
    return KVCacheTensor(
        size=BLOCK_BYTES * blocks, layers=list(layers), layer_stride=0, block_stride=BLOCK_BYTES
    )


def hand_config(tensors: list[KVCacheTensor], owned: tuple[str, ...] = ("a", "b")) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.bfloat16)
    return KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(layer_names=list(owned), kv_cache_spec=spec)],
    )


def test_a_one_block_pool_keeps_one_blocks_bytes_per_tensor():
    config = with_num_blocks(hand_config([tensor("a"), tensor("b")]), 1, KVCacheLayout.BLNHC)
    assert config.num_blocks == 1
    assert [t.size for t in config.kv_cache_tensors] == [BLOCK_BYTES, BLOCK_BYTES]


def test_bad_pool_sizes_name_the_count_and_the_layout():
    config = hand_config([tensor("a")])
    with pytest.raises(ValueError) as zero:
        with_num_blocks(config, 0, KVCacheLayout.BLNHC)
    assert str(zero.value) == "num_blocks must be positive, got 0"
    with pytest.raises(ValueError) as per_layer:
        with_num_blocks(config, 2, KVCacheLayout.LBNHC)
    assert str(per_layer.value) == "num_blocks: LBNHC places blocks per layer"


def test_every_unowned_tensors_layers_are_kept_in_order():
    config = hand_config([tensor("a"), tensor("x"), tensor("b"), tensor("y", "z")])
    kept, unowned = without_unowned_tensors(config)
    assert unowned == ("x", "y", "z")
    assert [t.layers for t in kept.kv_cache_tensors] == [["a"], ["b"]]
    # CONTROL: a config with every layer owned comes back as it is.
    whole = hand_config([tensor("a"), tensor("b")])
    assert without_unowned_tensors(whole) == (whole, ())


@pytest.fixture(scope="module")
def small_plans():
    scenario = load_scenario(str(SMALL))
    workload = scenario_workload(scenario)
    return {layout: Simulation(scenario, layout, workload).plan for layout in ("on", "off")}


def test_the_views_record_the_layout_and_the_unowned_ple(small_plans):
    views = allocate_worker_views(small_plans["off"], 2, num_blocks=2)
    assert views.kv_cache_layout is KVCacheLayout.BLNHC and views.num_blocks == 2
    assert views.unowned_layers == (PLE,)
    assert allocate_worker_views(small_plans["off"], 0, num_blocks=2).unowned_layers == ()


def test_a_rank_past_the_last_is_refused_by_name(small_plans):
    for rank in (4, -1):
        with pytest.raises(ValueError) as refused:
            allocate_worker_views(small_plans["on"], rank, num_blocks=2)
        assert str(refused.value) == f"rank must be in [0, 4), got {rank}"
    # CONTROL: the last rank is one.
    assert allocate_worker_views(small_plans["on"], 3, num_blocks=2).num_blocks == 2


def test_the_pool_is_allocated_on_the_device_asked_for(small_plans):
    views = allocate_worker_views(small_plans["on"], 0, num_blocks=2, device=torch.device("meta"))
    assert {t.device.type for t in _tensors(views.views.values())} == {"meta"}
    # CONTROL: by default the CPU.
    views = allocate_worker_views(small_plans["on"], 0, num_blocks=2)
    assert {t.device.type for t in _tensors(views.views.values())} == {"cpu"}


def test_pool_block_b_is_the_bytes_from_b_strides_to_the_next():
    views = WorkerViews(
        config=hand_config([tensor("a")]),
        kv_cache_layout=KVCacheLayout.BLNHC,
        kv_caches={},
        views={},
        base=0,
        block_stride_bytes=BLOCK_BYTES,
    )
    assert views.block_bytes(0) == (0, 96) and views.block_bytes(2) == (192, 288)


def test_a_pool_without_attention_groups_zeroes_nothing(small_plans):
    """vLLM's zeroer skips every group whose spec is not an attention spec:
    fed the Mamba groups alone it has no table, and nothing of a block is
    cleared."""
    views = allocate_worker_views(small_plans["on"], 0, num_blocks=2)
    mamba = [g for g in views.config.kv_cache_groups if isinstance(first_layer_spec(g), MambaSpec)]
    assert mamba
    cleared = zeroed_segments(replace(views.config, kv_cache_groups=mamba), views.views)
    assert cleared.segments == () and cleared.ranges == () and cleared.bytes_per_block == 0
    assert cleared.block_stride_bytes == views.block_stride_bytes
    # CONTROL: with the attention groups, a table.
    assert zeroed_segments(views.config, views.views).num_segments > 0
