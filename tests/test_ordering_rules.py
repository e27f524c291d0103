"""Every ordering rule, with a case that makes the order observable
(issue 10): where a new ring slot lands, in which order a freed request's
blocks become evictable under the fenced drain, which running request is
preempted, how many drafts a fixed acceptance draw accepts, the gates'
tolerance arithmetic at its boundary, and the ring-slot alignment rule.
Each expected value is derived by hand in the docstring (or taken from the
seed), never computed with the code under test.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.scheduler import CheckedEngine, FixedDraws, tiny_scheduler, tiny_spec

from sim.allocator_invariants import check_allocator
from sim.analysis.gates import GateSpec, check_row, on_vs_off_row
from sim.fork.side_cache_layout import RING_MAX_SLOTS, RING_SLOT_ALIGN, _largest_slots
from sim.fork.side_cache_rings import RingSlotPool
from sim.sched.model_runner import OUTPUT_TOKEN_BASE, AcceptanceModel, ModelRunner
from sim.sched.output import ScheduledRequest, SchedulerOutput
from sim.vllm_bridge import BlockPool


# ------------------------------------------------------------ ring slot order
def test_a_new_slot_lands_in_the_oldest_page_with_a_free_slot_at_its_lowest_slot():
    """Six claims on a fresh 3-slot pool fill page A (pool block 1, the free
    queue's head on a fresh pool: ids 3..5) then page B (block 2: ids 6..8).
    Free B's slot 0 (id 6), then A's slots 2 and 1 (ids 5, 4). The next
    claims take A first (the older page, though B's free slot is lower) at
    its lowest free slot: 4, then 5; only then B: 6."""
    pool = BlockPool(num_gpu_blocks=6, enable_caching=True, hash_block_size=16)
    slots = RingSlotPool(pool, slots_per_block=3)
    claimed = slots.get_new_blocks(6)
    assert [b.block_id for b in claimed] == [3, 4, 5, 6, 7, 8]
    slots.free_blocks([claimed[3]])
    slots.free_blocks([claimed[2], claimed[1]])
    assert [b.block_id for b in slots.get_new_blocks(3)] == [4, 5, 6]
    assert slots.num_pages == 2 and pool.get_num_free_blocks() == 3


def test_a_page_emptied_and_claimed_again_is_the_newest():
    """Pages in claim order: A (block 1, ids 3..5) and B (block 2, ids 6..8)
    full. A empties: block 1 goes back to the head of the main pool's free
    queue (vLLM reuses unhashed blocks LIFO), so the next claims reopen it
    as a new page, now the newest: ids 3, 4. Then B frees its slot 1 (id 7):
    the next claim lands in B (older than the reopened A), then in A's
    last free slot (id 5)."""
    pool = BlockPool(num_gpu_blocks=6, enable_caching=True, hash_block_size=16)
    slots = RingSlotPool(pool, slots_per_block=3)
    claimed = slots.get_new_blocks(6)
    slots.free_blocks(claimed[:3])
    assert slots.num_pages == 1
    assert [b.block_id for b in slots.get_new_blocks(2)] == [3, 4]
    slots.free_blocks([claimed[4]])
    assert [b.block_id for b in slots.get_new_blocks(2)] == [7, 5]


# -------------------------------------------------- fenced drain eviction order
def _evict_then_resume(num_evicted: int) -> int:
    """r000 (150-token prompt, 20 outputs) runs to its end with two batches
    in flight, so its blocks are popped for a fenced free and drained only
    when the engine idles. Then the ``num_evicted`` first cached blocks of
    the free queue are evicted (taken and given back unhashed) and r001 (the
    same 150-token prompt plus 50 more) arrives: its prefix hit."""
    scheduler = tiny_scheduler(batches=2)
    engine = CheckedEngine(scheduler, rates=(0.0,))
    scheduler.add_request(tiny_spec(0, 150, output=20, family=7))
    engine.run()
    assert scheduler.num_deferred_blocks() > 0  # popped behind the fence
    scheduler.complete_in_flight_steps()  # the engine idles: the drain
    assert scheduler.num_deferred_blocks() == 0
    pool = scheduler.kv_cache_manager.block_pool
    cached = [b for b in pool.free_block_queue.get_all_free_blocks() if b.block_hash is not None]
    assert len(cached) == 8
    taken = pool.get_new_blocks(pool.get_num_free_blocks() - len(cached) + num_evicted)
    pool.free_blocks(taken)
    scheduler.add_request(tiny_spec(1, 200, output=3, family=7))
    output = scheduler.schedule()
    assert output.new_request_ids == ("r001",)
    check_allocator(scheduler.kv_cache_manager, scheduler.deferred_blocks())
    # vLLM's prefix-cache stats: the request's 200 tokens queried, its hit counted.
    assert (output.prefix_cache_queries, output.prefix_cache_hits) == (200, output.admitted_hits["r001"])
    # vLLM's KV events: each evicted cached block is one removed hash.
    assert output.num_evicted_blocks == num_evicted == scheduler.num_evicted_blocks
    return output.admitted_hits["r001"]


def test_the_fenced_drain_makes_a_freed_requests_tail_evictable_first():
    """vLLM's rule (``pop_blocks_for_free``: free "in reverse order, so
    that tail blocks are evicted first"), kept by the scheduler's drain and
    by the retained checkpoint (first in the popped list, so freed last).

    r000's cached blocks (hand count, 32-token blocks): attention blocks
    0..3 hold prompt tokens 0..127 and block 4 (128..159) is full of prompt
    and output tokens: 5; each of the 3 Mamba groups retains its checkpoint
    at token 96 (the last block boundary before the prompt's last full
    block: 128 - 32): 3. Eight in all. r001's hit is 96: attention blocks
    0..3 match (128 tokens), MTP's drafter recomputes the last (96), where
    every Mamba group has its checkpoint.

    Evicting the first cached block must take attention block 4, which
    r001 cannot use (it holds r000's outputs): the hit stays 96. The next
    one is attention block 3, and the hit is gone."""
    assert _evict_then_resume(0) == 96
    assert _evict_then_resume(1) == 96
    assert _evict_then_resume(2) == 0  # CONTROL: the eviction reaches a needed block


# ------------------------------------------------------------ preemption order
def test_the_preempted_request_is_the_newest_running():
    """Three 150-token requests arrive in the order r000, r001, r002 and are
    admitted in that order in the first step (FCFS, a 512-token budget):
    running = [r000, r001, r002]. With 70 blocks the pool runs dry as they
    decode; vLLM's recompute preemption takes ``running[-1]``, the newest:
    r002, never r000 or r001, and the step goes on without it."""
    scheduler = tiny_scheduler(num_blocks=70, budget=512, batches=1)
    engine = CheckedEngine(scheduler)
    for index in range(3):
        scheduler.add_request(tiny_spec(index, 150, output=400))
    first, _ = engine.step()
    assert first.new_request_ids == ("r000", "r001", "r002")
    for _ in range(400):
        output, _ = engine.step()
        if output.preempted_request_ids:
            break
    assert output.preempted_request_ids[0] == "r002"
    assert [item.request_id for item in output.scheduled] == ["r000", "r001"]
    assert scheduler.waiting[0].request_id == "r002"  # back at the queue's head


# ------------------------------------------------------------- accepted drafts
@pytest.mark.parametrize(
    "rates, drafts, draws, accepted",
    [
        ((0.8, 0.7, 0.6), 3, (0.5, 0.69, 0.61), 2),  # 0.5<0.8, 0.69<0.7, 0.61>=0.6: stop
        ((0.8, 0.7, 0.6), 3, (0.1, 0.1, 0.1), 3),  # every draw under its rate
        ((0.8, 0.7, 0.6), 3, (0.8,), 0),  # a draw equal to the rate rejects (strict <)
        ((0.8, 0.7, 0.6), 2, (0.1, 0.1), 2),  # never more than the drafts offered
        ((0.9,), 3, (0.1, 0.2, 0.95), 2),  # past the listed rates: the last rate
        ((), 3, (0.0,), 0),  # no rates: nothing accepted
    ],
)
def test_accepted_drafts_for_a_fixed_draw(rates, drafts, draws, accepted):
    """Verification stops at the first rejected draft: draft i is accepted
    when draw i < rate i (hand-checked per row)."""
    rng = FixedDraws(*draws)
    assert AcceptanceModel(conditional_rates=rates).sample(drafts, rng) == accepted  # type: ignore[arg-type]


def test_mean_accepted_is_the_sum_of_prefix_products():
    """(0.8, 0.7, 0.6) over 3 drafts: 0.8 + 0.8*0.7 + 0.8*0.7*0.6 = 1.696;
    over 1 draft 0.8; over 4 drafts the last rate repeats: + 0.336*0.6."""
    model = AcceptanceModel(conditional_rates=(0.8, 0.7, 0.6))
    assert model.mean_accepted(3) == pytest.approx(1.696, abs=1e-12)
    assert model.mean_accepted(1) == pytest.approx(0.8, abs=1e-12)
    assert model.mean_accepted(4) == pytest.approx(1.696 + 0.2016, abs=1e-12)


def test_the_runner_samples_one_token_plus_the_accepted_drafts():
    """A prefill chunk short of its prompt's end (64 of 150 tokens) samples
    nothing, and the requests after it still run: a decode at context 100
    with 3 drafts (4 scheduled tokens, 101 tokens known) whose draws accept
    2 samples three tokens, ids base + 101, 102, 103. A drafted item that
    reaches only 96 + 4 - 3 = 97 of its 101 tokens samples nothing."""
    chunk = ScheduledRequest(
        request_id="p",
        num_scheduled_tokens=64,
        num_computed_tokens=0,
        num_spec_tokens=0,
        num_prompt_tokens_left=64,
    )
    decode = ScheduledRequest(
        request_id="d",
        num_scheduled_tokens=4,
        num_computed_tokens=100,
        num_spec_tokens=3,
        num_prompt_tokens_left=0,
    )
    short = ScheduledRequest(
        request_id="s",
        num_scheduled_tokens=4,
        num_computed_tokens=96,
        num_spec_tokens=3,
        num_prompt_tokens_left=0,
    )
    runner = ModelRunner(AcceptanceModel(conditional_rates=(0.8, 0.7, 0.6)), np.random.default_rng(0))
    runner.uniforms = FixedDraws(0.5, 0.69, 0.61)  # type: ignore[assignment]
    output = SchedulerOutput(step_index=1, scheduled=(chunk, decode, short))
    out = runner.execute(output, {"p": 150, "d": 101, "s": 101})
    assert out.sampled_token_ids == {"d": [OUTPUT_TOKEN_BASE + 101 + i for i in range(3)]}


def test_the_async_runner_samples_each_request_judged_to_sample_from_where_its_step_reaches():
    """Async scheduling judges sampling when it schedules (``samples``). A
    decode at context 100 with 3 drafts reaches 101 and its draws (0.5,
    0.69, 0.61 against 0.8, 0.7, 0.6) accept 2: ids base + 101..103. A
    padded one-token resume at context 40 (its 3 drafts placeholders)
    reaches 41 and accepts none, drawing nothing: id base + 41 alone. A
    chunk judged not to sample gets nothing and draws nothing. The next
    decode takes the next draws (0.9: rejected at once): id base + 201."""
    items = (
        ScheduledRequest("p", 64, 0, 0, 64),
        ScheduledRequest("d", 4, 100, 3, 0),
        ScheduledRequest("r", 4, 40, 3, 0, is_padded=True),
        ScheduledRequest("e", 4, 200, 3, 0),
    )
    runner = ModelRunner(AcceptanceModel(conditional_rates=(0.8, 0.7, 0.6)), np.random.default_rng(0))
    runner.uniforms = FixedDraws(0.5, 0.69, 0.61, 0.9, 0.0)  # type: ignore[assignment]
    output = SchedulerOutput(step_index=1, scheduled=items)
    out = runner.execute_sampling(output, {"p": False, "d": True, "r": True, "e": True})
    assert out.sampled_token_ids == {
        "d": [OUTPUT_TOKEN_BASE + 101 + i for i in range(3)],
        "r": [OUTPUT_TOKEN_BASE + 41],
        "e": [OUTPUT_TOKEN_BASE + 201],
    }
    assert runner.uniforms.draws == [0.0]  # type: ignore[attr-defined]


@pytest.mark.parametrize("rates", [(1.5,), (0.5, -0.1)])
def test_acceptance_rates_outside_zero_one_are_refused(rates):
    with pytest.raises(ValueError, match=r"conditional_rates must lie in \[0, 1\]"):
        AcceptanceModel(conditional_rates=rates)


def test_mean_accepted_is_rounded_to_twelve_digits():
    """Rounded so the documented figures print cleanly: 1/3 -> 0.333333333333."""
    assert AcceptanceModel(conditional_rates=(1 / 3,)).mean_accepted(1) == 0.333333333333


def test_the_scheduler_keeps_exactly_the_accepted_drafts():
    """A 40-token prompt, then decodes whose drafts a fixed draw accepts 2
    of 3: each step adds 3 tokens (the sampled one plus 2 drafts), counts 3
    drafts and 2 accepted, and rolls computed tokens back by the 1 rejected
    draft (computed = tokens - 1)."""
    scheduler = tiny_scheduler()
    scheduler.add_request(tiny_spec(0, 40))
    engine = CheckedEngine(scheduler, rates=(0.8, 0.7, 0.6))
    engine.model_runner.uniforms = FixedDraws(*([0.5, 0.69, 0.61] * 3))  # type: ignore[assignment]
    engine.step()  # the prefill samples 1 token and draws nothing
    request = scheduler.requests["r000"]
    for _ in range(3):
        before = request.num_tokens
        _, outcome = engine.step()
        assert request.num_tokens == before + 3
        assert request.num_computed_tokens == request.num_tokens - 1
        assert (outcome.num_draft_tokens, outcome.num_accepted_tokens) == (3, 2)


# ------------------------------------------------------- gates' tolerance
def _gate(tolerance: str | float, baseline: float) -> GateSpec:
    return GateSpec(
        scenario="x.yaml",
        baselines={"num_admitted": {"off": baseline, "on": baseline}},
        tolerance={"num_admitted": tolerance},
    )


@pytest.mark.parametrize(
    "tolerance, baseline, now, verdict",
    [
        ("5%", 200, 190, "pass"),  # 5 % of 200 = 10: a drop of exactly 10 passes
        ("5%", 200, 189.9, "fail"),  # a drop of 10.1 > 10
        ("5%", 200, 210, "pass"),  # a rise of exactly 10
        ("5%", 200, 210.1, "improved"),  # better than allowed: asks for --update
        ("5%", -200, -210, "pass"),  # relative to |baseline|: still 10
        ("5%", -200, -210.1, "fail"),
        ("12.5%", 80, 70, "pass"),  # 12.5 % of 80 = 10
        ("12.5%", 80, 69.9, "fail"),
        (2, 200, 198, "pass"),  # absolute: 2, whatever the baseline
        (2, 200, 197.9, "fail"),
        (0, 200, 200, "pass"),  # exact: no change allowed
        (0, 200, 199.9, "fail"),
    ],
)
def test_relative_and_absolute_tolerance_at_the_boundary(tolerance, baseline, now, verdict):
    """allowed = absolute + relative * |baseline|; a change of exactly the
    allowed amount passes, anything beyond fails (num_admitted: higher is
    better) or is 'improved'. Allowed amounts derived by hand per row."""
    row = check_row("g", _gate(tolerance, baseline), "on", "num_admitted", now)
    assert row.verdict == verdict
    expected_allowed = {"5%": 10.0, "12.5%": 10.0, 2: 2.0, 0: 0.0}[tolerance]
    assert row.allowed == pytest.approx(expected_allowed, abs=1e-12)


def test_the_new_layout_may_equal_the_old_but_not_admit_fewer():
    """on-vs-off: on >= off passes (equality included); one fewer fails."""
    same = on_vs_off_row("g", {"off": {"num_admitted": 10}, "on": {"num_admitted": 10}})
    fewer = on_vs_off_row("g", {"off": {"num_admitted": 10}, "on": {"num_admitted": 9}})
    assert (same.verdict, fewer.verdict) == ("pass", "fail")
    assert "the new layout admits 9 requests, the old 10" in fewer.message


# ----------------------------------------------------- ring-slot alignment
@pytest.mark.parametrize(
    "needs, slots",
    [
        # The seed's Flash-Next fp32 figures (patch 0088): per-worker strides
        # 11,468,800 / 12,902,400 B, rings 6 / 7 layers x 2,304 B. Strides/256 =
        # 44,800 / 50,400, gcd 5,600 = 2^5 5^2 7: its divisors in [2, 1024] that
        # also leave 16,128 >= 7 x 2,304 = 16,128 B (exactly: >= matters) per
        # slot: 800 is the largest (1,120 > 1,024; 875, 1,000 do not divide).
        ([(11_468_800, 6 * 2304), (12_902_400, 7 * 2304)], 800),
        # The same, with 1 byte more ring on worker 2: 800 no longer holds it;
        # the next divisor of 5,600 is 700 (18,432 B per slot).
        ([(11_468_800, 6 * 2304), (12_902_400, 7 * 2304 + 1)], 700),
        # 2,048 x 256 B: every S up to the cap divides; the cap wins.
        ([(2048 * 256, 256)], RING_MAX_SLOTS),
        # 1,000 x 256 B: 1,000 <= 1,024 divides, each slot 256 B aligned.
        ([(1000 * 256, 100)], 1000),
        # 1,000 x 256 B but 257-byte rings: a slot must be >= 512 B, so S
        # divides 500: 500.
        ([(1000 * 256, 257)], 500),
        # 768 B: only S = 3 leaves a 256-aligned slot; a 257-byte ring fits
        # no slot at all.
        ([(768, 256)], 3),
        ([(768, 257)], None),
        # 1,024 + 256 B = 5 x 256: S = 5 (256 B); S = 2 would leave 640 B, not aligned.
        ([(1280, 1)], 5),
        ([], None),
    ],
)
def test_the_largest_aligned_slot_count_wins(needs, slots):
    """S divides every stride into 256-byte-aligned slots that hold the ring,
    S in [2, 1024], the largest such S (the seed's ``_choose_ring_slots``)."""
    assert (RING_SLOT_ALIGN, RING_MAX_SLOTS) == (256, 1024)
    assert _largest_slots(needs) == slots


def test_gate_rows_in_full():
    """Every field of a row, hand-written: a drop of 10.1 against 5 % of
    200 (allowed 10) fails with the message naming baseline, now, change,
    allowance and why; a layout without a baseline is 'new'; a rise past
    the allowance is 'improved'; no tolerance means exact (allowed 0)."""
    gate = GateSpec(
        scenario="x.yaml",
        baselines={"num_admitted": {"off": 200}, "num_preemptions": {"on": 4}},
        tolerance={"num_admitted": "5%"},
    )
    fail = check_row("g", gate, "off", "num_admitted", 189.9)
    assert (fail.gate, fail.layout, fail.metric, fail.baseline, fail.now) == (
        "g",
        "off",
        "num_admitted",
        200,
        189.9,
    )
    assert (fail.change, fail.allowed, fail.verdict) == (pytest.approx(-10.1), 10.0, "fail")
    assert fail.message == (
        "g [off] num_admitted: baseline 200, now 189.9 (-10.1, allowed ±10): a drop is a regression"
    )
    new = check_row("g", gate, "on", "num_admitted", 150)
    assert (new.baseline, new.change, new.allowed, new.verdict) == (None, None, 0.0, "new")
    assert new.message == "no baseline yet: run kvsim gate --update to record it"
    better = check_row("g", gate, "on", "num_preemptions", 3)
    assert (better.change, better.allowed, better.verdict) == (-1, 0.0, "improved")
    assert better.message == "better than the baseline: run kvsim gate --update to lock it in"
    same = check_row("g", gate, "on", "num_preemptions", 4)
    assert (same.verdict, same.message) == ("pass", "")


def test_on_vs_off_rows_in_full():
    same = on_vs_off_row("g", {"off": {"num_admitted": 10}, "on": {"num_admitted": 10}})
    assert tuple(vars(same).values()) == ("g", "on-vs-off", "num_admitted", 10, 10, 0, 0.0, "pass", "")
    fewer = on_vs_off_row("g", {"off": {"num_admitted": 10}, "on": {"num_admitted": 9}})
    assert tuple(vars(fewer).values())[:8] == ("g", "on-vs-off", "num_admitted", 10, 9, -1, 0.0, "fail")
    assert fewer.message == (
        "g [on-vs-off] num_admitted: the new layout admits 9 requests, the old 10: "
        "the new layout must admit no fewer"
    )


@pytest.mark.parametrize(
    "baseline, now, direction, verdict",
    [
        (10, 10.5, "higher", "improved"),  # any rise past allowed 0, even under 1
        (10, 9.5, "lower", "improved"),
        (float("nan"), 1.0, "higher", "fail"),  # a metric that appears where none was
        (1.0, float("nan"), "higher", "fail"),
    ],
)
def test_judge_fractional_changes_and_nan(baseline, now, direction, verdict):
    from sim.analysis.gates import judge

    assert judge(baseline, now, direction, 0) == verdict


def test_a_zero_percent_tolerance_is_exact():
    from sim.analysis.gates import parse_tolerance

    assert parse_tolerance("0%", "t") == (0.0, 0.0)
