"""The package's layers import downward only, and only the bridge imports
vLLM (STYLE: one thin bridge; plain-Python core; SimPy, pandas and
matplotlib at the edges)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SIM = Path(__file__).resolve().parents[1] / "sim"

# Lowest first. A module may import only modules of its own or a lower layer;
# the most specific entry names a module's layer. The fork's twins
# (``sim/fork/``) sit on the floors of what they twin, each module by name.
LAYERS: list[tuple[str, ...]] = [
    ("sim.config", "sim.paths", "sim.metrics", "sim.model_arch", "sim.fork", "sim.fork.patches"),
    ("sim.vllm_bridge",),
    (
        "sim.model_specs",
        "sim.kv_cache_interface",
        "sim.fork.side_cache_rings",
        "sim.fork.retention",
        "sim.fork.side_cache_layout",
        "sim.kv_cache_plan",
    ),
    ("sim.fork.frees", "sim.fork.pins", "sim.kv_cache_manager", "sim.allocator_invariants"),
    ("sim.sched", "sim.fork.scheduler_pins"),
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
    "sim.fork": {"simpy", "pandas", "matplotlib"},
    "sim.engine_assembly": {"simpy", "pandas", "matplotlib"},
    "sim.workloads": {"vllm", "simpy", "torch", "pandas", "matplotlib"},
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(SIM.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int:
    matches = [
        (len(member), index)
        for index, members in enumerate(LAYERS)
        for member in members
        if module == member or module.startswith(member + ".")
    ]
    assert matches, f"{module} is in no layer: add it to LAYERS"
    return max(matches)[1]


def _is_module(name: str) -> bool:
    path = SIM.parent / name.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top, in a function or for type
    checking alike (``from package import module`` names the module)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names}
            names |= {name for name in submodules if _is_module(name)} or {node.module}
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


def test_every_fork_module_names_its_own_layer():
    """A new module in ``sim/fork/`` chooses its floor: it is not placed by
    the package's entry (the package itself imports nothing)."""
    listed = {member for members in LAYERS for member in members}
    fork = {_module_name(p) for p in (SIM / "fork").glob("*.py")}
    assert fork - listed == set()
    assert _imports(SIM / "fork" / "__init__.py") == set()


# The room that had an import circle (``kv_cache_manager`` <-> the pins, by a
# deferred import in the factory): no cycle among these, however imported.
CYCLE_FREE = {_module_name(p) for p in (SIM / "fork").glob("*.py")} | {"sim.kv_cache_manager"}


def _module_path(module: str) -> Path:
    path = SIM.parent / module.replace(".", "/")
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _import_cycle(paths: dict[str, Path]) -> list[str] | None:
    """One import cycle among ``paths`` (module -> file), or None."""
    graph = {module: sorted(_imports(path) & paths.keys()) for module, path in paths.items()}
    done: set[str] = set()

    def visit(module: str, trail: list[str]) -> list[str] | None:
        if module in trail:
            return trail[trail.index(module) :] + [module]
        if module in done:
            return None
        for imported in graph[module]:
            if (cycle := visit(imported, trail + [module])) is not None:
                return cycle
        done.add(module)
        return None

    return next((c for m in sorted(graph) if (c := visit(m, [])) is not None), None)


def test_no_import_cycle_in_the_fork_or_with_the_manager_factory():
    assert _import_cycle({m: _module_path(m) for m in CYCLE_FREE}) is None


def test_the_cycle_check_catches_the_factorys_old_deferred_import(tmp_path):
    """CONTROL: the pins importing the factory's module again (the old
    circle: the factory imported them inside a function) is a cycle."""
    probe = tmp_path / "pins.py"
    back_up = "\nfrom sim.kv_cache_manager import MTPHashing\n"
    probe.write_text((SIM / "fork" / "pins.py").read_text() + back_up)
    paths = {m: _module_path(m) for m in CYCLE_FREE} | {"sim.fork.pins": probe}
    assert _import_cycle(paths) == ["sim.fork.pins", "sim.kv_cache_manager", "sim.fork.pins"]


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
