"""The scheduler's counting and edge rules, each on a case small enough to
derive by hand (issue 10, second round): the fence counters on a request
preempted or finished in its very first step, token budgets that run out
exactly, the arguments handed to vLLM's allocator, and the per-step
statistics. Tests read public results only (``SchedulerOutput``, the
outcome, the pool's free count), so they outlive a refactor of the
scheduler's private helpers.

Block counts on the tiny model (32-token blocks, K = 3, side-cache layout
on), from vLLM's managers: a request whose prompt and K lookahead slots span
``n`` blocks holds ``n`` attention blocks, 1 + K = 4 state blocks in each of
the 3 Mamba groups (vLLM's align mode keeps K speculative state blocks) and
one slot of a shared ring page.
"""

from __future__ import annotations

from functools import cache

import pytest
from helpers.allocator import MAX_LEN, TINY_MODEL, K, tiny_plan
from helpers.scheduler import CheckedEngine, tiny_scheduler, tiny_spec

from sim.config import DeploymentConfig, load_model
from sim.fork.patches import ForkPatches
from sim.kv_cache_manager import MTPHashing, build_kv_cache_manager
from sim.kv_cache_plan import KVCachePlan, plan_kv_cache
from sim.sched.fast_path.kv_cache_manager import FastPathKVCacheManager
from sim.sched.output import ScheduledRequest, SchedulerOutput
from sim.sched.scheduler import Scheduler, SchedulerConfig

# vLLM's own admission and victim rules, derived by hand from vLLM 0.33.0:
# run upstream (the fork's admission also reserves each Mamba group's
# checkpoint; tests/test_fork_retention.py pins that).
UPSTREAM = ForkPatches.upstream()

# A 60-token prompt: 60 + K = 63 tokens span 2 attention blocks; 2 + 3 x 4 = 14
# blocks of its own, and one slot of the ring page.
BLOCKS_OF_A_60_TOKEN_PREFILL = 14


def _row(output) -> tuple:
    scheduled = tuple((item.request_id, item.num_scheduled_tokens) for item in output.scheduled)
    return scheduled, output.preempted_request_ids


# ------------------------------------------------------------- fence counters
@pytest.mark.parametrize(
    "batches, defer, preempted_at_step",
    [(1, True, 2), (2, True, 3), (2, False, 2)],
    ids=["one-batch", "fenced", "fence-off"],
)
def test_a_request_preempted_right_after_its_first_step_waits_for_its_fence(
    batches, defer, preempted_at_step
):
    """Two 60-token prompts fill a 30-block pool in step 1 (2 x 14 blocks,
    one shared ring page, the null block: 30). In step 2 r000's decode needs
    60 + 4 + K = 67 > 64 tokens: a third attention block, and the pool is
    empty, so vLLM preempts the newest, r001.

    With one batch in flight (or fencing off) step 1's output is processed
    before step 2, so r001's blocks can be freed at once: preempted in step
    2, and r000 takes one of its 14 blocks (13 free). With two batches in
    flight, step 1 is still running on the workers when step 2 is scheduled:
    r001's blocks cannot be freed, nothing is preempted and nothing runs
    (an empty step, during which the step in flight completes); step 3
    preempts."""
    scheduler = tiny_scheduler(num_blocks=30, batches=batches, defer=defer, budget=512, fork=UPSTREAM)
    engine = CheckedEngine(scheduler, rates=(0.0,))
    scheduler.add_request(tiny_spec(0, 60, output=5))
    scheduler.add_request(tiny_spec(1, 60, output=5))
    first, _ = engine.step()
    assert _row(first) == ((("r000", 60), ("r001", 60)), ())
    assert scheduler.kv_cache_manager.num_free_blocks == 0
    rows = [_row(engine.step()[0]) for _ in range(preempted_at_step - 1)]
    assert rows[-1] == ((("r000", 4),), ("r001",))
    assert rows[:-1] == [((), ())] * (preempted_at_step - 2)
    assert scheduler.kv_cache_manager.num_free_blocks == BLOCKS_OF_A_60_TOKEN_PREFILL - 1
    assert scheduler.num_deferred_blocks() == 0


@pytest.mark.parametrize(
    "batches, defer, fenced",
    [(1, True, False), (2, True, True), (3, True, True), (2, False, False)],
    ids=["one-batch", "fenced-2", "fenced-3", "fence-off"],
)
def test_a_request_finished_in_its_first_step_frees_at_once_or_behind_the_fence(batches, defer, fenced):
    """A 60-token prompt with one output token finishes in step 1 (its
    prefill samples the one token). With fencing and more than one batch in
    flight, step 1 may still be writing its blocks: its 14 blocks and its
    ring slot (15 entries) wait behind the fence, and the pool lacks 15
    blocks (the 14 and the ring page, empty once the slot is freed) until
    the engine idles; otherwise they return at once.

    ``complete_in_flight_steps`` says whether idling changed anything: the
    processed-step counter reaches step 1 unless step 1's own output already
    counted as processed (one batch in flight, fencing on)."""
    scheduler = tiny_scheduler(batches=batches, defer=defer)
    engine = CheckedEngine(scheduler)
    total = scheduler.kv_cache_manager.num_free_blocks
    scheduler.add_request(tiny_spec(0, 60, output=1))
    _, outcome = engine.step()
    assert outcome.finished == {"r000": 1}
    held = BLOCKS_OF_A_60_TOKEN_PREFILL + 1
    assert scheduler.num_deferred_blocks() == (held if fenced else 0)
    assert scheduler.kv_cache_manager.num_free_blocks == total - (held if fenced else 0)
    processed_by_the_step = batches == 1 and defer
    assert scheduler.complete_in_flight_steps() is not processed_by_the_step
    assert scheduler.complete_in_flight_steps() is False  # CONTROL: nothing left to change
    assert scheduler.num_deferred_blocks() == 0
    assert scheduler.kv_cache_manager.num_free_blocks == total


def test_a_fenced_free_waits_for_every_batch_still_in_flight():
    """Three batches in flight (PP=3): the output of step n arrives when
    steps n+1 and n+2 are scheduled, so only step n - 2's fence has passed.
    r000 (60 tokens, one output) finishes in step 1 beside r001 (still
    decoding): its 15 blocks stay fenced after steps 1 and 2, and come back
    when step 3's output passes step 1's fence. With two batches they come
    back one step earlier (CONTROL)."""
    held_after = {}
    for batches in (2, 3):
        scheduler = tiny_scheduler(batches=batches)
        engine = CheckedEngine(scheduler, rates=(0.0,))
        scheduler.add_request(tiny_spec(0, 60, output=1))
        scheduler.add_request(tiny_spec(1, 20, output=30))
        held_after[batches] = []
        for _ in range(3):
            engine.step()
            held_after[batches].append(scheduler.num_deferred_blocks())
    held = BLOCKS_OF_A_60_TOKEN_PREFILL + 1
    assert held_after == {2: [held, 0, 0], 3: [held, held, 0]}


# --------------------------------------------------------------- token budget
def test_the_last_running_request_gets_what_is_left_of_the_budget():
    """Budget 9: three 3-token prompts fill it exactly in step 1. In step 2
    r000 and r001 decode 1 + K = 4 tokens each; the 1 token left goes to
    r002, whose drafts are dropped (1 token, 0 drafts), as vLLM's running
    loop clips a decode to the budget."""
    scheduler = tiny_scheduler(budget=9)
    engine = CheckedEngine(scheduler, rates=(0.0,))
    for index in range(3):
        scheduler.add_request(tiny_spec(index, 3))
    first, _ = engine.step()
    assert _scheduled(first) == [("r000", 3, 0), ("r001", 3, 0), ("r002", 3, 0)]
    second, _ = engine.step()
    assert _scheduled(second) == [("r000", 4, 3), ("r001", 4, 3), ("r002", 1, 0)]


def test_a_one_token_prompt_takes_the_last_token_of_the_budget():
    """Budget 33: r000's 200-token prompt gets the 32-token chunk (vLLM's
    Mamba split floors 33 to a block boundary); the one token left admits
    r001, a 1-token prompt (a whole prompt, nothing to align; no padding:
    nothing else ran and it has no prefix hit)."""
    scheduler = tiny_scheduler(budget=33)
    scheduler.add_request(tiny_spec(0, 200))
    scheduler.add_request(tiny_spec(1, 1))
    output = scheduler.schedule()
    assert _scheduled(output) == [("r000", 32, 0), ("r001", 1, 0)]
    assert output.new_request_ids == ("r000", "r001")


def test_a_running_request_with_nothing_to_schedule_does_not_stop_the_ones_behind():
    """Budget 35. Step 1: r000 (1-token prompt) 1, r001 (200-token prompt)
    32 (34 floored to a block boundary), r002 (2-token prompt) 2. Step 2:
    r000 decodes 4, leaving 31: r001's next chunk would end at 63, not a
    block boundary and short of its prompt's end, so vLLM's split gives it
    0 tokens; the loop steps over it (not strictly FCFS, as in vLLM) and
    r002 decodes 4. r001, mid-prefill, samples nothing in step 1, and the
    requests after it still get their first token."""
    scheduler = tiny_scheduler(budget=35)
    engine = CheckedEngine(scheduler, rates=(0.0,))
    scheduler.add_request(tiny_spec(0, 1))
    scheduler.add_request(tiny_spec(1, 200))
    scheduler.add_request(tiny_spec(2, 2))
    first, outcome = engine.step()
    assert _scheduled(first) == [("r000", 1, 0), ("r001", 32, 0), ("r002", 2, 0)]
    assert outcome.first_token_request_ids == ("r000", "r002")
    assert outcome.num_generated_tokens == 2
    second, _ = engine.step()
    assert _scheduled(second) == [("r000", 4, 3), ("r002", 4, 3)]


def _scheduled(output) -> list[tuple[str, int, int]]:
    return [(item.request_id, item.num_scheduled_tokens, item.num_spec_tokens) for item in output.scheduled]


# ------------------------------------------------------ uniform-decode padding
def _pad_scheduler(*, budget: int = 40, threshold: int = 0, num_spec: int = K) -> Scheduler:
    manager = build_kv_cache_manager(tiny_plan(True), num_gpu_blocks=400)
    config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        max_model_len=MAX_LEN,
        block_size=32,
        num_speculative_tokens=num_spec,
        long_prefill_token_threshold=threshold,
    )
    return Scheduler(config, FastPathKVCacheManager(manager, config))


def _decode_then_admit(scheduler: Scheduler, *, with_prefill: bool = False):
    """Step 1 admits r001 (2-token prompt) and, with ``with_prefill``, first
    r000 (200 tokens, chunked); step 2 decodes r001 (and continues r000's
    prefill) while r002, a 1-token prompt, arrives: its row in step 2."""
    engine = CheckedEngine(scheduler, rates=(0.0,))
    if with_prefill:
        scheduler.add_request(tiny_spec(0, 200))
    scheduler.add_request(tiny_spec(1, 2))
    engine.step()
    scheduler.add_request(tiny_spec(2, 1))
    output, _ = engine.step()
    rows = {item.request_id: item for item in output.scheduled}
    assert output.new_request_ids == (("r002",) if "r002" in rows else ())
    return rows


def test_a_one_token_prompt_admitted_beside_a_decode_is_padded_to_a_uniform_decode():
    """vLLM pads an admitted request with one token to schedule to 1 + K
    rows (K placeholder drafts) when a running request was scheduled and no
    prefill is in the step: r002 gets 4 tokens, 3 of them drafts, marked
    padded; r001's decode is a normal one."""
    rows = _decode_then_admit(_pad_scheduler())
    assert (rows["r002"].num_scheduled_tokens, rows["r002"].num_spec_tokens) == (1 + K, K)
    assert rows["r002"].is_padded and rows["r002"].num_prompt_tokens_left == 0
    assert not rows["r001"].is_padded


def test_no_padding_while_a_running_prefill_is_in_the_step():
    """Same step with r000's prefill chunk scheduled first (32 of the 40
    tokens, then r001's decode 4): a prefill is in the batch, so no uniform
    decode to keep: r002 gets its one token, unpadded."""
    rows = _decode_then_admit(_pad_scheduler(), with_prefill=True)
    assert [(r.request_id, r.num_scheduled_tokens) for r in rows.values()] == [
        ("r000", 32),
        ("r001", 4),
        ("r002", 1),
    ]
    assert (rows["r002"].num_spec_tokens, rows["r002"].is_padded) == (0, False)


def test_a_lone_one_token_prompt_is_not_padded():
    """Nothing running was scheduled and there is no prefix hit: vLLM pads
    only to match a decode batch, so a lone 1-token prompt runs 1 token."""
    scheduler = _pad_scheduler()
    scheduler.add_request(tiny_spec(0, 1))
    [item] = scheduler.schedule().scheduled
    assert (item.num_scheduled_tokens, item.num_spec_tokens, item.is_padded) == (1, 0, False)


@pytest.mark.parametrize("budget, admitted", [(8, True), (7, False), (6, False)])
def test_padding_needs_the_whole_padded_decode_in_the_budget(budget, admitted):
    """r001's decode takes 4 of the budget. vLLM admits the padded r002 only
    if its 1 + K = 4 rows fit in what is left (4 of 8: yes; 3 of 7, 2 of 6:
    no) and prefers not scheduling it to scheduling it un-padded."""
    rows = _decode_then_admit(_pad_scheduler(budget=budget))
    assert ("r002" in rows) is admitted
    if admitted:
        assert (rows["r002"].num_scheduled_tokens, rows["r002"].is_padded) == (1 + K, True)


@pytest.mark.parametrize("num_spec, padded_tokens", [(0, None), (1, 2)])
def test_padding_follows_the_number_of_speculative_tokens(num_spec, padded_tokens):
    """Without speculative decoding nothing is padded (r002 runs 1 token);
    with K = 1 the uniform decode is 2 rows."""
    rows = _decode_then_admit(_pad_scheduler(num_spec=num_spec))
    item = rows["r002"]
    if padded_tokens is None:
        assert (item.num_scheduled_tokens, item.is_padded) == (1, False)
    else:
        assert (item.num_scheduled_tokens, item.num_spec_tokens, item.is_padded) == (padded_tokens, 1, True)


def test_padding_clipped_by_the_long_prefill_threshold_is_dropped():
    """long_prefill_token_threshold 2 (two requests: it applies): the padded
    1 + K = 4 rows are clipped to 2, and vLLM then drops the padding rather
    than shorten it: r002 runs its single token, unpadded. (r001's decode is
    clipped to 2 tokens, 1 draft, by the same threshold.)"""
    rows = _decode_then_admit(_pad_scheduler(threshold=2))
    assert (rows["r001"].num_scheduled_tokens, rows["r001"].num_spec_tokens) == (2, 1)
    item = rows["r002"]
    assert (item.num_scheduled_tokens, item.num_spec_tokens, item.is_padded) == (1, 0, False)


@cache
def _plan_with_max_model_len(max_model_len: int) -> KVCachePlan:
    return plan_kv_cache(
        load_model(TINY_MODEL),
        DeploymentConfig(max_model_len=max_model_len),
        side_cache_layout=True,
        num_gpu_blocks_override=400,
    )


@pytest.mark.parametrize("max_model_len, padded", [(485, True), (484, False)])
def test_a_full_prefix_hit_is_padded_only_with_room_for_the_sampled_token(max_model_len, padded):
    """Lookahead hashes (no EAGLE block drop): a block's hash also covers
    the next token, so r001, r000's 481-token prompt again, hits 480 tokens
    (15 blocks; the hit stops one token short of the prompt) and has one
    token left. Nothing else runs, but the hit alone makes vLLM pad it to
    1 + K = 4 rows, if its computed tokens, the 4 rows and the sampled
    token fit in max_model_len: 480 + 4 + 1 = 485 (padded at 485; at 484 it
    runs its one token)."""
    hashing = MTPHashing.for_hash_mode("lookahead", num_speculative_tokens=K)
    manager = build_kv_cache_manager(
        _plan_with_max_model_len(max_model_len), num_gpu_blocks=400, mtp_hashing=hashing
    )
    config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=512,
        max_model_len=max_model_len,
        block_size=32,
        num_speculative_tokens=K,
        mtp_hashing=hashing,
    )
    scheduler = Scheduler(config, FastPathKVCacheManager(manager, config))
    engine = CheckedEngine(scheduler, rates=(0.0,))
    scheduler.add_request(tiny_spec(0, 481, output=1, family=7))
    engine.run()
    scheduler.add_request(tiny_spec(1, 481, output=2, family=7))
    output, _ = engine.step()
    assert output.admitted_hits == {"r001": 480}
    [item] = output.scheduled
    assert item.num_computed_tokens == 480
    expected = (1 + K, K, True) if padded else (1, 0, False)
    assert (item.num_scheduled_tokens, item.num_spec_tokens, item.is_padded) == expected


# ------------------------------------------------------ lookahead slots, victims
def test_a_decode_needs_its_lookahead_slots_or_preempts():
    """r000 (58-token prompt) and r001 (20) fill a 29-block pool in step 1:
    r000 holds 2 attention blocks (58 + K = 61 tokens), r001 1 (23), 12
    Mamba blocks each, one shared ring page, and the null block: 29. In
    step 2 r000's decode computes 58 + 4 = 62 tokens, which fit its 2
    blocks, but vLLM also reserves K = 3 lookahead slots: 65 tokens, a
    third block, and the pool is empty: r001 (the newest) is preempted and
    r000 takes one of its 13 blocks (12 free)."""
    scheduler = tiny_scheduler(num_blocks=29, budget=512, batches=1)
    engine = CheckedEngine(scheduler, rates=(0.0,))
    scheduler.add_request(tiny_spec(0, 58))
    scheduler.add_request(tiny_spec(1, 20))
    first, _ = engine.step()
    assert _row(first) == ((("r000", 58), ("r001", 20)), ())
    assert scheduler.kv_cache_manager.num_free_blocks == 0
    second, _ = engine.step()
    assert _row(second) == ((("r000", 4),), ("r001",))
    assert scheduler.kv_cache_manager.num_free_blocks == 12


def test_a_request_that_is_its_own_victim_is_not_scheduled():
    """r000 alone (58-token prompt) in a 16-block pool (its 14 blocks, the
    ring page, the null block). Its decode needs a third attention block
    (62 + K lookahead slots > 64): vLLM's victim is the newest running
    request, r000 itself: preempted, and not scheduled in that step (all
    its 14 blocks and the ring page back: 15 free). Step 3 resumes it: 59 tokens (prompt and the one
    output) recomputed."""
    scheduler = tiny_scheduler(num_blocks=16, budget=512, batches=1, fork=UPSTREAM)
    engine = CheckedEngine(scheduler, rates=(0.0,))
    scheduler.add_request(tiny_spec(0, 58))
    engine.step()
    second, _ = engine.step()
    assert _row(second) == ((), ("r000",))
    assert scheduler.kv_cache_manager.num_free_blocks == 15
    third, _ = engine.step()
    assert _row(third) == ((("r000", 59),), ())
    assert third.resumed_request_ids == ("r000",)


@pytest.mark.parametrize("prompt, admitted", [(61, True), (62, False)])
def test_admission_needs_the_lookahead_slots_too(prompt, admitted):
    """A 16-block pool holds one request's 12 Mamba blocks, the ring page and
    2 attention blocks (64 tokens). vLLM admits a prompt with K = 3
    lookahead slots: 61 + 3 = 64 fits; 62 + 3 = 65 needs a third block."""
    scheduler = tiny_scheduler(num_blocks=16, budget=512, batches=1, fork=UPSTREAM)
    scheduler.add_request(tiny_spec(0, prompt))
    output = scheduler.schedule()
    assert (output.new_request_ids == ("r000",)) is admitted


def test_a_request_counts_each_of_its_preemptions():
    """Three 60-token prompts with 40 outputs each in a 50-block pool: the
    newest running request is preempted again and again. Each request's
    own count (vLLM's ``Request.num_preemptions``) equals the steps that
    named it preempted, and one was preempted more than once (the case the
    count is for)."""
    scheduler = tiny_scheduler(num_blocks=50, budget=512, batches=1)
    engine = CheckedEngine(scheduler, rates=(0.0,))
    for index in range(3):
        scheduler.add_request(tiny_spec(index, 60, output=40))
    seen, counts = {}, {}
    for _ in range(300):
        if not scheduler.has_unfinished_requests():
            break
        output, _ = engine.step()
        seen.update(scheduler.requests)
        for request_id in output.preempted_request_ids:
            counts[request_id] = counts.get(request_id, 0) + 1
    assert not scheduler.has_unfinished_requests()
    assert max(counts.values()) > 1
    assert {rid: seen[rid].num_preemptions for rid in counts} == counts


# ------------------------------------------------------ prefix hits on admission
def _cached_then_admitted(prompt: int, budget: int = 512, **kwargs):
    """r000 runs a ``prompt``-token prompt (family 7) to its end; then r001,
    the same prompt, is admitted: (scheduler, r000's blocks, the step)."""
    scheduler = tiny_scheduler(budget=budget, batches=1, **kwargs)
    engine = CheckedEngine(scheduler, rates=(0.0,))
    scheduler.add_request(tiny_spec(0, prompt, output=2, family=7))
    engine.step()
    blocks_of_r000 = scheduler.kv_cache_manager.get_block_ids("r000")
    engine.run()
    scheduler.add_request(tiny_spec(1, prompt, output=2, family=7))
    output, _ = engine.step()
    return scheduler, blocks_of_r000, output


def test_a_full_prefix_hit_takes_the_rest_of_the_prompt_in_one_chunk():
    """r001's 150-token prompt hits 96 tokens (4 blocks match, MTP's EAGLE
    drop gives back the last: 96, where each Mamba group retained r000's
    checkpoint). vLLM's split starts at the hit, past the last cacheable
    boundary (96), so the chunk runs to the prompt's end: 54 tokens, all
    prompt. The hit reuses r000's own cached attention blocks (the first 3
    block ids of r000's table)."""
    scheduler, blocks_of_r000, output = _cached_then_admitted(150)
    assert output.admitted_hits == {"r001": 96}
    [item] = output.scheduled
    assert (item.num_computed_tokens, item.num_scheduled_tokens, item.num_prompt_tokens_left) == (96, 54, 54)
    attention = len(blocks_of_r000) - 1  # the attention group comes last in the tiny plan
    assert scheduler.kv_cache_manager.get_block_ids("r001")[attention][:3] == blocks_of_r000[attention][:3]


# ------------------------------------------------- prefill chunks and thresholds
def _threshold_scheduler(threshold: int, hashing: MTPHashing | None = None) -> Scheduler:
    hashing = hashing or MTPHashing()
    manager = build_kv_cache_manager(tiny_plan(True), num_gpu_blocks=400, mtp_hashing=hashing)
    config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=512,
        max_model_len=MAX_LEN,
        block_size=32,
        num_speculative_tokens=K,
        long_prefill_token_threshold=threshold,
        mtp_hashing=hashing,
    )
    return Scheduler(config, FastPathKVCacheManager(manager, config))


def test_a_threshold_below_a_block_advances_prefills_sub_block():
    """long_prefill_token_threshold 16 (half a 32-token block), two 150-token
    prompts: vLLM's split lets a chunk limit narrower than a block advance
    sub-block (16 tokens a step each) instead of scheduling nothing."""
    scheduler = _threshold_scheduler(16)
    engine = CheckedEngine(scheduler, rates=(0.0,))
    scheduler.add_request(tiny_spec(0, 150))
    scheduler.add_request(tiny_spec(1, 150))
    for step in range(3):
        output, _ = engine.step()
        assert [(i.num_computed_tokens, i.num_scheduled_tokens) for i in output.scheduled] == [
            (16 * step, 16)
        ] * 2


def test_a_threshold_of_one_token_clips_decodes_too():
    """vLLM applies long_prefill_token_threshold to every running request:
    at 1, two 1-token prompts then decode one token a step, no drafts."""
    scheduler = _threshold_scheduler(1)
    engine = CheckedEngine(scheduler, rates=(0.0,))
    scheduler.add_request(tiny_spec(0, 1))
    scheduler.add_request(tiny_spec(1, 1))
    engine.step()
    output, _ = engine.step()
    assert _scheduled(output) == [("r000", 1, 0), ("r001", 1, 0)]


MULTI_MODULE_LOOKAHEAD = MTPHashing(
    use_eagle_block_drop=False, num_hash_lookahead_tokens=K, num_prefill_lookahead_tokens=K
)


def test_a_prefill_chunk_never_ends_within_the_drafters_runway():
    """Multi-module MTP (vLLM's prefill runway K = 3), threshold 16, two
    50-token prompts: chunks of 16 end at 16 and 32; the third would end at
    48, 2 tokens before the prompt's end, inside the runway: vLLM pulls it
    back to end 3 tokens before (47, 15 tokens); the last chunk is 3."""
    scheduler = _threshold_scheduler(16, MULTI_MODULE_LOOKAHEAD)
    engine = CheckedEngine(scheduler, rates=(0.0,))
    scheduler.add_request(tiny_spec(0, 50))
    scheduler.add_request(tiny_spec(1, 50))
    sizes = [[i.num_scheduled_tokens for i in engine.step()[0].scheduled] for _ in range(4)]
    assert sizes == [[16, 16], [16, 16], [15, 15], [3, 3]]


def test_the_runway_counts_from_the_prefix_hit():
    """Same runway and threshold, lookahead hashes (a block's hash covers
    the next 3 tokens): r000's 50-token prompt caches block 0 and its Mamba
    checkpoint at 32. r001 and r002 (the same prompt, and another one, so
    the threshold applies) arrive: r001 hits 32, and its chunk from 32
    (16 tokens, to 48) ends 2 tokens before its end: pulled back to 15."""
    scheduler = _threshold_scheduler(16, MULTI_MODULE_LOOKAHEAD)
    engine = CheckedEngine(scheduler, rates=(0.0,))
    scheduler.add_request(tiny_spec(0, 50, output=1, family=7))
    engine.run()
    scheduler.add_request(tiny_spec(1, 50, family=7))
    scheduler.add_request(tiny_spec(2, 50, family=8))
    output, _ = engine.step()
    assert output.admitted_hits == {"r001": 32, "r002": 0}
    assert [(i.num_computed_tokens, i.num_scheduled_tokens) for i in output.scheduled] == [(32, 15), (0, 16)]


def test_a_last_chunk_of_two_prompt_tokens_counts_them_as_prompt():
    """Budget 32, a 34-token prompt: the first chunk is one block (32), the
    second the last 2 tokens, both prompt tokens (it starts 2 before the
    end); the first decode after it has no prompt token left."""
    scheduler = tiny_scheduler(budget=32)
    engine = CheckedEngine(scheduler, rates=(0.0,))
    scheduler.add_request(tiny_spec(0, 34))
    left = []
    for _ in range(3):
        [item] = engine.step()[0].scheduled
        left.append((item.num_computed_tokens, item.num_scheduled_tokens, item.num_prompt_tokens_left))
    assert left == [(0, 32, 32), (32, 2, 2), (34, 4, 0)]


# ----------------------------------------------------------------- statistics
def test_a_steps_stats_carry_its_prefix_lookups_and_the_gauges_after_it():
    """Fencing on (two batches). Step 1: r000 (150 tokens) runs its first
    chunk, 96 tokens (the last cacheable boundary), and r001 (60 tokens,
    one output) its whole prompt and finishes. Prefix lookups: 150 + 60 =
    210 tokens queried, no hit, nothing evicted. After it: r000 holds 4
    attention blocks (96 + K = 99 tokens) and 12 Mamba blocks, the shared
    ring page stays (r000 holds a slot in it), r001's 14 blocks wait behind
    the fence: 399 - 16 - 1 - 14 = 368 free; usage is vLLM's 1 - free / 399.
    The fence holds r001's 14 blocks and its ring slot: 15 entries."""
    scheduler = tiny_scheduler(budget=512, batches=2)
    engine = CheckedEngine(scheduler, rates=(0.0,))
    scheduler.add_request(tiny_spec(0, 150, output=5))
    scheduler.add_request(tiny_spec(1, 60, output=1))
    output, outcome = engine.step()
    assert outcome.finished == {"r001": 1}
    stats = scheduler.make_stats(output, outcome)
    cache = stats.prefix_cache_stats
    assert (cache.prefix_cache_queries_tokens, cache.prefix_cache_hits_tokens) == (210, 0)
    assert cache.prefix_cache_evicted_blocks == 0
    gauges = stats.gauges
    assert (gauges.num_requests_running, gauges.num_requests_waiting) == (1, 0)
    assert (gauges.num_free_blocks, gauges.num_deferred_blocks) == (368, 15)
    assert gauges.kv_cache_usage_perc == pytest.approx(1 - 368 / 399)
    assert gauges.num_retained_checkpoints == 0


def test_the_retained_checkpoints_gauge_counts_one_per_mamba_group():
    """r000's 150-token prompt runs in two chunks (96, the last cacheable
    boundary, then 54). The next allocation (its first decode) moves each
    Mamba group's running state past the cached checkpoint at 96; vLLM
    drops it from the table and the fork retains it: 3, one per group, and
    none before (CONTROL)."""
    scheduler = tiny_scheduler(budget=512)
    engine = CheckedEngine(scheduler, rates=(0.0,))
    scheduler.add_request(tiny_spec(0, 150, output=5))
    retained = []
    for _ in range(3):
        engine.step()
        retained.append(scheduler.make_gauges().num_retained_checkpoints)
    assert retained == [0, 0, 3]


def test_arrivals_during_a_step_are_not_in_its_waiting_gauge():
    """vLLM's engine core adds requests between steps, so the stats of a
    step do not count the two that arrived while it ran (kvsim adds them
    as they arrive); the sampler's gauges do."""
    scheduler = tiny_scheduler(budget=512)
    engine = CheckedEngine(scheduler, rates=(0.0,))
    scheduler.add_request(tiny_spec(0, 40))
    step = engine.schedule()
    scheduler.add_request(tiny_spec(1, 40))
    scheduler.add_request(tiny_spec(2, 40))
    outcome = engine.complete(step)
    assert scheduler.make_stats(step.output, outcome).gauges.num_requests_waiting == 0
    assert scheduler.make_gauges().num_requests_waiting == 2  # CONTROL: they are waiting


def test_without_stats_logging_no_prefix_lookups_are_reported():
    """vLLM's manager keeps no PrefixCacheStats when log_stats is off: a
    step that admits a 40-token prompt reports 0 queried, 0 hit."""
    manager = build_kv_cache_manager(tiny_plan(True), num_gpu_blocks=400, log_stats=False)
    config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=512,
        max_model_len=MAX_LEN,
        block_size=32,
        num_speculative_tokens=K,
    )
    scheduler = Scheduler(config, FastPathKVCacheManager(manager, config))
    scheduler.add_request(tiny_spec(0, 40))
    output = scheduler.schedule()
    assert output.new_request_ids == ("r000",)
    assert (output.prefix_cache_queries, output.prefix_cache_hits) == (0, 0)


def test_a_resumed_requests_lookup_counts_in_the_prefix_stats():
    """vLLM records a preempted request's lookup apart (preempted queries
    and hits); kvsim's step reports both kinds together. Two 150-token
    prompts in a 45-block pool: r001 is preempted, then resumed with its
    outputs: it queries all its tokens and hits 96 (its own blocks, cached
    when it was preempted; the EAGLE drop, as for a fresh prompt)."""
    scheduler = tiny_scheduler(num_blocks=45, budget=512, batches=1)
    engine = CheckedEngine(scheduler, rates=(0.0,))
    scheduler.add_request(tiny_spec(0, 150, output=10))
    scheduler.add_request(tiny_spec(1, 150, output=10))
    for _ in range(100):
        step = engine.schedule()
        if step.output.resumed_request_ids:
            break
        engine.complete(step)
    output = step.output
    assert output.resumed_request_ids == ("r001",)
    resumed = scheduler.requests["r001"]
    assert resumed.num_preemptions == 1 and resumed.num_output_tokens > 0
    assert output.admitted_hits == {"r001": 96}
    assert (output.prefix_cache_queries, output.prefix_cache_hits) == (150 + resumed.num_output_tokens, 96)


def test_evicted_blocks_add_up_over_the_steps():
    """Six 150-token prompts of their own through a 60-block pool: each
    admission reuses blocks the finished ones left cached, in more than one
    step; the scheduler's running total is the sum of the steps' counts."""
    scheduler = tiny_scheduler(num_blocks=60, budget=512, batches=1)
    engine = CheckedEngine(scheduler, rates=(0.0,))
    for index in range(6):
        scheduler.add_request(tiny_spec(index, 150, output=5))
    per_step = [output.num_evicted_blocks for output, _ in engine.run(300)]
    assert not scheduler.has_unfinished_requests()
    assert sum(1 for n in per_step if n) >= 2
    assert scheduler.num_evicted_blocks == sum(per_step)


@pytest.mark.parametrize("max_model_len, admitted", [(485, False), (484, True)])
def test_a_hit_too_close_to_max_model_len_to_pad_runs_on_a_short_budget(max_model_len, admitted):
    """The 481-token prompt cached as above, then admitted by an engine with
    a 3-token budget. At max_model_len 485 it would be padded to 4 rows, more
    than the budget: vLLM prefers not scheduling it. At 484 there is no room
    to pad, so it is not a padding candidate: its one token runs."""
    hashing = MTPHashing.for_hash_mode("lookahead", num_speculative_tokens=K)
    manager = build_kv_cache_manager(
        _plan_with_max_model_len(max_model_len), num_gpu_blocks=400, mtp_hashing=hashing
    )
    configs = [
        SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            block_size=32,
            num_speculative_tokens=K,
            mtp_hashing=hashing,
        )
        for budget in (512, 3)
    ]
    first = Scheduler(configs[0], FastPathKVCacheManager(manager, configs[0]))
    first.add_request(tiny_spec(0, 481, output=1, family=7))
    CheckedEngine(first, rates=(0.0,)).run()
    second = Scheduler(
        configs[1], FastPathKVCacheManager(manager, configs[1])
    )  # the same pool, its cached prefix
    second.add_request(tiny_spec(1, 481, output=2, family=7))
    output = second.schedule()
    assert output.new_request_ids == (("r001",) if admitted else ())
    if admitted:
        assert _scheduled(output) == [("r001", 1, 0)] and output.admitted_hits == {"r001": 480}


def test_multi_module_lookahead_moves_the_last_cacheable_boundary():
    """Multi-module MTP with lookahead hashes (K = 3 lookahead tokens): a
    checkpoint must leave 3 tokens to prove it, so a lone 65-token prompt's
    last cacheable boundary is (65 - 3) // 32 * 32 = 32, not 64: vLLM's
    split stops the first chunk there (32), then runs to the end (33)."""
    scheduler = _threshold_scheduler(0, MULTI_MODULE_LOOKAHEAD)
    engine = CheckedEngine(scheduler, rates=(0.0,))
    scheduler.add_request(tiny_spec(0, 65))
    sizes = [engine.step()[0].scheduled[0].num_scheduled_tokens for _ in range(2)]
    assert sizes == [32, 33]


def test_a_prefix_block_is_hit_only_when_its_lookahead_tokens_exist():
    """Multi-module lookahead hashes: a block's hash covers the 3 tokens
    after it, so a request can hit a cached block only if it has them.
    r000's 100-token prompt stops its first chunk at its last cacheable
    boundary, (100 - 3) // 32 * 32 = 96, where the Mamba groups keep their
    state, and caches blocks 0..2. r001 (the first 97 tokens) cannot prove
    block 2 (1 token after it): its longest attention hit is 64, where no
    Mamba state is cached: no hit. r002 (99 tokens) can: it hits 96."""
    scheduler = _threshold_scheduler(0, MULTI_MODULE_LOOKAHEAD)
    engine = CheckedEngine(scheduler, rates=(0.0,))
    scheduler.add_request(tiny_spec(0, 100, output=1, family=7))
    engine.run()
    hits = {}
    for index, prompt in ((1, 97), (2, 99)):
        scheduler.add_request(tiny_spec(index, prompt, output=1, family=7))
        output, _ = engine.step()
        hits.update(output.admitted_hits)
        engine.run()
    assert hits == {"r001": 0, "r002": 96}


@pytest.mark.xfail(
    strict=True,
    reason="a known difference (docs/fidelity.md, Scheduling, WAITING loop): kvsim's waiting "
    "loop stops where vLLM 0.33.0 requeues a request the drafter's runway leaves 0 tokens "
    "(skip_request, 'so it does not stall the requests behind it')",
)
def test_a_waiting_request_the_runway_leaves_nothing_does_not_block_the_queue():
    """Prefill runway 3 (multi-module MTP), threshold 1, two waiting
    requests: r000's 3-token prompt may take 1 token (sub-block, the
    threshold), which would end 2 tokens before its prompt's end, inside the
    runway: vLLM's ``_reserve_prefill_lookahead`` leaves 0, and its waiting
    loop requeues r000 and admits r001 (a 1-token prompt, taken whole)."""
    hashing = MTPHashing(
        use_eagle_block_drop=True, num_hash_lookahead_tokens=0, num_prefill_lookahead_tokens=K
    )
    scheduler = _threshold_scheduler(1, hashing)
    scheduler.add_request(tiny_spec(0, 3))
    scheduler.add_request(tiny_spec(1, 1))
    assert scheduler.schedule().new_request_ids == ("r001",)


def test_a_padded_requests_placeholder_drafts_are_never_accepted():
    """Every real draft is accepted (rate 1.0): r001's decode keeps its 3
    drafts (4 tokens), while r002's padded rows hold placeholders the
    verifier never accepts: it samples its one token. Step 2 generates
    4 + 1 tokens and accepts 3 of 6 drafts (vLLM counts the placeholders,
    ``scheduled_spec_decode_tokens = [-1] * K``, as drafts)."""
    scheduler = _pad_scheduler()
    engine = CheckedEngine(scheduler, rates=(1.0,))
    scheduler.add_request(tiny_spec(1, 2))
    engine.step()
    scheduler.add_request(tiny_spec(2, 1))
    output, outcome = engine.step()
    assert [item.is_padded for item in output.scheduled] == [False, True]
    assert (outcome.num_generated_tokens, outcome.num_draft_tokens, outcome.num_accepted_tokens) == (5, 6, 3)


@pytest.mark.parametrize("prompt, hit", [(64, 0), (66, 32)])
def test_the_drafters_re_prefillable_tokens_are_not_cached(prompt, hit):
    """Multi-module MTP with the EAGLE drop (prefill runway 3): vLLM's
    coordinator caches only tokens whose KV is final, so the last 3 - 1 = 2
    computed tokens stay out of the cache. r000 (one output) computes its
    prompt in two chunks (the first ends at its last cacheable boundary,
    32) and finishes. At 64 tokens, block 1 (32..63) holds tokens 62 and 63,
    not final: r001 (200 tokens, the same start) matches block 0 only, and
    the EAGLE drop takes it back: no hit. At 66 tokens block 1 is final:
    two blocks match, one is dropped: 32 (where r000's first chunk left the
    Mamba groups' checkpoint)."""
    hashing = MTPHashing(
        use_eagle_block_drop=True, num_hash_lookahead_tokens=0, num_prefill_lookahead_tokens=K
    )
    scheduler = _threshold_scheduler(0, hashing)
    engine = CheckedEngine(scheduler, rates=(0.0,))
    scheduler.add_request(tiny_spec(0, prompt, output=1, family=7))
    engine.run()
    scheduler.add_request(tiny_spec(1, 200, output=1, family=7))
    output, _ = engine.step()
    assert output.admitted_hits == {"r001": hit}


def test_a_steps_token_sums_count_every_request():
    """Two prefill chunks (100 and 30 prompt tokens) and a decode of 1 + K
    = 4 (3 drafts): 134 scheduled tokens, 130 of them prefill, 4 decode."""
    scheduled = (
        ScheduledRequest("a", 100, 0, 0, 100),
        ScheduledRequest("b", 30, 64, 0, 30),
        ScheduledRequest("c", 4, 500, 3, 0),
    )
    output = SchedulerOutput(step_index=1, scheduled=scheduled)
    assert (output.total_num_scheduled_tokens, output.num_prefill_tokens, output.num_decode_tokens) == (
        134,
        130,
        4,
    )
