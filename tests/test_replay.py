"""kvsim serve and kvsim replay: a closed loop through real HTTP on
127.0.0.1 reproduces ``kvsim run``, and faults (unreachable server, HTTP
errors, a server that dies, bad /metrics, Ctrl-C) give a one-line error or
recorded failures in whole frames, never a hang.

Every server here listens on 127.0.0.1 and is stopped in a ``finally``
(``running_server``, ``LaunchedServer.stop``); every wait in the replay has a
deadline (request, drain, boot and scrape timeouts), and the tests pass small
ones.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
from helpers.fault_server import (
    MALFORMED_METRICS,
    MISSING_METRICS,
    FaultOptions,
    app_in_thread,
    free_port,
    running_server,
)
from helpers.scenarios import write_scenario

from sim import metrics
from sim.cli import main

FAULT_SERVER = Path(__file__).parent / "helpers" / "fault_server.py"

# Eight requests in ~2 s whose prompts (1-4K tokens) and 30-token outputs
# keep a 4-sequence cap busy: requests queue, so TTFT includes waiting.
CLOSED_LOOP = {
    "trace": "synthetic",
    "num_requests": 8,
    "arrival": {"process": "poisson", "rate_per_s": 4.0},
    "prompt": {"distribution": "uniform", "lo": 1000, "hi": 4000},
    "output": {"distribution": "fixed", "tokens": 30},
}
# Faults: six short requests, 2 s apart (0.2 s at --speed 10: each one has
# finished, 5 tokens at 10 ms, before the next one goes out).
FAULTS = {
    "trace": "synthetic",
    "num_requests": 6,
    "arrival": {"process": "constant", "rate_per_s": 0.5},
    "prompt": {"distribution": "fixed", "tokens": 64},
    "output": {"distribution": "fixed", "tokens": 5},
}
SPEED = 4.0
# TTFT p50 of the replay within this fraction of the simulation's: each
# request's HTTP round trip and the server's event-loop wake-ups add wall
# milliseconds, which --speed multiplies into scenario time (about 2 % here
# at speed 4 on a loaded 2-core machine; 10 % leaves room for load spikes).
TTFT_P50_TOLERANCE = 0.10


def _scenario(tmp_path: Path, workload: dict, name: str = "replay") -> Path:
    return write_scenario(
        tmp_path,
        name,
        deployment={"max_num_seqs": 4},
        simulation={"sample_interval_s": 0.5},
        workload=workload,
    )


def _manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def _frames(out: Path) -> dict[str, pd.DataFrame]:
    return {name: pd.read_parquet(out / f"{name}.parquet") for name in ("requests", "samples", "summary")}


def agreement(sim: pd.Series, replay: pd.Series) -> list[str]:
    """What the closed loop must reproduce; an empty list means it does."""
    problems = []
    for key in ("num_admitted", "num_finished"):
        if sim[key] != replay[key]:
            problems.append(f"{key}: sim {sim[key]}, replay {replay[key]}")
    if abs(sim["peak_concurrency"] - replay["peak_concurrency"]) > 1:
        problems.append(
            f"peak_concurrency: sim {sim['peak_concurrency']}, replay {replay['peak_concurrency']}"
        )
    if abs(replay["ttft_p50_s"] - sim["ttft_p50_s"]) > TTFT_P50_TOLERANCE * sim["ttft_p50_s"]:
        problems.append(f"ttft_p50_s: sim {sim['ttft_p50_s']:.3f}, replay {replay['ttft_p50_s']:.3f}")
    return problems


def test_closed_loop_serve_and_replay_reproduce_the_simulation(tmp_path, capsys):
    path = _scenario(tmp_path, CLOSED_LOOP)
    assert main(["run", str(path), "--layout", "on", "--out", str(tmp_path / "sim")]) == 0
    server_cmd = f"{sys.executable} -m sim.cli serve {path} --layout on --port {{port}} --speed {SPEED}"
    out = tmp_path / "replay"
    argv = ["replay", str(path), "--layout", "on", "--launch", "--server-cmd", server_cmd]
    argv += ["--speed", str(SPEED), "--out", str(out), "--boot-timeout", "300", "--request-timeout", "120"]
    assert main(argv) == 0, capsys.readouterr().err
    sim, replay = _frames(tmp_path / "sim")["summary"].iloc[0], _frames(out)["summary"].iloc[0]
    assert agreement(sim, replay) == []
    manifest = _manifest(out)
    assert manifest["complete"] is True and manifest["pool_plan_check"] == "ok"
    assert manifest["frames"] == ["requests.parquet", "samples.parquet", "summary.parquet"]
    assert manifest["boot_kv_cache_tokens"] == sim["kv_cache_tokens"]
    frames = _frames(out)
    assert set(frames["requests"]["source"]) == {"replay"} and frames["requests"].columns[-1] == "source"
    # Every replay column is registered (the sim's, or a replay-only one).
    for name, frame in frames.items():
        assert metrics.unregistered(name, frame.columns, source="replay") == [], name
    assert metrics.unregistered("requests", ["sent_s"]) == ["sent_s"]  # CONTROL: not a sim column
    assert (frames["requests"]["generated_tokens"] == 30).all()
    # The scraped counters agree with the simulator's own totals.
    assert replay["prefix_cache_queries_tokens"] == sim["prefix_cache_queries_tokens"]
    samples = frames["samples"]
    assert samples["num_generation_total_tokens"].iloc[-1] == 8 * 30
    # The simulation's frames say source = sim, last; its samples carry the
    # same running totals (the last sample is taken before the last step).
    sim_frames = {
        name: pd.read_parquet(tmp_path / "sim" / f"{name}.parquet") for name in ("steps", "samples")
    }
    for frame in (*sim_frames.values(), _frames(tmp_path / "sim")["requests"]):
        assert frame.columns[-1] == "source" and set(frame["source"]) == {"sim"}
    steps = sim_frames["steps"]
    sampled = sim_frames["samples"].iloc[-1]
    before = steps[steps["time_s"] <= sampled["time_s"]]
    assert sampled["num_generation_total_tokens"] == before["num_generation_tokens"].sum()
    assert sampled["prefix_cache_queries_total_tokens"] == before["prefix_cache_queries_tokens"].sum()
    assert (out / "server-on.log").read_text().count("GPU KV cache size") == 1
    # CONTROL: the same replay against a simulation with a lower sequence
    # cap disagrees (the check can fail).
    argv = [
        "run",
        str(path),
        "--layout",
        "on",
        "--set",
        "deployment.max_num_seqs=1",
        "--out",
        str(tmp_path / "s1"),
    ]
    assert main(argv) == 0
    assert agreement(_frames(tmp_path / "s1")["summary"].iloc[0], replay) != []


def test_unreachable_url_is_one_line_and_exit_2(tmp_path, capsys):
    path = _scenario(tmp_path, FAULTS)
    out = tmp_path / "out"
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert main(["replay", str(path), "--layout", "on", "--url", url, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvsim: error: ") and err.count("\n") == 1 and "not reachable" in err
    assert not out.exists()


def _replay_url(path: Path, url: str, out: Path, *extra: str) -> int:
    argv = ["replay", str(path), "--layout", "on", "--url", url, "--out", str(out), "--speed", "10"]
    return main([*argv, "--request-timeout", "20", "--drain-timeout", "2", *extra])


def test_http_errors_are_recorded_failures_and_missing_metrics_nan_with_one_warning(tmp_path, capsys):
    path = _scenario(tmp_path, FAULTS)
    out = tmp_path / "out"
    options = FaultOptions(statuses={1: 500, 3: 400}, garbled={4}, metrics_text=MISSING_METRICS)
    with running_server(options) as url:
        assert _replay_url(path, url, out) == 0
    err = capsys.readouterr().err
    requests = _frames(out)["requests"]
    failed = requests[requests["rejected"]]
    assert sorted(failed["request_id"]) == ["r000001", "r000003", "r000004"]
    errors = list(failed.sort_values("request_id")["error"])
    assert errors[0].startswith("HTTP 500") and errors[1].startswith("HTTP 400")
    assert errors[2].startswith("malformed stream chunk")
    finished = requests[requests["finished"]]
    assert len(finished) == 3 and (finished["generated_tokens"] == 5).all()
    samples = _frames(out)["samples"]
    assert samples["num_preemptions_total"].isna().all() and samples["num_draft_total_tokens"].isna().all()
    assert (samples["kv_cache_usage_perc"] == 0.25).all()
    # One warning per missing metric, however many scrapes.
    assert err.count("no vllm:num_preemptions") == 1 and len(samples) > 1
    assert _manifest(out)["complete"] is True


def test_malformed_metrics_page_gives_nan_samples_and_one_warning(tmp_path, capsys):
    path = _scenario(tmp_path, FAULTS)
    out = tmp_path / "out"
    with running_server(FaultOptions(metrics_text=MALFORMED_METRICS)) as url:
        assert _replay_url(path, url, out) == 0
    err = capsys.readouterr().err
    assert err.count("unparsable page") == 1
    samples = _frames(out)["samples"]
    assert len(samples) > 1 and samples["num_requests_running"].isna().all()
    assert _frames(out)["requests"]["finished"].all()


def test_a_server_that_dies_mid_run_gives_failures_whole_frames_and_incomplete(tmp_path, capsys):
    path = _scenario(tmp_path, FAULTS)
    out = tmp_path / "out"
    server_cmd = f"{sys.executable} {FAULT_SERVER} --port {{port}} --die-at 2"
    argv = ["replay", str(path), "--layout", "on", "--launch", "--server-cmd", server_cmd, "--out", str(out)]
    assert main([*argv, "--speed", "10", "--request-timeout", "20", "--boot-timeout", "60"]) == 1
    captured = capsys.readouterr()
    assert "POOL PLAN MISMATCH" in captured.err  # a fault server logs no KV cache size
    requests = _frames(out)["requests"]
    assert len(requests) == 6 and list(requests["finished"]) == [True, True] + [False] * 4
    assert requests["rejected"].sum() == 4 and requests.loc[requests["rejected"], "error"].notna().all()
    manifest = _manifest(out)
    assert manifest["complete"] is False and manifest["server_lost"] is True
    assert manifest["pool_plan_check"] == "mismatch"
    assert _frames(out)["summary"]["complete"].item() == False  # noqa: E712


def test_ctrl_c_stops_sending_and_writes_an_incomplete_run(tmp_path, capsys):
    path = _scenario(tmp_path, FAULTS)
    out = tmp_path / "out"
    # Arrivals every 2 s of scenario time at speed 1: Ctrl-C after 2.5 s
    # has sent two requests of six.
    timer = threading.Timer(2.5, lambda: os.kill(os.getpid(), signal.SIGINT))
    with running_server(FaultOptions()) as url:
        timer.start()
        try:
            argv = ["replay", str(path), "--layout", "on", "--url", url, "--out", str(out)]
            assert main([*argv, "--drain-timeout", "2", "--request-timeout", "20"]) == 1
        finally:
            timer.cancel()
    requests = _frames(out)["requests"]
    assert len(requests) == 6
    sent = requests["sent_s"].notna()
    assert 1 <= sent.sum() < 6
    assert requests.loc[~sent, "error"].str.startswith("not sent").all()
    assert not requests.loc[~sent, "rejected"].any()
    manifest = _manifest(out)
    assert manifest["complete"] is False and manifest["interrupted"] is True


def test_replay_flags_are_checked(tmp_path, capsys):
    path = _scenario(tmp_path, FAULTS)
    assert main(["replay", str(path), "--layout", "on", "--launch"]) == 2
    assert "--launch needs --model" in capsys.readouterr().err
    assert main(["replay", str(path), "--layout", "on", "--url", "http://127.0.0.1:1", "--speed", "0"]) == 2
    assert "--speed" in capsys.readouterr().err


# Requests 1 s apart sharing a 6,400-token prefix (two 3,200-token blocks):
# each finishes before the next arrives, so the prefix hits do not depend
# on timing.
SHARED_PREFIX = {
    "trace": "synthetic",
    "num_requests": 4,
    "arrival": {"process": "constant", "rate_per_s": 1.0},
    "prompt": {"distribution": "fixed", "tokens": 8000},
    "output": {"distribution": "fixed", "tokens": 4},
    "shared_prefix_tokens": 6400,
}


@contextlib.contextmanager
def _kvsim_serve_in_thread(path: Path, speed: float) -> Iterator[str]:
    """``kvsim serve``'s app in a thread on 127.0.0.1 (no process start-up)."""
    from sim.scenario import load_scenario
    from sim.serving.live_engine import LiveEngine
    from sim.serving.server import build_app

    def make_app():
        return build_app(LiveEngine(load_scenario(str(path)), "on", speed=speed))

    with app_in_thread(make_app, start_timeout_s=60) as url:
        yield url


def _replay_hits(tmp_path: Path, path: Path, name: str) -> pd.Series:
    out = tmp_path / name
    with _kvsim_serve_in_thread(path, speed=10.0) as url:
        assert _replay_url(path, url, out, "--vocab-size", "151936") == 0
    return _frames(out)["summary"].iloc[0]


def test_shared_prefixes_stay_shared_below_the_vocabulary(tmp_path, monkeypatch):
    """With ``--vocab-size`` the ids change but prompts that shared a prefix
    still do: the server's prefix-cache hits equal the simulation's."""
    path = _scenario(tmp_path, SHARED_PREFIX)
    assert main(["run", str(path), "--layout", "on", "--out", str(tmp_path / "sim")]) == 0
    sim = _frames(tmp_path / "sim")["summary"].iloc[0]
    replay = _replay_hits(tmp_path, path, "replay")
    assert sim["prefix_cache_hits_tokens"] > 0
    assert replay["prefix_cache_hits_tokens"] == sim["prefix_cache_hits_tokens"]
    assert replay["prefix_cache_queries_tokens"] == sim["prefix_cache_queries_tokens"]
    # CONTROL: a mapping that is not a function of the id alone (a fresh
    # offset per prompt) breaks the sharing, and the check sees it.
    import itertools

    import sim.serving.client as client

    offsets = itertools.count(1)

    def shifted(ids: list[int], vocab: int) -> list[int]:
        offset = next(offsets)
        return [(t + offset) % vocab for t in ids]

    monkeypatch.setattr(client, "map_token_ids", shifted)
    broken = _replay_hits(tmp_path, path, "broken")
    assert broken["prefix_cache_hits_tokens"] == 0
