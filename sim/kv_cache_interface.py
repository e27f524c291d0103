"""Helpers over vLLM's ``kv_cache_interface`` specs: a group's per-layer
specs, a spec converted to a kvsim subclass of its type, and kvsim's spec
types registered with their managers. No twin in vLLM
(0.33.0 reads them inline); the fork's spec types are in ``sim/fork/``
(``side_cache_rings.py``: 0088, ``retention.py``: 0086/0087/0093).
"""

from __future__ import annotations

from dataclasses import fields

from sim.vllm_bridge import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheSpecRegistry,
    UniformTypeKVCacheSpecs,
)


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


def register_managers(*registrations: tuple[type, type, type]) -> None:
    """Map kvsim's spec types to kvsim's managers in vLLM's registry, each
    as (spec type, manager class, vLLM base spec type).

    vLLM fills its built-in registrations lazily on first use, only while the
    registry is empty, so they must be in place before kvsim adds its own.
    """
    KVCacheSpecRegistry._ensure_registered()
    for spec_type, manager_class, base_spec_type in registrations:
        KVCacheSpecRegistry.register(spec_type, manager_class, uniform_type_base_spec=base_spec_type)
