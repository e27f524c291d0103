"""Start-up: a command pays for the libraries it uses, not for the others'.
vLLM's import (torch with it) costs 7-15 s and pandas a second or more;
building the parser (``kvsim --help``) imports neither, and ``kvsim plot``
never needs vLLM. Measured in a fresh
interpreter, since this test process has long imported everything."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers.scenarios import write_scenario

from sim.cli import main

HEAVY = ("vllm", "torch", "pandas")


def imported_after(code: str) -> set[str]:
    """Which of ``HEAVY`` a fresh interpreter holds after running ``code``."""
    probe = f"{code}\nimport sys\nprint('imported:', *(m for m in {HEAVY!r} if m in sys.modules))"
    command = [sys.executable, "-c", probe]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=True)
    last = done.stdout.splitlines()[-1].split()
    assert last[0] == "imported:", done.stdout[-500:]
    return set(last[1:])


def test_the_probe_sees_vllm_when_it_is_imported():
    """Failing control: the allocator's module does import vLLM (and torch)."""
    assert imported_after("import sim.kv_cache_manager") >= {"vllm", "torch"}
    assert "pandas" in imported_after("import sim.results")


def test_building_the_command_line_imports_no_vllm():
    assert imported_after("from sim.cli import build_parser; build_parser()") == set()


@pytest.mark.parametrize("args", [["--help"], ["plot", "--help"], ["conform", "--help"]])
def test_help_imports_no_vllm(args):
    code = f"from sim.cli import main\ntry:\n    main({args!r})\nexcept SystemExit:\n    pass"
    assert imported_after(code) == set()


@pytest.mark.parametrize("command", ["gate", "sweep", "plot", "validate", "calibrate"])
def test_a_commands_help_imports_no_pandas(command):
    """The commands that print frames import pandas where they run, not
    when the parser is built."""
    code = f"from sim.cli import main\ntry:\n    main([{command!r}, '--help'])\nexcept SystemExit:\n    pass"
    assert "pandas" not in imported_after(code)


def test_plot_imports_no_vllm(tmp_path):
    """A results directory made here; plotting it in a fresh process."""
    workload = {
        "trace": "synthetic",
        "num_requests": 3,
        "arrival": {"process": "poisson", "rate_per_s": 5.0},
        "prompt": {"distribution": "fixed", "tokens": 500},
        "output": {"distribution": "fixed", "tokens": 5},
    }
    out = tmp_path / "results"
    assert main(["run", str(write_scenario(tmp_path, workload=workload)), "--out", str(out)]) == 0
    code = f"from sim.cli import main\nassert main(['plot', {str(out)!r}, '--format', 'png']) == 0"
    assert imported_after(code) == {"pandas"}
