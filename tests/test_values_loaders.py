"""``sim.workloads.loaders`` values: the format a file is read as, Azure's
absolute timestamps to seconds (by hand, across days and with the 7-digit
fraction), the request cap and the one-line errors, whole (path, line and
text), so a message that loses its file or its value is caught."""

from __future__ import annotations

import numpy as np
import pytest

from sim.config import ConfigError
from sim.workloads import loaders
from sim.workloads.distributions import Poisson

AZURE = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
SHAREGPT = "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n"


def _file(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return path


def _error(call, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as caught:
        call(*args, **kwargs)
    return str(caught.value)


# ------------------------------------------------------------ the format
@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("t.jsonl", "not even json\n", "mooncake"),  # the extension decides
        ("t.json", "", "mooncake"),
        ("t.csv", AZURE + "2023-11-16 18:15:46.6805900,374,44\n", "azure"),
        ("t.csv", SHAREGPT, "sharegpt"),
        ("t.csv", " arrival_s , input_tokens,output_tokens\n", "timed_csv"),
        ("t.txt", '\n   {"timestamp": 0}\n', "mooncake"),  # first non-blank line, indented
    ],
)
def test_the_format_comes_from_the_extension_or_the_first_line(tmp_path, name, text, expected):
    assert loaders.detect_format(_file(tmp_path, name, text)) == expected


def test_unknown_and_empty_files_are_errors_naming_the_file_and_line(tmp_path):
    path = _file(tmp_path, "t.txt", "\n\nid,tokens\n")
    assert _error(loaders.detect_format, path) == (
        f"{path}:3: cannot tell the trace format (expected Mooncake JSON lines or an "
        "Azure/ShareGPT/arrival_s,input_tokens,output_tokens CSV header); set workload.format"
    )
    empty = _file(tmp_path, "e.csv", "\n  \n")
    assert _error(loaders.detect_format, empty) == f"{empty}:1: empty trace: no requests"
    # Control: a trailing "{" is not a JSON line.
    trailing = _file(tmp_path, "b.txt", "id {\n")
    assert "cannot tell the trace format" in _error(loaders.detect_format, trailing)


# ------------------------------------------------------------ Azure times
def test_azure_times_are_seconds_after_the_first_across_midnight_and_a_year(tmp_path):
    """23:59:59.5 -> 00:00:00.25 the next day: 0.75 s; a fraction of two
    digits is 0.25 s (padded on the right, 7 digits of 100 ns); none is 0;
    to 1 March 2024 is 0.5 s + 60 days (January's 31, a leap February's 29)."""
    rows = [
        "2023-12-31 23:59:59.5,10,1",
        "2024-01-01 00:00:00.25,10,1",
        "2024-01-01 00:00:01,10,1",
        "2024-03-01 00:00:00,10,1",
        "2024-03-01 00:00:00.0000001,10,1",
    ]
    workload = loaders.load_azure(_file(tmp_path, "a.csv", AZURE + "\n".join(rows) + "\n"))
    times = [r.arrival_s for r in workload.requests]
    march_s = 0.5 + 60 * 86_400.0
    assert times[:4] == [0.0, 0.75, 1.5, march_s]
    assert times[4] - march_s == pytest.approx(1e-7, rel=0.02)  # 100 ns (not cut to 1 us), to float precision


def test_a_bad_azure_timestamp_is_one_line_with_the_cell(tmp_path):
    path = _file(tmp_path, "a.csv", AZURE + "2023-11-16 18:15,374,44\n")
    assert _error(loaders.load_azure, path) == (
        f"{path}:2: TIMESTAMP: expected 'YYYY-MM-DD HH:MM:SS.fffffff', got '2023-11-16 18:15'"
    )


def test_azure_max_requests_cuts_the_file_and_must_be_positive(tmp_path):
    rows = "".join(f"2023-11-16 18:15:4{i}.0,10,1\n" for i in range(3))
    path = _file(tmp_path, "a.csv", AZURE + rows)
    assert [r.request_id for r in loaders.load_azure(path, max_requests=2).requests] == ["r000000", "r000001"]
    assert len(loaders.load_azure(path, max_requests=3).requests) == 3
    with pytest.raises(ValueError, match="^max_requests: expected >= 1, got 0$"):
        loaders.load_azure(path, max_requests=0)


def test_an_azure_trace_past_the_request_bound_names_its_line(tmp_path, monkeypatch):
    monkeypatch.setattr(loaders, "MAX_WORKLOAD_REQUESTS", 2)
    rows = "".join(f"2023-11-16 18:15:4{i}.0,10,1\n" for i in range(3))
    path = _file(tmp_path, "a.csv", AZURE + rows)
    assert _error(loaders.load_azure, path) == (
        f"{path}:4: more than 2 requests: cut the trace into slices (a workload holds at most that many)"
    )


def test_a_header_only_trace_is_empty(tmp_path):
    path = _file(tmp_path, "a.csv", AZURE)
    assert _error(loaders.load_azure, path) == f"{path}:1: empty trace: no requests"
    sharegpt = _file(tmp_path, "s.csv", SHAREGPT)
    rng = np.random.default_rng(0)
    got = _error(loaders.load_sharegpt_lengths, sharegpt, arrival=Poisson(rate_per_s=1.0), rng=rng)
    assert got == f"{sharegpt}:1: empty trace: no requests"


def test_an_unsorted_azure_trace_and_one_past_the_span_name_line_and_stamps(tmp_path, monkeypatch):
    rows = "2023-11-16 18:15:42.0,10,1\n2023-11-16 18:15:41.5,10,1\n"
    path = _file(tmp_path, "a.csv", AZURE + rows)
    assert _error(loaders.load_azure, path) == (
        f"{path}:3: timestamp '2023-11-16 18:15:41.5' is before the previous request's "
        "'2023-11-16 18:15:42.0': the trace must be sorted by time"
    )
    monkeypatch.setattr(loaders, "MAX_SIMULATED_S", 1.0)
    rows = "2023-11-16 18:15:40,10,1\n2023-11-16 18:15:41,10,1\n2023-11-16 18:15:42,10,1\n"
    path = _file(tmp_path, "b.csv", AZURE + rows)
    assert _error(loaders.load_azure, path) == (
        f"{path}:4: arrives 2 s after the trace starts: more than 1 s (a year), "
        "past any trace; check the unit"
    )


def test_azure_and_sharegpt_workloads_are_named_by_the_file_and_say_their_source(tmp_path):
    path = _file(tmp_path, "day.csv", AZURE + "2023-11-16 18:15:40,10,1\n2023-11-16 18:15:41,20,2\n")
    azure = loaders.load_azure(path)
    assert azure.name == "day" and loaders.load_azure(path, name="mine").name == "mine"
    assert azure.source == f"azure trace {path}: 2 requests, times relative to the first; no prefix sharing"
    lengths = _file(tmp_path, "pairs.csv", SHAREGPT + "5,3,8,0.6\n7,1,8,7.0\n9,9,18,1.0\n")
    arrival = Poisson(rate_per_s=2.0)
    sharegpt = loaders.load_sharegpt_lengths(
        lengths, arrival=arrival, rng=np.random.default_rng(0), max_requests=2
    )
    assert sharegpt.name == "pairs"
    assert sharegpt.source == (
        f"sharegpt lengths {lengths}: first 2 rows in file order, arrivals {arrival!r}; no prefix sharing"
    )
    assert [(r.prompt_len, r.output_len) for r in sharegpt.requests] == [(5, 3), (7, 1)]


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ("5,3", "expected 4 columns (num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio), got 2"),
        ("5,x,8,0.6", "num_decode_tokens: expected a positive integer, got 'x'"),
        ("5,3,y,0.6", "num_total_tokens: expected a positive integer, got 'y'"),
        ("5,3,9,0.6", "num_total_tokens: expected 5 + 3, got 9"),
        ("5,3,8,ratio", "pd_ratio: expected a number, got 'ratio'"),
    ],
)
def test_a_bad_sharegpt_row_is_one_line_with_its_column_and_cell(tmp_path, row, problem):
    path = _file(tmp_path, "s.csv", SHAREGPT + "1,1,2,1.0\n" + row + "\n")
    got = _error(
        loaders.load_sharegpt_lengths, path, arrival=Poisson(rate_per_s=1.0), rng=np.random.default_rng(0)
    )
    assert got == f"{path}:3: {problem}"


def test_sharegpt_max_requests_and_the_request_bound(tmp_path, monkeypatch):
    path = _file(tmp_path, "s.csv", SHAREGPT + "1,1,2,1.0\n2,2,4,1.0\n3,3,6,1.0\n")
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="^max_requests: expected >= 1, got 0$"):
        loaders.load_sharegpt_lengths(path, arrival=Poisson(rate_per_s=1.0), rng=rng, max_requests=0)
    monkeypatch.setattr(loaders, "MAX_WORKLOAD_REQUESTS", 2)
    assert _error(loaders.load_sharegpt_lengths, path, arrival=Poisson(rate_per_s=1.0), rng=rng) == (
        f"{path}:4: more than 2 requests: cut the trace into slices (a workload holds at most that many)"
    )


@pytest.mark.parametrize(
    ("record", "problem"),
    [
        ('{"input_length": 1, "output_length": 1, "hash_ids": [0]}', "missing field 'timestamp'"),
        ('{"timestamp": 0, "output_length": 1, "hash_ids": [0]}', "missing field 'input_length'"),
        ('{"timestamp": 0, "input_length": 1, "output_length": 1}', "missing field 'hash_ids'"),
        (
            '{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}',
            "input_length: expected a positive integer, got 0",
        ),
        (
            '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [-1]}',
            "hash_ids: expected a list of integers >= 0",
        ),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_a_bad_mooncake_line_is_one_line_with_its_field(tmp_path, record, problem):
    good = '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]}'
    path = _file(tmp_path, "t.jsonl", good + "\n" + record + "\n")
    assert _error(loaders.load_mooncake, path) == f"{path}:2: {problem}"


def test_a_wrong_csv_header_is_shown_with_the_expected_one(tmp_path):
    path = _file(tmp_path, "a.csv", "\nTIMESTAMP,Context,Generated\n")
    assert _error(loaders.load_azure, path) == (
        f"{path}:2: expected header 'TIMESTAMP,ContextTokens,GeneratedTokens', "
        "got 'TIMESTAMP,Context,Generated'"
    )


def _mooncake_line(timestamp) -> str:
    return f'{{"timestamp": {timestamp}, "input_length": 1, "output_length": 1, "hash_ids": [0]}}'


def test_mooncake_epoch_times_are_rebased_and_the_source_says_so(tmp_path):
    """Epoch milliseconds (2023-11-14): arrivals 0 and 1.5 s, named by the
    file; a trace from 0 keeps its times and says nothing of re-basing."""
    path = _file(
        tmp_path, "day.jsonl", _mooncake_line(1_700_000_000_000) + "\n" + _mooncake_line(1_700_000_001_500)
    )
    workload = loaders.load_mooncake(path)
    assert [r.arrival_s for r in workload.requests] == [0.0, 1.5] and workload.name == "day"
    assert workload.source == (
        f"mooncake trace {path}: 2 requests, timestamps ms -> s, "
        "absolute times re-based to the first (1700000000000 ms)"
    )
    plain = _file(tmp_path, "plain.jsonl", _mooncake_line(0) + "\n" + _mooncake_line(250))
    assert loaders.load_mooncake(plain, name="mine").name == "mine"
    assert loaders.load_mooncake(plain).source == f"mooncake trace {plain}: 2 requests, timestamps ms -> s"


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("-1", "-1"),
        ('"' + "x" * 38 + '"', "'" + "x" * 38 + "'"),  # 40 characters with quotes: shown whole
        ('"' + "x" * 39 + '"', "'" + "x" * 36 + "..."),  # 41: cut to 37 and "..."
    ],
)
def test_a_bad_value_is_shown_whole_up_to_forty_characters(tmp_path, value, shown):
    path = _file(tmp_path, "t.jsonl", _mooncake_line(value) + "\n")
    assert (
        _error(loaders.load_mooncake, path) == f"{path}:1: timestamp: expected milliseconds >= 0, got {shown}"
    )


def test_malformed_json_shows_pythons_own_reason_clipped(tmp_path):
    """A 5,000-digit number: Python refuses the conversion (its message, cut
    at 37 characters and "..."); a cut line: the decoder's message."""
    try:
        int("9" * 5000)
    except ValueError as error:
        reason = str(error)[:37] + "..."
    path = _file(tmp_path, "t.jsonl", _mooncake_line(0) + "\n" + _mooncake_line("9" * 5000) + "\n")
    assert _error(loaders.load_mooncake, path) == f"{path}:2: malformed JSON ({reason})"
    cut = _file(tmp_path, "c.jsonl", '{"timestamp": 0,\n')
    assert (
        _error(loaders.load_mooncake, cut)
        == f"{cut}:1: malformed JSON (Expecting property name enclosed in double quotes)"
    )


def test_a_line_loses_only_its_carriage_return(tmp_path):
    """CRLF files: the "\\r" goes, a trailing letter stays, and a 40-character
    line is still shown whole (41 with its "\\r" would be cut)."""
    header = "TIMESTAMP,ContextTokens,Generated" + "X" * 7
    assert len(header) == 40
    path = tmp_path / "a.csv"
    path.write_bytes(header.encode() + b"\r\n")
    assert _error(loaders.load_azure, path) == (
        f"{path}:1: expected header 'TIMESTAMP,ContextTokens,GeneratedTokens', got '{header}'"
    )


def test_a_trace_file_past_the_byte_bound_is_refused_before_reading(tmp_path, monkeypatch):
    monkeypatch.setattr(loaders, "MAX_TRACE_BYTES", 100)
    path = _file(tmp_path, "t.jsonl", _mooncake_line(0) + "\n" + _mooncake_line(1) + "\n")
    assert path.stat().st_size > 100
    with pytest.raises(ConfigError, match=f"^{path}"):
        loaders.load_mooncake(path)
    monkeypatch.setattr(loaders, "MAX_TRACE_BYTES", path.stat().st_size)  # control: at the bound it loads
    assert len(loaders.load_mooncake(path).requests) == 2
