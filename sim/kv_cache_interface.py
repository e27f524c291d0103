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
    MambaSpec,
    UniformTypeKVCacheSpecs,
)


@dataclass(frozen=True, kw_only=True)
class RingSlotsSpec(CircularBufferSpec):
    """A QSA raw-key ring as kvsim's ring manager serves it: each request's
    ring block is one of ``slots_per_block`` equal slots of a shared pool
    block (fork: ``KVCacheGroupSpec.slots_per_block``); 1 is the old layout's
    whole block per request.

    Worker configs carry it only for packed rings (so the old layout's
    configs stay exactly vLLM's); the scheduler's view carries it for every
    ring, which selects kvsim's ring manager through vLLM's spec registry.
    """

    slots_per_block: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.slots_per_block < 1:
            raise ValueError(f"slots_per_block must be positive, got {self.slots_per_block}")


@dataclass(frozen=True)
class RetainedCheckpointMambaSpec(MambaSpec):
    """A Mamba group whose manager keeps each request's newest cached
    checkpoint state (the fork's ``VLLM_E2_MAMBA_RETAIN_CHECKPOINT``,
    patches 0086/0087). Scheduler-side only: the worker sees the same block
    tables either way.
    """


@dataclass(frozen=True)
class PartialTailHoldingMambaSpec(RetainedCheckpointMambaSpec):
    """A retaining Mamba group whose manager also holds a partial hit's
    copy-on-write endpoints (the fork's patch 0093, same switch as
    0086/0087). Scheduler-side only, like its base."""


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


def config_layer_specs(config: KVCacheConfig) -> dict[str, KVCacheSpec]:
    """Every layer's own spec, across all groups of ``config``."""
    return {
        name: spec
        for group in config.kv_cache_groups
        for name, spec in zip(group.layer_names, group_layer_specs(group), strict=True)
    }


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
    if isinstance(spec, RingSlotsSpec):
        return spec.slots_per_block
    return int(getattr(group, "slots_per_block", 1))


def convert_spec(spec: KVCacheSpec, spec_cls: type, **extra: object) -> KVCacheSpec:
    """``spec`` (or every layer of a uniform collection) as ``spec_cls``, a
    kvsim subclass of its type, with the same field values plus ``extra``."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return UniformTypeKVCacheSpecs(
            block_size=spec.block_size,
            kv_cache_specs={
                name: convert_spec(layer_spec, spec_cls, **extra)
                for name, layer_spec in spec.kv_cache_specs.items()
            },
        )
    vllm_base = next(c for c in spec_cls.__mro__ if c.__module__.startswith("vllm."))
    assert isinstance(spec, vllm_base), f"{type(spec)} is not a {vllm_base}"
    values = {f.name: getattr(spec, f.name) for f in fields(spec) if f.init}
    values.update(extra)
    return spec_cls(**values)


def as_slot_packed(spec: KVCacheSpec, slots_per_block: int) -> KVCacheSpec:
    """``spec`` (a ring, or a uniform collection of rings) with ring slots."""
    return convert_spec(spec, RingSlotsSpec, slots_per_block=slots_per_block)
