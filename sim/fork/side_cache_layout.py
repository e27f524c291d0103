"""Fork patch 0088: twin of the fork's side-cache layout pass (its additions to
``vllm/v1/core/kv_cache_utils.py``), written for vLLM 0.33.0's planner. The
slot-packed ring's spec, tensor, config and manager are ``side_cache_rings.py``.

The packed block-outermost pool strides every block by the widest group and
every group draws whole blocks from it. Two layout-only changes stop charging
Flash-Next's two tiny side caches a whole block per request:

1. PLE fold: each TP-replicated Mamba group joins a sharded Mamba group with
   the same scheduling parameters, chosen so that no worker's block widens
   (lowest valid index wins); the pool block count does not move.
2. Ring slot packing: each one-block-per-request ring group cuts every pool
   block into ``S`` equal 256-byte-aligned slots, ``S`` the largest value up to
   1024 that works on every worker; a ring then costs ``cdiv(max_num_seqs, S)``
   blocks for the whole pool instead of one per request.

The planner itself (grouping, block count, strides, capacity arithmetic) is
vLLM's; this module only transforms its groups and its per-worker configs.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from sim.fork.side_cache_rings import (
    SideCacheKVCacheConfig,
    SlotPackedKVCacheTensor,
    as_slot_packed,
    group_slots_per_block,
)
from sim.kv_cache_interface import config_layer_specs, group_layer_specs
from sim.vllm_bridge import (
    CircularBufferSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    KVCacheSpec,
    MambaSpec,
    UniformTypeKVCacheSpecs,
    cdiv,
    compute_layout_strides,
    kv_cache_utils,
    planning,
)

# Slot stride alignment for packed ring views (bytes), and the largest S tried.
RING_SLOT_ALIGN = 256
RING_MAX_SLOTS = 1024

WorkerSpecs = list[dict[str, KVCacheSpec]]


def side_cache_layout_blocker(engine: Any) -> str | None:
    """Why the side-cache layout cannot apply to this engine, or None.

    KV connectors address groups and blocks themselves, HiSparse has its own
    pool, decode context parallelism shards blocks, and slots need the
    block dimension outermost.
    """
    if engine.kv_transfer_config is not None:
        return "a KV connector is configured"
    if engine.attention_config.hisparse_config is not None:
        return "HiSparse is enabled"
    if engine.parallel_config.decode_context_parallel_size not in (1, None):
        return "decode context parallelism is enabled"
    kv_cache_layout = engine.cache_config.get_resolved_kv_cache_layout()
    if not kv_cache_layout.is_block_outermost:
        return f"the KV cache layout {kv_cache_layout.name} is layer-outermost"
    return None


def mamba_schedule_key(spec: MambaSpec) -> tuple:
    """What the scheduler's MambaManager reads from a spec: two Mamba groups
    with equal keys get identical block tables for every request."""
    return (
        spec.block_size,
        spec.page_size_bytes,
        spec.num_speculative_blocks,
        spec.num_prefill_checkpoint_blocks,
        spec.prefill_checkpoint_alignment,
        spec.mamba_cache_mode,
    )


def worker_strides(
    groups: list[KVCacheGroupSpec], worker_specs: WorkerSpecs, kv_cache_layout: KVCacheLayout
) -> list[int]:
    """Pool block bytes of every worker for this global grouping (0: no layers)."""
    strides = []
    for spec in worker_specs:
        projected = planning._project_kv_cache_groups_to_worker(groups, spec)
        if not any(group.layer_names for group in projected):
            strides.append(0)
            continue
        strides.append(planning._get_kv_cache_bytes_per_block(projected, kv_cache_layout))
    return strides


def _replicated_mamba_key(group: KVCacheGroupSpec) -> tuple | None:
    """The schedule key of a group made only of TP-replicated Mamba layers."""
    specs = group_layer_specs(group)
    if not specs or not all(isinstance(spec, MambaSpec) and spec.tp_replicated for spec in specs):
        return None
    keys = {mamba_schedule_key(spec) for spec in specs}  # type: ignore[arg-type]
    return keys.pop() if len(keys) == 1 else None


def _is_fold_target(group: KVCacheGroupSpec, key: tuple, eagle: bool) -> bool:
    specs = group_layer_specs(group)
    return (
        group.is_eagle_group == eagle
        and bool(specs)
        and all(
            isinstance(spec, MambaSpec) and not spec.tp_replicated and mamba_schedule_key(spec) == key
            for spec in specs
        )
    )


def merge_groups(target: KVCacheGroupSpec, source: KVCacheGroupSpec) -> KVCacheGroupSpec:
    """``source``'s layers appended to ``target``'s group (target's table).

    Built directly: vLLM's ``is_uniform_type`` rejects mixed ``tp_replicated``
    on purpose (the NIXL connector), and connectors never reach this path.
    """
    specs = dict(zip(target.layer_names, group_layer_specs(target), strict=True))
    specs.update(zip(source.layer_names, group_layer_specs(source), strict=True))
    return KVCacheGroupSpec(
        target.layer_names + source.layer_names,
        UniformTypeKVCacheSpecs(block_size=target.kv_cache_spec.block_size, kv_cache_specs=specs),
        is_eagle_group=target.is_eagle_group,
    )


def _without(groups: list[KVCacheGroupSpec], index: int, target: int, merged: KVCacheGroupSpec):
    return [merged if i == target else g for i, g in enumerate(groups) if i != index]


def fold_replicated_mamba_groups(
    groups: list[KVCacheGroupSpec], worker_specs: WorkerSpecs, kv_cache_layout: KVCacheLayout
) -> tuple[list[KVCacheGroupSpec], list[str]]:
    """Fold every TP-replicated Mamba group into a compatible sharded one.

    A target holds only sharded Mamba layers with the same schedule key and
    EAGLE flag, and the merged grouping must not widen any worker's block
    (checked on every worker's projection, so every PP stage is covered).
    Among valid targets the lowest index wins. Returns the new groups and one
    note per replicated group.
    """
    groups = list(groups)
    notes: list[str] = []
    base = worker_strides(groups, worker_specs, kv_cache_layout)
    index = 0
    while index < len(groups):
        source = groups[index]
        key = _replicated_mamba_key(source)
        if key is None:
            index += 1
            continue
        chosen = _first_fold_target(groups, index, key, worker_specs, kv_cache_layout, base)
        if chosen is None:
            notes.append(
                f"replicated Mamba group {index} ({len(source.layer_names)} layer(s)) "
                "kept separate: no sharded group has a spare page on every worker"
            )
            index += 1
            continue
        target, trial = chosen
        merged = trial[target if target < index else target - 1]
        notes.append(
            f"folded replicated Mamba group {index} ({', '.join(source.layer_names)}) "
            f"into Mamba group {target} (now {len(merged.layer_names)} layers); "
            f"per-worker block bytes unchanged {sorted(set(base))}"
        )
        groups = trial  # the group after the folded one now sits at `index`
    return groups, notes


def _first_fold_target(
    groups: list[KVCacheGroupSpec],
    index: int,
    key: tuple,
    worker_specs: WorkerSpecs,
    kv_cache_layout: KVCacheLayout,
    base: list[int],
) -> tuple[int, list[KVCacheGroupSpec]] | None:
    source = groups[index]
    for target, group in enumerate(groups):
        if target == index or not _is_fold_target(group, key, source.is_eagle_group):
            continue
        trial = _without(groups, index, target, merge_groups(group, source))
        strides = worker_strides(trial, worker_specs, kv_cache_layout)
        if all(new <= old for new, old in zip(strides, base, strict=True)):
            return target, trial
    return None


def is_ring_group(group: KVCacheGroupSpec) -> bool:
    specs = group_layer_specs(group)
    return bool(specs) and all(type(spec) is CircularBufferSpec for spec in specs)


def choose_ring_slots(
    worker_groups: list[list[KVCacheGroupSpec]], kv_cache_layout: KVCacheLayout
) -> dict[int, int]:
    """Slots per pool block for every ring group (group index -> S >= 2).

    S must cut every worker's block stride into equal slots that are
    ``RING_SLOT_ALIGN``-aligned and hold that worker's ring pages; the largest
    such S up to ``RING_MAX_SLOTS`` wins. Block ids are global, so S is the same
    on every worker; a ring group with no valid S keeps one block per request.

    >>> from math import gcd
    >>> # Flash-Next fp32: strides 11,468,800 / 12,902,400, rings 6 / 7 x 2,304 B
    >>> _largest_slots([(11_468_800, 6 * 2304), (12_902_400, 7 * 2304)])
    800
    """
    chosen: dict[int, int] = {}
    if not worker_groups or not worker_groups[0]:
        return chosen
    strides = [
        planning._get_kv_cache_bytes_per_block(groups, kv_cache_layout)
        if any(g.layer_names for g in groups)
        else 0
        for groups in worker_groups
    ]
    for index, group in enumerate(worker_groups[0]):
        if not is_ring_group(group):
            continue
        needs = [
            (stride, sum(s.page_size_bytes for s in group_layer_specs(groups[index])))
            for groups, stride in zip(worker_groups, strides, strict=True)
            if groups[index].layer_names
        ]
        slots = _largest_slots(needs)
        if slots is not None:
            chosen[index] = slots
    return chosen


def _largest_slots(needs: list[tuple[int, int]]) -> int | None:
    """Largest S in [2, RING_MAX_SLOTS] valid for every (stride, ring bytes)."""
    if not needs:
        return None
    for slots in range(RING_MAX_SLOTS, 1, -1):
        if all(
            stride % slots == 0 and (stride // slots) % RING_SLOT_ALIGN == 0 and stride // slots >= ring_bytes
            for stride, ring_bytes in needs
        ):
            return slots
    return None


def pack_ring_slots(
    config: KVCacheConfig, slots: dict[int, int], kv_cache_layout: KVCacheLayout
) -> SideCacheKVCacheConfig:
    """``config`` with the chosen ring groups slot-packed: their specs carry
    ``slots_per_block`` and their tensors view every pool block as S slots."""
    groups = [
        replace(group, kv_cache_spec=as_slot_packed(group.kv_cache_spec, slots[i])) if i in slots else group
        for i, group in enumerate(config.kv_cache_groups)
    ]
    slot_of_layer = {name: slots[i] for i in slots for name in config.kv_cache_groups[i].layer_names}
    bytes_per_block = planning._get_kv_cache_bytes_per_block(config.kv_cache_groups, kv_cache_layout)
    layer_specs = config_layer_specs(config)
    tensors = [
        _slot_tensor(
            tensor,
            slot_of_layer[tensor.layers[0]],
            layer_specs[tensor.layers[0]],
            config.num_blocks,
            bytes_per_block,
            kv_cache_layout,
        )
        if tensor.layers and tensor.layers[0] in slot_of_layer
        else tensor
        for tensor in config.kv_cache_tensors
    ]
    fields = {name: getattr(config, name) for name in config.__dataclass_fields__}
    fields.update(kv_cache_groups=groups, kv_cache_tensors=tensors)
    return SideCacheKVCacheConfig(**fields)


def _slot_tensor(
    tensor,
    slots: int,
    spec: KVCacheSpec,
    num_blocks: int,
    bytes_per_block: int,
    kv_cache_layout: KVCacheLayout,
) -> SlotPackedKVCacheTensor:
    """A ring tensor re-strided so view block ``b * S + s`` is slot ``s`` of
    pool block ``b``."""
    assert kv_cache_layout.is_block_outermost, "slot-packed groups need a block-outermost kv_cache_layout"
    assert bytes_per_block % slots == 0, (bytes_per_block, slots)
    slot_stride = bytes_per_block // slots
    ring_bytes = spec.page_size_bytes * len(tensor.layers)
    assert ring_bytes <= slot_stride, (
        f"slot-packed ring needs {ring_bytes} B per slot, slot is {slot_stride} B"
    )
    layer_stride, block_stride, _, _, _ = compute_layout_strides(
        spec,
        num_blocks * slots,
        len(tensor.layers),
        kv_cache_layout,
        fixed_strides=(None, slot_stride, None, None, None),
    )
    return SlotPackedKVCacheTensor(
        size=tensor.size,
        layers=list(tensor.layers),
        layer_stride=layer_stride,
        block_stride=block_stride,
        offset=tensor.offset,
        host_resident=tensor.host_resident,
        slots_per_block=slots,
    )


def shared_ring_blocks(engine: Any, config: KVCacheConfig) -> int:
    """Pool blocks the slot-packed rings of ``max_num_seqs`` requests occupy."""
    max_num_seqs = max(int(engine.scheduler_config.max_num_seqs), 1)
    return sum(
        cdiv(max_num_seqs, group_slots_per_block(group))
        for group in config.kv_cache_groups
        if group_slots_per_block(group) > 1 and not group.host_resident
    )


def get_kv_cache_capacity(engine: Any, config: KVCacheConfig) -> tuple[int, float]:
    """Token capacity and maximum concurrency, as the boot line reports them.

    Slot-packed ring groups cost ``cdiv(max_num_seqs, S)`` blocks for the whole
    pool instead of one block per request; the rest is vLLM's own arithmetic,
    run on the config without those groups.
    """
    packed = [i for i, g in enumerate(config.kv_cache_groups) if group_slots_per_block(g) > 1]
    if not packed:
        return kv_cache_utils.get_kv_cache_capacity(engine, config)
    view = replace(
        config,
        num_blocks=max(config.num_blocks - shared_ring_blocks(engine, config), 0),
        kv_cache_groups=[g for i, g in enumerate(config.kv_cache_groups) if i not in packed],
    )
    return kv_cache_utils.get_kv_cache_capacity(engine, view)


def blocks_per_max_length_request(engine: Any, config: KVCacheConfig) -> int:
    """Blocks one ``max_model_len`` request holds, as the boot's capacity line
    counts them (shared ring pages excluded)."""
    return sum(
        cdiv(group.kv_cache_spec.max_memory_usage_bytes(engine), group.kv_cache_spec.page_size_bytes)
        for group in config.kv_cache_groups
        if group_slots_per_block(group) == 1 and not group.host_resident
    )
