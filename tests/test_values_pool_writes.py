"""The pool replay's writes (``sim.pool_replay.replay.PoolReplay``) on a
hand-laid, block-outermost pool: which cells a step writes, the ownership,
fence and geometry checks before a write, the write itself, the ring
zeroing. Each rule has its control (a table, a holder, a fence or a view
broken on purpose) and the exact message, derived by hand from the byte
layout below. Milliseconds; the whole replay is tests/test_pool_replay.py.

Four pool blocks of 64 bytes (``stride``); a cell is ``offset + view block
* stride0 + row * stride1``, one 8-byte word:

    group 0, attention, 2 tokens a block:
        "g0.a" (one row a token, 2 rows)   offset 0,  stride0 64, stride1 8
        "g0.k" (one row per 2 tokens)      offset 16, stride0 64
    group 1, mamba (a state page a block): "g1.s" offset 24, stride0 64
    group 2, ring of 2 rows, 2 slots a pool block (view block = 2 * pool
        block + slot, a slot is 32 bytes): "g2.r" offset 0, stride0 32, stride1 8
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sim.pool_replay.fingerprints import UNKNOWN, ZERO_POSITION, PoolCorruption
from sim.pool_replay.plan import Group, Layer, RowClass
from sim.pool_replay.replay import PoolReplay
from sim.pool_replay.verify import Cells, Fence

RA, RB = 1 << 24, 2 << 24  # shadow codes of ra's and rb's writes at position 0


def row_class(group: int, kind: str, per_row: int, num_rows: int, num_blocks: int, layer: tuple) -> RowClass:
    made = RowClass(
        group=group,
        kind=kind,
        tokens_per_row=per_row,
        num_rows=num_rows,
        layers=[Layer(*layer)],
        shadow=torch.zeros((num_blocks, num_rows), dtype=torch.int64),
    )
    made.build_word_sets()
    return made


def block(block_id: int) -> SimpleNamespace:
    """A table entry; -1 stands for vLLM's null block, whose id is 0."""
    return SimpleNamespace(block_id=max(block_id, 0), is_null=block_id < 0)


class Mamba(SimpleNamespace):
    """A manager that retains checkpoints (vLLM's Mamba manager here)."""

    def retained_checkpoints(self) -> dict:
        return self.retained


def hand_replay() -> PoolReplay:
    replay = PoolReplay.__new__(PoolReplay)
    replay.device = torch.device("cpu")
    replay.groups = [
        Group(
            0,
            "attention",
            2,
            1,
            [
                row_class(0, "tokens", 1, 2, 4, ("g0.a", 0, 0, 64, 8, 1)),
                row_class(0, "tokens", 2, 1, 4, ("g0.k", 1, 16, 64, 0, 1)),
            ],
        ),
        Group(1, "mamba", 2, 1, [row_class(1, "state", 0, 1, 4, ("g1.s", 0, 24, 64, 0, 1))]),
        Group(2, "ring", 2, 2, [row_class(2, "ring", 1, 2, 8, ("g2.r", 0, 0, 32, 8, 1))]),
    ]
    replay.managers = [
        SimpleNamespace(req_to_blocks={}),
        Mamba(req_to_blocks={}, retained={}),
        SimpleNamespace(req_to_blocks={}),
    ]
    replay.words = torch.zeros(32, dtype=torch.int64)
    replay.stride = 64
    replay.scheduler = SimpleNamespace(processed_step_seq=5)
    replay.sim = SimpleNamespace(env=SimpleNamespace(now=1.5))
    replay.request_numbers, replay.request_names = {}, {}
    replay.fences, replay.fenced = [], {}
    replay.step = 5
    replay.tallies = {}
    replay.counts = defaultdict(int)
    replay.max_slots_sharing_a_block = 0
    replay._last_hit = {}
    for name in ("ra", "rb", "rc"):
        replay._number(name)  # ra 1, rb 2, rc 3
    return replay


def tables(replay: PoolReplay, group: int, **held: list[int]) -> None:
    replay.managers[group].req_to_blocks.update({r: [block(b) for b in ids] for r, ids in held.items()})


def fails(work, message: str) -> None:
    with pytest.raises(PoolCorruption) as caught:
        work()
    assert str(caught.value) == message


def cells_of(part) -> list[list[int]]:
    return [list(map(int, a)) for a in part]


@pytest.fixture
def replay() -> PoolReplay:
    return hand_replay()


# ------------------------------------------------------------- numbering
def test_requests_are_numbered_from_one_in_order_of_first_sight(replay):
    assert replay.request_numbers == {"ra": 1, "rb": 2, "rc": 3}
    assert replay.request_names == {1: "ra", 2: "rb", 3: "rc"}
    assert replay._number("rb") == 2 and replay._number("rd") == 4


# --------------------------------------------------------- cells to write
def test_token_rows_map_positions_through_the_table(replay):
    g0 = replay.groups[0]
    a, k = g0.classes
    # Positions 1..3 of the table [2, 1]: block 2 row 1, block 1 rows 0 and 1.
    assert cells_of(replay._request_cells(g0, a, "ra", [2, 1], 1, 4, 4)) == [[2, 1, 1], [1, 0, 1], [1, 2, 3]]
    # One row per 2 tokens: rows 0 (tokens 0, 1) and 1 (tokens 2, 3), one a block.
    assert cells_of(replay._request_cells(g0, k, "ra", [2, 1], 1, 4, 4)) == [[2, 1], [0, 0], [0, 1]]
    # A row is written from the step's first token it holds (token 3 is row 1's).
    assert cells_of(replay._request_cells(g0, k, "ra", [2, 1], 3, 4, 4)) == [[1], [0], [1]]
    # Drafts (end past end_main) are written like the rest.
    assert cells_of(replay._request_cells(g0, a, "ra", [2, 1], 2, 2, 4)) == [[1, 1], [0, 1], [2, 3]]


def test_a_token_past_the_table_is_refused(replay):
    g0 = replay.groups[0]
    fails(
        lambda: replay._request_cells(g0, g0.classes[0], "ra", [2, 1], 3, 5, 5),
        "step 5: request ra, group 0: writes position 4 past its 2-block table",
    )
    assert cells_of(replay._request_cells(g0, g0.classes[0], "ra", [2, 1], 3, 4, 4)) == [[1], [1], [3]]


def test_a_token_in_a_null_block_is_refused(replay):
    g0 = replay.groups[0]
    fails(
        lambda: replay._request_cells(g0, g0.classes[0], "ra", [2, -1, 3], 1, 5, 5),
        "step 5: request ra, group 0: writes position 2 into a null block",
    )


def test_a_state_lives_in_the_block_of_the_last_computed_token(replay):
    g1 = replay.groups[1]
    s = g1.classes[0]
    # Tokens up to 3 computed (end_main 3): token 2 is in the table's second block.
    assert cells_of(replay._request_cells(g1, s, "ra", [0, 3], 0, 3, 5)) == [[3], [0], [3]]
    assert cells_of(replay._request_cells(g1, s, "ra", [0, 3], 0, 2, 5)) == [[0], [0], [2]]
    assert cells_of(replay._request_cells(g1, s, "ra", [0, 3], 2, 4, 4)) == [[3], [0], [4]]
    assert replay.counts["state_writes_without_a_block"] == 0


@pytest.mark.parametrize(("table", "end_main"), [([0, 3], 0), ([0, 3], 5), ([0, -1], 4), ([], 1)])
def test_a_state_without_a_block_is_counted_not_written(replay, table, end_main):
    g1 = replay.groups[1]
    assert replay._request_cells(g1, g1.classes[0], "ra", table, 0, end_main, end_main) is None
    assert replay.counts["state_writes_without_a_block"] == 1


def test_a_ring_keeps_the_last_capacity_positions_at_position_mod_capacity(replay):
    g2 = replay.groups[2]
    r = g2.classes[0]
    assert cells_of(replay._request_cells(g2, r, "ra", [5], 3, 6, 6)) == [[5, 5], [0, 1], [4, 5]]
    assert cells_of(replay._request_cells(g2, r, "ra", [5], 3, 4, 4)) == [[5], [1], [3]]
    fails(
        lambda: replay._request_cells(g2, r, "ra", [], 0, 1, 1),
        "step 5: request ra, group 2: writes its ring but holds no ring block",
    )


def scheduled(request_id: str, computed: int, num: int, spec: int = 0) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=request_id, num_computed_tokens=computed, num_scheduled_tokens=num, num_spec_tokens=spec
    )


def test_a_steps_cells_are_each_requests_in_order_with_their_fingerprints(replay):
    tables(replay, 0, ra=[2, 1], rb=[0], rd=[3])
    g0 = replay.groups[0]
    cells = replay._step_cells(
        g0, g0.classes[0], [scheduled("rb", 0, 2), scheduled("ra", 2, 1), scheduled("rd", 0, 1)]
    )
    assert cells.view_blocks.tolist() == [0, 0, 1, 3] and cells.rows.tolist() == [0, 1, 0, 0]
    assert cells.codes.tolist() == [RB, RB | 1, RA | 2, 4 << 24]  # rd is numbered 4 on sight
    assert cells.request_ids == ["rb", "rb", "ra", "rd"]


def test_a_steps_state_is_written_at_end_main_and_skipped_without_a_block(replay):
    tables(replay, 1, ra=[2, 1], rb=[])
    g1 = replay.groups[1]
    cells = replay._step_cells(g1, g1.classes[0], [scheduled("rb", 0, 2), scheduled("ra", 1, 3, spec=1)])
    assert (cells.view_blocks.tolist(), cells.rows.tolist(), cells.codes.tolist()) == ([1], [0], [RA | 3])
    assert cells.request_ids == ["ra"]
    empty = replay._step_cells(g1, g1.classes[0], [scheduled("rb", 0, 2)])
    assert (empty.view_blocks.size, empty.rows.size, empty.codes.size, empty.request_ids) == (0, 0, 0, [])
    assert empty.codes.dtype == np.int64


# ------------------------------------------------------------- holders
def test_holders_are_every_table_block_and_retained_checkpoint(replay):
    tables(replay, 0, ra=[2, -1, 1], rb=[2])
    tables(replay, 1, ra=[3])
    replay.managers[1].retained = {"rc": block(0), "ra": block(3)}
    tables(replay, 2, rb=[7])
    assert replay._table(0, "ra") == [2, -1, 1] and replay._table(0, "nobody") == []
    assert replay._held_blocks(0, "ra") == [2, 1] and replay._held_blocks(1, "rc") == [0]
    pool_groups, holders = replay._holders()
    assert dict(pool_groups) == {2: {0}, 1: {0}, 3: {1, 2}, 0: {1}}
    assert dict(holders) == {
        (0, 2): {"ra", "rb"},
        (0, 1): {"ra"},
        (1, 3): {"ra"},
        (1, 0): {"rc"},
        (2, 7): {"rb"},
    }


def test_the_ring_packing_gauge_is_the_most_live_slots_of_one_pool_block(replay):
    holders = {(2, 0): {"ra"}, (2, 1): {"rb"}, (2, 5): {"rc"}, (2, 4): set(), (0, 1): {"ra"}, (0, 0): {"rb"}}
    replay._note_ring_packing(holders)
    assert replay.max_slots_sharing_a_block == 2
    replay._note_ring_packing({(2, 6): {"ra"}})
    assert replay.max_slots_sharing_a_block == 2  # a maximum over the run
    fresh = hand_replay()
    fresh._note_ring_packing({(0, 0): {"ra"}, (0, 1): {"rb"}})  # not a packed group
    assert fresh.max_slots_sharing_a_block == 0


# ---------------------------------------------------- checks before a write
def cells(blocks: list[int], rows: list[int], codes: list[int], requests: list[str]) -> Cells:
    return Cells(np.array(blocks), np.array(rows), np.array(codes), requests)


def test_a_block_the_writer_alone_holds_is_written(replay):
    g0 = replay.groups[0]
    replay._check_ownership(
        g0, g0.classes[0], cells([1, 1], [0, 1], [RA, RA | 1], ["ra", "ra"]), {1: {0}}, {(0, 1): {"ra"}}
    )


@pytest.mark.parametrize(
    ("owners", "what"),
    [({"ra", "rc", "rb"}, "held by rb, rc"), (set(), "not held by it"), ({"rb"}, "held by rb")],
)
def test_a_block_held_by_others_is_refused_naming_them(replay, owners, what):
    g0 = replay.groups[0]
    work = cells([2, 1], [0, 1], [RA, RA | 1], ["ra", "ra"])
    fails(
        lambda: replay._check_ownership(
            g0, g0.classes[0], work, {1: {0}, 2: {0}}, {(0, 2): {"ra"}, (0, 1): owners}
        ),
        f"step 5: request ra, group 0, layer g0.a, bytes [72, 80): writes view block 1 {what}",
    )


def test_a_pool_block_another_group_holds_is_refused(replay):
    g2 = replay.groups[2]
    work = cells([3], [1], [RA], ["ra"])  # slot 1 of pool block 1
    fails(
        lambda: replay._check_ownership(g2, g2.classes[0], work, {1: {2, 1, 0}}, {(2, 3): {"ra"}}),
        "step 5: request ra, group 2, layer g2.r, bytes [104, 112): "
        "writes pool block 1, also held by groups [0, 1]",
    )


def test_a_fenced_block_is_refused_until_its_fence_passes(replay):
    g0 = replay.groups[0]
    replay.fenced[0, 1] = Fence(seq=7, request_id="rb", step=3, keys={(0, 1)}, cells=[])
    work = cells([2, 1], [0, 0], [RA, RA | 2], ["ra", "ra"])
    fails(
        lambda: replay._check_ownership(
            g0, g0.classes[0], work, {1: {0}, 2: {0}}, {(0, 2): {"ra"}, (0, 1): {"ra"}}
        ),
        "step 5: request ra, group 0, layer g0.a, bytes [64, 72): writes view block 1, freed by rb at step 3 "
        "but fenced until step seq 7 completes (now 5)",
    )
    replay.fenced[1, 2] = replay.fenced.pop((0, 1))  # another group's key: not this block
    replay._check_ownership(g0, g0.classes[0], work, {1: {0}, 2: {0}}, {(0, 2): {"ra"}, (0, 1): {"ra"}})


def test_every_requests_cells_are_checked_not_only_the_first_writers(replay):
    g0 = replay.groups[0]
    work = cells([1, 1], [0, 1], [RA, RB], ["ra", "rb"])
    fails(
        lambda: replay._check_ownership(g0, g0.classes[0], work, {1: {0}}, {(0, 1): {"ra"}}),
        "step 5: request rb, group 0, layer g0.a, bytes [72, 80): writes view block 1 held by ra",
    )


def test_a_cell_outside_its_pool_block_is_refused(replay):
    g0 = replay.groups[0]
    stray = row_class(0, "tokens", 1, 2, 4, ("g0.x", 0, 56, 64, 8, 1))  # row 1 spills into the next block
    replay._check_geometry(g0, stray, cells([2], [0], [RA], ["ra"]))
    fails(
        lambda: replay._check_geometry(
            g0, stray, cells([2, 1, 1], [0, 0, 1], [RA, RA, RA], ["ra", "rb", "rc"])
        ),
        "step 5: request rc, group 0, layer g0.x, bytes [128, 136): view block 1 row 1 lies outside "
        "pool block 1 [64, 128)",
    )
    before = row_class(0, "tokens", 1, 2, 4, ("g0.y", 0, 0, 64, -8, 1))  # row 1 before the block
    fails(
        lambda: replay._check_geometry(g0, before, cells([1], [1], [RA], ["ra"])),
        "step 5: request ra, group 0, layer g0.y, bytes [56, 64): view block 1 row 1 lies outside "
        "pool block 1 [64, 128)",
    )


def test_a_ring_cell_outside_its_slot_is_refused(replay):
    g2 = replay.groups[2]
    shifted = row_class(2, "ring", 1, 2, 8, ("g2.r", 0, 24, 32, 8, 1))  # row 1 in the next slot
    replay._check_geometry(g2, shifted, cells([3], [0], [RA], ["ra"]))
    fails(
        lambda: replay._check_geometry(g2, shifted, cells([3], [1], [RA], ["ra"])),
        "step 5: request ra, group 2, layer g2.r, bytes [128, 136): view block 3 row 1 lies outside "
        "slot 1 of pool block 1 [96, 128)",
    )
    replay._check_geometry(g2, g2.classes[0], cells([7, 7], [0, 1], [RA, RA], ["ra", "ra"]))


# ------------------------------------------------------------- the write
def test_a_write_tiles_each_layers_fingerprint_and_forgets_other_groups_bytes(replay):
    g0 = replay.groups[0]
    a, k = g0.classes
    k.shadow[1, 0] = RB  # same group: kept
    for group in (1, 2):
        replay.groups[group].classes[0].shadow[:] = RB
    replay._write(a, cells([2, 1, 1], [1, 0, 1], [RA | 1, RA | 2, RA | 3], ["ra"] * 3))
    tag = (1 << 56) | (1 << 48)
    assert {i: int(w) for i, w in enumerate(replay.words) if w} == {
        17: tag | RA | 1,
        8: tag | RA | 2,
        9: tag | RA | 3,
    }
    assert a.shadow.tolist() == [[0, 0], [RA | 2, RA | 3], [0, RA | 1], [0, 0]]
    assert k.shadow[1, 0] == RB
    # Pool blocks 1 and 2 are group 0's now: the mamba pages and ring slots there are stale.
    assert replay.groups[1].classes[0].shadow.flatten().tolist() == [RB, UNKNOWN, UNKNOWN, RB]
    ring = replay.groups[2].classes[0].shadow
    assert [int(ring[v, 0]) for v in range(8)] == [RB, RB, 0, 0, 0, 0, RB, RB]
    # Three one-word cells written, then read back.
    assert replay._tally().bytes_written == 24 and replay._tally().bytes_verified == 24


def test_a_write_that_lands_on_another_cell_of_the_step_is_caught_on_read_back(replay):
    aliased = row_class(0, "tokens", 1, 2, 4, ("g0.a", 0, 0, 64, 0, 1))  # both rows on one word
    fails(
        lambda: replay._write(aliased, cells([1, 1], [0, 1], [RA, RA | 1], ["ra", "ra"])),
        "step 5: request ra, group 0, layer g0.a, bytes [64, 72): view block 1 row 0 right after the write: "
        "expected its position 0, found request ra's fingerprint (group 0, layer label 0, position 1)",
    )


def test_a_ring_write_forgets_the_whole_pool_block_of_its_slot(replay):
    g1 = replay.groups[1].classes[0]
    g1.shadow[:] = RB
    replay._write(replay.groups[2].classes[0], cells([3], [0], [RA], ["ra"]))
    assert g1.shadow.flatten().tolist() == [RB, UNKNOWN, RB, RB]


# ------------------------------------------------------------- ring zeroing
def test_new_ring_slots_are_zeroed_for_their_holder(replay):
    ring = replay.groups[2].classes[0]
    replay.words[:] = -1
    holders = {(2, 3): {"rb"}, (2, 4): {"ra"}, (0, 3): {"rc"}}
    replay._zero_new_rings([4, 3, 4, 6], {1: {2}, 2: {2}}, holders)  # 6: held by nobody
    assert replay.counts["ring_slots_zeroed"] == 2
    zeroed = [i for i, w in enumerate(replay.words.tolist()) if w == 0]
    assert zeroed == [12, 13, 16, 17]  # view block 3 (bytes 96..112), 4 (128..144)
    assert ring.shadow[3].tolist() == [RB | ZERO_POSITION] * 2
    assert ring.shadow[4].tolist() == [RA | ZERO_POSITION] * 2
    assert ring.shadow[6].tolist() == [0, 0]


def test_nothing_is_zeroed_without_new_slots(replay):
    replay.words[:] = -1
    replay._zero_new_rings([], {}, {})
    replay._zero_new_rings([5], {}, {})
    assert bool((replay.words == -1).all()) and replay.counts["ring_slots_zeroed"] == 0


def test_a_new_ring_slot_held_by_two_requests_is_refused_naming_both(replay):
    fails(
        lambda: replay._zero_new_rings([2, 3], {1: {2}}, {(2, 2): {"ra"}, (2, 3): {"rc", "rb"}}),
        "step 5: request rc, group 2, layer g2.r, bytes [96, 104): ring slot 3 (pool block 1) "
        "is held by 2 requests: rb, rc",
    )


def test_a_new_ring_slot_is_checked_like_any_write(replay):
    replay.fenced[2, 3] = Fence(seq=9, request_id="rc", step=4, keys={(2, 3)}, cells=[])
    fails(
        lambda: replay._zero_new_rings([3], {1: {2}}, {(2, 3): {"rb"}}),
        "step 5: request rb, group 2, layer g2.r, bytes [96, 104): "
        "writes view block 3, freed by rc at step 4 but fenced until step seq 9 completes (now 5)",
    )


def test_a_block_nobody_holds_is_refused(replay):
    g0 = replay.groups[0]
    fails(
        lambda: replay._check_ownership(g0, g0.classes[0], cells([3], [0], [RA], ["ra"]), {3: {0}}, {}),
        "step 5: request ra, group 0, layer g0.a, bytes [192, 200): writes view block 3 not held by it",
    )


def test_a_new_ring_slot_held_by_three_names_the_last_of_them(replay):
    fails(
        lambda: replay._zero_new_rings([3], {1: {2}}, {(2, 3): {"rc", "ra", "rb"}}),
        "step 5: request rc, group 2, layer g2.r, bytes [96, 104): ring slot 3 (pool block 1) "
        "is held by 3 requests: ra, rb, rc",
    )


def test_zeroed_ring_slots_are_counted_over_the_run(replay):
    replay._zero_new_rings([3], {1: {2}}, {(2, 3): {"ra"}})
    replay._zero_new_rings([4, 5], {2: {2}}, {(2, 4): {"rb"}, (2, 5): {"rc"}})
    assert replay.counts["ring_slots_zeroed"] == 3


def test_a_ring_group_without_claims_does_not_stop_the_next_ones_zeroing(replay):
    """Two ring groups (none of kvsim's models has two on a rank, but the
    rule is per group): the first claims nothing this step."""
    replay.groups.append(Group(3, "ring", 2, 2, [row_class(3, "ring", 1, 2, 8, ("g3.r", 0, 0, 32, 8, 1))]))
    replay.words[:] = -1
    replay._zero_new_rings([5], {2: {3}}, {(3, 5): {"ra"}})
    assert [i for i, w in enumerate(replay.words.tolist()) if w == 0] == [
        20,
        21,
    ]  # view block 5: bytes 160..176
    assert replay.groups[3].classes[0].shadow[5].tolist() == [RA | ZERO_POSITION] * 2
    assert replay.counts["ring_slots_zeroed"] == 1


def test_states_without_a_block_are_counted_over_the_run(replay):
    g1 = replay.groups[1]
    for _ in range(2):
        replay._request_cells(g1, g1.classes[0], "ra", [], 0, 1, 1)
    assert replay.counts["state_writes_without_a_block"] == 2


def test_a_write_past_the_table_names_its_last_position(replay):
    g0 = replay.groups[0]
    fails(
        lambda: replay._request_cells(g0, g0.classes[0], "ra", [2, 1], 2, 6, 6),
        "step 5: request ra, group 0: writes position 5 past its 2-block table",
    )


def test_a_cells_last_word_outside_its_block_is_refused(replay):
    g0 = replay.groups[0]
    wide = row_class(0, "tokens", 1, 2, 4, ("g0.w", 0, 48, 64, 8, 2))  # 16-byte cells
    replay._check_geometry(g0, wide, cells([1], [0], [RA], ["ra"]))  # bytes 112..128
    fails(
        lambda: replay._check_geometry(g0, wide, cells([1], [1], [RA], ["ra"])),
        "step 5: request ra, group 0, layer g0.w, bytes [120, 136): view block 1 row 1 lies outside "
        "pool block 1 [64, 128)",
    )


def test_the_bytes_written_add_up_over_a_step(replay):
    a = replay.groups[0].classes[0]
    replay._write(a, cells([1], [0], [RA], ["ra"]))
    replay._write(a, cells([2, 2], [0, 1], [RB, RB | 1], ["rb", "rb"]))
    assert replay._tally().bytes_written == 8 * 3


def test_a_ring_write_forgets_only_its_own_pool_block_in_another_packed_group(replay):
    """A second packed group (2 slots a pool block): a write to slot 1 of
    pool block 1 forgets that group's view blocks 2 and 3, not 4."""
    replay.groups.append(Group(3, "ring", 2, 2, [row_class(3, "ring", 1, 2, 8, ("g3.r", 0, 0, 32, 8, 1))]))
    other = replay.groups[3].classes[0].shadow
    other[:] = RB
    replay._write(replay.groups[2].classes[0], cells([3], [0], [RA], ["ra"]))
    assert [int(other[v, 0]) for v in range(8)] == [RB, RB, 0, 0, RB, RB, RB, RB]


class _Numbered(dict):
    """Counts as if 2**24 - 2 requests were numbered before its own."""

    def __len__(self) -> int:
        return (1 << 24) - 2 + super().__len__()


def test_request_numbers_fit_their_24_bits(replay):
    replay.request_numbers = _Numbered()
    assert replay._number("last") == (1 << 24) - 1
    with pytest.raises(AssertionError):
        replay._number("one too many")


def test_a_steps_failure_names_the_request_that_writes(replay):
    tables(replay, 0, ra=[2], rb=[1])
    g0 = replay.groups[0]
    fails(
        lambda: replay._step_cells(g0, g0.classes[0], [scheduled("ra", 0, 1), scheduled("rb", 1, 3)]),
        "step 5: request rb, group 0: writes position 3 past its 1-block table",
    )
