"""``kvsim conform --fork``: building the fork's environment from the user's
copy (blob ids checked, nothing half-built taken as good), the child that
runs the fork's Scheduler (bounded, always stopped), and bad input (one line,
exit 2). The fork's own run is checked through its golden frames
(``test_fork_golden.py``); nothing here needs the fork."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from sim.analysis.agent_bench import CARD_V250
from sim.cli import main
from sim.conformance import fork_backend, fork_venv
from sim.model_specs import build_worker_specs
from sim.scenario import load_scenario
from sim.vllm_bridge.fork_server import decode_spec, switch_pins

SCENARIO = "scenarios/conformance/prefix-hits.yaml"
FILE = "vllm/v1/core/sched/scheduler.py"
BASE = b"x = 1\n"
PATCHED = b"x = 2\n"


def _diff(old_blob: str, new_blob: str) -> str:
    return textwrap.dedent(
        f"""\
        diff --git a/vllm/README.md b/vllm/README.md
        index 1111111..2222222 100644
        --- a/vllm/README.md
        +++ b/vllm/README.md
        @@ -1 +1 @@
        -a
        +b
        diff --git a/{FILE} b/{FILE}
        index {old_blob}..{new_blob} 100644
        --- a/{FILE}
        +++ b/{FILE}
        @@ -1 +1 @@
        -x = 1
        +x = 2
        """
    )


def _fake_base(venv: Path) -> None:
    """vLLM 0.30.0's file, as the package index would install it."""
    site = Path(fork_venv._site_packages(venv))
    (site / FILE).parent.mkdir(parents=True)
    (site / FILE).write_bytes(BASE)


def _good_diff(tmp_path: Path) -> Path:
    diff = tmp_path / "v9.9.9-combined.diff"
    blobs = fork_venv.git_blob_id(BASE)[:10], fork_venv.git_blob_id(PATCHED)[:10]
    diff.write_text(_diff(*blobs))
    return diff


def test_a_good_diff_builds_once_and_is_cached(tmp_path):
    root, installs = tmp_path / "cache", []

    def install(venv: Path) -> None:
        installs.append(venv)
        _fake_base(venv)

    diff = _good_diff(tmp_path)
    python = fork_venv.fork_python(diff, root=root, install=install)
    site = Path(fork_venv._site_packages(python.parent.parent))
    assert (site / FILE).read_bytes() == PATCHED
    assert (python.parent.parent.parent / fork_venv.MARKER).is_file()
    # Only the scheduler-side section was applied (the README's is not).
    assert [s.path for s in fork_venv.scheduler_sections(diff)] == [FILE]
    assert fork_venv.fork_python(diff, root=root, install=install) == python
    assert len(installs) == 1
    assert [p.name for p in root.iterdir()] == [python.parent.parent.parent.name]


def test_a_checkout_uses_its_newest_combined_diff(tmp_path):
    for version in ("v2.2/v2.2.0", "v2.5/v2.5.1", "v2.5/v2.5.0"):
        path = tmp_path / "release" / f"{version}-combined.diff"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
    assert fork_venv.combined_diff(tmp_path).name == "v2.5.1-combined.diff"


def test_a_diff_against_another_base_is_refused_and_nothing_is_kept(tmp_path):
    root = tmp_path / "cache"
    diff = tmp_path / "other.diff"
    diff.write_text(_diff("1234567890", fork_venv.git_blob_id(PATCHED)[:10]))
    with pytest.raises(fork_venv.ForkBuildError, match=r"blob 1234567890 is not vLLM 0\.30\.0's file"):
        fork_venv.fork_python(diff, root=root, install=_fake_base)
    assert list(root.iterdir()) == []  # the half-built environment is gone


def test_a_diff_that_does_not_give_its_new_blob_is_refused(tmp_path):
    root = tmp_path / "cache"
    diff = tmp_path / "bad.diff"
    diff.write_text(_diff(fork_venv.git_blob_id(BASE)[:10], "abcdef0123"))
    with pytest.raises(fork_venv.ForkBuildError, match="after applying, not the diff's blob abcdef0123"):
        fork_venv.fork_python(diff, root=root, install=_fake_base)
    assert list(root.iterdir()) == []


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp: tmp, "neither a fork checkout"),
        (lambda tmp: tmp / "missing.diff", "neither a fork checkout"),
        (lambda tmp: _write(tmp / "notes.txt", "not a diff\n"), "no section of the fork's scheduler files"),
    ],
)
def test_a_path_that_is_no_fork_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch, make, message):
    monkeypatch.setenv("KVSIM_FORK_CACHE", str(tmp_path / "cache"))
    assert main(["conform", SCENARIO, "--fork", str(make(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "cache").exists()


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_no_package_index_is_one_line_exit_2_and_nothing_kept(tmp_path, capsys, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVSIM_FORK_CACHE", str(cache))
    # An index nobody listens on (the loopback discard port), no config.
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple/")
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    assert main(["conform", SCENARIO, "--fork", str(_good_diff(tmp_path))]) == 2
    err = capsys.readouterr().err.strip()
    assert "installing vLLM 0.30.0 from the package index" in err and len(err.splitlines()) == 1
    assert list(cache.iterdir()) == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--mtp-hash-mode", "lookahead"], "the fork hashes with the EAGLE drop only"),
        (["--set", "fork.deferred_free_eviction_order=false"], "the fork's code has no switch for it"),
        (["--set", "fork.caches_at_allocation_only=false"], "the fork's code has no switch for it"),
        # 0093 acts below the block's unit, where the fork cannot turn it off.
        (
            ["--set", "deployment.block_size=4096", "--set", "deployment.prefix_match_unit=64"]
            + ["--set", "fork.mamba_hold_partial_tail=false"],
            "the fork has no switch for 0093",
        ),
    ],
)
def test_what_the_fork_cannot_run_is_one_line(tmp_path, capsys, argv, message):
    assert main(["conform", SCENARIO, "--fork", str(_good_diff(tmp_path)), *argv]) == 2
    assert message in capsys.readouterr().err


def test_record_needs_the_fork(tmp_path, capsys):
    assert main(["conform", SCENARIO, "--record", str(tmp_path / "g.jsonl.gz")]) == 2
    assert "--record: needs --fork" in capsys.readouterr().err


def test_the_card_v250_switches_reach_the_forks_side():
    """v2.5.0 as the card ran it (0093-0097 off, a block-sized match unit):
    the fork's side is told to pin no waiter and grace no turn, and keeps
    retention (VLLM_E2_MAMBA_RETAIN_CHECKPOINT, its one switch) as set."""
    shipped = load_scenario("scenarios/agent-sessions.yaml")
    v250 = load_scenario("scenarios/agent-sessions.yaml", CARD_V250.overrides)
    assert fork_backend.fork_pin_switches(shipped) == {"waiter_pins": True, "grace_pins": True}
    assert fork_backend.fork_pin_switches(v250) == {"waiter_pins": False, "grace_pins": False}
    no_retention = load_scenario("scenarios/agent-sessions.yaml", ["fork.mamba_retain_checkpoint=false"])
    for scenario, retain in ((v250, "1"), (no_retention, "0")):
        environment = fork_backend.fork_environment("on", scenario.fork.patches())
        assert environment["VLLM_E2_MAMBA_RETAIN_CHECKPOINT"] == retain


@pytest.mark.parametrize(
    ("patches", "max_pinned_waiters", "enable_grace_pins"),
    [({}, 16, True), ({"waiter_pins": False, "grace_pins": False}, 0, False)],
)
def test_the_child_turns_the_forks_pins_off_where_told(patches, max_pinned_waiters, enable_grace_pins):
    """The fork's manager has no pin switch: a bound of no waiters (its
    ``pin_waiting_hit`` then returns at once) and graces off as under a KV
    connector; told nothing, it is left as shipped (CONTROL)."""
    manager = SimpleNamespace(MAX_PINNED_WAITERS=16, enable_grace_pins=True)
    switch_pins(manager, patches)
    assert (manager.MAX_PINNED_WAITERS, manager.enable_grace_pins) == (max_pinned_waiters, enable_grace_pins)


# ------------------------------------------------------------- the child
def test_every_layer_spec_crosses_the_pipe_unchanged():
    """kvsim's encoding, decoded with the classes of the same names (here
    vLLM 0.33.0's; in the child the fork's), gives the spec back."""
    import json

    scenario = load_scenario(SCENARIO)
    _, workers = build_worker_specs(scenario.load_model(), scenario.deployment)
    for layer, spec in workers[-1].items():
        record = json.loads(json.dumps(fork_backend.encode_spec(spec)))
        assert decode_spec(record) == spec, layer


def _server(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "server.py"
    path.write_text(body)
    return path


def test_a_child_that_dies_is_one_line(tmp_path):
    server = _server(tmp_path, "import sys\nprint('boom', file=sys.stderr)\nsys.exit(3)\n")
    with fork_backend.ForkProcess(Path(sys.executable), server) as child:
        with pytest.raises(fork_backend.ForkUnavailable, match=r"stopped answering \(init\): boom"):
            child.call("init", timeout_s=30)
    assert child.process.poll() is not None


def test_a_child_that_hangs_is_stopped_at_the_bound(tmp_path):
    server = _server(tmp_path, "import time\ntime.sleep(600)\n")
    with fork_backend.ForkProcess(Path(sys.executable), server) as child:
        with pytest.raises(fork_backend.ForkUnavailable, match="stopped answering"):
            child.call("schedule", timeout_s=0.5)
    assert child.process.poll() is not None


def test_a_child_that_reports_an_error_is_one_line(tmp_path):
    server = _server(
        tmp_path,
        "import json, sys\nsys.stdin.readline()\n"
        "print(json.dumps({'error': 'init: ValueError: no'}), flush=True)\n",
    )
    with fork_backend.ForkProcess(Path(sys.executable), server) as child:
        with pytest.raises(
            fork_backend.ForkUnavailable, match="the fork's scheduler failed: init: ValueError: no"
        ):
            child.call("init", timeout_s=30)


def _fake_vllm_wheel(folder: Path) -> Path:
    """A 'vllm 0.30.0' wheel holding only the one file the diffs touch, so pip
    installs it from a local folder (no index) as it would the real one."""
    import zipfile

    folder.mkdir()
    wheel = folder / "vllm-0.30.0-py3-none-any.whl"
    info = "vllm-0.30.0.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(FILE, BASE)
        archive.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: vllm\nVersion: 0.30.0\n")
        archive.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: kvsim-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        archive.writestr(f"{info}/RECORD", "")
    return folder


def test_a_diff_against_another_base_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    """Through the command and pip (offline, from a local wheel): the diff's
    blob is not the base's file; nothing half-built is kept."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVSIM_FORK_CACHE", str(cache))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(_fake_vllm_wheel(tmp_path / "wheels")))
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    diff = tmp_path / "other.diff"
    diff.write_text(_diff("1234567890", fork_venv.git_blob_id(PATCHED)[:10]))
    assert main(["conform", SCENARIO, "--fork", str(diff)]) == 2
    err = capsys.readouterr().err.strip()
    assert "the diff's blob 1234567890 is not vLLM 0.30.0's file" in err and len(err.splitlines()) == 1
    assert list(cache.iterdir()) == []
