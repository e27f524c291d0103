"""The pool each layout gives (issue: foundation), against the fork's logged
figures. Each case runs the code path users run (``plan_kv_cache``, and the
``kvsim pool-plan --json`` command for the table)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from sim.cli import main
from sim.fork import side_cache_layout as side
from sim.fork.side_cache_rings import RingSlotsSpec, SlotPackedKVCacheTensor, group_slots_per_block
from sim.kv_cache_plan import plan_kv_cache
from sim.model_specs import build_worker_specs
from sim.vllm_bridge import CircularBufferSpec, KVCacheGroupSpec, kv_cache_utils, planning

# SSM dtype -> block, block bytes PP0/PP1, blocks, per-request off/on, tokens off/on
POOL_FIGURES = {
    "fp32": (3200, (11_468_800, 12_902_400), 317, (103, 97), (806_792, 853_994)),
    "fp16": (1664, (5_963_776, 6_709_248), 611, (179, 173), (894_804, 924_322)),
}
PLE = "language_model.model.layers.2.ple"


def _pool_plan_json(capsys, *flags: str) -> dict:
    assert main(["pool-plan", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("ssm", sorted(POOL_FIGURES))
def test_pool_plan_command_reports_the_forks_figures(capsys, ssm):
    block, strides, blocks, per_request, tokens = POOL_FIGURES[ssm]
    report = _pool_plan_json(capsys, "--ssm-dtype", ssm)
    for name, index in (("off", 0), ("on", 1)):
        figures = report[name]
        assert figures["block_size"] == block
        # The pool itself does not move: same block count and strides.
        assert tuple(figures["block_bytes_per_stage"]) == strides
        assert figures["num_blocks"] == blocks
        assert figures["blocks_per_request"] == per_request[index]
        assert figures["kv_cache_tokens"] == tokens[index]
    # 5 PLE blocks (2 + K) and the ring block no longer count per request.
    assert report["off"]["blocks_per_request"] - report["on"]["blocks_per_request"] == 6
    assert report["off"]["ring_slots_per_block"] == 1


def test_pool_plan_prints_the_boot_lines(capsys):
    assert main(["pool-plan"]) == 0
    out = capsys.readouterr().out
    assert "GPU KV cache size: 806,792 tokens" in out
    assert "GPU KV cache size: 853,994 tokens" in out
    assert "packs 800 requests per pool block" in out


@pytest.mark.parametrize("on", [False, True], ids=["off", "on"])
def test_every_rank_and_the_scheduler_agree(flash_next, reference, on):
    plan = plan_kv_cache(flash_next, reference, side_cache_layout=on)
    capacities = {side.get_kv_cache_capacity(plan.engine, c)[0] for c in plan.worker_configs}
    assert capacities == {plan.kv_cache_tokens}
    assert {c.num_blocks for c in plan.worker_configs} == {plan.num_blocks}
    scheduler = plan.scheduler_config()
    assert side.get_kv_cache_capacity(plan.engine, scheduler)[0] == plan.kv_cache_tokens


def test_old_layout_is_vllms_own_planner(flash_next, reference):
    """Switch 0 must be upstream, block for block: compare with a direct call."""
    plan = plan_kv_cache(flash_next, reference, side_cache_layout=False)
    _, workers = build_worker_specs(flash_next, reference)
    groups = planning.get_global_kv_cache_groups(plan.engine, workers)
    direct = planning.get_kv_cache_configs(
        plan.engine, workers, [reference.kv_cache_memory_bytes] * 4, groups
    )
    assert plan.worker_configs == direct
    assert plan.kv_cache_tokens == kv_cache_utils.get_kv_cache_capacity(plan.engine, direct[0])[0]


def test_ring_packs_800_requests_per_block_and_slots_stay_inside(flash_next, reference):
    plan = plan_kv_cache(flash_next, reference, side_cache_layout=True)
    assert plan.ring_slots_per_block == 800
    for rank, config in enumerate(plan.worker_configs):
        stride = plan.block_bytes_per_stage[rank // 2]
        rings = [t for t in config.kv_cache_tensors if isinstance(t, SlotPackedKVCacheTensor)]
        assert len(rings) == 1, f"rank {rank}"
        ring = rings[0]
        assert ring.slots_per_block == 800
        assert ring.block_stride * 800 == stride
        assert ring.block_stride % side.RING_SLOT_ALIGN == 0
        ring_bytes = len(ring.layers) * ring.layer_stride
        assert ring.block_stride >= ring_bytes
        assert config.num_blocks_of(ring) == config.num_blocks * 800
        # The last slot of the last pool block ends inside that block.
        last = config.num_blocks * 800 - 1
        end = ring.offset + last * ring.block_stride + ring_bytes
        assert (config.num_blocks - 1) * stride < end <= config.num_blocks * stride


def test_ple_rides_in_a_gdn_group_with_a_spare_page(flash_next, reference):
    on = plan_kv_cache(flash_next, reference, side_cache_layout=True)
    off = plan_kv_cache(flash_next, reference, side_cache_layout=False)
    for rank in (0, 2):
        [owner] = [g for g in on.worker_configs[rank].kv_cache_groups if PLE in g.layer_names] or [None]
        if rank == 2:
            assert owner is None  # PLE lives on PP0 only
            # and, unlike the old layout, no group projects empty on PP1
            assert all(g.layer_names for g in on.worker_configs[rank].kv_cache_groups)
            assert any(not g.layer_names for g in off.worker_configs[rank].kv_cache_groups)
            continue
        gdn = [n for n in owner.layer_names if n.endswith("linear_attn")]
        assert len(gdn) == 6 and owner.layer_names[-1] == PLE
    # CONTROL: the old layout keeps PLE in a group of its own.
    [alone] = [g for g in off.worker_configs[0].kv_cache_groups if PLE in g.layer_names]
    assert alone.layer_names == [PLE]
    assert [g.kind for g in on.groups].count("gdn+ple") == 1


def test_fold_never_widens_a_stage(flash_next, reference):
    """Folding PLE into GDN group 0 (7 pages on PP0) would widen PP0's block to
    8 pages; the pass picks a 6-page group. CONTROL: the forced group-0 fold
    really does widen PP0."""
    plan = plan_kv_cache(flash_next, reference, side_cache_layout=False)
    _, workers = build_worker_specs(flash_next, reference)
    kv_cache_layout = plan.engine.cache_config.get_resolved_kv_cache_layout()
    groups = planning.get_global_kv_cache_groups(plan.engine, workers)
    base = side.worker_strides(groups, workers, kv_cache_layout)
    folded, notes = side.fold_replicated_mamba_groups(groups, workers, kv_cache_layout)
    assert side.worker_strides(folded, workers, kv_cache_layout) == base
    assert len(folded) == len(groups) - 1 and "into Mamba group 1" in notes[0]

    ple_index = next(i for i, g in enumerate(groups) if PLE in g.layer_names)
    forced = side.merge_groups(groups[0], groups[ple_index])
    wrong = [forced] + [g for i, g in enumerate(groups) if i not in (0, ple_index)]
    widened = side.worker_strides(wrong, workers, kv_cache_layout)
    page = flash_next_attention_page(plan)
    assert widened[0] == base[0] + page == base[0] + 1_638_400  # 8 pages instead of 7


def flash_next_attention_page(plan) -> int:
    return plan.layer_specs.gdn.page_size_bytes


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"kv_connector": True}, "KV connector"),
        ({"decode_context_parallel_size": 2}, "decode context parallelism"),
    ],
)
def test_engines_the_layout_does_not_apply_to_keep_the_old_layout(flash_next, reference, change, reason):
    deployment = reference.model_copy(update=change)
    old = plan_kv_cache(flash_next, deployment, side_cache_layout=False)
    plan = plan_kv_cache(flash_next, deployment, side_cache_layout=True)
    assert not plan.applied
    assert plan.worker_configs == old.worker_configs
    assert plan.kv_cache_tokens == old.kv_cache_tokens
    assert plan.ring_slots_per_block == 1
    assert any(reason in note for note in plan.notes)


def test_layer_outermost_layout_keeps_the_old_layout(flash_next, reference):
    deployment = reference.model_copy(update={"kv_cache_layout": "LBNHC"})
    plan = plan_kv_cache(flash_next, deployment, side_cache_layout=True)
    assert not plan.applied and plan.ring_slots_per_block == 1
    assert any("layer-outermost" in note for note in plan.notes)


# Hand-derived from the seed's fp32 figures: block 3,200 tokens, widest
# stride 12,902,400 B, per request 82 attention blocks (cdiv(262,144, 3,200))
# + 4 Mamba groups x (2 + K = 5) + 1 ring = 103 old, 82 + 3 x 5 = 97 new; the
# new layout's ring costs cdiv(max_num_seqs, 800) shared blocks; tokens =
# int((blocks - shared) / per_request x max_model_len).
#   more memory: 8.2e9 // 12,902,400 = 635 blocks: 635/103 and 634/97 x 262,144
#   shorter max len: cdiv(131,072, 3,200) = 41: 62 old, 56 new per request
#   more sequences: cdiv(1000, 800) = 2 shared ring blocks: 315/97 x 262,144
FLAG_CASES = {
    "more-memory": ({"kv_cache_memory_bytes": 8_200_000_000}, 635, (103, 97), (1_616_130, 1_713_394)),
    "shorter-max-len": ({"max_model_len": 131_072}, 317, (62, 56), (670_158, 739_620)),
    "more-seqs": ({"max_num_seqs": 1000}, 317, (103, 97), (806_792, 851_292)),
}


@pytest.mark.parametrize("on", [False, True], ids=["off", "on"])
@pytest.mark.parametrize("case", sorted(FLAG_CASES))
def test_flags_change_the_figures_as_arithmetic_says(flash_next, reference, on, case):
    change, num_blocks, per_request, tokens = FLAG_CASES[case]
    plan = plan_kv_cache(flash_next, reference.model_copy(update=change), side_cache_layout=on)
    assert plan.num_blocks == num_blocks
    assert plan.blocks_per_request == per_request[on]
    assert plan.kv_cache_tokens == tokens[on]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--layer-partition", "20,20"], "covers 40 layers"),
        (["--kv-cache-memory", "1e8"], "KV cache is needed"),
        (["--pp", "3"], "--layer-partition"),
        (["--pp", "2", "--layer-partition", "25,23,0"], "layer_partition"),
    ],
)
def test_bad_deployment_is_a_one_line_error(capsys, flags, message):
    assert main(["pool-plan", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvsim: error:") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_unknown_model_key_names_key_and_file(capsys, tmp_path, flash_next):
    data = flash_next.model_dump(mode="json")
    data["gdn"]["num_kv_heads"] = 4  # misspelt
    path = tmp_path / "model.yaml"
    import yaml

    path.write_text(yaml.safe_dump(data))
    assert main(["pool-plan", "--model", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: unknown key 'gdn.num_kv_heads'" in err and err.count("\n") == 1


def test_an_installed_fork_plans_with_its_own_switch(flash_next, reference, monkeypatch):
    """When the fork is installed kvsim calls its planner with the switch set
    per layout (a stand-in fork here: upstream's planner plus kvsim's pass),
    reports the source, and leaves the environment as it was."""
    import os
    from types import SimpleNamespace

    import sim.kv_cache_plan as layout_module

    seen: list[str | None] = []

    def fork_configs(engine, workers, memory):
        seen.append(os.environ.get("VLLM_E2_SIDE_CACHE_LAYOUT"))
        return layout_module._plan_upstream(engine, workers, memory, seen[-1] == "1")[0]

    stand_in = SimpleNamespace(
        get_kv_cache_configs=fork_configs, get_kv_cache_capacity=side.get_kv_cache_capacity
    )
    monkeypatch.setattr(layout_module, "fork_planning_module", lambda: stand_in)
    monkeypatch.delenv("VLLM_E2_SIDE_CACHE_LAYOUT", raising=False)
    on = plan_kv_cache(flash_next, reference, side_cache_layout=True)
    off = plan_kv_cache(flash_next, reference, side_cache_layout=False)
    assert seen == ["1", "0"]
    assert (on.source, off.source) == ("fork", "fork")
    assert (on.kv_cache_tokens, off.kv_cache_tokens) == (853_994, 806_792)
    assert on.applied and not off.applied
    assert "VLLM_E2_SIDE_CACHE_LAYOUT" not in os.environ


def _ring(slots_per_block: int = 1, spec_type: type = RingSlotsSpec) -> Any:
    extra = {"slots_per_block": slots_per_block} if spec_type is RingSlotsSpec else {}
    return spec_type(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16, **extra)


def test_a_ring_of_fewer_than_one_slot_per_block_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"^slots_per_block must be positive, got 0$"):
        _ring(0)
    assert _ring(1).slots_per_block == 1  # CONTROL: one slot is the old layout's whole block


def test_a_groups_slot_count_is_its_ring_specs_or_else_the_forks_own_field_on_the_group():
    """kvsim carries the count on the ring's spec; a plan by the installed
    fork (``plan_kv_cache``'s "fork" source) carries it on the group
    (``KVCacheGroupSpec.slots_per_block``) over vLLM's plain ring spec; a
    group with neither is one block per request."""
    packed = KVCacheGroupSpec(["ring"], _ring(4))
    forks = KVCacheGroupSpec(["ring"], _ring(spec_type=CircularBufferSpec))
    forks.slots_per_block = 6  # type: ignore[attr-defined]
    plain = KVCacheGroupSpec(["ring"], _ring(spec_type=CircularBufferSpec))
    assert [group_slots_per_block(g) for g in (packed, forks, plain)] == [4, 6, 1]
