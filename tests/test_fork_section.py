"""The scenario's ``fork:`` section: the fork as shipped by default,
``upstream`` for vLLM 0.33.0, any patch off by its key, unknown keys refused
naming the key."""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers.scenarios import scenario

from sim.config import ConfigError
from sim.engine import Simulation
from sim.fork.patches import AS_SHIPPED, ForkPatches
from sim.fork.retention import PartialTailHoldingMambaManager, RetainingMambaManager
from sim.scenario import ForkSection


def test_the_section_has_one_key_per_modelled_patch():
    assert set(ForkSection.model_fields) - {"base"} == set(ForkPatches.names())


def test_the_default_is_the_fork_as_shipped(tmp_path):
    patches = scenario(tmp_path).fork.patches()
    assert patches == AS_SHIPPED and all(getattr(patches, name) for name in ForkPatches.names())


@pytest.mark.parametrize("section", ["upstream", {"base": "upstream"}])
def test_upstream_turns_every_patch_off(tmp_path, section):
    patches = scenario(tmp_path, fork=section).fork.patches()
    assert patches == ForkPatches.upstream()
    assert not any(getattr(patches, name) for name in ForkPatches.names())


def test_one_patch_off_or_on_over_either_base(tmp_path):
    one_off = scenario(tmp_path, fork={"mamba_retain_checkpoint": False}).fork.patches()
    assert one_off == ForkPatches(mamba_retain_checkpoint=False)
    one_on = scenario(tmp_path, overrides=["fork.base=upstream", "fork.deferred_free_eviction_order=true"])
    expected = replace(ForkPatches.upstream(), deferred_free_eviction_order=True)
    assert one_on.fork.patches() == expected


@pytest.mark.parametrize("section", [{"retain_everything": True}, {"base": "v2.2"}, "newest"])
def test_an_unknown_patch_key_or_base_is_an_error_naming_it(tmp_path, section):
    with pytest.raises(ConfigError) as error:
        scenario(tmp_path, fork=section)
    message = str(error.value)
    assert "fork" in message and "\n" not in message
    if isinstance(section, dict) and "retain_everything" in section:
        assert "retain_everything" in message


def test_the_simulation_builds_its_manager_from_the_section(tmp_path):
    """Upstream: vLLM's own Mamba manager and upstream's deferred-free order."""
    for section, kvsim_mamba in (("upstream", False), ({}, True)):
        manager = Simulation(scenario(tmp_path, fork=section), "on", workload=None).kv_cache_manager  # type: ignore[arg-type]
        assert any(isinstance(m, RetainingMambaManager) for m in manager.managers) is kvsim_mamba
        assert manager.deferred_free_eviction_order is kvsim_mamba


def test_the_partial_tail_hold_has_its_own_key(tmp_path):
    """Patch 0093 rides the fork's retention switch but has a key of its
    own: as shipped the Mamba groups get the holding manager, with the key
    off the retaining manager without it (the fork before 0093)."""
    for section, holding in (({}, True), ({"mamba_hold_partial_tail": False}, False)):
        manager = Simulation(scenario(tmp_path, fork=section), "on", workload=None).kv_cache_manager  # type: ignore[arg-type]
        mambas = [m for m in manager.managers if isinstance(m, RetainingMambaManager)]
        assert mambas and all(isinstance(m, PartialTailHoldingMambaManager) is holding for m in mambas)
