"""Twin of the worker side of the fork's side-cache layout (patch 0088,
``vllm/v1/worker/utils.py``): bind every layer's view of one rank's pool and
read the KV zeroer's segment table, on CPU tensors.

The views come from vLLM's own ``allocate_kv_cache``, which asks the config
``num_blocks_of(tensor)``; kvsim's ``SideCacheKVCacheConfig`` answers
``num_blocks * S`` for a slot-packed ring tensor, so view block
``pool_block * S + slot`` is slot ``slot`` of pool block ``pool_block``::

    pool block b:  | slot 0 | slot 1 | ... | slot S-1 |   (ring group's view)
                   |<-- stride / S -->|
                   | GDN / PLE / attention pages ...  |   (other groups alias)

The zeroer is vLLM's own ``KVBlockZeroer``, built but never launched (its
Triton kernel needs a GPU). Upstream 0.33.0 has no
``skip_kv_cache_group_ids``; the fork's skip is reproduced by not feeding it
the slot-packed groups' attention groups, which is exactly what the fork's
extra ``continue`` does. Deliberate differences from a real worker: the pool
may be shrunk to a few blocks (same placement per block), and tensors the
0.33.0 planner places for layers a rank does not own are dropped (see
``without_unowned_tensors``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import torch

from sim.kv_cache_interface import config_layer_specs, first_layer_spec
from sim.kv_cache_plan import KVCachePlan
from sim.vllm_bridge import (
    KVCacheConfig,
    KVCacheLayout,
    KVCacheSpec,
    MambaSpec,
    worker_api,
)

_worker = worker_api()
MambaBase = _worker.MambaBase
AttentionBackend = _worker.AttentionBackend
AttentionGroup = _worker.AttentionGroup
KVBlockZeroer = _worker.KVBlockZeroer
allocate_kv_cache = _worker.allocate_kv_cache

CPU = torch.device("cpu")

# What a layer holds after ``bind_kv_cache``: one view, or a Mamba layer's
# per-state views.
LayerView = torch.Tensor | tuple[torch.Tensor, ...]


@dataclass(frozen=True, kw_only=True)
class WorkerViews:
    """One rank's pool on the CPU, bound as its worker binds it.

    ``kv_caches`` is what ``allocate_kv_cache`` returns (the runner keeps it;
    a Mamba layer's entry is its raw ``[B, 1, 1, C]`` page view); ``views`` is
    what each layer holds after ``bind_kv_cache``. Every view aliases one
    backing buffer that starts at ``base``; pool block ``b`` is the bytes
    ``[base + b * block_stride_bytes, base + (b + 1) * block_stride_bytes)``.
    """

    config: KVCacheConfig
    kv_cache_layout: KVCacheLayout
    kv_caches: dict[str, torch.Tensor] = field(repr=False)
    views: dict[str, LayerView] = field(repr=False)
    base: int
    block_stride_bytes: int
    unowned_layers: tuple[str, ...] = ()  # placed by the planner, not on this rank

    @property
    def num_blocks(self) -> int:
        return self.config.num_blocks

    def block_bytes(self, block: int) -> tuple[int, int]:
        """Offsets from ``base`` of pool block ``block``."""
        return block * self.block_stride_bytes, (block + 1) * self.block_stride_bytes


def pool_block_bytes(config: KVCacheConfig) -> int:
    """Bytes of one pool block: the planner sizes the one backing buffer as
    ``bytes_per_block * num_blocks`` (in a block-outermost memory order, the stride
    between consecutive blocks)."""
    sizes = {tensor.size for tensor in config.kv_cache_tensors}
    assert len(sizes) == 1, f"tensors disagree on the backing size: {sizes}"
    size = sizes.pop()
    assert size % config.num_blocks == 0, (size, config.num_blocks)
    return size // config.num_blocks


def with_num_blocks(config: KVCacheConfig, num_blocks: int, kv_cache_layout: KVCacheLayout) -> KVCacheConfig:
    """``config`` with a pool of ``num_blocks`` blocks and the same placement.

    With a block-outermost ``kv_cache_layout`` (vLLM's memory order) every tensor's offset and strides are per
    block, so only ``num_blocks`` and the backing size depend on the block
    count (vLLM's ``get_kv_cache_config_from_groups``): a small pool gives the
    same view of each block the planner's pool does, without the boot memory
    check a plan that small would fail. The config keeps its class, so a
    slot-packed config stays one.
    """
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be positive, got {num_blocks}")
    if not kv_cache_layout.is_block_outermost:
        raise ValueError(f"num_blocks: {kv_cache_layout.name} places blocks per layer")
    stride = pool_block_bytes(config)
    tensors = [replace(t, size=stride * num_blocks) for t in config.kv_cache_tensors]
    return replace(config, num_blocks=num_blocks, kv_cache_tensors=tensors)


def without_unowned_tensors(
    config: KVCacheConfig,
) -> tuple[KVCacheConfig, tuple[str, ...]]:
    """``config`` without the tensors of layers none of its groups names, and
    those layers.

    vLLM 0.33.0's ``_project_kv_cache_groups_to_worker`` keeps a uniform
    group's whole spec when the worker has none of its layers, and
    ``get_kv_cache_config_from_groups`` places a tensor for every layer of
    that spec: on Flash-Next's PP1 the old layout gets a tensor for the PLE
    layer, which lives on PP0. Its ``allocate_kv_cache`` then finds no group
    for it and raises ``StopIteration``. The fork's configs hold exactly the
    rank's own layers (its test checks it), so the worker binds those.
    """
    owned = {name for group in config.kv_cache_groups for name in group.layer_names}
    tensors, unowned = [], []
    for tensor in config.kv_cache_tensors:
        mine = [name in owned for name in tensor.layers]
        assert all(mine) or not any(mine), f"tensor half on this rank: {tensor.layers}"
        if all(mine):
            tensors.append(tensor)
        else:
            unowned += tensor.layers
    if not unowned:
        return config, ()
    return replace(config, kv_cache_tensors=tensors), tuple(unowned)


def bind_layer_views(config: KVCacheConfig, kv_caches: Mapping[str, torch.Tensor]) -> dict[str, LayerView]:
    """What every layer holds after its ``bind_kv_cache``.

    A Mamba layer splits its page into per-state views (vLLM's own
    ``MambaBase.bind_kv_cache``, run on a stand-in whose state shapes and
    dtypes are the spec's, which is where the spec got them). Other layers
    keep the view (QSA caches transpose the two inner dims; that moves no
    byte of any page, so it is left out).
    """
    specs = config_layer_specs(config)
    views: dict[str, LayerView] = {}
    for name, cache in kv_caches.items():
        spec = specs[name]
        if isinstance(spec, MambaSpec):
            layer = SimpleNamespace(
                get_state_shape=lambda spec=spec: spec.shapes,
                get_state_dtype=lambda spec=spec: spec.dtypes,
            )
            MambaBase.bind_kv_cache(layer, cache)  # type: ignore[arg-type]
            views[name] = layer.kv_cache
        else:
            views[name] = cache
    return views


def allocate_worker_views(
    plan: KVCachePlan, rank: int, *, num_blocks: int | None = None, device: torch.device = CPU
) -> WorkerViews:
    """Allocate rank ``rank``'s pool of ``plan`` on ``device`` (the CPU by
    default) and bind its views, through vLLM's ``allocate_kv_cache``.

    ``num_blocks`` shrinks the pool (see ``with_num_blocks``); by default the
    plan's block count is used.
    """
    configs = plan.worker_configs
    if not 0 <= rank < len(configs):
        raise ValueError(f"rank must be in [0, {len(configs)}), got {rank}")
    kv_cache_layout = plan.engine.cache_config.get_resolved_kv_cache_layout()
    config, unowned = without_unowned_tensors(configs[rank])
    if num_blocks is not None:
        config = with_num_blocks(config, num_blocks, kv_cache_layout)
    kv_caches = allocate_kv_cache(config, device, kv_cache_layout, kernel_block_sizes(config))
    return WorkerViews(
        config=config,
        kv_cache_layout=kv_cache_layout,
        kv_caches=kv_caches,
        views=bind_layer_views(config, kv_caches),
        base=backing_base(kv_caches.values()),
        block_stride_bytes=pool_block_bytes(config),
        unowned_layers=unowned,
    )


def kernel_block_sizes(config: KVCacheConfig) -> list[int]:
    """The runner's kernel block size of every group: the group's own block
    size (a packed block-outermost pool cannot be split into kernel blocks;
    vLLM's ``create_kv_cache_views`` refuses it)."""
    return [first_layer_spec(group).block_size for group in config.kv_cache_groups]


def backing_base(views: Iterable[LayerView]) -> int:
    """Address of the one buffer every view aliases."""
    bases = {tensor.untyped_storage().data_ptr() for tensor in _tensors(views)}
    assert len(bases) == 1, f"views span {len(bases)} allocations"
    return bases.pop()


def _tensors(views: Iterable[LayerView]) -> list[torch.Tensor]:
    return [t for view in views for t in (view if isinstance(view, tuple) else (view,))]


def byte_range(view: LayerView | Sequence[torch.Tensor], index: int, base: int) -> tuple[int, int]:
    """``[lo, hi)``: offsets from ``base`` of the bytes view block ``index``
    spans (first to one past the last byte it addresses). A Mamba layer's
    states are packed in its page, so its range is their hull.

    >>> pages = torch.zeros(4, 3, dtype=torch.int16)  # 4 blocks of 6 bytes
    >>> byte_range(pages, 2, pages.data_ptr())
    (12, 18)
    >>> byte_range(pages[:, ::2], 1, pages.data_ptr())  # first and last word
    (6, 12)
    """
    if not isinstance(view, torch.Tensor):
        ranges = [byte_range(state, index, base) for state in view]
        return min(lo for lo, _ in ranges), max(hi for _, hi in ranges)
    page = view[index]
    lo = page.data_ptr() - base
    last = sum((size - 1) * stride for size, stride in zip(page.shape, page.stride(), strict=True))
    return lo, lo + (last + 1) * page.element_size()


@dataclass(frozen=True, kw_only=True)
class ZeroSegment:
    """One row of the zeroer's table: for block ``b`` it clears
    ``page_bytes`` from ``offset_bytes + b * block_stride_bytes`` (offsets
    from the backing base)."""

    offset_bytes: int
    block_stride_bytes: int
    page_bytes: int


@dataclass(frozen=True, kw_only=True)
class ZeroPlan:
    """What the worker's KV zeroer clears of every newly allocated block."""

    segments: tuple[ZeroSegment, ...]
    block_stride_bytes: int

    @property
    def num_segments(self) -> int:
        return len(self.segments)

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        """The cleared bytes of a block, relative to its start, as sorted
        disjoint ``[lo, hi)`` ranges (the same for every block).

        >>> seg = lambda lo, n: ZeroSegment(offset_bytes=lo, block_stride_bytes=64,
        ...                                 page_bytes=n)
        >>> ZeroPlan(segments=(seg(8, 8), seg(0, 12), seg(32, 4)),
        ...          block_stride_bytes=64).ranges
        ((0, 16), (32, 36))
        """
        merged: list[tuple[int, int]] = []
        for seg in sorted(self.segments, key=lambda s: s.offset_bytes):
            assert seg.block_stride_bytes == self.block_stride_bytes, seg
            lo, hi = seg.offset_bytes, seg.offset_bytes + seg.page_bytes
            assert 0 <= lo < self.block_stride_bytes, f"{seg} starts past block 0"
            if merged and lo <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            else:
                merged.append((lo, hi))
        return tuple(merged)

    @property
    def bytes_per_block(self) -> int:
        return sum(hi - lo for lo, hi in self.ranges)


def attention_groups(config: KVCacheConfig, skip_group_ids: Iterable[int] = ()) -> list[Any]:
    """The runner's attention groups: one per cache group and per-layer spec
    (the backend is not read by the zeroer, so the abstract base stands in).
    Groups in ``skip_group_ids`` are left out."""
    skip = set(skip_group_ids)
    groups: list[Any] = []
    specs = config_layer_specs(config)
    for group_id, group in enumerate(config.kv_cache_groups):
        if group_id in skip:
            continue
        by_spec: dict[KVCacheSpec, list[str]] = {}
        for name in group.layer_names:
            by_spec.setdefault(specs[name], []).append(name)
        groups += [
            AttentionGroup(AttentionBackend, names, spec, group_id)  # type: ignore[type-abstract]
            for spec, names in by_spec.items()
        ]
    return groups


def zeroed_segments(
    config: KVCacheConfig,
    views: Mapping[str, LayerView],
    *,
    skip_slot_packed: bool = True,
) -> ZeroPlan:
    """The segment table of vLLM's ``KVBlockZeroer`` for these views.

    With ``skip_slot_packed`` the slot-packed ring groups are not fed to it
    (the fork's ``skip_kv_cache_group_ids=config.slot_packed_group_ids``);
    without, every ring slot of a pool block becomes a segment of its own.
    """
    # kvsim's SideCacheKVCacheConfig and the fork's KVCacheConfig both have
    # slot_packed_group_ids; upstream's plain config has no packed group.
    skip: tuple[int, ...] = ()
    if skip_slot_packed:
        skip = tuple(getattr(config, "slot_packed_group_ids", ()))
    zeroer = KVBlockZeroer(
        CPU,
        attn_groups_iter=attention_groups(config, skip),
        kernel_block_sizes=kernel_block_sizes(config),
        static_forward_context={name: SimpleNamespace(kv_cache=view) for name, view in views.items()},
        num_blocks=config.num_blocks,
    )
    base = backing_base(views.values())
    stride = pool_block_bytes(config)
    if zeroer._meta is None:
        return ZeroPlan(segments=(), block_stride_bytes=stride)
    addrs, block_strides, page_sizes, *_ = zeroer._meta
    # The table counts int32 words: strides and pages are in 4-byte units.
    segments = tuple(
        ZeroSegment(offset_bytes=addr - base, block_stride_bytes=4 * s, page_bytes=4 * p)
        for addr, s, p in zip(addrs.tolist(), block_strides.tolist(), page_sizes.tolist(), strict=True)
    )
    return ZeroPlan(segments=segments, block_stride_bytes=stride)
