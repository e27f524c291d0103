"""The fast path (``simulation.fast_path``, ``sim/sched/fast_path/settled.py``): the
allocator calls it skips change nothing, and every frame is the same with
and without it.

Two independent checks, neither reading the fast path's own reasoning: the
fast path's audit (``FastPath.audit``) makes every skipped call anyway and
compares the whole allocator state (every block's id, reference count and
hash, the free queue's order, every per-request table and dict of every
manager) before and after; and the frames of every gate scenario run both
ways.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

import pytest
from helpers import pins, scenarios
from helpers.fast_path import (
    CHECKED_CASES,
    DECODE_ACROSS_BOUNDARIES,
    audited,
    checked_simulation,
    frames_with_fast_path,
    one_request,
)

from sim.analysis.gates import DEFAULT_GATES, gate_scenario, load_gates
from sim.analysis.runs import scenario_workload
from sim.engine import Simulation
from sim.fork.pins import PinningKVCacheManager
from sim.scenario import load_scenario
from sim.sched.fast_path.kv_cache_manager import FastPathKVCacheManager
from sim.sched.fast_path.missed_lookups import MissedPinLookups
from sim.sched.fast_path.settled import SettledSteps

# ----------------------------------------------------------------- windows


@pytest.mark.parametrize(
    ("first", "last", "window"),
    [
        # margin 32 on 3,200-token blocks: [first - 32, last + 32] must lie
        # strictly inside one block.
        (100, 107, (0,)),  # 68..139
        (10, 20, None),  # -22: reaches back past the first position
        (32, 40, None),  # 0..72: touches the boundary at 0
        (3168, 3170, None),  # 3136..3202 crosses 3200
        (3160, 3167, (0,)),  # 3128..3199: the last position before the boundary
        (3232, 3239, None),  # 3200..3271 starts on the boundary
        (3233, 3240, (1,)),  # 3201..3272
    ],
)
def test_a_window_is_one_block_interior_widened_by_the_margin(first, last, window):
    assert SettledSteps((3200,), margin_tokens=32).window(first, last) == window


def test_a_window_needs_every_block_size():
    """3,300..3,340 is inside block 1 of 3,200 tokens but crosses 3,328 = 2 x 1,664."""
    assert SettledSteps((3200,), 0).window(3300, 3340) == (1,)
    assert SettledSteps((3200, 1664), 0).window(3300, 3340) is None
    assert SettledSteps((3200, 1664), 0).window(3340, 3400) == (2, 1)


def test_a_settled_window_ends_exactly_at_its_bounds():
    """A real call over 100..107 (margin 32, 3,200-token blocks) settles
    later calls whose first token is at least 0 + 1 + 32 = 33 and whose last
    is at most 3,199 - 32 = 3,167, not one token beyond either."""
    settled = SettledSteps((3200,), margin_tokens=32)
    settled.record("a", 100, 107)
    assert settled.is_settled("a", 33, 40) and not settled.is_settled("a", 32, 40)
    assert settled.is_settled("a", 100, 3167) and not settled.is_settled("a", 100, 3168)
    # Two sizes: block 1 of 3,200 (3,201..6,399) and block 3 of 1,664
    # (4,993..6,655): 4,993 + 8 = 5,001 up to 6,399 - 8 = 6,391.
    both = SettledSteps((3200, 1664), margin_tokens=8)
    both.record("a", 5100, 5107)
    assert both.is_settled("a", 5001, 6391)
    assert not both.is_settled("a", 5000, 5100) and not both.is_settled("a", 5100, 6392)


def test_block_sizes_must_be_positive():
    for sizes in ((), (0,), (3200, -1)):
        with pytest.raises(ValueError, match=r"block sizes must be positive, got \("):
            SettledSteps(sizes, margin_tokens=8)
    assert SettledSteps((1,), margin_tokens=0).window(5, 5) is None  # a 1-token block has no interior


def test_forgetting_a_request_never_recorded_is_harmless():
    settled = SettledSteps((3200,), margin_tokens=8)
    settled.forget("never-seen")
    assert not settled.is_settled("never-seen", 100, 107)


def test_only_a_second_call_in_the_same_window_is_settled():
    settled = SettledSteps((3200,), margin_tokens=8)
    assert not settled.is_settled("a", 100, 107)  # never called
    settled.record("a", 100, 107)
    assert settled.is_settled("a", 104, 111)
    assert not settled.is_settled("b", 104, 111)  # per request
    settled.record("a", 3190, 3197)  # a boundary call: no window
    assert not settled.is_settled("a", 104, 111)
    settled.record("a", 100, 107)
    settled.forget("a")  # freed: its tables are gone
    assert not settled.is_settled("a", 104, 111)


def test_the_hash_unit_bounds_a_window_only_inside_the_prompt():
    """The rig: 4,096-token blocks, a 64-token hash unit, margin 32. Inside
    the prompt no window fits the unit (its 63 interior positions hold no
    span widened by 32 each way); a call past the prompt and the margin is
    windowed by the block alone, and its window starts past them."""
    settled = SettledSteps((4096,), margin_tokens=32, prompt_unit=64)
    # 5,000..5,007 of a 4,500-token prompt: widened, from 4,968, past it.
    assert settled.window(5000, 5007, prompt_tokens=4500) == (1,)
    settled.record("a", 5000, 5007, 4500)
    # Block 1 less the margin: 4,129..8,159; past the prompt and the margin: from 4,533.
    assert settled.bounds("a") == (4533, 8159)
    assert settled.is_settled("a", 4533, 4540) and not settled.is_settled("a", 4532, 4540)
    # At 4,532 the widened span starts on the prompt's last token: the unit counts.
    assert settled.window(4532, 4540, prompt_tokens=4500) is None
    assert settled.window(4533, 4540, prompt_tokens=4500) == (1,)
    # The prompt unknown, or reached by the span: the unit counts, no window fits.
    assert settled.window(5000, 5007) is None
    settled.record("b", 5000, 5007, 4968)
    assert settled.bounds("b") is None
    with pytest.raises(ValueError, match="unit 0"):
        SettledSteps((4096,), margin_tokens=32, prompt_unit=0)


# ------------------------------------------------- which calls are skipped


def _counted_calls(simulation: Simulation) -> dict[str, int]:
    """Counts the scheduler's calls into the allocator (it is their only caller)."""
    counts = {"allocate_slots": 0, "cache_blocks": 0}
    kv_cache_manager = simulation.kv_cache_manager
    for name in counts:
        real = getattr(kv_cache_manager, name)

        def counting(*args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            return _real(*args, **kwargs)

        setattr(kv_cache_manager, name, counting)
    return counts


@pytest.mark.parametrize(("fast_path", "allocations", "cachings"), [(True, 75, 67), (False, 150, 149)])
def test_the_calls_skipped_across_a_block_boundary(tmp_path, fast_path, allocations, cachings):
    """A 3,120-token prompt, 150 outputs: the admission, then decode steps at
    computed c = 3,120 .. 3,268 (149), each over positions c .. c + 7 (4
    tokens, 3 lookahead); margin 32, blocks of 3,200.
    Allocations: the admission; c = 3,120 (first, settles c + 7 <= 3,167);
    c = 3,121 .. 3,160 skipped (40); c = 3,161 .. 3,232 real (their widened
    span touches 3,200); c = 3,233 real (settles from 3,201 + 32); c =
    3,234 .. 3,268 skipped (35): 1 + 1 + 72 + 1 = 75 real, 150 without.
    Caching after each sampled step (not the last, which finishes), at
    computed 3,120 .. 3,268 (149): 3,120 real, 3,121 .. 3,167 skipped (47),
    3,168 .. 3,233 real (66), 3,234 .. 3,268 skipped (35): 67 real."""
    simulation = one_request(tmp_path, 3120, 150, f"simulation.fast_path={str(fast_path).lower()}")
    counts = _counted_calls(simulation)
    simulation.run()
    assert counts == {"allocate_slots": allocations, "cache_blocks": cachings}


def test_prefill_chunks_are_never_skipped(tmp_path):
    """A 1,002-token prompt in 100-token chunks (the token budget), 5
    outputs. Allocations: the admission (100), chunks at computed 100 ..
    900 (9), the 2-token chunk at 1,000 (two short of the end: still a
    prefill), then decode steps at 1,002 (first: real) and 1,003 .. 1,005
    (skipped): 12 real. Caching: after the prefill (1,002, real) and after
    decode steps to 1,003 .. 1,005 (skipped): 1 real."""
    simulation = one_request(tmp_path, 1002, 5, "scheduler.max_num_batched_tokens=100")
    counts = _counted_calls(simulation)
    simulation.run()
    assert counts == {"allocate_slots": 12, "cache_blocks": 1}


@pytest.mark.parametrize(("output", "generated"), [(3, [1, 2]), (5, [1, 4]), (6, [1, 4, 1])])
def test_a_stop_within_a_step_counts_the_tokens_up_to_it(tmp_path, output, generated):
    """Every draft accepted: the prefill samples 1 token, each decode step 4
    (1 + K). With 3 outputs the second step's stop falls on its 2nd token
    (2 counted, 2 dropped); with 5 on its last (4, appended at once); with 6
    a third step samples 4 and stops at its 1st."""
    simulation = one_request(tmp_path, 500, output, "mtp.acceptance_rates=[1, 1, 1]")
    recording = simulation.run()
    assert recording.steps.to_dict()["num_generation_tokens"] == generated
    (request,) = recording.requests.values()
    assert request["generated_tokens"] == output


def test_requests_of_one_output_length_share_their_sampling_params(tmp_path):
    """Built once per output length (vLLM's Request only reads it), with EOS
    ignored: a trace replay forces the output length."""
    simulation = one_request(tmp_path, 500, 5)
    scheduler = simulation.scheduler
    specs = [
        type("Spec", (), {"request_id": rid, "arrival_s": 0.0, "prompt_len": 10, "output_len": n})
        for rid, n in (("a", 7), ("b", 7), ("c", 8))
    ]
    for spec in specs:
        spec.prompt_token_ids = lambda: list(range(10))
    a, b, c = (scheduler._materialize(spec) for spec in specs)
    assert a.sampling_params is b.sampling_params and a.sampling_params is not c.sampling_params
    assert a.sampling_params.ignore_eos and c.sampling_params.ignore_eos
    assert (a.max_tokens, c.max_tokens) == (7, 8)


# ------------------------------------------------------- skipped calls


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("layout", ["off", "on"])
@pytest.mark.parametrize(
    ("name", "overrides"), CHECKED_CASES, ids=lambda v: Path(str(v)).stem if isinstance(v, str) else ""
)
def test_every_skipped_call_changes_nothing(name, overrides, layout, mode, tmp_path):
    """In both engine modes (async: the batch queue, outputs applied two
    micro-batches after the next schedule, no steady lane)."""
    simulation = checked_simulation(name, [*overrides, f"engine.mode={mode}"], layout, tmp_path)
    counts = audited(simulation, lane=False)
    simulation.run()
    # Control: the fast path did skip calls here, so the check had work.
    assert counts["allocation"] > 0 and counts["caching"] > 0
    if name == "saturated-decode":
        # No shared prefixes: the waiters' pin lookups (rule 10), then whole
        # pin passes and, in passes after a changed queue, the waiters of the
        # last idle one (rule 11), are skipped, and audited.
        assert counts["pin lookup"] > 0 and counts["pin pass"] > 0 and counts["unchanged waiter"] > 0


def settle_every_call_after_the_first(monkeypatch) -> None:
    """A broken fast path: blind to block boundaries, it settles every
    decode call of a request after its first real one."""
    called: set[tuple[int, str]] = set()
    monkeypatch.setattr(
        SettledSteps, "record", lambda self, rid, first, last, prompt=None: called.add((id(self), rid))
    )
    monkeypatch.setattr(SettledSteps, "is_settled", lambda self, rid, first, last: (id(self), rid) in called)


def test_the_check_catches_a_call_skipped_across_a_boundary(monkeypatch, tmp_path):
    """Failing control for the check above: the boundary call that
    allocates is settled, and it is caught."""
    settle_every_call_after_the_first(monkeypatch)
    simulation = checked_simulation(*CHECKED_CASES[0], "off", tmp_path)
    audited(simulation, lane=False)
    with pytest.raises(AssertionError, match="a settled call allocated|changed the allocator"):
        simulation.run()


def _span_blind_to_tokens_in_flight(request, num_tokens):
    """``FastPathKVCacheManager.decode_span`` from the computed tokens, as if none were
    in flight (they never are in sync mode)."""
    computed = request.num_computed_tokens
    return None if computed < request.num_tokens - 1 else (computed, computed + num_tokens)


def test_the_check_catches_an_async_window_blind_to_the_tokens_in_flight(monkeypatch, tmp_path):
    """Failing control (async mode, fast-path rule 1): ``allocate_slots``
    frees skipped blocks at the processed tokens, behind those in flight;
    a window that leaves them out settles a call that frees a block."""
    monkeypatch.setattr(FastPathKVCacheManager, "decode_span", staticmethod(_span_blind_to_tokens_in_flight))
    name, overrides = CHECKED_CASES[1]  # pool-bound decode
    simulation = checked_simulation(name, [*overrides, "engine.mode=async"], "off", tmp_path)
    audited(simulation, lane=False)
    with pytest.raises(AssertionError, match="changed the allocator"):
        simulation.run()


# ---------------------------------------------------------------- frames


GATES = load_gates(DEFAULT_GATES).gates


def _in_mode(scenario, mode: str):
    return scenario.model_copy(update={"engine": scenario.engine.model_copy(update={"mode": mode})})


# The gates run async (the rig's loop): both layouts there; the synchronous
# loop keeps its proof on the new layout (the old one takes the same code
# paths in the lane, and the suite's time is bounded).
MODES_AND_LAYOUTS = [("async", "off"), ("async", "on"), ("sync", "on")]


@pytest.mark.parametrize(("mode", "layout"), MODES_AND_LAYOUTS)
@pytest.mark.parametrize("gate", sorted(GATES))
def test_every_gate_scenario_gives_the_same_frames_with_and_without_the_fast_path(gate, layout, mode):
    scenario = _in_mode(gate_scenario(DEFAULT_GATES, gate, GATES[gate]), mode)
    fast, step_by_step = (
        frames_with_fast_path(scenario, layout, True),
        frames_with_fast_path(scenario, layout, False),
    )
    for frame in fast:
        assert fast[frame] == step_by_step[frame], f"{gate} [{layout}, {mode}]: {frame} differ"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_default_scenario_gives_the_same_frames_with_and_without_the_fast_path(mode):
    """The shipped default (its first 150 requests: the check, not the load)."""
    scenario = load_scenario("chat-slice", ["workload.max_requests=150", f"engine.mode={mode}"])
    assert frames_with_fast_path(scenario, "on", True) == frames_with_fast_path(scenario, "on", False)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_fast_path_that_skips_across_boundaries_changes_the_frames(monkeypatch, tmp_path, mode):
    """Failing control: settle every decode call after the first (ignoring
    block boundaries) and the frames comparison above goes red."""
    name, overrides = CHECKED_CASES[0]
    overrides = [*overrides, f"engine.mode={mode}"]
    scenario = scenarios.scenario(tmp_path, name, overrides, workload=DECODE_ACROSS_BOUNDARIES)
    step_by_step = frames_with_fast_path(scenario, "off", False)
    settle_every_call_after_the_first(monkeypatch)
    assert frames_with_fast_path(scenario, "off", True)["steps"] != step_by_step["steps"]


# ------------------------------------------------- waiter pin lookups


def _memo_blind_to_new_hashes(monkeypatch) -> None:
    """A broken rule 10: a waiter with no hit is never looked up again."""
    monkeypatch.setattr(MissedPinLookups, "_count_insertions", lambda self, block_pool: None)


def _gate(name: str, mode: str):
    return _in_mode(gate_scenario(DEFAULT_GATES, name, GATES[name]), mode)


@pytest.mark.parametrize("blind", [False, True])
def test_the_check_catches_a_pin_lookup_memo_blind_to_new_hashes(monkeypatch, blind):
    """prefix-shared: the first turns arrive together, before their shared
    system prompt is cached; the waiters behind them hit once it is. The
    audit passes with the memo as it is (it skips lookups there too) and
    catches one that ignores the hashes cached since (the failing control)."""
    scenario = _gate("prefix-shared", "sync")
    if blind:
        _memo_blind_to_new_hashes(monkeypatch)
    simulation = Simulation(scenario, "on", scenario_workload(scenario))
    counts = audited(simulation, lane=False)
    if blind:
        with pytest.raises(
            AssertionError, match="a skipped pin lookup hits|a waiter passed over pins|changed the allocator"
        ):
            simulation.run()
    else:
        simulation.run()
        assert counts["pin lookup"] > 0


def test_a_pin_lookup_memo_blind_to_new_hashes_changes_the_frames(monkeypatch):
    """Failing control for the gate frames comparison (prefix-mooncake,
    async): never looking a waiter up again loses pins the fork makes."""
    scenario = _gate("prefix-mooncake", "async")
    step_by_step = frames_with_fast_path(scenario, "on", False)
    _memo_blind_to_new_hashes(monkeypatch)
    assert frames_with_fast_path(scenario, "on", True)["steps"] != step_by_step["steps"]


def test_a_waiter_with_no_hit_is_looked_up_again_once_a_hash_is_cached_or_its_tokens_grow():
    """Rule 10 on the fork tests' hybrid rig: vLLM's own lookup finds a hit
    after each event the memo watches, so a memo blind to either is wrong."""
    manager = pins.pinning_manager(400)
    assert isinstance(manager, PinningKVCacheManager)
    memo = MissedPinLookups(manager.block_pool)
    prompt = pins.tail_tokens(1, 340)
    waiter = pins.request("waiter", [*prompt, 7])
    assert manager.pin_waiting_hit(waiter) == 0 and manager.pin_lookup_found_no_hit
    memo.found_no_hit(waiter)
    assert memo.knows_no_hit(waiter) and memo.knows_no_hit(waiter)
    pins.run(manager, pins.request("same-prompt", prompt))
    assert not memo.knows_no_hit(waiter)  # hashes were cached
    assert manager.get_computed_blocks(waiter)[1] > 0  # and it hits now

    # A short waiter (a preempted request, say) that takes the same tokens.
    grows = pins.request("grows", prompt[:20])
    assert manager.pin_waiting_hit(grows) == 0 and manager.pin_lookup_found_no_hit
    memo.found_no_hit(grows)
    assert memo.knows_no_hit(grows)
    for token in [*prompt[20:], 7]:
        grows.append_output_token_ids(token)
    assert not memo.knows_no_hit(grows)
    assert manager.get_computed_blocks(grows)[1] > 0


def test_a_pin_pass_is_known_idle_only_with_the_same_queue_pins_hashes_and_tokens():
    """Rule 11: each of the pass's inputs voids the memo of an idle pass."""
    manager = pins.pinning_manager(400)
    memo = MissedPinLookups(manager.block_pool)
    first, second = pins.request("a", pins.tail_tokens(1, 40)), pins.request("b", pins.tail_tokens(2, 40))
    waiting: deque = deque([first, second])
    memo.pass_ends(waiting, (), pinned=True)
    assert not memo.knows_idle_pass(waiting, ())  # it pinned something
    memo.pass_ends(waiting, (), pinned=False)
    assert memo.knows_idle_pass(waiting, ())
    changes = [
        (deque([second, first]), (), 0, 0),
        (deque([first]), (), 0, 0),
        (deque([first, second, first]), (), 0, 0),
        (waiting, ("a",), 0, 0),
        (waiting, (), 1, 0),
        (waiting, (), 0, 1),
    ]
    for queue, pinned_ids, insertions, waiter_changes in changes:
        memo.num_hash_insertions += insertions
        memo.num_waiter_changes += waiter_changes
        assert not memo.knows_idle_pass(queue, pinned_ids)
        memo.pass_ends(waiting, (), pinned=False)
