"""What a workload is: requests with arrival times, lengths and prompt content.

No twin in vLLM. The nearest relatives are the request generators in vLLM's
``benchmarks/`` (ShareGPT, random prompts), which make prompts but no arrival
trace and no controlled prefix sharing.

A prompt is described by *content ids*, one per ``prefix_unit``-token chunk,
and materialised into token ids only on demand (a Mooncake hour is 145 M
prompt tokens; a workload never holds them). Chunk ``i`` with content id ``c``
holds tokens ``c * prefix_unit + j``::

    prefix_unit = 4, prefix_ids = (7, 2, 9), prompt_len = 10

    chunk:   |----- 7 -----|----- 2 -----|- 9 -|
    tokens:   28 29 30 31   8  9 10 11   36 37      (last chunk truncated)

Two prompts therefore share identical token prefixes exactly where they share
content ids position by position, and vLLM's block hashing finds the shared
blocks at any block size.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from sim.config import MAX_REQUEST_TOKENS, ConfigError

# Where fresh (never shared) content ids start. Above every id of the Mooncake
# conversation hour (dense, < 182,790), so a fresh id is never mistaken for a
# trace id, and low enough that token ids stay below 2**31 (the int32 token
# buffers of vLLM's input batch) for ~3 M fresh 512-token chunks.
FRESH_ID_BASE = 1 << 20
# Requests in one workload (a trace as loaded, or a synthetic recipe): about
# 300 MB of workload requests; slice bigger traces (window_s, sample_fraction)
# before handing them to kvsim.
MAX_WORKLOAD_REQUESTS = 1_000_000


def check_tokens(field: str, value: int) -> str | None:
    """What is wrong with a token count, or None: whole, >= 1 and at most
    ``MAX_REQUEST_TOKENS`` (no model serves a longer context)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"{field}: expected a positive integer, got {value!r}"[:120]
    if value > MAX_REQUEST_TOKENS:
        return (
            f"{field}: {value:.3g} tokens is more than {MAX_REQUEST_TOKENS:,} "
            "(no model serves a longer context)"
        )
    return None


class TraceError(ConfigError):
    """A bad trace file; ``str()`` is one line: ``path:line: what is wrong``."""

    def __init__(self, path: Path | str, line: int | None, problem: str) -> None:
        self.path = str(path)
        self.line = line
        self.problem = " ".join(problem.split())  # one line, whatever came in
        where = self.path if line is None else f"{self.path}:{line}"
        super().__init__(f"{where}: {self.problem}")

    def __reduce__(self) -> tuple[type[TraceError], tuple[str, int | None, str]]:
        return (TraceError, (self.path, self.line, self.problem))


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` in integers.

    >>> ceil_div(6758, 512), ceil_div(512, 512), ceil_div(513, 512)
    (14, 1, 2)
    """
    return -(-a // b)


def request_id(index: int) -> str:
    """``r`` + a zero-padded 0-based index, so ids sort in index order.

    >>> request_id(42)
    'r000042'
    """
    return f"r{index:06d}"


def materialise_tokens(prefix_ids: Iterable[int], prefix_unit: int, prompt_len: int) -> list[int]:
    """Token ids of a prompt: chunk ``c`` is ``c*unit .. c*unit+unit-1``, cut at
    ``prompt_len``.

    >>> materialise_tokens((7, 2, 9), 4, 10)
    [28, 29, 30, 31, 8, 9, 10, 11, 36, 37]
    """
    tokens: list[int] = []
    for content_id in prefix_ids:
        start = content_id * prefix_unit
        take = min(prefix_unit, prompt_len - len(tokens))
        tokens.extend(range(start, start + take))
    return tokens


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkloadRequest:
    """One request as the simulator will submit it.

    ``arrival_s`` is seconds from the workload start; ``output_len`` is the
    number of tokens to generate (generation is forced to stop there, as the
    Mooncake paper replays its traces). ``prefix_ids`` has exactly
    ``ceil(prompt_len / prefix_unit)`` entries.

    A follow-up turn (``follows`` set: the request id of the turn before it
    in its session) is closed-loop: it arrives ``think_s`` after that turn
    ends, whenever that is, and its ``arrival_s`` is only the earliest it
    could (the turn before's ``arrival_s`` + ``think_s``), which keeps the
    workload order. ``turn`` counts the turns before it (0: a first turn,
    or any open-loop request).
    """

    request_id: str
    arrival_s: float
    prompt_len: int
    output_len: int
    prefix_ids: tuple[int, ...]
    prefix_unit: int
    follows: str | None = None
    think_s: float = 0.0
    turn: int = 0

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id: must not be empty")
        if not (math.isfinite(self.arrival_s) and self.arrival_s >= 0):
            raise ValueError(f"arrival_s: expected >= 0, got {self.arrival_s}")
        for field in ("prompt_len", "output_len", "prefix_unit"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field}: expected >= 1, got {getattr(self, field)}")
        for field in ("prompt_len", "output_len"):
            problem = check_tokens(field, getattr(self, field))
            if problem:
                raise ValueError(problem)
        expected = ceil_div(self.prompt_len, self.prefix_unit)
        if len(self.prefix_ids) != expected:
            raise ValueError(
                f"prefix_ids: expected ceil({self.prompt_len} / {self.prefix_unit})"
                f" = {expected} ids, got {len(self.prefix_ids)}"
            )
        if min(self.prefix_ids) < 0:
            raise ValueError("prefix_ids: content ids must be >= 0")
        if not (math.isfinite(self.think_s) and self.think_s >= 0):
            raise ValueError(f"think_s: expected >= 0, got {self.think_s}")
        if (self.follows is None) != (self.turn == 0) or self.turn < 0:
            raise ValueError(f"turn: {self.turn} with follows {self.follows!r} (a follow-up has turn >= 1)")

    def prompt_token_ids(self) -> list[int]:
        """The prompt's token ids, built now (never stored: see module doc)."""
        return materialise_tokens(self.prefix_ids, self.prefix_unit, self.prompt_len)

    @property
    def max_token_id(self) -> int:
        """Largest token id of the prompt, without materialising it."""
        last = self.prompt_len - (len(self.prefix_ids) - 1) * self.prefix_unit
        full = self.prefix_ids[:-1]
        candidates = [c * self.prefix_unit + self.prefix_unit - 1 for c in full]
        candidates.append(self.prefix_ids[-1] * self.prefix_unit + last - 1)
        return max(candidates)


class FreshIds:
    """Hands out content ids no other chunk uses, counting up from ``start``.

    One counter per workload being built (never module-level), so a trace
    without prefix information gets chunks that can never produce a prefix
    hit: the no-sharing control the tests rely on.
    """

    def __init__(self, start: int = FRESH_ID_BASE) -> None:
        self._next_id = start

    def take(self, num: int) -> tuple[int, ...]:
        ids = tuple(range(self._next_id, self._next_id + num))
        self._next_id += num
        return ids


def _sort_key(request: WorkloadRequest) -> tuple[float, str]:
    return (request.arrival_s, request.request_id)


def sort_requests(requests: Iterable[WorkloadRequest]) -> tuple[WorkloadRequest, ...]:
    """The workload order: by arrival, ties broken by request id."""
    return tuple(sorted(requests, key=_sort_key))


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A named, ordered set of requests and how it was made.

    Invariants (checked on construction): requests sorted by
    ``(arrival_s, request_id)`` and request ids unique. ``source`` is a human
    description of the file and every transformation applied, in order, so a
    result can always be traced back to its input.
    """

    name: str
    source: str
    requests: tuple[WorkloadRequest, ...]
    # Closed-loop workloads (sessions): a follow-up due after this time never
    # arrives, nor do the turns after it (None: every follow-up arrives).
    follow_ups_until_s: float | None = None

    def __post_init__(self) -> None:
        keys = [_sort_key(r) for r in self.requests]
        if any(a > b for a, b in zip(keys, keys[1:], strict=False)):
            raise ValueError("requests: must be sorted by (arrival_s, request_id)")
        if len({r.request_id for r in self.requests}) != len(self.requests):
            raise ValueError("requests: request ids must be unique")
        followed = [r.follows for r in self.requests if r.follows is not None]
        if len(set(followed)) != len(followed):
            raise ValueError("requests: a request is followed by at most one turn")
        earlier: set[str] = set()
        for r in self.requests:  # the order puts a turn after the one it follows
            if r.follows is not None and r.follows not in earlier:
                raise ValueError(f"requests: {r.request_id} follows {r.follows!r}, not an earlier request")
            earlier.add(r.request_id)

    def follow_ups(self) -> dict[str, WorkloadRequest]:
        """Request id -> the turn that follows it (closed-loop workloads)."""
        return {r.follows: r for r in self.requests if r.follows is not None}

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def duration_s(self) -> float:
        """Time from the workload start (0) to the last arrival."""
        return self.requests[-1].arrival_s if self.requests else 0.0

    @property
    def mean_rate_per_s(self) -> float:
        """Requests per second over ``duration_s`` (0 when it is 0)."""
        return self.num_requests / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def total_prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def total_output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    @property
    def max_prompt_len(self) -> int:
        return max((r.prompt_len for r in self.requests), default=0)

    @property
    def max_output_len(self) -> int:
        return max((r.output_len for r in self.requests), default=0)

    @property
    def max_token_id(self) -> int:
        """Largest prompt token id; lets a caller check it fits its token dtype."""
        return max((r.max_token_id for r in self.requests), default=0)
