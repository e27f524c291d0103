"""Property tests: random admit / chunk / decode (random accepts) / finish /
preempt / deferred free sequences keep every allocator invariant, for both
layouts; and deliberately broken allocators are caught by the checker."""

from __future__ import annotations

import pytest
from helpers.allocator import BLOCK, K, request, tiny_manager
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.allocator_invariants import AllocatorInvariantError, allocator_problems, check_allocator
from sim.vllm_bridge import MambaAlignedSplit

POOL = 90
_split = MambaAlignedSplit(block_size=BLOCK, max_num_scheduled_tokens=64)

ops = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.integers(1, 200), st.integers(0, 3)),
        st.tuples(st.just("step"), st.integers(0, 3), st.integers(0, 10**6)),
        st.tuples(st.just("finish"), st.integers(0, 7), st.booleans()),
        st.tuples(st.just("preempt"), st.integers(0, 7), st.booleans()),
        st.tuples(st.just("drain"), st.integers(0, 0), st.integers(0, 0)),
    ),
    min_size=1,
    max_size=40,
)


class _Driver:
    """A toy scheduler: just enough to exercise every allocator path."""

    def __init__(self, on: bool) -> None:
        self.manager = tiny_manager(on, num_blocks=POOL)
        self.running: list = []
        self.deferred: list[list] = []
        self.count = 0

    def _prompt(self, length: int, family: int) -> list[int]:
        # Requests of one family share a prefix, so prefix hits happen.
        return [family * 100000 + i for i in range(length)]

    def admit(self, length: int, family: int) -> None:
        self.count += 1
        req = request(f"q{self.count}", self._prompt(length, family))
        computed, hit, _ = self.manager.get_computed_blocks(req)
        num_new = _split(req, req.num_tokens - hit, hit)
        if num_new == 0:
            return
        blocks = self.manager.allocate_slots(
            req,
            num_new,
            num_new_computed_tokens=hit,
            new_computed_blocks=computed,
            num_lookahead_tokens=0,
            full_sequence_must_fit=True,
        )
        if blocks is not None:
            req.num_computed_tokens = hit + num_new
            self.running.append(req)

    def step(self, accepts: int, salt: int) -> None:
        """One engine step, vLLM's token accounting: computed tokens chase the
        tokens (prompt, outputs, drafts); a decode carries K drafts, of which
        ``accepts`` survive, and rejected ones roll the count back."""
        for req in list(self.running):
            decoding = req.num_output_tokens > 0 and req.num_computed_tokens == req.num_tokens - 1
            req.spec_token_ids = [salt + i for i in range(K)] if decoding else []
            drafts = len(req.spec_token_ids)
            num_new = req.num_tokens + drafts - req.num_computed_tokens
            if not decoding:
                num_new = _split(req, num_new)
            if num_new == 0:
                continue
            allocated = self.manager.allocate_slots(req, num_new, num_lookahead_tokens=K)
            req.spec_token_ids = []
            if allocated is None:
                self._preempt(req, deferred=False)
                continue
            req.num_computed_tokens += num_new
            if req.num_computed_tokens >= req.num_tokens:  # a token was sampled
                accepted = min(accepts, drafts)
                req.num_computed_tokens -= drafts - accepted
                req.append_output_token_ids(list(range(salt, salt + accepted + 1)))
        self.manager.new_step_starts()

    def _free(self, req, deferred: bool) -> None:
        self.running.remove(req)
        if deferred:
            self.deferred.append(self.manager.pop_blocks_for_free(req))
        else:
            self.manager.free(req)

    def _preempt(self, req, deferred: bool) -> None:
        self._free(req, deferred)
        req.num_computed_tokens = 0

    def finish(self, index: int, deferred: bool) -> None:
        if self.running:
            self._free(self.running[index % len(self.running)], deferred)

    def preempt(self, index: int, deferred: bool) -> None:
        if self.running:
            self._preempt(self.running[index % len(self.running)], deferred)

    def drain(self, *_: int) -> None:
        for blocks in self.deferred:
            self.manager.block_pool.free_blocks(reversed(blocks))
        self.deferred.clear()


@pytest.mark.parametrize("on", [True, False], ids=["layout-on", "layout-off"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=ops)
def test_random_programs_keep_every_invariant(on, program):
    driver = _Driver(on)
    for name, a, b in program:
        getattr(driver, name)(a, b)
        check_allocator(driver.manager, driver.deferred)
    while driver.running:
        driver.finish(0, deferred=False)
    driver.drain()
    check_allocator(driver.manager)
    assert driver.manager.block_pool.get_num_free_blocks() == POOL - 1  # nothing leaked


def _busy_manager(on: bool):
    driver = _Driver(on)
    for family in range(3):
        driver.admit(70, family)
    driver.step(2, 500)
    driver.step(1, 900)
    check_allocator(driver.manager)
    return driver


def test_a_block_returned_early_is_caught():
    driver = _busy_manager(False)
    table = driver.manager.coordinator.get_blocks(driver.running[0].request_id)[-1]
    driver.manager.block_pool.free_blocks([table[-1]])  # BUG: still in the table
    with pytest.raises(AllocatorInvariantError, match="neither free nor held|free and held|ref_cnt"):
        check_allocator(driver.manager)


def test_a_ring_slot_freed_twice_is_caught():
    driver = _busy_manager(True)
    [ring] = driver.manager.ring_managers
    slot = ring.req_to_blocks[driver.running[0].request_id][0]
    slot.ref_cnt = 0  # BUG: the slot's owner dropped its reference
    with pytest.raises(AllocatorInvariantError, match="ring slot"):
        check_allocator(driver.manager)
    slot.ref_cnt = 1
    with pytest.raises(AssertionError, match="twice"):
        ring.slot_pool.free_blocks([slot])
        ring.slot_pool.free_blocks([slot])  # the pool itself is loud too


def test_a_ring_page_returned_while_slots_live_is_caught():
    driver = _busy_manager(True)
    [ring] = driver.manager.ring_managers
    [page] = ring.slot_pool.pages()
    driver.manager.block_pool.free_blocks([page])  # BUG: three rings still live in it
    problems = allocator_problems(driver.manager)
    assert any(f"block {page.block_id}" in p for p in problems)


def test_a_slot_handed_out_twice_is_caught():
    driver = _busy_manager(True)
    [ring] = driver.manager.ring_managers
    first = driver.running[0].request_id
    twin = driver.running[1].request_id
    ring.req_to_blocks[twin][0].block_id = ring.req_to_blocks[first][0].block_id  # BUG
    with pytest.raises(AllocatorInvariantError, match="ring slot"):
        check_allocator(driver.manager)


def test_a_block_in_two_groups_is_caught():
    driver = _busy_manager(False)
    tables = driver.manager.coordinator.get_blocks(driver.running[0].request_id)
    victim = tables[-1][0]
    victim.ref_cnt += 1
    driver.manager.managers[0].req_to_blocks[driver.running[0].request_id].append(victim)  # BUG
    with pytest.raises(AllocatorInvariantError, match="owned by groups"):
        check_allocator(driver.manager)


def test_deferred_blocks_are_held_until_the_drain():
    driver = _busy_manager(True)
    driver.finish(0, deferred=True)
    check_allocator(driver.manager, driver.deferred)
    # CONTROL: forgetting the popped blocks makes them look leaked.
    with pytest.raises(AllocatorInvariantError, match="neither free nor held"):
        check_allocator(driver.manager)
    driver.drain()
    check_allocator(driver.manager)
