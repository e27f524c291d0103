"""The package's layers import downward only, and only the bridge imports
vLLM (STYLE: one thin bridge; plain-Python core; SimPy, pandas and
matplotlib at the edges)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SIM = Path(__file__).resolve().parents[1] / "sim"

# Lowest first. A module may import only modules of its own or a lower layer.
LAYERS: list[tuple[str, ...]] = [
    ("sim.config", "sim.paths", "sim.metrics", "sim.fork_patches", "sim.model_arch"),
    ("sim.vllm_bridge",),
    ("sim.model_specs", "sim.kv_cache_interface", "sim.kv_cache_utils", "sim.kv_cache_plan"),
    (
        "sim.single_type_kv_cache_manager",
        "sim.kv_cache_manager",
        "sim.kv_cache_pins",
        "sim.allocator_invariants",
    ),
    ("sim.sched",),
    (
        "sim.workloads",
        "sim.rig",
        "sim.step_time",
        "sim.pipeline_clock",
        "sim.scenario",
        "sim.engine_assembly",
        "sim.engine",
    ),
    ("sim.analysis", "sim.results", "sim.bench", "sim.conformance", "sim.pool_replay"),
    ("sim.serving",),
    ("sim.commands",),
    ("sim.cli",),
]
# Third-party packages a layer must not use.
FORBIDDEN = {
    "sim.sched": {"simpy", "pandas", "matplotlib"},
    "sim.kv_cache_plan": {"simpy", "pandas", "matplotlib"},
    "sim.kv_cache_manager": {"simpy", "pandas", "matplotlib"},
    "sim.kv_cache_pins": {"simpy", "pandas", "matplotlib"},
    "sim.engine_assembly": {"simpy", "pandas", "matplotlib"},
    "sim.workloads": {"vllm", "simpy", "torch", "pandas", "matplotlib"},
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(SIM.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int:
    for index, members in enumerate(LAYERS):
        if any(module == m or module.startswith(m + ".") for m in members):
            return index
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


MODULES = sorted(p for p in SIM.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: _module_name(p))
def test_imports_go_downward_only(path):
    module = _module_name(path)
    if module == "sim":
        return
    own = _layer(module)
    for name in _imports(path):
        top = name.split(".")[0]
        if top == "vllm":
            in_bridge = module == "sim.vllm_bridge" or module.startswith("sim.vllm_bridge.")
            assert in_bridge, f"{module} imports vLLM directly ({name})"
        if top == "sim" and name != "sim":
            assert _layer(name) <= own, f"{module} (layer {own}) imports {name} (layer {_layer(name)})"
        for prefix, banned in FORBIDDEN.items():
            if module == prefix or module.startswith(prefix + "."):
                assert top not in banned, f"{module} imports {top}"


def test_the_checker_catches_an_upward_import(tmp_path):
    """CONTROL: a scheduler module importing the SimPy edge is flagged."""
    bad = SIM / "sched" / "scheduler.py"
    text = bad.read_text() + "\nfrom sim.engine import Simulation\n"
    probe = tmp_path / "probe.py"
    probe.write_text(text)
    assert "sim.engine" in _imports(probe)
    assert _layer("sim.engine") > _layer("sim.sched.scheduler")


def _prints(path: Path) -> bool:
    return any(
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"
        for node in ast.walk(ast.parse(path.read_text()))
    )


@pytest.mark.parametrize("path", [p for p in MODULES if "analysis" in p.parts], ids=lambda p: p.stem)
def test_analysis_returns_frames_and_prints_nothing(path):
    """Printing belongs to the commands (``sim/commands``), not to analysis."""
    assert not _prints(path), f"{_module_name(path)} prints"


def test_the_print_check_catches_a_print(tmp_path):
    """CONTROL: a module with a print call is flagged."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    print('x')\n")
    assert _prints(probe)


def test_every_command_module_is_registered():
    """A module in sim/commands that is not in COMMAND_MODULES would be dead."""
    from sim.commands import COMMAND_MODULES

    helpers = {"__init__", "common"}
    on_disk = {p.stem for p in (SIM / "commands").glob("*.py")} - helpers
    assert on_disk == set(COMMAND_MODULES)


# Analysis modules that run scenarios but must not lean on one another:
# each takes its runners from sim.analysis.executors.
INDEPENDENT = {"sim.analysis.gates": {"sim.analysis.sweep", "sim.analysis.capacity"}}


def _leans_on(path: Path, banned: set[str]) -> set[str]:
    return {name for name in _imports(path) if name in banned}


@pytest.mark.parametrize("module", sorted(INDEPENDENT))
def test_gates_run_through_the_executors_not_the_sweep(module):
    path = SIM.parent / (module.replace(".", "/") + ".py")
    assert _leans_on(path, INDEPENDENT[module]) == set()
    assert "sim.analysis.executors" in _imports(path)


def test_the_independence_check_catches_a_sweep_import(tmp_path):
    """CONTROL: gates importing the sweep again is flagged."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        (SIM / "analysis" / "gates.py").read_text() + "\nfrom sim.analysis.sweep import run_sweep\n"
    )
    assert _leans_on(probe, INDEPENDENT["sim.analysis.gates"]) == {"sim.analysis.sweep"}
