#!/usr/bin/env python3
"""Which conformance shapes catch which vLLM-side mutant (issue 41): every
mutant of ``tests/helpers/vllm_mutants.py`` (a patched copy of one of vLLM's
Scheduler methods, on the reference's instance only) against every shape of
``scenarios/conformance/``, both layouts, both MTP hashing modes, both
engine modes; prints a markdown table of the first differing step of each
run ("-": the gates conform, the mutant passes).

    scripts/conformance_mutants.py                 every mutant and shape (about a minute)
    scripts/conformance_mutants.py budget_one_short block-budget

The tests assert the rows that matter (tests/test_conformance.py,
tests/test_async_conformance.py); this shows the whole matrix
(docs/mutation/report.md sums it up).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

MUTANTS = (
    "budget_one_short",
    "block_end_floored_one_early",
    "tail_on_the_block",
    "checkpoint_on_the_block",
    "stale_output_forgotten",
)
Layout = Literal["off", "on"]
Mode = Literal["eagle-drop", "lookahead"]
COMBOS: tuple[tuple[Layout, Mode], ...] = (
    ("off", "eagle-drop"),
    ("off", "lookahead"),
    ("on", "eagle-drop"),
    ("on", "lookahead"),
)


def first_differences(mutant_name: str, shape: str) -> tuple[list[int | None], list[int | None]]:
    """The first differing step of each (layout, mode), sync then async."""
    import pytest
    from helpers import vllm_mutants
    from helpers.scenarios import conformance_requests, conformance_shape

    from sim.conformance.async_engine import run_async_conformance
    from sim.conformance.driver import run_conformance

    patch = pytest.MonkeyPatch()
    getattr(vllm_mutants, mutant_name)().apply(patch)
    try:
        scenario, requests = conformance_shape(shape), conformance_requests(shape)
        sync = [
            run_conformance(scenario, layout, requests, mtp_hash_mode=mode).comparison.first_difference
            for layout, mode in COMBOS
        ]
        asynchronous = [
            run_async_conformance(scenario, layout, requests, mtp_hash_mode=mode).first_difference
            for layout, mode in COMBOS
        ]
    finally:
        patch.undo()
    return sync, asynchronous


def _cell(steps: list[int | None]) -> str:
    return " ".join("-" if step is None else str(step) for step in steps)


def main(argv: list[str]) -> int:
    from sim.paths import SCENARIOS_DIR

    shapes = sorted(path.stem for path in (SCENARIOS_DIR / "conformance").glob("*.yaml"))
    mutants = [a for a in argv if a in MUTANTS] or list(MUTANTS)
    shapes = [a for a in argv if a in shapes] or shapes
    combos = ", ".join(f"{layout}/{mode}" for layout, mode in COMBOS)
    print(f"First differing step per ({combos}); '-': conforms.\n")
    print("| vLLM mutant | Shape | Sync | Async |")
    print("|---|---|---|---|")
    for mutant in mutants:
        for shape in shapes:
            sync, asynchronous = first_differences(mutant, shape)
            print(f"| `{mutant}` | {shape} | {_cell(sync)} | {_cell(asynchronous)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
