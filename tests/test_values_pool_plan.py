"""The pool replay's geometry (``sim.pool_replay.plan``) on hand-made
tensors: a cell's bytes, the words a word set gathers and what it expects
there, the row dim of a view, the checks that a cell is whole aligned words,
the chunks and the pool as words. Expected values by hand from the
docstrings' rules (a cell is ``offset + view block * stride0 + row *
stride1``; a fingerprint's tag is ``(group + 1) << 56 | (label + 1) << 48``).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sim.analysis.runs import scenario_workload
from sim.engine import Simulation
from sim.pool_replay import plan
from sim.pool_replay.fingerprints import ZERO_POSITION
from sim.pool_replay.plan import Layer, RowClass, _layer, _row_dim, build_groups, chunks, pool_words
from sim.pool_replay.views import allocate_worker_views
from sim.scenario import load_scenario

RA, RB = 1 << 24, 2 << 24


def row_class(group: int, *layers: tuple) -> RowClass:
    made = RowClass(
        group=group,
        kind="tokens",
        tokens_per_row=1,
        num_rows=2,
        layers=[Layer(*layer) for layer in layers],
        shadow=torch.zeros((4, 2), dtype=torch.int64),
    )
    made.build_word_sets()
    return made


def tag(group: int, label: int) -> int:
    return ((group + 1) << 56) | ((label + 1) << 48)


def test_a_cells_bytes_are_offset_plus_strides_and_its_words():
    layer = Layer("x", 0, offset_bytes=16, stride0_bytes=64, stride1_bytes=24, num_words=3)
    assert layer.byte_range(2, 1) == (16 + 128 + 24, 16 + 128 + 24 + 24)
    assert layer.byte_range(0, 0) == (16, 40)


def test_word_sets_group_a_classes_layers_by_cell_size_in_order():
    made = row_class(
        2,
        ("a", 0, 8, 64, 16, 1),
        ("b", 1, 24, 128, 32, 2),
        ("c", 5, 40, 64, 8, 1),
    )
    one, two = made.word_sets
    assert [la.name for la in one.layers] == ["a", "c"] and [la.name for la in two.layers] == ["b"]
    assert (one.num_words, two.num_words) == (1, 2)
    assert one.tags.tolist() == [tag(2, 0), tag(2, 5)] and two.tags.tolist() == [tag(2, 1)]
    assert one.offsets.tolist() == [1, 5] and two.offsets.tolist() == [3]
    assert one.strides0.tolist() == [8, 8] and two.strides0.tolist() == [16]
    assert one.strides1.tolist() == [2, 1] and two.strides1.tolist() == [4]
    assert one.tags.dtype == torch.int64 and one.tags.device == made.shadow.device


def test_a_word_sets_index_is_every_layers_words_of_every_cell():
    made = row_class(0, ("a", 0, 0, 64, 8, 2), ("b", 1, 16, 64, 16, 2))
    (words,) = made.word_sets
    index = words.word_index(torch.tensor([1, 3]), torch.tensor([0, 1]))
    assert index.tolist() == [
        [[8, 9], [25, 26]],  # a: block 1 row 0 at word 8; block 3 row 1 at 24 + 1
        [[10, 11], [28, 29]],  # b: 2 + 8; 2 + 24 + 2
    ]


def test_a_word_sets_expected_words_are_code_and_tag_or_zeros_for_a_zeroed_slot():
    made = row_class(1, ("a", 0, 0, 64, 8, 1), ("b", 3, 8, 64, 8, 1))
    (words,) = made.word_sets
    expected = words.words(torch.tensor([RA | 5, RB | ZERO_POSITION, RB | (ZERO_POSITION - 1)]))
    assert expected.tolist() == [
        [tag(1, 0) | RA | 5, 0, tag(1, 0) | RB | (ZERO_POSITION - 1)],
        [tag(1, 3) | RA | 5, 0, tag(1, 3) | RB | (ZERO_POSITION - 1)],
    ]


@pytest.mark.parametrize(
    ("shape", "rows", "dim"), [((4, 3, 2, 8), 2, 2), ((4, 2, 2, 8), 2, 1), ((4, 5, 3, 2, 8), 3, 2)]
)
def test_the_row_dim_is_the_first_inner_dim_of_that_size(shape, rows, dim):
    assert _row_dim(torch.zeros(shape), rows, "x") == dim


@pytest.mark.parametrize("shape", [(2, 3, 8), (4, 3, 2), (4, 2)])
def test_neither_the_block_dim_nor_the_innermost_is_a_row_dim(shape):
    with pytest.raises(ValueError) as caught:
        _row_dim(torch.zeros(shape), 2, "layer.x")
    assert str(caught.value) == f"layer.x: no dim of {shape} holds 2 rows"


BUFFER = torch.zeros(4096, dtype=torch.uint8)
BASE = BUFFER.data_ptr()


def cells(shape: tuple, strides: tuple, offset: int) -> torch.Tensor:
    return BUFFER.as_strided(shape, strides, offset)


@pytest.mark.parametrize(
    ("shape", "strides", "offset", "layer"),
    [
        ((4, 2, 8), (64, 8, 1), 16, (16, 64, 8, 1)),
        ((4, 2, 2, 8), (64, 16, 8, 1), 8, (8, 64, 16, 2)),
        # A dim of size 1 may have any stride: it moves no byte.
        ((4, 2, 1, 8), (64, 8, 999, 1), 0, (0, 64, 8, 1)),
        ((4, 1, 3, 8), (96, 8, 8, 1), 24, (24, 96, 8, 3)),
    ],
)
def test_a_layer_is_read_off_its_cells(shape, strides, offset, layer):
    assert _layer("x", 7, cells(shape, strides, offset), BASE) == Layer("x", 7, *layer)


@pytest.mark.parametrize(
    ("shape", "strides", "offset", "nbytes", "at"),
    [
        ((4, 2, 2, 8), (64, 32, 16, 1), 0, 16, 0),  # the two words of a cell are apart
        ((4, 2, 8, 2), (64, 16, 1, 8), 0, 16, 0),  # transposed inside the cell
        ((4, 2, 4), (64, 8, 1), 0, 4, 0),  # half a word
        ((4, 2, 8), (64, 8, 1), 4, 8, 4),  # a cell off a word boundary
        ((4, 2, 8), (60, 8, 1), 0, 8, 0),  # a block stride off a word
        ((4, 2, 8), (64, 12, 1), 0, 8, 0),  # a row stride off a word
    ],
)
def test_cells_that_are_not_whole_aligned_words_are_refused(shape, strides, offset, nbytes, at):
    with pytest.raises(ValueError) as caught:
        _layer("layer.x", 0, cells(shape, strides, offset), BASE)
    assert str(caught.value) == f"layer.x: cells of {nbytes} B at {at} are not whole aligned words"


def test_chunks_bound_the_words_one_gather_touches(monkeypatch):
    made = row_class(0, ("a", 0, 0, 64, 16, 2), ("b", 1, 8, 64, 16, 2))
    (words,) = made.word_sets  # 2 layers of 2 words: 4 words a cell
    monkeypatch.setattr(plan, "CHUNK_WORDS", 9)
    assert chunks(5, words) == [slice(0, 2), slice(2, 4), slice(4, 6)]
    assert chunks(4, words) == [slice(0, 2), slice(2, 4)]
    assert chunks(0, words) == []
    monkeypatch.setattr(plan, "CHUNK_WORDS", 3)  # less than one cell: one cell a chunk
    assert chunks(3, words) == [slice(0, 1), slice(1, 2), slice(2, 3)]


def test_the_pool_as_words_aliases_the_whole_backing_buffer():
    backing = torch.zeros(20, dtype=torch.uint8)
    views = SimpleNamespace(
        kv_caches={"x": backing[8:].view(3, 4), "y": backing[:4]}, base=backing.data_ptr()
    )
    words = pool_words(views)
    assert words.dtype == torch.int64 and words.shape == (2,)  # 20 bytes: two whole words
    words[1] = -1
    assert backing.tolist() == [0] * 8 + [255] * 8 + [0] * 4


# ---------------------------------------------------------------------------
# The groups of the small replay's real pool (tests/data/pool-replay.yaml,
# tests/data/tiny-flash-next.yaml), by hand from the model file: 32-token
# blocks; GDN and PLE layers are Mamba groups (one state page a block); the
# raw-key ring holds 8 tokens of 144 bf16 (288 B a row), 8 slots a pool
# block in the new layout; the attention group holds compressed keys (one
# row per 4 tokens: 8 rows of 128 bf16, 256 B) and attention KV (32 rows of
# 1 head at TP 2 x 256 fp8 x K and V, 512 B). The PLE group is empty on PP1.
# ---------------------------------------------------------------------------
SMALL = Path(__file__).parent / "data" / "pool-replay.yaml"
MAMBA, RING, ATTENTION = "mamba", "ring", "attention"


@pytest.fixture(params=[("on", 0), ("off", 2)], ids=["on-pp0", "off-pp1"])
def real(request):
    """Built afresh for each test (a third of a second): mutmut runs only the
    tests it saw reach ``build_groups``, and a module-wide fixture is built
    in the first one alone."""
    layout, rank = request.param
    scenario = load_scenario(str(SMALL))
    sim = Simulation(scenario, layout, scenario_workload(scenario))
    views = allocate_worker_views(sim.plan, rank, num_blocks=2)
    return layout, views, build_groups(views)


def test_the_groups_are_the_ranks_non_empty_groups_with_their_kinds(real):
    layout, views, groups = real
    shape = [(g.index, g.kind, g.block_size, g.slots_per_block) for g in groups]
    if layout == "on":  # PP0: three GDN groups (the PLE folded into one), the packed ring
        assert shape == [
            (0, MAMBA, 32, 1),
            (1, MAMBA, 32, 1),
            (2, MAMBA, 32, 1),
            (3, RING, 8, 8),
            (4, ATTENTION, 32, 1),
        ]
    else:  # PP1, old layout: group 3 (the PLE's) holds no layer here
        assert shape == [
            (0, MAMBA, 32, 1),
            (1, MAMBA, 32, 1),
            (2, MAMBA, 32, 1),
            (4, RING, 8, 1),
            (5, ATTENTION, 32, 1),
        ]


def test_each_kind_has_its_row_classes(real):
    layout, views, groups = real
    stride = views.block_stride_bytes
    for group in groups:
        classes = [(c.kind, c.tokens_per_row, c.num_rows, tuple(c.shadow.shape)) for c in group.classes]
        if group.kind == MAMBA:
            assert classes == [("state", 0, 1, (2, 1))]
        elif group.kind == RING:
            slots = group.slots_per_block
            assert classes == [("ring", 1, 8, (2 * slots, 8))]
            assert {(la.num_words, la.stride0_bytes, la.stride1_bytes) for la in group.classes[0].layers} == {
                (36, stride // slots, 288)
            }
        else:
            assert classes == [("tokens", 4, 8, (2, 8)), ("tokens", 1, 32, (2, 32))]
            keys, kv = group.classes
            assert {(la.num_words, la.stride0_bytes, la.stride1_bytes) for la in keys.layers} == {
                (32, stride, 256)
            }
            assert {(la.num_words, la.stride0_bytes, la.stride1_bytes) for la in kv.layers} == {
                (64, stride, 512)
            }
            assert all(la.name.endswith("compressed_key_cache") for la in keys.layers)
            assert all(la.name.endswith("self_attn.attn") for la in kv.layers)


def test_a_mamba_layers_cells_are_its_bound_state_pages(real):
    """Each state vLLM's ``bind_kv_cache`` gives a Mamba layer is one cell a
    block: its whole page, at its own offset; labels are the layer's place
    in the group times 4 plus the state's index (the fingerprint layout)."""
    _, views, groups = real
    for group in (g for g in groups if g.kind == MAMBA):
        names = views.config.kv_cache_groups[group.index].layer_names
        expected = []
        for position, name in enumerate(names):
            for index, state in enumerate(views.views[name]):
                page = state[0]  # block 0: its offset from the base
                expected.append(
                    (
                        name,
                        position * 4 + index,
                        page.data_ptr() - views.base,
                        state.stride(0) * state.element_size(),
                        page.numel() * page.element_size() // 8,
                    )
                )
        got = [
            (la.name, la.label, la.offset_bytes, la.stride0_bytes, la.num_words)
            for la in group.classes[0].layers
        ]
        assert got == expected
        assert {e[3] for e in expected} == {views.block_stride_bytes}
        assert max(e[1] for e in expected) >= 5  # a second layer's second state: labels 4 apart


def test_token_layers_are_labelled_by_their_place_in_the_group(real):
    _, views, groups = real
    for group in (g for g in groups if g.kind != MAMBA):
        names = views.config.kv_cache_groups[group.index].layer_names
        labels = {la.name: la.label for c in group.classes for la in c.layers}
        assert labels == {name: 4 * position for position, name in enumerate(names)}
