"""The what-ifs the fork's engineers ask (issue 39): TP4, a power cap, MTP
off or K=2, a checkpoint's quantization. Each runs from the CLI with
``--set``; bad values are one line and exit 2; and each what-if's direction
and size is held against the lever the fork published for it (the figures
are the bench cards', scenarios/rig/published.yaml, never kvsim's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.analysis.published import load_figures, published_table
from sim.cli import main
from sim.scenario import load_scenario
from sim.step_time import even_partition

TINY = """name: tiny
workload:
  trace: synthetic
  num_requests: 2
  arrival: {process: poisson, rate_per_s: 2.0}
  prompt: {distribution: fixed, tokens: 1000}
  output: {distribution: fixed, tokens: 10}
"""
BOUND_PCT = 10.0


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    return path


@pytest.fixture(scope="module")
def figures():
    return {f.id: f for f in load_figures()}


def table(figures, *ids):
    return published_table([figures[i] for i in ids]).set_index("figure")


# ------------------------------------------------------------- the CLI
@pytest.mark.parametrize(
    "settings",
    [
        ["deployment.tensor_parallel_size=4", "deployment.pipeline_parallel_size=1"],
        ["step_time.power_cap_w=200"],
        ["mtp.num_speculative_tokens=0"],
        ["mtp.num_speculative_tokens=2"],
        ["step_time.quantization=w4a16-merlin-int8-attention"],
        ["step_time.ple_transport=push"],
        ["step_time.gdn_forward=unfused"],
    ],
)
def test_each_what_if_runs_from_the_cli(tiny: Path, tmp_path: Path, settings: list[str]) -> None:
    argv = ["run", str(tiny), "--layout", "on", "--out", str(tmp_path / "out")]
    for setting in settings:
        argv += ["--set", setting]
    assert main(argv) == 0
    assert (tmp_path / "out" / "manifest.json").is_file()


def test_the_keys_reach_the_model_and_the_clock(tiny: Path) -> None:
    """K=0 builds no MTP layer (vLLM without --speculative-config); K=2
    drafts the profile's first two positions; TP4 at pp 1 gets vLLM's even
    split; the cap and the replay reach the step-time config."""
    off = load_scenario(str(tiny), ["mtp.num_speculative_tokens=0"])
    assert (off.load_model().mtp.num_layers, off.step_time_config().num_speculative_tokens) == (0, 0)
    assert not off.step_time_config().recover_ssm_replay  # RecoverSSM needs MTP
    k2 = load_scenario(str(tiny), ["mtp.num_speculative_tokens=2"])
    k3 = load_scenario(str(tiny))
    assert k2.mtp.acceptance_rates == k3.mtp.acceptance_rates[:2]
    tp4 = load_scenario(
        str(tiny), ["deployment.tensor_parallel_size=4", "deployment.pipeline_parallel_size=1"]
    )
    assert tp4.deployment.layer_partition == (48,)
    capped = load_scenario(str(tiny), ["step_time.power_cap_w=200"]).step_time_config()
    assert capped.power_cap_w == 200 and k3.step_time_config().recover_ssm_replay


@pytest.mark.parametrize(
    "layers, pp, expected",
    # vLLM's get_pp_indices: 48 // 5 = 9 each, the 3 left over on the
    # stages before the last; 50 over 4: 12 each, 2 left over.
    [(48, 1, [48]), (48, 2, [24, 24]), (48, 5, [9, 10, 10, 10, 9]), (50, 4, [12, 13, 13, 12])],
)
def test_a_pp_degree_without_a_partition_gets_vllms_split(layers, pp, expected) -> None:
    assert list(even_partition(layers, pp)) == expected


# ----------------------------------------------------------- bad input
def one_line(capsys, argv: list[str], *needles: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvsim: error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize(
    "setting, needles",
    [
        # 24 query heads, 16 GDN key heads, 48 value heads: 3 does not divide 16.
        ("deployment.tensor_parallel_size=3", ("tensor_parallel_size 3", "16 GDN key heads")),
        ("deployment.tensor_parallel_size=5", ("tensor_parallel_size 5", "24 QSA query heads")),
        ("step_time.power_cap_w=90", ("step_time.power_cap_w", "90 W", "100-400 W")),
        ("step_time.power_cap_w=450", ("step_time.power_cap_w", "450 W")),
        ("step_time.quantization=int3", ("step_time.quantization", "unknown quantization 'int3'")),
        ("mtp.num_speculative_tokens=-1", ("num_speculative_tokens",)),
        ("step_time.ple_transport=carrier", ("step_time", "ple_transport", "'pull' or 'push'")),
    ],
)
def test_bad_what_ifs_are_one_line_and_exit_2(tiny: Path, tmp_path: Path, capsys, setting, needles) -> None:
    out = tmp_path / "out"
    one_line(capsys, ["run", str(tiny), "--set", setting, "--out", str(out)], *needles)
    assert not out.exists()


def test_control_tp8_is_accepted(tiny: Path) -> None:
    """Control of the head check: 8 divides 24, 16 and 48, and the 2 QSA
    KV heads divide 8 (vLLM replicates them), so TP8 is a valid degree."""
    scenario = load_scenario(
        str(tiny), ["deployment.tensor_parallel_size=8", "deployment.pipeline_parallel_size=1"]
    )
    assert scenario.step_time_config().tensor_parallel_size == 8


# --------------------------------------------- levers the fork published
def test_the_k2_lever(figures) -> None:
    """2026-09-24 card: MTP K=2 cuts the ITL 10-12 % (held in the 4K and
    100K thinking-on cells) and, judged on tokens per step over ITL, the
    throughput 10-12 % in 3 of 4 cells. Control: K=3 against itself is 1."""
    rows = table(figures, "k2-itl-on-4k", "k2-itl-on-100k", "k2-toks-on-100k")
    for figure, row in rows.iterrows():
        assert row["kvsim"] < 1, figure  # the direction
        assert abs(row["error_pct"]) <= BOUND_PCT, (figure, row.to_dict())
    assert 0.85 <= rows.loc["k2-itl-on-4k", "kvsim"] <= 0.92


def test_mtp_off(figures) -> None:
    """2026-10-05 card: without MTP, single-stream decode is about 82 tok/s
    at 65K-262K, half of what K=3 gives at the same depths."""
    rows = table(figures, "no-mtp-toks-65k", "no-mtp-toks-262k", "v250-toks-on-261k")
    for figure in ("no-mtp-toks-65k", "no-mtp-toks-262k"):
        assert abs(rows.loc[figure, "error_pct"]) <= BOUND_PCT, rows.loc[figure].to_dict()
    assert rows.loc["no-mtp-toks-262k", "kvsim"] < 0.6 * rows.loc["v250-toks-on-261k", "kvsim"]


def test_the_tp4_arm_pool_and_prefill(figures) -> None:
    """2026-09-17 card's v1 TP4 arm: pool 342,912 (against v2's 806,792),
    prefill 4,498 / 4,194 tok/s at 10K / 100K (v2: 4,944 / 5,282), TTFT
    0.97 / 31.94 s at 4K / 131K. kvsim gives TP4 the slower prefill, by the
    card's size within the bound."""
    ids = ("tp4-pool", "tp4-prefill-10k", "tp4-prefill-100k", "tp4-ttft-4k", "tp4-ttft-131k")
    rows = table(figures, *ids, "prefill-100k")
    for figure in ids:
        assert abs(rows.loc[figure, "error_pct"]) <= BOUND_PCT, rows.loc[figure].to_dict()
    assert rows.loc["tp4-pool", "kvsim"] == 342_912
    assert rows.loc["tp4-prefill-100k", "kvsim"] < 0.9 * rows.loc["prefill-100k", "kvsim"]


def test_the_tp4_arm_decode(figures) -> None:
    """The v1 TP4 arm decodes about as fast as v2: 18.61 / 18.73 / 19.17 ms
    at 4K / 32K / 131K against v2's 18.72 / 18.73 / 19.10. kvsim halves
    the sharded reads at TP4, pays NCCL's four-rank all-reduce on every
    layer and v1's PLE push transport (one round trip a step); each interval
    and the TP4 / v2 ratio hold the card's within the bound. Controls: with
    v2's pull transport the 131K interval is more than 10 % fast; with
    NCCL's tuning-model base latency (6.6 us) instead of the 40 us measured
    on 3090s over PCIe, far faster still."""
    ids = ("tp4-itl-on-4k", "tp4-itl-on-32k", "tp4-itl-on-131k")
    rows = table(figures, *ids, "itl-on-4k", "itl-on-32k", "itl-on-131k")
    for tp4 in ids:
        v2 = tp4.removeprefix("tp4-")
        assert abs(rows.loc[tp4, "error_pct"]) <= BOUND_PCT, rows.loc[tp4].to_dict()
        rig_ratio = rows.loc[tp4, "rig"] / rows.loc[v2, "rig"]
        kvsim_ratio = rows.loc[tp4, "kvsim"] / rows.loc[v2, "kvsim"]
        assert abs(kvsim_ratio / rig_ratio - 1) <= BOUND_PCT / 100, (tp4, kvsim_ratio, rig_ratio)
    figure = figures["tp4-itl-on-131k"]
    pull = figure.model_copy(update={"settings": {**figure.settings, "step_time.ple_transport": "pull"}})
    assert published_table([pull])["error_pct"].iloc[0] < -BOUND_PCT
    cheap = {"nccl_base_latency_s": 6.6e-6}
    fast = published_table([figures["tp4-itl-on-4k"]], cheap).set_index("figure").loc["tp4-itl-on-4k"]
    assert fast["error_pct"] < -BOUND_PCT


def test_the_release_candidates_unfused_forward(figures) -> None:
    """2026-10-05 card, section 5: the release candidate (RecoverSSM with
    the unfused GDN forward) prefilled 100K at 4,706 tok/s at its computed
    3,392-token block and 4,808 at 3,456, against 5,525 at 4,096 (0.852 and
    0.870 of it). The one coefficient was fitted on the 10K pair (4,798 /
    5,344: two block-cut chunks); at 100K the 29 and 28 cut chunks are held
    out: kvsim's ratio to the 4,096 row within 2 % of the card's (its boots
    are within 1 %), each row within the bound. Control: priced as the
    fused forward, the candidate's 100K row misses by more than 10 %."""
    ids = ("recovery-rc-100k", "recovery-rc-block-3456-100k", "recovery-rc-block-4096-100k")
    rows = table(figures, *ids)
    for figure in ids:
        assert abs(rows.loc[figure, "error_pct"]) <= BOUND_PCT, rows.loc[figure].to_dict()
    whole = "recovery-rc-block-4096-100k"
    for cut in ids[:2]:
        rig_ratio = rows.loc[cut, "rig"] / rows.loc[whole, "rig"]
        kvsim_ratio = rows.loc[cut, "kvsim"] / rows.loc[whole, "kvsim"]
        assert abs(kvsim_ratio / rig_ratio - 1) <= 0.02, (cut, kvsim_ratio, rig_ratio)
    figure = figures["recovery-rc-100k"]
    fused = figure.model_copy(update={"settings": {**figure.settings, "step_time.gdn_forward": "fused"}})
    assert published_table([fused])["error_pct"].iloc[0] > BOUND_PCT


def test_the_power_cap_moves_prefill_not_decode(figures) -> None:
    """A 200 W cap slows the capped tensor clock by (200/220)^(1/3) = 0.969:
    compute-bound prefill follows it, weight-streaming decode does not."""
    base = [figures["prefill-100k"], figures["itl-on-4k"]]
    capped = published_table(base, {"power_cap_w": 200}).set_index("figure")["kvsim"]
    rig = published_table(base).set_index("figure")["kvsim"]
    assert capped["prefill-100k"] / rig["prefill-100k"] == pytest.approx((200 / 220) ** (1 / 3), abs=0.01)
    assert capped["itl-on-4k"] == pytest.approx(rig["itl-on-4k"], rel=1e-3)
