"""Steady decodes (``sim/sched/fast_path/steady.py``) and known-idle waiting loops:
the fast path's lane gives the steps, frames and allocator states the
ordinary path gives.

Checks that do not read the lane's own reasoning: hand-counted lane steps of
one request across a block boundary (from the settled windows' arithmetic,
pinned in ``test_fast_path.py``); a lane and a scheduler that make every
call they skip (each steady request's allocation and caching, each waiting
loop known to admit nobody) and compare the whole allocator state; the
frames with the fast path off; vLLM's own Scheduler through the conformance
driver. Each has a failing control.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import scenarios
from helpers.allocator import K
from helpers.fast_path import CHECKED_CASES, audited, checked_simulation, frames_with_fast_path, one_request
from helpers.scheduler import CheckedEngine, tiny_scheduler, tiny_spec

from sim.analysis.runs import scenario_workload
from sim.conformance.driver import run_conformance
from sim.engine import Simulation
from sim.paths import SCENARIOS_DIR
from sim.scenario import load_scenario
from sim.sched.engine_core import EngineCore
from sim.sched.fast_path.kv_cache_manager import FastPathKVCacheManager
from sim.sched.fast_path.memos import FastPath
from sim.sched.fast_path.steady import SyncSteadyLane, _Kept
from sim.sched.model_runner import AcceptanceModel, ModelRunner, UniformStream, accepted_drafts
from sim.sched.scheduler import _StepState
from sim.vllm_bridge import RequestStatus, kv_cache_utils

# ------------------------------------------------------------ the draws


def test_the_stream_gives_the_generators_own_draws_across_blocks():
    """The runner draws from blocks; the numbers are those of one
    ``random()`` call per draw, across block ends too."""
    seed = np.random.SeedSequence([7, 1])
    one_by_one = np.random.default_rng(seed)
    stream = UniformStream(np.random.default_rng(seed))
    count = 2 * UniformStream.BLOCK + 5
    assert [stream.random() for _ in range(count)] == [one_by_one.random() for _ in range(count)]


@pytest.mark.parametrize("rates", [(0.8, 0.7, 0.6), (1.0, 1.0, 1.0), (0.0,), (0.5, 0.9)])
def test_the_streams_acceptance_draws_are_the_rules(rates):
    """The runner's per-decode draw (``UniformStream.accepted_drafts``)
    accepts what ``accepted_drafts`` does on the same numbers, leaving the
    stream at the same place, across block ends."""
    fast = UniformStream(np.random.default_rng(3))
    rule = UniformStream(np.random.default_rng(3))
    for _ in range(UniformStream.BLOCK):
        assert fast.accepted_drafts(rates) == accepted_drafts(rates, rule)
    assert fast.random() == rule.random()


def test_a_steps_acceptance_draws_in_one_call_are_the_rules():
    """``UniformStream.accepted_drafts_each`` (the async runner's draws for a
    step's requests) accepts what ``accepted_drafts`` does request by
    request, rates of mixed lengths, across block ends, leaving the stream
    at the same place."""
    each = UniformStream(np.random.default_rng(4))
    rule = UniformStream(np.random.default_rng(4))
    steps = [[(0.8, 0.7, 0.6), (0.5,), (), (1.0, 0.9)]] * (UniformStream.BLOCK // 3)
    for rates_each in steps:
        assert each.accepted_drafts_each(rates_each) == [accepted_drafts(rates, rule) for rates in rates_each]
    assert each.random() == rule.random()


def test_a_runners_acceptance_draws_are_its_per_request_draws():
    """``ModelRunner.acceptance_draws`` (the lane's draw per request) gives
    the numbers ``num_accepted`` gives, one rule's rate per position, from
    the same place in the stream."""
    acceptance = AcceptanceModel(conditional_rates=(0.8, 0.5, 0.3))
    looped = ModelRunner(acceptance, np.random.default_rng(5))
    per_call = ModelRunner(acceptance, np.random.default_rng(5))
    draw = looped.acceptance_draws(3)
    drawn = [draw() for _ in range(2 * UniformStream.BLOCK)]
    assert drawn == [per_call.num_accepted(3) for _ in range(2 * UniformStream.BLOCK)]
    assert set(drawn) == {0, 1, 2, 3}
    assert looped.acceptance_draws(0)() == 0


# ------------------------------------------------------ hand-counted lanes


def _lane_steps(simulation: Simulation) -> tuple[list[bool], list]:
    """Drive the engine core without a clock (every request queued at
    once): which steps took the lane, and each step's outcome."""
    for spec in simulation.workload.requests:
        simulation.scheduler.add_request(spec)
    steady, outcomes = [], []
    for _ in range(10_000):
        if not simulation.scheduler.has_unfinished_requests():
            break
        scheduled = simulation.core.schedule()
        assert not scheduled.output.is_empty
        outcomes.append(simulation.core.complete(scheduled))
        steady.append(scheduled.num_steady > 0)
    return steady, outcomes


def test_a_decode_across_a_block_boundary_runs_steady_inside_its_windows(tmp_path):
    """A 3,120-token prompt, 150 outputs, one token a step (the counts of
    ``test_the_calls_skipped_across_a_block_boundary``): the prefill and the
    first decode (c = 3,120: its allocation is real) are ordinary; c = 3,121
    .. 3,160 steady (40: the allocation window ends at 3,167 and a step's
    span is c .. c + 7); c = 3,161 .. 3,233 ordinary (73: real calls, the
    last one settling the next block); c = 3,234 .. 3,268 steady (35), the
    last stopping the request inside the lane."""
    steady, outcomes = _lane_steps(one_request(tmp_path, 3120, 150))
    assert steady == [False] * 2 + [True] * 40 + [False] * 73 + [True] * 35
    assert sum(o.num_generated_tokens for o in outcomes) == 150
    assert [dict(o.finished) for o in outcomes if o.finished] == [{"r000000": 150}]


def test_where_the_scheduler_caches_at_allocation_only_the_allocation_window_alone_bounds_the_lane(tmp_path):
    """Rule 6 in fork mode (``fork.caches_at_allocation_only``: the fork's
    0.30.0 sync Scheduler makes no caching call after sampling, so no
    caching window is ever known): the counts of the test above, which its
    allocation windows alone set (the caching window never bound there)."""
    simulation = one_request(tmp_path, 3120, 150, "fork.caches_at_allocation_only=true")
    assert not simulation.scheduler.config.caches_after_sampling
    steady, _ = _lane_steps(simulation)
    assert steady == [False] * 2 + [True] * 40 + [False] * 73 + [True] * 35


def test_without_drafts_the_allocation_window_alone_bounds_the_lane(tmp_path):
    """Rule 6 with K = 0: a step schedules one token and makes no caching
    call after sampling (there is nothing to cache past the allocation), so
    no caching window is known. 100-token prompt, 150 outputs: the prefill
    and the first decode (c = 100, a real allocation) are ordinary, then
    every step is steady: 148 (the allocation window ends at 3,167)."""
    simulation = one_request(tmp_path, 100, 150, "mtp.num_speculative_tokens=0")
    assert simulation.scheduler.config.caches_after_sampling
    steady, outcomes = _lane_steps(simulation)
    assert steady == [False] * 2 + [True] * 148
    assert sum(o.num_generated_tokens for o in outcomes) == 150


def test_every_draft_accepted_stops_inside_the_lane(tmp_path):
    """100-token prompt, 150 outputs, 4 tokens a decode step: the prefill
    samples 1, the first decode 4 (ordinary: its allocation is real), then
    36 steady steps of 4 reach 149 and a 37th, steady too, stops at its first
    token (the other 3 dropped)."""
    steady, outcomes = _lane_steps(one_request(tmp_path, 100, 150, "mtp.acceptance_rates=[1, 1, 1]"))
    assert steady == [False, False] + [True] * 37
    assert [o.num_generated_tokens for o in outcomes] == [1] + [4] * 37 + [1]
    assert outcomes[-1].finished == {"r000000": 150}


def test_a_kept_request_takes_its_tokens_first_at_the_step_that_may_stop_it(tmp_path):
    """Rules 5-6 at ``unstoppable``'s edge. A 100-token prompt, 150 outputs,
    one token a step: a step starting at c computed tokens starts with
    c - 99 outputs and samples at most 1 + K = 4, so it may stop the request
    only from c = 245 (146 + 4 = 150). The request enters the lane at
    c = 101 and its ``Request`` stays stale (2 outputs, rule 5) through the
    step at c = 244, the last that cannot stop it; from c = 245 each step
    hands it its tokens the scheduler's way: 147, 148, 149, 150 outputs."""
    simulation = one_request(tmp_path, 100, 150)
    scheduler, core = simulation.scheduler, simulation.core
    scheduler.add_request(simulation.workload.requests[0])
    core.complete(core.schedule())  # the prefill (the Request is built at the queue's head)
    request = scheduler.requests["r000000"]
    seen = [request.num_output_tokens]
    while scheduler.has_unfinished_requests() and len(seen) < 200:
        core.complete(core.schedule())
        seen.append(request.num_output_tokens)
    assert seen == [1, 2] + [2] * 144 + [147, 148, 149, 150]


@pytest.mark.parametrize(
    ("prompt", "overrides", "expected"),
    [
        # max_model_len 300: the clip leaves 300 - c - 1 tokens, 1 + K = 4
        # of them while c <= 295 (the allocation window, to 3,167, is wider).
        (
            100,
            ["deployment.max_model_len=300", "workload.output.tokens=1000"],
            {101: 295, 295: 295, 296: None},
        ),
        # The allocation window ends at 3,167 and a step spans c .. c + 7
        # (1 + K tokens, K lookahead slots): the last steady start is 3,160
        # (the caching window, c + 1 .. c + 4 up to 3,167, would allow 3,163).
        (3120, [], {3121: 3160, 3160: 3160, 3161: None}),
    ],
)
def test_a_requests_limit_is_the_last_step_start_its_windows_and_the_clip_leave_whole(
    tmp_path, prompt, overrides, expected
):
    """Rule 6's ``limit`` at its edges, hand-derived: the most computed
    tokens a steady step may start at, and None once the request is past it
    (a request at its limit enters). Read at each step's start with the lane
    off (fresh ``Request``s; the scheduler's own settled calls keep the
    windows), one token a step."""
    simulation = one_request(tmp_path, prompt, 150, *overrides)
    scheduler = simulation.scheduler
    scheduler.fast_path.use_lane = False
    simulation.core = EngineCore(scheduler, simulation.model_runner)
    lane = SyncSteadyLane(scheduler, scheduler.kv_cache_manager, simulation.model_runner)
    scheduler.add_request(simulation.workload.requests[0])
    limits = {}
    while scheduler.has_unfinished_requests() and len(limits) < len(expected):
        simulation.core.complete(simulation.core.schedule())
        request = scheduler.requests["r000000"]
        if request.num_computed_tokens in expected:
            limits[request.num_computed_tokens] = lane.limit(request)
    assert limits == expected


def test_a_steady_step_admits_an_arrival_after_its_decodes(tmp_path):
    """r000000 (100-token prompt) decodes; steps 1-2 are ordinary, 3-4
    steady. r001 (50 tokens) arrives: in step 5 the lane offers r000000's
    1 + K = 4 tokens and the waiting loop admits r001 after them (its whole
    prompt fits the 8,192-token budget), which samples its first token the
    scheduler's way."""
    simulation = one_request(tmp_path, 100, 150)
    scheduler, core = simulation.scheduler, simulation.core
    scheduler.add_request(simulation.workload.requests[0])
    steady = []
    for _ in range(4):
        step = core.schedule()
        core.complete(step)
        steady.append(step.num_steady)
    assert steady == [0, 0, 1, 1]
    scheduler.add_request(tiny_spec(1, 50))
    step = core.schedule()
    assert step.num_steady == 1 and step.output.new_request_ids == ("r001",)
    scheduled = [(i.request_id, i.num_scheduled_tokens) for i in step.output.scheduled]
    assert scheduled == [("r000000", 4), ("r001", 50)]
    outcome = core.complete(step)
    assert outcome.first_token_request_ids == ("r001",) and outcome.num_generated_tokens == 2
    # r000000 stays in the lane while r001's first decode allocates for real.
    step = core.schedule()
    assert step.num_steady == 1 and [i.request_id for i in step.output.scheduled] == ["r000000", "r001"]


def _steady_then_arrival(tmp_path, prompt: int, num_steady_steps: int):
    """r000000 (100-token prompt) runs ``num_steady_steps`` steps, then
    r001 (``prompt`` tokens) arrives: the next step."""
    simulation = one_request(tmp_path, 100, 150)
    scheduler, core = simulation.scheduler, simulation.core
    scheduler.add_request(simulation.workload.requests[0])
    for _ in range(num_steady_steps):
        core.complete(core.schedule())
    scheduler.add_request(tiny_spec(1, prompt))
    return core.schedule()


def test_a_one_token_admission_beside_steady_decodes_is_padded_to_a_uniform_decode(tmp_path):
    """r001's prompt is one token (no prefix hit, one token left). In a step
    whose only running decode is steady (r000000, step 5 as above), vLLM
    pads the admission to 1 + K = 4 rows (a running request was scheduled,
    no prefill was): r001 gets 4 tokens, marked padded."""
    step = _steady_then_arrival(tmp_path, 1, 4)
    assert step.num_steady == 1
    shares = [(i.request_id, i.num_scheduled_tokens, i.is_padded) for i in step.output.scheduled]
    assert shares == [("r000000", 4, False), ("r001", 4, True)]


def test_a_one_token_admission_with_nothing_else_scheduled_is_not_padded(tmp_path):
    """Control: r000000 finished (150 outputs, one token a step: 150
    steps), r001 arrives to an idle engine; with no running request
    scheduled and no prefix hit, its one token goes alone, unpadded."""
    step = _steady_then_arrival(tmp_path, 1, 150)
    shares = [(i.request_id, i.num_scheduled_tokens, i.is_padded) for i in step.output.scheduled]
    assert shares == [("r001", 1, False)]


def test_the_max_model_len_clip_ends_the_lane(tmp_path):
    """max_model_len 300, a 100-token prompt, one token a step: the lane
    runs c = 101 .. 295 (195 steps: at 295 the clip, 300 - 295 - 1 = 4,
    still leaves 1 + K; the step there may reach the limit, so the request
    takes its token the scheduler's way); at c = 296, 297, 298 the clip
    leaves 3, 2, 1 tokens (ordinary), and the last reaches 300 tokens."""
    simulation = one_request(tmp_path, 100, 1000, "deployment.max_model_len=300")
    steady, outcomes = _lane_steps(simulation)
    assert steady == [False, False] + [True] * 195 + [False] * 3
    assert sum(o.num_generated_tokens for o in outcomes) == 200
    assert outcomes[-1].finished == {"r000000": 200}


def test_a_step_that_reaches_max_model_len_stops_the_request_in_the_lane(tmp_path):
    """max_model_len 300, a 99-token prompt, every draft accepted (4 tokens
    a decode step): steady from c = 103 by fours to 291 (48 steps, each
    unable to stop it), then c = 295, where 4 more tokens reach 300: the
    request takes them the scheduler's way and stops, 201 tokens out."""
    simulation = one_request(
        tmp_path, 99, 1000, "deployment.max_model_len=300", "mtp.acceptance_rates=[1, 1, 1]"
    )
    steady, outcomes = _lane_steps(simulation)
    assert steady == [False, False] + [True] * 49
    assert [o.num_generated_tokens for o in outcomes] == [1] + [4] * 50
    assert outcomes[-1].finished == {"r000000": 201}


def test_a_steady_decode_runs_beside_an_earlier_prefill(tmp_path):
    """r000's 30,000-token prompt takes several chunks; r001 (50 tokens) is
    admitted after its first chunk and decodes while the chunks go on: in
    those steps the ordinary prefill comes first in the running loop and
    the steady decode after it."""
    simulation = one_request(tmp_path, 100, 10)  # its workload unused
    simulation.scheduler.add_request(tiny_spec(0, 30000, output=100))
    simulation.scheduler.add_request(tiny_spec(1, 50, output=100))
    mixed = []
    for _ in range(20):
        step = simulation.core.schedule()
        simulation.core.complete(step)
        shares = {
            i.request_id: (i.num_prompt_tokens_left, i.num_scheduled_tokens) for i in step.output.scheduled
        }
        if len(shares) == 2 and shares["r000"][0] > 0 and step.num_steady == 1:
            mixed.append(shares["r001"])
    assert mixed and set(mixed) == {(0, 4)}


@pytest.mark.parametrize(("budget", "expected"), [(6, [4, 2]), (5, [4, 1])])
def test_a_clipped_budget_hands_a_steady_decode_back(tmp_path, budget, expected):
    """A 6- (5-) token budget and two decoding requests: the first takes its
    1 + K = 4 steady tokens, the second gets the 2 (1) left, the ordinary
    way (the lane hands it back; one token goes without drafts); every
    step's output and outcome equal those of the step-by-step run."""
    fast = _steps_as_step_by_step(tmp_path, [f"scheduler.max_num_batched_tokens={budget}"])
    shares = [[i.num_scheduled_tokens for i in output.scheduled] for output, _, steady in fast if steady]
    assert expected in shares


def test_a_long_prefill_threshold_below_a_decode_hands_it_back(tmp_path):
    """long_prefill_token_threshold 1 clips every request's step to one
    token while both run: no decode is taken as it is, and every step's
    output and outcome equal the step-by-step run's."""
    fast = _steps_as_step_by_step(tmp_path, ["scheduler.long_prefill_token_threshold=1"])
    both_running = [steady for output, _, steady in fast if len(output.scheduled) == 2]
    assert both_running and not any(both_running)


def _steps_as_step_by_step(tmp_path, overrides: list[str]) -> list[tuple]:
    """``_steps_of`` with the fast path, checked step for step (output and
    outcome) against the run without it."""
    fast = _steps_of(tmp_path, overrides, fast_path=True)
    step_by_step = _steps_of(tmp_path, overrides, fast_path=False)
    assert [(output, outcome) for output, outcome, _ in fast] == [(o, oc) for o, oc, _ in step_by_step]
    return fast


def _steps_of(tmp_path, overrides: list[str], *, fast_path: bool) -> list[tuple]:
    """Two 40-token prompts decoding 30 tokens each (one token a step),
    driven without a clock: every step's output, its outcome, and whether
    the lane took a decode in it."""
    simulation = one_request(tmp_path, 100, 10, *overrides, f"simulation.fast_path={str(fast_path).lower()}")
    for index in range(2):
        simulation.scheduler.add_request(tiny_spec(index, 40, output=30))
    steps = []
    for _ in range(500):
        if not simulation.scheduler.has_unfinished_requests():
            break
        scheduled = simulation.core.schedule()
        outcome = simulation.core.complete(scheduled)
        steps.append((scheduled.output, outcome, scheduled.num_steady > 0))
    return steps


def test_a_lane_blind_to_the_allocation_window_runs_through_the_boundary(monkeypatch, tmp_path):
    """Failing control for the hand count: a lane that takes a step's
    allocation as settled whenever a window is known."""
    monkeypatch.setattr(SyncSteadyLane, "limit", _limit_without_allocation_window)
    steady, _ = _lane_steps(one_request(tmp_path, 3120, 150))
    assert steady != [False] * 2 + [True] * 40 + [False] * 73 + [True] * 35


def _limit_without_allocation_window(self: SyncSteadyLane, request) -> int | None:
    caching = self.door.caching.bounds(request.request_id)
    if request.num_computed_tokens != request.num_tokens - 1 or caching is None:
        return None
    return self.scheduler.config.max_model_len


# ----------------------------------------------------- the waiting memo


def _takes_blocks(scheduler) -> None:
    """A running request's allocation or caching, say: through the door
    it moves the allocator's version only (rule 12)."""
    scheduler.kv_cache_manager.allocator_version += 1


def _frees(scheduler) -> None:
    """A free through the allocator's door (of no blocks): a change that
    may give blocks back moves both versions (rule 3)."""
    scheduler.kv_cache_manager.free_blocks([])


def _third_prompt_refused():
    """The waiting memo's scene (below): after step 2's schedule."""
    scheduler = tiny_scheduler(num_blocks=34, budget=512)
    engine = EngineCore(scheduler, _runner())
    for index in range(3):
        scheduler.add_request(tiny_spec(index, 60))
    engine.complete(engine.schedule())
    return scheduler, engine, engine.schedule()


def test_the_waiting_memo_holds_only_for_the_same_inputs_and_allocator():
    """Tiny model (32-token blocks): two 60-token prompts take 14 blocks
    each of a 34-block pool in step 1 (with the shared ring page and the
    null block, 4 are left); in step 2 each decode (4 tokens of a 512-token
    budget) needs a third attention block (60 + 4 + K = 67 > 64 tokens), and
    the third prompt (14 blocks) is refused with 2 free. Until the allocator
    changes, a waiting loop with the same inputs (504 tokens left, decodes
    scheduled, no prefill) would refuse it again; other inputs or an
    allocator change void that (one that may free blocks: rule 12 keeps it
    through a running request's allocation or caching, tested below)."""
    scheduler, _, step = _third_prompt_refused()
    assert [item.request_id for item in step.output.scheduled] == ["r000", "r001"]
    assert scheduler.fast_path.waiting_known_idle(504, True, False)
    assert not scheduler.fast_path.waiting_known_idle(503, True, False)
    assert not scheduler.fast_path.waiting_known_idle(504, True, True)
    _frees(scheduler)  # a call that may free blocks (rule 12 aside)
    assert not scheduler.fast_path.waiting_known_idle(504, True, False)


def test_a_head_that_found_nothing_stays_refused_while_running_requests_only_take_blocks():
    """Rule 12, the same scene: the third prompt's lookup found nothing in
    any group, and it needs 14 blocks with 2 free. Completing step 2 caches
    the decodes' blocks (their own hashes: rule 3 alone would void the
    memo); nothing else changed and no block came free, so the loop is
    still known idle. Controls, each voiding it: a memo that saw fewer
    free blocks than now, one whose head's lookup found something, one of
    the head's own hashes inserted, a request's blocks freed."""
    scheduler, engine, step = _third_prompt_refused()
    fast_path = scheduler.fast_path
    idle = fast_path._idle_waiting
    assert idle is not None and idle.head_missed and idle.num_free_blocks == 2

    def known(memo=idle) -> bool:
        fast_path._idle_waiting = memo
        return fast_path.waiting_known_idle(504, True, False)

    engine.complete(step)
    assert fast_path.door.allocator_version != idle.allocator_version
    assert known()
    assert not known(replace(idle, num_free_blocks=1))
    assert not known(replace(idle, head_missed=False))
    scheduler.finish_requests("r000", RequestStatus.FINISHED_ABORTED)
    assert not known()


def test_a_release_bump_at_a_running_allocation_alone_is_caught():
    """Rule 12 through the door's running ``allocate_slots`` alone (the
    test above passes through ``cache_blocks`` too): r000's next decode is
    a real call (the tiny model's 32-token blocks leave no window inside a
    32-token margin), which may take blocks, never give any back, so the
    release version stays and the head stays refused. Control: the same
    call with the release version bumped there (the fault this test is
    for, ``rule3-running-allocation-bumps-release`` in
    ``scripts/hand_mutants.py``) voids the memo."""
    scheduler, engine, step = _third_prompt_refused()
    fast_path, door = scheduler.fast_path, scheduler.kv_cache_manager
    engine.complete(step)
    idle, release = fast_path._idle_waiting, door.release_version
    request = scheduler.requests["r000"]
    allocations = door.allocator_version
    door.allocate_slots(request, 1 + K, num_lookahead_tokens=K)  # refused here: 2 blocks free
    assert door.allocator_version == allocations + 1  # a real call, counted
    assert door.release_version == release
    assert fast_path.waiting_known_idle(504, True, False)
    door.release_version += 1  # control: the bump the fault adds
    fast_path._idle_waiting = idle
    assert not fast_path.waiting_known_idle(504, True, False)


def test_a_head_forgotten_then_remembered_again_by_a_pin_lookup_is_looked_up_again():
    """Rule 12 holds from the waiting loop's own lookup that found nothing:
    once one of the head's hashes is inserted, a pin lookup that finds no
    hit remembers it again for rule 10 (no tokens hit, though a group's
    blocks or the boundary may now be found), but neither its lookup nor
    its loop is known any more (control: before the insertion both are)."""
    scheduler, _, _ = _third_prompt_refused()
    fast_path, head, kv = scheduler.fast_path, scheduler.waiting[0], scheduler.kv_cache_manager
    _takes_blocks(scheduler)
    assert fast_path.waiting_known_idle(504, True, False) and kv.finds_nothing(head)
    pool = kv.block_pool
    key = kv_cache_utils.make_block_hash_with_group_id(head.block_hashes[0], 99)
    pool._insert_block_hash(key, pool.blocks[1], num_tokens=16)
    kv.missed_pin_lookups.found_no_hit(head)  # a pin pass's lookup: no tokens hit
    assert kv.missed_pin_lookups.knows_no_hit(head)
    assert not kv.finds_nothing(head)
    assert not fast_path.waiting_known_idle(504, True, False)


def test_rule_12_keeps_the_idle_loops_of_other_inputs_across_the_changes_it_allows():
    """The same scene: a loop at 400 tokens left, run after a running
    request's caching (the allocator's version moved, rule 12 holds),
    is remembered beside the loop at 504 (both still refuse the head);
    after a free neither is known."""
    scheduler, _, _ = _third_prompt_refused()
    fast_path = scheduler.fast_path
    _takes_blocks(scheduler)
    scheduler._schedule_waiting(_StepState(token_budget=400, running_scheduled=True, prefill_scheduled=False))
    assert fast_path.waiting_known_idle(400, True, False) and fast_path.waiting_known_idle(504, True, False)
    _frees(scheduler)
    assert not fast_path.waiting_known_idle(400, True, False)
    assert not fast_path.waiting_known_idle(504, True, False)
    # A loop run after that change is remembered alone: the older inputs
    # were idle on a state rule 12 does not carry over.
    scheduler._schedule_waiting(_StepState(token_budget=400, running_scheduled=True, prefill_scheduled=False))
    assert fast_path.waiting_known_idle(400, True, False)
    assert not fast_path.waiting_known_idle(504, True, False)


def test_a_head_whose_own_hash_is_inserted_is_looked_up_again():
    """Rule 12's control through rule 10: after a call that only takes
    blocks the memo holds, but a hash of the refused head's prompt inserted
    into the pool's map voids it (the lookup may hit now)."""
    scheduler, _, _ = _third_prompt_refused()
    head = scheduler.waiting[0]
    pool = scheduler.kv_cache_manager.block_pool
    _takes_blocks(scheduler)
    assert scheduler.fast_path.waiting_known_idle(504, True, False)
    key = kv_cache_utils.make_block_hash_with_group_id(head.block_hashes[0], 0)
    pool._insert_block_hash(key, pool.blocks[1], num_tokens=16)
    assert not scheduler.fast_path.waiting_known_idle(504, True, False)


def test_a_refused_head_that_found_nothing_is_neither_looked_up_nor_allocated_again():
    """Rule 12 inside the loop, the same scene after step 2's caching: a
    loop at another budget (400 tokens left: not remembered whole) still
    clips the head to its 60 tokens, but neither looks it up (vLLM would
    answer its empty blocks) nor tries its allocation (refused with the
    same 60 tokens and running requests, only caching since). Controls:
    with a request's blocks freed the allocation is tried (the lookup is
    still known: none of the head's hashes was inserted); with one of the
    head's hashes inserted, the lookup is made (and finds nothing here)."""
    scheduler, engine, step = _third_prompt_refused()
    engine.complete(step)
    kv = scheduler.kv_cache_manager
    calls: list[str] = []
    # The calls that pass the door, made on the allocator behind it.
    look_up, allocate = kv.wrapped.get_computed_blocks, kv.wrapped.allocate_slots
    kv.wrapped.get_computed_blocks = lambda *a, **k: (calls.append("lookup"), look_up(*a, **k))[1]  # type: ignore[method-assign]
    kv.wrapped.allocate_slots = lambda *a, **k: (calls.append("allocate"), allocate(*a, **k))[1]  # type: ignore[method-assign]

    def waiting_loop() -> list[str]:
        calls.clear()
        scheduler._schedule_waiting(
            _StepState(token_budget=400, running_scheduled=True, prefill_scheduled=False)
        )
        return list(calls)

    assert waiting_loop() == []
    _frees(scheduler)  # the pool may have room now
    assert waiting_loop() == ["allocate"]
    head = scheduler.waiting[0]
    # One of the head's hashes under a group id no lookup probes: the head is
    # forgotten, looked up again, found to hit nothing, and its allocation is
    # known refused again (nothing came free since the last try).
    key = kv_cache_utils.make_block_hash_with_group_id(head.block_hashes[0], 99)
    kv.block_pool._insert_block_hash(key, kv.block_pool.blocks[1], num_tokens=16)
    assert waiting_loop() == ["lookup"]


def test_a_refused_admission_is_known_only_for_the_same_request_tokens_running_set_and_empty_lookup():
    """Rule 12's admission memo, the same scene after step 2's caching: the
    third prompt refused with 60 tokens while requests ran. Known refused:
    the same request and tokens. Not known: other tokens, no request
    running (vLLM's watermark), another request whose lookup found nothing
    too (same tokens), the head once one of its hashes is inserted. Under
    the audit each skipped admission is made anyway and counted once."""
    scheduler, engine, step = _third_prompt_refused()
    engine.complete(step)
    fast_path, head = scheduler.fast_path, scheduler.waiting[0]
    refused = fast_path._refusal
    assert refused is not None and (refused.request, refused.num_new, refused.has_scheduled_reqs) == (
        head,
        60,
        True,
    )

    def known(request=head, num_new: int = 60) -> bool:
        return fast_path.skips_refused_admission(request, num_new, lambda: None)

    assert known()
    assert not known(num_new=59)
    fast_path._refusal = replace(refused, has_scheduled_reqs=False)
    assert not known()
    fast_path._refusal = refused
    scheduler.add_request(tiny_spec(3, 60))
    _, other = scheduler._waiting_requests()  # built as the pin pass builds it
    scheduler.kv_cache_manager.get_computed_blocks(other)  # it finds nothing too
    assert not known(other)
    scheduler.kv_cache_manager.get_computed_blocks(head)
    fast_path.door.audit = True
    assert known() and known()
    assert fast_path.door.audited["refused admission"] == 2
    pool = scheduler.kv_cache_manager.block_pool
    key = kv_cache_utils.make_block_hash_with_group_id(head.block_hashes[0], 99)
    pool._insert_block_hash(key, pool.blocks[1], num_tokens=16)  # forgets the head (rule 10)
    assert not known()


def test_each_audited_lookup_that_finds_nothing_counts_once():
    """Under the audit a skipped lookup is made and must find nothing;
    each counts once (two skips, two counted); the skip answers what vLLM
    answers."""
    scheduler, _, _ = _third_prompt_refused()
    head, kv = scheduler.waiting[0], scheduler.kv_cache_manager
    kv.audit = True
    assert kv.finds_nothing(head)
    # The door then answers as vLLM does for a lookup that finds nothing:
    # its empty blocks (the same object), no tokens, no boundary.
    assert (
        kv.get_computed_blocks(head)
        == kv.wrapped.get_computed_blocks(head)
        == (kv.empty_kv_cache_blocks, 0, 0)
    )
    assert kv.get_computed_blocks(head)[0] is kv.empty_kv_cache_blocks
    assert kv.audited["lookup"] == 2


@pytest.mark.parametrize(
    ("hit", "num_hit", "boundary", "missed"),
    [
        (([], []), 0, 0, True),
        (([], [object()]), 0, 0, False),
        (([], []), 0, 32, False),
        (([], []), 16, 0, False),
    ],
)
def test_a_lookup_found_nothing_only_with_no_block_no_token_and_no_boundary(hit, num_hit, boundary, missed):
    """Rule 12 holds only for a head whose lookup found nothing in any
    group: a group's block or a shared-prefix boundary (one group's longer
    hit) may change with evictions, not only with insertions."""
    scheduler = tiny_scheduler()
    scheduler.add_request(tiny_spec(0, 60))
    (request,) = scheduler._waiting_requests()
    kv = scheduler.kv_cache_manager
    kv.wrapped.get_computed_blocks = lambda request: (SimpleNamespace(blocks=hit), num_hit, boundary)
    kv.get_computed_blocks(request)
    assert kv.last_lookup == (request, missed)
    assert kv.finds_nothing(request) == missed


def test_the_waiting_memo_keeps_idle_loops_of_other_inputs_while_the_allocator_stays():
    """The same scene: the third prompt (14 blocks, 2 free) is refused at
    any budget. A loop with 400 tokens left, run after step 2's (504 left),
    is remembered beside it, as async scheduling's stagger alternates two
    budgets; at most ``MAX_INPUTS`` are kept (the oldest goes), and an
    allocator change (other than rule 12's) voids them all."""
    scheduler, _, _ = _third_prompt_refused()
    known = scheduler.fast_path.waiting_known_idle
    scheduler._schedule_waiting(_StepState(token_budget=400, running_scheduled=True, prefill_scheduled=False))
    assert known(400, True, False) and known(504, True, False)
    assert not known(401, True, False)
    for budget in (300, 200, 100):
        scheduler._schedule_waiting(
            _StepState(token_budget=budget, running_scheduled=True, prefill_scheduled=False)
        )
    assert not known(504, True, False)  # the oldest of five
    assert all(known(budget, True, False) for budget in (400, 300, 200, 100))
    _frees(scheduler)
    assert not any(known(budget, True, False) for budget in (400, 300, 200, 100))


def test_an_arrival_voids_the_waiting_memo():
    scheduler, _, _ = _third_prompt_refused()
    scheduler.add_request(tiny_spec(3, 60))
    assert not scheduler.fast_path.waiting_known_idle(504, True, False)


def _runner() -> ModelRunner:
    return ModelRunner(AcceptanceModel(conditional_rates=(0.8, 0.7, 0.6)), np.random.default_rng(0))


# --------------------------------------- every skipped call, made anyway


# Pool-bound with free seats: requests wait while steady steps run, so their
# waiting loops are skipped (at 16 seats the seats bind first).
POOL_BOUND = ["workload.max_requests=60"]
STEADY_CASES = [*CHECKED_CASES, ("saturated-decode", POOL_BOUND)]


@pytest.mark.parametrize("layout", ["off", "on"])
@pytest.mark.parametrize(
    ("name", "overrides"), STEADY_CASES, ids=lambda v: str(v).rsplit("/", 1)[-1].removesuffix(".yaml")
)
def test_every_call_a_steady_step_skips_changes_nothing(name, overrides, layout, tmp_path):
    """The fast path's audit, with the lane: each steady request's
    allocation and caching and each waiting loop known to admit nobody are
    made anyway, and change nothing."""
    simulation = checked_simulation(name, overrides, layout, tmp_path)
    counts = audited(simulation, lane=True)
    simulation.run()
    # Control: steady decodes ran here (and known-idle waiting loops were
    # skipped in the pool-bound case), so the checks had work.
    assert counts["lane step"] > 0
    if overrides is POOL_BOUND:
        assert counts["waiting loop"] > 0 and counts["lookup"] > 0 and counts["refused admission"] > 0


def test_the_check_catches_a_steady_step_across_a_boundary(monkeypatch, tmp_path):
    """Failing control: a lane blind to the allocation window runs steady
    steps across block boundaries, and the check catches the allocation."""
    monkeypatch.setattr(SyncSteadyLane, "limit", _limit_without_allocation_window)
    simulation = checked_simulation(*CHECKED_CASES[0], "off", tmp_path)
    audited(simulation, lane=True)
    with pytest.raises(AssertionError, match="allocates|changed the allocator"):
        simulation.run()


def test_the_check_catches_a_waiting_loop_wrongly_skipped(monkeypatch, tmp_path):
    """Failing control: a scheduler that takes every waiting loop as known
    to admit nobody; the check's waiting loop admits someone."""
    monkeypatch.setattr(FastPath, "waiting_known_idle", lambda self, *inputs: bool(self.scheduler.waiting))
    simulation = checked_simulation(*STEADY_CASES[-1], "off", tmp_path)
    audited(simulation, lane=True)
    with pytest.raises(AssertionError, match="admits|changed"):
        simulation.run()


def test_the_check_catches_a_head_taken_as_refused_after_blocks_came_free(monkeypatch, tmp_path):
    """Failing control for rule 12: memos blind to the kind of change (a
    finished request's free taken for a running request's allocation) and
    to the free blocks (either alone catches a finished request's free
    here; each alone is controlled in the value tests above); the check's
    waiting loop, or a skipped admission, admits."""
    monkeypatch.setattr(
        FastPath, "_only_took_blocks_since", lambda self, release_version, num_free_blocks: True
    )
    simulation = checked_simulation(*STEADY_CASES[-1], "off", tmp_path)
    audited(simulation, lane=True)
    with pytest.raises(AssertionError, match="admits|changed"):
        simulation.run()


# ------------------------------------------------------------- frames


@pytest.mark.parametrize("hashing", ["eagle-drop", "lookahead"])
@pytest.mark.parametrize("layout", ["off", "on"])
def test_pool_bound_decode_gives_the_same_frames_in_the_lane(layout, hashing):
    scenario = load_scenario("saturated-decode", [*POOL_BOUND, f"scheduler.mtp_hash_mode={hashing}"])
    fast, step_by_step = (
        frames_with_fast_path(scenario, layout, True),
        frames_with_fast_path(scenario, layout, False),
    )
    assert fast == step_by_step


def test_a_lane_skipping_every_waiting_loop_changes_the_frames(monkeypatch):
    """Failing control for the frames: take every waiting loop as known to
    admit nobody, whatever changed."""
    scenario = load_scenario("saturated-decode", POOL_BOUND)
    step_by_step = frames_with_fast_path(scenario, "off", False)
    monkeypatch.setattr(FastPath, "waiting_known_idle", lambda self, *inputs: bool(self.scheduler.waiting))
    assert frames_with_fast_path(scenario, "off", True)["steps"] != step_by_step["steps"]


def test_a_lane_that_never_stops_a_request_changes_the_frames(monkeypatch):
    """Failing control: take every request as unstoppable (its tokens kept
    aside even in the step that should stop it: it runs past its output
    length until an ordinary step stops it)."""
    scenario = load_scenario("saturated-decode", POOL_BOUND)
    step_by_step = frames_with_fast_path(scenario, "off", False)
    monkeypatch.setattr(SyncSteadyLane, "unstoppable", lambda self, request: 10**9)
    assert frames_with_fast_path(scenario, "off", True)["requests"] != step_by_step["requests"]


# ----------------------------------------------------------- the horizon


def _running_at_horizon(tmp_path, fast_path: bool, flush: bool = True) -> list[tuple]:
    scenario = scenarios.scenario(
        tmp_path,
        overrides=["simulation.max_time_s=8", f"simulation.fast_path={str(fast_path).lower()}"],
        workload={
            "trace": "synthetic",
            "num_requests": 20,
            "arrival": {"process": "poisson", "rate_per_s": 10.0},
            "prompt": {"distribution": "fixed", "tokens": 500},
            "output": {"distribution": "fixed", "tokens": 2000},
        },
    )
    simulation = Simulation(scenario, "off", scenario_workload(scenario))
    if not flush:
        simulation.core.flush = lambda: None  # type: ignore[method-assign]
    simulation.run()
    return [(r.request_id, r.num_tokens, r.num_computed_tokens) for r in simulation.scheduler.running]


def test_requests_stopped_by_the_horizon_hold_every_token_they_sampled(tmp_path):
    """A run cut mid-decode: each running request's tokens are those of the
    step-by-step run (the lane hands them over when the run ends)."""
    step_by_step = _running_at_horizon(tmp_path, False)
    assert step_by_step and _running_at_horizon(tmp_path, True) == step_by_step


def test_without_the_hand_over_at_the_horizon_requests_lag(tmp_path):
    """Failing control: skip the hand-over at the end of the run."""
    assert _running_at_horizon(tmp_path, True, flush=False) != _running_at_horizon(tmp_path, False)


# ----------------------------------------------------------- conformance


def test_the_conformance_driver_compares_the_lanes_steps(monkeypatch):
    """kvsim's side of ``kvsim conform`` steps through the engine core, so
    vLLM's own Scheduler is compared with steady steps too."""
    taken = []
    sample_and_apply = SyncSteadyLane.sample_and_apply
    counted = lambda self, *a: taken.append(self.num_taken) or sample_and_apply(self, *a)  # noqa: E731
    monkeypatch.setattr(SyncSteadyLane, "sample_and_apply", counted)
    scenario = load_scenario(str(SCENARIOS_DIR / "conformance" / "heavy-preemption.yaml"))
    result = run_conformance(scenario, "off", scenario_workload(scenario).requests)
    assert any(taken) and result.comparison.identical_share == 1.0


@pytest.mark.parametrize(
    ("num_computed", "num_drafts", "enters"),
    [
        (99, 3, True),  # the last known token left, K drafts queued
        (98, 3, False),  # two tokens left: a prefill chunk's tail, not a decode
        (99, 2, False),  # fewer drafts than K
        (100, 3, False),  # every known token computed (a decode's still counted)
    ],
)
def test_only_a_decode_with_the_last_known_token_left_and_k_drafts_enters_the_lane(
    num_computed, num_drafts, enters
):
    """The lane's entry test alone (``SteadyLane._decodes_next``), each
    clause on its own: the computed tokens one short of the known tokens
    (100, placeholders counted: 97 tokens and 3 placeholders), and K = 3
    drafts queued. The rows after the first are its controls; elsewhere the
    clauses are backed by later checks (the span's ``is_decoding``, the
    async lane's prefill checks), so only this test pins each one."""
    lane = SyncSteadyLane.__new__(SyncSteadyLane)
    lane.num_spec = 3
    request = SimpleNamespace(
        num_tokens=97,
        num_output_placeholders=3,
        num_computed_tokens=num_computed,
        spec_token_ids=[0] * num_drafts,
    )
    assert lane._decodes_next(request) is enters


def test_a_request_the_entry_test_keeps_out_has_no_limit_however_wide_its_windows():
    """``limit`` asks the entry test first: 96 of 97 tokens computed (a
    decode: sync mode has no placeholders, and the span's own decoding test
    passes) with 2 drafts queued, not K = 3, has no limit. The control, with
    3 drafts: the allocation window's bound, 1,000 less the span's 1 + 2K = 7
    tokens, 993 (the caching window's, 1,000 - 4, and the clip's, 96 + 1,903
    tokens of room - 4, are wider)."""
    lane = SyncSteadyLane.__new__(SyncSteadyLane)
    lane.num_spec, lane.step_tokens = 3, 4
    wide, span = SimpleNamespace(bounds=lambda request_id: (0, 1000)), FastPathKVCacheManager.decode_span
    lane.door = SimpleNamespace(decode_span=span, allocations=wide, caching=wide)
    lane.scheduler = SimpleNamespace(
        config=SimpleNamespace(caches_after_sampling=True),
        clip_room=lambda request: 2000 - request.num_computed_tokens - 1,
    )

    def decoding(num_drafts: int) -> SimpleNamespace:
        return SimpleNamespace(
            request_id="r", num_tokens=97, num_output_placeholders=0, num_computed_tokens=96,
            num_in_flight_tokens=0, spec_token_ids=[0] * num_drafts,
        )  # fmt: skip

    assert lane.limit(decoding(3)) == 993
    assert lane.limit(decoding(2)) is None


# ------------------------------------------- the lane's audit (issue 42)
# Issue 42 moved the lanes' audits into SteadyLane; its mutation run of
# steady.py left these unpinned: each test fails on its mutant.


def test_each_audited_lane_step_counts_once_and_the_audit_off_makes_none(monkeypatch, tmp_path):
    """The hand count of test_a_decode_across_a_block_boundary_runs_steady_inside_its_windows:
    40 + 35 steps take the lane. Under the audit each is audited and
    counted once; with it off, the lane makes no audit call at all (the
    control: the same steps take the lane)."""
    (tmp_path / "audited").mkdir()
    (tmp_path / "off").mkdir()
    simulation = one_request(tmp_path / "audited", 3120, 150)
    counts = audited(simulation, lane=True)
    steady, _ = _lane_steps(simulation)
    assert steady == [False] * 2 + [True] * 40 + [False] * 73 + [True] * 35
    assert counts["lane step"] == 75

    def no_audit(*args):
        raise AssertionError("an audit call with the audit off")

    monkeypatch.setattr(SyncSteadyLane, "_audit_each", no_audit)
    simulation = one_request(tmp_path / "off", 3120, 150)
    assert simulation.scheduler.config.caches_after_sampling  # where the caching audit would run
    steady, _ = _lane_steps(simulation)
    assert steady == [False] * 2 + [True] * 40 + [False] * 73 + [True] * 35
    assert simulation.scheduler.fast_path.door.audited["lane step"] == 0


def test_the_lane_audits_a_taken_step_from_its_start_with_its_lookahead():
    """The tiny scheduler (32-token blocks, K = 3): a 60-token prompt holds
    2 blocks, 64 slots. The lane audits a taken step before it counts the
    step's tokens (1 + K = 4) as computed; the audit allocates as the
    running loop would, from the step's start, for 4 tokens and 3
    lookahead slots: a step from 57 needs 64 (passes, the request handed
    the kept computed tokens), one from 60 needs 67, a third block
    (caught; without the lookahead, 64: it would pass)."""
    scheduler = tiny_scheduler()
    scheduler.add_request(tiny_spec(0, 60))
    CheckedEngine(scheduler).step()
    request = scheduler.requests["r000"]
    assert (request.num_computed_tokens, request.num_tokens) == (60, 61)
    lane = SyncSteadyLane(scheduler, scheduler.kv_cache_manager, None)  # type: ignore[arg-type]
    tokens = request.num_tokens

    def kept(computed: int) -> _Kept:
        return _Kept(request, computed, tokens, tokens, limit=computed, unstoppable=computed)

    lane._audit_taken(kept(57))
    assert request.num_computed_tokens == 57
    with pytest.raises(AssertionError, match=r"^r000: a steady decode allocates$"):
        lane._audit_taken(kept(60))
