"""Multi-turn agent sessions: a closed-loop workload.

No twin in vLLM (its benchmarks send open-loop traffic). The shape is the
fork's agent bench (``halt95/qwen38-flash-next-3090s``, a bench card's
"Eight concurrent agent conversations"): every session starts with one
shared system/tool prefix and a history of its own; each turn's reply and a
new tool result are appended to the history, and the next turn is sent a
think time after the previous one ends. So, with ``prefix`` the shared
tokens, ``h0`` the first history, ``reply_k`` turn k's output and
``tool_k`` the tool result sent with turn k::

    prompt_0     = prefix + h0
    prompt_(n+1) = prompt_n + reply_n + tool_(n+1)
    arrival_(n+1) = end of turn n + think_(n+1)        (closed loop)

A session ends before a prompt would exceed ``max_context_tokens`` (or
after ``max_turns`` turns). Each turn's tokens are a prefix of the next
turn's (content ids position by position, see ``sim.workloads.spec``), so
a follow-up can hit the cache on everything its session sent before. The
reply enters the next prompt as prompt tokens: they are not the ids the
simulated model generated, so they never hit the cache (docs/fidelity.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.workloads.distributions import LengthDistribution
from sim.workloads.spec import (
    MAX_WORKLOAD_REQUESTS,
    FreshIds,
    Workload,
    WorkloadRequest,
    ceil_div,
    sort_requests,
)
from sim.workloads.synthetic import shared_ids


@dataclass(frozen=True, kw_only=True)
class SessionShape:
    """How sessions are drawn (validated by ``SessionsConfig``)."""

    num_sessions: int
    shared_prefix_tokens: int
    first_history: LengthDistribution
    reply: LengthDistribution
    tool_result: LengthDistribution
    think_s: tuple[float, float]
    start_spread_s: float
    max_context_tokens: int
    max_turns: int
    prefix_unit: int


class History:
    """A session's tokens so far as content ids, growing at the end: new
    tokens first fill the last (partial) chunk, so every earlier prompt is
    a token prefix of every later one.

    >>> h = History((0,), 4, FreshIds(100)); h.append(6); h.ids, h.num_tokens
    ((0, 100, 101), 10)
    >>> h.append(1); h.ids, h.num_tokens
    ((0, 100, 101), 11)
    """

    def __init__(self, prefix_ids: tuple[int, ...], prefix_unit: int, fresh: FreshIds) -> None:
        self.unit = prefix_unit
        self.ids = prefix_ids
        self.num_tokens = len(prefix_ids) * prefix_unit
        self.fresh = fresh

    def append(self, num_tokens: int) -> None:
        room = len(self.ids) * self.unit - self.num_tokens
        self.num_tokens += num_tokens
        self.ids += self.fresh.take(ceil_div(max(num_tokens - room, 0), self.unit))


def _session_id(session: int, turn: int) -> str:
    """``s`` session ``t`` turn, zero-padded: ids sort session by session,
    turn by turn (so a zero think time keeps a turn after its predecessor).

    >>> _session_id(3, 12)
    's003t0012'
    """
    return f"s{session:03d}t{turn:04d}"


def _one_session(
    session: int, shape: SessionShape, rng: np.random.Generator, fresh: FreshIds
) -> list[WorkloadRequest]:
    """One session's turns. Draw order, fixed: start, first history, then
    per turn its reply, and (for the next turn) its tool result and think time."""
    history = History(shared_ids(shape.shared_prefix_tokens, shape.prefix_unit), shape.prefix_unit, fresh)
    arrival_s = float(rng.uniform(0.0, shape.start_spread_s)) if shape.start_spread_s else 0.0
    history.append(int(shape.first_history.sample(1, rng)[0]))
    turns: list[WorkloadRequest] = []
    think_s = 0.0
    while history.num_tokens <= shape.max_context_tokens and len(turns) < shape.max_turns:
        reply = int(shape.reply.sample(1, rng)[0])
        turns.append(
            WorkloadRequest(
                request_id=_session_id(session, len(turns)),
                arrival_s=arrival_s,
                prompt_len=history.num_tokens,
                output_len=reply,
                prefix_ids=history.ids[: ceil_div(history.num_tokens, shape.prefix_unit)],
                prefix_unit=shape.prefix_unit,
                follows=turns[-1].request_id if turns else None,
                think_s=think_s,
                turn=len(turns),
            )
        )
        history.append(reply + int(shape.tool_result.sample(1, rng)[0]))
        think_s = float(rng.uniform(*shape.think_s))
        arrival_s += think_s
    return turns


def agent_sessions(
    shape: SessionShape, rng: np.random.Generator, *, until_s: float | None, name: str = "sessions"
) -> Workload:
    """``shape.num_sessions`` sessions, each drawn from its own stream
    spawned from ``rng`` (a session's draws never shift another's); no
    follow-up arrives after ``until_s``."""
    requests: list[WorkloadRequest] = []
    fresh = FreshIds()  # one counter: no chunk of one session is another's
    for session, stream in enumerate(rng.spawn(shape.num_sessions)):
        requests += _one_session(session, shape, stream, fresh)
        if len(requests) > MAX_WORKLOAD_REQUESTS:
            raise ValueError(f"max_turns: more than {MAX_WORKLOAD_REQUESTS:,} turns in all")
    if not requests:
        raise ValueError(
            f"max_context_tokens: {shape.max_context_tokens} leaves no turn (first prompts are longer)"
        )
    return Workload(
        name=name,
        source=f"sessions: {shape.num_sessions} sessions, prefix {shape.shared_prefix_tokens} shared + "
        f"history {shape.first_history!r}, reply {shape.reply!r}, tool result {shape.tool_result!r}, "
        f"think {shape.think_s} s, up to {shape.max_context_tokens} tokens",
        requests=sort_requests(requests),
        follow_ups_until_s=until_s,
    )
