"""The fork's v2.5.1 deployment (issue 20, item 4): ``--block-size 4096``,
``--prefix-match-unit 64``, ``--use-replayssm`` (RecoverSSM, patches
0071/0072), MTP K=3, at ``--kv-cache-memory 4100000000``.

Expected pool figures are the fork's own published statements, quoted with
their source in each case; the hand derivations beside them are independent
of kvsim's planner. Every rule has a control (the flag off gives the old
figure)."""

from __future__ import annotations

import json

import pytest
from helpers.scenarios import write_scenario

from sim.cli import main
from sim.config import ConfigError, DeploymentConfig, load_model
from sim.kv_cache_manager import build_kv_cache_manager
from sim.kv_cache_plan import plan_kv_cache
from sim.model_specs import recoverssm_replay_shape
from sim.paths import DEFAULT_MODEL, PROJECT_ROOT
from sim.scenario import load_scenario
from sim.sched.fast_path.kv_cache_manager import FastPathKVCacheManager

TINY_MODEL = PROJECT_ROOT / "tests" / "data" / "tiny-flash-next.yaml"
SHIPPED = DeploymentConfig(block_size=4096, prefix_match_unit=64, use_replayssm=True)


def _without_mtp(model):
    """The fork's "same command minus --speculative-config": no drafter
    layer, no drafts (and so no RecoverSSM: patch 0085's fallback)."""
    mtp = model.mtp.model_copy(update={"num_layers": 0, "num_speculative_tokens": 0})
    return model.model_copy(update={"mtp": mtp})


# (case, deployment changes, without MTP, layout on) -> (block, blocks, tokens).
# Sources (repository halt95/qwen38-flash-next-3090s):
#   CARD = benchmarks/2026-10-06/BENCH-CARD.md @1034669d5a42a2448c4279b833bc1ebd979308c2, section 3
#          ("924,993 (attention block 4,096; 248 blocks; as v2.5.0)"; v2.2.0 "806,792 (block 3,200)";
#          without MTP "computed attention block: pool 1,057,314")
#   REF  = docs/reference.md @2dba2ee168a9ce35e05c8dac47ceb04472d34c75, "The KV budget"
#          ("from 806,792 to 929,987 tokens at the computed 3,392-token block, and to 924,993 at the
#          shipped 4,096-token block"; "the layout alone measured 806,792 -> 853,994"; "the pin from
#          3.8e9 (pool 748,255) to 4.1e9 (pool 806,792)"; "without MTP the pool is 1,057,314 tokens")
PUBLISHED = {
    # CARD s3, REF: the shipped v2.5.1 deployment.
    "shipped-4096": ({"block_size": 4096, "use_replayssm": True}, False, True, (4096, 248, 924_993)),
    # REF: RecoverSSM at the planner's computed block.
    "recoverssm-computed": ({"use_replayssm": True}, False, True, (3392, None, 929_987)),
    # CARD s3, REF: without MTP, computed block (v2.5.0 release candidate).
    "no-mtp-computed": ({"use_replayssm": True}, True, True, (None, None, 1_057_314)),
    # CARD s3 (v2.2.0), REF: before the side-cache layout and RecoverSSM.
    "v2.2.0": ({}, False, False, (3200, 317, 806_792)),
    # REF: the side-cache layout alone (patch 0088's own commit).
    "layout-alone": ({}, False, True, (3200, 317, 853_994)),
    # REF: the 3.8e9 pin before host-resident embeddings.
    "pin-3.8e9": ({"kv_cache_memory_bytes": 3_800_000_000}, False, False, (3200, None, 748_255)),
}


@pytest.mark.parametrize("case", sorted(PUBLISHED))
def test_the_forks_published_pool_figures(flash_next, case):
    changes, no_mtp, on, (block, blocks, tokens) = PUBLISHED[case]
    model = _without_mtp(flash_next) if no_mtp else flash_next
    plan = plan_kv_cache(model, DeploymentConfig(**changes), side_cache_layout=on)
    assert plan.kv_cache_tokens == tokens
    if block is not None:
        assert plan.block_size == block
    if blocks is not None:
        assert plan.num_blocks == blocks


def test_the_shipped_pool_by_hand(flash_next):
    """924,993 re-derived without the planner: block bytes scale with the
    block (every page is per token), so PP1's 12,902,400 B at 3,200 tokens is
    16,515,072 B at 4,096 and 4.1e9 holds 248 of them; a 262,144-token
    request holds cdiv(262,144, 4,096) = 64 attention blocks plus 2 state
    blocks in each of the 3 Mamba groups (RecoverSSM: no per-draft blocks);
    the rings share cdiv(8 sequences, 1,024 slots) = 1 block."""
    stride = 12_902_400 * 4096 // 3200
    blocks = 4_100_000_000 // stride
    per_request = 262_144 // 4096 + 3 * 2
    assert (stride, blocks, per_request) == (16_515_072, 248, 70)
    plan = plan_kv_cache(flash_next, SHIPPED, side_cache_layout=True)
    assert max(plan.block_bytes_per_stage) == stride
    assert (plan.num_blocks, plan.blocks_per_request) == (blocks, per_request)
    assert plan.kv_cache_tokens == (blocks - 1) * 262_144 // per_request == 924_993


def test_without_recoverssm_the_forced_block_keeps_k_spec_blocks(flash_next):
    """CONTROL for the shipped figure: the same block without --use-replayssm
    keeps 2 + K = 5 blocks per Mamba group, 64 + 15 = 79 per request."""
    plan = plan_kv_cache(flash_next, DeploymentConfig(block_size=4096), side_cache_layout=True)
    assert (plan.num_blocks, plan.blocks_per_request) == (248, 79)
    assert plan.kv_cache_tokens == 247 * 262_144 // 79 == 819_614


def test_the_replay_record_makes_the_computed_block_3392(flash_next):
    """Patch 0072: each GDN layer's state gains an fp32 replay record of
    (HV/tp, K+1, V+K+1) = (24, 4, 257), 98,688 B, on top of the 1,634,304 B
    conv + SSM state; 16 x cdiv(1,732,992, 16 x 512) = 3,392 tokens.
    Patch 0071: every Mamba spec then has 0 speculative blocks."""
    deployment = DeploymentConfig(use_replayssm=True)
    assert recoverssm_replay_shape(flash_next, deployment) == (24, 4, 257)
    specs = plan_kv_cache(flash_next, deployment, side_cache_layout=False).layer_specs
    assert specs.gdn.real_page_size_bytes == 1_634_304 + 24 * 4 * 257 * 4 == 1_732_992
    assert specs.block_size == 16 * -(-1_732_992 // (16 * 512)) == 3392
    assert specs.gdn.num_speculative_blocks == specs.ple.num_speculative_blocks == 0
    # CONTROL: without the flag, the stock state and K spec blocks.
    stock = plan_kv_cache(flash_next, DeploymentConfig(), side_cache_layout=False).layer_specs
    assert (stock.gdn.real_page_size_bytes, stock.block_size) == (1_634_304, 3200)
    assert stock.gdn.num_speculative_blocks == stock.ple.num_speculative_blocks == 3


def test_replayssm_without_drafts_falls_back(flash_next):
    """Patch 0085: --use-replayssm with no speculative tokens is the stock path."""
    model = _without_mtp(flash_next)
    on = plan_kv_cache(model, DeploymentConfig(use_replayssm=True), side_cache_layout=True)
    off = plan_kv_cache(model, DeploymentConfig(), side_cache_layout=True)
    assert on.worker_configs == off.worker_configs


def test_pool_plan_command_reports_the_shipped_deployment(capsys):
    argv = ["pool-plan", "--json", "--layout", "on", "--block-size", "4096", "--use-replayssm"]
    assert main([*argv, "--prefix-match-unit", "64"]) == 0
    shipped = json.loads(capsys.readouterr().out)["on"]
    assert (shipped["block_size"], shipped["num_blocks"], shipped["kv_cache_tokens"]) == (4096, 248, 924_993)
    assert shipped["hash_block_size"] == 64
    # CONTROL: no unit, hits on the block.
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["on"]["hash_block_size"] == 4096


# ------------------------------------------------------------ the scenario
def test_the_shipped_scenario_is_the_deployment():
    scenario = load_scenario("fork-v2.5.1")
    deployment = scenario.deployment
    assert (deployment.block_size, deployment.prefix_match_unit, deployment.use_replayssm) == (4096, 64, True)
    assert (deployment.max_num_seqs, deployment.kv_cache_memory_bytes) == (8, 4_100_000_000)
    assert scenario.scheduler.max_num_batched_tokens == 1024
    assert scenario.load_model().mtp.num_speculative_tokens == 3
    assert scenario.layouts == ("on",)
    plan = plan_kv_cache(scenario.load_model(), deployment, side_cache_layout=True)
    assert (plan.kv_cache_tokens, plan.hash_block_size) == (924_993, 64)


# serve-v2.5.sh as exec'd (halt95/qwen38-flash-next-3090s, scripts/serve-v2.5.sh;
# the received note fork-patch-series.md, section 4): no --async-scheduling flag, but vLLM 0.33.0
# on Model Runner V2 under PP schedules asynchronously (docs/fidelity.md).
SERVE_V25 = {"max_num_seqs": 8, "kv_cache_memory_bytes": 4_100_000_000, "block_size": 4096}
SERVE_V25_UNIT, SERVE_V25_BUDGET = 64, 1024


def _sections(scenario):
    d = scenario.deployment
    return (
        (d.max_num_seqs, d.kv_cache_memory_bytes, d.block_size, d.prefix_match_unit, d.use_replayssm),
        scenario.scheduler.max_num_batched_tokens,
        scenario.engine.mode,
        scenario.max_concurrent_batches,
    )


RIG = ((8, 4_100_000_000, 4096, SERVE_V25_UNIT, True), SERVE_V25_BUDGET, "async", 3)


def test_the_scenario_defaults_are_the_rig_as_shipped(tmp_path):
    """Issue 21.1: a scenario that says nothing runs serve-v2.5.sh's flags on
    the async loop (a batch queue of pp + 1 = 3), MTP at the card's thinking-on
    4 K acceptance (1 + r + r^2 + r^3 = 3.02 tokens per step, BENCH-CARD
    2026-09-17). CONTROL: the tests' pinned old defaults (PRE_RIG) are not."""
    bare = load_scenario(str(write_scenario(tmp_path, "bare", rig=True)))
    assert _sections(bare) == RIG
    assert bare.mtp.acceptance_profile == "thinking-on-4k"
    r = bare.mtp.acceptance_rates[0]
    assert bare.mtp.acceptance_rates == (r, r, r) and abs(1 + r + r**2 + r**3 - 3.02) < 1e-5
    plan = plan_kv_cache(bare.load_model(), bare.deployment, side_cache_layout=True)
    assert (plan.kv_cache_tokens, plan.num_blocks, plan.hash_block_size) == (924_993, 248, 64)
    old = load_scenario(str(write_scenario(tmp_path, "old")))
    assert _sections(old) == ((8, 4_100_000_000, None, None, False), 8192, "sync", 2)
    assert old.mtp.acceptance_rates == (0.8, 0.7, 0.6) and old.mtp.acceptance_profile is None


def test_a_partial_deployment_section_keeps_the_rigs_block_flags(tmp_path):
    """The defaults hold key by key: 32 sequences keep block 4096, unit 64,
    RecoverSSM; null gives vLLM's (the computed block: the layout-alone pool
    853,994). Rates given alone replace the default profile."""
    given = {"max_num_seqs": 32}
    partial = load_scenario(str(write_scenario(tmp_path, "p", rig=True, deployment=given)))
    d = partial.deployment
    assert (d.max_num_seqs, d.block_size, d.prefix_match_unit, d.use_replayssm) == (32, 4096, 64, True)
    stock = {**given, "block_size": None, "prefix_match_unit": None, "use_replayssm": False}
    vllms = load_scenario(str(write_scenario(tmp_path, "v", rig=True, deployment=stock)))
    plan = plan_kv_cache(vllms.load_model(), vllms.deployment, side_cache_layout=True)
    assert (plan.block_size, plan.kv_cache_tokens) == (3200, 853_994)
    rates = load_scenario(str(write_scenario(tmp_path, "r", rig=True, mtp={"acceptance_rates": [0.5] * 3})))
    assert (rates.mtp.acceptance_rates, rates.mtp.acceptance_profile) == ((0.5, 0.5, 0.5), None)


def test_the_default_scenario_spells_out_the_defaults(tmp_path):
    """scenarios/default.yaml names every rig setting it runs, and they are
    the scenario defaults; old-defaults.yaml is the control."""
    default, bare = load_scenario("chat-slice"), load_scenario(str(write_scenario(tmp_path, rig=True)))
    assert _sections(default) == _sections(bare) == RIG
    assert default.mtp == bare.mtp
    old = load_scenario("old-defaults")
    assert _sections(old) == ((16, 4_100_000_000, None, None, False), 8192, "sync", 2)


def test_the_unit_reaches_vllms_managers_and_the_hasher(flash_next):
    """The plan's hash block is what vLLM's KVCacheManager hashes on, and
    its coordinator turns sub-block (partial) hits on, as vLLM's engine core
    does with --prefix-match-unit; the scheduler hashes requests on it.
    CONTROL: the default deployment hashes on the block, no partial hits."""
    from sim.sched.scheduler import Scheduler, SchedulerConfig

    plan = plan_kv_cache(flash_next, SHIPPED, side_cache_layout=True)
    manager = build_kv_cache_manager(plan)
    assert manager.block_pool.hash_block_size == 64
    assert manager.coordinator.enable_partial_hash_hits
    config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=1024,
        max_model_len=262_144,
        block_size=4096,
        num_speculative_tokens=3,
    )
    scheduler = Scheduler(config, FastPathKVCacheManager(manager, config))
    assert scheduler.split._scheduler.mamba_partial_cache_hit
    default = build_kv_cache_manager(plan_kv_cache(flash_next, DeploymentConfig(), side_cache_layout=True))
    assert default.block_pool.hash_block_size == 3200
    assert not default.coordinator.enable_partial_hash_hits
    # Without prefix caching vLLM hashes on the block whatever the unit.
    assert build_kv_cache_manager(plan, enable_caching=False).block_pool.hash_block_size == 4096


def _partial_hit_scenario(tmp_path):
    """The fork's partial-hit test shape (patch 0093: block 32, unit 8, K=3)
    on the tiny model: three requests sharing a 96-token prefix, so the
    later ones hit mid-block and vLLM copies the hit's tail (copy-on-write)."""
    path = write_scenario(
        tmp_path,
        "partial",
        model=str(TINY_MODEL),
        layouts=["on"],
        deployment={"prefix_match_unit": 8, "kv_cache_memory_bytes": 60_000_000, "max_model_len": 4096},
        workload={
            "trace": "synthetic",
            "num_requests": 3,
            "arrival": {"process": "constant", "rate_per_s": 0.5},
            "prompt": {"distribution": "fixed", "tokens": 150},
            "output": {"distribution": "fixed", "tokens": 4},
            "shared_prefix_tokens": 96,
            "prefix_unit": 8,
        },
        simulation={"check_invariants": True, "sample_interval_s": None},
    )
    return load_scenario(str(path))


def test_partial_hits_release_their_copy_blocks(tmp_path, monkeypatch):
    """vLLM's scheduler frees both ends of each copy-on-write copy once the
    copying step is done; the allocator checker (run after every step)
    finds every block free or held. CONTROL: skip that release and the
    checker finds the copy blocks held by nobody."""
    from sim.allocator_invariants import AllocatorInvariantError
    from sim.analysis.runs import run_scenario
    from sim.sched.scheduler import Scheduler
    from sim.vllm_bridge import KVCacheManager

    copies: list[int] = []
    take = KVCacheManager.take_kv_cache_block_copies

    def counting(self):
        result = take(self)
        copies.append(len(result[0]))
        return result

    monkeypatch.setattr(KVCacheManager, "take_kv_cache_block_copies", counting)
    scenario = _partial_hit_scenario(tmp_path)
    result = run_scenario(scenario)
    assert sum(copies) > 0, "no partial hit: the case does not exercise copy-on-write"
    assert result.summary["num_finished"].iloc[0] == 3
    monkeypatch.setattr(Scheduler, "_release_cow_copies", lambda self: None)
    with pytest.raises(AllocatorInvariantError, match="neither free nor held|ref_cnt"):
        run_scenario(scenario)


# ------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "flags, needles",
    [
        (
            ["--block-size", "4096", "--prefix-match-unit", "100"],
            ("prefix_match_unit 100", "block_size 4096"),
        ),
        (["--prefix-match-unit", "6"], ("prefix_match_unit=6", "divisible")),
        # divides the block, but cuts a compressed-key state (4 tokens each)
        (["--prefix-match-unit", "2"], ("prefix_match_unit=2", "compression")),
        (["--block-size", "0"], ("block_size",)),
        (["--block-size", "20000000"], ("block_size", "no request is longer")),
        (["--prefix-match-unit", "0"], ("prefix_match_unit",)),
    ],
)
def test_impossible_units_and_blocks_are_one_line_errors(capsys, flags, needles):
    assert main(["pool-plan", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvsim: error:") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err


FITTING_UNITS = [["--prefix-match-unit", "64"], ["--block-size", "4096", "--prefix-match-unit", "4096"]]


@pytest.mark.parametrize("flags", FITTING_UNITS)
def test_units_that_fit_are_accepted(capsys, flags):
    """CONTROL for the errors above."""
    assert main(["pool-plan", "--json", *flags]) == 0
    assert json.loads(capsys.readouterr().out)["on"]["hash_block_size"] == int(flags[-1])


def test_scenario_keys_are_strict(tmp_path, capsys):
    path = write_scenario(tmp_path, "typo", deployment={"prefix_match_units": 64})
    assert main(["run", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{path}: unknown key 'deployment.prefix_match_units'" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_scenario_unit_must_divide_the_block(capsys, tmp_path):
    argv = ["run", "fork-v2.5.1", "--set", "deployment.prefix_match_unit=100", "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "deployment: prefix_match_unit 100 does not divide block_size 4096" in err
    assert err.count("\n") == 1


def test_plan_error_names_the_unit(flash_next):
    with pytest.raises(ConfigError, match="prefix_match_unit=48"):
        plan_kv_cache(flash_next, DeploymentConfig(prefix_match_unit=48), side_cache_layout=True)


def test_the_model_file_is_unchanged():
    """The deployment keys are the engine's flags, not the model's: the
    shipped model description loads as before."""
    assert load_model(DEFAULT_MODEL).name == "flash-next"


def test_partial_hits_conform_to_vllms_scheduler(tmp_path, monkeypatch):
    """With a prefix-match unit finer than the block (partial hits, Mamba
    copy-on-write), kvsim's scheduler is step for step vLLM 0.33.0's own
    Scheduler built from a real VllmConfig with ``prefix_match_unit``.
    CONTROL: kvsim's manager hashing on the block instead differs."""
    import sim.engine_assembly as assembly
    from sim.analysis.runs import scenario_workload
    from sim.conformance.driver import run_conformance

    scenario = _partial_hit_scenario(tmp_path)
    requests = scenario_workload(scenario).requests
    result = run_conformance(scenario, "on", requests, mtp_hash_mode="eagle-drop")
    comparison = result.comparison
    assert comparison.num_steps > 0 and comparison.conforms, comparison.first_difference
    build = assembly.build_kv_cache_manager

    def on_the_block(plan, **kwargs):
        from dataclasses import replace

        return build(replace(plan, hash_block_size=plan.block_size), **kwargs)

    monkeypatch.setattr(assembly, "build_kv_cache_manager", on_the_block)
    assert not run_conformance(scenario, "on", requests, mtp_hash_mode="eagle-drop").comparison.conforms
