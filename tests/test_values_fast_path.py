"""Value tests of the fast path's memos (``sim/sched/fast_path/memos.py``,
``sim/sched/fast_path/missed_lookups.py``) that the audits and frame comparisons do
not pin: the counts the memos keep, per waiter, and the fast path off.
Expected values are worked by hand from the rules in ``sim/sched/fast_path``'s
docstring (rules 10-11), each with its control.
"""

from __future__ import annotations

import inspect
from collections import Counter, deque
from types import SimpleNamespace

import pytest
from helpers import pins
from helpers.fast_path import audited, one_request
from helpers.pins import Spec, finish
from helpers.scheduler import CheckedEngine, tiny_scheduler, tiny_spec

from sim.allocator_invariants import allocator_snapshot
from sim.fork.scheduler_pins import SchedulerPins
from sim.sched.fast_path.kv_cache_manager import FastPathKVCacheManager, settled_steps
from sim.sched.fast_path.memos import FastPath, NoFastPath
from sim.sched.fast_path.missed_lookups import MissedPinLookups
from sim.sched.fast_path.settled import SettledSteps
from sim.sched.fast_path.waiting_queue import WaitingQueue
from sim.sched.scheduler import Scheduler, _StepState
from sim.vllm_bridge import BlockPool, KVCacheManager, RequestStatus, init_none_hash, kv_cache_utils, sha256


def _pool() -> BlockPool:
    """vLLM's own block pool, eight 16-token blocks, caching on."""
    return BlockPool(8, enable_caching=True, hash_block_size=16)


def _insert(pool: BlockPool, key: bytes, block_id: int) -> None:
    """What vLLM's caching calls to put ``key`` -> block in the cached-hash map."""
    pool._insert_block_hash(key, pool.blocks[block_id], num_tokens=16)


def _key(request, unit: int = 0, group_id: int = 0) -> bytes:
    """vLLM's key for ``request``'s hash unit ``unit`` in a group."""
    return kv_cache_utils.make_block_hash_with_group_id(request.block_hashes[unit], group_id)


def _waiter(name: str, seed: int):
    init_none_hash(sha256)  # vLLM's block hasher needs its root hash set
    return pins.request(name, pins.tail_tokens(seed, 40))


def test_a_fresh_memo_has_counted_nothing_and_counts_each_insertion_once():
    """Three new (hash, block) pairs: three counted, each inserted into
    vLLM's map."""
    pool = _pool()
    memo = MissedPinLookups(pool)
    assert (memo.num_hash_insertions, memo.num_waiter_changes) == (0, 0)
    for index in range(1, 4):
        _insert(pool, bytes([index]) * 36, index)
    assert memo.num_hash_insertions == 3
    assert [
        pool.cached_block_hash_to_block.get_one_block(bytes([i]) * 36) for i in range(1, 4)
    ] == pool.blocks[1:4]


def test_only_a_pair_the_map_lacks_counts_as_an_insertion():
    """vLLM returns at once for a pair its map already holds (a decode's
    caching re-keys the prompt's partial tail every step): not counted, and
    the memo lives on. The same key on another block, and a pair again
    after a prefix-cache reset (a new map), are new pairs and count."""
    pool = _pool()
    memo = MissedPinLookups(pool)
    waiter = _waiter("a", 1)
    _insert(pool, _key(waiter), 1)
    memo.found_no_hit(waiter)
    _insert(pool, _key(waiter), 1)  # held already: vLLM inserts nothing
    assert memo.num_hash_insertions == 1 and memo.knows_no_hit(waiter)
    _insert(pool, _key(waiter), 2)
    assert memo.num_hash_insertions == 2 and not memo.knows_no_hit(waiter)
    pool.blocks[1].reset_hash()
    pool.blocks[2].reset_hash()
    pool.cached_block_hash_to_block = type(pool.cached_block_hash_to_block)()  # as a reset does
    _insert(pool, _key(waiter), 1)
    assert memo.num_hash_insertions == 3


def test_every_waiter_with_no_hit_is_remembered_until_one_of_its_hashes_is_inserted():
    """Rule 10 per waiter: two lookups with no hit, both known. A key of
    neither (another prompt's) leaves both; one of a's hashes, in any group
    and at any unit (its second of five 8-token units here), forgets a only
    (control: a memo that forgets on every insertion, or on none)."""
    pool = _pool()
    memo = MissedPinLookups(pool)
    a, b, other = _waiter("a", 1), _waiter("b", 2), _waiter("other", 3)
    memo.found_no_hit(a)
    memo.found_no_hit(b)
    assert memo.knows_no_hit(a) and memo.knows_no_hit(b)
    _insert(pool, _key(other), 1)
    assert memo.knows_no_hit(a) and memo.knows_no_hit(b)
    _insert(pool, _key(a, unit=1, group_id=2), 2)
    assert not memo.knows_no_hit(a) and memo.knows_no_hit(b)
    _insert(pool, _key(b, unit=0, group_id=1), 3)
    assert not memo.knows_no_hit(b)


def test_a_memo_holds_only_for_the_same_request_its_tokens_and_its_hashes():
    """Rule 10's three conditions each alone (issue 41: dropping any one
    passed every test; each holds only where the others do not already
    follow from it). The same request id in a new request (an id reused
    after an abort) is another request; one token more that completes no
    8-token unit changes the tokens and not the hashes; a hash added with
    the tokens unchanged (a lookahead hash computed late) changes the
    hashes alone. Control: with all three unchanged the memo holds."""
    pool = _pool()
    memo = MissedPinLookups(pool)
    a = _waiter("a", 1)  # 40 tokens, five whole 8-token units
    memo.found_no_hit(a)
    assert memo.knows_no_hit(a)
    assert not memo.knows_no_hit(_waiter("a", 1))  # same id, tokens and hashes
    a.append_output_token_ids(7)
    assert (a.num_tokens, len(a.block_hashes)) == (41, 5)
    assert not memo.knows_no_hit(a)
    b = _waiter("b", 2)
    memo.found_no_hit(b)
    b.block_hashes.append(b.block_hashes[-1])
    assert b.num_tokens == 40 and not memo.knows_no_hit(b)


def test_a_lookup_after_an_insertion_is_remembered_at_once():
    """A hash inserted before a lookup with no hit: that lookup already saw
    it, so it is known (no second lookup); the other waiter, remembered
    before its own hash went in, is not."""
    pool = _pool()
    memo = MissedPinLookups(pool)
    a, b = _waiter("a", 1), _waiter("b", 2)
    memo.found_no_hit(b)
    _insert(pool, _key(a), 1)
    _insert(pool, _key(b), 2)
    memo.found_no_hit(a)
    assert memo.knows_no_hit(a)
    assert not memo.knows_no_hit(b)


def test_memos_past_the_bound_are_all_forgotten(monkeypatch):
    """Memory stays bounded: a memo that would pass the remembered hashes'
    bound drops every memo first (each then costs one lookup), and itself
    is kept. Five 8-token units each: a bound of 10 holds a and b, c drops both."""
    monkeypatch.setattr(MissedPinLookups, "MAX_REMEMBERED_HASHES", 10)
    memo = MissedPinLookups(_pool())
    a, b, c = _waiter("a", 1), _waiter("b", 2), _waiter("c", 3)
    assert len(a.block_hashes) == 5
    memo.found_no_hit(a)
    memo.found_no_hit(b)
    assert memo.knows_no_hit(a) and memo.knows_no_hit(b)
    memo.found_no_hit(c)
    assert not memo.knows_no_hit(a) and not memo.knows_no_hit(b) and memo.knows_no_hit(c)


def test_after_a_drop_the_bound_counts_the_kept_memo_alone(monkeypatch):
    """The drop starts the count again from the memo it keeps: with a bound
    of 10, c (5 hashes) is kept after the drop and d (5 more, 10 in all,
    not past it) joins it (control: a count restarted at 1, 11 with d,
    drops c again)."""
    monkeypatch.setattr(MissedPinLookups, "MAX_REMEMBERED_HASHES", 10)
    memo = MissedPinLookups(_pool())
    for name, seed in (("a", 1), ("b", 2), ("c", 3)):
        memo.found_no_hit(_waiter(name, seed))
    c, d = memo._missed["c"][0], _waiter("d", 4)
    memo.found_no_hit(d)
    assert memo.knows_no_hit(c) and memo.knows_no_hit(d)


def test_a_pass_memo_counts_waiter_changes_from_zero():
    """An idle pass remembered before any change holds until the first."""
    memo = MissedPinLookups(_pool())
    waiting = deque([_waiter("a", 1)])
    memo.pass_ends(waiting, (), pinned=False)
    assert memo.knows_idle_pass(waiting, ())
    memo.num_waiter_changes += 1
    assert not memo.knows_idle_pass(waiting, ())


def test_the_fast_path_off_makes_every_call_and_remembers_nothing():
    """``NoFastPath``: no lane, no call skipped, no waiting inputs."""
    off = NoFastPath()
    waiter = _waiter("a", 1)
    assert off.audit is False
    assert off.make_lane(None) is None and off.make_async_lane() is None  # type: ignore[arg-type]
    assert not off.skips_waiting(None) and not off.skips_pin_pass(())  # type: ignore[arg-type]
    loops: list[object] = []
    assert (
        off.admission(waiter, 4, lambda: "made") == "made" and off.admission(waiter, 4, lambda: None) is None
    )
    for call in (
        off.waiting_request_changes,
        lambda: off.waiting_loop("step", loops.append),  # type: ignore[arg-type]
        lambda: off.waiter_admitted(waiter),
        lambda: off.pin_pass_ends(()),
        off.waiting_tokens_change,
    ):
        assert call() is None
    assert loops == ["step"]  # the loop made, once


# ------------------------------------------------ the waiting loop's audit


def _one_token_waiter() -> Scheduler:
    """The tiny scheduler (K = 3, 400 blocks) with a 1-token prompt waiting:
    vLLM pads its admission to 1 + K = 4 rows beside a scheduled running
    request when no prefill is scheduled (``_pads_to_uniform_decode``), and
    schedules nothing if the 4 rows do not fit the budget."""
    scheduler = tiny_scheduler()
    scheduler.add_request(tiny_spec(0, 1))
    return scheduler


def test_the_waiting_audit_runs_the_loop_with_the_steps_flags():
    """Budget 2 after a running request, no prefill: padded to 4 > 2, the
    loop admits nobody and the audit passes (a probe without the running
    flag would admit the 1 token unpadded and fail); each audit counts."""
    scheduler = _one_token_waiter()
    fast_path = scheduler.fast_path
    for count in (1, 2):
        fast_path._audit_waiting(_StepState(token_budget=2, running_scheduled=True, prefill_scheduled=False))
        assert fast_path.door.audited["waiting loop"] == count
    assert [request.request_id for request in scheduler.waiting] == ["r000"]


def test_the_waiting_audit_catches_a_loop_that_admits():
    """Control: with a prefill scheduled there is no padding, so the same
    loop admits the 1 token, which the audit catches (a probe without the
    prefill flag would pad, refuse, and pass)."""
    scheduler = _one_token_waiter()
    step = _StepState(token_budget=2, running_scheduled=True, prefill_scheduled=True)
    with pytest.raises(AssertionError, match=r"^a skipped waiting loop call changed the allocator$"):
        scheduler.fast_path._audit_waiting(step)
    assert scheduler.fast_path.door.audited["waiting loop"] == 0


def test_a_waiting_request_taking_tokens_counts_one_change():
    """Rule 11: each stale output landing on a waiter is one change."""
    scheduler = tiny_scheduler()
    fast_path = scheduler.fast_path
    assert isinstance(fast_path, FastPath)
    for count in (1, 2):
        fast_path.waiting_tokens_change()
        assert scheduler.kv_cache_manager.missed_pin_lookups.num_waiter_changes == count


def test_a_drained_stale_output_voids_the_waiting_memo_for_good():
    """Rule 9: a waiting request's stale output drained voids a remembered
    idle waiting loop, and no later allocator change brings it back (each
    moves the version to one it never had: control, a version set or
    stepped back would repeat the remembered one)."""
    scheduler = _one_token_waiter()
    fast_path = scheduler.fast_path
    budget, flags = 2, (True, False)
    free = scheduler.kv_cache_manager.free_blocks  # a change through the door (of no blocks)
    for void in (lambda: free([]), fast_path.waiting_request_changes):
        void()
        step = _StepState(token_budget=budget, running_scheduled=True, prefill_scheduled=False)
        fast_path.waiting_loop(step, lambda step: False)  # admits nobody
        assert fast_path.waiting_known_idle(budget, *flags)
        fast_path.waiting_request_changes()
        assert not fast_path.waiting_known_idle(budget, *flags)
        for _ in range(3):
            free([])
            assert not fast_path.waiting_known_idle(budget, *flags)


# ------------------------------------------- the allocation call's audit


def test_the_allocation_audit_makes_the_call_with_its_lookahead():
    """The tiny scheduler (32-token blocks, K = 3): a 60-token prompt is
    prefilled in one step (budget 64) into 2 blocks, 64 slots. After the
    first decode call (made: it records the request's retired blocks), a
    skipped call for 1 new token and 3 lookahead slots needs 60 + 1 + 3 =
    64: it allocates nothing and the audit passes; 2 new + 3 lookahead need 65,
    a third block, which the audit catches (without the lookahead, 62
    slots: it would pass)."""
    scheduler = tiny_scheduler()
    scheduler.add_request(tiny_spec(0, 60))
    engine = CheckedEngine(scheduler)
    engine.step()
    request = scheduler.requests["r000"]
    assert request.num_computed_tokens == 60
    door = scheduler.kv_cache_manager
    door.allocate_slots(request, 1, num_lookahead_tokens=3)
    for count in (1, 2):
        door._audit_allocation(request, 1, 3)
        assert door.audited["allocation"] == count
    with pytest.raises(AssertionError, match=r"^a skipped allocation call changed the allocator$"):
        door._audit_allocation(request, 2, 3)


# ---------------------------------------------- what the fast path remembers


def test_a_free_forgets_both_windows_of_that_request_only():
    """Rule 6: windows move only on a real call or a free. Windows of
    3,200-token blocks, margin 8: a call over 100..107 settles 104..111."""
    door = tiny_scheduler().kv_cache_manager
    door.allocations, door.caching = SettledSteps((3200,), 8), SettledSteps((3200,), 8)
    for steps in (door.allocations, door.caching):
        steps.record("a", 100, 107)
        steps.record("b", 100, 107)
    versions = (door.allocator_version, door.release_version)
    door.free(SimpleNamespace(request_id="a"))  # through the door: it holds no blocks
    assert (door.allocator_version, door.release_version) == (versions[0] + 1, versions[1] + 1)
    for steps in (door.allocations, door.caching):
        assert not steps.is_settled("a", 104, 111) and steps.is_settled("b", 104, 111)


def test_a_lookup_that_found_no_hit_is_skipped_next_time():
    """Rule 10 through the fast path: the lookup is skipped once it found
    no hit (control: a waiter never looked up is not)."""
    scheduler = tiny_scheduler()
    first, second = (scheduler._materialize(tiny_spec(index, 60)) for index in range(2))
    door, looked_up = scheduler.kv_cache_manager, []
    door.wrapped.pin_waiting_hit = lambda request: looked_up.append(request.request_id) or 0
    door.missed_pin_lookups.found_no_hit(first)
    assert door.pin_waiting_hit(first) == door.pin_waiting_hit(second) == 0
    assert looked_up == ["r001"]


def test_a_pin_pass_is_skipped_only_after_one_that_changed_nothing():
    """Rule 11 through the fast path: a pass that bumped the allocator's
    version pinned something, so the next is made; one that did not is
    remembered, and the next with the same inputs is skipped."""
    scheduler = tiny_scheduler()
    scheduler.add_request(tiny_spec(0, 60))
    fast_path = scheduler.fast_path
    assert not fast_path.skips_pin_pass(())  # never run
    scheduler.kv_cache_manager.free_blocks([])  # a change through the door: the pass pinned, say
    fast_path.pin_pass_ends(())
    assert not fast_path.skips_pin_pass(())
    fast_path.pin_pass_ends(())  # this pass pinned nothing
    assert fast_path.skips_pin_pass(())


# ------------------------------------------------- the audit on one request


def test_the_audit_makes_each_skipped_call_once(tmp_path):
    """``test_fast_path.py::test_the_calls_skipped_across_a_block_boundary``'s
    request (3,120-token prompt, 150 outputs, margin 32, 3,200-token
    blocks), the lane off: the scheduler skips 40 + 35 = 75 allocations
    and 47 + 35 = 82 cachings (that test's hand count), each audited once."""
    simulation = one_request(tmp_path, 3120, 150)
    counts = audited(simulation, lane=False)
    simulation.run()
    assert (counts["allocation"], counts["caching"]) == (75, 82)


# ------------------------------------------------- the pin calls' audits


def _grace_rig_with_a_cached_prompt():
    """The fork's grace rig (block 16, prefix caching, waiter pins on) after
    a 64-token prompt ran and finished: its 4 full blocks are cached, free."""
    scheduler = pins.grace_scheduler(32)
    prompt = tuple(pins.tail_tokens(3, 64))
    pins.finish(scheduler, pins.Spec("done", prompt, 2))
    return scheduler, prompt


def test_each_audited_pin_lookup_counts_once():
    """A waiter with its own tokens finds no hit: the audit passes, once a call."""
    scheduler, _ = _grace_rig_with_a_cached_prompt()
    fast_path = FastPathKVCacheManager(scheduler.kv_cache_manager, scheduler.config)
    waiter = pins.request("new", pins.tail_tokens(4, 64), unit=16)
    for count in (1, 2):
        fast_path._audit_pin_lookup(waiter)
        assert fast_path.audited["pin lookup"] == count


def test_the_pin_pass_audit_catches_a_pass_that_pins():
    """Failing control of rule 11's audit: two waiters behind nobody, both
    with the cached 64-token prompt; the pass the audit makes pins a hit."""
    scheduler, prompt = _grace_rig_with_a_cached_prompt()
    for name in ("w1", "w2"):
        scheduler.add_request(pins.Spec(name, (*prompt, 9), 2))
    fast_path = FastPath(scheduler, FastPathKVCacheManager(scheduler.kv_cache_manager, scheduler.config))
    with pytest.raises(AssertionError, match=r"^a skipped pin pass call changed the allocator$"):
        fast_path._audit_pin_pass()
    assert fast_path.door.audited["pin pass"] == 0


def test_each_audited_pin_pass_that_pins_nothing_counts_once():
    """Control of the test above: waiters with their own tokens hit nothing."""
    scheduler, _ = _grace_rig_with_a_cached_prompt()
    for index, name in enumerate(("w1", "w2")):
        scheduler.add_request(pins.Spec(name, tuple(pins.tail_tokens(5 + index, 65)), 2))
    fast_path = FastPath(scheduler, FastPathKVCacheManager(scheduler.kv_cache_manager, scheduler.config))
    for count in (1, 2):
        fast_path._audit_pin_pass()
        assert fast_path.door.audited["pin pass"] == count


# ------------------------------------------- rule 11: waiters passed over


def test_an_idle_pass_names_its_waiters_while_hashes_tokens_and_pins_stay():
    """The waiters a pass may pass over are the last idle pass's, by
    identity, and none once a waiter takes tokens, the pinned waiters differ
    or the pass pinned something; nor once a hash is inserted, after a pass
    that met a waiter rule 10 does not remember (the next test has the
    other case)."""
    memo = MissedPinLookups(_pool())
    a, b = _waiter("a", 1), _waiter("b", 2)
    assert memo.idle_pass_entries(()) == frozenset()  # no pass yet
    memo.pass_meets_unremembered_waiter()
    memo.pass_ends(deque([a, b]), (), pinned=False)
    assert memo.idle_pass_entries(()) == {id(a), id(b)}
    assert memo.idle_pass_entries(("a",)) == frozenset()
    memo.num_hash_insertions += 1
    assert memo.idle_pass_entries(()) == frozenset()
    memo.pass_ends(deque([a, b]), (), pinned=False)
    memo.num_waiter_changes += 1
    assert memo.idle_pass_entries(()) == frozenset()
    memo.pass_ends(deque([a]), (), pinned=False)
    assert memo.idle_pass_entries(()) == {id(a)}
    memo.pass_ends(deque([a]), (), pinned=True)
    assert memo.idle_pass_entries(()) == frozenset()


def test_a_pass_that_ends_unstarted_is_taken_as_meeting_unremembered_waiters():
    """A pass ended without a start (``idle_pass_entries``) reported no
    waiter: the safe side is to pass over nobody after an insertion."""
    pool = _pool()
    memo = MissedPinLookups(pool)
    a = _waiter("a", 1)
    memo.pass_ends(deque([a]), (), pinned=False)
    _insert(pool, bytes([9]) * 36, 1)
    assert memo.idle_pass_entries(()) == frozenset()


def test_a_queue_without_a_version_is_compared_entry_by_entry():
    """A plain ``deque`` counts nothing: the same object changed in place is
    not known idle (only the scheduler's ``WaitingQueue`` is trusted by
    its count)."""
    memo = MissedPinLookups(_pool())
    a, b = _waiter("a", 1), _waiter("b", 2)
    queue = deque([a])
    memo.pass_ends(queue, (), pinned=False)
    assert memo.knows_idle_pass(queue, ())
    queue.append(b)
    assert not memo.knows_idle_pass(queue, ())


def test_after_insertions_a_pass_passes_over_the_remembered_waiters_not_forgotten(monkeypatch):
    """Rule 11 with hashes inserted since an idle pass: if that pass met only
    waiters rule 10 remembers, an insertion changes a waiter only by
    forgetting it (one of its own hashes), so the others are passed over. An
    admitted waiter (it may come back preempted: the same object, more
    tokens) is examined again. A pass that met a waiter rule 10 does not
    remember (a hit of null blocks only, a pinned waiter), or passed over
    one met so, passes over nobody after an insertion; nor does one whose
    memos were dropped at the bound."""
    pool = _pool()
    memo = MissedPinLookups(pool)
    a, b, c = _waiter("a", 1), _waiter("b", 2), _waiter("c", 3)
    queue = deque([a, b, c])

    def idle_pass(meets_unremembered: bool = False) -> frozenset[int]:
        passed_over = memo.idle_pass_entries(())  # the pass starts
        for waiter in queue:
            if id(waiter) not in passed_over:
                memo.found_no_hit(waiter)
        if meets_unremembered:
            memo.pass_meets_unremembered_waiter()
        memo.pass_ends(queue, (), pinned=False)
        return passed_over

    assert idle_pass() == frozenset()
    _insert(pool, _key(a), 1)  # one of a's own hashes
    _insert(pool, bytes([9]) * 36, 2)  # nobody's
    assert memo.num_hash_insertions == 2 and not memo.knows_idle_pass(queue, ())
    assert idle_pass() == {id(b), id(c)}
    memo.waiter_admitted(b)
    assert not memo.knows_idle_pass(queue, ())
    assert idle_pass() == {id(a), id(c)}
    assert idle_pass(meets_unremembered=True) == {id(a), id(b), id(c)}
    _insert(pool, bytes([8]) * 36, 3)
    assert memo.idle_pass_entries(()) == frozenset()
    idle_pass(meets_unremembered=True)
    assert idle_pass() == {id(a), id(b), id(c)}  # passes over the unremembered waiter
    _insert(pool, bytes([7]) * 36, 4)
    assert memo.idle_pass_entries(()) == frozenset()
    assert idle_pass() == frozenset() and idle_pass() == {id(a), id(b), id(c)}
    monkeypatch.setattr(MissedPinLookups, "MAX_REMEMBERED_HASHES", 0)
    memo.idle_pass_entries(())
    memo.found_no_hit(a)  # past the bound: every memo dropped
    memo.pass_ends(queue, (), pinned=False)
    _insert(pool, bytes([6]) * 36, 5)
    assert memo.idle_pass_entries(()) == frozenset()


def test_a_pass_after_an_idle_one_examines_only_the_waiters_it_did_not_meet():
    """A waiter that hits (its prompt cached by another request) is pinned by
    a pass that has not met it, and passed over by one told it is unchanged:
    no lookup, no pin (control: the same pass without it pins)."""
    manager = pins.pinning_manager(400)
    prompt = pins.tail_tokens(1, 340)
    pins.run(manager, pins.request("same-prompt", prompt))
    waiter = pins.request("waiter", [*prompt, 7])
    passed_over = SchedulerPins(manager, NoFastPath())
    passed_over.pin_waiters(iter([waiter]), frozenset({id(waiter)}))
    assert manager.pinned_waiter_ids() == ()
    passed_over.pin_waiters(iter([waiter]))
    assert manager.pinned_waiter_ids() == ("waiter",)


def test_the_scheduler_reports_each_admitted_waiter_to_rule_11():
    """A preempted request comes back to the queue as the same object with
    more tokens: rule 11 must hear of each admission (the memo's side is
    checked above). The first 60-token prompt takes the step, the second
    waits for the next."""
    scheduler = tiny_scheduler()
    for index in range(2):
        scheduler.add_request(tiny_spec(index, 60))
    first, second = scheduler._waiting_requests()
    admitted: list[object] = []
    memo = scheduler.kv_cache_manager.missed_pin_lookups
    report = memo.waiter_admitted
    memo.waiter_admitted = lambda request: (admitted.append(request), report(request))  # type: ignore[method-assign]
    engine = CheckedEngine(scheduler)
    engine.step()
    assert admitted == [first]
    engine.step()
    assert admitted == [first, second]


def test_a_pin_call_that_pins_nothing_and_finds_a_hit_is_not_remembered():
    """Rule 11's cover: a waiter whose lookup finds no hit is remembered
    (rule 10); one that pins nothing otherwise (here: pinned already) is
    reported as not remembered, so hashes inserted later void the pass."""
    manager = pins.pinning_manager(400)
    prompt = pins.tail_tokens(1, 340)
    pins.run(manager, pins.request("same-prompt", prompt))
    waiter, stranger = pins.request("waiter", [*prompt, 7]), pins.request("stranger", pins.tail_tokens(2, 40))
    calls: list[str] = []
    door = FastPathKVCacheManager(manager, SimpleNamespace(block_size=16, num_speculative_tokens=0))  # type: ignore[arg-type]
    memo = door.missed_pin_lookups
    memo.found_no_hit = lambda request: calls.append(f"no hit {request.request_id}")  # type: ignore[method-assign]
    memo.pass_meets_unremembered_waiter = lambda: calls.append("not remembered")  # type: ignore[method-assign]
    scheduler_pins = SchedulerPins(door, NoFastPath())  # type: ignore[arg-type]
    scheduler_pins.pin_waiters(iter([waiter, stranger]))
    assert calls == ["no hit stranger"] and door.allocator_version == 1  # the waiter pinned
    calls.clear()
    scheduler_pins.pin_waiters(iter([waiter, stranger]))
    assert calls == ["not remembered", "no hit stranger"] and door.allocator_version == 1


def test_the_audit_makes_a_passed_over_waiters_pin_call():
    """Under the audit a passed-over waiter's pin call is made and must pin
    nothing: one that hits is caught (a pass wrongly told it is unchanged)."""
    manager = pins.pinning_manager(400)
    prompt = pins.tail_tokens(1, 340)
    pins.run(manager, pins.request("same-prompt", prompt))
    waiter = pins.request("waiter", [*prompt, 7])
    fast_path = _pass_over_fast_path(manager, audit=True)
    with pytest.raises(AssertionError, match="waiter: a waiter passed over pins"):
        SchedulerPins(manager, fast_path).pin_waiters(iter([waiter]), frozenset({id(waiter)}))


# ------------------------------- rule 1: the hash unit, only inside the prompt


def test_the_prompt_unit_bounds_a_window_only_where_the_span_reaches_the_prompt():
    """4,096-token blocks, a 64-token unit, margin 8. 80..90 widens to
    72..98: inside unit 1 (64..127) and block 0, so (1, 0) (sizes in
    order). It starts past a 71-token prompt (72 > 71): the block alone,
    (0,); not past a 72-token one (72 > 72 fails) nor an unknown one. 100..107
    widens to 92..115, inside unit 1 too; 60..70 (52..78) crosses 64: no
    window unless past a 51-token prompt (control: the unit everywhere, or
    nowhere, or past from the prompt's last token on)."""
    settled = SettledSteps((4096,), margin_tokens=8, prompt_unit=64)
    assert settled.window(80, 90) == (1, 0)
    assert settled.window(80, 90, prompt_tokens=72) == (1, 0)
    assert settled.window(80, 90, prompt_tokens=71) == (0,)
    assert settled.window(60, 70) is None
    assert settled.window(60, 70, prompt_tokens=52) is None
    assert settled.window(60, 70, prompt_tokens=51) == (0,)


def test_a_call_past_the_prompt_settles_from_past_the_prompt_and_margin():
    """Same sizes. A real call over 80..90 past a 71-token prompt: block 0
    less the margin is 9..4,087; past the prompt and the margin it starts
    at 71 + 1 + 8 = 80. Reaching into a 100-token prompt, or with the
    prompt unknown, unit 1 bounds it too: max(9, 64 + 1 + 8) = 73 up to
    min(4,087, 127 - 8) = 119."""
    settled = SettledSteps((4096,), margin_tokens=8, prompt_unit=64)
    settled.record("past", 80, 90, 71)
    assert settled.bounds("past") == (80, 4087)
    assert settled.is_settled("past", 80, 4087) and not settled.is_settled("past", 79, 90)
    settled.record("into", 80, 90, 100)
    settled.record("unknown", 80, 90)
    assert settled.bounds("into") == settled.bounds("unknown") == (73, 119)
    settled.record("into", 60, 70, 100)  # crosses the unit boundary at 64
    assert settled.bounds("into") is None


def test_a_prompt_unit_must_be_positive_and_one_of_the_sizes_changes_nothing():
    """Unit 0 or -1 is refused with both values named; a 1-token unit is a
    size (no interior: no window inside the prompt). A unit equal to a
    block size bounds windows as that size does anyway."""
    for unit in (0, -1):
        with pytest.raises(
            ValueError, match=rf"^block sizes must be positive, got \(4096,\) and unit {unit}$"
        ):
            SettledSteps((4096,), margin_tokens=8, prompt_unit=unit)
    assert SettledSteps((4096,), 0, prompt_unit=1).window(80, 90) is None
    assert SettledSteps((4096,), 0, prompt_unit=1).window(80, 90, prompt_tokens=10) == (0,)
    same = SettledSteps((64, 4096), margin_tokens=8, prompt_unit=64)
    assert same.block_sizes == (64, 4096)
    assert same.window(80, 90) == same.window(80, 90, prompt_tokens=71) == (1, 0)


def _manager(block_sizes: list[int], rings: list[int], hash_block_size: int) -> SimpleNamespace:
    managers = [SimpleNamespace(block_size=size) for size in block_sizes + rings]
    return SimpleNamespace(
        managers=managers,
        ring_managers=managers[len(block_sizes) :],
        block_pool=SimpleNamespace(hash_block_size=hash_block_size),
    )


def _config(block_size: int, num_speculative_tokens: int) -> SimpleNamespace:
    return SimpleNamespace(block_size=block_size, num_speculative_tokens=num_speculative_tokens)


def test_the_fast_paths_windows_take_the_hash_unit_only_inside_the_prompt():
    """The rig: attention and Mamba at 4,096, a ring of 8-token blocks
    (never a size), the 64-token unit, K = 3: margin 4 x 4 + 16 = 32.
    5,000..5,007 widened is 4,968..5,039, across unit boundary 4,992:
    no window into the prompt; past a 4,500-token prompt, block 1."""
    steps = settled_steps(_manager([4096, 4096], [8], 64), _config(4096, 3))  # type: ignore[arg-type]
    assert (steps.block_sizes, steps.margin_tokens) == ((4096,), 32)
    assert steps.window(5000, 5007) is None
    assert steps.window(5000, 5007, prompt_tokens=4500) == (1,)
    # The unit a block size already (64-token blocks hashed every 64, the
    # scheduler's 128), K = 0, margin 20: the same windows either side of
    # the prompt; 100..107 widened is 80..127, in block 1 of 64 and 0 of 128.
    plain = settled_steps(_manager([64], [], 64), _config(128, 0))  # type: ignore[arg-type]
    assert (plain.block_sizes, plain.margin_tokens) == ((64, 128), 20)
    assert plain.window(100, 107) == plain.window(100, 107, prompt_tokens=1) == (1, 0)


def _decoding(computed: int, prompt: int, in_flight: int = 0) -> SimpleNamespace:
    """A request decoding past its prompt: its last token left to compute."""
    return SimpleNamespace(
        request_id="r",
        num_computed_tokens=computed,
        num_tokens=computed + 1,
        num_in_flight_tokens=in_flight,
        num_prompt_tokens=prompt,
        status=RequestStatus.RUNNING,
    )


def _rig_door() -> FastPathKVCacheManager:
    """The door with the rig's windows, over a manager whose calls succeed."""
    door = FastPathKVCacheManager.__new__(FastPathKVCacheManager)  # only the windows are read
    door.wrapped = SimpleNamespace(
        allocate_slots=lambda *args, **kwargs: "blocks", cache_blocks=lambda *args: None
    )  # type: ignore[assignment]
    door.allocator_version, door.audit = 0, False
    door.allocations = SettledSteps((4096,), margin_tokens=32, prompt_unit=64)
    door.caching = SettledSteps((4096,), margin_tokens=32, prompt_unit=64)
    return door


def test_real_calls_past_the_prompt_record_windows_of_the_block_alone():
    """The rig's windows (4,096-token blocks, 64-token unit, margin 32), a
    4,500-token prompt. An allocation at 5,000 computed for 1 new token and
    3 lookahead spans 5,000..5,004: settled from 4,500 + 1 + 32 = 4,533 to
    8,191 - 32 = 8,159 (the unit would give no window: control). At 8,156
    it spans 8,156..8,160, widened past 8,191: no window (1 + 3 slots; 1 x
    3 or 1 - 3 would fit). Caching at 5,000: the same window."""
    door = _rig_door()
    door.allocate_slots(_decoding(5000, 4500), 1, num_lookahead_tokens=3)
    assert door.allocations.bounds("r") == (4533, 8159)
    door.allocate_slots(_decoding(8156, 4500), 1, num_lookahead_tokens=3)
    assert door.allocations.bounds("r") is None
    door.cache_blocks(_decoding(5000, 4500), 5000)
    assert door.caching.bounds("r") == (4533, 8159)
    door.cache_blocks(_decoding(8159, 4500), 8160)
    assert door.caching.bounds("r") is None
    assert door.allocator_version == 4  # each a real call that may take blocks


def test_a_prefill_allocation_records_no_window():
    """A request with prompt tokens still to compute is not decoding: its
    allocation records nothing, and the window of its last decode stays."""
    door = _rig_door()
    door.allocate_slots(_decoding(5000, 4500), 1, num_lookahead_tokens=3)
    prefilling = _decoding(5000, 4500)
    prefilling.num_tokens = 5002
    door.allocate_slots(prefilling, 1, num_lookahead_tokens=3)
    assert door.allocations.bounds("r") == (4533, 8159)


# -------------------------------- rule 11: which waiters a pass walks


def test_the_fast_path_names_the_last_idle_passs_waiters_for_the_same_pins():
    """``FastPath.unchanged_waiters``: the entries of the last idle pass
    while the pinned waiters are the same, none for other pinned waiters."""
    scheduler = tiny_scheduler()
    fast_path = scheduler.fast_path
    a, b = _waiter("a", 1), _waiter("b", 2)
    scheduler.kv_cache_manager.missed_pin_lookups.pass_ends(deque([a, b]), ("p",), pinned=False)
    assert fast_path.unchanged_waiters(("p",)) == {id(a), id(b)}
    assert fast_path.unchanged_waiters(()) == frozenset()


def _pass_over_fast_path(manager, audit: bool) -> FastPath:
    fast_path = FastPath.__new__(FastPath)  # only the audit's parts are read
    fast_path.door = SimpleNamespace(wrapped=manager, audit=audit, audited=Counter())  # type: ignore[assignment]
    return fast_path


def test_without_the_audit_a_passed_over_waiter_is_not_looked_up():
    """The waiter would hit (its prompt cached), but passed over with the
    audit off nothing is called: no pin, no error, nothing audited
    (control: the audit's pin call, which would pin and fail)."""
    manager = pins.pinning_manager(400)
    prompt = pins.tail_tokens(1, 340)
    pins.run(manager, pins.request("same-prompt", prompt))
    waiter = pins.request("waiter", [*prompt, 7])
    fast_path = _pass_over_fast_path(manager, audit=False)
    SchedulerPins(manager, fast_path).pin_waiters(iter([waiter]), frozenset({id(waiter)}))
    assert manager.pinned_waiter_ids() == () and fast_path.door.audited["unchanged waiter"] == 0


def test_each_audited_passed_over_waiter_that_pins_nothing_counts_once():
    """A passed-over waiter with its own tokens finds no hit: the audit's
    pin call pins nothing, and each counts one."""
    manager = pins.pinning_manager(400)
    pins.run(manager, pins.request("other-prompt", pins.tail_tokens(1, 340)))
    waiter = pins.request("waiter", pins.tail_tokens(2, 341))
    fast_path = _pass_over_fast_path(manager, audit=True)
    for count in (1, 2):
        SchedulerPins(manager, fast_path).pin_waiters(iter([waiter]), frozenset({id(waiter)}))
        assert fast_path.door.audited["unchanged waiter"] == count
    assert manager.pinned_waiter_ids() == ()


def _grace_rig_with_a_fast_path(audit: bool) -> tuple[Scheduler, list[frozenset]]:
    """The grace rig (a cached 64-token prompt) with its fast path on, two
    waiters of their own tokens; records what each pass asks the waiting
    queue to skip."""
    scheduler, _ = _grace_rig_with_a_cached_prompt()
    door = FastPathKVCacheManager(scheduler.kv_cache_manager, scheduler.config)
    fast_path = FastPath(scheduler, door)
    fast_path.door.audit = audit
    scheduler.kv_cache_manager, scheduler.fast_path = door, fast_path  # type: ignore[assignment]
    scheduler.pins = SchedulerPins(door, fast_path)  # type: ignore[arg-type]
    for index, name in enumerate(("w1", "w2")):
        scheduler.add_request(pins.Spec(name, tuple(pins.tail_tokens(5 + index, 65)), 2))
    skips: list[frozenset] = []

    def waiting(skip=frozenset()):
        skips.append(skip)
        return scheduler._waiting_requests(skip)

    scheduler.pins.pin_waiting(waiting)  # the first pass: nothing known, pins nothing
    scheduler.add_request(pins.Spec("w3", tuple(pins.tail_tokens(7, 65)), 2))  # an arrival
    scheduler.pins.pin_waiting(waiting)
    return scheduler, skips


def test_a_pass_after_an_arrival_skips_the_idle_passs_waiters_by_identity():
    """Rule 11: the first pass meets w1 and w2 and pins nothing; after w3
    arrives the queue differs, so a pass runs, told to skip w1's and w2's
    entries (not walked: w3 alone is looked up, and found no hit). The
    second pass is idle too and names all three."""
    scheduler, skips = _grace_rig_with_a_fast_path(audit=False)
    w1, w2, w3 = scheduler.waiting
    assert skips == [frozenset(), {id(w1), id(w2)}]
    assert scheduler.kv_cache_manager.missed_pin_lookups.knows_no_hit(w3)
    assert scheduler.fast_path.unchanged_waiters(()) == {id(w1), id(w2), id(w3)}
    assert scheduler.kv_cache_manager.pinned_waiter_ids() == ()


def test_under_the_audit_a_pass_walks_every_waiter_and_checks_the_passed_over():
    """The same passes under the audit: the queue is walked whole (nothing
    skipped) and w1 and w2, passed over, each make their pin call once."""
    scheduler, skips = _grace_rig_with_a_fast_path(audit=True)
    assert skips == [frozenset(), frozenset()]
    assert scheduler.fast_path.door.audited["unchanged waiter"] == 2


def test_a_pass_like_the_last_idle_one_walks_no_waiter():
    """Rule 11 whole: a second pass with the same queue, pins, hashes and
    tokens is skipped before the queue is asked for a waiter; with waiter
    pins off no pass asks for one (control: a pass never skipped, or
    checked against other pinned waiters, walks the queue again)."""
    scheduler, skips = _grace_rig_with_a_fast_path(audit=False)
    scheduler.pins.pin_waiting(lambda skip=frozenset(): skips.append(skip) or iter(()))
    assert len(skips) == 2
    scheduler.kv_cache_manager.wrapped.enable_waiter_pins = False
    scheduler.add_request(pins.Spec("w4", tuple(pins.tail_tokens(8, 65)), 2))  # not idle now
    scheduler.pins.pin_waiting(lambda skip=frozenset(): skips.append(skip) or iter(()))
    assert len(skips) == 2


def test_a_pass_stops_at_the_first_waiter_it_meets_with_the_bound_reached():
    """The pin bound at 1: w1 (the cached prompt and one token) is pinned,
    and the pass ends at the next waiter it draws, w2: w3 is never drawn
    (control: a pass that goes on at the bound draws w3 and looks it up)."""
    scheduler, prompt = _grace_rig_with_a_cached_prompt()
    scheduler.kv_cache_manager.max_pinned_waiters = 1
    scheduler.add_request(pins.Spec("w1", (*prompt, 9), 2))
    for index, name in enumerate(("w2", "w3")):
        scheduler.add_request(pins.Spec(name, tuple(pins.tail_tokens(5 + index, 65)), 2))
    drawn = []

    def waiting():
        for request in scheduler._waiting_requests():
            drawn.append(request.request_id)
            yield request

    scheduler.pins.pin_waiters(waiting())
    assert scheduler.kv_cache_manager.pinned_waiter_ids() == ("w1",)
    assert drawn == ["w1", "w2"]


def test_the_audit_makes_a_skipped_caching_call_and_names_it(tmp_path):
    """A caching call the fast path skips is made anyway under the audit,
    and a change it makes is reported as the caching call's. The allocator
    here is broken on purpose: each ``cache_blocks`` call leaves a new entry
    in a manager's table, so the first skipped one is caught (control: the
    audit off, the run ends)."""
    for audit in (False, True):
        simulation = one_request(tmp_path, 3120, 150)
        manager = simulation.kv_cache_manager
        real = manager.cache_blocks
        calls = iter(range(10**6))

        def leaving_a_trace(request, num_computed_tokens, _real=real, _manager=manager, _calls=calls):
            _real(request, num_computed_tokens)
            _manager.managers[0].num_cached_block[f"trace-{next(_calls)}"] = 0

        manager.cache_blocks = leaving_a_trace
        if not audit:
            simulation.run()
            continue
        audited(simulation, lane=False)
        with pytest.raises(AssertionError, match="^a skipped caching call changed the allocator$"):
            simulation.run()


def test_the_audit_of_a_skipped_pin_lookup_wants_a_lookup_that_found_no_hit():
    """A skipped pin lookup is made under the audit and must have looked up
    and found nothing: one that pins nothing without finding "no hit" (its
    waiter pinned already, so vLLM's lookup is not even made) is caught
    too, not only one that pins."""
    manager = pins.pinning_manager(400)
    prompt = pins.tail_tokens(1, 340)
    pins.run(manager, pins.request("same-prompt", prompt))
    waiter = pins.request("waiter", [*prompt, 7])
    assert manager.pin_waiting_hit(waiter) > 0  # pinned now
    fast_path = FastPathKVCacheManager(manager, SimpleNamespace(block_size=16, num_speculative_tokens=0))  # type: ignore[arg-type]
    fast_path.audit = True
    with pytest.raises(AssertionError, match="^waiter: a skipped pin lookup hits$"):
        fast_path._audit_pin_lookup(waiter)
    assert manager.pinned_waiter_ids() == ("waiter",) and fast_path.audited["pin lookup"] == 0


# What ``deque`` offers that leaves the queue as it is (read from the
# ``collections.deque`` documentation, not from ``WaitingQueue``).
_DEQUE_READS = {
    "__add__",
    "__class_getitem__",
    "__contains__",
    "__copy__",
    "__getitem__",
    "__iter__",
    "__len__",
    "__mul__",
    "__reversed__",
    "__rmul__",
    "copy",
    "count",
    "index",
    "maxlen",
}

# Each of deque's changing calls, with arguments: what it leaves in [a, b].
_DEQUE_CHANGES = {
    "append": (("c",), ["a", "b", "c"]),
    "appendleft": (("c",), ["c", "a", "b"]),
    "clear": ((), []),
    "extend": ((["c"],), ["a", "b", "c"]),
    "extendleft": ((["c"],), ["c", "a", "b"]),
    "insert": ((1, "c"), ["a", "c", "b"]),
    "pop": ((), ["a"]),
    "popleft": ((), ["b"]),
    "remove": (("a",), ["b"]),
    "reverse": ((), ["b", "a"]),
    "rotate": ((1,), ["b", "a"]),
    "__setitem__": ((0, "c"), ["c", "b"]),
    "__delitem__": ((0,), ["b"]),
    "__iadd__": ((["c"],), ["a", "b", "c"]),
    "__imul__": ((2,), ["a", "b", "a", "b"]),
}


def _only_taken_out(left: list[str], before: list[str]) -> bool:
    """Whether ``left`` is ``before`` with some entries taken out."""
    rest = iter(before)
    return all(entry in rest for entry in left)


def test_the_waiting_queue_counts_every_call_of_deque_that_may_insert():
    """Rule 11's one-number check is sound only if no insertion escapes the
    count: every method of ``deque`` is either a read or wrapped, each acts
    as ``deque``'s own, and each but the removals moves the count by one."""
    assert set(dir(deque)) - set(dir(object)) - _DEQUE_READS == set(_DEQUE_CHANGES)
    assert set(WaitingQueue.MUTATORS) == set(_DEQUE_CHANGES)
    for name, (args, left) in _DEQUE_CHANGES.items():
        queue, plain = WaitingQueue(["a", "b"]), deque(["a", "b"])
        queue.rotate(0)  # a call that moves nothing counts: the count is 1
        returned, expected = getattr(queue, name)(*args), getattr(plain, name)(*args)
        assert list(queue) == left, name
        assert returned is queue if expected is plain else returned == expected, name
        # A removal leaves some of the entries in their order, and only a
        # removal leaves the insertions as they were.
        assert _only_taken_out(left, ["a", "b"]) == (name in WaitingQueue.REMOVALS), name
        assert queue.insertions == (1 if name in WaitingQueue.REMOVALS else 2), name
    queue = WaitingQueue(["a"])
    queue.__init__(["a"])  # a refill counts as well
    assert queue.insertions == 1
    assert WaitingQueue("ab", maxlen=1) == deque("b") and WaitingQueue().maxlen is None


def test_a_waiting_queue_without_calls_since_an_idle_pass_is_known_idle_unread():
    """With the scheduler's queue the pass memo compares a version; the
    entries are read again only after a call (and a queue changed back to
    the same entries is still known by them, then by its new version)."""

    class CountedReads(WaitingQueue):
        reads = 0

        def __iter__(self):  # type: ignore[no-untyped-def]
            self.reads += 1
            return super().__iter__()

    memo = MissedPinLookups(_pool())
    a, b, c = _waiter("a", 1), _waiter("b", 2), _waiter("c", 3)
    queue = CountedReads([a, b])
    memo.pass_ends(queue, (), pinned=False)
    reads = queue.reads
    assert memo.knows_idle_pass(queue, ()) and memo.knows_idle_pass(queue, ())
    assert queue.reads == reads  # not read
    queue[1] = c
    assert not memo.knows_idle_pass(queue, ())
    queue[1] = b
    assert memo.knows_idle_pass(queue, ())  # by identity, read once
    reads = queue.reads
    assert memo.knows_idle_pass(queue, ()) and queue.reads == reads


def _idle_after_pops(insert_hash: bytes | None = None, meets_unremembered: bool = False):
    """An idle pass over [a, b, c] (each found no hit), then the head
    admitted (popped) and, if given, a hash inserted."""
    pool = _pool()
    memo = MissedPinLookups(pool)
    a, b, c = _waiter("a", 1), _waiter("b", 2), _waiter("c", 3)
    queue = WaitingQueue([a, b, c])
    memo.idle_pass_entries(())  # the pass starts
    for waiter in queue:
        memo.found_no_hit(waiter)
    if meets_unremembered:
        memo.pass_meets_unremembered_waiter()
    memo.pass_ends(queue, (), pinned=False)
    memo.waiter_admitted(queue.popleft())
    if insert_hash is not None:
        _insert(pool, insert_hash, 1)
    return memo, queue, (a, b, c)


def test_a_queue_only_taken_from_since_an_idle_pass_is_known_idle():
    """Rule 11 with only removals since the idle pass (an admission pops the
    head): every waiter left met that pass and none was forgotten, so the
    whole pass is skipped; also after a hash insertion, if that pass met
    only remembered waiters and the insertion forgot none of those left.
    Controls: an insertion into the queue, a forgotten waiter, a pass that
    met an unremembered waiter, each make the pass run (by hand from the
    rule; the queue's entries are passed over one by one otherwise)."""
    memo, queue, (a, b, c) = _idle_after_pops()
    assert memo.knows_idle_pass(queue, ())
    queue.remove(c)  # a waiter stopped by a stale output leaves too
    assert memo.knows_idle_pass(queue, ())
    assert not memo.knows_idle_pass(queue, ("b",))  # other pins
    queue.append(_waiter("d", 4))
    assert not memo.knows_idle_pass(queue, ())
    memo, queue, _ = _idle_after_pops(insert_hash=bytes([9]) * 36)  # nobody's hash
    assert memo.knows_idle_pass(queue, ())
    memo, queue, (a, b, c) = _idle_after_pops(insert_hash=_key(c))  # c's own
    assert not memo.knows_idle_pass(queue, ())
    memo, queue, _ = _idle_after_pops(insert_hash=_key(a))  # the admitted one's: forgotten too
    assert not memo.knows_idle_pass(queue, ())
    memo, queue, _ = _idle_after_pops(insert_hash=bytes([9]) * 36, meets_unremembered=True)
    assert not memo.knows_idle_pass(queue, ())
    memo, queue, _ = _idle_after_pops(meets_unremembered=True)  # no insertion: still idle
    assert memo.knows_idle_pass(queue, ())


def test_a_queue_refilled_since_an_idle_pass_is_not_known_idle_by_its_insertions():
    """A queue emptied and refilled with other waiters has had insertions:
    the pass runs (control: the same queue only emptied is known idle)."""
    memo, queue, _ = _idle_after_pops()
    queue.clear()
    assert memo.knows_idle_pass(queue, ())
    queue.extend([_waiter("d", 4)])
    assert not memo.knows_idle_pass(queue, ())


def test_hashes_inserted_before_an_idle_pass_leave_it_idle():
    """The pass memo counts the insertions since the idle pass, not those
    before it: with a hash inserted before an idle pass that met a waiter
    rule 10 does not remember, a queue only taken from since is known idle
    (control: a hash inserted after it voids that)."""
    pool = _pool()
    memo = MissedPinLookups(pool)
    _insert(pool, bytes([9]) * 36, 2)
    queue = WaitingQueue([_waiter("a", 1), _waiter("b", 2)])
    memo.idle_pass_entries(())
    memo.pass_meets_unremembered_waiter()
    memo.pass_ends(queue, (), pinned=False)
    memo.waiter_admitted(queue.popleft())
    assert memo.knows_idle_pass(queue, ())
    _insert(pool, bytes([8]) * 36, 3)
    assert not memo.knows_idle_pass(queue, ())


# -------------------------------------------- the door's calls (issue 42)
# Issue 42's mutation run of the door (sim/sched/fast_path/kv_cache_manager.py)
# left these calls' values unpinned: each test below fails on its mutant.


def test_an_admission_bumps_both_versions_only_when_it_allocates():
    """Rule 3: every call that changes the allocator bumps the versions. A
    waiting request's allocate_slots that allocates changes it; one vLLM
    refuses (every block of the pool taken) returns None having taken and
    freed nothing: the pool's blocks, free queue and cache are as they were
    (its managers keep an empty table for the request, as vLLM's
    ``defaultdict`` does on any read)."""
    scheduler = tiny_scheduler()
    door = scheduler.kv_cache_manager
    pool = door.block_pool
    scheduler.add_request(tiny_spec(0, 60))
    request = next(scheduler._waiting_requests())
    taken = pool.get_new_blocks(pool.get_num_free_blocks())
    before = allocator_snapshot(door.wrapped)
    assert door.allocate_slots(request, 60, num_lookahead_tokens=3) is None
    after = allocator_snapshot(door.wrapped)
    assert [after[key] == before[key] for key in ("blocks", "free_queue", "cached")] == [True] * 3
    assert (door.allocator_version, door.release_version) == (0, 0)
    pool.free_blocks(taken)
    before = allocator_snapshot(door.wrapped)
    assert door.allocate_slots(request, 60, num_lookahead_tokens=3) is not None
    assert allocator_snapshot(door.wrapped) != before
    assert (door.allocator_version, door.release_version) == (1, 1)


@pytest.mark.parametrize(
    ("computed", "num_tokens", "in_flight", "span"),
    [
        (100, 101, 0, (100, 107)),  # sync: the processed tokens are the computed
        (108, 109, 8, (100, 115)),  # async: 8 in flight, counted computed already
        (99, 101, 0, None),  # two tokens left to compute: not decoding
    ],
)
def test_a_decode_spans_from_its_processed_tokens(computed, num_tokens, in_flight, span):
    """Rule 9: a decode's calls read positions from its processed tokens
    (computed less those in flight) to its computed tokens plus the call's
    7 slots (1 + K new, K = 3 lookahead)."""
    request = SimpleNamespace(
        num_computed_tokens=computed, num_tokens=num_tokens, num_in_flight_tokens=in_flight
    )
    assert FastPathKVCacheManager.decode_span(request, 7) == span  # type: ignore[arg-type]


class _CountingManager:
    """A stand-in behind the door: counts the allocations made through it."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def allocate_slots(self, request, num_new_tokens, num_lookahead_tokens=0):
        self.calls.append((num_new_tokens, num_lookahead_tokens))
        return SimpleNamespace(blocks=((),))


def test_a_call_without_lookahead_slots_spans_as_vllms_default_of_none():
    """vLLM's allocate_slots defaults num_lookahead_tokens to 0, and the
    door's span does too. Windows of 3,200-token blocks, margin 8: a block
    holds settled calls up to 3,200 - 1 - 8 = 3,191. A decode at 3,190
    spans 3,190..3,191 (one new token): its first call is made and records
    the window, its second is settled. With one lookahead slot taken by
    default the span would reach 3,192, past the window: both made."""
    assert inspect.signature(KVCacheManager.allocate_slots).parameters["num_lookahead_tokens"].default == 0
    door = tiny_scheduler().kv_cache_manager
    door.allocations = SettledSteps((3200,), 8)
    door.wrapped = counting = _CountingManager()
    request = _decoding(3190, 100)
    for _ in range(2):
        door.allocate_slots(request, 1)
    assert counting.calls == [(1, 0)]
    assert door.allocations.bounds("r") == (109, 3191)  # past the 100-token prompt and the margin


def _forced_settled(door) -> None:
    """A broken window that settles every call (the audit must see what it
    lets through)."""
    door.allocations = SimpleNamespace(is_settled=lambda *args: True, record=None, forget=None)


def test_the_audit_of_a_skipped_allocation_makes_it_with_the_calls_lookahead():
    """As test_the_allocation_audit_makes_the_call_with_its_lookahead, but
    through the door's allocate_slots: a skipped call for 1 + 3 slots past
    the 60 computed tokens needs 64 (2 blocks held: passes), for 2 + 3 it
    needs 65, a third block (caught; without the lookahead, 62: it would
    pass). A call without the keyword takes vLLM's default of 0: 4 new
    tokens need 64 and pass. (The first call is made: it records the
    request's retired blocks.)"""
    scheduler = tiny_scheduler()
    scheduler.add_request(tiny_spec(0, 60))
    CheckedEngine(scheduler).step()
    request = scheduler.requests["r000"]
    assert (request.num_computed_tokens, request.num_tokens) == (60, 61)
    door = scheduler.kv_cache_manager
    door.allocate_slots(request, 1, num_lookahead_tokens=3)  # made: it records the retired blocks
    _forced_settled(door)
    door.audit = True
    assert not any(door.allocate_slots(request, 1, num_lookahead_tokens=3).blocks)
    assert not any(door.allocate_slots(request, 4).blocks)
    assert door.audited["allocation"] == 2
    with pytest.raises(AssertionError, match=r"^a skipped allocation call changed the allocator$"):
        door.allocate_slots(request, 2, num_lookahead_tokens=3)


def test_the_audit_catches_a_skipped_allocation_that_vllm_would_refuse():
    """A skipped call that vLLM would refuse (no free block for the third
    block it needs) changes nothing, yet it was not a settled call: the
    audit names it. Control: with a block free it allocates, and the
    snapshot check names it instead."""
    scheduler = tiny_scheduler()
    scheduler.add_request(tiny_spec(0, 60))
    CheckedEngine(scheduler).step()
    request = scheduler.requests["r000"]
    door = scheduler.kv_cache_manager
    door.allocate_slots(request, 1, num_lookahead_tokens=3)  # made: it records the retired blocks
    pool = door.block_pool
    taken = pool.get_new_blocks(pool.get_num_free_blocks())
    _forced_settled(door)
    door.audit = True
    with pytest.raises(AssertionError, match=r"^r000: a settled call allocated$"):
        door.allocate_slots(request, 2, num_lookahead_tokens=3)
    pool.free_blocks(taken[:1])
    with pytest.raises(AssertionError, match=r"^a skipped allocation call changed the allocator$"):
        door.allocate_slots(request, 2, num_lookahead_tokens=3)


def test_a_pop_for_a_fenced_free_forgets_both_windows_of_that_request_only():
    """As test_a_free_forgets_both_windows_of_that_request_only, for the
    fenced path (blocks popped now, freed at the fence): windows of
    3,200-token blocks, margin 8, a call over 100..107 settles 104..111."""
    door = tiny_scheduler().kv_cache_manager
    door.allocations, door.caching = SettledSteps((3200,), 8), SettledSteps((3200,), 8)
    for steps in (door.allocations, door.caching):
        steps.record("a", 100, 107)
        steps.record("b", 100, 107)
    assert door.pop_blocks_for_free(SimpleNamespace(request_id="a")) == []  # it holds no blocks
    assert (door.allocator_version, door.release_version) == (1, 1)
    for steps in (door.allocations, door.caching):
        assert not steps.is_settled("a", 104, 111) and steps.is_settled("b", 104, 111)


def test_the_fork_pin_calls_pass_through_the_door_and_count_as_changes():
    """The fork's release of a pinned hit's extras and its yield, made
    through the door: the values of the fork's own test
    (tests/test_fork_pins.py::test_releasing_the_extras_drops_only_the_proof_block_past_the_hit):
    H pins A1, A2 and the proof block A3; releasing the extras drops 1,
    then 0; with H's pins kept, A's grace yields and frees A3 (96 free
    blocks to 97). A call that released something bumps both versions
    (rule 3), one that released nothing neither. A limit of 0, given by
    position or by keyword, releases nothing."""
    scheduler = pins.grace_scheduler(100, eagle=True)
    finish(scheduler, Spec("A", tuple(range(1000, 1048)), 2))
    scheduler.add_request(Spec("H", tuple(range(1000, 1048)) + tuple(range(5000, 5064)), 2))
    h = next(scheduler._waiting_requests())
    door = FastPathKVCacheManager(scheduler.kv_cache_manager, scheduler.config)
    hit, num_hit, _ = door.wrapped.get_computed_blocks(h)
    assert num_hit == 32 and door.pin_waiting_hit(h) == 3
    versions = (door.allocator_version, door.release_version)
    assert door.yield_pinned_hits(None, 0) == 0 and door.yield_pinned_hits(limit=0) == 0
    assert (door.allocator_version, door.release_version) == versions
    assert door.release_pinned_extras("H", hit.blocks) == 1
    assert (door.allocator_version, door.release_version) == (versions[0] + 1, versions[1] + 1)
    assert door.release_pinned_extras("H", hit.blocks) == 0
    assert (door.allocator_version, door.release_version) == (versions[0] + 1, versions[1] + 1)
    assert door.block_pool.get_num_free_blocks() == 96
    assert door.yield_pinned_hits("H") > 0
    assert door.block_pool.get_num_free_blocks() == 97 and door.wrapped.pinned_hit_blocks("H")
    assert (door.allocator_version, door.release_version) == (versions[0] + 2, versions[1] + 2)
