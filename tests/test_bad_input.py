"""Bad input and faults (issue 14): every input named in the issue gives one
line on stderr and exit 2 and writes nothing, or a complete result (a
manifest, written last, listing files that all exist). Each case is the
exact input the issue reports; the checks that matter have a failing control
(the rule broken on purpose, the check goes red).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml
from helpers.scenarios import write_scenario

import sim.analysis.runs
import sim.engine
import sim.results
from sim.analysis.sweep import load_finished
from sim.cli import main
from sim.config import ConfigError, read_yaml
from sim.paths import DEFAULT_MODEL
from sim.workloads import load_mooncake

TINY = {
    "trace": "synthetic",
    "num_requests": 4,
    "arrival": {"process": "poisson", "rate_per_s": 2.0},
    "prompt": {"distribution": "fixed", "tokens": 1000},
    "output": {"distribution": "fixed", "tokens": 10},
}


# ------------------------------------------------------------------ checks
def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], *needles: str) -> str:
    """Exit 2, exactly one line ``kvsim: error: ...`` holding every needle."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvsim: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    return err


def strict_json(path: Path) -> object:
    """JSON as the standard has it: NaN and Infinity are not JSON."""

    def refuse(name: str) -> None:
        raise ValueError(f"{path}: {name} is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def assert_complete(out: Path) -> dict:
    """A manifest listing files that all exist, and nothing half-written."""
    manifest = strict_json(out / "manifest.json")
    assert isinstance(manifest, dict)
    for name in manifest["files"]:
        assert (out / name).is_file(), name
    assert {"steps.parquet", "summary.json", "plots/admission.png"} <= set(manifest["files"])
    assert not list(out.rglob(".*.tmp"))
    strict_json(out / "summary.json")
    # The manifest is the newest file: written after the last figure.
    newest = max((out / name).stat().st_mtime_ns for name in manifest["files"])
    assert (out / "manifest.json").stat().st_mtime_ns >= newest
    return manifest


def test_strict_json_refuses_nan(tmp_path: Path) -> None:
    """Failing control of strict_json: Python's json writes bare NaN."""
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"ttft_p50_s": float("nan")}))
    with pytest.raises(ValueError, match="NaN is not JSON"):
        strict_json(path)


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return write_scenario(tmp_path, "tiny", workload=TINY)


def mooncake_trace(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def mooncake_row(timestamp: float, output_length: int = 5) -> dict:
    return {"timestamp": timestamp, "input_length": 600, "output_length": output_length, "hash_ids": [0, 1]}


# ------------------------------------------------------------ High: times
def test_epoch_millisecond_mooncake_trace_is_rebased_and_runs(tmp_path: Path, capsys) -> None:
    """The issue's trace: ``1700000000000 + i*1000``. Re-based, three
    requests one second apart; the samples cover seconds, not 54 years."""
    trace = mooncake_trace(
        tmp_path / "epoch.jsonl", [mooncake_row(1_700_000_000_000 + i * 1000) for i in range(3)]
    )
    workload = load_mooncake(trace)
    assert [r.arrival_s for r in workload.requests] == [0.0, 1.0, 2.0]
    assert "re-based" in workload.source
    path = write_scenario(tmp_path, "epoch", workload={"trace": str(trace)})
    out = tmp_path / "out"
    assert main(["run", str(path), "--out", str(out)]) == 0
    assert_complete(out)
    samples = pd.read_parquet(out / "samples.parquet")
    assert 0 < len(samples) < 100 and samples["time_s"].max() < 100


@pytest.mark.parametrize(
    ("first_ms", "needle"),
    [(1_700_000_000_000, "a year"), (1_700_000_000, "sample rows")],  # epoch ms; epoch s written as ms
)
def test_epoch_trace_without_rebasing_is_refused_before_it_runs(
    tmp_path: Path, capsys, monkeypatch, first_ms: int, needle: str
) -> None:
    """Failing control of the re-basing: with it off, the same traces would
    sample 54 years (or 20 days) of nothing before the first arrival; the
    span and sample-row bounds refuse them in one line instead."""
    rows = [mooncake_row(first_ms + i * 1000) for i in range(3)]
    trace = mooncake_trace(tmp_path / "epoch.jsonl", rows)
    path = write_scenario(tmp_path, "epoch", workload={"trace": str(trace)})
    assert load_mooncake(trace).requests[0].arrival_s == 0.0  # re-based by the rule
    monkeypatch.setattr("sim.workloads.loaders.EPOCH_LIKE_MS", float("inf"))
    one_line_error(capsys, ["run", str(path), "--out", str(tmp_path / "out")], needle)
    assert not (tmp_path / "out").exists()


def test_timestamp_1e30_is_a_one_line_error(tmp_path: Path, capsys) -> None:
    trace = mooncake_trace(tmp_path / "t.jsonl", [mooncake_row(0), mooncake_row(1e30)])
    path = write_scenario(tmp_path, "far", workload={"trace": str(trace)})
    one_line_error(capsys, ["run", str(path), "--out", str(tmp_path / "out")], f"{trace}:2:", "a year")
    assert not (tmp_path / "out").exists()


def test_sampler_stops_at_the_row_bound(tiny: Path, tmp_path: Path, monkeypatch) -> None:
    """A drain longer than the bound: sampling stops there and the summary
    says so. Control: with the bound far away the same run is not cut."""
    from sim.analysis.runs import run_scenario
    from sim.scenario import load_scenario

    scenario = load_scenario(str(tiny), ["simulation.sample_interval_s=0.05"])
    whole = run_scenario(scenario, ["on"])
    assert not whole.summary["samples_truncated"].item() and len(whole.samples) > 10
    monkeypatch.setattr(sim.engine, "MAX_SAMPLE_ROWS", 10)
    cut = run_scenario(scenario, ["on"])
    assert len(cut.samples) == 10 and cut.summary["samples_truncated"].item()


# -------------------------------------------------------- High: no steps
@pytest.mark.parametrize("setting", ["deployment.max_model_len=1", "simulation.max_time_s=0.0001"])
def test_run_without_steps_is_complete_and_plots(tiny: Path, tmp_path: Path, capsys, setting: str) -> None:
    out = tmp_path / "out"
    assert main(["compare", str(tiny), "--set", setting, "--out", str(out)]) == 0
    assert_complete(out)
    summary = strict_json(out / "summary.json")
    assert [row["num_steps"] for row in summary] == [0, 0]
    assert summary[0]["ttft_p50_s"] is None  # NaN -> null
    assert main(["plot", str(out)]) == 0


def test_a_failing_figure_leaves_no_manifest(tiny: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    """Failing control of "manifest last": a figure write that fails leaves
    an incomplete directory, which plot refuses in one line."""

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("sim.analysis.plots.write_figure", no_space)
    out = tmp_path / "out"
    one_line_error(capsys, ["run", str(tiny), "--out", str(out)], "cannot write the results", "No space left")
    assert not (out / "manifest.json").exists() and not (out / "steps.parquet").exists()
    one_line_error(capsys, ["plot", str(out)], "not a kvsim results directory")


# ------------------------------------------------------------------ Medium
def test_layout_tp3_is_a_one_line_error(capsys) -> None:
    one_line_error(capsys, ["pool-plan", "--tp", "3"], "tensor_parallel_size 3", "not divisible by 3")


@pytest.mark.parametrize("command", ["run", "compare"])
def test_run_with_tp3_is_a_one_line_error(tiny: Path, tmp_path: Path, capsys, command: str) -> None:
    argv = [command, str(tiny), "--set", "deployment.tensor_parallel_size=3", "--out", str(tmp_path / "out")]
    one_line_error(capsys, argv, "tensor_parallel_size 3")
    assert not (tmp_path / "out").exists()


def test_kvsims_own_assertion_is_not_reported_as_bad_input(flash_next, reference, monkeypatch) -> None:
    """Only vLLM's assertions are the user's input; kvsim's own are bugs."""
    from sim import kv_cache_plan as layout

    def broken(*args, **kwargs):
        raise AssertionError("kvsim bug")

    monkeypatch.setattr(layout, "build_worker_specs", broken)
    with pytest.raises(AssertionError, match="kvsim bug"):
        layout.plan_kv_cache(flash_next, reference, side_cache_layout=False)


def _refuse_to_simulate(monkeypatch) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("simulated before checking the output")

    monkeypatch.setattr(sim.analysis.runs, "run_scenario", fail)


@pytest.mark.parametrize(
    ("out", "needle"),
    [
        ("a-file", "exists and is not a directory"),
        ("a-file/sub", "is not a directory"),
        ("/proc/kvsim-out", "cannot write"),
    ],
)
def test_unusable_out_is_found_before_simulating(
    tiny: Path, tmp_path: Path, capsys, monkeypatch, out, needle
) -> None:
    (tmp_path / "a-file").write_text("mine\n")
    _refuse_to_simulate(monkeypatch)
    target = out if out.startswith("/") else str(tmp_path / out)
    one_line_error(capsys, ["run", str(tiny), "--out", target], "--out", needle)
    assert (tmp_path / "a-file").read_text() == "mine\n"


def test_usable_out_control(tiny: Path, tmp_path: Path, monkeypatch) -> None:
    """Control: a fresh directory passes the check and reaches the run."""
    _refuse_to_simulate(monkeypatch)
    with pytest.raises(AssertionError, match="simulated before"):
        main(["run", str(tiny), "--out", str(tmp_path / "new" / "dir")])
    assert not (tmp_path / "new").exists()  # the check creates nothing


def _non_utf8(path: Path, text: str) -> Path:
    path.write_bytes(text.encode() + b"\n# caf\xe9\n")
    return path


def test_non_utf8_scenario_names_file_and_line(tmp_path: Path, capsys) -> None:
    path = _non_utf8(tmp_path / "s.yaml", "name: s")
    one_line_error(capsys, ["run", str(path)], f"{path}:2:", "not UTF-8")


def test_non_utf8_model_names_file_and_line(tmp_path: Path, capsys) -> None:
    model = _non_utf8(tmp_path / "m.yaml", DEFAULT_MODEL.read_text())
    one_line_error(capsys, ["pool-plan", "--model", str(model)], f"{model}:", "not UTF-8")


def test_non_utf8_gates_file_names_file_and_line(tmp_path: Path, capsys) -> None:
    gates = _non_utf8(tmp_path / "g.yaml", "gates:")
    one_line_error(capsys, ["gate", str(gates), "--report", str(tmp_path / "r")], f"{gates}:2:", "not UTF-8")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    ("tokens", "needle"), [(10**30, "31-digit number"), (10**12, "more than 10,000,000")]
)
def test_azure_context_tokens_are_bounded(tmp_path: Path, capsys, tokens: int, needle: str) -> None:
    trace = tmp_path / "azure.csv"
    trace.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,{tokens},5\n")
    path = write_scenario(tmp_path, "az", workload={"trace": str(trace)})
    started = time.perf_counter()
    one_line_error(capsys, ["run", str(path), "--out", str(tmp_path / "out")], f"{trace}:2:", needle)
    assert time.perf_counter() - started < 5  # refused, not built
    assert not (tmp_path / "out").exists()


def test_mooncake_output_length_1e30_is_refused_before_the_run(tmp_path: Path, capsys) -> None:
    trace = mooncake_trace(tmp_path / "t.jsonl", [mooncake_row(0, output_length=10**30)])
    path = write_scenario(tmp_path, "long", workload={"trace": str(trace)})
    one_line_error(capsys, ["run", str(path), "--out", str(tmp_path / "out")], f"{trace}:1:", "output_length")
    assert not (tmp_path / "out").exists()


def test_a_frame_parquet_cannot_hold_leaves_no_manifest(
    tiny: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    """Were a value past int64 to reach the frames (the bounds stop it at the
    trace), the write fails in one line and no manifest claims a result."""
    real = sim.analysis.runs.RunResult.frames

    def overflowing(self):
        frames = real(self)
        requests = frames["requests"].astype({"output_tokens": object})
        requests.loc[0, "output_tokens"] = 10**30
        return {**frames, "requests": requests}

    monkeypatch.setattr(sim.analysis.runs.RunResult, "frames", overflowing)
    out = tmp_path / "out"
    one_line_error(capsys, ["run", str(tiny), "--out", str(out)], "cannot write the results")
    assert not out.exists() or not any(out.iterdir())


def test_negative_seed_is_a_one_line_error(tiny: Path, capsys) -> None:
    one_line_error(capsys, ["run", str(tiny), "--set", "seed=-1"], "seed")


@pytest.mark.parametrize(
    ("text", "needle"),
    [("gates: {}\n", "expected at least one gate"), ("{}\n", "gates: Field required"), ("gates:\n", "gates")],
)
def test_empty_gates_file_is_a_one_line_error(tmp_path: Path, capsys, text: str, needle: str) -> None:
    gates = tmp_path / "g.yaml"
    gates.write_text(text)
    one_line_error(capsys, ["gate", str(gates), "--report", str(tmp_path / "r")], str(gates), needle)


# --------------------------------------------------------------------- Low
def test_wrong_number_of_acceptance_rates_is_an_error(tiny: Path, capsys) -> None:
    one_line_error(capsys, ["run", str(tiny), "--set", "mtp.acceptance_rates=[0.5]"], "3", "acceptance_rates")
    one_line_error(capsys, ["run", str(tiny), "--set", "mtp.acceptance_rates=[0.5,0.5,0.5,0.5]"], "4 rates")


def test_right_number_of_acceptance_rates_loads(tiny: Path) -> None:
    from sim.scenario import load_scenario

    assert load_scenario(str(tiny), ["mtp.acceptance_rates=[0.5,0.4,0.3]"]).mtp.acceptance_rates == (
        0.5,
        0.4,
        0.3,
    )


@pytest.mark.parametrize("name", ["../../x", "a/b", "..", ".hidden", "", "x" * 101])
def test_scenario_name_must_be_a_path_component(
    tiny: Path, tmp_path: Path, capsys, monkeypatch, name
) -> None:
    monkeypatch.chdir(tmp_path)
    one_line_error(capsys, ["run", str(tiny), "--set", f"name='{name}'"], "name")
    assert not (tmp_path / "results").exists() and not (tmp_path.parent / "x").exists()


def test_leftovers_and_stale_figures_are_removed(tiny: Path, tmp_path: Path, capsys) -> None:
    """A compare, then a killed write's temporary file, then a one-layout run
    into the same directory: the gain figures of the compare go, the
    temporary file goes, a file kvsim never wrote stays."""
    out = tmp_path / "out"
    assert main(["compare", str(tiny), "--out", str(out)]) == 0
    assert (out / "plots" / "gain.png").exists()
    (out / "plots" / ".gain.png.abc123.tmp").write_bytes(b"half")
    (out / ".steps.parquet.x1y2.tmp").write_bytes(b"half")
    (out / "notes.txt").write_text("mine\n")
    assert main(["run", str(tiny), "--out", str(out)]) == 0
    manifest = assert_complete(out)
    assert not (out / "plots" / "gain.png").exists() and "plots/gain.png" not in manifest["files"]
    assert (out / "notes.txt").read_text() == "mine\n"
    assert set(pd.read_parquet(out / "summary.parquet")["layout"]) == {"on"}


def test_figures_kvsim_plot_adds_are_listed_and_go_stale_too(tiny: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    assert main(["compare", str(tiny), "--out", str(out)]) == 0
    assert main(["plot", str(out), "--format", "pdf"]) == 0
    assert "plots/gain.pdf" in assert_complete(out)["files"]
    assert main(["run", str(tiny), "--out", str(out)]) == 0
    assert not (out / "plots" / "gain.pdf").exists() and (out / "plots" / "admission.png").exists()


def test_only_listed_files_are_removed(tmp_path: Path) -> None:
    """A manifest naming a path outside the directory removes nothing there."""
    out, outside = tmp_path / "out", tmp_path / "precious.txt"
    out.mkdir()
    outside.write_text("keep\n")
    (out / "manifest.json").write_text(json.dumps({"files": ["../precious.txt", str(outside)]}))
    assert sim.results._listed_files(out) == set()


def test_corrupt_parquet_in_plot_is_a_one_line_error(tiny: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    assert main(["run", str(tiny), "--out", str(out)]) == 0
    (out / "steps.parquet").write_bytes(b"PAR1 not really")
    one_line_error(capsys, ["plot", str(out)], f"{out / 'steps.parquet'}", "not a readable parquet")


def test_run_file_without_summary_is_run_again(tmp_path: Path) -> None:
    """``sweep --resume`` counts a run file without its summary as not run
    (it is run again and overwritten); a whole one is kept."""
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "aaaa.json").write_text(json.dumps({"run_id": "aaaa", "params": {}}))
    (runs / "bbbb.json").write_text(
        json.dumps({"run_id": "bbbb", "params": {}, "summary": {"ttft_p50_s": None}})
    )
    (runs / "cccc.json").write_bytes(b"\xff\xfe")
    finished = load_finished(runs)
    assert set(finished) == {"bbbb"}
    assert finished["bbbb"]["summary"]["ttft_p50_s"] != finished["bbbb"]["summary"]["ttft_p50_s"]  # NaN again


def test_missing_absolute_scenario_path_message(capsys) -> None:
    err = one_line_error(
        capsys, ["run", "/nonexistent/abs.yaml"], "/nonexistent/abs.yaml: no such scenario file"
    )
    assert "scenarios/" not in err and ".yaml.yaml" not in err


def test_missing_bare_name_mentions_shipped_scenarios(capsys) -> None:
    one_line_error(capsys, ["run", "no-such-scenario"], "nor a shipped scenario")


def _gates_with(tmp_path: Path, metric: str, value: str) -> Path:
    scenario = write_scenario(tmp_path, "g", workload=TINY)
    gates = tmp_path / "gates.yaml"
    gates.write_text(
        f"gates:\n  a:\n    scenario: {scenario}\n    baselines:\n      {metric}: {{off: {value}}}\n"
    )
    return gates


def test_nan_baseline_of_a_count_is_rejected(tmp_path: Path, capsys) -> None:
    gates = _gates_with(tmp_path, "num_admitted", ".nan")
    one_line_error(capsys, ["gate", str(gates), "--report", str(tmp_path / "r")], "num_admitted.off: nan")


def test_nan_baseline_of_a_latency_is_what_update_records(tmp_path: Path) -> None:
    """Control: a TTFT has no value when nothing finished; --update writes
    .nan for it, so that file must load."""
    from sim.analysis.gates import load_gates

    gates = _gates_with(tmp_path, "ttft_p99_s", ".nan")
    assert load_gates(gates).gates["a"].baseline("ttft_p99_s", "off") != 0


def test_yaml_byte_count_like_the_command_line(tiny: Path, capsys) -> None:
    from sim.scenario import load_scenario

    text = tiny.read_text() + "deployment:\n  kv_cache_memory_bytes: 4.1e9\n"
    tiny.write_text(text)
    assert load_scenario(str(tiny)).deployment.kv_cache_memory_bytes == 4_100_000_000
    with pytest.raises(ConfigError, match="whole|integer"):
        load_scenario(str(tiny), ["deployment.kv_cache_memory_bytes=4.1e0"])


def test_absurd_pool_is_bounded_with_its_reason(tiny: Path, capsys) -> None:
    one_line_error(
        capsys, ["run", str(tiny), "--set", "deployment.kv_cache_memory_bytes=4.1e15"], "1e+12", "288 GB"
    )
    one_line_error(capsys, ["pool-plan", "--kv-cache-memory", "4.1e15"], "288 GB")


def test_yaml_aliases_are_refused(tmp_path: Path) -> None:
    """A few lines of aliases would expand to gigabytes when copied."""
    path = tmp_path / "laughs.yaml"
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match="line 2: aliases"):
        read_yaml(path)


def _wait_for_pool_workers(pid: int, count: int, timeout_s: float = 120.0) -> None:
    """Until the process's pool has ``count`` workers: with the forkserver
    start method (Linux) they are the forkserver's children, so the
    process's grandchildren. Bounded by ``timeout_s``."""
    import psutil

    deadline = time.monotonic() + timeout_s
    parent = psutil.Process(pid)
    while True:
        with contextlib.suppress(psutil.NoSuchProcess):
            if sum(len(child.children()) for child in parent.children()) >= count:
                return
        assert parent.is_running() and time.monotonic() < deadline, "the pool's workers never started"
        time.sleep(0.05)


def test_gate_ctrl_c_with_workers_is_one_line(tmp_path: Path, python_ctrl_c) -> None:
    """Ctrl-C (SIGINT to the foreground process group, as a terminal sends
    it) during ``gate --workers 2``: one line, exit 130, no child traceback.
    The gate inherits this process's SIGINT mask: unblocked here
    (``python_ctrl_c``), as a terminal's shell leaves it."""
    scenario = write_scenario(
        tmp_path,
        "slow",
        workload={**TINY, "num_requests": 400, "output": {"distribution": "fixed", "tokens": 2000}},
    )
    gates = tmp_path / "gates.yaml"
    gates.write_text(
        yaml.safe_dump(
            {
                "gates": {
                    n: {"scenario": str(scenario), "set": [f"seed={i}"], "baselines": {"num_admitted": None}}
                    for i, n in enumerate("ab")
                }
            }
        )
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    argv = [
        sys.executable,
        "-m",
        "sim.cli",
        "gate",
        str(gates),
        "--workers",
        "2",
        "--report",
        str(tmp_path / "r"),
    ]
    process = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        _wait_for_pool_workers(process.pid, 2)  # the readiness signal: the workers run
        os.killpg(process.pid, signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
    assert process.returncode == 130, err
    assert err == "kvsim: interrupted\n", err


def test_sweep_resume_reruns_a_run_file_without_summary_and_says_so(
    tiny: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "sweep"
    argv = ["sweep", str(tiny), "--grid", "layout=on", "--workers", "1", "--out", str(out)]
    assert main(argv) == 0
    (run_file,) = (out / "runs").glob("*.json")
    whole = json.loads(run_file.read_text())
    run_file.write_text(json.dumps({"run_id": whole["run_id"], "params": whole["params"]}))
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 0
    assert "not finished runs" in capsys.readouterr().out
    assert json.loads(run_file.read_text())["summary"] == json.loads(json.dumps(whole["summary"]))
    assert len(pd.read_parquet(out / "sweep.parquet")) == 1


def test_ctrl_c_during_a_pool_start_is_raised_after_it(python_ctrl_c) -> None:
    """The driver gets Ctrl-C once the pool exists (and can be terminated);
    processes started meanwhile inherit SIGINT blocked. Control: outside the
    block the same Ctrl-C interrupts at once."""
    from sim.analysis.executors import _sigint_deferred

    def child_blocks_sigint() -> bool:
        status = subprocess.run(
            ["cat", "/proc/self/status"], capture_output=True, text=True, check=True
        ).stdout
        mask = int(next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16)
        return bool(mask & (1 << (signal.SIGINT - 1)))

    steps: list[str] = []
    with pytest.raises(KeyboardInterrupt), _sigint_deferred():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)
        steps.append("pool started")
        assert child_blocks_sigint()
    assert steps == ["pool started"]
    assert not child_blocks_sigint()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)
        steps.append("not reached")
    assert steps == ["pool started"]
