"""The fork's prefix-hit pins (patches 0095, 0096, 0097 of
``halt95/qwen38-flash-next-3090s``): waiters' hits pinned until admission,
finished turns' prefixes held as graces until the next turn is admitted,
both yielding before anyone is preempted.

Every expected value is one the fork's tests assert
(``tests/v1/core/prefix_cache/test_partial_prefix_cache_hits.py``), on the
same sizes (``tests/helpers/pins.py``); each test's control turns the
patch's switch off (or breaks its rule) and gets the other value.
"""

from __future__ import annotations

from functools import partial

import pytest
from helpers.pins import (
    BLOCK,
    K,
    Spec,
    assert_pool_clean,
    decode,
    drain_copies,
    finish,
    finish_and_free,
    follow_up,
    free_ids,
    grace_scheduler,
    pinning_manager,
    pins_scheduler_config,
    prefill,
    request,
    run,
    step,
    tail_position,
    tail_tokens,
)
from helpers.scenarios import write_scenario

from sim.fork.patches import ForkPatches
from sim.fork.pins import PinningKVCacheManager
from sim.fork.scheduler_pins import SchedulerPins
from sim.kv_cache_manager import KVCacheManager
from sim.paths import PROJECT_ROOT
from sim.scenario import load_scenario
from sim.sched.fast_path.memos import NoFastPath
from sim.vllm_bridge import RequestStatus

PINS_ON = ForkPatches()
NO_PINS = ForkPatches(waiter_pins=False, grace_pins=False)
NO_GRACES = ForkPatches(grace_pins=False)


def _ids(output) -> set[str]:
    return {item.request_id for item in output.scheduled}


def _non_null(blocks) -> list:
    return [b for group in blocks.blocks for b in group if not b.is_null]


def _finished_first_turn(manager, seed: int = 1):
    first = request("A0", tail_tokens(seed, 150))
    run(manager, first)
    manager.free(first)
    drain_copies(manager)
    return first


# ----------------------------------------------------------- waiter pins (0095)
@pytest.mark.parametrize("fork", [PINS_ON, NO_PINS], ids=["pinned", "control-unpinned"])
def test_a_pinned_waiter_keeps_its_hit_through_another_admission_and_a_burst(fork):
    """0095's first test: A2 waits while B1 is admitted and a burst takes
    every free block. Pinned, A2 resumes at A1's tail (168); unpinned it is
    a total miss (0)."""
    manager = pinning_manager(64, fork)
    pool = manager.block_pool
    a0 = request("A0", tail_tokens(1, 150))
    run(manager, a0)
    b0 = request("B0", tail_tokens(2, 150))
    run(manager, b0)
    manager.free(a0)
    drain_copies(manager)
    a1 = follow_up(a0, 26, seed=3)
    run(manager, a1)
    for finished in (a1, b0):
        manager.free(finished)
        drain_copies(manager)

    a2 = follow_up(a1, 20, seed=4)
    a1_tail = tail_position(a1.num_prompt_tokens)
    hit_blocks = _non_null(manager.get_computed_blocks(a2)[0])
    pinned = manager.pin_waiting_hit(a2) if fork.waiter_pins else 0
    if fork.waiter_pins:
        assert pinned == len(hit_blocks) == 7
        assert manager.pin_waiting_hit(a2) == 0  # idempotent
        assert all(b.ref_cnt == 1 for b in manager.pinned_hit_blocks(a2.request_id))
        assert {b.block_id for b in hit_blocks}.isdisjoint(free_ids(manager))

    b1 = follow_up(b0, 26, seed=5)
    run(manager, b1)
    pool.free_blocks(pool.get_new_blocks(pool.get_num_free_blocks()))

    assert manager.get_computed_blocks(a2)[1] == (a1_tail if fork.waiter_pins else 0)
    assert a1_tail == 168
    prefill(manager, a2)
    assert not manager.pinned_hits() if fork.waiter_pins else True  # admission releases it
    decode(manager, a2, 2)
    manager.free(a2)
    manager.free(b1)
    drain_copies(manager)
    assert_pool_clean(manager, 64)


@pytest.mark.parametrize("bound", [16, 8], ids=["0096-bound-16", "0095-bound-8"])
def test_pins_are_released_on_abort_admission_yield_and_reset_within_the_bound(bound):
    """0095's bookkeeping test, at 0096's bound (16) and 0095's own (8):
    abort releases, the bound refuses one more, yields go newest first and
    keep the head, admission and reset release."""
    manager = pinning_manager(64)
    manager.max_pinned_waiters = bound
    pool = manager.block_pool
    a0 = _finished_first_turn(manager)
    baseline = pool.get_num_free_blocks()

    w1 = follow_up(a0, 20, seed=3, suffix="w1")
    assert manager.pin_waiting_hit(w1) > 0 and pool.get_num_free_blocks() < baseline
    manager.free(w1)  # an abort while pinned
    assert not manager.pinned_hits() and pool.get_num_free_blocks() == baseline

    w2 = follow_up(a0, 21, seed=4, suffix="w2")
    w3 = follow_up(a0, 22, seed=5, suffix="w3")
    assert manager.pin_waiting_hit(w2) > 0 and manager.pin_waiting_hit(w3) > 0
    extra = [follow_up(a0, 24 + i, seed=10 + i, suffix=f"x{i}") for i in range(bound - 1)]
    for waiter in extra[:-1]:
        assert manager.pin_waiting_hit(waiter) > 0
    assert manager.pin_waiting_hit(extra[-1]) == 0  # one past the bound
    assert manager.num_pinned_waiters == bound
    assert manager.yield_pinned_hits(keep=w2.request_id, limit=1) > 0
    assert list(manager.pinned_hits())[-1] == extra[-3].request_id  # newest went first
    assert manager.yield_pinned_hits(keep=w2.request_id) > 0
    assert list(manager.pinned_hits()) == [w2.request_id]
    run(manager, w2)
    assert not manager.pinned_hits()
    manager.free(w2)
    drain_copies(manager)
    assert pool.get_num_free_blocks() == baseline
    assert manager.pin_waiting_hit(w3) > 0
    assert manager.reset_prefix_cache() and not manager.pinned_hits()
    assert_pool_clean(manager, 64)


def test_control_the_bound_of_0095_is_not_the_shipped_one():
    """Control for the bound: at the shipped 16 the 9th waiter is pinned."""
    manager = pinning_manager(64)
    a0 = _finished_first_turn(manager)
    pinned = [manager.pin_waiting_hit(follow_up(a0, 20 + i, seed=3 + i, suffix=f"q{i}")) for i in range(9)]
    assert pinned[8] > 0 and manager.num_pinned_waiters == 9


def test_a_running_request_at_a_full_pool_takes_the_waiters_pin():
    """0095's second test: the pool is full, the only reclaimable blocks are
    a waiter's pin; it yields all its blocks and the running request
    allocates; the waiter is admitted later on what is left."""
    manager = pinning_manager(48)
    pool = manager.block_pool
    a0 = _finished_first_turn(manager)
    a1 = follow_up(a0, 26, seed=3)
    assert manager.pin_waiting_hit(a1) > 0
    pinned_ids = {b.block_id for b in manager.pinned_hit_blocks(a1.request_id)}
    r = request("R", tail_tokens(7, 2 * BLOCK))
    run(manager, r, decode_steps=0)
    taken = pool.get_new_blocks(pool.get_num_free_blocks())
    r.append_output_token_ids(777)
    r.spec_token_ids = [778, 779, 780]
    assert manager.allocate_slots(r, 1 + K, num_lookahead_tokens=K) is None
    assert manager.yield_pinned_hits() == len(pinned_ids)
    assert manager.allocate_slots(r, 1 + K, num_lookahead_tokens=K) is not None
    r.spec_token_ids = []
    r.num_computed_tokens += 1
    manager.new_step_starts()
    drain_copies(manager)
    pool.free_blocks(taken)
    manager.free(r)
    drain_copies(manager)
    assert 0 <= manager.get_computed_blocks(a1)[1] <= tail_position(a1.num_prompt_tokens)
    run(manager, a1)
    manager.free(a1)
    drain_copies(manager)
    assert_pool_clean(manager, 48)


def test_the_pass_pins_the_front_of_the_queue_in_arrival_order():
    """0095's pass: arrival order up to the bound, skipping a request that
    computed tokens (8) and one with nothing cached; idempotent; nothing
    with a KV connector. Control: waiter pins off pins nobody."""
    manager = pinning_manager(96)
    a0 = _finished_first_turn(manager)
    waiters = [
        follow_up(a0, 20 + i, seed=30 + i, suffix=f"q{i}") for i in range(manager.max_pinned_waiters + 2)
    ]
    waiters[1].num_computed_tokens = 8  # a resumed load: not a lookup
    cold = request("COLD", tail_tokens(9, 40))
    pins = SchedulerPins(manager, NoFastPath())
    pins.pin_waiting(lambda skip: iter([cold, *waiters]))
    pinned = list(manager.pinned_hits())
    assert waiters[1].request_id not in pinned and cold.request_id not in pinned
    assert pinned[0] == waiters[0].request_id
    assert len(pinned) == manager.max_pinned_waiters == 16
    assert waiters[-1].request_id not in pinned
    pins.pin_waiting(lambda skip: iter([cold, *waiters]))
    assert list(manager.pinned_hits()) == pinned
    manager.yield_pinned_hits()
    assert_pool_clean(manager, 96)

    for fork, connector in ((PINS_ON, True), (ForkPatches(waiter_pins=False), False)):
        other = pinning_manager(96, fork, kv_connector=connector)
        first = _finished_first_turn(other)
        waiter = follow_up(first, 20, seed=30)
        SchedulerPins(other, NoFastPath()).pin_waiting(lambda skip, waiter=waiter: iter([waiter]))
        assert not other.pinned_hits()


# ------------------------------------------------------- deferred free (0096)
def test_a_pinned_waiter_popped_for_a_fenced_free_releases_its_pin_at_once():
    """0096: the fenced-free path returns [] for a waiter (no table) and
    releases its pin now. Control: the path without the release (kvsim's
    manager's own pop) leaves the pin and the blocks out of the queue."""
    for release in (True, False):
        manager = pinning_manager(64)
        pool = manager.block_pool
        a0 = _finished_first_turn(manager)
        baseline = pool.get_num_free_blocks()
        waiter = follow_up(a0, 20, seed=3)
        assert manager.pin_waiting_hit(waiter) > 0 and pool.get_num_free_blocks() < baseline
        # The control pops through kvsim's manager without the pin patch.
        pop = manager.pop_blocks_for_free if release else partial(KVCacheManager.pop_blocks_for_free, manager)
        assert pop(waiter) == []
        assert (manager.num_pinned_waiters, pool.get_num_free_blocks() == baseline) == (
            (0, True) if release else (1, False)
        )


# ------------------------------------------------------------ grace pins (0097)
def _finish_turns(manager, names, seed: int, num_tokens: int, decode_steps: int, path="immediate"):
    turns = []
    for i, name in enumerate(names):
        turn = request(name, tail_tokens(seed + i, num_tokens))
        run(manager, turn, decode_steps)
        finish_and_free(manager, turn, path)
        turns.append(turn)
    return turns


@pytest.mark.parametrize("fork", [PINS_ON, NO_GRACES], ids=["graces", "control-no-graces"])
def test_graces_yield_before_waiter_pins_oldest_first_and_are_bounded(fork):
    manager = pinning_manager(192, fork)
    finished = _finish_turns(manager, ["F0", "F1", "F2"], 10, 150, 2)
    waiter = follow_up(finished[2], 20, seed=5)
    assert manager.pin_waiting_hit(waiter) > 0
    if not fork.grace_pins:
        assert manager.grace_order() == []  # the waiter's pin is the one to yield
        assert manager.yield_pinned_hits(limit=1) > 0 and not manager.pinned_hits()
        return
    assert manager.grace_order() == ["F0", "F1", "F2"]
    for turn in finished:
        grace = manager.grace_pinned_blocks(turn.request_id)
        assert grace and all(b.block_hash is not None for b in grace)
        assert all(b.ref_cnt == 1 for b in grace) or turn is finished[2]  # F2's: + the waiter's pin
    f0 = manager.grace_pinned_blocks("F0")
    assert manager.yield_pinned_hits(limit=1) == len(f0)
    assert all(b.ref_cnt == 0 for b in f0)
    assert manager.grace_order() == ["F1", "F2"] and waiter.request_id in manager.pinned_hits()
    assert manager.yield_pinned_hits(keep=waiter.request_id, limit=2) > 0
    assert not manager.grace_order() and waiter.request_id in manager.pinned_hits()
    assert all(b.ref_cnt == 1 for b in manager.pinned_hit_blocks(waiter.request_id))

    _finish_turns(manager, [f"G{i}" for i in range(manager.max_grace_pins + 2)], 100, 2 * BLOCK + 9, 1)
    assert manager.num_grace_pins == manager.max_grace_pins == 16
    assert manager.grace_order()[0] == "G2"
    waiter.status = RequestStatus.FINISHED_ABORTED  # an aborted waiter: no output, no grace
    manager.free(waiter)
    assert waiter.request_id not in manager.grace_order() and not manager.pinned_hits()
    assert manager.reset_prefix_cache() and not manager.grace_order()
    assert_pool_clean(manager, 192)


@pytest.mark.parametrize("path", ["immediate", "deferred"])
def test_a_grace_only_for_a_turn_that_finished_with_output(path):
    """Stop, length and an abort after decoding hold a grace; an error, an
    ignored request and a preemption's free (still RUNNING) do not."""
    manager = pinning_manager(96)
    pool = manager.block_pool
    statuses = {
        "stop": RequestStatus.FINISHED_STOPPED,
        "len": RequestStatus.FINISHED_LENGTH_CAPPED,
        "abort": RequestStatus.FINISHED_ABORTED,
        "err": RequestStatus.FINISHED_ERROR,
        "ign": RequestStatus.FINISHED_IGNORED,
        "pre": RequestStatus.RUNNING,
    }
    for i, (name, status) in enumerate(statuses.items()):
        turn = request(name, tail_tokens(i + 1, 2 * BLOCK + 9))
        run(manager, turn, 1)
        finish_and_free(manager, turn, path, status)
    assert manager.grace_order() == ["stop", "len", "abort"]
    held = manager.num_grace_pinned_blocks
    assert held > 0 and pool.get_num_free_blocks() == 96 - 1 - held
    assert manager.yield_pinned_hits() == held
    assert_pool_clean(manager, 96)


def test_graces_are_off_at_a_block_sized_unit_and_with_a_connector():
    """The fork turns graces on only for sub-block hits and no connector
    (the U=4096 lane has none); the control is the fine unit."""
    assert pinning_manager(96).enable_grace_pins
    assert not pinning_manager(96, hash_block_size=BLOCK).enable_grace_pins
    assert not pinning_manager(96, kv_connector=True).enable_grace_pins


@pytest.mark.parametrize("fork", [PINS_ON, NO_GRACES], ids=["graces", "control-no-graces"])
def test_a_running_request_at_a_full_pool_yields_exactly_one_grace(fork):
    """0097: graces fill the pool with the running request; it needs one
    more block: one yield (the oldest, F0), graces left [F1, F2], the
    shortfall > 0 then 0. Without graces their blocks are free: no yield."""
    manager = pinning_manager(40, fork)
    pool = manager.block_pool
    r = request("R", tail_tokens(7, 2 * BLOCK))
    run(manager, r, decode_steps=0)
    _finish_turns(manager, ["F0", "F1", "F2"], 20, 2 * BLOCK + 9, 1)
    taken = pool.get_new_blocks(pool.get_num_free_blocks())
    r.append_output_token_ids(777)
    r.spec_token_ids = [778, 779, 780]
    blocks = manager.allocate_slots(r, 1 + K, num_lookahead_tokens=K)
    assert blocks is None and manager.last_alloc_shortfall > 0
    if not fork.grace_pins:
        # Nothing to yield: the scheduler would preempt a victim.
        assert manager.yield_pinned_hits(limit=1) == 0
        pool.free_blocks(taken)
        taken = []
    yields = 0
    while blocks is None:
        assert manager.yield_pinned_hits(limit=1) > 0 or not fork.grace_pins, "nothing left to yield"
        yields += 1
        blocks = manager.allocate_slots(r, 1 + K, num_lookahead_tokens=K)
    assert manager.last_alloc_shortfall == 0
    if fork.grace_pins:
        assert yields == 1 and manager.grace_order() == ["F1", "F2"]
    r.spec_token_ids = []
    r.num_computed_tokens += 1
    manager.new_step_starts()
    drain_copies(manager)
    pool.free_blocks(taken)
    finish_and_free(manager, r)
    manager.yield_pinned_hits()
    assert_pool_clean(manager, 40)


def test_yieldable_blocks_never_count_the_head_waiters_own_hit():
    manager = pinning_manager(96)
    a0 = request("A0", tail_tokens(1, 150))
    run(manager, a0)
    finish_and_free(manager, a0)
    grace = manager.grace_pinned_blocks("A0")
    assert manager.num_yieldable_blocks() == len(grace)
    a1 = follow_up(a0, 26, seed=3)
    assert manager.pin_waiting_hit(a1) > 0
    own = {id(b) for b in manager.pinned_hit_blocks(a1.request_id)}
    assert manager.num_yieldable_blocks(keep=a1.request_id) == len([b for b in grace if id(b) not in own])
    assert manager.num_yieldable_blocks() == len({id(b) for b in grace} | own)
    run(manager, a1)  # the admission releases both the pin and A0's grace
    assert not manager.grace_order() and not manager.pinned_hits()
    finish_and_free(manager, a1)
    manager.yield_pinned_hits()
    assert_pool_clean(manager, 96)


# ------------------------------------------------ the scheduler's pin points
def test_the_scheduler_yields_a_grace_instead_of_preempting():
    """0097 on the scheduler: A's grace (3 blocks) and R's 8 fill the 11
    usable blocks; R's 129th token needs a 9th: A's grace yields, nobody is
    preempted, and R's own grace is the one left. Control: without the
    graces A's blocks are free and R never needs a yield."""
    for fork in (PINS_ON, NO_PINS):
        scheduler = grace_scheduler(12, fork)
        manager, pool = scheduler.kv_cache_manager, scheduler.kv_cache_manager.block_pool
        finish(scheduler, Spec("A", tuple(range(1000, 1048)), 2))
        graces = fork.grace_pins
        assert pool.get_num_free_blocks() == (8 if graces else 11)
        scheduler.add_request(Spec("R", tuple(range(2000, 2128)), 4))
        assert "R" in _ids(step(scheduler))
        assert pool.get_num_free_blocks() == (0 if graces else 3)
        output = step(scheduler)
        assert "R" in _ids(output) and not output.preempted_request_ids
        if graces:
            assert manager.num_grace_pins == 0
        while scheduler.has_unfinished_requests():
            step(scheduler)
        if graces:
            assert manager.grace_order() == ["R"]
            manager.yield_pinned_hits()
        assert pool.get_num_free_blocks() == 11


def test_the_head_waiter_yields_graces_only_when_they_cover_its_shortfall():
    scheduler = grace_scheduler(12)
    manager, pool = scheduler.kv_cache_manager, scheduler.kv_cache_manager.block_pool
    finish(scheduler, Spec("A", tuple(range(1000, 1048)), 2))
    scheduler.add_request(Spec("R", tuple(range(2000, 2112)), 6))
    step(scheduler)
    assert pool.get_num_free_blocks() == 1
    scheduler.add_request(Spec("W", tuple(range(3000, 3064)), 2))
    assert "W" not in _ids(step(scheduler))
    assert manager.grace_pinned_blocks("A")  # 4 > 0 free + 3 yieldable: nothing yields
    while "R" in scheduler.requests:
        assert "W" not in _ids(step(scheduler))
    # R finished: graces A (3) and R (7), 1 free; W's 4 are covered and the
    # oldest grace (A's) is enough.
    assert "W" in _ids(step(scheduler))
    assert "A" not in manager.grace_order() and "R" in manager.grace_order()
    while scheduler.has_unfinished_requests():
        step(scheduler)
    manager.yield_pinned_hits()
    assert pool.get_num_free_blocks() == 11


def test_a_follow_up_takes_its_turns_grace_over_and_a_system_prompt_hit_takes_none():
    """A's next turn is admitted on A's grace and releases it (no double
    ref); C, sharing only the 2-block system prompt, releases no grace."""
    scheduler = grace_scheduler(32)
    manager, pool = scheduler.kv_cache_manager, scheduler.kv_cache_manager.block_pool
    system = tuple(range(500, 532))
    finish(scheduler, Spec("A", system + tuple(range(1000, 1048)), 2))
    finish(scheduler, Spec("B", system + tuple(range(2000, 2048)), 2))
    grace = manager.grace_pinned_blocks("A")
    assert len(grace) == 5 and len(manager.grace_pinned_blocks("B")) == 5
    scheduler.add_request(Spec("C", system + tuple(range(3000, 3040)), 2))
    output = step(scheduler)
    assert output.admitted_hits["C"] == 32 and set(manager.grace_order()) == {"A", "B"}
    a_tokens = system + tuple(range(1000, 1048)) + (7, 7)
    scheduler.add_request(Spec("A2", a_tokens + tuple(range(4000, 4030)), 2))
    output = step(scheduler)
    assert output.admitted_hits["A2"] == 80
    assert "A" not in manager.grace_order() and "B" in manager.grace_order()
    shared = {id(b) for b in manager.grace_pinned_blocks("B")}
    for block in grace:  # A2's table (+ C's table and B's grace on the system blocks)
        assert block.ref_cnt == 1 + 2 * (id(block) in shared)
    while scheduler.has_unfinished_requests():
        step(scheduler)
    manager.yield_pinned_hits()
    assert pool.get_num_free_blocks() == 31


def _proof_pin_scene():
    """The fork's scene: 99 usable blocks, the EAGLE drop on. A (80 tokens)
    and B (16) finished with graces; R took every free block and its first
    decode made A's grace (the oldest) yield; R consumed A's 5th block, A's
    first four stay cached at ref 0: 4 free, B's grace the only pin."""
    scheduler = grace_scheduler(100, eagle=True)
    manager, pool = scheduler.kv_cache_manager, scheduler.kv_cache_manager.block_pool
    a = Spec("A", tuple(range(1000, 1080)), 2)
    finish(scheduler, a)
    finish(scheduler, Spec("B", tuple(range(2000, 2016)), 2))
    assert pool.get_num_free_blocks() == 93
    r = Spec("R", tuple(range(3000, 4488)), 4)
    scheduler.add_request(r)
    assert step(scheduler).scheduled[0].num_scheduled_tokens == 1488 and pool.get_num_free_blocks() == 0
    assert not step(scheduler).preempted_request_ids
    assert manager.grace_order() == ["B"] and pool.get_num_free_blocks() == 4
    return scheduler, manager, pool, a


def _cached(pool, spec: Spec, index: int):
    probe = request("probe", list(spec.tokens), unit=16)
    cached = pool.get_cached_block(probe.block_hashes[index], [0])
    return None if cached is None else cached[0]


def test_the_head_waiter_measures_its_shortfall_after_pinning_its_proof_block():
    """H resends A's prompt: 4 cached blocks, the drop returns 3, the 4th is
    the proof block. Short by 1 before its own pin, by 2 after it; it gives
    the proof block back and B's grace covers the rest: admitted on 48."""
    scheduler, manager, pool, a = _proof_pin_scene()
    assert _cached(pool, a, 3).ref_cnt == 0 and _cached(pool, a, 4) is None
    scheduler.add_request(Spec("H", a.tokens, 2))
    output = step(scheduler)
    assert output.admitted_hits["H"] == 48 and output.scheduled[-1].num_scheduled_tokens == 32
    assert not manager.pinned_hits() and not manager.grace_order()
    assert pool.get_num_free_blocks() == 0 and not output.preempted_request_ids
    while scheduler.has_unfinished_requests():
        step(scheduler)
    manager.yield_pinned_hits()
    assert pool.get_num_free_blocks() == 99


def test_the_head_waiter_keeps_every_pin_when_nothing_covers_it():
    """H one block longer: short by 3 after its pin, its proof block and B's
    grace give 2: nothing yields; once R finished H is admitted on 48."""
    scheduler, manager, pool, a = _proof_pin_scene()
    scheduler.add_request(Spec("H", a.tokens + tuple(range(5000, 5016)), 2))
    assert "H" not in _ids(step(scheduler))
    assert manager.grace_pinned_blocks("B"), "B's grace yielded for nothing"
    assert len(manager.pinned_hit_blocks("H")) == 4 and _cached(pool, a, 3).ref_cnt == 1
    assert pool.get_num_free_blocks() == 0
    while "R" in scheduler.requests:
        step(scheduler)
    output = step(scheduler)
    assert [item.num_scheduled_tokens for item in output.scheduled if item.request_id == "H"] == [96 - 48]
    assert not manager.pinned_hit_blocks("H")
    while scheduler.has_unfinished_requests():
        step(scheduler)
    manager.yield_pinned_hits()
    assert pool.get_num_free_blocks() == 99


@pytest.mark.parametrize("fork", [PINS_ON, NO_GRACES], ids=["0097", "control-0095-head-rule"])
def test_a_head_waiter_needing_the_whole_pool_gives_its_proof_block_back(fork):
    """A finished (grace on its 3 blocks); H = A's prompt + 1535 tokens
    needs all 99 blocks. It pins its hit and the proof block, gives the
    proof block back, A's grace yields: admitted on 32 with H's grace left.
    Control: 0095's head rule (no graces, yield the others and retry once)
    has nothing to yield and keeps H's own pin: H waits."""
    scheduler = grace_scheduler(100, fork, eagle=True)
    manager, pool = scheduler.kv_cache_manager, scheduler.kv_cache_manager.block_pool
    a = Spec("A", tuple(range(1000, 1048)), 2)
    finish(scheduler, a)
    scheduler.add_request(Spec("H", a.tokens + tuple(range(5000, 6535)), 1))
    output = step(scheduler)
    if fork.grace_pins:
        assert pool.get_num_free_blocks() == 0 or "H" not in scheduler.requests
        assert [i.num_scheduled_tokens for i in output.scheduled] == [1583 - 32]
        assert not manager.pinned_hit_blocks("H") and manager.grace_order() == ["H"]
        manager.yield_pinned_hits()
        assert pool.get_num_free_blocks() == 99
    else:
        assert output.admitted_hits["H"] == 32  # A's blocks were free: no grace, no pin needed


def test_releasing_the_extras_drops_only_the_proof_block_past_the_hit():
    scheduler = grace_scheduler(100, eagle=True)
    manager, pool = scheduler.kv_cache_manager, scheduler.kv_cache_manager.block_pool
    a = Spec("A", tuple(range(1000, 1048)), 2)
    finish(scheduler, a)
    scheduler.add_request(Spec("H", a.tokens + tuple(range(5000, 5064)), 2))
    h = next(scheduler._waiting_requests())
    hit, num_hit, _ = manager.get_computed_blocks(h)
    assert num_hit == 32 and len(hit.blocks[0]) == 2
    assert manager.pin_waiting_hit(h) == 3  # A1, A2 and the proof A3
    a3 = _cached(pool, a, 2)
    assert a3.ref_cnt == 2
    assert manager.num_yieldable_blocks(keep="H") == 0
    assert manager.num_yieldable_blocks(keep="H", keep_hit=hit.blocks) == 1
    assert manager.release_pinned_extras("H", hit.blocks) == 1
    assert manager.release_pinned_extras("H", hit.blocks) == 0
    assert [b.block_id for b in manager.pinned_hit_blocks("H")] == [b.block_id for b in hit.blocks[0]]
    assert a3.ref_cnt == 1 and pool.get_num_free_blocks() == 96
    assert manager.num_yieldable_blocks(keep="H") == 1
    manager.yield_pinned_hits(keep="H")
    assert a3.ref_cnt == 0 and pool.get_num_free_blocks() == 97
    manager.release_pinned_hit("H")
    assert pool.get_num_free_blocks() == 99


def _arrival_gap(fork: ForkPatches, path: str):
    """0097's reproduction: A1 finished, A2 not looked up yet; B1's
    admission frees dead blocks after A1's prefix and the running set then
    takes as many blocks as are free besides A1's. Returns (manager, A1,
    A2, A1's hashed block ids, the blocks the gap took)."""
    manager = pinning_manager(64, fork)
    pool = manager.block_pool
    a0 = request("A0", tail_tokens(1, 150))
    run(manager, a0)
    finish_and_free(manager, a0, path)
    a1 = follow_up(a0, 26, seed=3)
    run(manager, a1)
    held = [b for m in manager.managers for b in m.req_to_blocks[a1.request_id]]
    a1_ids = {id(b) for b in held if not b.is_null and b.block_hash is not None}
    finish_and_free(manager, a1, path)
    b0 = request("B0", tail_tokens(2, 150))
    run(manager, b0)
    finish_and_free(manager, b0, path)
    run(manager, follow_up(b0, 26, seed=5))  # B1 stays running
    dead = [b for b in pool.free_block_queue.get_all_free_blocks() if id(b) not in a1_ids]
    gap = pool.get_new_blocks(len(dead))
    return manager, a1, follow_up(a1, 20, seed=4), a1_ids, gap


@pytest.mark.parametrize("path", ["immediate", "deferred"])
@pytest.mark.parametrize("fork", [PINS_ON, NO_GRACES], ids=["graces", "control-no-graces"])
def test_a_finished_turns_grace_keeps_its_attention_prefix_through_the_arrival_gap(fork, path):
    """The grace holds every hashed block of A1 on both free paths: A1's
    whole attention prefix is still cached when A2 arrives. Without it LRU
    took A1's older blocks first."""
    manager, a1, _, _, _ = _arrival_gap(fork, path)
    pool = manager.block_pool
    # Attention keys sit at block ends (every 4th unit of 8 tokens).
    ends = range(BLOCK // 8 - 1, a1.num_prompt_tokens // 8, BLOCK // 8)
    cached = [pool.get_cached_block(a1.block_hashes[i], [0]) for i in ends]
    assert len(cached) == a1.num_prompt_tokens // BLOCK
    assert all(cached) is fork.grace_pins
    assert ("A0+" in manager.grace_order()) is fork.grace_pins


@pytest.mark.parametrize("path", ["immediate", "deferred"])
def test_the_next_turn_resumes_at_the_finished_turns_tail_after_the_arrival_gap(path):
    """The fork's asserted value: A2's hit is A1's tail (168; 0 before 0097),
    and A2's admission takes the grace over (no double ref). Needs 0093's
    tail hold too: the grace holds A1's moved tail state."""
    manager, a1, a2, a1_ids, gap = _arrival_gap(PINS_ON, path)
    assert manager.get_computed_blocks(a2)[1] == tail_position(a1.num_prompt_tokens) == 168
    manager.block_pool.free_blocks(gap)  # the running set finishes: room for A2's own blocks
    prefill(manager, a2)
    assert "A0+" not in manager.grace_order()
    for block in manager.managers[0].req_to_blocks[a2.request_id]:
        assert id(block) not in a1_ids or block.ref_cnt == 1


@pytest.mark.parametrize("path", ["immediate", "deferred"])
def test_without_graces_the_arrival_gap_loses_the_next_turns_hit(path):
    """Control (the fork before 0097): nobody holds A1's blocks through the
    gap, the burst evicts them and A2 hits nothing."""
    manager, _, a2, _, _ = _arrival_gap(NO_GRACES, path)
    assert manager.get_computed_blocks(a2)[1] == 0


# ------------------------------------------------------- the scenario's keys
def _tiny_scenario(tmp_path, unit: int | None, fork: dict):
    """The fork's partial-hit shape on the tiny model (block 32): a burst of
    requests sharing a 96-token prefix, the allocator checked every step."""
    deployment = {"kv_cache_memory_bytes": 60_000_000, "max_model_len": 4096}
    if unit is not None:
        deployment["prefix_match_unit"] = unit
    path = write_scenario(
        tmp_path,
        "pins",
        model=str(PROJECT_ROOT / "tests" / "data" / "tiny-flash-next.yaml"),
        layouts=["on"],
        deployment=deployment,
        fork=fork,
        workload={
            "trace": "synthetic",
            "num_requests": 12,
            "arrival": {"process": "constant", "rate_per_s": 20.0},
            "prompt": {"distribution": "fixed", "tokens": 150},
            # Long enough that later arrivals wait while the first decode
            # (with 4 output tokens the rig's clock since issue 39 admits
            # every arrival before the prefix is cached: no pin).
            "output": {"distribution": "fixed", "tokens": 40},
            "shared_prefix_tokens": 96,
            "prefix_unit": 8,
        },
        simulation={"check_invariants": True, "sample_interval_s": None},
    )
    return load_scenario(str(path))


@pytest.mark.parametrize(
    ("unit", "fork", "expected"),
    [
        (8, {}, (PinningKVCacheManager, True, True)),
        (None, {"grace_pins": True}, (PinningKVCacheManager, True, False)),  # unit == block: inactive
        (8, {"waiter_pins": False, "grace_pins": False}, (KVCacheManager, None, None)),
        (8, "upstream", (KVCacheManager, None, None)),
    ],
    ids=["shipped-unit-8", "graces-at-the-block-unit", "pins-off", "upstream"],
)
def test_the_fork_section_switches_the_pins_and_runs_check_every_step(
    tmp_path, monkeypatch, unit, fork, expected
):
    """The ``fork:`` keys pick the manager; graces set on at unit == block
    run inactive, as the fork ships them (docs/fork-patches.md). Every step
    passes the allocator checker, pins counted as holders."""
    from sim.analysis.runs import run_scenario
    from sim.engine import Simulation

    loaded = _tiny_scenario(tmp_path, unit, fork)
    manager = Simulation(loaded, "on", workload=None).kv_cache_manager  # type: ignore[arg-type]
    assert type(manager) is expected[0]
    assert getattr(manager, "enable_waiter_pins", None) is expected[1]
    assert getattr(manager, "enable_grace_pins", None) is expected[2]
    pinned: list[int] = []
    pin = PinningKVCacheManager.pin_waiting_hit
    monkeypatch.setattr(
        PinningKVCacheManager, "pin_waiting_hit", lambda m, r: pinned.append(pin(m, r)) or pinned[-1]
    )
    graced: list[int] = []
    grace = PinningKVCacheManager._take_grace_pin
    monkeypatch.setattr(
        PinningKVCacheManager, "_take_grace_pin", lambda m, r: graced.append(grace(m, r)) or graced[-1]
    )
    requests = run_scenario(loaded).requests
    assert requests["finished"].all() and len(requests) == 12
    # The burst's waiters pin the shared prefix; finished turns hold graces.
    assert (any(pinned), any(graced)) == (bool(expected[1]), bool(expected[2]))


def test_the_fast_path_gives_the_same_frames_with_pins(tmp_path):
    """Every pin change voids the fast path's idle-waiting memo (rule 3):
    the pin scenario's frames are the same with and without it."""
    from helpers.fast_path import frames_with_fast_path

    loaded = _tiny_scenario(tmp_path, 8, {})
    assert frames_with_fast_path(loaded, "on", True) == frames_with_fast_path(loaded, "on", False)


def _random_prompt(rng, kind: str, usable: int, max_tokens: int, prompts: list, finished: list) -> list[int]:
    """The fork's mix: fresh, a cut of a seen prompt, a finished turn's
    follow-up, or a cached prompt extended to fill the pool exactly."""
    if kind == "fresh" or not prompts:
        return [rng.randint(1, 50_000) for _ in range(rng.randint(1, max(1, usable * 16 - max_tokens)))]
    if kind == "prefix":
        base = rng.choice(prompts)
        return base[: rng.randint(1, len(base))] + [rng.randint(1, 50_000) for _ in range(rng.randint(1, 48))]
    if kind == "follow" and finished:
        return rng.choice(finished) + [rng.randint(1, 50_000) for _ in range(rng.randint(1, 64))]
    base = rng.choice(finished or prompts)
    return base + [rng.randint(1, 50_000) for _ in range(max(usable * 16 - 1 - len(base), 1))]


def _waits(scheduler, request_id: str) -> bool:
    return any(entry.request_id == request_id for entry in scheduler.waiting)


@pytest.mark.parametrize("seed", range(60))
def test_a_random_mix_keeps_every_ref_accounted_and_an_idle_head_admitted(seed):
    """The fork's random-mix test on kvsim's scheduler (60 of its 200
    seeds): after every step the allocator checker accounts for every ref
    (tables, waiter pins, graces), and a head waiter that fits an idle
    pool is admitted within three passes; nothing leaks at the end."""
    import random

    from sim.allocator_invariants import check_allocator

    rng = random.Random(seed)
    num_blocks = rng.randint(16, 40)
    usable = num_blocks - 1
    scheduler = grace_scheduler(num_blocks, eagle=rng.random() < 0.7)
    manager = scheduler.kv_cache_manager
    prompts: list[list[int]] = []
    finished: list[list[int]] = []
    live: set[str] = set()
    prompts_of: dict[str, list[int]] = {}
    tokens_of: dict[str, list[int]] = {}
    stuck = 0
    for index in range(80):
        if len(live) < 4 and rng.random() < 0.6:
            kind = rng.choice(["fresh", "prefix", "follow", "exact", "exact"])
            max_tokens = 1 if kind == "exact" else rng.randint(1, 6)
            tokens = _random_prompt(rng, kind, usable, max_tokens, prompts, finished)[
                : usable * 16 - max_tokens
            ]
            prompts.append(tokens)
            scheduler.add_request(Spec(f"q{index}", tuple(tokens), max_tokens))
            live.add(f"q{index}")
            prompts_of[f"q{index}"] = tokens
        if live and rng.random() < 0.08:
            scheduler.finish_requests(rng.choice(sorted(live)), RequestStatus.FINISHED_ABORTED)
        head = next(scheduler._waiting_requests()) if scheduler.waiting and not scheduler.running else None
        output = step(scheduler)
        check_allocator(manager)
        if head is not None and -(-(head.num_prompt_tokens + head.max_tokens) // 16) <= usable:
            stuck = 0 if head.request_id in _ids(output) else stuck + 1
            assert stuck < 3, f"seed {seed}: head {head.request_id} not admitted on an idle pool"
        tokens_of.update({r.request_id: list(r.all_token_ids) for r in scheduler.running})
        for request_id in sorted(live):
            if request_id not in scheduler.requests and not _waits(scheduler, request_id):
                live.discard(request_id)
                if len(tokens_of.get(request_id, ())) > len(prompts_of[request_id]):
                    finished.append(tokens_of[request_id])  # a finished turn, with its outputs
    scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    step(scheduler)
    manager.yield_pinned_hits()
    check_allocator(manager)
    assert manager.block_pool.get_num_free_blocks() == usable


def test_control_the_checker_finds_a_pin_nobody_accounts_for(monkeypatch):
    """The random mix's checker counts pins and graces as holders: hide
    them and a pinned block's ref is reported."""
    from sim.allocator_invariants import AllocatorInvariantError, check_allocator

    manager = pinning_manager(64)
    a0 = _finished_first_turn(manager)
    assert manager.pin_waiting_hit(follow_up(a0, 20, seed=3)) > 0
    check_allocator(manager)
    monkeypatch.setattr(PinningKVCacheManager, "pin_holders", lambda self: [])
    with pytest.raises(AllocatorInvariantError):
        check_allocator(manager)


def test_the_checker_sees_pins_through_the_fast_paths_door():
    """With the fast path on, the scheduler's manager is the door, and the
    invariant checker is handed the door: a pin it held must still count as
    a holder there (the door passes ``pin_holders`` through). The control
    is the test above: a checker blind to pins reports the pinned block."""
    from sim.allocator_invariants import check_allocator
    from sim.sched.fast_path.kv_cache_manager import FastPathKVCacheManager

    manager = pinning_manager(64)
    a0 = _finished_first_turn(manager)
    assert manager.pin_waiting_hit(follow_up(a0, 20, seed=3)) > 0
    door = FastPathKVCacheManager(manager, pins_scheduler_config(manager.block_pool.hash_block_size))
    assert door.pin_holders() == manager.pin_holders() != []
    check_allocator(door)
