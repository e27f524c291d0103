"""The pool replay's checks (``sim.pool_replay.verify.PoolChecks``) on a
hand-laid 48-word pool, each check with a control that corrupts exactly the
word it guards and the exact message expected, derived by hand from the
fingerprint layout (``sim/pool_replay/fingerprints.py``'s header) and the
byte offsets below; the clean case passes. Milliseconds: the whole replay's
controls are tests/test_values_pool_replay.py.

The pool (byte offsets; a cell is ``offset + view block * stride0 + row *
stride1``, ``8 * words`` bytes; view blocks 0..3):

    group 0, attention, 2 token rows per block:
        layer "g0.a" label 0 at 0,   stride0 32, stride1 8,  1 word
        layer "g0.b" label 1 at 16,  stride0 32, stride1 8,  1 word
        layer "g0.c" label 2 at 128, stride0 32, stride1 16, 2 words
    group 1, mamba, one state row:
        layer "g1.s" label 0 at 256, stride0 16,             2 words
    group 2, ring, 2 rows:
        layer "g2.r" label 0 at 320, stride0 16, stride1 8,  1 word
"""

from __future__ import annotations

import re
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sim.pool_replay import plan
from sim.pool_replay.fingerprints import UNKNOWN, ZERO_POSITION, PoolCorruption
from sim.pool_replay.plan import Group, Layer, RowClass
from sim.pool_replay.report import ReplayStep
from sim.pool_replay.verify import Fence, PoolChecks

NAMES = {1: "ra", 2: "rb", 3: "rc"}
NUMBERS = {name: number for number, name in NAMES.items()}


class HandChecks(PoolChecks):
    """The checks over the hand-laid pool; the tables and the fence clock
    are plain fields the tests set."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.groups = [
            Group(
                0,
                "attention",
                2,
                1,
                [
                    row_class(
                        0,
                        "tokens",
                        2,
                        [("g0.a", 0, 0, 32, 8, 1), ("g0.b", 1, 16, 32, 8, 1), ("g0.c", 2, 128, 32, 16, 2)],
                    )
                ],
            ),
            Group(1, "mamba", 2, 1, [row_class(1, "state", 1, [("g1.s", 0, 256, 16, 0, 2)])]),
            Group(2, "ring", 2, 1, [row_class(2, "ring", 2, [("g2.r", 0, 320, 16, 8, 1)])]),
        ]
        self.scheduler = SimpleNamespace(
            config=SimpleNamespace(defer_block_free=True), last_sched_seq={}, processed_step_seq=0
        )
        self.step = 5
        self.counts = defaultdict(int)
        self.words = torch.zeros(48, dtype=torch.int64)
        self.fences = []
        self.fenced = {}
        self.request_names = dict(NAMES)
        self.stride = 0
        self._last_hit = {}
        self.held: dict[tuple[int, str], list[int]] = {}
        self.tally = ReplayStep(step=5, time_s=0.0)

    def _held_blocks(self, group: int, request_id: str) -> list[int]:
        return self.held.get((group, request_id), [])

    def _tally(self) -> ReplayStep:
        return self.tally


def row_class(group: int, kind: str, num_rows: int, layers: list[tuple]) -> RowClass:
    made = RowClass(
        group=group,
        kind=kind,
        tokens_per_row=1,
        num_rows=num_rows,
        layers=[Layer(*layer) for layer in layers],
        shadow=torch.zeros((4, num_rows), dtype=torch.int64),
    )
    made.build_word_sets()
    return made


def word_indices(layer: Layer, view_block: int, row: int) -> list[int]:
    first = (layer.offset_bytes + view_block * layer.stride0_bytes + row * layer.stride1_bytes) // 8
    return list(range(first, first + layer.num_words))


def put(checks: HandChecks, group: int, view_block: int, row: int, request: str, position: int) -> None:
    """``request`` wrote ``position`` into the cell: the shadow and every
    layer's words, by hand (a zeroed ring slot's words are zeros)."""
    cls = checks.groups[group].classes[0]
    cls.shadow[view_block, row] = (NUMBERS[request] << 24) | position
    for layer in cls.layers:
        value = ((group + 1) << 56) | ((layer.label + 1) << 48) | (NUMBERS[request] << 24) | position
        for index in word_indices(layer, view_block, row):
            checks.words[index] = 0 if position == ZERO_POSITION else value


def layer_named(checks: HandChecks, name: str) -> Layer:
    return next(la for g in checks.groups for c in g.classes for la in c.layers if la.name == name)


def flip(checks: HandChecks, name: str, view_block: int, row: int, word: int = 0) -> None:
    checks.words[word_indices(layer_named(checks, name), view_block, row)[word]] ^= 1


@pytest.fixture
def checks() -> HandChecks:
    """ra wrote positions 0..3 into blocks 2, 1 of group 0 (its table) and
    its state into block 3 of group 1; rb position 0 into block 0; ra's
    ring slot 1 holds positions 2, 3."""
    made = HandChecks()
    for position, (block, row) in enumerate([(2, 0), (2, 1), (1, 0), (1, 1)]):
        put(made, 0, block, row, "ra", position)
    put(made, 0, 0, 0, "rb", 0)
    put(made, 1, 3, 0, "ra", 4)
    put(made, 2, 1, 0, "ra", 2)
    put(made, 2, 1, 1, "ra", 3)
    made.held = {(0, "ra"): [2, 1], (1, "ra"): [3], (2, "ra"): [1], (0, "rb"): [0]}
    return made


def all_cells(checks: HandChecks, group: int):
    cls = checks.groups[group].classes[0]
    blocks, rows = torch.nonzero(cls.shadow != UNKNOWN, as_tuple=True)
    return cls, blocks, rows, cls.shadow[blocks, rows]


def fails(work, message: str) -> None:
    with pytest.raises(PoolCorruption) as caught:
        work()
    assert str(caught.value) == message


# ------------------------------------------------------------------ _fail
def test_a_failure_names_step_request_group_layer_and_bytes(checks):
    fails(
        lambda: checks._fail("ra", 2, "what", (8, 16), "g2.r"),
        "step 5: request ra, group 2, layer g2.r, bytes [8, 16): what",
    )
    fails(lambda: checks._fail("rb", 0, "what", None), "step 5: request rb, group 0: what")
    fails(lambda: checks._fail("rb", 0, "what", (0, 8)), "step 5: request rb, group 0, bytes [0, 8): what")


def test_values_become_contiguous_int64_on_the_device(checks):
    made = checks._tensor(np.array([1, 2, 3, 4], dtype=np.int32)[::2])
    assert made.dtype == torch.int64 and made.is_contiguous() and made.tolist() == [1, 3]
    assert made.device == checks.device


# --------------------------------------------------------------- _verify
def test_clean_cells_pass_and_count_every_word_read(checks):
    cls, blocks, rows, codes = all_cells(checks, 0)
    checks._verify(cls, blocks, rows, codes, "now")
    # 5 cells: layers a and b 1 word each, layer c 2 words: 5 * 4 words.
    assert checks.tally.bytes_verified == 8 * 5 * 4


def test_unknown_cells_are_neither_checked_nor_counted(checks):
    cls = checks.groups[0].classes[0]
    flip(checks, "g0.a", 3, 0)  # block 3 nobody wrote
    blocks, rows = torch.tensor([3, 2]), torch.tensor([0, 0])
    checks._verify(cls, blocks, rows, cls.shadow[blocks, rows], "now")
    assert checks.tally.bytes_verified == 8 * 1 * 4


@pytest.mark.parametrize(
    ("name", "block", "row", "span", "label"),
    [
        ("g0.a", 1, 1, (40, 48), 0),
        ("g0.b", 2, 0, (80, 88), 1),
        ("g0.c", 1, 0, (160, 176), 2),  # the second word set
    ],
)
def test_a_flipped_word_is_named_with_its_layer_bytes_writer_and_both_values(
    checks, name, block, row, span, label
):
    flip(checks, name, block, row)
    position = {(2, 0): 0, (2, 1): 1, (1, 0): 2, (1, 1): 3}[block, row]
    cls, blocks, rows, codes = all_cells(checks, 0)
    fails(
        lambda: checks._verify(cls, blocks, rows, codes, "when checked"),
        f"step 5: request ra, group 0, layer {name}, bytes [{span[0]}, {span[1]}): "
        f"view block {block} row {row} when checked: expected its position {position}, "
        f"found request ra's fingerprint (group 0, layer label {label}, position {position ^ 1})",
    )


def test_the_found_word_shown_is_the_cells_first(checks):
    """Layer c's cell has two words: its first word, flipped, is shown (the
    second still holds the fingerprint)."""
    checks.words[word_indices(layer_named(checks, "g0.c"), 0, 0)[0]] = 0
    cls, blocks, rows, codes = all_cells(checks, 0)
    fails(
        lambda: checks._verify(cls, blocks, rows, codes, "x"),
        "step 5: request rb, group 0, layer g0.c, bytes [128, 144): view block 0 row 0 x: "
        "expected its position 0, found zeros",
    )


def test_the_second_word_of_a_cell_is_checked_too(checks):
    flip(checks, "g1.s", 3, 0, word=1)
    cls, blocks, rows, codes = all_cells(checks, 1)
    fails(
        lambda: checks._verify(cls, blocks, rows, codes, "x"),
        "step 5: request ra, group 1, layer g1.s, bytes [304, 320): view block 3 row 0 x: "
        "expected its position 4, found request ra's fingerprint (group 1, layer label 0, position 4)",
    )


def test_the_first_bad_cell_of_the_first_bad_layer_is_reported(checks):
    """Cells in the order given, layers in the word set's order."""
    flip(checks, "g0.b", 2, 0)
    flip(checks, "g0.a", 1, 0)
    cls = checks.groups[0].classes[0]
    blocks, rows = torch.tensor([2, 1]), torch.tensor([0, 0])
    fails(
        lambda: checks._verify(cls, blocks, rows, cls.shadow[blocks, rows], "x"),
        "step 5: request ra, group 0, layer g0.a, bytes [32, 40): view block 1 row 0 x: "
        "expected its position 2, found request ra's fingerprint (group 0, layer label 0, position 3)",
    )


def test_a_zeroed_ring_slot_expects_zeros_and_names_a_writer_over_it(checks):
    put(checks, 2, 2, 0, "rb", ZERO_POSITION)
    cls, blocks, rows, codes = all_cells(checks, 2)
    checks._verify(cls, blocks, rows, codes, "x")  # zeros where zeros are due
    put(checks, 2, 2, 0, "rc", 9)  # rc's bytes, but the shadow still says rb's zeros
    checks.groups[2].classes[0].shadow[2, 0] = (NUMBERS["rb"] << 24) | ZERO_POSITION
    fails(
        lambda: checks._verify(cls, blocks, rows, codes, "x"),
        "step 5: request rb, group 2, layer g2.r, bytes [352, 360): view block 2 row 0 x: "
        "expected zeros (its new ring slot), "
        "found request rc's fingerprint (group 2, layer label 0, position 9)",
    )


def test_expected_positions_are_checked_before_the_bytes(checks):
    """The shadow says block 1 holds positions 2, 3: read as positions 0, 1
    (another block's place in the table), the first cell is named."""
    cls = checks.groups[0].classes[0]
    blocks, rows = torch.tensor([2, 2, 1, 1]), torch.tensor([0, 1, 0, 1])
    codes = cls.shadow[blocks, rows]
    checks._verify(cls, blocks, rows, codes, "x", torch.tensor([0, 1, 2, 3]))
    flip(checks, "g0.a", 1, 0)  # the bytes are wrong too: the position is reported first
    fails(
        lambda: checks._verify(cls, blocks, rows, codes, "on a hit", torch.tensor([0, 1, 0, 1])),
        "step 5: request ra, group 0, layer g0.a, bytes [32, 40): view block 1 row 0 on a hit: "
        "was written at its position 2, not the position read",
    )


def test_expected_positions_skip_the_unknown_cells_with_them(checks):
    cls = checks.groups[0].classes[0]
    blocks, rows = torch.tensor([3, 1]), torch.tensor([0, 1])  # block 3: unknown
    checks._verify(cls, blocks, rows, cls.shadow[blocks, rows], "x", torch.tensor([7, 3]))


def test_chunks_each_check_their_own_cells(checks, monkeypatch):
    """With one cell per chunk the bad cell sits in the third chunk: it is
    still found, and named by its own index in that chunk."""
    monkeypatch.setattr(plan, "CHUNK_WORDS", 1)
    cls, blocks, rows, codes = all_cells(checks, 0)  # block 0 row 0, block 1 rows 0, 1, block 2 ...
    assert blocks.tolist()[:3] == [0, 1, 1]
    checks._verify(cls, blocks, rows, codes, "x", None)
    flip(checks, "g0.b", 1, 1)
    positions = torch.tensor([0, 2, 3, 0, 1])
    fails(
        lambda: checks._verify(cls, blocks, rows, codes, "x", positions),
        "step 5: request ra, group 0, layer g0.b, bytes [56, 64): view block 1 row 1 x: "
        "expected its position 3, found request ra's fingerprint (group 0, layer label 1, position 2)",
    )
    fails(
        lambda: checks._verify(cls, blocks, rows, codes, "x", torch.tensor([0, 2, 9, 0, 1])),
        "step 5: request ra, group 0, layer g0.a, bytes [40, 48): view block 1 row 1 x: "
        "was written at its position 3, not the position read",
    )


# ----------------------------------------------------- _cells_of_blocks
def test_the_cells_of_blocks_are_every_row_of_each_block_in_order(checks):
    cls = checks.groups[0].classes[0]
    blocks, rows, codes = checks._cells_of_blocks(cls, [2, 0])
    assert blocks.tolist() == [2, 2, 0, 0] and rows.tolist() == [0, 1, 0, 1]
    assert codes.tolist() == [1 << 24, (1 << 24) | 1, 2 << 24, UNKNOWN]


# -------------------------------------------------------------- _on_free
def test_a_free_checks_every_page_the_request_holds(checks):
    checks._on_free(SimpleNamespace(request_id="ra"))
    assert checks.counts["frees_verified"] == 1 and not checks.fences and not checks.fenced
    # Group 0 blocks 1, 2 (4 cells of 4 words), group 1 block 3 (2 words),
    # ring block 1 (2 cells of 1 word).
    assert checks.tally.bytes_verified == 8 * (16 + 2 + 2)


@pytest.mark.parametrize(
    ("name", "block", "row", "message"),
    [
        (
            "g0.b",
            1,
            0,
            "group 0, layer g0.b, bytes [48, 56): view block 1 row 0 when ra is freed: "
            "expected its position 2, found request ra's fingerprint (group 0, layer label 1, position 3)",
        ),
        (
            "g1.s",
            3,
            0,
            "group 1, layer g1.s, bytes [304, 320): view block 3 row 0 when ra is freed: "
            "expected its position 4, found request ra's fingerprint (group 1, layer label 0, position 5)",
        ),
        (
            "g2.r",
            1,
            1,
            "group 2, layer g2.r, bytes [344, 352): view block 1 row 1 when ra is freed: "
            "expected its position 3, found request ra's fingerprint (group 2, layer label 0, position 2)",
        ),
    ],
)
def test_a_free_names_the_flipped_page_in_each_group(checks, name, block, row, message):
    flip(checks, name, block, row)
    fails(lambda: checks._on_free(SimpleNamespace(request_id="ra")), f"step 5: request ra, {message}")


def test_a_free_checks_only_the_freed_requests_pages(checks):
    flip(checks, "g0.a", 0, 0)  # rb's page
    checks._on_free(SimpleNamespace(request_id="ra"))
    fails(
        lambda: checks._on_free(SimpleNamespace(request_id="rb")),
        "step 5: request rb, group 0, layer g0.a, bytes [0, 8): view block 0 row 0 when rb is freed: "
        "expected its position 0, found request rb's fingerprint (group 0, layer label 0, position 1)",
    )


@pytest.mark.parametrize(("defer", "last", "fenced"), [(True, 3, True), (True, 2, False), (False, 3, False)])
def test_a_free_is_fenced_only_with_fencing_on_and_a_step_in_flight(checks, defer, last, fenced):
    checks.scheduler.config.defer_block_free = defer
    checks.scheduler.processed_step_seq = 2
    checks.scheduler.last_sched_seq["ra"] = last
    checks.held[0, "ra"] = [2, 1, 2]  # a block listed twice is one key
    checks._on_free(SimpleNamespace(request_id="ra"))
    if not fenced:
        assert checks.fences == [] and checks.fenced == {}
        return
    (fence,) = checks.fences
    assert (fence.seq, fence.request_id, fence.step) == (3, "ra", 5)
    assert fence.keys == {(0, 1), (0, 2), (1, 3), (2, 1)}
    assert checks.fenced == dict.fromkeys(fence.keys, fence)
    # One entry per row class of a group with held blocks: the cells held then.
    assert [(c.group, b.tolist(), r.tolist()) for c, b, r, _ in fence.cells] == [
        (0, [1, 1, 2, 2], [0, 1, 0, 1]),
        (1, [3], [0]),
        (2, [1, 1], [0, 1]),
    ]
    assert fence.cells[0][3].tolist() == [(1 << 24) | 2, (1 << 24) | 3, 1 << 24, (1 << 24) | 1]


def test_a_request_never_scheduled_is_not_fenced(checks):
    checks._on_free(SimpleNamespace(request_id="ra"))  # no last_sched_seq, processed 0
    assert checks.fences == []


def test_a_request_holding_nothing_is_counted_and_not_fenced(checks):
    checks.scheduler.last_sched_seq["rc"] = 9
    checks._on_free(SimpleNamespace(request_id="rc"))
    assert checks.counts["frees_verified"] == 1 and checks.tally.bytes_verified == 0
    assert [f.keys for f in checks.fences] == [set()] and checks.fenced == {}


# --------------------------------------------------------------- fences
def fence_of(checks: HandChecks, request: str, seq: int) -> Fence:
    checks.scheduler.last_sched_seq[request] = seq
    checks._on_free(SimpleNamespace(request_id=request))
    return checks.fences[-1]


def test_a_fence_passes_when_its_step_completes_and_not_before(checks):
    ra = fence_of(checks, "ra", 3)
    rb = fence_of(checks, "rb", 4)
    checks.scheduler.processed_step_seq = 2
    checks._pass_fences()
    assert checks.fences == [ra, rb] and checks.counts["fences_verified"] == 0
    checks.scheduler.processed_step_seq = 3
    checks._pass_fences()
    assert checks.fences == [rb] and checks.counts["fences_verified"] == 1
    assert set(checks.fenced) == {(0, 0)}
    checks._pass_fences(processed=4)  # an explicit clock (the end of the run)
    assert checks.fences == [] and checks.fenced == {} and checks.counts["fences_verified"] == 2


def test_a_fence_leaves_a_later_fence_of_the_same_block_in_place(checks):
    first = fence_of(checks, "ra", 3)
    checks.held = {(0, "rb"): [2]}
    second = fence_of(checks, "rb", 4)
    assert checks.fenced[0, 2] is second and checks.fenced[0, 1] is first
    checks._pass_fences(processed=3)
    assert checks.fenced == {(0, 2): second}


def test_a_page_changed_while_fenced_is_named_when_the_fence_passes(checks):
    fence_of(checks, "ra", 3)
    put(checks, 0, 1, 1, "rb", 7)  # rb writes ra's fenced page (its shadow moves on too)
    checks.step = 6
    fails(
        lambda: checks._pass_fences(processed=3),
        "step 6: request ra, group 0, layer g0.a, bytes [40, 48): view block 1 row 1 "
        "when the fence of ra (freed at step 5) passes: expected its position 3, "
        "found request rb's fingerprint (group 0, layer label 0, position 7)",
    )


# --------------------------------------------------------------- _on_hit
def block(block_id: int, is_null: bool = False) -> SimpleNamespace:
    return SimpleNamespace(block_id=block_id, is_null=is_null)


def hit(*groups: list[SimpleNamespace]) -> SimpleNamespace:
    return SimpleNamespace(blocks=tuple(groups))


def ra_hit(ring_block: int = 1) -> SimpleNamespace:
    """A hit on ra's table (blocks 2, 1), its state page and a ring block."""
    return hit([block(2), block(1)], [block(0, True), block(3)], [block(ring_block)])


def test_a_hit_reads_what_the_earlier_request_wrote_at_its_positions(checks):
    checks._on_hit("rc", ra_hit(), 64)
    assert checks.counts["prefix_hits_verified"] == 1
    # Group 0: 4 cells of 4 words; group 1: one state page of 2 words; no ring.
    assert checks.tally.bytes_verified == 8 * (16 + 2)


def test_the_same_hit_looked_up_again_is_checked_once(checks):
    checks._on_hit("rc", ra_hit(), 64)
    flip(checks, "g0.a", 2, 0)
    checks._on_hit("rc", ra_hit(), 64)  # the request waited: same blocks
    assert checks.counts["prefix_hits_verified"] == 1
    fails(  # another request, or other blocks, are checked afresh
        lambda: checks._on_hit("rb", ra_hit(), 64),
        "step 5: request ra, group 0, layer g0.a, bytes [64, 72): view block 2 row 0 when rb hits it: "
        "expected its position 0, found request ra's fingerprint (group 0, layer label 0, position 1)",
    )


def test_a_hit_on_other_blocks_is_checked_afresh(checks):
    checks._on_hit("rc", ra_hit(), 64)
    flip(checks, "g0.a", 2, 0)
    with pytest.raises(PoolCorruption, match="when rc hits it"):
        checks._on_hit("rc", ra_hit(ring_block=0), 64)
    assert checks.counts["prefix_hits_verified"] == 2


@pytest.mark.parametrize(
    ("name", "block", "row", "message"),
    [
        (
            "g0.c",
            1,
            1,
            "group 0, layer g0.c, bytes [176, 192): view block 1 row 1 when rc hits it: "
            "expected its position 3, found request ra's fingerprint (group 0, layer label 2, position 2)",
        ),
        (
            "g1.s",
            3,
            0,
            "group 1, layer g1.s, bytes [304, 320): view block 3 row 0 when rc hits it: "
            "expected its position 4, found request ra's fingerprint (group 1, layer label 0, position 5)",
        ),
    ],
)
def test_a_hit_names_the_flipped_page_and_the_hitting_request(checks, name, block, row, message):
    flip(checks, name, block, row)
    fails(lambda: checks._on_hit("rc", ra_hit(), 64), f"step 5: request ra, {message}")


def test_rings_are_never_read_by_a_hit(checks):
    flip(checks, "g2.r", 1, 0)
    checks._on_hit("rc", ra_hit(), 64)


def test_a_hit_block_in_the_wrong_place_of_the_table_is_named(checks):
    """ra wrote block 1 at positions 2, 3: a table holding it first reads
    positions 0, 1 there."""
    fails(
        lambda: checks._on_hit("rc", hit([block(1), block(2)], [], []), 64),
        "step 5: request ra, group 0, layer g0.a, bytes [32, 40): view block 1 row 0 when rc hits it: "
        "was written at its position 2, not the position read",
    )


def test_null_blocks_keep_their_place_in_the_table(checks):
    """A hit [null, 1]: block 1 is the table's second, positions 2, 3."""
    checks._on_hit("rc", hit([block(0, True), block(1)], [], []), 64)
    with pytest.raises(
        PoolCorruption, match="view block 2 row 0 when rd hits it: was written at its position 0"
    ):
        checks._on_hit("rd", hit([block(0, True), block(2)], [], []), 64)


def test_a_hit_on_a_token_row_nobody_wrote_is_named(checks):
    checks.groups[0].classes[0].shadow[1, 1] = UNKNOWN
    fails(
        lambda: checks._on_hit("rc", ra_hit(), 64),
        "step 5: request rc, group 0, layer g0.a, bytes [40, 48): prefix hit reads view block 1 row 1, "
        "which nobody wrote",
    )


def test_a_state_page_nobody_wrote_is_not_verified(checks):
    """The replay writes a Mamba state only at a step's last token
    (docs/fidelity.md): a hit on a page it never wrote is skipped."""
    checks._on_hit("rc", hit([], [block(2)], []), 64)
    assert checks.counts["prefix_hits_verified"] == 1 and checks.tally.bytes_verified == 0


# ---------------------------------------------------- _verify_everything
def test_the_end_checks_every_cell_anyone_wrote(checks):
    checks._verify_everything()
    # Group 0: 5 cells of 4 words; group 1: 2 words; ring: 2 cells of 1.
    assert checks.tally.bytes_verified == 8 * (20 + 2 + 2)
    flip(checks, "g0.a", 3, 1)  # a cell nobody wrote: not checked
    checks._verify_everything()
    flip(checks, "g2.r", 1, 1)
    fails(
        checks._verify_everything,
        "step 5: request ra, group 2, layer g2.r, bytes [344, 352): view block 1 row 1 at the end: "
        "expected its position 3, found request ra's fingerprint (group 2, layer label 0, position 2)",
    )


def test_the_message_format_is_the_replays(checks):
    """The line docs/pool-replay.md shows: step, request, group, layer, bytes."""
    flip(checks, "g0.a", 0, 0)
    with pytest.raises(PoolCorruption) as caught:
        checks._verify_everything()
    assert re.match(r"^step \d+: request r\w+, group \d+, layer \S+, bytes \[\d+, \d+\): ", str(caught.value))


def test_a_ring_group_listed_first_does_not_end_the_hit_check(checks):
    checks.groups = [checks.groups[2], *checks.groups[:2]]
    flip(checks, "g0.a", 1, 1)
    with pytest.raises(
        PoolCorruption, match="layer g0.a, bytes \\[40, 48\\): view block 1 row 1 when rc hits it"
    ):
        checks._on_hit("rc", hit([block(2), block(1)], [], [block(1)]), 64)


def test_a_group_without_a_hit_block_does_not_end_the_hit_check(checks):
    flip(checks, "g1.s", 3, 0)
    with pytest.raises(
        PoolCorruption, match="layer g1.s, bytes \\[304, 320\\): view block 3 row 0 when rc hits it"
    ):
        checks._on_hit("rc", hit([block(0, True)], [block(0, True), block(3)], []), 64)


def test_a_group_the_request_holds_nothing_in_does_not_end_the_free_check(checks):
    checks.held = {(1, "rc"): [3]}  # rc holds ra's state page in group 1 only
    flip(checks, "g1.s", 3, 0)
    with pytest.raises(
        PoolCorruption, match="layer g1.s, bytes \\[304, 320\\): view block 3 row 0 when rc is freed"
    ):
        checks._on_free(SimpleNamespace(request_id="rc"))
