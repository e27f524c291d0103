"""Trace interchange with other tools: vLLM's ``timed_trace`` JSON lines and a
plain ``arrival_s,input_tokens,output_tokens`` CSV, both ways.

No twin in vLLM for the writer; the reader follows
``vllm/benchmarks/datasets/datasets.py: TimedTrace`` (0.33.0): one JSON object
per line with ``timestamp`` (seconds, its default ``--timed-trace-sec-multiplier
1``), ``input_length``, ``output_length`` and ``hash_ids``, one id per
``--timed-trace-chunk-hash-size`` tokens (default 16). vLLM reads only those
four keys, so the writer may add ``request_id``: a round trip then keeps the
ids (``r000042`` stays the 43rd request of the original trace).

``vllm bench serve --dataset-name timed_trace`` expands each hash id into
random vocabulary tokens: prompts that share hash ids share token prefixes
there too, as they share content ids here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sim.workloads.loaders import (
    _cells,
    _check_header,
    _check_order,
    _empty,
    _hash_ids,
    _int_cell,
    _int_field,
    _json_record,
    _lines,
    _row,
    _short,
    no_prefix_request,
)
from sim.workloads.shipped import display_path
from sim.workloads.spec import (
    FreshIds,
    TraceError,
    Workload,
    WorkloadRequest,
    request_id,
    sort_requests,
)

# vLLM's --timed-trace-chunk-hash-size default (the Qwen/Alibaba traces).
TIMED_TRACE_CHUNK_TOKENS = 16
TIMED_CSV_HEADER = ("arrival_s", "input_tokens", "output_tokens")


def _seconds(path: Path, line: int, value: Any, field: str) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value < 0:
        raise TraceError(path, line, f"{field}: expected seconds >= 0, got {_short(value)}")
    return float(value)


def _record_id(path: Path, line: int, record: dict[str, Any], index: int) -> str:
    value = record.get("request_id", request_id(index))
    if not isinstance(value, str) or not value:
        raise TraceError(path, line, f"request_id: expected a non-empty string, got {_short(value)}")
    return value


def load_timed_trace(
    path: Path | str, *, chunk_tokens: int = TIMED_TRACE_CHUNK_TOKENS, name: str | None = None
) -> Workload:
    """Read vLLM's ``timed_trace`` JSON lines; ``hash_ids`` become the prefix
    ids, one per ``chunk_tokens`` tokens."""
    path = Path(path)
    requests: list[WorkloadRequest] = []
    previous: tuple[float, str] | None = None
    for line, text in _lines(path):
        record = _json_record(path, line, text)
        if "timestamp" not in record:
            raise TraceError(path, line, "missing field 'timestamp'")
        time_s = _seconds(path, line, record["timestamp"], "timestamp")
        _check_order(path, line, (time_s, f"{record['timestamp']} s"), previous)
        previous = (time_s, f"{record['timestamp']} s")
        prompt_len = _int_field(path, line, record, "input_length")
        requests.append(
            WorkloadRequest(
                request_id=_record_id(path, line, record, len(requests)),
                arrival_s=time_s,
                prompt_len=prompt_len,
                output_len=_int_field(path, line, record, "output_length"),
                prefix_ids=_hash_ids(path, line, record, prompt_len, chunk_tokens),
                prefix_unit=chunk_tokens,
            )
        )
    if not requests:
        raise _empty(path)
    if len({r.request_id for r in requests}) != len(requests):
        raise TraceError(path, None, "request_id: ids must be unique")
    return Workload(
        name=name or path.stem,
        source=f"timed_trace {display_path(path)}: {len(requests)} requests, "
        f"{chunk_tokens}-token hash chunks",
        requests=sort_requests(requests),
    )


def load_timed_csv(path: Path | str, *, name: str | None = None) -> Workload:
    """Read ``arrival_s,input_tokens,output_tokens`` rows. No prefix
    information: every chunk gets a fresh content id (no sharing)."""
    path = Path(path)
    lines = _lines(path)
    _check_header(path, lines, TIMED_CSV_HEADER)
    fresh = FreshIds()
    requests: list[WorkloadRequest] = []
    previous: tuple[float, str] | None = None
    for line, text in lines:
        arrival, prompt, output = _row(path, line, text, TIMED_CSV_HEADER)
        try:
            time_s = _seconds(path, line, float(arrival), "arrival_s")
        except ValueError:
            raise TraceError(path, line, f"arrival_s: expected seconds >= 0, got {_short(arrival)}") from None
        _check_order(path, line, (time_s, arrival), previous)
        previous = (time_s, arrival)
        prompt_len = _int_cell(path, line, TIMED_CSV_HEADER[1], prompt)
        requests.append(
            no_prefix_request(
                len(requests), time_s, prompt_len, _int_cell(path, line, TIMED_CSV_HEADER[2], output), fresh
            )
        )
    if not requests:
        raise _empty(path)
    return Workload(
        name=name or path.stem,
        source=f"timed csv {display_path(path)}: {len(requests)} requests; no prefix sharing",
        requests=sort_requests(requests),
    )


def is_timed_csv_header(text: str) -> bool:
    return tuple(_cells(text)) == TIMED_CSV_HEADER


def chunk_tokens_of(requests: Iterable[WorkloadRequest]) -> int:
    """The one prefix unit of a workload (``timed_trace`` has one chunk size)."""
    units = {r.prefix_unit for r in requests}
    if len(units) != 1:
        raise ValueError(f"prefix_unit: a timed_trace needs one chunk size, the workload has {sorted(units)}")
    return units.pop()


def timed_trace_lines(workload: Workload) -> list[str]:
    """The workload as ``timed_trace`` JSON lines (``repr``-exact floats, so
    reading them back gives the same arrival times)."""
    chunk_tokens_of(workload.requests)
    return [
        json.dumps(
            {
                "timestamp": spec.arrival_s,
                "input_length": spec.prompt_len,
                "output_length": spec.output_len,
                "hash_ids": list(spec.prefix_ids),
                "request_id": spec.request_id,
            }
        )
        for spec in workload.requests
    ]
