"""Workloads (issue: workloads layer): loaders against the shipped slices,
prompt materialisation and prefix sharing, one-line errors for bad traces,
transformations, synthetic arrivals against theory, and the scenario config.

Each check that matters has a failing control next to it: the same assertion
applied to a deliberately wrong input, showing it would catch the bug.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.config import ConfigError, validate
from sim.workloads import (
    AZURE_CODE_SLICE,
    AZURE_CONV_SLICE,
    DATA_DIR,
    DEFAULT_TRACE,
    FRESH_ID_BASE,
    SHAREGPT_LENGTHS,
    Constant,
    Empirical,
    Fixed,
    Gamma,
    LogNormal,
    Poisson,
    TraceError,
    Uniform,
    Workload,
    WorkloadConfig,
    WorkloadRequest,
    build_workload,
    clamp_lengths,
    limit,
    load_azure,
    load_mooncake,
    load_sharegpt_lengths,
    sample,
    scale_rate,
    scale_time,
    spread_bursts,
    synthetic,
    window,
)

# A folder holding the upstream trace files the slices were cut from (named in
# sim/data/README.md): $KVSIM_UPSTREAM_TRACES, else the received material's
# traces folder beside the checkout (../shared/traces, where the project's CI
# has it); the byte-prefix check runs only where the folder exists.
UPSTREAM_TRACES = Path(
    os.environ.get("KVSIM_UPSTREAM_TRACES") or Path(__file__).resolve().parents[2] / "shared" / "traces"
).resolve()


@pytest.fixture(scope="module")
def mooncake() -> Workload:
    return load_mooncake(DEFAULT_TRACE)


@pytest.fixture(scope="module")
def azure() -> Workload:
    return load_azure(AZURE_CODE_SLICE)


def _lcp(a: list[int] | tuple[int, ...], b: list[int] | tuple[int, ...]) -> int:
    """Length of the common prefix of two sequences."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _tokens_disjoint(requests: tuple[WorkloadRequest, ...]) -> bool:
    seen: set[int] = set()
    for request in requests:
        tokens = set(request.prompt_token_ids())
        if seen & tokens:
            return False
        seen |= tokens
    return True


# --- the shipped slices -------------------------------------------------------


def _readme_checksums() -> dict[str, str]:
    text = (DATA_DIR / "README.md").read_text()
    return dict(re.findall(r"^\| `([^`]+)` \|.*`([0-9a-f]{64})`", text, re.M))


def test_shipped_files_match_the_checksums_in_their_readme():
    checksums = _readme_checksums()
    assert set(checksums) == {
        DEFAULT_TRACE.name,
        AZURE_CODE_SLICE.name,
        AZURE_CONV_SLICE.name,
        SHAREGPT_LENGTHS.name,
    }
    for name, digest in checksums.items():
        assert hashlib.sha256((DATA_DIR / name).read_bytes()).hexdigest() == digest
    assert (DATA_DIR / "LICENSE-APACHE-2.0.txt").is_file()


@pytest.mark.skipif(
    not UPSTREAM_TRACES.is_dir(), reason=f"{UPSTREAM_TRACES}: no upstream traces (set KVSIM_UPSTREAM_TRACES)"
)
@pytest.mark.parametrize(
    "shipped, upstream",
    [
        (DEFAULT_TRACE, "mooncake_fast25_conversation_trace.jsonl"),
        (AZURE_CODE_SLICE, "AzureLLMInferenceTrace_code.csv"),
        (SHAREGPT_LENGTHS, "metron_sharegpt_8k_filtered_stats_llama2_tokenizer.csv"),
    ],
)
def test_shipped_slices_are_byte_prefixes_of_the_upstream_files(shipped, upstream):
    data = shipped.read_bytes()
    whole = (UPSTREAM_TRACES / upstream).read_bytes()
    assert whole.startswith(data) and data.endswith(b"\n")


def test_default_trace_is_found_from_the_package_not_the_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert DEFAULT_TRACE.is_absolute() and DEFAULT_TRACE.is_file()
    built = build_workload(WorkloadConfig(), base_dir=tmp_path, seed=0)
    assert built.num_requests == 2728


def test_mooncake_slice_loads_ms_as_seconds(mooncake):
    assert mooncake.num_requests == 2728
    first, last = mooncake.requests[0], mooncake.requests[-1]
    assert first.arrival_s == 0.0 and last.arrival_s == 899.999  # 899,999 ms
    assert first.request_id == "r000000"
    assert (first.prompt_len, first.output_len) == (6758, 500)
    assert first.prefix_ids == tuple(range(14)) and first.prefix_unit == 512
    assert mooncake.total_prompt_tokens == 36_783_744
    assert mooncake.total_output_tokens == 951_148
    # Control, an independent reading with the json module: same numbers.
    rows = [json.loads(line) for line in DEFAULT_TRACE.read_text().splitlines()]
    prompt_lens = [r.prompt_len for r in mooncake.requests]
    assert prompt_lens == [row["input_length"] for row in rows]
    assert last.arrival_s == rows[-1]["timestamp"] / 1000 != rows[-1]["timestamp"]


def test_azure_slice_loads_relative_to_the_first_request(azure):
    assert azure.num_requests == 781
    first, last = azure.requests[0], azure.requests[-1]
    # 18:17:03.9799600 -> 18:22:03.9373530, exact to 100 ns.
    assert first.arrival_s == 0.0
    assert last.arrival_s == pytest.approx(299.957393, abs=1e-9)
    assert (first.prompt_len, first.output_len) == (4808, 10)
    assert (last.prompt_len, last.output_len) == (1985, 19)
    gaps_s = np.diff([r.arrival_s for r in azure.requests])
    assert gaps_s.max() == pytest.approx(143.734274)  # the silent gap before the burst


def test_sharegpt_lengths_keep_file_order_and_get_arrivals():
    w = load_sharegpt_lengths(
        SHAREGPT_LENGTHS,
        arrival=Poisson(rate_per_s=5.0),
        rng=np.random.default_rng(1),
        max_requests=500,
    )
    assert w.num_requests == 500
    assert (w.requests[0].prompt_len, w.requests[0].output_len) == (74, 918)
    assert (w.requests[1].prompt_len, w.requests[1].output_len) == (290, 905)
    assert 0 < w.requests[0].arrival_s < w.requests[-1].arrival_s


# --- prompt materialisation and prefix sharing -------------------------------


def _broken_tokens(request: WorkloadRequest) -> list[int]:
    """A materialiser that ignores content ids: every prompt is 0, 1, 2, ..."""
    return list(range(request.prompt_len))


def test_mooncake_requests_share_exactly_their_common_hash_prefix(mooncake):
    by_pair = {}
    for request in mooncake.requests:
        if len(request.prefix_ids) > 3:
            by_pair.setdefault(request.prefix_ids[:2], []).append(request)
    a, b = next(
        (a, b)
        for group in by_pair.values()
        for a, b in zip(group, group[1:], strict=False)
        if _lcp(a.prefix_ids, b.prefix_ids) < min(len(a.prefix_ids), len(b.prefix_ids))
    )
    k = _lcp(a.prefix_ids, b.prefix_ids)
    assert k >= 2
    tokens_a, tokens_b = a.prompt_token_ids(), b.prompt_token_ids()
    assert len(tokens_a) == a.prompt_len and len(tokens_b) == b.prompt_len
    assert _lcp(tokens_a, tokens_b) == k * 512
    assert tokens_a[k * 512] != tokens_b[k * 512]  # and differ at the next token
    # Control: a materialiser that ignores content ids shares far more.
    assert _lcp(_broken_tokens(a), _broken_tokens(b)) != k * 512


def test_traces_without_prefix_information_never_share_a_token(azure):
    sharegpt = load_sharegpt_lengths(
        SHAREGPT_LENGTHS,
        arrival=Constant(rate_per_s=1.0),
        rng=np.random.default_rng(0),
        max_requests=200,
    )
    made = synthetic(
        num_requests=200,
        arrival=Poisson(rate_per_s=1.0),
        prompt=Uniform(lo=1, hi=3000),
        output=Fixed(tokens=8),
        rng=np.random.default_rng(0),
    )
    for w in (azure, sharegpt, made):
        ids = [c for r in w.requests for c in r.prefix_ids]
        assert len(ids) == len(set(ids)) and min(ids) >= FRESH_ID_BASE
        assert _tokens_disjoint(w.requests[:200])
    # Control: the Mooncake slice shares its first block in every request.
    assert not _tokens_disjoint(load_mooncake(DEFAULT_TRACE, max_requests=5).requests)


def test_token_ids_fit_in_int32(mooncake, azure):
    """vLLM keeps token ids in int32 buffers; fresh ids are chosen to fit."""
    assert max(mooncake.max_token_id, azure.max_token_id) < 2**31
    request = azure.requests[-1]
    assert request.max_token_id == max(request.prompt_token_ids())


@st.composite
def _prompt(draw, unit: int, ids: list[int]) -> WorkloadRequest:
    last = draw(st.integers(1, unit))
    return WorkloadRequest(
        request_id="r",
        arrival_s=0.0,
        prompt_len=(len(ids) - 1) * unit + last,
        output_len=1,
        prefix_ids=tuple(ids),
        prefix_unit=unit,
    )


@st.composite
def _two_prompts(draw) -> tuple[WorkloadRequest, WorkloadRequest]:
    unit = draw(st.integers(1, 40))
    content = st.integers(0, 50)
    common = draw(st.lists(content, max_size=4))
    tail_a = draw(st.lists(content, max_size=4))
    tail_b = draw(st.lists(content, max_size=4))
    ids_a, ids_b = common + tail_a, common + tail_b
    if not ids_a or not ids_b:
        ids_a, ids_b = ids_a or [0], ids_b or [0]
    return draw(_prompt(unit, ids_a)), draw(_prompt(unit, ids_b))


@settings(max_examples=100, deadline=None)
@given(_two_prompts())
def test_token_prefixes_follow_content_id_prefixes(pair):
    a, b = pair
    tokens_a, tokens_b = a.prompt_token_ids(), b.prompt_token_ids()
    assert len(tokens_a) == a.prompt_len and min(tokens_a) >= 0
    k = _lcp(a.prefix_ids, b.prefix_ids)
    expected = min(k * a.prefix_unit, a.prompt_len, b.prompt_len)
    assert _lcp(tokens_a, tokens_b) == expected


def test_request_spec_rejects_a_wrong_number_of_ids():
    with pytest.raises(ValueError, match="prefix_ids: expected ceil"):
        WorkloadRequest(
            request_id="r0", arrival_s=0.0, prompt_len=513, output_len=1,
            prefix_ids=(1,), prefix_unit=512,
        )  # fmt: skip


def test_workload_requires_sorted_unique_requests(mooncake):
    a, b = mooncake.requests[0], mooncake.requests[-1]
    with pytest.raises(ValueError, match="sorted"):
        Workload(name="x", source="x", requests=(b, a))
    twin = replace(b, request_id=a.request_id)
    with pytest.raises(ValueError, match="unique"):
        Workload(name="x", source="x", requests=(a, twin))
    assert Workload(name="x", source="x", requests=(a, b)).num_requests == 2  # control


# --- bad input: one line naming file and line -------------------------------

MOONCAKE_GOOD = [
    '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}',
    '{"timestamp": 3000, "input_length": 512, "output_length": 7, "hash_ids": [0]}',
    '{"timestamp": 3000, "input_length": 1100, "output_length": 9, "hash_ids": [0, 1, 2]}',
]
AZURE_GOOD = [
    "TIMESTAMP,ContextTokens,GeneratedTokens",
    "2023-11-16 18:15:46.6805900,100,10",
    "2023-11-16 18:15:47.0000000,2000,20",
    "2023-11-16 18:15:47.5000001,30,3",
]
SHAREGPT_GOOD = [
    "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio",
    "74,918,992,0.0806",
    "290,905,1195,0.3204",
]
GOOD = {"mooncake": MOONCAKE_GOOD, "azure": AZURE_GOOD, "sharegpt": SHAREGPT_GOOD}


def _load(fmt: str, path: Path) -> Workload:
    if fmt == "mooncake":
        return load_mooncake(path)
    if fmt == "azure":
        return load_azure(path)
    return load_sharegpt_lengths(path, arrival=Poisson(rate_per_s=1.0), rng=np.random.default_rng(0))


# (format, line to replace (1-based), new text, fragment of the message)
BAD_LINES = [
    ("mooncake", 2, '{"timestamp": 3000, "input_length": 512,', "malformed JSON"),
    ("mooncake", 2, "[1, 2, 3]", "expected a JSON object"),
    ("mooncake", 1, '{"timestamp": 0, "output_length": 5, "hash_ids": [0, 1]}',
     "missing field 'input_length'"),
    ("mooncake", 3, '{"timestamp": 3000, "input_length": 1100, "output_length": 9}',
     "missing field 'hash_ids'"),
    ("mooncake", 2, '{"timestamp": 3000, "input_length": 51.2, "output_length": 7, '
     '"hash_ids": [0]}', "input_length: expected a positive integer"),
    ("mooncake", 2, '{"timestamp": 3000, "input_length": "512", "output_length": 7, '
     '"hash_ids": [0]}', "input_length: expected a positive integer"),
    ("mooncake", 2, '{"timestamp": 3000, "input_length": true, "output_length": 7, '
     '"hash_ids": [0]}', "input_length: expected a positive integer"),
    ("mooncake", 2, '{"timestamp": 3000, "input_length": 512, "output_length": 0, '
     '"hash_ids": [0]}', "output_length: expected a positive integer"),
    ("mooncake", 3, '{"timestamp": 3000, "input_length": 1100, "output_length": 9, '
     '"hash_ids": [0, 1]}', "hash_ids: expected ceil(input_length / 512) = 3 ids"),
    ("mooncake", 3, '{"timestamp": 3000, "input_length": 1100, "output_length": 9, '
     '"hash_ids": [0, -1, 2]}', "hash_ids: expected a list of integers"),
    ("mooncake", 2, '{"timestamp": "soon", "input_length": 512, "output_length": 7, '
     '"hash_ids": [0]}', "timestamp: expected milliseconds"),
    ("mooncake", 3, '{"timestamp": 2999, "input_length": 1100, "output_length": 9, '
     '"hash_ids": [0, 1, 2]}', "is before the previous request's 3000 ms"),
    ("azure", 1, "timestamp,context,generated", "expected header"),
    ("azure", 3, "2023-11-16 18:15:47,2000", "expected 3 columns"),
    ("azure", 3, "2023-13-16 18:15:47.0000000,2000,20", "TIMESTAMP: expected"),
    ("azure", 3, "16/11/2023 18:15:47,2000,20", "TIMESTAMP: expected"),
    ("azure", 3, "2023-11-16 18:15:47.0000000,2000.5,20", "ContextTokens: expected"),
    ("azure", 4, "2023-11-16 18:15:47.5000001,30,0", "GeneratedTokens: expected"),
    ("azure", 4, "2023-11-16 18:15:46.0000000,30,3", "is before the previous"),
    ("sharegpt", 1, "prefill,decode", "expected header"),
    ("sharegpt", 2, "74,918,990,0.0806", "num_total_tokens: expected 74 + 918"),
    ("sharegpt", 3, "-290,905,615,0.32", "num_prefill_tokens: expected a positive"),
    ("sharegpt", 3, "290,905,1195,lots", "pd_ratio: expected a number"),
]  # fmt: skip


def _write(tmp_path: Path, fmt: str, lines: list[str]) -> Path:
    path = tmp_path / ("trace.jsonl" if fmt == "mooncake" else "trace.csv")
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _one_line_error(error: TraceError, path: Path, line: int | None) -> bool:
    where = str(path) if line is None else f"{path}:{line}"
    return "\n" not in str(error) and str(error).startswith(f"{where}: ")


@pytest.mark.parametrize("fmt", sorted(GOOD))
def test_the_good_baselines_load(tmp_path, fmt):
    """Control for the cases below: only the replaced line is wrong."""
    assert _load(fmt, _write(tmp_path, fmt, GOOD[fmt])).num_requests in (2, 3)


@pytest.mark.parametrize("fmt, line, text, fragment", BAD_LINES)
def test_bad_lines_name_file_and_line(tmp_path, fmt, line, text, fragment):
    lines = list(GOOD[fmt])
    lines[line - 1] = text
    path = _write(tmp_path, fmt, lines)
    with pytest.raises(TraceError) as caught:
        _load(fmt, path)
    assert _one_line_error(caught.value, path, line), str(caught.value)
    assert fragment in str(caught.value)
    assert isinstance(caught.value, ConfigError)  # hence a ValueError too


@pytest.mark.parametrize("fmt", sorted(GOOD))
@pytest.mark.parametrize("content", ["", "\n\n", "header-only"])
def test_empty_traces_are_errors(tmp_path, fmt, content):
    if content == "header-only":  # JSON lines have no header: blanks only
        content = " \n" if fmt == "mooncake" else GOOD[fmt][0] + "\n"
    path = tmp_path / "empty.txt"
    path.write_text(content)
    with pytest.raises(TraceError) as caught:
        _load(fmt, path)
    assert _one_line_error(caught.value, path, 1)
    assert "empty trace" in str(caught.value)


def test_unreadable_and_non_utf8_files(tmp_path):
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(TraceError) as caught:
        load_mooncake(missing)
    assert _one_line_error(caught.value, missing, None)
    assert "cannot read" in str(caught.value)
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(MOONCAKE_GOOD[0].encode() + b"\n\xff\xfe\n")
    with pytest.raises(TraceError) as caught:
        load_mooncake(binary)
    assert _one_line_error(caught.value, binary, 2)


def test_equal_timestamps_and_blank_lines_are_fine(tmp_path):
    path = _write(tmp_path, "mooncake", [MOONCAKE_GOOD[0], "", *MOONCAKE_GOOD[1:], ""])
    w = load_mooncake(path)
    assert [r.arrival_s for r in w.requests] == [0.0, 3.0, 3.0]


# --- transformations ----------------------------------------------------------


def test_window_keeps_its_range_and_rebases_to_its_start(mooncake):
    kept = window(mooncake, 300.0, 600.0)
    inside = [r for r in mooncake.requests if 300.0 <= r.arrival_s < 600.0]
    assert [r.request_id for r in kept.requests] == [r.request_id for r in inside]
    assert [r.arrival_s for r in kept.requests] == [r.arrival_s - 300.0 for r in inside]
    assert 0 <= kept.requests[0].arrival_s and kept.duration_s < 300.0
    assert "window [300, 600)" in kept.source
    # Control: the un-rebased requests would not fit in [0, 300).
    assert max(r.arrival_s for r in inside) >= 300.0


def test_scale_rate_is_scale_time_by_the_inverse(mooncake):
    assert scale_rate(mooncake, 2.0).requests == scale_time(mooncake, 0.5).requests
    faster, slower = scale_rate(mooncake, 4.0), scale_time(mooncake, 2.0)
    assert faster.mean_rate_per_s == pytest.approx(4 * mooncake.mean_rate_per_s)
    assert slower.duration_s == pytest.approx(2 * mooncake.duration_s)
    # Control: scaling time by the factor itself is the opposite direction.
    assert scale_rate(mooncake, 2.0).requests != scale_time(mooncake, 2.0).requests


def test_sample_is_deterministic_per_seed_and_keeps_about_the_fraction(mooncake):
    first = sample(mooncake, 0.5, np.random.default_rng(3))
    again = sample(mooncake, 0.5, np.random.default_rng(3))
    other = sample(mooncake, 0.5, np.random.default_rng(4))
    assert first == again
    assert first.requests != other.requests  # control: another seed differs
    n = mooncake.num_requests  # Binomial(n, 1/2): sd = sqrt(n) / 2 ~ 26
    assert abs(first.num_requests - n / 2) < 5 * math.sqrt(n) / 2
    assert set(first.requests) <= set(mooncake.requests)


def test_limit_takes_the_first_requests(mooncake):
    assert limit(mooncake, 10).requests == mooncake.requests[:10]
    assert limit(mooncake, 10**6).requests == mooncake.requests
    with pytest.raises(ValueError, match="max_requests"):
        limit(mooncake, 0)


def test_spread_bursts_moves_each_request_within_its_quantum(mooncake):
    spread = spread_bursts(mooncake, 3.0, np.random.default_rng(0))
    original = {r.request_id: r.arrival_s for r in mooncake.requests}
    for request in spread.requests:
        assert 0 <= request.arrival_s - original[request.request_id] < 3.0
    assert len({r.arrival_s for r in spread.requests}) == spread.num_requests
    # Control: the quantised trace has only 301 distinct stamps.
    assert len(set(original.values())) == 301


def test_clamp_lengths_keeps_the_leading_tokens(mooncake):
    clamped = clamp_lengths(mooncake, max_prompt_len=4000, max_output_len=100)
    assert clamped.max_prompt_len == 4000 and clamped.max_output_len == 100
    long = next(r for r in mooncake.requests if r.prompt_len > 4000)
    cut = next(r for r in clamped.requests if r.request_id == long.request_id)
    assert cut.prompt_token_ids() == long.prompt_token_ids()[:4000]


# --- synthetic arrivals and lengths against theory ---------------------------


def _mean_gap_matches(gaps_s: np.ndarray, rate_per_s: float, cv: float) -> bool:
    """CLT: the mean of n i.i.d. gaps has sd = cv / (rate * sqrt(n)); allow 4 sd."""
    tolerance = 4 * cv / (rate_per_s * math.sqrt(len(gaps_s)))
    return abs(gaps_s.mean() - 1 / rate_per_s) < tolerance


def _cv(gaps_s: np.ndarray) -> float:
    return float(gaps_s.std(ddof=1) / gaps_s.mean())


def test_poisson_mean_gap_is_one_over_the_rate():
    rate_per_s, n = 2.5, 20_000
    gaps_s = Poisson(rate_per_s=rate_per_s).inter_arrival_s(n, np.random.default_rng(5))
    assert _mean_gap_matches(gaps_s, rate_per_s, cv=1.0)
    assert _cv(gaps_s) == pytest.approx(1.0, rel=0.05)
    # Control: a process 10 % too fast fails the same check (4 sd is 2.8 %).
    fast = Poisson(rate_per_s=1.1 * rate_per_s)
    assert not _mean_gap_matches(fast.inter_arrival_s(n, np.random.default_rng(5)), rate_per_s, cv=1.0)


def test_gamma_cv3_is_burstier_than_poisson_with_the_same_mean():
    """Gamma gaps with shape 1/9 have CV 3. The sample variance's relative sd is
    sqrt((kurtosis - 1) / n) = sqrt(56 / 50000) = 3.3 %, so the CV is within
    ~1.7 % (1 sd); 10 % is about 6 sd."""
    rng = np.random.default_rng(6)
    gaps_s = Gamma(rate_per_s=2.0, cv=3.0).inter_arrival_s(50_000, rng)
    poisson_s = Poisson(rate_per_s=2.0).inter_arrival_s(50_000, rng)
    assert _mean_gap_matches(gaps_s, 2.0, cv=3.0)
    assert _cv(gaps_s) == pytest.approx(3.0, rel=0.10)
    assert _cv(gaps_s) > 2 * _cv(poisson_s)
    one = Gamma(rate_per_s=2.0, cv=1.0).inter_arrival_s(50_000, rng)
    assert _cv(one) == pytest.approx(1.0, rel=0.05)  # cv = 1 is Poisson


def test_constant_arrivals_are_evenly_spaced():
    gaps_s = Constant(rate_per_s=4.0).inter_arrival_s(10, np.random.default_rng(0))
    assert np.all(gaps_s == 0.25)


def test_length_distributions_match_their_parameters():
    rng = np.random.default_rng(7)
    lognormal = LogNormal(p50=1000, p90=3000).sample(20_000, rng)
    assert np.median(lognormal) == pytest.approx(1000, rel=0.05)
    assert np.percentile(lognormal, 90) == pytest.approx(3000, rel=0.05)
    uniform = Uniform(lo=3, hi=5).sample(2_000, rng)
    assert set(uniform.tolist()) == {3, 4, 5}  # both ends included
    assert set(Empirical(values=(7, 9)).sample(100, rng).tolist()) == {7, 9}
    assert LogNormal(p50=1, p90=1).sample(100, rng).min() >= 1


def test_synthetic_shared_prefix_is_shared_exactly():
    w = synthetic(
        num_requests=50,
        arrival=Poisson(rate_per_s=1.0),
        prompt=Uniform(lo=1, hi=200),
        output=Fixed(tokens=4),
        rng=np.random.default_rng(8),
        shared_prefix_tokens=64,
    )
    tokens = [r.prompt_token_ids() for r in w.requests]
    assert [len(t) for t in tokens] == [r.prompt_len for r in w.requests]
    assert min(r.prompt_len for r in w.requests) > 64
    assert {_lcp(a, b) for a in tokens[:10] for b in tokens[10:20]} == {64}
    with pytest.raises(ValueError, match="multiple of prefix_unit"):
        synthetic(
            num_requests=1, arrival=Poisson(rate_per_s=1.0), prompt=Fixed(tokens=1),
            output=Fixed(tokens=1), rng=np.random.default_rng(0),
            shared_prefix_tokens=100,
        )  # fmt: skip


# --- the scenario config --------------------------------------------------------

SYNTHETIC = {
    "trace": "synthetic",
    "num_requests": 200,
    "arrival": {"process": "gamma", "rate_per_s": 3.0, "cv": 2.0},
    "prompt": {"distribution": "lognormal", "p50": 800, "p90": 2400},
    "output": {"distribution": "uniform", "lo": 10, "hi": 300},
    "shared_prefix_tokens": 256,
}


@pytest.mark.parametrize(
    "data, message",
    [
        ({"windw_s": [0, 10]}, "scenario.yaml: unknown key 'windw_s'"),
        ({**SYNTHETIC, "arrival": {"rate_per_s": 1.0, "burst": 2}},
         "scenario.yaml: unknown key 'arrival.burst'"),
        ({**SYNTHETIC, "prompt": {"distribution": "fixed", "tokens": 5, "n": 1}},
         "scenario.yaml: unknown key 'prompt.fixed.n'"),
        ({"arrival": {"rate_per_s": 1.0}}, "arrival: not used by mooncake traces"),
        ({**SYNTHETIC, "prompt": None}, "prompt: required for synthetic workloads"),
        ({**SYNTHETIC, "arrival": {"process": "gamma", "rate_per_s": 1.0}},
         "cv: required for process gamma"),
        ({**SYNTHETIC, "output": {"distribution": "uniform", "lo": 9, "hi": 3}},
         "hi: expected >= lo"),
        ({"window_s": [10, 5]}, "scenario.yaml: window_s: expected [start, end]"),
        ({"sample_fraction": 1.5}, "sample_fraction"),
        ({"trace": "azure-code-slice", "spread_bursts": True},
         "spread_bursts: only for"),
        ({"trace": "default", "format": "azure"}, "does not match trace 'default'"),
    ],
)  # fmt: skip
def test_workload_config_rejects_bad_keys_naming_them(data, message):
    with pytest.raises(ConfigError) as caught:
        validate(WorkloadConfig, data, "scenario.yaml")
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_valid_configs_pass():
    """Control for the table above: the unbroken versions validate."""
    validate(WorkloadConfig, SYNTHETIC, "scenario.yaml")
    validate(WorkloadConfig, {"window_s": [0, 10], "spread_bursts": True}, "s.yaml")
    sharegpt = {"trace": "sharegpt-lengths", "arrival": {"rate_per_s": 2}}
    validate(WorkloadConfig, sharegpt, "s.yaml")
    by_format = {**SYNTHETIC, "format": "synthetic"}
    del by_format["trace"]
    assert validate(WorkloadConfig, by_format, "s.yaml").known_format() == "synthetic"


def test_build_workload_is_deterministic_per_seed(tmp_path):
    cfg = validate(WorkloadConfig, SYNTHETIC, "scenario.yaml")
    first = build_workload(cfg, base_dir=tmp_path, seed=11)
    assert first == build_workload(cfg, base_dir=tmp_path, seed=11)
    assert first.requests != build_workload(cfg, base_dir=tmp_path, seed=12).requests
    assert first.num_requests == 200 and "seed 11" in first.source
    trace_cfg = WorkloadConfig(sample_fraction=0.3, spread_bursts=True)
    again = build_workload(trace_cfg, base_dir=tmp_path, seed=5)
    assert again == build_workload(trace_cfg, base_dir=tmp_path, seed=5)


def test_build_workload_applies_steps_in_the_documented_order(tmp_path, mooncake):
    cfg = WorkloadConfig(
        window_s=(300.0, 600.0), sample_fraction=0.5, max_requests=100,
        time_scale=2.0, max_prompt_len=8192,
    )  # fmt: skip
    built = build_workload(cfg, base_dir=tmp_path, seed=1)
    rng = np.random.SeedSequence(1).spawn(3)[1]  # the sample stream
    expected = window(mooncake, 300.0, 600.0)
    expected = limit(sample(expected, 0.5, np.random.default_rng(rng)), 100)
    expected = clamp_lengths(scale_time(expected, 2.0), max_prompt_len=8192)
    assert built.requests == expected.requests
    assert built.duration_s < 600.0 and built.max_prompt_len <= 8192


def test_build_workload_reads_relative_paths_and_sniffs_the_format(tmp_path):
    (tmp_path / "traces").mkdir()
    _write(tmp_path / "traces", "azure", AZURE_GOOD)
    cfg = WorkloadConfig(trace="traces/trace.csv", rate_scale=2.0)
    w = build_workload(cfg, base_dir=tmp_path, seed=0)
    assert w.num_requests == 3  # 47.5000001 - 46.6805900 s, at twice the rate:
    assert w.requests[-1].arrival_s == pytest.approx(0.8194101 / 2)
    with_arrival = WorkloadConfig(trace="traces/trace.csv", arrival={"rate_per_s": 1})
    with pytest.raises(ConfigError, match="workload.arrival: not used by azure"):
        build_workload(with_arrival, base_dir=tmp_path, seed=0)
    with pytest.raises(ConfigError, match="no such file"):
        build_workload(WorkloadConfig(trace="nope.csv"), base_dir=tmp_path, seed=0)
    with pytest.raises(ConfigError, match="leave no requests"):
        build_workload(WorkloadConfig(window_s=(5000, 6000)), base_dir=tmp_path, seed=0)


def test_workloads_do_not_import_the_upper_layers():
    code = (
        "import sys, sim.workloads; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'vllm', 'simpy', 'torch', 'pandas', 'matplotlib'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
