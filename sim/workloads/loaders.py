"""Readers for the public traces: Mooncake JSONL, Azure CSV, ShareGPT lengths.

No twin in vLLM. Formats, units and caveats are those of
``sim/data/README.md``. Readers are strict: any bad line stops the load with a
``TraceError`` naming file and line, because a silently skipped request
changes every queueing result downstream.

Decisions recorded here:
- Timestamps must not go backwards (equal is fine). Every upstream file is
  sorted; an unsorted file is most likely two files glued together, which
  sorting would hide.
- Blank lines are skipped (a trailing newline is not a request); extra JSON
  fields are ignored (forks of the Mooncake format add some).
- Request ids are ``r`` + the 0-based request index in the file, so
  ``r000042`` is the 43rd request whatever transformations follow.
- Bounds: a file of at most ``MAX_TRACE_BYTES``, at most
  ``MAX_WORKLOAD_REQUESTS`` requests, token counts of at most
  ``MAX_REQUEST_TOKENS``, and a span (last arrival - first) of at most
  ``MAX_SIMULATED_S``; past any of them the load stops with the line.
- Mooncake times are milliseconds from the trace start and are kept, except
  that a trace whose first timestamp is past ``EPOCH_LIKE_MS`` (a day) is
  read as absolute (epoch) time and re-based so its first request arrives at
  0; the workload's ``source`` says so. Azure times are always re-based.
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from sim.config import MAX_SIMULATED_S, read_text
from sim.workloads.distributions import ArrivalProcess, arrival_times_s
from sim.workloads.shipped import TraceFormat, display_path
from sim.workloads.spec import (
    MAX_WORKLOAD_REQUESTS,
    FreshIds,
    TraceError,
    Workload,
    WorkloadRequest,
    ceil_div,
    check_tokens,
    request_id,
    sort_requests,
)

MOONCAKE_BLOCK_TOKENS = 512
# Traces without prefix information get fresh ids per 512-token chunk: any
# unit gives the same no-sharing guarantee; a large one keeps tuples short.
NO_PREFIX_UNIT = 512
AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
SHAREGPT_HEADER = (
    "num_prefill_tokens",
    "num_decode_tokens",
    "num_total_tokens",
    "pd_ratio",
)
_AZURE_TIME = re.compile(r"(\d{4})-(\d{2})-(\d{2}) (\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,7}))?")
_DIGITS = re.compile(r"[0-9]+")
_EPOCH = datetime(1970, 1, 1)
_TICKS_PER_S = 10_000_000  # Azure stamps carry 7 fractional digits (100 ns)
# A trace file: ~4 M lines of Mooncake JSON, past the request bound anyway.
MAX_TRACE_BYTES = 1 << 30
# A Mooncake trace starting later than a day after 0 cannot be "ms from the
# trace start" of any public trace: it holds absolute (epoch) times.
EPOCH_LIKE_MS = 86_400_000.0


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, text without line ending) of each non-blank line."""
    text = read_text(path, max_bytes=MAX_TRACE_BYTES, error=TraceError)
    for number, line_text in enumerate(text.split("\n"), start=1):
        if line_text.strip():
            yield number, line_text.rstrip("\r")


def _check_max_requests(max_requests: int | None) -> None:
    if max_requests is not None and max_requests < 1:
        raise ValueError(f"max_requests: expected >= 1, got {max_requests}")


def _check_count(path: Path, line: int, num_requests: int) -> None:
    if num_requests >= MAX_WORKLOAD_REQUESTS:
        raise TraceError(
            path,
            line,
            f"more than {MAX_WORKLOAD_REQUESTS:,} requests: cut the trace into slices "
            "(a workload holds at most that many)",
        )


def _check_span(path: Path, line: int, span_s: float) -> None:
    """Arrivals must lie within ``MAX_SIMULATED_S`` of the first."""
    if span_s > MAX_SIMULATED_S:
        raise TraceError(
            path,
            line,
            f"arrives {span_s:.3g} s after the trace starts: more than {MAX_SIMULATED_S:.3g} s "
            "(a year), past any trace; check the unit",
        )


def _clip(text: str) -> str:
    return text if len(text) <= 40 else text[:37] + "..."


def _short(value: Any) -> str:
    return _clip(repr(value))


def _int_field(path: Path, line: int, record: dict[str, Any], field: str) -> int:
    if field not in record:
        raise TraceError(path, line, f"missing field '{field}'")
    value = record[field]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TraceError(path, line, f"{field}: expected a positive integer, got {_short(value)}")
    problem = check_tokens(field, value)
    if problem:
        raise TraceError(path, line, problem)
    return value


def _json_record(path: Path, line: int, text: str) -> dict[str, Any]:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        raise TraceError(path, line, f"malformed JSON ({error.msg})") from None
    except (ValueError, RecursionError) as error:  # a 5,000-digit number; deep nesting
        raise TraceError(path, line, f"malformed JSON ({_clip(str(error) or 'nested too deeply')})") from None
    if not isinstance(record, dict):
        raise TraceError(path, line, "expected a JSON object")
    return record


def _timestamp_ms(path: Path, line: int, record: dict[str, Any]) -> float:
    if "timestamp" not in record:
        raise TraceError(path, line, "missing field 'timestamp'")
    value = record["timestamp"]
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value < 0:
        raise TraceError(path, line, f"timestamp: expected milliseconds >= 0, got {_short(value)}")
    return float(value)


def _hash_ids(path: Path, line: int, record: dict[str, Any], input_length: int, unit: int) -> tuple[int, ...]:
    if "hash_ids" not in record:
        raise TraceError(path, line, "missing field 'hash_ids'")
    value = record["hash_ids"]
    if not isinstance(value, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value
    ):
        raise TraceError(path, line, "hash_ids: expected a list of integers >= 0")
    expected = ceil_div(input_length, unit)
    if len(value) != expected:
        raise TraceError(
            path,
            line,
            f"hash_ids: expected ceil(input_length / {unit}) = {expected} ids, got {len(value)}",
        )
    return tuple(value)


def _check_order(path: Path, line: int, time: tuple[float, str], previous: tuple[float, str] | None) -> None:
    """``time`` and ``previous`` are (comparable value, text as in the file)."""
    if previous is not None and time[0] < previous[0]:
        raise TraceError(
            path,
            line,
            f"timestamp {time[1]} is before the previous request's {previous[1]}: "
            "the trace must be sorted by time",
        )


def no_prefix_request(
    index: int, arrival_s: float, prompt_len: int, output_len: int, fresh: FreshIds
) -> WorkloadRequest:
    """A request of a trace without prefix information: every chunk of its
    prompt gets a fresh content id, so it shares no block with another."""
    return WorkloadRequest(
        request_id=request_id(index),
        arrival_s=arrival_s,
        prompt_len=prompt_len,
        output_len=output_len,
        prefix_ids=fresh.take(ceil_div(prompt_len, NO_PREFIX_UNIT)),
        prefix_unit=NO_PREFIX_UNIT,
    )


def _empty(path: Path) -> TraceError:
    return TraceError(path, 1, "empty trace: no requests")


def load_mooncake(
    path: Path | str,
    *,
    name: str | None = None,
    max_requests: int | None = None,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> Workload:
    """Read a Mooncake JSONL trace; ``hash_ids`` become the prefix ids as they
    are (prefix-chained, so sharing id k at position i means sharing the whole
    prefix). Timestamps are milliseconds from the trace start and are kept
    as they are (not re-based), so times match the paper's time axis; but
    a first timestamp past ``EPOCH_LIKE_MS`` marks absolute (epoch) times,
    which are re-based so the first request arrives at 0."""
    path = Path(path)
    _check_max_requests(max_requests)
    requests: list[WorkloadRequest] = []
    previous: tuple[float, str] | None = None
    origin_ms = 0.0
    for line, text in _lines(path):
        if max_requests is not None and len(requests) >= max_requests:
            break
        _check_count(path, line, len(requests))
        record = _json_record(path, line, text)
        time_ms = _timestamp_ms(path, line, record)
        stamp = (time_ms, f"{_short(record['timestamp'])} ms")
        _check_order(path, line, stamp, previous)
        previous = stamp
        if not requests and time_ms > EPOCH_LIKE_MS:
            origin_ms = time_ms
        _check_span(path, line, (time_ms - origin_ms) / 1000.0)
        prompt_len = _int_field(path, line, record, "input_length")
        output_len = _int_field(path, line, record, "output_length")
        requests.append(
            WorkloadRequest(
                request_id=request_id(len(requests)),
                arrival_s=(time_ms - origin_ms) / 1000.0,
                prompt_len=prompt_len,
                output_len=output_len,
                prefix_ids=_hash_ids(path, line, record, prompt_len, block_tokens),
                prefix_unit=block_tokens,
            )
        )
    if not requests:
        raise _empty(path)
    return Workload(
        name=name or path.stem,
        source=f"mooncake trace {display_path(path)}: {len(requests)} requests, timestamps ms -> s"
        + (f", absolute times re-based to the first ({origin_ms:.0f} ms)" if origin_ms else ""),
        requests=sort_requests(requests),
    )


def _cells(text: str) -> list[str]:
    return [cell.strip() for cell in next(csv.reader([text]))]


def _check_header(path: Path, lines: Iterator[tuple[int, str]], header: tuple[str, ...]) -> None:
    first = next(lines, None)
    if first is None:
        raise _empty(path)
    line, text = first
    if tuple(_cells(text)) != header:
        raise TraceError(path, line, f"expected header '{','.join(header)}', got '{_clip(text)}'")


def _row(path: Path, line: int, text: str, header: tuple[str, ...]) -> list[str]:
    cells = _cells(text)
    if len(cells) != len(header):
        raise TraceError(
            path,
            line,
            f"expected {len(header)} columns ({','.join(header)}), got {len(cells)}",
        )
    return cells


def _int_cell(path: Path, line: int, column: str, cell: str) -> int:
    if _DIGITS.fullmatch(cell) is None:
        raise TraceError(path, line, f"{column}: expected a positive integer, got {_short(cell)}")
    if len(cell) > 30:  # keep int() off thousands of digits (itself an error)
        raise TraceError(path, line, f"{column}: a {len(cell)}-digit number of tokens, past any bound")
    problem = check_tokens(column, int(cell))
    if problem:
        raise TraceError(path, line, problem)
    return int(cell)


def _azure_ticks(path: Path, line: int, cell: str) -> int:
    """Absolute time in 100 ns ticks, exact (no float, no 6-digit ``%f`` cut)."""
    match = _AZURE_TIME.fullmatch(cell)
    try:
        if match is None:
            raise ValueError
        *parts, fraction = match.groups()
        year, month, day, hour, minute, second = (int(p) for p in parts)
        stamp = datetime(year, month, day, hour, minute, second) - _EPOCH
    except ValueError:
        raise TraceError(
            path,
            line,
            f"TIMESTAMP: expected 'YYYY-MM-DD HH:MM:SS.fffffff', got {_short(cell)}",
        ) from None
    whole_s = stamp.days * 86_400 + stamp.seconds
    return whole_s * _TICKS_PER_S + int((fraction or "0").ljust(7, "0"))


def load_azure(path: Path | str, *, name: str | None = None, max_requests: int | None = None) -> Workload:
    """Read an Azure LLM inference CSV (2023 format). Absolute timestamps
    become seconds after the first request, which therefore arrives at 0.
    No prefix information: every chunk gets a fresh content id."""
    path = Path(path)
    _check_max_requests(max_requests)
    lines = _lines(path)
    _check_header(path, lines, AZURE_HEADER)
    fresh = FreshIds()
    requests: list[WorkloadRequest] = []
    first_ticks: int | None = None
    previous: tuple[float, str] | None = None
    for line, text in lines:
        if max_requests is not None and len(requests) >= max_requests:
            break
        _check_count(path, line, len(requests))
        stamp, context, generated = _row(path, line, text, AZURE_HEADER)
        ticks = _azure_ticks(path, line, stamp)
        _check_order(path, line, (ticks, repr(stamp)), previous)
        previous = (ticks, repr(stamp))
        first_ticks = ticks if first_ticks is None else first_ticks
        _check_span(path, line, (ticks - first_ticks) / _TICKS_PER_S)
        prompt_len = _int_cell(path, line, AZURE_HEADER[1], context)
        requests.append(
            no_prefix_request(
                len(requests),
                (ticks - first_ticks) / _TICKS_PER_S,
                prompt_len,
                _int_cell(path, line, AZURE_HEADER[2], generated),
                fresh,
            )
        )
    if not requests:
        raise _empty(path)
    return Workload(
        name=name or path.stem,
        source=f"azure trace {display_path(path)}: {len(requests)} requests, "
        "times relative to the first; no prefix sharing",
        requests=sort_requests(requests),
    )


def _sharegpt_row(path: Path, line: int, text: str) -> tuple[int, int]:
    prefill, decode, total, ratio = _row(path, line, text, SHAREGPT_HEADER)
    prompt_len = _int_cell(path, line, SHAREGPT_HEADER[0], prefill)
    output_len = _int_cell(path, line, SHAREGPT_HEADER[1], decode)
    if _int_cell(path, line, SHAREGPT_HEADER[2], total) != prompt_len + output_len:
        raise TraceError(
            path,
            line,
            f"num_total_tokens: expected {prompt_len} + {output_len}, got {total}",
        )
    try:
        float(ratio)
    except ValueError:
        raise TraceError(path, line, f"pd_ratio: expected a number, got {_short(ratio)}") from None
    return prompt_len, output_len


def load_sharegpt_lengths(
    path: Path | str,
    *,
    arrival: ArrivalProcess,
    rng: np.random.Generator,
    name: str | None = None,
    max_requests: int | None = None,
) -> Workload:
    """Read ShareGPT (prompt, output) length pairs and give them arrival times.

    Rows are used in file order (pairs kept together, first ``max_requests``
    rows), so the lengths are reproducible from the file alone; ``rng`` draws
    only the arrival times. No prefix information: fresh content ids.
    """
    path = Path(path)
    _check_max_requests(max_requests)
    lines = _lines(path)
    _check_header(path, lines, SHAREGPT_HEADER)
    lengths: list[tuple[int, int]] = []
    for line, text in lines:
        if max_requests is not None and len(lengths) >= max_requests:
            break
        _check_count(path, line, len(lengths))
        lengths.append(_sharegpt_row(path, line, text))
    if not lengths:
        raise _empty(path)
    times_s = arrival_times_s(arrival, len(lengths), rng)
    fresh = FreshIds()
    requests = [
        no_prefix_request(index, float(time_s), prompt_len, output_len, fresh)
        for index, ((prompt_len, output_len), time_s) in enumerate(zip(lengths, times_s, strict=True))
    ]
    return Workload(
        name=name or path.stem,
        source=f"sharegpt lengths {display_path(path)}: first {len(requests)} rows "
        f"in file order, arrivals {arrival!r}; no prefix sharing",
        requests=sort_requests(requests),
    )


def detect_format(path: Path) -> TraceFormat:
    """``mooncake``, ``azure``, ``sharegpt`` or ``timed_csv``, from the
    extension or first line (a ``timed_trace`` looks like Mooncake JSON
    lines: set ``workload.format: timed_trace``)."""
    if path.suffix in (".jsonl", ".json"):
        return "mooncake"
    first = next(_lines(path), None)
    if first is None:
        raise _empty(path)
    line, text = first
    cells = tuple(_cells(text))
    if cells == AZURE_HEADER:
        return "azure"
    if cells == SHAREGPT_HEADER:
        return "sharegpt"
    if cells == ("arrival_s", "input_tokens", "output_tokens"):
        return "timed_csv"
    if text.lstrip().startswith("{"):
        return "mooncake"
    raise TraceError(
        path,
        line,
        "cannot tell the trace format (expected Mooncake JSON lines or an "
        "Azure/ShareGPT/arrival_s,input_tokens,output_tokens CSV header); set workload.format",
    )
