"""Value tests of the sessions workload's own rules (``sim/workloads/sessions.py``,
issue 41: a module mutation had never run): the history's chunk filling at
its edges, the id format, the documented draw order replayed by hand on a
second generator, the context and turn caps at the exact value where they
flip, the turn-count cap, and the workload's record.

Expected values come from the module's docstrings (the spec: prompt_0 =
prefix + h0, prompt_(n+1) = prompt_n + reply_n + tool_(n+1), the draw
order) and from numpy's own draws, never from the code under test.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from sim.workloads import sessions
from sim.workloads.distributions import Fixed, Uniform
from sim.workloads.sessions import History, SessionShape, agent_sessions
from sim.workloads.spec import FRESH_ID_BASE, FreshIds


def _shape(**changes) -> SessionShape:
    """One session: prefix 128 on a 64-token unit, history 100, reply 10,
    tool result 30, think 1 s: prompts 228, 268, 308, 348, 388, ..."""
    values: dict[str, Any] = {
        "num_sessions": 1,
        "shared_prefix_tokens": 128,
        "first_history": Fixed(tokens=100),
        "reply": Fixed(tokens=10),
        "tool_result": Fixed(tokens=30),
        "think_s": (1.0, 1.0),
        "start_spread_s": 0.0,
        "max_context_tokens": 400,
        "max_turns": 100,
        "prefix_unit": 64,
    }
    return SessionShape(**(values | changes))


def _requests(shape: SessionShape, seed: int = 0, until_s: float | None = None):
    return agent_sessions(shape, np.random.default_rng(seed), until_s=until_s).requests


# ------------------------------------------------------------ the history
@pytest.mark.parametrize(
    "appends, ids_added, tokens",
    [
        # prefix (0,) on a 4-token unit: 4 tokens, no room in the last chunk.
        ((4,), 1, 8),  # exactly one chunk: one id
        ((5,), 2, 9),  # one past: a second id
        ((4, 0), 1, 8),  # nothing appended: nothing taken
        ((5, 3), 2, 12),  # 3 tokens fill the 3 left in the last chunk exactly: no id
        ((5, 4), 3, 13),  # one past the room: a new id
        ((6, 1), 2, 11),  # the docstring's case
    ],
)
def test_a_history_takes_a_new_id_only_for_tokens_past_the_last_chunks_room(appends, ids_added, tokens):
    history = History((0,), 4, FreshIds(100))
    for n in appends:
        history.append(n)
    assert history.num_tokens == tokens
    assert history.ids == (0, *range(100, 100 + ids_added))
    # Every token has a chunk, and the last chunk is not empty.
    assert (len(history.ids) - 1) * 4 < history.num_tokens <= len(history.ids) * 4


def test_a_history_starts_with_its_prefix_ids_as_whole_chunks():
    history = History((0, 1, 2), 64, FreshIds(7))
    assert (history.ids, history.num_tokens, history.unit) == ((0, 1, 2), 192, 64)
    history.append(1)
    assert history.ids == (0, 1, 2, 7)


def test_session_ids_are_zero_padded_session_then_turn():
    assert sessions._session_id(0, 0) == "s000t0000"
    assert sessions._session_id(3, 12) == "s003t0012"
    assert sessions._session_id(999, 9999) == "s999t9999"


# ------------------------------------------------------------ one session
def test_each_turn_follows_the_one_before_with_the_drawn_think_time():
    """The docstring's chain: 5 turns (228 .. 388; 428 > 400 ends it), the
    first with no predecessor and no think time."""
    requests = _requests(_shape(think_s=(2.5, 2.5)))
    assert [r.request_id for r in requests] == [f"s000t000{t}" for t in range(5)]
    assert [r.prompt_len for r in requests] == [228, 268, 308, 348, 388]
    assert [r.output_len for r in requests] == [10] * 5
    assert [r.follows for r in requests] == [None, "s000t0000", "s000t0001", "s000t0002", "s000t0003"]
    assert [r.think_s for r in requests] == [0.0, 2.5, 2.5, 2.5, 2.5]
    assert [r.turn for r in requests] == [0, 1, 2, 3, 4]
    # Listed arrivals: start plus the think times so far (the engine moves
    # a follow-up to its predecessor's end plus think).
    assert [r.arrival_s for r in requests] == [0.0, 2.5, 5.0, 7.5, 10.0]


@pytest.mark.parametrize("cap, turns", [(387, 4), (388, 5), (389, 5), (228, 1), (227, 0)])
def test_a_prompt_of_exactly_max_context_tokens_is_still_sent(cap, turns):
    """Prompts 228, 268, ..., 388: a cap of 388 keeps the fifth turn, 387
    drops it; 227 leaves no turn at all (an error, below)."""
    shape = _shape(max_context_tokens=cap)
    if turns == 0:
        with pytest.raises(ValueError, match=r"^max_context_tokens: 227 leaves no turn \(first prompts"):
            _requests(shape)
    else:
        assert len(_requests(shape)) == turns


@pytest.mark.parametrize("max_turns", [1, 2, 4, 5])
def test_a_session_has_at_most_max_turns_turns(max_turns):
    """The context cap allows 5 turns; max_turns cuts it to exactly that."""
    assert len(_requests(_shape(max_turns=max_turns))) == min(max_turns, 5)


def test_each_turns_prefix_ids_cover_its_prompt_on_the_unit():
    """Turn 0: 228 tokens on a 64-token unit: ceil(228 / 64) = 4 ids, the
    prefix's two (0, 1) and two fresh; turn 1 (268 tokens) needs 5: its
    prompt's first 4 ids are turn 0's (every turn a prefix of the next)."""
    first, second = _requests(_shape())[:2]
    assert first.prefix_ids == (0, 1, FRESH_ID_BASE, FRESH_ID_BASE + 1)
    assert first.prefix_unit == second.prefix_unit == 64
    assert len(second.prefix_ids) == 5 and second.prefix_ids[:4] == first.prefix_ids


def test_the_draws_follow_the_documented_order():
    """Start, first history, then per turn: reply, tool result, think.
    Replayed by hand on a generator spawned as agent_sessions spawns it."""
    shape = _shape(
        start_spread_s=5.0,
        first_history=Uniform(lo=100, hi=200),
        reply=Uniform(lo=1, hi=50),
        tool_result=Uniform(lo=1, hi=50),
        think_s=(0.5, 3.0),
        max_context_tokens=100_000,
        max_turns=3,
    )
    (stream,) = np.random.default_rng(11).spawn(1)
    start = float(stream.uniform(0.0, 5.0))
    prompt = 128 + int(stream.integers(100, 200, endpoint=True))
    expected = []
    arrival, think = start, 0.0
    for turn in range(3):
        reply = int(stream.integers(1, 50, endpoint=True))
        expected.append((prompt, reply, arrival, think, turn))
        prompt += reply + int(stream.integers(1, 50, endpoint=True))
        think = float(stream.uniform(0.5, 3.0))
        arrival += think
    got = [(r.prompt_len, r.output_len, r.arrival_s, r.think_s, r.turn) for r in _requests(shape, seed=11)]
    assert got == expected


def test_no_start_spread_draws_nothing_for_the_start():
    """With no spread the first draw is the first history's."""
    shape = _shape(first_history=Uniform(lo=100, hi=200), max_turns=1)
    (stream,) = np.random.default_rng(5).spawn(1)
    (request,) = _requests(shape, seed=5)
    assert request.arrival_s == 0.0
    assert request.prompt_len == 128 + int(stream.integers(100, 200, endpoint=True))


# ----------------------------------------------------------- the workload
def test_sessions_draw_from_streams_of_their_own_and_fresh_ids_never_repeat():
    """Session 1's turns are the same whatever session 0 draws (its own
    spawned stream), and no fresh id is in two sessions."""
    shape = _shape(
        num_sessions=2, first_history=Uniform(lo=100, hi=300), max_context_tokens=10_000, max_turns=2
    )
    requests = _requests(shape, seed=3)
    (_, stream) = np.random.default_rng(3).spawn(2)
    s1 = [r for r in requests if r.request_id.startswith("s001")]
    assert s1[0].prompt_len == 128 + int(stream.integers(100, 300, endpoint=True))
    fresh = [
        {i for i in r.prefix_ids if i >= FRESH_ID_BASE} for r in requests if r.request_id.endswith("t0001")
    ]
    assert len(fresh) == 2 and not fresh[0] & fresh[1]


def test_the_workload_is_sorted_by_arrival_and_records_its_recipe():
    """Two sessions, think 1 s: arrivals 0, 0, 1, 1, ... sorted by (arrival,
    id); the source names every part of the recipe."""
    shape = _shape(num_sessions=2, max_turns=2)
    workload = agent_sessions(shape, np.random.default_rng(0), until_s=9.5, name="agents")
    assert [r.request_id for r in workload.requests] == ["s000t0000", "s001t0000", "s000t0001", "s001t0001"]
    assert workload.name == "agents"
    assert workload.follow_ups_until_s == 9.5
    assert workload.source == (
        "sessions: 2 sessions, prefix 128 shared + history Fixed(tokens=100), reply Fixed(tokens=10), "
        "tool result Fixed(tokens=30), think (1.0, 1.0) s, up to 400 tokens"
    )
    assert agent_sessions(shape, np.random.default_rng(0), until_s=None).name == "sessions"


@pytest.mark.parametrize("limit, fails", [(4, False), (3, True)])
def test_more_turns_than_a_workload_holds_is_refused(monkeypatch, limit, fails):
    """Two sessions of 2 turns: 4 turns in all, allowed at a limit of 4 and
    refused at 3 (after the second session, naming max_turns)."""
    monkeypatch.setattr(sessions, "MAX_WORKLOAD_REQUESTS", limit)
    shape = _shape(num_sessions=2, max_turns=2)
    if fails:
        with pytest.raises(ValueError, match=r"^max_turns: more than 3 turns in all$"):
            _requests(shape)
    else:
        assert len(_requests(shape)) == 4
