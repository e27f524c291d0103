"""The gain figure of a closed loop (issue 38): in agent sessions the layout
that finishes turns faster has fewer requests running at once, so "running,
on - off" reads as a loss where the layout helps. The figure for a closed
loop shows turns completed, the follow-up TTFT distribution, reuse and full
re-prefills, and says which layout is ahead from those figures.

The frames are made by hand (expected values by counting), each check with
a failing control: the open-loop figure on the same run says "off runs
more", which is the misreading the closed-loop figure must not make."""

from __future__ import annotations

import re

import pandas as pd
import pytest
from matplotlib.figure import Figure

from sim.analysis import plots
from sim.analysis.session_plots import ahead, closed_loop_gain_figure


def _session_requests(layout: str, finished_s: list[float], hits: list[int]) -> pd.DataFrame:
    """One session of len(finished_s) turns of 10,000 prompt tokens; turn k
    arrives when turn k-1 finishes, waits 1 s for its first token, and
    finds hits[k] tokens cached."""
    arrivals = [0.0, *finished_s[:-1]]
    return pd.DataFrame(
        {
            "scenario": "hand-sessions",
            "layout": layout,
            "turn": range(len(finished_s)),
            "arrival_s": arrivals,
            "admitted": True,
            "admitted_s": arrivals,
            "finished": True,
            "finished_s": finished_s,
            "ttft_s": 1.0 if layout == "on" else 3.0,
            "prompt_tokens": 10_000,
            "prefix_hit_tokens": hits,
        }
    )


# On finishes 5 turns in 10 s, off 3: on completes 2 more (+67 %). Off's
# three turns are long, so off runs its one request for the whole span
# while on's run idles between turns (think time): off runs more at once.
ON_COMPLETES_MORE = pd.concat(
    [
        _session_requests("off", [4.0, 7.0, 10.0], [0, 1_000, 9_000]),
        _session_requests("on", [2.0, 4.0, 6.0, 8.0, 10.0], [0, 9_500, 9_500, 9_500, 2_000]),
    ],
    ignore_index=True,
)
OFF_RUNS_MORE_AT_ONCE = pd.DataFrame(
    {
        "scenario": "hand-sessions",
        "layout": ["off"] * 4 + ["on"] * 4,
        "time_s": [1.0, 4.0, 7.0, 10.0, 1.0, 4.0, 7.0, 10.0],
        "num_requests_running": [1, 1, 1, 0, 0, 1, 0, 0],
    }
)


def _texts(fig: Figure) -> str:
    parts = [fig.get_suptitle()]
    parts += [ax.get_title(loc="left") for ax in fig.axes]
    parts += [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    return " | ".join(parts)


def test_a_closed_loop_where_on_completes_more_never_says_off_does_more():
    fig = closed_loop_gain_figure(ON_COMPLETES_MORE)
    text = _texts(fig)
    assert "on completes 2 more turns than off (5 against 3, +67 %)" in text
    assert not re.search(r"\boff (runs|completes|has) [^|]*more", text), text
    assert "closed-loop gain" in fig.get_suptitle()
    # FAILING CONTROL: the open-loop figure on the same run says off runs
    # more (its mean gain is negative): the misreading of issue 38.
    open_loop = plots.gain_figure(OFF_RUNS_MORE_AT_ONCE)
    assert "off runs more requests" in _texts(open_loop)
    assert plots.concurrency_gain(OFF_RUNS_MORE_AT_ONCE)["gain"].min() < 0


def test_the_panels_give_ttft_reuse_and_full_reprefills_by_hand():
    """TTFT 1 s (on) against 3 s (off); reuse on (0 + 3 x 9,500 + 2,000) /
    40,000 = 76.2 %, off 10,000 / 20,000 = 50.0 %; full re-prefills
    (follow-ups under 5,000 cached): on 1 (2,000), off 1 (1,000)."""
    ttft, reuse = (ax.get_title(loc="left") for ax in closed_loop_gain_figure(ON_COMPLETES_MORE).axes[1:])
    assert ttft == "follow-up TTFT: off p50 3.00 s, p90 3.0 s; on p50 1.00 s, p90 1.0 s"
    assert reuse == "reuse off 50.0 %, on 76.2 %; both layouts have 1 full re-prefills"


def test_the_standard_figures_pick_the_closed_loop_gain_for_sessions_only():
    steps = OFF_RUNS_MORE_AT_ONCE
    steps = steps.assign(**{column: 0 for column in plots.PANEL_COLUMNS if column not in steps})
    frames = {"steps": steps, "requests": ON_COMPLETES_MORE}
    assert "closed-loop" in plots.standard_figures(frames)["gain"].get_suptitle()
    # Control: the same requests as first turns only (an open loop).
    frames["requests"] = ON_COMPLETES_MORE.assign(turn=0)
    assert "open-loop" in plots.standard_figures(frames)["gain"].get_suptitle()


@pytest.mark.parametrize(
    ("counts", "kwargs", "expected"),
    [
        ({"off": 3, "on": 5}, {}, "on completes 2 more turns than off (5 against 3, +67 %)"),
        ({"off": 5, "on": 3}, {}, "off completes 2 more turns than on (5 against 3, +67 %)"),
        ({"off": 4, "on": 4}, {}, "both layouts complete 4 turns"),
        ({"off": 1, "on": 4}, {"more_is_better": False}, "off has 3 fewer turns than on (1 against 4)"),
    ],
)
def test_who_is_ahead_is_read_from_the_counts(counts, kwargs, expected):
    """Each direction in words (the second row is the control of the
    first: swapped counts name the other layout)."""
    assert ahead(counts, "turns", **kwargs) == expected
