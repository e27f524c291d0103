"""Frames before and after a refactor must be equal: save every gate
scenario's, the main job's (agent-sessions), chat-slice's and
saturated-decode's frames (both layouts; each in both engine modes, with the
fast path on and off) with one checkout, compare them with another.

    PYTHONPATH=$PWD python tests/helpers/reference_frames.py save /tmp/ref8
    PYTHONPATH=$PWD python tests/helpers/reference_frames.py compare /tmp/ref8

``compare`` checks values and dtypes column by column, ignoring column
order (a refactor may reorder columns; it must document that), and exits 1
on any difference. Not collected by pytest (a full run takes minutes).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from sim.analysis.gates import load_gates
from sim.analysis.runs import run_scenario
from sim.paths import SCENARIOS_DIR
from sim.scenario import Scenario, load_scenario

GATES = SCENARIOS_DIR / "gates.yaml"


VARIANTS = {
    f"{mode}{'' if fast else '-step-by-step'}": [
        f"engine.mode={mode}",
        f"simulation.fast_path={str(fast).lower()}",
    ]
    for mode in ("sync", "async")
    for fast in (True, False)
}


def reference_scenarios() -> dict[str, Scenario]:
    gates = load_gates(GATES)
    bases = {}
    for name, gate in gates.gates.items():
        local = GATES.parent / gate.scenario
        bases[name] = (str(local) if local.exists() else gate.scenario, list(gate.set))
    for name in ("chat-slice", "agent-sessions", "saturated-decode"):
        bases[name] = (name, [])
    return {
        f"{name}.{variant}": load_scenario(path, overrides + variant_overrides)
        for name, (path, overrides) in bases.items()
        for variant, variant_overrides in VARIANTS.items()
    }


def scenario_frames(scenario: Scenario) -> dict[str, pd.DataFrame]:
    return run_scenario(scenario, ("off", "on")).frames()


def save(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, scenario in reference_scenarios().items():
        for kind, frame in scenario_frames(scenario).items():
            frame.to_parquet(out_dir / f"{name}.{kind}.parquet")
        print(f"saved {name}", flush=True)


def differences(before: pd.DataFrame, after: pd.DataFrame) -> list[str]:
    found = []
    if set(before.columns) != set(after.columns):
        found.append(
            f"columns: only before {sorted(set(before.columns) - set(after.columns))}, "
            f"only after {sorted(set(after.columns) - set(before.columns))}"
        )
    if list(before.columns) != list(after.columns):
        found.append("(note) column order differs")
    common = [c for c in before.columns if c in after.columns]
    try:
        pd.testing.assert_frame_equal(before[common], after[common], check_exact=True)
    except AssertionError as error:
        found.append(str(error))
    return found


def compare(ref_dir: Path) -> int:
    failed = 0
    for name, scenario in reference_scenarios().items():
        for kind, after in scenario_frames(scenario).items():
            before = pd.read_parquet(ref_dir / f"{name}.{kind}.parquet")
            after = pd.read_parquet(_roundtrip(after))
            found = differences(before, after)
            hard = [f for f in found if not f.startswith("(note)")]
            failed += bool(hard)
            print(f"{name}.{kind}: {'DIFFERENT' if hard else 'equal'} {' '.join(found)}", flush=True)
    return 1 if failed else 0


def _roundtrip(frame: pd.DataFrame) -> Path:
    """Through parquet, as the reference went, so dtypes compare like for like."""
    import tempfile

    path = Path(tempfile.mkdtemp()) / "frame.parquet"
    frame.to_parquet(path)
    return path


if __name__ == "__main__":
    action, directory = sys.argv[1], Path(sys.argv[2])
    if action == "save":
        save(directory)
    else:
        sys.exit(compare(directory))
