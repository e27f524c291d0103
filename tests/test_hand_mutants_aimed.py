"""Every hand mutant still aims (issue 42e): its patches' old texts occur
exactly once in its file, so a refactor that moves a rule's code cannot leave
a mutant silently "not applied"; and every test id it runs exists. No mutant
runs here."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():
    if "hand_mutants" in sys.modules:
        return sys.modules["hand_mutants"]
    spec = importlib.util.spec_from_file_location("hand_mutants", ROOT / "scripts" / "hand_mutants.py")
    module = importlib.util.module_from_spec(spec)
    # dataclasses look the defining module up by name while building Mutant.
    sys.modules["hand_mutants"] = module
    spec.loader.exec_module(module)
    return module


def _misaimed(script, mutants) -> list[str]:
    return [
        f"{mutant.name}: {count} matches in {mutant.path}"
        for mutant in mutants
        for _, count in [script.mutate(mutant, (ROOT / mutant.path).read_text())]
        if count != 1
    ]


def test_every_hand_mutant_patches_text_that_occurs_exactly_once():
    script = _script()
    assert _misaimed(script, script.MUTANTS) == []


def test_control_a_mutant_whose_old_text_is_gone_or_repeated_is_reported():
    script = _script()
    aimed = script.MUTANTS[0]
    gone = dataclasses.replace(aimed, name="gone", old="text no module holds \x00")
    repeated = dataclasses.replace(aimed, name="repeated", old="\n")
    stale_also = dataclasses.replace(aimed, name="stale-also", also=(("text no module holds \x00", ""),))
    assert _misaimed(script, (aimed, gone, repeated, stale_also)) == [
        f"gone: 0 matches in {aimed.path}",
        f"repeated: {(ROOT / aimed.path).read_text().count(chr(10))} matches in {aimed.path}",
        f"stale-also: 0 matches in {aimed.path}",
    ]


def _unknown_tests(mutants) -> list[str]:
    """Test ids whose file, or whose function in it, is gone (a mutant run
    against them would fail to collect: a false kill)."""
    unknown = []
    for test in sorted({test for mutant in mutants for test in mutant.tests}):
        path, _, function = test.partition("::")
        source = ROOT / path
        if not source.is_file() or (function and f"def {function.split('[')[0]}(" not in source.read_text()):
            unknown.append(test)
    return unknown


def test_every_hand_mutant_runs_tests_that_exist():
    assert _unknown_tests(_script().MUTANTS) == []


def test_control_a_mutant_naming_a_gone_test_is_reported():
    aimed = _script().MUTANTS[0]
    gone = ("tests/test_fast_path.py::test_no_such_test[x]", "tests/test_no_such_file.py")
    assert _unknown_tests((dataclasses.replace(aimed, tests=(*aimed.tests, *gone)),)) == sorted(gone)
