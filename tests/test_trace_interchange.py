"""Trace interchange: ``kvsim export-trace`` writes vLLM's ``timed_trace``
JSON lines, and that file (and a plain arrival CSV) loads back as
``workload.trace``: the same requests, and one-line errors naming file and
line for bad rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.scenarios import write_scenario

from sim.cli import main
from sim.config import ConfigError
from sim.workloads import build_workload, load_timed_csv, load_timed_trace
from sim.workloads.config import WorkloadConfig

# Shared prefixes (128 tokens in 16-token units) and a sampled subset: ids
# are not 0..n-1 after sampling, so the round trip must keep them.
SHARED = {
    "trace": "synthetic",
    "num_requests": 20,
    "arrival": {"process": "poisson", "rate_per_s": 3.0},
    "prompt": {"distribution": "uniform", "lo": 200, "hi": 700},
    "output": {"distribution": "uniform", "lo": 5, "hi": 50},
    "shared_prefix_tokens": 128,
    "prefix_unit": 16,
    "sample_fraction": 0.6,
}


def _workload(tmp_path: Path, **workload):
    return build_workload(WorkloadConfig(**workload), base_dir=tmp_path, seed=0)


def test_export_then_load_gives_the_same_requests(tmp_path, capsys):
    path = write_scenario(tmp_path, workload=SHARED)
    out = tmp_path / "trace.jsonl"
    assert main(["export-trace", str(path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "--dataset-name timed_trace" in printed and "--timed-trace-chunk-hash-size 16" in printed
    original = _workload(tmp_path, **SHARED)
    loaded = _workload(tmp_path, trace=str(out), format="timed_trace")  # vLLM's default chunk: 16
    assert loaded.requests == original.requests
    # The file is vLLM's format: seconds, lengths, one hash id per 16 tokens.
    first = json.loads(out.read_text().splitlines()[0])
    spec = original.requests[0]
    assert first["timestamp"] == spec.arrival_s and first["input_length"] == spec.prompt_len
    assert len(first["hash_ids"]) == -(-spec.prompt_len // 16)
    # CONTROL: read with the wrong chunk size, the same file is refused.
    with pytest.raises(ConfigError, match=r"trace.jsonl:1: hash_ids: expected ceil\(input_length / 512\)"):
        _workload(tmp_path, trace=str(out), format="timed_trace", hash_chunk_tokens=512)


def test_exported_prefix_sharing_survives_the_round_trip(tmp_path):
    """Requests sharing the 128-token prefix share their first 8 hash ids."""
    path = write_scenario(tmp_path, workload=SHARED)
    out = tmp_path / "trace.jsonl"
    assert main(["export-trace", str(path), "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    heads = {tuple(row["hash_ids"][:8]) for row in rows}
    tails = [row["hash_ids"][8] for row in rows]
    assert len(heads) == 1 and len(set(tails)) == len(rows)


def test_timed_trace_without_request_ids_numbers_them(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 0.5, "input_length": 20, "output_length": 3, "hash_ids": [7, 8]}\n'
        '{"timestamp": 1.25, "input_length": 16, "output_length": 4, "hash_ids": [7]}\n'
    )
    workload = load_timed_trace(trace)
    assert [r.request_id for r in workload.requests] == ["r000000", "r000001"]
    assert [r.arrival_s for r in workload.requests] == [0.5, 1.25]
    # 16-token chunks: chunk 7 is tokens 112..127 in both prompts.
    assert workload.requests[0].prompt_token_ids()[:16] == workload.requests[1].prompt_token_ids()


def test_arrival_csv_loads_with_no_sharing(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,input_tokens,output_tokens\n0,1000,10\n0.75,1000,20\n")
    workload = _workload(tmp_path, trace=str(trace))  # format from the header
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in workload.requests] == [
        (0.0, 1000, 10),
        (0.75, 1000, 20),
    ]
    first, second = (set(r.prompt_token_ids()) for r in workload.requests)
    assert not first & second


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "arrival_s,input_tokens,output_tokens\n0,10,x\n",
            "t.csv:2: output_tokens: expected a positive integer",
        ),
        ("arrival_s,input_tokens,output_tokens\n-1,10,5\n", "t.csv:2: arrival_s: expected seconds >= 0"),
        ("arrival_s,input_tokens,output_tokens\n2,10,5\n1,10,5\n", "t.csv:3: timestamp 1 is before"),
        ("arrival_s,input_tokens,output_tokens\n1,10\n", "t.csv:2: expected 3 columns"),
        ("arrival_s,input_tokens\n", "t.csv:1: expected header"),
    ],
)
def test_bad_csv_rows_are_one_line_errors(tmp_path, text, message):
    trace = tmp_path / "t.csv"
    trace.write_text(text)
    with pytest.raises(ConfigError) as error:
        load_timed_csv(trace)
    assert str(error.value).startswith(
        str(tmp_path / message.split(":")[0]) + message[len(message.split(":")[0]) :]
    )
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            '{"timestamp": "soon", "input_length": 16, "output_length": 1, "hash_ids": [1]}',
            "timestamp: expected seconds",
        ),
        (
            '{"timestamp": 1, "input_length": 16, "output_length": 0, "hash_ids": [1]}',
            "output_length: expected a positive",
        ),
        (
            '{"timestamp": 1, "input_length": 17, "output_length": 1, "hash_ids": [1]}',
            "hash_ids: expected ceil",
        ),
        ('{"timestamp": 1, "input_length": 16, "output_length": 1}', "missing field 'hash_ids'"),
        ("{not json", "malformed JSON"),
    ],
)
def test_bad_timed_trace_lines_are_one_line_errors(tmp_path, line, message):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 16, "output_length": 1, "hash_ids": [1]}\n' + line + "\n"
    )
    with pytest.raises(ConfigError, match=f"t.jsonl:2: {message}"):
        load_timed_trace(trace)


def test_hash_chunk_tokens_only_for_timed_trace(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,input_tokens,output_tokens\n0,10,5\n")
    with pytest.raises(ConfigError, match="hash_chunk_tokens: only for timed_trace"):
        _workload(tmp_path, trace=str(trace), hash_chunk_tokens=32)
