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
