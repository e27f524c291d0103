"""The pool's geometry, from the bound views: groups, row classes, layers,
the words each cell spans. No twin in vLLM (its worker binds the views and
never maps them back).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from sim.fork.side_cache_rings import group_slots_per_block
from sim.kv_cache_interface import config_layer_specs, first_layer_spec
from sim.pool_replay.fingerprints import CHUNK_WORDS, MAX_LABEL, POSITION_MASK, ZERO_POSITION
from sim.pool_replay.views import WorkerViews
from sim.vllm_bridge import CircularBufferSpec, MambaSpec


@dataclass
class Layer:
    """One layer (one state of a Mamba layer) of a row class. Cell
    ``(view block, row)`` is the ``8 * num_words`` contiguous bytes from
    ``offset_bytes + view_block * stride0_bytes + row * stride1_bytes``
    (offsets from the pool base, read off the bound view)."""

    name: str
    label: int
    offset_bytes: int
    stride0_bytes: int
    stride1_bytes: int
    num_words: int

    def byte_range(self, view_block: int, row: int) -> tuple[int, int]:
        lo = self.offset_bytes + view_block * self.stride0_bytes + row * self.stride1_bytes
        return lo, lo + 8 * self.num_words


@dataclass
class WordSet:
    """The layers of a row class whose cells have one size, as index
    tensors: the replay touches all of them with one gather or scatter."""

    layers: list[Layer]
    tags: torch.Tensor  # [L] int64: the group and layer bits of each fingerprint
    offsets: torch.Tensor  # [L] words
    strides0: torch.Tensor  # [L] words
    strides1: torch.Tensor  # [L] words
    num_words: int

    def word_index(self, view_blocks: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """[L, n, num_words]: the pool words of every layer's cells."""
        starts = (
            self.offsets[:, None]
            + view_blocks[None, :] * self.strides0[:, None]
            + rows[None, :] * self.strides1[:, None]
        )
        return starts[:, :, None] + torch.arange(self.num_words, device=starts.device)

    def words(self, codes: torch.Tensor) -> torch.Tensor:
        """[L, n]: every layer's fingerprint of every cell."""
        words = codes[None, :] | self.tags[:, None]
        zeroed = (codes & POSITION_MASK) == ZERO_POSITION
        return torch.where(zeroed[None, :], torch.zeros_like(words), words)


@dataclass
class RowClass:
    """The layers of one group that share a row geometry, and the shadow of
    who wrote each of their cells."""

    group: int
    kind: str  # "tokens", "ring" or "state"
    tokens_per_row: int
    num_rows: int
    layers: list[Layer]
    shadow: torch.Tensor  # int64 [view blocks, rows]: the expected code
    word_sets: list[WordSet] = field(default_factory=list)

    def build_word_sets(self) -> None:
        device = self.shadow.device
        by_size: dict[int, list[Layer]] = defaultdict(list)
        for layer in self.layers:
            by_size[layer.num_words].append(layer)

        def column(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        self.word_sets = [
            WordSet(
                layers=layers,
                tags=column([((self.group + 1) << 56) | ((layer.label + 1) << 48) for layer in layers]),
                offsets=column([layer.offset_bytes // 8 for layer in layers]),
                strides0=column([layer.stride0_bytes // 8 for layer in layers]),
                strides1=column([layer.stride1_bytes // 8 for layer in layers]),
                num_words=num_words,
            )
            for num_words, layers in by_size.items()
        ]


@dataclass
class Group:
    index: int
    kind: str  # "attention", "ring" or "mamba"
    block_size: int  # tokens per block (the ring: its capacity)
    slots_per_block: int
    classes: list[RowClass]


# ---------------------------------------------------------------------------
# The pool's geometry, from the bound views.
# ---------------------------------------------------------------------------
def _row_dim(view: torch.Tensor, num_rows: int, name: str) -> int:
    """The dim of a paged view that indexes token rows (neither the block dim
    nor the innermost, contiguous one)."""
    dims = [d for d in range(1, view.dim() - 1) if view.shape[d] == num_rows]
    if not dims:
        raise ValueError(f"{name}: no dim of {tuple(view.shape)} holds {num_rows} rows")
    return dims[0]


def _layer(name: str, label: int, cells: torch.Tensor, base: int) -> Layer:
    """``cells``: a uint8 view ``[view blocks, rows, *cell bytes]``. The
    replay moves whole 8-byte words, so a cell must be contiguous and
    word-aligned (every page of the models kvsim knows is)."""
    shape, strides = cells.shape[2:], cells.stride()[2:]
    nbytes = math.prod(shape)
    contiguous = all(stride == math.prod(shape[i + 1 :]) for i, stride in enumerate(strides) if shape[i] > 1)
    offset = cells.data_ptr() - base
    if not contiguous or nbytes % 8 or offset % 8 or cells.stride(0) % 8 or cells.stride(1) % 8:
        raise ValueError(f"{name}: cells of {nbytes} B at {offset} are not whole aligned words")
    return Layer(
        name=name,
        label=label,
        offset_bytes=offset,
        stride0_bytes=cells.stride(0),
        stride1_bytes=cells.stride(1),
        num_words=nbytes // 8,
    )


def chunks(num_cells: int, word_set: WordSet) -> list[slice]:
    per_chunk = max(1, CHUNK_WORDS // (len(word_set.layers) * word_set.num_words))
    return [slice(lo, lo + per_chunk) for lo in range(0, num_cells, per_chunk)]


def pool_words(views: WorkerViews) -> torch.Tensor:
    """The whole backing buffer as int64 words: every cell is written and
    read through it, at the offsets the bound views give."""
    storage = next(iter(views.kv_caches.values())).untyped_storage()
    assert storage.data_ptr() == views.base
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device)
    flat.set_(storage, 0, (storage.nbytes(),), (1,))
    return flat[: storage.nbytes() // 8 * 8].view(torch.int64)


def build_groups(views: WorkerViews) -> list[Group]:
    """Every non-empty group of the rank, its layers split into row classes."""
    specs = config_layer_specs(views.config)
    groups = []
    for index, group in enumerate(views.config.kv_cache_groups):
        if not group.layer_names:
            continue  # a group projected empty on this rank
        first = first_layer_spec(group)
        kind = (
            "mamba"
            if isinstance(first, MambaSpec)
            else "ring"
            if isinstance(first, CircularBufferSpec)
            else "attention"
        )
        classes: dict[tuple[str, int], RowClass] = {}
        for position, name in enumerate(group.layer_names):
            spec, view = specs[name], views.views[name]
            states = view if isinstance(view, tuple) else (view,)
            for state_index, state in enumerate(states):
                label = position * 4 + state_index
                assert label <= MAX_LABEL, f"group {index} has too many layers to label"
                if isinstance(spec, MambaSpec):
                    key, rows, per_row = ("state", 0), 1, 0
                    cells = state.view(torch.uint8).unsqueeze(1)
                elif isinstance(spec, CircularBufferSpec):
                    key, rows, per_row = ("ring", 1), spec.block_size, 1
                    cells = state.view(torch.uint8).movedim(_row_dim(state, rows, name), 1)
                else:
                    per_row = int(spec.tokens_per_state) if spec.tokens_per_state > 0 else 1
                    key, rows = ("tokens", per_row), first.block_size // per_row
                    cells = state.view(torch.uint8).movedim(_row_dim(state, rows, name), 1)
                if key not in classes:
                    classes[key] = RowClass(
                        group=index,
                        kind=key[0],
                        tokens_per_row=per_row,
                        num_rows=rows,
                        layers=[],
                        shadow=torch.zeros((cells.shape[0], rows), dtype=torch.int64, device=cells.device),
                    )
                classes[key].layers.append(_layer(name, label, cells, views.base))
        for row_class in classes.values():
            row_class.build_word_sets()
        groups.append(
            Group(
                index=index,
                kind=kind,
                block_size=first.block_size,
                slots_per_block=group_slots_per_block(group),
                classes=list(classes.values()),
            )
        )
    return groups
