"""Residency (issue 38): how many sessions of L tokens each layout holds at
once, as the fork publishes it, reproduced exactly through vLLM's allocator
under kvsim's scheduler (``kvsim capacity``). Every expected count is the
fork's, with its source:

- v2.5.1 as shipped (block 4,096, 248 blocks, 924,993 tokens, MTP K=3,
  layout on): six 131,072-token sessions resident at once, 0 preemptions,
  a seventh not; three full 262,144-token sessions, a fourth not
  (benchmarks/2026-10-06/BENCH-CARD.md section 3; README "The KV budget").
- Without MTP ("same command minus --speculative-config", computed block,
  pool 1,057,314): seven 131K and three 262K resident (v2.5.0's release
  candidate, benchmarks/2026-10-05/BENCH-CARD_OLD.md section 3); an eighth
  131K session not (kvsim; the card names no eighth).
- The v2 gate (block 3,200, 317 blocks, layout off, no RecoverSSM): three
  262K sessions resident, "peak 302 / 317 blocks" (the v2 card,
  benchmarks/2026-09-17/BENCH-CARD.md; README: "the v2 gate held three at
  302 of 317 blocks"), derived by hand in
  ``test_the_v2_gates_peak_of_302_blocks``.
"""

from __future__ import annotations

import pytest

from sim.analysis.residency import V2_GATE, ResidencyRun, sessions_resident, v2_gate_run


@pytest.mark.parametrize(
    ("tokens", "mtp", "overrides", "layout", "pool_blocks", "expected"),
    [
        (131_072, True, [], "on", 248, 6),
        (262_144, True, [], "on", 248, 3),
        (131_072, False, [], "on", 364, 7),
        (262_144, False, [], "on", 364, 3),
        (262_144, True, list(V2_GATE), "off", 317, 3),
    ],
    ids=["v2.5.1-131K", "v2.5.1-262K", "no-MTP-131K", "no-MTP-262K", "v2-gate-262K"],
)
def test_the_forks_residency_figures(tokens, mtp, overrides, layout, pool_blocks, expected):
    found = sessions_resident("agent-sessions", overrides, tokens, layout, mtp=mtp)
    assert found.num_resident == expected
    assert found.fits.resident and found.fits.num_gpu_blocks == pool_blocks
    assert found.one_more is not None and not found.one_more.resident  # one more does not fit


def test_the_v2_gates_peak_of_302_blocks():
    """The v2 card's capacity row: three 262K sessions resident, "peak 302 /
    317 blocks". The fork counts blocks in use in its scheduler log (v2
    patch 0025, ``e2_alloc_log.py``) as the pool's ``num_gpu_blocks`` (317,
    the null block among them) less its free blocks. By hand, from the
    fork's own figures: a 262K request holds 103 blocks in the fork's plan
    (806,792 = 317 / 103 x 262,144 tokens): 82 attention blocks (262,144 /
    3,200, rounded up), 1 ring block, and 5 in each of the 4 Mamba-type
    groups (GDN x 3, PLE): 1 + K = 4 states and, on the step its prefill
    completes, the block-boundary state as well; a decoding request holds
    4, so 99. The gate prefills at 1,024 tokens a step, so one session at a
    time, and the peak is the step the third completes while the two
    before it decode:

        1 (null) + 3 x 82 + 3 x 1 + 4 x (5 + 4 + 4) = 1 + 246 + 3 + 52 = 302.

    (The per-request sum the same log also writes, nulls excluded, is 301.)"""
    run = v2_gate_run("agent-sessions", [])
    assert run.resident and run.num_gpu_blocks == 317
    assert run.blocks_in_use == 302


@pytest.mark.parametrize(
    ("control", "blocks_in_use"),
    [
        # v2.5's checkpoint retention (0086): each session also keeps its
        # newest Mamba checkpoint, 1 block in each of 4 groups: 302 + 3 x 4.
        (["fork.mamba_retain_checkpoint=true"], 314),
    ],
)
def test_control_the_v2_gate_with_v25s_retention_holds_more(control, blocks_in_use):
    """FAILING CONTROL: the peak moves off the card's 302 when the gate
    runs with a patch v2 did not have."""
    run = v2_gate_run("agent-sessions", control)
    assert run.resident and run.blocks_in_use == blocks_in_use != 302


@pytest.mark.parametrize(
    ("run", "words"),
    [
        (ResidencyRun(3, 3, 0, 302, 317), "three 262K sessions resident, peak 302 / 317 blocks"),
        (ResidencyRun(3, 2, 0, 210, 317), "three 262K sessions NOT resident, peak 210 / 317 blocks"),
    ],
)
def test_capacity_words_the_v2_gate_as_its_card_does(run, words):
    from sim.commands.capacity import v2_gate_words

    assert words in v2_gate_words(run) and v2_gate_words(run).endswith("(the card: 302 / 317)")


def test_control_a_smaller_pool_holds_fewer_131k_sessions():
    """FAILING CONTROL: the fork's lower pin (3.8e9 B, its ceiling before
    the host-resident embeddings) cannot hold the six the test asserts."""
    found = sessions_resident(
        "agent-sessions", ["deployment.kv_cache_memory_bytes=3.8e9"], 131_072, "on", mtp=True
    )
    assert found.num_resident < 6


@pytest.mark.parametrize(
    ("run", "resident"),
    [
        (ResidencyRun(7, 7, 0, 240, 248), True),
        (ResidencyRun(7, 7, 1, 243, 248), False),  # all ran, but one was preempted
        (ResidencyRun(7, 6, 0, 209, 248), False),  # the seventh never ran
    ],
)
def test_resident_means_all_running_and_none_preempted(run, resident):
    assert run.resident is resident


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["capacity", "--sessions-of", "131072,x"], "--sessions-of: expected comma-separated token counts"),
        (["capacity", "--sessions-of", "64"], "above 64"),
    ],
)
def test_capacity_refuses_bad_lengths(argv, message, capsys):
    from sim.cli import main

    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_capacity_refuses_a_cap_out_of_range(capsys):
    from sim.cli import main

    assert main(["capacity", "--max-num-seqs-up-to", "0"]) == 2
    assert capsys.readouterr().err == "kvsim: error: --max-num-seqs-up-to: expected 1 to 256, got 0\n"


@pytest.mark.parametrize(
    ("summary", "verdict"),
    [
        ({"num_preemptions": 0, "mean_waiting": 1.0}, True),  # one waiting on average: not growing
        ({"num_preemptions": 1, "mean_waiting": 0.0}, False),  # a preemption
        ({"num_preemptions": 0, "mean_waiting": 1.5}, False),  # a growing queue
    ],
)
def test_a_cap_holds_without_preemption_or_a_growing_queue(summary, verdict):
    from sim.analysis.residency import holds

    assert holds(summary) is verdict


def test_the_cap_search_finds_the_threshold_in_few_runs():
    """Holding up to 11 of 64: found in 1 + 1 + log2(64) runs at most;
    control: a threshold one higher is found one higher."""
    from sim.analysis.residency import largest_holding

    asked: list[int] = []
    assert largest_holding(lambda n: asked.append(n) or n <= 11, 64) == 11
    assert len(asked) <= 8
    assert largest_holding(lambda n: n <= 12, 64) == 12
