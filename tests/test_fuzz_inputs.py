"""Fuzzing the input layer (issue 14): generated scenario files, traces and
``--set`` values, valid and broken. For each, ``kvsim run`` either exits 0
with a complete result (a manifest, written last, listing files that all
exist; summary.json strict JSON) or exits 2 with one line on stderr and no
result directory, within a hard time bound and with bounded memory.

In-process (``sim.cli.main``) and small: at most three requests of at most
32 output tokens per run (harness settings appended after the fuzzed ones),
40 examples, derandomized so CI sees the same inputs every time (a longer
hunt: ``KVSIM_FUZZ_EXAMPLES=1000 KVSIM_FUZZ_RANDOM=1``).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import string
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from sim.cli import main
from sim.paths import DEFAULT_MODEL

# Per example: a run of three tiny requests takes a few seconds here (most
# of it drawing the figures); 60 s means something is unbounded.
EXAMPLE_LIMIT_S = 60
# Growth of the peak resident set over all examples: the unbounded cases of
# the issue (sample rows to an epoch time, ids for 10**12 tokens) take GBs.
MEMORY_GROWTH_LIMIT_MIB = 1024
HARNESS = [
    "workload.max_requests=3",
    "workload.max_output_len=32",
    "workload.max_prompt_len=16000",
]

# -------------------------------------------------------------- strategies
junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**40), 10**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.lists(st.integers(-5, 10**9), max_size=4),
    st.dictionaries(st.text(string.ascii_lowercase, max_size=5), st.integers(-3, 3), max_size=2),
)
plausible = st.one_of(
    st.integers(0, 70_000),
    st.floats(0.001, 1000.0),
    st.sampled_from(["off", "on", "4.1e9", "[0.5, 0.5, 0.5]", "[25, 23]", "[0, 60]", "true", "null"]),
)
KEYS = (
    "seed",
    "name",
    "layouts",
    "model",
    "bogus",
    "deployment.max_num_seqs",
    "deployment.kv_cache_memory_bytes",
    "deployment.max_model_len",
    "deployment.tensor_parallel_size",
    "deployment.pipeline_parallel_size",
    "deployment.layer_partition",
    "scheduler.max_num_batched_tokens",
    "scheduler.long_prefill_token_threshold",
    "scheduler.max_concurrent_batches",
    "mtp.acceptance_rates",
    "workload.window_s",
    "workload.rate_scale",
    "workload.time_scale",
    "workload.sample_fraction",
    "workload.spread_bursts",
    "workload.trace",
    "simulation.sample_interval_s",
    "simulation.max_time_s",
    "step_time.step_overhead_s",
)
key = st.one_of(st.sampled_from(KEYS), st.text(string.ascii_letters + "._", min_size=1, max_size=12))
value = st.one_of(junk, plausible)

timestamp_ms = st.one_of(
    st.integers(0, 600_000),
    st.integers(1_600_000_000_000, 1_800_000_000_000),  # epoch milliseconds
    st.sampled_from([1e30, -1, float("nan"), float("inf"), "soon", 10**400]),
)
tokens = st.one_of(st.integers(1, 20_000), st.sampled_from([0, -3, 10**12, 10**30, 2.5, "many", None]))


@st.composite
def mooncake_line(draw: st.DrawFn) -> str:
    if draw(st.integers(0, 9)) == 0:
        return draw(st.text(max_size=30)).replace("\n", " ")
    length = draw(tokens)
    ids = list(range(-(-length // 512))) if isinstance(length, int) and 0 < length < 10**6 else [0]
    record = {
        "timestamp": draw(timestamp_ms),
        "input_length": length,
        "output_length": draw(tokens),
        "hash_ids": ids,
    }
    return json.dumps(record)


azure_stamp = st.one_of(
    st.datetimes().map(lambda t: t.strftime("%Y-%m-%d %H:%M:%S.%f") + "0"),
    st.text(max_size=12).map(lambda t: t.replace("\n", " ").replace(",", ";")),
)


@st.composite
def azure_line(draw: st.DrawFn) -> str:
    return f"{draw(azure_stamp)},{draw(tokens)},{draw(tokens)}"


@st.composite
def trace(draw: st.DrawFn) -> tuple[str, bytes]:
    """(file suffix, content) of a Mooncake or Azure trace."""
    if draw(st.booleans()):
        lines = draw(st.lists(mooncake_line(), min_size=1, max_size=4))
        suffix = ".jsonl"
    else:
        lines = [
            "TIMESTAMP,ContextTokens,GeneratedTokens",
            *draw(st.lists(azure_line(), min_size=1, max_size=4)),
        ]
        suffix = ".csv"
    content = ("\n".join(lines) + "\n").encode()
    if draw(st.integers(0, 9)) == 0:
        content += draw(st.binary(min_size=1, max_size=8))  # maybe not UTF-8
    return suffix, content


SYNTHETIC = {
    "trace": "synthetic",
    "num_requests": 3,
    "arrival": {"process": "poisson", "rate_per_s": 2.0},
    "prompt": {"distribution": "uniform", "lo": 500, "hi": 4000},
    "output": {"distribution": "fixed", "tokens": 8},
}


def set_key(data: dict[str, Any], dotted: str, new: Any) -> None:
    node = data
    *parents, last = [part or "_" for part in dotted.split(".")]
    for part in parents:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[last] = new


@st.composite
def case(draw: st.DrawFn) -> dict[str, Any]:
    """A scenario file (bytes), maybe a trace, and --set overrides."""
    uses_trace = draw(st.booleans())
    data: dict[str, Any] = {"name": "fuzz", "model": str(DEFAULT_MODEL), "workload": dict(SYNTHETIC)}
    trace_file = draw(trace()) if uses_trace else None
    if trace_file is not None:
        data["workload"] = {"trace": f"trace{trace_file[0]}"}
    for dotted, new in draw(st.lists(st.tuples(key, value), max_size=3)):
        set_key(data, dotted, new)
    text = yaml.safe_dump(data, allow_unicode=True)
    scenario = text.encode()
    mutation = draw(st.integers(0, 14))
    if mutation == 0:
        scenario = draw(st.binary(max_size=40))
    elif mutation == 1:
        scenario = draw(st.text(max_size=40)).encode()
    overrides = [f"{k}={v}" for k, v in draw(st.lists(st.tuples(key, st.text(max_size=15)), max_size=2))]
    overrides += [
        f"{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
        for k, v in draw(st.lists(st.tuples(key, value), max_size=2))
    ]
    return {"scenario": scenario, "trace": trace_file, "overrides": overrides}


# ------------------------------------------------------------------ checks
@contextlib.contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"example ran past {seconds} s: something is unbounded")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def check_outcome(code: int, err: str, out: Path) -> None:
    if code == 2:
        assert err.startswith("kvsim: error: ") and err.count("\n") == 1, err
        assert not out.exists(), f"a result after an error: {sorted(out.rglob('*'))}"
        return
    assert code == 0, err
    manifest = json.loads((out / "manifest.json").read_text(), parse_constant=_no_constants)
    for name in manifest["files"]:
        assert (out / name).is_file(), name
    json.loads((out / "summary.json").read_text(), parse_constant=_no_constants)
    assert not list(out.rglob(".*.tmp"))


def _no_constants(name: str) -> None:
    raise AssertionError(f"{name} in a JSON file")


@pytest.fixture(scope="module")
def baseline_rss_mib() -> float:
    # Pay vLLM's import and a first plan before measuring growth.
    main(["pool-plan", "--json"])
    return peak_rss_mib()


@settings(
    max_examples=int(os.environ.get("KVSIM_FUZZ_EXAMPLES", "40")),
    deadline=None,
    derandomize="KVSIM_FUZZ_RANDOM" not in os.environ,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(inputs=case())
def test_fuzzed_inputs_end_in_a_result_or_one_line(
    inputs: dict[str, Any], baseline_rss_mib: float, capsys: pytest.CaptureFixture[str]
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        path = directory / "fuzz.yaml"
        path.write_bytes(inputs["scenario"])
        if inputs["trace"] is not None:
            suffix, content = inputs["trace"]
            (directory / f"trace{suffix}").write_bytes(content)
        out = directory / "out"
        argv = ["run", str(path), "--out", str(out)]
        for override in [*inputs["overrides"], *HARNESS]:
            argv += ["--set", override]
        capsys.readouterr()
        with time_limit(EXAMPLE_LIMIT_S):
            code = main(argv)
        captured = capsys.readouterr()
        event(f"exit {code}")
        check_outcome(code, captured.err, out)
    assert peak_rss_mib() - baseline_rss_mib < MEMORY_GROWTH_LIMIT_MIB


def test_check_outcome_catches_a_result_after_an_error(tmp_path: Path) -> None:
    """Failing controls of the fuzz's checks."""
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(AssertionError, match="a result after an error"):
        check_outcome(2, "kvsim: error: x\n", out)
    with pytest.raises(AssertionError):
        check_outcome(2, "Traceback (most recent call last):\n  ...\nKeyError: 'x'\n", tmp_path / "none")
    (out / "manifest.json").write_text(json.dumps({"files": ["steps.parquet"]}))
    with pytest.raises(AssertionError, match="steps.parquet"):
        check_outcome(0, "", out)
    with pytest.raises(TimeoutError), time_limit(1):
        while True:
            pass
