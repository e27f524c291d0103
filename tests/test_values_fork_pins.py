"""Value tests for the fork's prefix-hit pins (patches 0095-0097 of
``halt95/qwen38-flash-next-3090s``), written against the survivors of their
mutation run (``scripts/mutation.sh kv_cache_pins sched_pins``: ``sim/fork/pins.py``,
``sim/fork/scheduler_pins.py``).

Each expected value is vLLM 0.33.0's allocation arithmetic or the fork's
rule worked by hand on the rigs of ``tests/helpers/pins.py`` (the fork
tests' sizes); each test's control is the other side of the rule.
"""

from __future__ import annotations

import pytest
from helpers.pins import (
    BLOCK,
    UNIT,
    Spec,
    assert_pool_clean,
    decode,
    drain_copies,
    finish,
    finish_and_free,
    grace_scheduler,
    pinning_manager,
    prefill,
    request,
    step,
    tail_tokens,
)

from sim.fork.patches import ForkPatches
from sim.fork.pins import PinningKVCacheManager
from sim.fork.scheduler_pins import NoPins, SchedulerPins, scheduler_pins
from sim.kv_cache_manager import KVCacheManager
from sim.sched.fast_path.memos import NoFastPath
from sim.vllm_bridge import RequestStatus, init_none_hash, sha256

NO_GRACES = ForkPatches(grace_pins=False)


def _ids(output) -> set[str]:
    return {item.request_id for item in output.scheduled}


# ------------------------------------------------------------ construction
def test_both_pins_are_on_by_default_and_nothing_has_failed_yet():
    """The fork ships both patches on (waiter pins unless a connector,
    graces with sub-block hits): a manager built without the switches has
    both, and no allocation has failed, so no shortfall."""
    config = pinning_manager(64).kv_cache_config
    manager = PinningKVCacheManager(
        config,
        max_model_len=8192,
        scheduler_block_size=BLOCK,
        hash_block_size=UNIT,
        enable_caching=True,
        use_eagle=True,
    )
    assert (manager.enable_waiter_pins, manager.enable_grace_pins, manager.guards_head_yields) == (
        True,
        True,
        True,
    )
    assert manager.last_alloc_shortfall == 0


def test_nothing_to_release_or_pin_counts_zero():
    manager = pinning_manager(64)
    cold = request("COLD", tail_tokens(9, 40))
    assert manager.pin_waiting_hit(cold) == 0  # nothing cached: nothing pinned
    assert manager.release_pinned_hit("nobody") == 0
    assert manager.release_grace_pin("nobody") == 0
    assert manager.grace_pinned_blocks("nobody") == []


# --------------------------------------------------------------- shortfall
def _full_pool(num_free: int):
    """The grace rig's manager (block 16, 11 usable) with ``num_free``
    blocks left free, and a 64-token request: 4 blocks for its prompt."""
    manager = grace_scheduler(12).kv_cache_manager
    pool = manager.block_pool
    taken = pool.get_new_blocks(pool.get_num_free_blocks() - num_free)
    return manager, taken, request("Q", tail_tokens(3, 64), unit=16)


@pytest.mark.parametrize(
    ("kwargs", "status", "expected"),
    [
        ({}, RequestStatus.WAITING, 4 - 2),
        ({"reserved_blocks": 2}, RequestStatus.WAITING, 4 - (2 - 2)),
        ({"has_scheduled_reqs": True}, RequestStatus.WAITING, 4 + 3 - 2),
        ({"has_scheduled_reqs": True}, RequestStatus.PREEMPTED, 4 + 3 - 2),
        ({"has_scheduled_reqs": True}, RequestStatus.RUNNING, 4 - 2),
        ({"has_scheduled_reqs": False}, RequestStatus.WAITING, 4 - 2),
    ],
    ids=["free", "reserved", "watermark-waiting", "watermark-preempted", "running-no-watermark", "idle"],
)
def test_the_shortfall_is_vllms_required_minus_available(kwargs, status, expected):
    """vLLM's step check: required = blocks + the watermark (waiting or
    preempted requests, only beside scheduled ones), available = free less
    ``reserved_blocks``. 2 free, 4 needed, a watermark of 3."""
    manager, _, q = _full_pool(2)
    manager.watermark_blocks = 3
    q.status = status
    arguments = {"has_scheduled_reqs": False, **kwargs}
    assert manager.allocate_slots(q, 64, **arguments) is None
    assert manager.last_alloc_shortfall == expected


def test_the_full_sequence_gate_counts_the_whole_request_against_the_free_blocks():
    """The gate (``full_sequence_must_fit``) fails on the whole request (4
    blocks) against the free blocks (2), ``reserved_blocks`` not subtracted;
    passing it, the step's own need (1 block for 16 tokens) is checked
    against the free blocks less the reserve. Control: the same 16-token
    step without the gate allocates."""
    manager, _, q = _full_pool(2)
    gate = {"full_sequence_must_fit": True, "has_scheduled_reqs": False}
    assert manager.allocate_slots(q, 16, reserved_blocks=2, **gate) is None
    assert manager.last_alloc_shortfall == 4 - 2
    manager, _, q = _full_pool(4)
    assert manager.allocate_slots(q, 16, reserved_blocks=4, **gate) is None
    assert manager.last_alloc_shortfall == 1 - (4 - 4)
    blocks = manager.allocate_slots(q, 16, reserved_blocks=3, **gate)
    assert blocks is not None and manager.last_alloc_shortfall == 0


def test_allocate_slots_takes_vllms_arguments_by_position():
    """``num_lookahead_tokens`` in vLLM's fifth place: 16 tokens and 16
    lookahead slots need two blocks."""
    manager, _, q = _full_pool(4)
    blocks = manager.allocate_slots(q, 16, 0, None, 16)
    assert len(blocks.blocks[0]) == 2


# ------------------------------------------------------------------ graces
def test_a_turn_aborted_before_its_first_output_takes_no_grace():
    """0097: a grace needs output. Aborted mid-request before sampling
    (its prompt computed, no token out): plain free. Control: one decode
    step later the same abort holds a grace."""
    manager = pinning_manager(96)
    for name, steps in (("A", 0), ("B", 1)):
        turn = request(name, tail_tokens(1 + steps, 2 * BLOCK + 9))
        prefill(manager, turn)
        if steps:
            decode(manager, turn, steps)
        assert (turn.num_output_tokens > 0) is bool(steps)
        turn.status = RequestStatus.FINISHED_ABORTED
        manager.free(turn)
        drain_copies(manager)
    assert manager.grace_order() == ["B"]
    manager.yield_pinned_hits()
    assert_pool_clean(manager, 96)


def test_a_turn_with_nothing_hashed_takes_no_grace():
    """Five tokens are below one 8-token unit: no hashed block, no Mamba
    checkpoint; the turn finishes with output and holds nothing."""
    manager = pinning_manager(64)
    turn = request("S", tail_tokens(4, 5))
    prefill(manager, turn)
    decode(manager, turn, 1)
    turn.status = RequestStatus.FINISHED_STOPPED
    assert manager._take_grace_pin(turn) == 0
    manager.free(turn)
    drain_copies(manager)
    assert manager.grace_order() == []
    assert_pool_clean(manager, 64)


def test_a_request_id_used_again_replaces_its_grace():
    """A second turn under the same id holds the new blocks only: the first
    grace's blocks go back to the queue (3 held, not 6), nothing leaks."""
    scheduler = grace_scheduler(32)
    manager, pool = scheduler.kv_cache_manager, scheduler.kv_cache_manager.block_pool
    finish(scheduler, Spec("A", tuple(range(1000, 1048)), 2))
    first = manager.grace_pinned_blocks("A")
    finish(scheduler, Spec("A", tuple(range(2000, 2048)), 2))
    assert manager.grace_order() == ["A"] and manager.num_grace_pinned_blocks == 3
    assert all(block.ref_cnt == 0 for block in first)
    manager.yield_pinned_hits()
    assert pool.get_num_free_blocks() == 31


def test_a_released_waiter_pin_queues_its_deepest_block_first():
    """A released waiter pin gives its blocks back as vLLM frees a
    request's (``SingleTypeKVCacheManager.free``: ``reversed``): the tail
    first, so the prefix other waiters share stays cached longest (issue
    41: the order reversed passed every test). A's 96-token prompt (three
    32-token blocks) is cached and freed; W (A's prompt and more) pins its
    hit; released, W's attention blocks are queued deepest first. (Control: the lookup lists the prefix first,
    so the pin list's own order fails.)"""
    manager = pinning_manager(64, NO_GRACES)
    a = request("A", tail_tokens(1, 96))
    prefill(manager, a)
    finish_and_free(manager, a)
    w = request("W", tail_tokens(1, 96) + tail_tokens(2, 64))
    assert manager.pin_waiting_hit(w) > 0
    hit, num_hit, _ = manager.get_computed_blocks(w)
    attention = [block.block_id for block in hit.blocks[0] if not block.is_null]
    assert num_hit > 0 and len(attention) >= 2
    manager.release_pinned_hit("W")
    queue = [block.block_id for block in manager.block_pool.free_block_queue.get_all_free_blocks()]
    positions = [queue.index(block_id) for block_id in attention]
    assert positions == sorted(positions, reverse=True)  # the deepest block queued first
    assert manager.pinned_hit_blocks("W") == []


@pytest.mark.parametrize(
    ("hit_blocks", "released"), [(2, True), (1, False)], ids=["reach-equal", "one-short"]
)
def test_a_hit_releases_the_grace_when_two_units_reach_the_prompt_exactly(hit_blocks, released):
    """A's prompt is 64 tokens (unit 16). A follow-up hitting 32 reaches
    32 + 2 x 16 = 64: A's grace is released on its admission. Control: a
    hit of 16 reaches 48 < 64 and releases nothing."""
    scheduler = grace_scheduler(32)
    manager = scheduler.kv_cache_manager
    a = Spec("A", tuple(range(1000, 1064)), 2)
    finish(scheduler, a)
    scheduler.add_request(Spec("F", a.tokens[: 16 * hit_blocks] + tuple(range(5000, 5040)), 2))
    assert step(scheduler).admitted_hits["F"] == 16 * hit_blocks
    assert ("A" not in manager.grace_order()) is released


def test_graces_one_hit_releases_go_back_oldest_first():
    """A (48 tokens, 3 outputs) computes a 32-token system prompt; Z (48,
    1 output) is admitted on it while A runs and finishes first. H hits
    the system prompt (32, reach 64 >= 48): both graces go, in the order
    they were taken (as yields do), so Z's own third block is queued, and
    evicted, before A's. Control: by name A's would go first."""
    scheduler = grace_scheduler(64)
    manager, pool = scheduler.kv_cache_manager, scheduler.kv_cache_manager.block_pool
    system = tuple(range(500, 532))
    scheduler.add_request(Spec("A", system + tuple(range(1000, 1016)), 3))
    step(scheduler)
    scheduler.add_request(Spec("Z", system + tuple(range(2000, 2016)), 1))
    assert step(scheduler).admitted_hits["Z"] == 32
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert manager.grace_order() == ["Z", "A"]
    z_tail, a_tail = manager.grace_pinned_blocks("Z")[0], manager.grace_pinned_blocks("A")[0]
    scheduler.add_request(Spec("H", system + tuple(range(3000, 3040)), 2))
    assert step(scheduler).admitted_hits["H"] == 32 and manager.grace_order() == []
    queue = [block.block_id for block in pool.free_block_queue.get_all_free_blocks()]
    assert queue[-2:] == [z_tail.block_id, a_tail.block_id]


def test_the_head_waiters_hit_is_never_yieldable_pinned_or_not():
    """The fork's extras scene (A's grace on A1-A3, H's hit A1, A2 under the
    EAGLE drop), H not pinned yet: of A's grace only A3 would return to the
    queue for H; all three for anyone else."""
    scheduler = grace_scheduler(100, eagle=True)
    manager = scheduler.kv_cache_manager
    a = Spec("A", tuple(range(1000, 1048)), 2)
    finish(scheduler, a)
    scheduler.add_request(Spec("H", a.tokens + tuple(range(5000, 5064)), 2))
    h = next(scheduler._waiting_requests())
    hit, num_hit, _ = manager.get_computed_blocks(h)
    assert num_hit == 32 and not manager.pinned_hits()
    assert manager.num_yieldable_blocks(keep="H", keep_hit=hit.blocks) == 1
    assert manager.num_yieldable_blocks() == 3


# ------------------------------------------------------- the scheduler side
def test_upstream_has_no_pin_points():
    """``fork: upstream`` (kvsim's own manager): nothing yields, a failed
    head stays failed, no waiter is pinned."""
    pins = scheduler_pins(KVCacheManager.__new__(KVCacheManager), NoFastPath())
    assert isinstance(pins, NoPins)
    assert pins.yield_for_running() is False
    assert pins.admit_head(None, None, lambda: pytest.fail("no retry upstream")) is None  # type: ignore[arg-type]
    assert pins.pin_waiting(lambda skip: iter(())) is None


@pytest.mark.parametrize("fork", [NO_GRACES, ForkPatches(waiter_pins=False, grace_pins=False)])
def test_0095s_head_rule_yields_the_pins_behind_the_head(fork):
    """0095/0096 (graces off): H (150 tokens, 10 of the 11 blocks) waits
    behind R; W, behind H, pins A's 3 cached blocks. Once R has finished 8
    blocks are free: H is admitted only because W's pin yields to it (one
    retry). Control: without waiter pins A's blocks are simply free."""
    scheduler = grace_scheduler(12, fork)
    manager, pool = scheduler.kv_cache_manager, scheduler.kv_cache_manager.block_pool
    a = Spec("A", tuple(range(1000, 1048)), 2)
    finish(scheduler, a)
    scheduler.add_request(Spec("R", tuple(range(2000, 2112)), 6))
    step(scheduler)
    scheduler.add_request(Spec("H", tuple(range(3000, 3150)), 1))
    scheduler.add_request(Spec("W", a.tokens + tuple(range(4000, 4016)), 1))
    while "R" in scheduler.requests:
        assert "H" not in _ids(step(scheduler))
    if fork.waiter_pins:
        assert isinstance(scheduler.pins, SchedulerPins)
        assert len(manager.pinned_hit_blocks("W")) == 3 and pool.get_num_free_blocks() == 8
    assert "H" in _ids(step(scheduler))


@pytest.mark.parametrize(
    ("reused", "released"), [(16, ["B", "A"]), (48, ["A"])], ids=["retained-longer", "whole-hit"]
)
def test_a_group_retaining_a_longer_hit_is_matched_on_the_blocks_it_adopts(reused, released):
    """vLLM trims a group that retains a longer hit (a host tier) to the
    reused tokens' blocks, cdiv(reused, 16). A (48 tokens: X1, A2, A3) and B
    (X1, B2, admitted on A's X1 while A ran) hold graces. H is offered A's
    three blocks but reuses 16 tokens: its adopted hit is X1, held by both
    graces, and 16 + 2 x 16 reaches both prompts: both go. Control: reusing
    all 48, the deepest block A3 is A's alone: B keeps its grace."""
    scheduler = grace_scheduler(64)
    manager = scheduler.kv_cache_manager
    x = tuple(range(500, 516))
    a = Spec("A", x + tuple(range(1000, 1032)), 3)
    scheduler.add_request(a)
    step(scheduler)
    scheduler.add_request(Spec("B", x + tuple(range(2000, 2016)), 1))
    assert step(scheduler).admitted_hits["B"] == 16
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert manager.grace_order() == ["B", "A"]
    manager.retained_hit_group_ids = (0,)
    h = request("H", [*a.tokens, 7, 7, *range(3000, 3040)], unit=16)
    hit, num_hit, _ = manager.get_computed_blocks(h)
    assert num_hit == 48
    assert manager.allocate_slots(h, h.num_tokens - reused, reused, hit) is not None
    assert [rid for rid in ("B", "A") if rid not in manager.grace_order()] == released


def _head_fails(graced: bool):
    """11 usable blocks. A (48 tokens) finished: its grace holds A1-A3, or
    (``graced`` False) it was yielded and A's blocks sit cached at ref 0. R
    (112 tokens) runs on fresh blocks; H (A's prompt + 64) hits A1-A3 and
    needs 4 new blocks: its admission fails. Returns the pin point, the
    manager, H, its hit and a retry that counts its calls."""
    scheduler = grace_scheduler(12)
    manager = scheduler.kv_cache_manager
    a = Spec("A", tuple(range(1000, 1048)), 2)
    finish(scheduler, a)
    if not graced:
        manager.yield_pinned_hits()
    scheduler.add_request(Spec("R", tuple(range(2000, 2112)), 6))
    step(scheduler)
    scheduler.add_request(Spec("H", a.tokens + tuple(range(5000, 5064)), 2))
    h = next(scheduler._waiting_requests())
    hit, num_hit, _ = manager.get_computed_blocks(h)
    assert num_hit == 48
    calls: list[int] = []

    def retry():
        calls.append(1)
        return manager.allocate_slots(h, h.num_tokens - num_hit, num_hit, hit)

    assert manager.allocate_slots(h, h.num_tokens - num_hit, num_hit, hit) is None
    return scheduler.pins, manager, h, hit, retry, calls


def test_0097s_head_pins_its_own_hit_first_and_retries_on_it():
    """0097's pin point: H, not yet pinned (it arrived this step), pins its
    hit (A1-A3) and retries once on the pinned state; short by 3 with
    nothing yieldable outside its hit, it waits, A's grace kept."""
    pins, manager, h, hit, retry, calls = _head_fails(graced=True)
    assert pins.admit_head(h, hit, retry) is None
    assert calls == [1]
    assert [b.block_id for b in manager.pinned_hit_blocks("H")] == [b.block_id for b in hit.blocks[0]]
    assert manager.grace_order() == ["A"] and manager.last_alloc_shortfall == 3


def test_0097s_head_rule_does_nothing_while_nobody_holds_a_pin():
    """Control: the same failure with no grace and no pin held: no pin,
    no retry (the end of the step pins the waiters)."""
    pins, manager, h, hit, retry, calls = _head_fails(graced=False)
    assert pins.admit_head(h, hit, retry) is None
    assert calls == [] and not manager.pinned_hits()


def test_a_grace_is_released_only_if_it_holds_the_deepest_block_of_every_group():
    """0097's match on a two-group hit built by hand from two graces that
    share a system prompt (A: P1 P2 A3, Z: P1 P2 Z3): one group's deepest
    block is A3 (A's alone), the other's P2 (both). Only A holds both: A's
    grace goes, Z's stays, though 48 + 2 x 16 reaches both prompts. A group
    whose hit is only the null block is skipped: Z3 alone releases Z."""
    scheduler = grace_scheduler(64)
    manager = scheduler.kv_cache_manager
    system = tuple(range(500, 532))
    scheduler.add_request(Spec("A", system + tuple(range(1000, 1016)), 3))
    step(scheduler)
    scheduler.add_request(Spec("Z", system + tuple(range(2000, 2016)), 1))
    while scheduler.has_unfinished_requests():
        step(scheduler)
    a3, p2 = manager.grace_pinned_blocks("A")[:2]
    assert p2 is manager.grace_pinned_blocks("Z")[1]
    manager._release_grace_for_hit(([a3], [p2]), 48)
    assert manager.grace_order() == ["Z"]
    # A group with no block past the null block is skipped, not the end.
    z3 = manager.grace_pinned_blocks("Z")[0]
    manager._release_grace_for_hit(([manager.block_pool.null_block], [z3]), 48)
    assert manager.grace_order() == []


@pytest.mark.parametrize(
    ("prompt", "admitted", "graces", "retries"),
    [("A-then-32", False, ["A"], 1), ("32-fresh", True, [], 2)],
    ids=["hits-A", "hits-nothing"],
)
def test_0097s_loop_never_counts_the_heads_own_hit_once_a_retry_fails_again(
    prompt, admitted, graces, retries
):
    """Waiter pins off, so the head pins nothing. B's grace (B1, B2) is
    older than A's (A1-A3); 1 block is free, 2 are reserved. H (A's 48
    tokens + 32) needs 2 new blocks: the full-sequence gate fails by 1,
    covered by B's 2 (A's blocks are H's hit). B yields: 3 free, the gate
    passes, the step (2 against 3 - 2) fails by 1. Only A's grace is left,
    all of it H's hit: H waits, A's grace kept, one retry. Control: a head
    of 32 fresh tokens (same need, no hit) yields A's grace too, the step's
    2 fit 6 - 2, and it is admitted on the second retry."""
    scheduler = grace_scheduler(12, ForkPatches(waiter_pins=False))
    manager, pool = scheduler.kv_cache_manager, scheduler.kv_cache_manager.block_pool
    a = Spec("A", tuple(range(1000, 1048)), 2)
    finish(scheduler, Spec("B", tuple(range(2000, 2032)), 2))
    finish(scheduler, a)
    assert manager.grace_order() == ["B", "A"] and pool.get_num_free_blocks() == 11 - 2 - 3
    pool.get_new_blocks(5)
    fresh = list(range(5000, 5032))
    h = request("H", [*a.tokens, *fresh] if prompt == "A-then-32" else fresh, unit=16)
    hit, num_hit, _ = manager.get_computed_blocks(h)
    assert num_hit == (48 if prompt == "A-then-32" else 0)
    calls: list[int] = []

    def retry():
        calls.append(1)
        gate = {"full_sequence_must_fit": True, "reserved_blocks": 2, "has_scheduled_reqs": False}
        return manager.allocate_slots(h, 32, num_hit, hit, **gate)

    assert retry() is None and manager.last_alloc_shortfall == 2 - 1
    calls.clear()
    assert (scheduler.pins.admit_head(h, hit, retry) is not None) is admitted
    assert manager.grace_order() == graces and len(calls) == retries


# ------------------------------------- the scheduler's own guards (issue 41)
class _Manager:
    """A stand-in pinning manager that counts the calls the scheduler's pin
    points make: every guard tested here is the scheduler's own, before
    the manager's (which would refuse as well)."""

    guards_head_yields = True
    enable_waiter_pins = True

    def __init__(self, *, pinned=0, bound=2, shortfall=1, graces=0) -> None:
        self.num_pinned_waiters, self.max_pinned_waiters = pinned, bound
        self.last_alloc_shortfall, self.num_grace_pins = shortfall, graces
        self.pin_lookup_found_no_hit = False
        self.calls: list[str] = []

    def pin_waiting_hit(self, request) -> int:
        self.calls.append(f"pin {request.request_id}")
        return 0

    def num_yieldable_blocks(self, keep=None, keep_hit=None) -> int:
        return 100

    def yield_pinned_hits(self, keep=None, limit=None) -> int:
        self.calls.append("yield")
        return 0

    def release_pinned_extras(self, request_id, hit) -> int:
        self.calls.append("extras")
        return 0


def _waiting(request_id: str, status: RequestStatus = RequestStatus.WAITING):
    init_none_hash(sha256)  # vLLM's block hasher needs its root hash set
    waiter = request(request_id, tail_tokens(5, 16))
    waiter.status = status
    return waiter


@pytest.mark.parametrize(("pinned", "looked_up"), [(1, ["pin W"]), (2, []), (3, [])])
def test_the_pin_pass_stops_at_the_bound_before_any_lookup(pinned, looked_up):
    """The fork's pass pins "up to the manager's bound": with 2 of 2 pinned
    it stops before the first waiter's lookup (one below: it looks up)."""
    manager = _Manager(pinned=pinned, bound=2)
    SchedulerPins(manager, NoFastPath()).pin_waiters(iter([_waiting("W")]))  # type: ignore[arg-type]
    assert manager.calls == looked_up


@pytest.mark.parametrize(
    ("status", "looked_up"),
    [
        (RequestStatus.WAITING, ["pin W"]),
        (RequestStatus.PREEMPTED, ["pin W"]),
        (RequestStatus.WAITING_FOR_REMOTE_KVS, []),
        (RequestStatus.FINISHED_ABORTED, []),
    ],
)
def test_the_pin_pass_looks_up_only_waiting_or_preempted_waiters(status, looked_up):
    """The pass skips requests that are "neither WAITING nor PREEMPTED"
    (the fork's rule), even with nothing computed."""
    manager = _Manager(pinned=0)
    SchedulerPins(manager, NoFastPath()).pin_waiters(iter([_waiting("W", status)]))  # type: ignore[arg-type]
    assert manager.calls == looked_up


@pytest.mark.parametrize(("shortfall", "calls"), [(0, []), (-1, []), (1, ["pin H"])])
def test_0097s_head_rule_does_nothing_without_a_shortfall(shortfall, calls):
    """0097's rule acts only on a head whose allocation fell short: with
    no shortfall (the failure was not for blocks) it neither pins, yields
    nor retries, whatever graces there are (one here)."""
    manager = _Manager(shortfall=shortfall, graces=1)
    retries: list[int] = []
    head = _waiting("H")
    result = SchedulerPins(manager, NoFastPath()).admit_head(  # type: ignore[arg-type]
        head, type("Hit", (), {"blocks": ()})(), lambda: retries.append(1)
    )
    assert result is None and manager.calls[:1] == calls
    assert retries == []
