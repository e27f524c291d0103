"""The golden-frame gate: kvsim's fork mode takes the fork's own steps.

``tests/data/fork-golden/`` holds the steps the fork's own Scheduler took
(vLLM 0.30.0 with the scheduler-side sections of the fork's v2.5.1 combined
diff, built and run by ``kvsim conform --fork``; re-recorded with
``scripts/record-fork-golden.sh FORK``): figures the fork produced, not its
code. Each recording is replayed here on kvsim alone, with the recording's
own step times, and every step must be identical: scheduled tokens,
admissions, preemptions, finishes, queues, free blocks, prefix queries and
hits, waiter pins, graces, retained checkpoints, fenced blocks.

Failing controls: each modelled fork patch turned off in turn leaves the
golden frames at a step found by the comparison with them (not by kvsim),
and a golden file with one step changed is caught.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
from pathlib import Path

import pytest

from sim.commands.conform import _print_difference
from sim.conformance.backends import FORK_STATE_TWINS, fork_state_twins
from sim.conformance.driver import compare
from sim.conformance.golden import (
    GoldenFrames,
    first_difference,
    kvsim_against_golden,
    read_golden,
)
from sim.fork.patches import ForkPatches
from sim.paths import PROJECT_ROOT

GOLDEN = Path(__file__).resolve().parent / "data" / "fork-golden"
FILES = sorted(GOLDEN.glob("*.jsonl.gz"))
_RUNS: dict[Path, tuple[GoldenFrames, object]] = {}


def _replayed(path: Path) -> tuple[GoldenFrames, object]:
    golden = read_golden(path)
    return golden, kvsim_against_golden(golden)


def _fork_columns(golden: GoldenFrames) -> list[dict]:
    return [dict(step["fork_state"]) for step in golden.steps]


def test_the_golden_frames_are_there():
    names = {path.name for path in FILES}
    for shape in ("fork-mooncake", "agent-sessions-150s", "heavy-preemption", "long-chunked", "prefix-hits"):
        for layout in ("on", "off"):
            assert f"{shape}-{layout}.jsonl.gz" in names
    assert {"fork-mooncake-8seqs-on.jsonl.gz", "heavy-preemption-nocache-on.jsonl.gz"} <= names
    # The rig's engine: the fork's own batch queue over its AsyncScheduler.
    assert {"agent-sessions-150s-async-on.jsonl.gz", "agent-sessions-150s-async-off.jsonl.gz"} <= names
    assert "heavy-preemption-async-on.jsonl.gz" in names
    # v2.5.0 as the card ran it, the whole agent bench (its preemption loop).
    assert "agent-sessions-v250-seed1-async-on.jsonl.gz" in names


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name.removesuffix(".jsonl.gz"))
def test_kvsim_takes_every_step_the_fork_took(path):
    golden, trajectory = _replayed(path)
    difference = first_difference(golden, trajectory)
    assert difference is None, (difference.step, difference.columns)
    assert len(golden.steps) == golden.header["steps"] > 0


def _total(golden: GoldenFrames, column: str) -> int:
    return sum(len(step[column]) for step in golden.steps)


def test_the_recordings_exercise_the_forks_rules():
    """Read off the fork's frames alone: the gate is about something."""
    mooncake = read_golden(GOLDEN / "fork-mooncake-on.jsonl.gz")
    columns = _fork_columns(mooncake)
    assert max(len(c["graces"]) for c in columns) == 16  # 0097's bound reached
    assert max(len(c["pinned_waiters"]) for c in columns) >= 3  # 0095/0096
    assert max(max(c["retained"]) for c in columns) >= 2  # 0086
    sessions = read_golden(GOLDEN / "agent-sessions-150s-on.jsonl.gz")
    assert sum(step["prefix_cache_hits_tokens"] for step in sessions.steps) > 200_000  # sub-block hits
    preemption = read_golden(GOLDEN / "heavy-preemption-on.jsonl.gz")
    assert _total(preemption, "preempted") >= 5 and _total(preemption, "resumed") >= 5


def test_the_forks_own_v250_scheduler_loops_on_one_request():
    """docs/agent-bench.md ("v2.5.0's preemptions"): on seed 1 kvsim's v2.5.0
    preempts one follow-up 12 times in the last seconds. The fork's own
    scheduler, run with v2.5.0's settings (pins off, a 4,096-token unit),
    does the same, read off its frames alone (the replay above checks kvsim
    takes each of those steps): 12 preemptions, all of one request, each
    resumed on the same hit, with no pin or grace anywhere in the run."""
    golden = read_golden(GOLDEN / "agent-sessions-v250-seed1-async-on.jsonl.gz")
    assert golden.header["scenario"]["deployment"]["prefix_match_unit"] == 4096
    preempted = [(step["time_s"], rid) for step in golden.steps for rid in step["preempted"]]
    assert len(preempted) == 12 and {rid for _, rid in preempted} == {"s002t0010"}
    assert min(time_s for time_s, _ in preempted) > 285
    resumed_at = {
        computed
        for step in golden.steps
        if "s002t0010" in step["resumed"]
        for rid, computed, _, _ in step["scheduled_tokens"]
        if rid == "s002t0010"
    }
    assert resumed_at == {110_592}  # 27 blocks of 4,096: the same hit every time
    columns = _fork_columns(golden)
    assert not any(c["pinned_waiters"] or c["graces"] for c in columns)
    # CONTROL: with 0095/0096's waiter pins (v2.5.1's), kvsim leaves these
    # frames at step 86, where the fork's own scheduler with its pins on
    # pinned its first five waiters on the same run.
    difference = first_difference(golden, kvsim_against_golden(golden, ("fork.waiter_pins=true",)))
    assert difference is not None and difference.step == 86
    assert len(dict(difference.kvsim["fork_state"])["pinned_waiters"]) == 5


# --------------------------------------------------------------- controls
def _first_step_where(golden: GoldenFrames, shows) -> int:
    """The first step (1-based) at which the fork's frames show ``shows``."""
    return next(i for i, column in enumerate(_fork_columns(golden), start=1) if shows(column))


# Each patch off, on a recording where the fork's frames show it at work,
# and the step the comparison must stop at, read off those frames: the
# first step a grace or a waiter pin exists (nothing differs before it), or
# (retention, whose admission reserve may part the schedules sooner) at
# the latest the first step a checkpoint is retained. 0023 (deferred-free
# eviction order) orders blocks freed behind a fence: stepped one call at a
# time every request's fence passes with its own step, so only the batch
# queue's recording reaches it, at the latest where the fork's frames first
# hold fenced blocks of a request.
CONTROLS = {
    "grace_pins": ("fork-mooncake-on", lambda c: bool(c["graces"]), "exactly"),
    "waiter_pins": ("fork-mooncake-on", lambda c: bool(c["pinned_waiters"]), "exactly"),
    "mamba_retain_checkpoint": ("heavy-preemption-on", lambda c: any(c["retained"]), "at the latest"),
    "mamba_hold_partial_tail": ("agent-sessions-150s-on", None, None),
    # The first step schedules a lone 38,788-token prompt: the fork's base
    # caps it at the 4,096-token threshold (one 3,200-token block).
    "threshold_caps_lone_request": ("long-chunked-on", None, "step 1"),
    "caches_at_allocation_only": ("heavy-preemption-on", None, None),
    "deferred_free_eviction_order": ("heavy-preemption-async-on", None, None),
}


# The patch numbers of the pins, from docs/fork-patches.md: a difference in
# their fork state must point at the twin of that patch.
PIN_PATCHES = {"grace_pins": "0097", "waiter_pins": "0095"}


def test_every_modelled_patch_has_a_control():
    assert set(CONTROLS) == set(ForkPatches.names())


@pytest.mark.parametrize("patch", sorted(CONTROLS))
def test_a_patch_turned_off_leaves_the_golden_frames(patch):
    name, shows, how = CONTROLS[patch]
    golden = read_golden(GOLDEN / f"{name}.jsonl.gz")
    trajectory = kvsim_against_golden(golden, (f"fork.{patch}=false",))
    difference = first_difference(golden, trajectory)
    assert difference is not None, f"fork.{patch}=false still takes the fork's steps"
    if how == "exactly":
        assert difference.step == _first_step_where(golden, shows)
        assert "fork_state" in difference.columns
        twins = fork_state_twins(difference.kvsim["fork_state"], difference.fork["fork_state"])
        assert any("sim/fork/pins.py" in twin and PIN_PATCHES[patch] in twin for twin in twins), twins
    elif how == "at the latest":
        assert difference.step <= _first_step_where(golden, shows)
    elif how == "step 1":
        assert difference.step == 1 and golden.steps[0]["scheduled_tokens"][0][2] == 3200
    else:
        assert 1 <= difference.step <= len(golden.steps)


def test_a_golden_file_with_one_step_changed_is_caught(tmp_path):
    """The reference can fail: one more free block at one step of the fork's
    recording, and the comparison names that step and that column."""
    source = GOLDEN / "prefix-hits-on.jsonl.gz"
    with gzip.open(source, "rt") as lines:
        records = [json.loads(line) for line in lines]
    records[30]["num_free_blocks"] += 1  # step 30 (the header is line 0)
    changed = tmp_path / "changed.jsonl.gz"
    with gzip.open(changed, "wt") as out:
        out.write("\n".join(json.dumps(r) for r in records) + "\n")
    golden = read_golden(changed)
    difference = first_difference(golden, kvsim_against_golden(golden))
    assert difference is not None and difference.step == 30
    assert difference.columns == ("num_free_blocks",)


def test_a_truncated_golden_file_is_refused(tmp_path):
    source = GOLDEN / "prefix-hits-on.jsonl.gz"
    with gzip.open(source, "rt") as lines:
        kept = lines.readlines()[:10]
    truncated = tmp_path / "truncated.jsonl.gz"
    with gzip.open(truncated, "wt") as out:
        out.writelines(kept)
    with pytest.raises(ValueError, match="not a complete golden-frames file"):
        read_golden(truncated)


def test_kvsim_reports_the_fork_columns_in_the_forks_shape():
    golden, trajectory = _replayed(GOLDEN / "prefix-hits-on.jsonl.gz")
    state = trajectory.steps[0]
    assert dataclasses.asdict(state)["fork_state"] is not None
    assert [key for key, _ in state.fork_state] == [key for key, _ in golden.steps[0]["fork_state"]]
    # Every fork-state column points at a twin that exists.
    assert set(FORK_STATE_TWINS) == {key for key, _ in state.fork_state}
    for twin in FORK_STATE_TWINS.values():
        paths = re.findall(r"sim/fork/\w+\.py", twin)
        assert paths and all((PROJECT_ROOT / path).is_file() for path in paths), twin


def test_a_fork_state_difference_names_its_twin(capsys):
    """``kvsim conform --fork``'s report of a difference in the fork's own
    state names the module twinning it and the patch: graces off against
    kvsim as shipped (the fork's side here) part at the first grace (0097)."""
    golden, shipped = _replayed(GOLDEN / "fork-mooncake-on.jsonl.gz")
    no_graces = kvsim_against_golden(golden, ("fork.grace_pins=false",))
    _print_difference(compare(no_graces, shipped))
    printed = capsys.readouterr().out
    assert "fork state graces: sim/fork/pins.py, sim/fork/scheduler_pins.py (0097)" in printed
    assert "fork state retained" not in printed  # CONTROL: a column that agrees is not named


def test_retention_without_prefix_caching_leaves_the_golden_frames(monkeypatch):
    """CONTROL for the fork's rule that retention needs prefix caching (its
    MambaManager reads enable_caching): kvsim retaining all the same parts
    from the fork's recording with caching off."""
    from sim import kv_cache_manager

    golden = read_golden(GOLDEN / "heavy-preemption-nocache-on.jsonl.gz")
    assert first_difference(golden, kvsim_against_golden(golden)) is None
    monkeypatch.setattr(kv_cache_manager, "patches_with_caching", lambda fork, enable_caching: fork)
    assert first_difference(golden, kvsim_against_golden(golden)) is not None


def test_the_coverage_table_in_the_docs_is_the_recordings():
    from sim.conformance.golden import coverage_table

    doc = (Path(__file__).resolve().parents[1] / "docs" / "fork-patches.md").read_text()
    block = doc.split("<!-- golden-coverage -->\n")[1].split("<!-- /golden-coverage -->")[0]
    assert block.strip() == coverage_table(GOLDEN), "python scripts/fork_golden_table.py: into the docs"
