"""The rig as data: GPUs, quantization schemes and acceptance profiles by
name; an unknown name is one line naming the key (exit 2 from the CLI)."""

from __future__ import annotations

import pytest
from helpers.scenarios import scenario

from sim import rig
from sim.cli import main
from sim.config import ConfigError


@pytest.mark.parametrize(
    "profile, tokens_per_step, rate",
    # Rates solved independently (scipy.optimize.brentq on 1 + r + r^2 + r^3 = T).
    [("thinking-on-4k", 3.02, 0.8149), ("thinking-off-4k", 2.21, 0.6103), ("thinking-on-261k", 3.28, 0.8689)],
)
def test_acceptance_profiles_give_the_measured_tokens_per_step(profile, tokens_per_step, rate):
    rates = rig.acceptance_profile(profile).acceptance_rates()
    assert rates == pytest.approx((rate,) * 3, abs=1e-4)
    r = rates[0]
    assert 1 + r + r * r + r**3 == pytest.approx(tokens_per_step, abs=1e-5)


def test_a_scenario_takes_a_profile_or_rates_not_both(tmp_path):
    sc = scenario(tmp_path, mtp={"acceptance_profile": "thinking-off-32k"})
    assert sc.mtp.acceptance_rates == rig.acceptance_profile("thinking-off-32k").acceptance_rates()
    with pytest.raises(ConfigError, match="not both"):
        scenario(tmp_path, mtp={"acceptance_profile": "thinking-off-32k", "acceptance_rates": [0.5] * 3})


def test_the_rig_entries():
    gpu = rig.gpu("rtx3090-220w")
    # The 220 W cap holds (220 / 350)^(1/3) = 0.8566 of the boost clock.
    assert gpu.sustained_flops() == pytest.approx(35.6e12 * 0.85661, rel=1e-5)
    assert gpu.sustained_flops(350) == 35.6e12 and gpu.sustained_flops(400) == 35.6e12
    quant = rig.quantization("w4a16-merlin")
    assert quant.bytes_per_param("routed_experts") == pytest.approx(0.515625)
    assert quant.bytes_per_param("gdn_projections") == 1.0 and quant.bytes_per_param("attention") == 2.0
    assert set(quant.host) == {"ple_table", "embed_tokens"}


def test_an_unknown_name_names_the_key_and_the_names_there_are():
    with pytest.raises(ConfigError, match="step_time.gpu: unknown gpu 'h100'; gpus.yaml has rtx3090-220w"):
        rig.gpu("h100")


@pytest.mark.parametrize(
    "section, expected",
    [
        ("mtp:\n  acceptance_profile: nope\n", "mtp.acceptance_profile: unknown acceptance_profile 'nope'"),
        ("step_time:\n  gpu: h100\n", "step_time.gpu: unknown gpu 'h100'"),
        ("step_time:\n  quantization: int3\n", "step_time.quantization: unknown quantization 'int3'"),
    ],
)
def test_an_unknown_name_is_one_line_and_exit_2(tmp_path, capsys, section, expected):
    path = tmp_path / "bad.yaml"
    path.write_text("name: bad\n" + section)
    assert main(["run", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and len(err.splitlines()) == 1
