"""Twin of the fork's additions to ``vllm/v1/kv_cache_interface.py`` (patch
0088): the slot-packed ring as a spec type, the slot-packed tensor and the
config that knows about both.

Upstream 0.33.0 has no ``slots_per_block`` anywhere. kvsim carries it on
subclasses of vLLM's own classes, so everything that reads a config (the
planner's capacity code, ``KVCacheManager``, the worker's view binding) keeps
working unchanged, and the spec type picks the slot-packing ring manager
through vLLM's spec -> manager registry.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from sim.vllm_bridge import (
    CircularBufferSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    UniformTypeKVCacheSpecs,
)


@dataclass(frozen=True, kw_only=True)
class SlotPackedCircularBufferSpec(CircularBufferSpec):
    """A QSA raw-key ring whose per-request block is one of ``slots_per_block``
    equal slots of a shared pool block (fork: ``KVCacheGroupSpec.slots_per_block``).
    """

    slots_per_block: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.slots_per_block < 2:
            raise ValueError(
                f"slots_per_block must be at least 2, got {self.slots_per_block}"
            )


@dataclass
class SlotPackedKVCacheTensor(KVCacheTensor):
    """A tensor whose view has ``slots_per_block`` view blocks per pool block:
    ``block_stride`` is one slot, and view block ``pool_block * S + slot`` lies
    inside pool block ``pool_block`` (fork: ``KVCacheTensor.slots_per_block``).
    """

    slots_per_block: int = 1


@dataclass
class SideCacheKVCacheConfig(KVCacheConfig):
    """A ``KVCacheConfig`` with slot-packed ring groups."""

    @property
    def slot_packed_group_ids(self) -> tuple[int, ...]:
        """Groups whose blocks are slots of shared pool blocks: whole-block
        zeroing skips them (their bytes lie in pool blocks only the ring
        manager owns)."""
        return tuple(
            group_id
            for group_id, group in enumerate(self.kv_cache_groups)
            if group_slots_per_block(group) > 1
        )

    def num_blocks_of(self, tensor: KVCacheTensor) -> int:
        if isinstance(tensor, SlotPackedKVCacheTensor) and not tensor.host_resident:
            return self.num_blocks * tensor.slots_per_block
        return super().num_blocks_of(tensor)


def group_layer_specs(group: KVCacheGroupSpec) -> list[KVCacheSpec]:
    """The spec of every layer of ``group``, in ``layer_names`` order."""
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return [spec.kv_cache_specs[name] for name in group.layer_names]
    return [spec] * len(group.layer_names)


def first_layer_spec(group: KVCacheGroupSpec) -> KVCacheSpec:
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.first_spec
    return spec


def group_slots_per_block(group: KVCacheGroupSpec) -> int:
    """Ring slots per pool block of ``group``; 1 when it is not slot-packed.

    kvsim carries the count on the ring's spec; the fork, when installed,
    carries it on the group itself.
    """
    spec = first_layer_spec(group)
    if isinstance(spec, SlotPackedCircularBufferSpec):
        return spec.slots_per_block
    return int(getattr(group, "slots_per_block", 1))


def as_slot_packed(spec: KVCacheSpec, slots_per_block: int) -> KVCacheSpec:
    """``spec`` (a ring, or a uniform collection of rings) with ring slots."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return UniformTypeKVCacheSpecs(
            block_size=spec.block_size,
            kv_cache_specs={
                name: as_slot_packed(layer_spec, slots_per_block)
                for name, layer_spec in spec.kv_cache_specs.items()
            },
        )
    assert type(spec) is CircularBufferSpec, f"not a plain ring: {type(spec)}"
    values = {f.name: getattr(spec, f.name) for f in fields(spec) if f.init}
    return SlotPackedCircularBufferSpec(**values, slots_per_block=slots_per_block)
