"""The simulated scheduler's policy, step by step, on the tiny model
(32-token blocks): vLLM 0.33.0's rules, each with a control."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.allocator import K, tiny_plan
from helpers.scheduler import MAX_LEN, CheckedEngine, FixedDraws, tiny_scheduler, tiny_spec

from sim.kv_cache_manager import build_kv_cache_manager
from sim.sched.fast_path.kv_cache_manager import FastPathKVCacheManager
from sim.sched.model_runner import AcceptanceModel
from sim.sched.scheduler import Scheduler, SchedulerConfig
from sim.vllm_bridge import RequestStatus


def test_prefill_chunks_end_on_block_boundaries_and_decode_carries_k_drafts():
    scheduler = tiny_scheduler(budget=40)
    scheduler.add_request(tiny_spec(0, 150))
    engine = CheckedEngine(scheduler)
    ends = []
    for _ in range(6):
        output, _ = engine.step()
        [item] = output.scheduled
        ends.append(item.num_computed_tokens + item.num_scheduled_tokens)
    # vLLM's split: chunks end on 32-token boundaries until the last cacheable
    # one (150 -> 128 - 32 = 96), then run to the prompt's end.
    assert ends[:5] == [32, 64, 96, 128, 150]
    decode = output.scheduled[0]  # the sixth step: the first decode
    assert decode.num_scheduled_tokens == 1 + K and decode.num_spec_tokens == K


def test_rejected_drafts_roll_back_computed_tokens():
    scheduler = tiny_scheduler()
    scheduler.add_request(tiny_spec(0, 40))
    engine = CheckedEngine(scheduler, rates=(1.0, 0.0, 0.0))  # exactly one draft accepted
    engine.step()  # prefill
    request = scheduler.requests["r000"]
    for _ in range(3):
        before = request.num_tokens
        output, outcome = engine.step()
        assert output.scheduled[0].num_spec_tokens == K
        assert request.num_tokens == before + 2  # the sampled token + one draft
        assert request.num_computed_tokens == request.num_tokens - 1
        assert outcome.num_accepted_tokens == 1 and outcome.num_draft_tokens == K


def test_requests_longer_than_max_model_len_are_rejected_at_arrival():
    scheduler = tiny_scheduler()
    assert not scheduler.add_request(tiny_spec(0, MAX_LEN))
    assert scheduler.add_request(tiny_spec(1, MAX_LEN - 1, output=1))
    assert scheduler.num_rejected == 1 and scheduler.num_waiting == 1
    assert not scheduler.add_request(tiny_spec(2, MAX_LEN + 10))
    assert scheduler.num_rejected == 2  # each rejection counts


def test_waiting_queue_is_head_of_line_blocking():
    scheduler = tiny_scheduler(num_blocks=44, budget=512)
    scheduler.add_request(tiny_spec(0, 400))  # fits alone
    scheduler.add_request(tiny_spec(1, 400))  # does not fit beside it
    scheduler.add_request(tiny_spec(2, 20))  # would fit, but waits behind 1
    output = scheduler.schedule()
    assert output.new_request_ids == ("r000",)
    assert scheduler.num_waiting == 2
    # CONTROL: with the big one gone from the head, the small one is admitted.
    scheduler.waiting.remove(scheduler.waiting[0])
    assert scheduler.schedule().new_request_ids == ("r002",)


def test_preemption_picks_the_newest_and_admits_nothing_in_that_step():
    scheduler = tiny_scheduler(num_blocks=70, budget=512, batches=1)
    engine = CheckedEngine(scheduler)
    for index in range(3):
        scheduler.add_request(tiny_spec(index, 150, output=400))
    preempting = None
    for _ in range(400):
        output, _ = engine.step()
        if output.preempted_request_ids:
            preempting = output
            break
    assert preempting is not None, "the pool should force a preemption"
    victim = scheduler.requests[preempting.preempted_request_ids[0]]
    # Hand-derived: all three are admitted in arrival order in the first step
    # (running = [r000, r001, r002]); vLLM's victim is running[-1], the newest.
    assert victim.request_id == "r002"
    assert not preempting.new_request_ids and not preempting.resumed_request_ids
    assert scheduler.waiting[0] is victim  # back to the front of the queue
    assert victim.status == RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
    assert victim.num_preemptions == 1  # counted once, on the request itself
    assert victim.num_output_tokens > 0  # outputs are kept; recomputed on resume
    for _ in range(400):  # its next admission is a resume, not a new request
        output, _ = engine.step()
        if "r002" in output.resumed_request_ids:
            break
    assert output.resumed_request_ids == ("r002",) and output.new_request_ids == ()
    engine.run()
    assert not scheduler.has_unfinished_requests()  # and it still finishes


@pytest.mark.parametrize("batches", [1, 2], ids=["no-fence", "fence-2"])
def test_fenced_frees_return_blocks_one_step_later(batches):
    scheduler = tiny_scheduler(batches=batches)
    engine = CheckedEngine(scheduler)
    scheduler.add_request(tiny_spec(0, 40, output=2))
    scheduler.add_request(tiny_spec(1, 40, output=60))
    freed_at = None
    for index in range(20):
        _, outcome = engine.step()
        if outcome and "r000" in outcome.finished:
            freed_at = index
            held_after_finish = scheduler.num_deferred_blocks()
            break
    assert freed_at is not None
    if batches == 1:
        assert held_after_finish == 0  # CONTROL: no step in flight, freed at once
    else:
        assert held_after_finish > 0  # a step still in flight may write them
        engine.step()
        assert scheduler.num_deferred_blocks() == 0


def test_acceptance_model_matches_its_theory():
    model = AcceptanceModel(conditional_rates=(0.8, 0.7, 0.6))
    rng = np.random.default_rng(1)
    draws = np.array([model.sample(3, rng) for _ in range(20000)])
    expected = model.mean_accepted(3)  # 0.8 + 0.56 + 0.336
    assert expected == pytest.approx(1.696)
    # Standard error of the mean is < 0.01 here: 5 sigma.
    assert abs(draws.mean() - expected) < 0.05
    assert np.mean(draws >= 1) == pytest.approx(0.8, abs=0.02)


def test_one_step_accounts_every_request():
    """Two 40-token prompts (outputs 5 and 2), budget 512, K = 3, draws fixed.
    Step 1 prefills both (40 + 40 prompt tokens left, 80 tokens queried, no
    hit, two new rings in adjacent slots) and samples each one first token.
    Step 2 decodes both (4 tokens, 3 drafts, no prompt left): r000's draws
    0.1, 0.1, 0.9 accept 2 (3 tokens); r001's 0.1, 0.9 accept 1, but it
    needs only 1 more token: it stops there, finished with 2. Generated
    3 + 1 = 4, drafts 6, accepted 3. Step 3: r000 alone, draws 0.5 x 3
    accept all, it needs 1 token: finished with 5; generated 1."""
    scheduler = tiny_scheduler(budget=512)
    engine = CheckedEngine(scheduler)
    engine.model_runner.uniforms = FixedDraws(0.1, 0.1, 0.9, 0.1, 0.9, 0.5, 0.5, 0.5)  # type: ignore[assignment]
    scheduler.add_request(tiny_spec(0, 40, output=5))
    scheduler.add_request(tiny_spec(1, 40, output=2))
    rows = []
    for _ in range(3):
        output, outcome = engine.step()
        scheduled = [
            (i.request_id, i.num_scheduled_tokens, i.num_spec_tokens, i.num_prompt_tokens_left)
            for i in output.scheduled
        ]
        cache = (output.prefix_cache_queries, output.prefix_cache_hits)
        counts = (outcome.num_generated_tokens, outcome.num_draft_tokens, outcome.num_accepted_tokens)
        rows.append((output.new_request_ids, scheduled, *cache, outcome.finished, *counts))
        if len(rows) == 1:
            first_ring, second_ring = output.new_ring_block_ids
            assert second_ring == first_ring + 1
    assert rows == [
        (("r000", "r001"), [("r000", 40, 0, 40), ("r001", 40, 0, 40)], 80, 0, {}, 2, 0, 0),
        ((), [("r000", 4, 3, 0), ("r001", 4, 3, 0)], 0, 0, {"r001": 2}, 4, 6, 3),
        ((), [("r000", 4, 3, 0)], 0, 0, {"r000": 5}, 1, 3, 3),
    ]
    assert not scheduler.has_unfinished_requests()


def _threshold_scheduler(threshold: int, seqs: int = 8) -> Scheduler:
    manager = build_kv_cache_manager(tiny_plan(True), num_gpu_blocks=400)
    config = SchedulerConfig(
        max_num_seqs=seqs,
        max_num_batched_tokens=512,
        max_model_len=MAX_LEN,
        block_size=32,
        num_speculative_tokens=K,
        long_prefill_token_threshold=threshold,
    )
    return Scheduler(config, FastPathKVCacheManager(manager, config))


@pytest.mark.parametrize("num_requests, chunk", [(1, 96), (2, 32)])
def test_long_prefill_threshold_applies_only_with_company(num_requests, chunk):
    """vLLM's long_prefill_token_threshold (32 here) clips a prefill only
    when another request is running or waiting: a lone 150-token prompt
    takes vLLM's Mamba-aligned first chunk, 96 tokens (the last cacheable
    boundary, 128 - 32), unclipped; two take 32-token chunks each."""
    scheduler = _threshold_scheduler(32)
    for index in range(num_requests):
        scheduler.add_request(tiny_spec(index, 150))
    output = scheduler.schedule()
    assert [item.num_scheduled_tokens for item in output.scheduled] == [chunk] * num_requests


def test_max_num_seqs_caps_admission():
    """Three small waiting requests, max_num_seqs 2: two admitted."""
    scheduler = _threshold_scheduler(0, seqs=2)
    for index in range(3):
        scheduler.add_request(tiny_spec(index, 20))
    assert scheduler.schedule().new_request_ids == ("r000", "r001")


def test_decodes_near_max_model_len_keep_room_for_the_sampled_token():
    """A 500-token prompt under max_model_len 512: a step may compute at
    most up to 511 tokens (one slot left for the sampled token), so the
    last decodes carry fewer than 1 + K tokens; the request still finishes."""
    scheduler = tiny_scheduler(budget=512)
    engine = CheckedEngine(scheduler, rates=(1.0,))
    scheduler.add_request(tiny_spec(0, 500, output=30))
    ends, sizes = [], []
    for output, _ in engine.run():
        for item in output.scheduled:
            ends.append(item.num_computed_tokens + item.num_scheduled_tokens)
            sizes.append(item.num_scheduled_tokens)
    assert max(ends) == MAX_LEN - 1
    assert min(sizes[1:]) < 1 + K  # clipped by the limit, not the drafts
    assert not scheduler.has_unfinished_requests()


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("max_num_seqs", 0, "max_num_seqs must be positive, got 0"),
        ("max_num_batched_tokens", -1, "max_num_batched_tokens must be positive, got -1"),
        ("max_concurrent_batches", 0, "max_concurrent_batches must be at least 1, got 0"),
    ],
)
def test_scheduler_config_names_the_bad_field(field, value, message):
    base = dict(
        max_num_seqs=1, max_num_batched_tokens=1, max_model_len=1, block_size=1, num_speculative_tokens=0
    )
    SchedulerConfig(**base)  # CONTROL: 1 is valid everywhere
    with pytest.raises(ValueError, match=f"^{message}$"):
        SchedulerConfig(**{**base, field: value})
