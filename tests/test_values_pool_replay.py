"""Pool replay controls that reach the checks the corruption tests in
tests/test_pool_replay.py do not: the check at free time and the
sole-writer rule, each with a control that corrupts exactly the page the
check guards, and the message naming that page (request, group, layer,
byte range) derived from the corruption, not from the replay's report."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sim.analysis.runs import scenario_workload
from sim.engine import Simulation
from sim.pool_replay import PoolCorruption, PoolReplay, replay_pool, with_pool_bytes
from sim.pool_replay.fingerprints import UNKNOWN
from sim.pool_replay.verify import Fence
from sim.pool_replay.views import allocate_worker_views
from sim.scenario import load_scenario

SMALL = Path(__file__).parent / "data" / "pool-replay.yaml"


@pytest.fixture(scope="module")
def small():
    scenario = load_scenario(str(SMALL))
    return scenario, scenario_workload(scenario)


def _written_cell(replay: PoolReplay, request_id: str):
    """A cell the request wrote (shadow known) in a group of one slot per
    block: (group, word set, layer, view block, row)."""
    for group in replay.groups:
        if group.slots_per_block != 1:
            continue
        for view_block in sorted(set(replay._held_blocks(group.index, request_id))):
            for row_class in group.classes:
                codes = row_class.shadow[view_block]
                number = replay.request_numbers[request_id]
                # A shadow code is request number << 24 | position: this request's writes.
                rows = torch.nonzero((codes >> 24) == number).flatten().tolist()
                if rows:
                    word_set = row_class.word_sets[0]
                    return group, row_class, word_set, word_set.layers[0], view_block, rows[0]
    return None


def _flip_a_written_word(replay: PoolReplay, request_id: str) -> dict[str, object]:
    """Flip the first word of layer 0's cell of a cell the request wrote,
    behind the allocator's back; what was flipped (empty if it wrote none)."""
    found = _written_cell(replay, request_id)
    if found is None:
        return {}
    group, _, word_set, layer, view_block, row = found
    index = word_set.word_index(torch.tensor([view_block]), torch.tensor([row]))
    replay.words[index[0, 0, 0]] ^= 1
    return {
        "request": request_id,
        "group": group.index,
        "layer": layer.name,
        "span": layer.byte_range(view_block, row),
        "view_block": view_block,
        "row": row,
    }


@pytest.mark.parametrize("layout", ["off", "on"])
def test_a_page_changed_behind_the_allocator_is_caught_when_its_owner_is_freed(small, layout, monkeypatch):
    """One word of one cell the first freed request wrote is flipped just
    before its free: the free-time check names exactly that cell."""
    on_free = PoolReplay._on_free
    corrupted: dict[str, object] = {}

    def corrupt_then_free(self, request):
        if not corrupted:
            corrupted.update(_flip_a_written_word(self, request.request_id))
        on_free(self, request)

    monkeypatch.setattr(PoolReplay, "_on_free", corrupt_then_free)
    with pytest.raises(PoolCorruption) as caught:
        replay_pool(*small[:1], layout, small[1])
    message = str(caught.value)
    c = corrupted
    lo, hi = c["span"]
    assert re.match(
        rf"^step \d+: request {c['request']}, group {c['group']}, layer {re.escape(c['layer'])}, "
        rf"bytes \[{lo}, {hi}\): view block {c['view_block']} row {c['row']} when {c['request']} is freed: "
        r"expected its position \d+, found ",
        message,
    ), (message, corrupted)


class _FreedUnchecked(Exception):
    """The control's free went through: stop the run there."""


def test_control_without_the_free_time_check_that_free_reports_nothing(small, monkeypatch):
    """The same flip with that one free's check skipped: the free goes
    through unreported (the run is stopped right after it), so the
    free-time check is what names the page at the free."""
    on_free = PoolReplay._on_free
    corrupted: dict[str, object] = {}

    def corrupt_then_free_unchecked(self, request):
        if not corrupted:
            corrupted.update(_flip_a_written_word(self, request.request_id))
            if corrupted:
                self._verify = lambda *args, **kwargs: None  # this free checks nothing
                on_free(self, request)
                raise _FreedUnchecked
        return on_free(self, request)

    monkeypatch.setattr(PoolReplay, "_on_free", corrupt_then_free_unchecked)
    with pytest.raises(_FreedUnchecked):
        replay_pool(*small[:1], "off", small[1])
    assert corrupted


@pytest.mark.parametrize("layout", ["off", "on"])
def test_a_block_two_requests_hold_is_caught_before_the_second_writes_it(small, layout, monkeypatch):
    """The sole-writer rule: at the first step where two running requests
    hold blocks of a full-attention group, the block the later one writes
    first this step is replaced in its table by the earlier one's first
    (one page, two owners). The write is refused naming the writer, the
    block and its other holder."""
    replay_step = PoolReplay._replay_step
    shared: dict[str, object] = {}

    def share_a_block(self, output):
        if not shared:
            computed = {item.request_id: item.num_computed_tokens for item in output.scheduled}
            for group in self.groups:
                manager = self.managers[group.index]
                if type(manager).__name__ != "FullAttentionManager":
                    continue
                tables = manager.req_to_blocks
                holding = [r for r in computed if [b for b in tables.get(r, []) if not b.is_null]]
                if len(holding) >= 2:
                    first, second = holding[0], holding[1]
                    block = next(b for b in tables[first] if not b.is_null)
                    # The block the second writes its first token of the step into.
                    tables[second][computed[second] // manager.block_size] = block
                    shared.update(group=group.index, first=first, second=second, block=block.block_id)
                    break
        replay_step(self, output)

    monkeypatch.setattr(PoolReplay, "_replay_step", share_a_block)
    with pytest.raises(PoolCorruption) as caught:
        replay_pool(*small[:1], layout, small[1])
    message = str(caught.value)
    s = shared
    assert re.match(
        rf"^step \d+: request {s['second']}, group {s['group']}, layer \S+, bytes \[\d+, \d+\): "
        rf"writes view block {s['block']} held by {s['first']}$",
        message,
    ), (message, shared)


@pytest.mark.parametrize("layout", ["off", "on"])
def test_a_page_changed_behind_the_allocator_is_caught_when_a_prefix_hit_reads_it(small, layout, monkeypatch):
    """One word of a cell of the first prefix hit's first cached block (a
    group of one slot per block, a cell somebody wrote) is flipped just
    before the hit is checked: the hit check names the hitting request.
    (No other check runs between the flip and the hit's.)"""
    on_hit = PoolReplay._on_hit
    corrupted: dict[str, object] = {}

    def corrupt_then_hit(self, request_id, blocks, num_hit):
        for group in self.groups if not corrupted else ():
            if group.kind == "ring" or group.slots_per_block != 1:
                continue
            hit = [b.block_id for b in blocks.blocks[group.index] if not b.is_null]
            for row_class in group.classes if hit else ():
                rows = torch.nonzero(row_class.shadow[hit[0]] != UNKNOWN).flatten().tolist()
                if rows and not corrupted:
                    word_set = row_class.word_sets[0]
                    index = word_set.word_index(torch.tensor([hit[0]]), torch.tensor([rows[0]]))
                    self.words[index[0, 0, 0]] ^= 1
                    corrupted.update(request=request_id, group=group.index, block=hit[0], row=rows[0])
        on_hit(self, request_id, blocks, num_hit)

    monkeypatch.setattr(PoolReplay, "_on_hit", corrupt_then_hit)
    with pytest.raises(PoolCorruption) as caught:
        replay_pool(*small[:1], layout, small[1])
    message, c = str(caught.value), corrupted
    assert c, "the small replay has no prefix hit to corrupt"
    # The cell's writer is named, then the reader; flipping the word's lowest
    # bit turns the written position p into p ^ 1.
    found = re.match(
        rf"^step \d+: request r\d+, group {c['group']}, .*view block {c['block']} row {c['row']} "
        rf"when {c['request']} hits it: expected its position (\d+), found .*position (\d+)\)$",
        message,
    )
    assert found, (message, c)
    assert int(found[2]) == int(found[1]) ^ 1


def test_the_report_names_the_run_its_pool_and_its_steps(monkeypatch):
    """Two requests of at most 96 + 96 tokens (six 32-token blocks each) in
    the 93-block pool: nothing is preempted, and the old layout has no
    packed ring group. The clock is faked to tick once per reading, so each
    timed hook adds exactly one second to its step."""
    ticks = iter(range(10**9, 2 * 10**9))  # a clock that started long ago
    monkeypatch.setattr("sim.pool_replay.replay.time.perf_counter", lambda: float(next(ticks)))
    scenario = load_scenario(str(SMALL), ["workload.num_requests=2"])
    report = replay_pool(scenario, "off", scenario_workload(scenario))
    assert (report.scenario, report.layout, report.rank, report.device) == ("pool-replay", "off", 0, "cpu")
    # 12 MB over the larger stage's stride (129,024 B): 93 blocks on every rank.
    assert report.num_blocks == 93
    assert report.pool_bytes == 93 * report.block_stride_bytes <= 12_000_000
    counts = report.counts
    assert (counts["num_requests"], counts["num_preemptions"], counts["max_ring_slots_sharing_a_block"]) == (
        2,
        0,
        0,
    )
    assert counts["prefix_hit_tokens"] % 32 == 0  # whole blocks
    numbers = [step.step for step in report.steps]
    assert numbers == sorted(set(numbers)) and numbers
    # Every step's time is a whole count of timed hooks; some step has two.
    assert all(step.replay_s >= 1 and step.replay_s == int(step.replay_s) for step in report.steps)
    assert max(step.replay_s for step in report.steps) >= 2
    assert all(step.time_s >= 0.0 for step in report.steps)
    assert report.replay_s == sum(step.replay_s for step in report.steps) < report.wall_s
    assert report.wall_s < 10**9  # the run's own readings, not the clock's age


def test_a_pinned_pool_changes_the_pool_bytes_alone(small):
    scenario = small[0]
    pinned = with_pool_bytes(scenario, 5_000_000)
    assert pinned.deployment.kv_cache_memory_bytes == 5_000_000
    assert pinned.deployment.max_model_len == 512 and pinned.name == "pool-replay"
    assert scenario.deployment.kv_cache_memory_bytes == 12_000_000  # the original is kept


def _idle_replay(small) -> PoolReplay:
    """A replay bound to the small scenario's pool, nothing run yet."""
    scenario, workload = small
    sim = Simulation(scenario, "off", workload)
    return PoolReplay(sim, allocate_worker_views(sim.plan, 0, device=torch.device("cpu")))


def _hit_nothing(replay: PoolReplay) -> SimpleNamespace:
    """A prefix hit of no block in any group (the pages it reads: none)."""
    return SimpleNamespace(blocks=tuple([] for _ in replay.managers))


def test_each_requests_prefix_hit_is_verified_once_per_lookup_of_new_blocks(small):
    """The memo skips only the same request's same hit looked up again
    while it waits: a hits, a again (skipped), b the same blocks: two
    verified, counted by hand. (One memo for all requests would take b's
    hit for a's repeat: one.)"""
    replay = _idle_replay(small)
    blocks = _hit_nothing(replay)
    for request_id in ("a", "a", "b"):
        replay.prefix_hit(SimpleNamespace(request_id=request_id), blocks, 0)
    assert replay.counts["prefix_hits_verified"] == 2


def test_finish_passes_the_fences_of_every_step_scheduled(small):
    """At the end every scheduled step has completed, so a fence waiting
    for the last scheduled step (seq 3, the workers' clock still at 1) is
    passed and verified: one fence, none left; a fence verified at the
    workers' clock alone would stay."""
    replay = _idle_replay(small)
    replay.scheduler.sched_step_seq, replay.scheduler.processed_step_seq = 3, 1
    replay.fences.append(Fence(seq=3, request_id="a", step=2, keys=set(), cells=[]))
    replay.finish()
    assert (replay.counts["fences_verified"], replay.fences) == (1, [])


def test_a_replay_stops_at_the_scenarios_horizon(small):
    """``simulation.max_time_s`` 0.5: no step replayed past half a second
    of simulated time (control: without it the run goes on past it)."""
    scenario, workload = small
    stopped = replay_pool(load_scenario(str(SMALL), ["simulation.max_time_s=0.5"]), "off", workload)
    assert stopped.steps and max(step.time_s for step in stopped.steps) <= 0.5
    whole = replay_pool(scenario, "off", workload)
    assert max(step.time_s for step in whole.steps) > 0.5
