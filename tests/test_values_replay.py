"""Replay and ``kvsim serve`` values: what a replay records from a
``/metrics`` page that states its values (the fault server), what it sends
(each request's ``max_tokens``), how it labels request outcomes, the live
server's gauges while a known number of requests runs and waits, and
kvsim's metric definitions against vLLM 0.33.0's own (names, types and help
text read from ``vllm/v1/metrics/loggers.py`` and
``vllm/v1/spec_decode/metrics.py``; spec-decode counts as
``SpecDecodingStats.observe_draft`` defines them)."""

from __future__ import annotations

import asyncio
import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import vllm
from aiohttp.test_utils import TestClient
from helpers.fault_server import GOOD_METRICS, GOOD_PAGE_VALUES, FaultOptions, FaultServer, app_in_thread
from helpers.scenarios import scenario as make_scenario
from helpers.scenarios import write_scenario
from helpers.serve import serve_in_process
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from vllm.v1.spec_decode.metrics import SpecDecodingStats

from sim.analysis.runs import scenario_workload
from sim.cli import main
from sim.metrics import FRAMES
from sim.sched.output import ScheduledRequest, SchedulerOutput, StepOutcome
from sim.serving.client import ReplayOutcome, RequestRecord
from sim.serving.recording import requests_frame
from sim.serving.server_metrics import SCRAPED, ServerMetrics, parse_metrics

VLLM = Path(vllm.__file__).parent
# Four requests of distinct output lengths, 1 s apart (0.1 s at --speed 10).
DISTINCT_OUTPUTS = {
    "trace": "synthetic",
    "num_requests": 4,
    "arrival": {"process": "constant", "rate_per_s": 1.0},
    "prompt": {"distribution": "empirical", "values": [33, 65, 97]},
    "output": {"distribution": "empirical", "values": [2, 3, 5, 7]},
}


# ---------------------------------------------------------- the parser
def test_the_fault_servers_page_is_read_into_its_own_columns():
    assert parse_metrics(GOOD_METRICS, warn=pytest.fail) == GOOD_PAGE_VALUES


def _two_engine_page() -> str:
    """What prometheus-client (vLLM's exporter) writes for two engines."""
    registry = CollectorRegistry()
    running = Gauge("vllm:num_requests_running", "d", ["engine"], registry=registry)
    prompt = Counter("vllm:prompt_tokens", "d", ["engine"], registry=registry)
    running.labels("0").set(3)
    running.labels("1").set(4)
    prompt.labels("0").inc(10)
    prompt.labels("1").inc(5)
    return generate_latest(registry).decode()


def test_engines_add_up_and_a_missing_metric_is_nan():
    values = parse_metrics(_two_engine_page(), warn=pytest.fail)
    assert values["num_requests_running"] == 7.0
    assert values["num_prompt_total_tokens"] == 15.0  # not the _created timestamps
    others = [c for c in SCRAPED.values() if c not in ("num_requests_running", "num_prompt_total_tokens")]
    assert all(math.isnan(values[c]) for c in others)


def test_engines_add_up_on_a_page_typed_by_the_family_name():
    """``# TYPE vllm:prompt_tokens counter`` (the fault server's style) with
    two engines: the parser gives one family per sample; both count."""
    page = (
        "# TYPE vllm:prompt_tokens counter\n"
        'vllm:prompt_tokens_total{engine="0"} 10.0\n'
        'vllm:prompt_tokens_total{engine="1"} 5.0\n'
    )
    assert parse_metrics(page, warn=pytest.fail)["num_prompt_total_tokens"] == 15.0


def test_a_counter_without_a_type_line_is_read_by_its_total():
    values = parse_metrics(
        'vllm:num_preemptions_total{engine="0"} 6\nvllm:num_requests_waiting 2\n', warn=pytest.fail
    )
    assert (values["num_preemptions_total"], values["num_requests_waiting"]) == (6.0, 2.0)


def test_an_unparsable_page_is_all_nan_with_one_warning():
    warnings: list[str] = []
    values = parse_metrics("vllm:num_requests_running{engine=0 1.0\n", warnings.append)
    assert all(math.isnan(v) for v in values.values()) and len(warnings) == 1
    assert warnings[0].startswith("/metrics: unparsable page (")


# ------------------------------------------- kvsim's metrics against vLLM's
def _vllm_definitions() -> dict[str, tuple[str, str]]:
    """name -> (type, help) as vLLM 0.33.0 defines them."""
    loggers = (VLLM / "v1/metrics/loggers.py").read_text()
    found = {
        name: (kind, doc)
        for kind, name, doc in re.findall(
            r'self\._(counter|gauge)_cls\(\s*name="(vllm:[^"]+)",\s*documentation=\(?\s*"([^"]*)"', loggers
        )
    }
    spec = (VLLM / "v1/spec_decode/metrics.py").read_text()
    block = spec[spec.index('("vllm:spec_decode_num_drafts"') :]
    block = block[: block.index("]")]
    for name, doc in re.findall(r'\("(vllm:[^"]+)", "([^"]*)"\)', block):
        found[name] = ("counter", doc)  # built with self._counter_cls below the list
    return found


def test_every_vllm_metric_kvsim_serves_has_vllms_name_type_and_help():
    metrics = ServerMetrics("flash", _Plan())
    ours = {
        family.name: (family.type, family.documentation)
        for family in metrics.registry.collect()
        if family.name.startswith("vllm:") and family.name != "vllm:cache_config_info"
    }
    definitions = _vllm_definitions()
    assert len(ours) == 12  # 3 gauges, 9 counters (request_success counts aborts too)
    for name, (kind, doc) in ours.items():
        assert definitions.get(name) == (kind, doc), name
    # And every scraped metric is one kvsim serves.
    assert set(SCRAPED) <= set(ours)


class _Plan:
    block_size, num_blocks, kv_cache_tokens = 3200, 7, 22400


# vLLM's per-request histograms, which ``kvsim serve`` does not expose (a
# replay measures each request at its client instead). Any other metric the
# registry names after vLLM's must be on the page.
NOT_SERVED = {
    "vllm:request_prompt_tokens",
    "vllm:request_num_preemptions",
    "vllm:request_generation_tokens",
    "vllm:time_to_first_token_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:e2e_request_latency_seconds",
}


def _unserved(frames: dict) -> set[str]:
    """vLLM names in the registry's frames that kvsim serve's page lacks."""
    served = {family.name for family in ServerMetrics("flash", _Plan()).registry.collect()}
    named = {m.vllm_name for metrics in frames.values() for m in metrics if m.vllm_name is not None}
    return named - served


def test_every_vllm_metric_the_registry_names_is_served_unless_named_here():
    """A metric added to the registry (any frame) with a vLLM name, gauge
    or counter, fails here until ``ServerMetrics`` exposes it; a histogram
    until it is served or named in ``NOT_SERVED``."""
    assert _unserved(FRAMES) == NOT_SERVED


def test_a_registry_metric_kvsim_serve_forgot_is_caught():
    """CONTROL: a step counter given a vLLM name the server lacks."""
    forgotten = replace(FRAMES["steps"][0], vllm_name="vllm:brand_new", vllm_kind="counter")
    frames = {**FRAMES, "steps": (*FRAMES["steps"], forgotten)}
    assert _unserved(frames) == NOT_SERVED | {"vllm:brand_new"}


def _step(specs: list[int], preempted: int = 0, queries: int = 0, hits: int = 0) -> SchedulerOutput:
    scheduled = tuple(ScheduledRequest(f"r{i}", 1 + n, 10, n, 0) for i, n in enumerate(specs))
    return SchedulerOutput(
        step_index=1,
        scheduled=scheduled,
        preempted_request_ids=tuple(f"p{i}" for i in range(preempted)),
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
    )


def _values(metrics: ServerMetrics) -> dict[str, float]:
    text = metrics.exposition().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                out[family.name] = sample.value
    return out


def test_record_step_counts_as_vllm_defines_each_counter():
    """Two steps. vLLM: a draft is one request's drafts in one step
    (``observe_draft`` once per request that had drafts scheduled), its
    tokens are the drafts scheduled, accepted the tokens accepted; a
    preemption counts each preempted request; prompt tokens come from the
    caller (counted when the first token comes out)."""
    metrics = ServerMetrics("flash", _Plan())
    # Step 1: three requests, two with 3 drafts, one prefill without; two preempted.
    metrics.record_step(
        _step([3, 0, 3], preempted=2, queries=640, hits=128),
        StepOutcome(num_generated_tokens=6, num_draft_tokens=6, num_accepted_tokens=3),
        prompt_tokens=97,
    )
    # Step 2: one request with 2 drafts, none accepted.
    metrics.record_step(
        _step([2]),
        StepOutcome(num_generated_tokens=1, num_draft_tokens=2, num_accepted_tokens=0),
        prompt_tokens=0,
    )
    values = _values(metrics)
    # vLLM's own accounting of the same drafts: step 1's two requests
    # accepted 2 and 1 of their 3, step 2's none of its 2.
    vllm_stats = SpecDecodingStats.new(num_spec_tokens=3)
    for drafted, accepted in ((3, 2), (3, 1), (2, 0)):
        vllm_stats.observe_draft(num_draft_tokens=drafted, num_accepted_tokens=accepted)
    assert values["vllm:spec_decode_num_drafts"] == vllm_stats.num_drafts == 3
    assert values["vllm:spec_decode_num_draft_tokens"] == vllm_stats.num_draft_tokens == 8
    assert values["vllm:spec_decode_num_accepted_tokens"] == vllm_stats.num_accepted_tokens == 3
    assert values["vllm:num_preemptions"] == 2
    assert values["vllm:prefix_cache_queries"] == 640 and values["vllm:prefix_cache_hits"] == 128
    assert values["vllm:prompt_tokens"] == 97 and values["vllm:generation_tokens"] == 7


def test_a_step_without_drafts_counts_no_draft():
    metrics = ServerMetrics("flash", _Plan())
    metrics.record_step(_step([0, 0]), StepOutcome(num_generated_tokens=2), prompt_tokens=0)
    assert _values(metrics)["vllm:spec_decode_num_drafts"] == 0


def test_gauges_are_set_each_to_its_own_value():
    metrics = ServerMetrics("flash", _Plan())
    metrics.set_gauges(running=3, waiting=5, kv_cache_usage=0.125, max_lag_s=0.5)
    values = _values(metrics)
    assert values["vllm:num_requests_running"] == 3 and values["vllm:num_requests_waiting"] == 5
    assert values["vllm:kv_cache_usage_perc"] == 0.125 and values["kvsim:engine_max_lag_seconds"] == 0.5
    page = metrics.exposition().decode()
    assert (
        'vllm:cache_config_info{block_size="3200",kv_cache_size_tokens="22400",num_gpu_blocks="7"} 1.0'
        in page
    )


# ------------------------------------------------- the replay, end to end
class RecordingFaultServer(FaultServer):
    """The fault server, keeping each request body it was sent."""

    def __init__(self, options: FaultOptions) -> None:
        super().__init__(options)
        self.bodies: list[dict[str, Any]] = []

    async def completions(self, request):
        self.bodies.append(await request.json())
        return await super().completions(request)


def test_a_replay_records_what_the_page_states_and_sends_each_requests_length(tmp_path, capsys):
    path = write_scenario(
        tmp_path, "values", simulation={"sample_interval_s": 0.5}, workload=DISTINCT_OUTPUTS
    )
    workload = scenario_workload(
        make_scenario(tmp_path, "values", simulation={"sample_interval_s": 0.5}, workload=DISTINCT_OUTPUTS)
    )
    server = RecordingFaultServer(FaultOptions(token_delay_s=0.005))
    out = tmp_path / "out"
    with app_in_thread(server.app, start_timeout_s=10) as url:
        argv = ["replay", str(path), "--layout", "on", "--url", url, "--out", str(out), "--speed", "10"]
        assert main([*argv, "--request-timeout", "20", "--drain-timeout", "2"]) == 0
    capsys.readouterr()
    samples = pd.read_parquet(out / "samples.parquet")
    assert len(samples) >= 2
    for column, value in GOOD_PAGE_VALUES.items():
        assert (samples[column] == value).all(), column
    # Each request went out with its own output length, pinned both ways.
    sent = sorted(len(b["prompt"]) * 1000 + b["max_tokens"] for b in server.bodies)
    expected = sorted(r.prompt_len * 1000 + r.output_len for r in workload.requests)
    assert sent == expected and len(set(r.output_len for r in workload.requests)) > 1
    assert all(b["min_tokens"] == b["max_tokens"] and b["ignore_eos"] is True for b in server.bodies)
    requests = pd.read_parquet(out / "requests.parquet").sort_values("request_id")
    by_id = {r.request_id: r for r in workload.requests}
    assert list(requests["output_tokens"]) == [by_id[i].output_len for i in requests["request_id"]]
    assert list(requests["generated_tokens"]) == list(requests["output_tokens"])
    assert list(requests["prompt_tokens"]) == [by_id[i].prompt_len for i in requests["request_id"]]


def _record(request_id: str, **changes: Any) -> RequestRecord:
    base = dict(request_id=request_id, arrival_s=1.0, prompt_tokens=10, output_tokens=4)
    return RequestRecord(**{**base, **changes})


def test_the_requests_frame_labels_each_outcome():
    """Finished: the last token's time. Failed after sending: rejected, no
    finish. Failed before sending (a stop): neither. Got a token but no
    finish reason: admitted, not finished."""
    records = [
        _record(
            "done",
            sent_s=1.0,
            first_token_s=1.5,
            last_token_s=3.0,
            generated_tokens=4,
            finish_reason="length",
        ),
        _record("failed", sent_s=1.0, error="HTTP 500: boom"),
        _record("unsent", error="cancelled"),
        _record("cut", sent_s=1.0, first_token_s=2.0, last_token_s=2.5, generated_tokens=2),
    ]
    outcome = ReplayOutcome(records=records, samples=[], duration_s=5.0)
    frame = requests_frame(outcome, "s", "on").set_index("request_id")
    assert list(frame["rejected"]) == [False, True, False, False]
    assert list(frame["admitted"]) == [True, False, False, True]
    assert frame.loc["done", "finished_s"] == 3.0 and frame["finished_s"].isna().sum() == 3
    assert frame.loc["done", "ttft_s"] == pytest.approx(0.5) and frame.loc["done", "e2e_s"] == pytest.approx(
        2.0
    )
    assert frame.loc["failed", "error"] == "HTTP 500: boom" and frame.loc["done", "finish_reason"] == "length"
    assert (frame["source"] == "replay").all() and (frame["layout"] == "on").all()


# ------------------------------------------------------- the live gauges
LIVE_WORKLOAD = {
    "trace": "synthetic",
    "num_requests": 1,
    "arrival": {"process": "constant", "rate_per_s": 1.0},
    "prompt": {"distribution": "fixed", "tokens": 10},
    "output": {"distribution": "fixed", "tokens": 1},
}


def _serve(tmp_path, check, speed: float, **sections: Any) -> Any:
    sc = make_scenario(tmp_path, deployment={"max_num_seqs": 2}, workload=LIVE_WORKLOAD, **sections)
    return serve_in_process(sc, check, speed)


async def _gauges(client: TestClient) -> dict[str, float]:
    text = await (await client.get("/metrics")).text()
    return {
        f.name: sum(s.value for s in f.samples if not s.name.endswith("_created"))
        for f in text_string_to_metric_families(text)
    }


async def _complete(client: TestClient, max_tokens: int) -> None:
    body = {"prompt": list(range(64)), "max_tokens": max_tokens, "stream": False}
    response = await client.post("/v1/completions", json=body)
    assert response.status == 200
    await response.read()


def test_the_gauges_while_two_requests_run_and_three_wait(tmp_path):
    """max_num_seqs 2, five requests of 40 tokens sent at once: once the
    first step has run, 2 run and 3 wait until the first finishes."""

    async def check(client: TestClient) -> tuple[dict, dict, dict]:
        tasks = [asyncio.create_task(_complete(client, 40)) for _ in range(5)]
        seen = None
        for _ in range(500):  # bounded: 5 s at most
            gauges = await _gauges(client)
            if gauges["vllm:num_requests_running"] == 2:
                seen = gauges
                break
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
        return seen, await _gauges(client)

    # Fenced frees off: with them on, an engine gone idle still holds the
    # last step's freed blocks (no later step completes to release them).
    seen, after = _serve(
        tmp_path,
        check,
        speed=1.0,
        mtp={"acceptance_rates": [0.0, 0.0, 0.0]},
        scheduler={"defer_block_free": False},
    )
    assert seen is not None, "never saw two running"
    assert seen["vllm:num_requests_waiting"] == 3
    assert 0 < seen["vllm:kv_cache_usage_perc"] <= 1
    # All done: none running or waiting, and cached blocks count as free (vLLM's get_usage).
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0.0
    assert after["vllm:generation_tokens"] == 5 * 40 and after["vllm:prompt_tokens"] == 5 * 64


def test_spec_decode_counters_of_a_request_as_vllm_counts_them(tmp_path):
    """K = 3, the first draft always accepted, the second never: the prefill
    step samples 1 token, each decode step 2 (one accepted draft + the
    bonus). 9 tokens: 1 + 4 x 2, so 4 decode steps, each one draft of 3
    tokens with 1 accepted (``observe_draft(3, 1)`` four times)."""

    async def check(client: TestClient) -> dict:
        await _complete(client, 9)
        return await _gauges(client)

    after = _serve(tmp_path, check, speed=50.0, mtp={"acceptance_rates": [1.0, 0.0, 0.0]})
    assert after["vllm:spec_decode_num_drafts"] == 4
    assert after["vllm:spec_decode_num_draft_tokens"] == 12
    assert after["vllm:spec_decode_num_accepted_tokens"] == 4
    assert after["vllm:generation_tokens"] == 9 and after["vllm:prompt_tokens"] == 64
