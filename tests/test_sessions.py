"""Multi-turn agent sessions (issue 20 item 6): the closed-loop workload,
its follow-up metrics, and ``kvsim patches`` (item 7).

Expected values are derived by hand in each docstring: turn n's prompt is
the shared prefix plus the session's history (first history, then each
reply and tool result), a follow-up arrives its think time after the turn
before it finishes, and the follow-up figures count turns >= 1 only.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers.scenarios import HAND_STEP_TIME, scenario, write_scenario

from sim.analysis.frames import followup_figures
from sim.analysis.patches import SHIPPED_ROW, UPSTREAM_ROW, markdown_table, off_row, patch_table
from sim.analysis.runs import run_scenario, scenario_workload
from sim.cli import main
from sim.config import validate
from sim.fork.patches import ForkPatches
from sim.workloads.config import WorkloadConfig, build_workload


def _sessions(**changes) -> dict:
    """One session: prefix 128, history 100, reply 10, tool result 30, think 1 s."""
    section = {
        "num_sessions": 1,
        "first_history": {"distribution": "fixed", "tokens": 100},
        "reply": {"distribution": "fixed", "tokens": 10},
        "tool_result": {"distribution": "fixed", "tokens": 30},
        "think_s": [1.0, 1.0],
        "max_context_tokens": 400,
    }
    return {
        "trace": "sessions",
        "shared_prefix_tokens": 128,
        "prefix_unit": 64,
        "sessions": section | changes,
    }


def _build(workload: dict, seed: int = 0):
    return build_workload(validate(WorkloadConfig, workload, "s.yaml"), base_dir=Path("."), seed=seed)


# ------------------------------------------------------------ the workload
def test_turn_n_prompt_is_the_prefix_plus_the_history_so_far():
    """prompt_0 = 128 + 100 = 228; each turn adds the reply (10) and a tool
    result (30): 268, 308, 348, 388; the next (428) passes the 400 cap, so
    the session has 5 turns, each following the one before."""
    requests = _build(_sessions()).requests
    assert [r.prompt_len for r in requests] == [228, 268, 308, 348, 388]
    assert [r.output_len for r in requests] == [10] * 5
    assert [r.turn for r in requests] == [0, 1, 2, 3, 4]
    assert [r.follows for r in requests] == [None, *(r.request_id for r in requests[:-1])]
    assert [r.think_s for r in requests] == [0.0, 1.0, 1.0, 1.0, 1.0]


def test_every_turn_is_a_token_prefix_of_the_next_and_sessions_share_only_the_prefix():
    requests = _build(_sessions(num_sessions=2)).requests
    by_session: dict[str, list] = {}
    for r in requests:
        by_session.setdefault(r.request_id[:4], []).append(r.prompt_token_ids())
    for turns in by_session.values():
        for before, after in zip(turns, turns[1:], strict=False):
            assert after[: len(before)] == before
    first, second = (turns[0] for turns in by_session.values())
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert shared == 128  # the shared prefix, and not one token more


def test_control_without_the_history_rule_the_prompts_would_not_grow():
    """Control: a reply and tool result of 1 token each grow the prompt by 2
    a turn, not 40: the lengths follow the drawn sizes."""
    tiny = _sessions(
        reply={"distribution": "fixed", "tokens": 1}, tool_result={"distribution": "fixed", "tokens": 1}
    )
    assert [r.prompt_len for r in _build(tiny).requests][:3] == [228, 230, 232]


def test_the_workload_is_deterministic_per_seed():
    drawn = _sessions(
        num_sessions=3,
        first_history={"distribution": "uniform", "lo": 100, "hi": 900},
        think_s=[0.5, 3.0],
        start_spread_s=5.0,
        max_context_tokens=5000,
    )
    assert _build(drawn, seed=7) == _build(drawn, seed=7)
    assert _build(drawn, seed=7).requests != _build(drawn, seed=8).requests


@pytest.mark.parametrize(
    "workload, key",
    [
        (_sessions(bogus=1), "bogus"),
        ({**_sessions(), "window_s": [0, 10]}, "window_s"),
        ({**_sessions(), "num_requests": 5}, "num_requests"),
        ({"trace": "default", "sessions": _sessions()["sessions"]}, "sessions"),
        ({"trace": "sessions"}, "sessions"),
        (_sessions(think_s=[3.0, 1.0]), "think_s"),
    ],
)  # fmt: skip
def test_a_bad_sessions_key_is_one_line_naming_it_exit_2(tmp_path, capsys, workload, key):
    path = write_scenario(tmp_path, "bad", workload=workload)
    assert main(["run", str(path), "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and key in error and error.startswith("kvsim: error: ")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------- the closed loop
def _hand_run(tmp_path, **changes):
    """The engine timeline's hand clock (step = 0.2 s + 1 ms per token), no
    MTP acceptance; one session of 7,000 / 7,300 / 7,600-token prompts, one
    output token each, think time 2 s."""
    workload = _sessions(
        first_history={"distribution": "fixed", "tokens": 7000},
        reply={"distribution": "fixed", "tokens": 1},
        tool_result={"distribution": "fixed", "tokens": 299},
        think_s=[2.0, 2.0],
        max_context_tokens=7700,
        **changes,
    )
    workload.update(shared_prefix_tokens=0, prefix_unit=16)
    sc = scenario(
        tmp_path,
        workload=workload,
        mtp={"acceptance_rates": [0.0, 0.0, 0.0]},
        simulation={"sample_interval_s": None, "check_invariants": True},
        step_time=HAND_STEP_TIME,
    )
    return sc, run_scenario(sc, ("off",))


def test_a_follow_up_arrives_its_think_time_after_the_turn_before_finishes(tmp_path):
    """Closed loop: turn n+1 arrives at turn n's finish + 2 s, whenever that
    is; turn 0's prefill (7,000 tokens) takes 0.2 s per step plus 7 s, so
    turn 1 cannot arrive before 9.2 s, far past the workload's open-loop
    lower bound (2 s: turn 0's arrival + think)."""
    sc, result = _hand_run(tmp_path)
    requests = result.requests.set_index("request_id").sort_index()
    assert requests["prompt_tokens"].tolist() == [7000, 7300, 7600]
    finished = requests["finished_s"].tolist()
    assert requests["arrival_s"].tolist()[1:] == pytest.approx(
        [finished[0] + 2.0, finished[1] + 2.0], abs=1e-9
    )
    assert requests["arrival_s"].iloc[1] >= 9.2
    lower_bounds = [r.arrival_s for r in scenario_workload(sc).requests]
    assert lower_bounds == [0.0, 2.0, 4.0]  # control: what an open loop would send
    assert run_scenario(sc, ("off",)).requests.equals(result.requests)  # deterministic


def test_no_follow_up_arrives_after_the_sessions_duration(tmp_path):
    """``duration_s`` 5: turn 1 would arrive past 9.2 s, so it and turn 2
    never come; the run ends (not stalled) with turn 0 alone."""
    _, result = _hand_run(tmp_path, duration_s=5.0)
    assert result.requests["request_id"].tolist() == ["s000t0000"]
    assert not result.summary["stalled"].iloc[0]


# ------------------------------------------------------------ the figures
def _frame() -> pd.DataFrame:
    """A first turn (TTFT 9, 0 reused of 1,000) and three follow-ups: TTFTs
    1, 2 and 4 s; reused 900 of 1,100, 1,000 of 1,200 and (never admitted)
    0 of 1,300; the third follow-up never finished."""
    return pd.DataFrame(
        {
            "turn": [0, 1, 2, 3],
            "ttft_s": [9.0, 1.0, 2.0, np.nan],
            "finished": [True, True, True, False],
            "admitted": [True, True, True, False],
            "prompt_tokens": [1000, 1100, 1200, 1300],
            "prefix_hit_tokens": [0, 900, 1000, 0],
        }
    )


def test_follow_up_figures_count_turns_after_the_first():
    """3 follow-ups arrived; TTFT over the finished ones (1, 2): median 1.5,
    p90 1 + 0.9 * (2 - 1) = 1.9; reuse over the admitted ones: 1,900 of
    2,300 tokens."""
    figures = followup_figures(_frame())
    assert figures["num_followups"] == 3
    assert figures["followup_ttft_p50_s"] == pytest.approx(1.5)
    assert figures["followup_ttft_p90_s"] == pytest.approx(1.9)
    assert figures["followup_reused_tokens"] == 1900
    assert figures["followup_prefix_hit_rate"] == pytest.approx(1900 / 2300)


def test_control_counting_the_first_turn_changes_both_figures():
    """FAILING CONTROL: relabel the first turn a follow-up and the median TTFT
    becomes 2 (of 1, 2, 9) and reuse 1,900 of 3,300: the figures do exclude it."""
    frame = _frame()
    frame.loc[0, "turn"] = 1
    figures = followup_figures(frame)
    assert figures["followup_ttft_p50_s"] == pytest.approx(2.0)
    assert figures["followup_prefix_hit_rate"] == pytest.approx(1900 / 3300)


def test_a_run_reports_the_follow_up_figures_of_its_frame(tmp_path):
    """The hand run's summary: 2 follow-ups, their TTFTs and hits as the
    requests frame stamps them, and a KV peak between 0 and 1."""
    _, result = _hand_run(tmp_path)
    summary = result.summary.iloc[0]
    follow = result.requests[result.requests["turn"] > 0]
    assert summary["num_followups"] == 2
    assert summary["followup_ttft_p50_s"] == pytest.approx(follow["ttft_s"].median())
    reuse = follow["prefix_hit_tokens"].sum() / follow["prompt_tokens"].sum()
    assert summary["followup_prefix_hit_rate"] == pytest.approx(reuse) and reuse > 0
    assert 0 < summary["peak_kv_cache_usage_perc"] <= 1


def test_an_open_loop_run_has_no_follow_ups(tmp_path):
    _, result = _hand_run(tmp_path, max_turns=1)
    summary = result.summary.iloc[0]
    assert summary["num_followups"] == 0 and math.isnan(summary["followup_ttft_p50_s"])


# ------------------------------------------------------------ kvsim patches
def test_patches_has_a_row_per_patch_and_a_patch_off_row_equals_that_fork_key_false(tmp_path):
    sc, _ = _hand_run(tmp_path, max_turns=2)
    table = patch_table(sc, "off")
    names = ForkPatches.names()
    assert table.index.tolist() == [SHIPPED_ROW, *(off_row(n) for n in names), UPSTREAM_ROW]
    path = write_scenario(tmp_path, "hand", **_scenario_sections(sc))
    for name in names:
        from sim.scenario import load_scenario

        switched = load_scenario(str(path), [f"fork.{name}=false"])
        row = run_scenario(switched, ("off",)).summary.iloc[0]
        for column in table.columns:
            assert table.loc[off_row(name), column] == pytest.approx(row[column], nan_ok=True)
    assert markdown_table(table).count("\n") == len(table) + 1


def _scenario_sections(sc) -> dict:
    data = sc.model_dump(mode="json", exclude={"name", "base_dir", "model"})
    return data


@pytest.mark.parametrize("command", ["export-trace", "replay"])
def test_commands_that_send_at_fixed_times_refuse_a_closed_loop_workload(tmp_path, capsys, command):
    path = write_scenario(tmp_path, "loop", workload=_sessions())
    extra = ["--layout", "on", "--url", "http://127.0.0.1:9"] if command == "replay" else []
    assert main([command, str(path), "--out", str(tmp_path / "out"), *extra]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "closed loop" in error
    assert not (tmp_path / "out").exists()
