"""The MTP draft's KV cache group and the Mamba prompt-tail key (the fork's
patches 0060 and 0063, ports of vLLM #55390 and #58368). Both are upstream
behaviour on kvsim's base, so they have no ``ForkPatches`` key; these tests
pin vLLM 0.33.0's own functions and kvsim's managers to the values the
fork's tests assert, each with a control that breaks the rule.

0060 (fork: ``test_kv_cache_utils.py``): with MTP, only the group holding
the draft's attention layer is the EAGLE group, on the hybrid path too, so
the block drop on a hit never reaches a Mamba group. The fork finds that
group by position (the last registered layer); 0.33.0 by the marker its
worker puts on every layer the drafter adds (``KVCacheSpec.is_draft``).

0063 (fork: ``test_mamba_eagle_resume_checkpoint.py``): the Mamba prompt
tail is keyed one hash unit lower whenever the EAGLE drop is on
(``MambaManager.drop_eagle_checkpoint_block``, set on every Mamba manager),
no longer only when the Mamba group itself is flagged.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from helpers.allocator import TINY_MODEL, tiny_plan
from helpers.fork import mamba_spec, partial_hit_split, prefill, unit_request

from sim.config import DeploymentConfig, load_model
from sim.fork.patches import ForkPatches
from sim.kv_cache_manager import KVCacheManager, build_kv_cache_manager
from sim.model_specs import build_worker_specs
from sim.vllm_bridge import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaManager,
    MambaSpec,
    engine_config,
    init_none_hash,
    planning,
    sha256,
)

DRAFT = "mtp.layers.0.self_attn.attn"
UNMARKED_WARNING = "could be identified as the draft model's"


def _qwen3_5_hybrid_specs(*, marked: bool) -> dict:
    """The fork's Qwen3.5-shaped hybrid: [GDN x3, full attention x1] twice,
    then the MTP drafter's full-attention layer, spec-identical to the
    target's; ``marked`` as 0.33.0's worker marks a layer the drafter adds."""
    attention = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    gdn = MambaSpec(block_size=16, shapes=((2048,),), dtypes=(torch.float32,), mamba_cache_mode="align")
    specs: dict = {}
    for index in range(8):
        name = f"model.layers.{index}." + ("self_attn.attn" if index % 4 == 3 else "linear_attn")
        specs[name] = attention if index % 4 == 3 else gdn
    specs[DRAFT] = replace(attention, is_draft=marked)
    return specs


def _engine(method: str = "mtp"):
    engine = engine_config(
        max_model_len=4096,
        max_num_seqs=8,
        num_speculative_tokens=3,
        pipeline_parallel_size=1,
        tensor_parallel_size=1,
        total_num_hidden_layers=8,
    )
    engine.speculative_config.method = method
    return engine


def _groups(caplog, *, marked: bool, method: str = "mtp") -> list[KVCacheGroupSpec]:
    with caplog.at_level(logging.WARNING):
        return planning.get_global_kv_cache_groups(_engine(method), [_qwen3_5_hybrid_specs(marked=marked)])


def _is_mamba(group: KVCacheGroupSpec) -> bool:
    return isinstance(group.kv_cache_spec, MambaSpec)


def test_the_mtp_drafts_group_alone_is_flagged_on_the_hybrid_path(caplog):
    """The fork's values: exactly one flagged group, the one holding the
    draft layer; no Mamba group flagged; no warning."""
    groups = _groups(caplog, marked=True)
    [flagged] = [g for g in groups if g.is_eagle_group]
    assert DRAFT in flagged.layer_names
    assert sum(_is_mamba(g) for g in groups) == 2
    assert not any(_is_mamba(g) and g.is_eagle_group for g in groups)
    assert UNMARKED_WARNING not in caplog.text


@pytest.mark.parametrize("method", ["eagle", "eagle3", "dspark"])
def test_other_drafters_with_unmarked_layers_flag_nothing_and_warn(caplog, method):
    groups = _groups(caplog, marked=False, method=method)
    assert not any(g.is_eagle_group for g in groups)
    assert UNMARKED_WARNING in caplog.text


def _manager(groups: list[KVCacheGroupSpec]) -> KVCacheManager:
    init_none_hash(sha256)
    config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    return KVCacheManager(
        config,
        max_model_len=4096,
        scheduler_block_size=16,
        hash_block_size=16,
        enable_caching=True,
        use_eagle=True,
    )


def test_without_the_draft_group_the_drop_sweeps_every_mamba_group(caplog):
    """CONTROL (the fork before 0060, and 0.33.0 given unmarked layers: the
    fork's position rule has no twin in 0.33.0, whose worker always marks
    the drafter's layers): no group is flagged, the MTP case warns, and the
    coordinator falls back to the drop on every group, Mamba included;
    with the draft group identified only the attention group drops."""
    unmarked = _groups(caplog, marked=False)
    assert not any(g.is_eagle_group for g in unmarked) and UNMARKED_WARNING in caplog.text
    marked = _groups(caplog, marked=True)
    attention = next(i for i, g in enumerate(marked) if DRAFT in g.layer_names)
    assert _manager(marked).coordinator.drop_eagle_group_ids == {attention}
    assert _manager(unmarked).coordinator.drop_eagle_group_ids == set(range(len(unmarked)))


def test_an_inexact_partition_is_refused_before_anything_is_flagged():
    """The fork's position rule stays off when the groups do not cover
    every layer exactly once (nothing flagged); 0.33.0 refuses such a
    grouping outright, so no flag can come of it."""
    specs = _qwen3_5_hybrid_specs(marked=True)
    engine = _engine()
    groups = planning.get_global_kv_cache_groups(engine, [specs])
    trimmed = [
        KVCacheGroupSpec([n for n in g.layer_names if n != "model.layers.0.linear_attn"], g.kv_cache_spec)
        for g in groups
    ]
    builder = SimpleNamespace(get_kv_cache_groups=lambda config, layer_specs: trimmed)
    with pytest.raises(AssertionError, match="miss layers"):
        planning.get_kv_cache_groups_from_builder(builder, engine, specs)
    # Control: the exact grouping passes the same check.
    builder = SimpleNamespace(get_kv_cache_groups=lambda config, layer_specs: groups)
    assert planning.get_kv_cache_groups_from_builder(builder, engine, specs) == groups


def test_kvsims_plan_drops_only_in_the_group_of_the_last_registered_layer():
    """kvsim's plan (the tiny Flash-Next: GDN, QSA rings, compressed keys,
    one MTP layer on the last stage) through kvsim's manager: of the groups
    that take part in hits (rings never do), the dropping one is exactly
    the group holding the last registered layer (0060's rule, derived here
    from the layer order), no Mamba group drops, and every Mamba manager
    keys its tail one unit lower (0063's precondition)."""
    plan = tiny_plan(True)
    _, workers = build_worker_specs(load_model(TINY_MODEL), DeploymentConfig(max_model_len=512))
    last_layer = next(reversed(workers[-1]))
    assert last_layer.startswith("mtp.")
    global_groups = planning.get_global_kv_cache_groups(plan.engine, workers)
    [holder] = [g for g in global_groups if last_layer in g.layer_names]
    flagged = [g for g in global_groups if g.is_eagle_group and g.kv_cache_spec.prefix_cacheable]
    assert flagged == [holder]
    # The scheduler's groups (side-cache layout, rank 0's layer names):
    # the one dropping group is the holder (a subset of its layers).
    manager = build_kv_cache_manager(plan, num_gpu_blocks=64)
    groups = manager.coordinator.kv_cache_config.kv_cache_groups
    cacheable = {i for i, g in enumerate(groups) if g.kv_cache_spec.prefix_cacheable}
    [dropping] = manager.coordinator.drop_eagle_group_ids & cacheable
    assert set(groups[dropping].layer_names) <= set(holder.layer_names)
    mambas = [m for m in manager.managers if isinstance(m, MambaManager)]
    assert mambas and not {m.kv_cache_group_id for m in mambas} & manager.coordinator.drop_eagle_group_ids
    assert all(m.drop_eagle_checkpoint_block for m in mambas)


# ---------------------------------------------------------------------------
# 0063: block 1,024, hash unit 64, the EAGLE drop on.

BLOCK, UNIT = 1024, 64
PREFIX = list(range(1, 20_001))


# vLLM 0.33.0's split with partial hits on (the unit is below the block): it
# stops at the prompt's tail key, under the drop.
_split = partial_hit_split(UNIT, block=BLOCK, max_num_scheduled_tokens=1 << 20)


def _sibling_hit(prompt_len: int, *, draft_group_identified: bool, before_0063: bool = False) -> int:
    """Prefill A (``prompt_len`` tokens of PREFIX) in the split's chunks on
    full attention + one Mamba group (kvsim's shipped Mamba manager), then
    the hit of a sibling sharing all of A's prompt and 500 tokens more.
    ``before_0063`` keys the Mamba tail as the fork did before the patch:
    lowered only if the Mamba group is itself flagged."""
    init_none_hash(sha256)
    attention = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    groups = [
        KVCacheGroupSpec(["full"], attention, is_eagle_group=draft_group_identified),
        KVCacheGroupSpec(["mamba"], mamba_spec(ForkPatches(), BLOCK)),
    ]
    config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    manager = KVCacheManager(
        replace(config, prefix_cache_retention_interval=0),
        max_model_len=1 << 20,
        scheduler_block_size=BLOCK,
        hash_block_size=UNIT,
        enable_caching=True,
        use_eagle=True,
    )
    mamba = manager.managers[1]
    if before_0063:
        mamba.drop_eagle_checkpoint_block = 1 in manager.coordinator.drop_eagle_group_ids
    prefill(manager, unit_request("A", PREFIX[:prompt_len], UNIT), split=_split, check=False)
    sibling = unit_request("S", PREFIX[:prompt_len] + [-1] * 500, UNIT)
    return manager.get_computed_blocks(sibling)[1]


@pytest.mark.parametrize("draft_group_identified", [False, True], ids=["all-flagged", "draft-group"])
def test_the_prompt_tail_hit_after_the_mtp_drop(draft_group_identified):
    """The fork's value: a 1,600-token prompt's sibling hits 1600 - 64 =
    1536, with or without the draft group identified."""
    assert _sibling_hit(1600, draft_group_identified=draft_group_identified) == 1600 - UNIT


@pytest.mark.parametrize("draft_group_identified", [False, True], ids=["all-flagged", "draft-group"])
def test_before_0063_a_draft_group_model_loses_the_tail(draft_group_identified):
    """CONTROL. At 1,600 0.33.0 leaves a proof token below the tail even
    without the drop ((1600 - 1) // 64 * 64 = 1536), so the old rule's
    miss shows one token later: a 1,601-token prompt. The split stops at
    1601 // 64 * 64 - 64 = 1536 either way; 0063 keys the state there
    (hit 1536); the old rule, with the Mamba group unflagged, keys 1600,
    which no chunk ends at, so nothing is keyed and the sibling hits 0.
    All groups flagged, the old rule lowered the key too: 1536."""
    assert _sibling_hit(1601, draft_group_identified=draft_group_identified) == 1536
    broken = _sibling_hit(1601, draft_group_identified=draft_group_identified, before_0063=True)
    assert broken == (0 if draft_group_identified else 1536)
