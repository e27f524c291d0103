"""The replay's I/O by value: the requests and samples frames from hand
records, what the client sends and records against the fault server
(``tests/helpers/fault_server.py``, whose page and streams state their
values), the token-id mapping against SplitMix64's published outputs, and
the launcher (its command, the boot-log check, a server process started
and stopped in a ``finally``). Every server listens on 127.0.0.1 and every
wait is bounded."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from helpers.fault_server import GOOD_METRICS, GOOD_PAGE_VALUES, MISSING_METRICS, app_in_thread, free_port
from helpers.scenarios import NO_WORKLOAD
from helpers.scenarios import scenario as make_scenario

from sim.serving.client import (
    ClientConfig,
    Replay,
    ReplayOutcome,
    RequestRecord,
    ServerUnreachable,
    _mix64,
    map_token_ids,
)
from sim.serving.launch import (
    BootReport,
    LaunchedServer,
    LaunchError,
    check_boot_log,
    custom_command,
    server_env,
    vllm_serve_command,
)
from sim.serving.launch import free_port as free_port_launch
from sim.serving.recording import replay_frames, requests_frame, samples_frame
from sim.serving.server_metrics import SCRAPED
from sim.workloads import WorkloadRequest

# SplitMix64 (Steele, Lea, Flood 2014; Vigna's reference splitmix64.c)
# seeded with 0: its first outputs, the finaliser applied to 1, 2, 3, 4
# times the golden gamma 0x9E3779B97F4A7C15 (the finaliser adds one gamma
# itself, so the inputs are 0, gamma, 2 gamma, 3 gamma).
GAMMA = 0x9E3779B97F4A7C15
SPLITMIX64_SEED_0 = (0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F, 0xF88BB8A8724C81EC)


def test_mix64_is_splitmix64s_finaliser():
    inputs = [(i * GAMMA) % 2**64 for i in range(4)]
    assert tuple(_mix64(x) for x in inputs) == SPLITMIX64_SEED_0


def test_token_ids_map_through_the_mix_modulo_the_vocabulary():
    assert map_token_ids([0, 0, 5], 1000) == [0xE220A8397B1DCDAF % 1000] * 2 + [_mix64(5) % 1000]
    assert map_token_ids([0], 1000) == [0xE220A8397B1DCDAF % 1000] == [535]
    assert map_token_ids([3, 70000], None) == [3, 70000]


# ------------------------------------------------------------ recording
def _record(request_id: str, **changes: Any) -> RequestRecord:
    base = dict(request_id=request_id, arrival_s=1.0, prompt_tokens=10, output_tokens=4)
    return RequestRecord(**{**base, **changes})


DONE = dict(sent_s=1.25, first_token_s=1.5, last_token_s=3.0, generated_tokens=4, finish_reason="length")


def test_the_requests_frame_has_the_runs_columns_then_the_replays_own():
    """``kvsim run``'s request columns (``sim.analysis.frames``) in its
    order, the latencies, then ``sent_s``, ``server_arrival_s``, ``finish_reason``, ``error``,
    between the labels: scenario and layout first, source last."""
    outcome = ReplayOutcome(records=[_record("a", **DONE)], samples=[], duration_s=5.0)
    frame = requests_frame(outcome, "s", "on")
    assert list(frame.columns) == [
        "scenario", "layout", "request_id", "arrival_s", "prompt_tokens", "output_tokens",
        "rejected", "admitted_s", "first_token_s", "finished_s", "num_preemptions",
        "prefix_hit_tokens", "generated_tokens", "turn", "admitted", "finished", "ttft_s",
        "queue_s", "e2e_s", "sent_s", "server_arrival_s", "finish_reason", "error", "source",
    ]  # fmt: skip
    row = frame.iloc[0]
    assert (row["scenario"], row["layout"], row["source"]) == ("s", "on", "replay")
    assert (row["arrival_s"], row["prompt_tokens"], row["output_tokens"]) == (1.0, 10, 4)
    assert (row["sent_s"], row["first_token_s"], row["finished_s"]) == (1.25, 1.5, 3.0)
    assert (row["generated_tokens"], row["turn"], row["finish_reason"]) == (4, 0, "length")
    assert row["error"] is None and not row["rejected"] and row["admitted"] and row["finished"]
    for unknown in ("admitted_s", "num_preemptions", "prefix_hit_tokens", "queue_s"):
        assert math.isnan(row[unknown]), unknown
    assert (row["ttft_s"], row["e2e_s"]) == (0.5, 2.0)


def test_an_error_after_the_finish_reason_is_not_a_finish():
    """A finish reason with an error (the stream ended without ``[DONE]``):
    rejected, admitted (it got tokens), not finished."""
    outcome = ReplayOutcome(
        records=[_record("late", **{**DONE, "error": "stream ended before the last token"})],
        samples=[],
        duration_s=5.0,
    )
    row = requests_frame(outcome, "s", "off").iloc[0]
    assert row["rejected"] and row["admitted"] and not row["finished"] and math.isnan(row["finished_s"])


def test_frames_of_a_replay_with_no_records_keep_their_columns_and_types():
    outcome = ReplayOutcome(records=[], samples=[], duration_s=0.0)
    requests = requests_frame(outcome, "s", "on")
    assert requests.empty and "error" in requests.columns and "sent_s" in requests.columns
    assert requests["rejected"].dtype == bool and requests["admitted"].dtype == bool
    assert requests["finish_reason"].dtype == object and requests["error"].dtype == object
    samples = samples_frame(outcome, "s", "on")
    assert list(samples.columns) == ["scenario", "layout", "time_s", *SCRAPED.values(), "source"]


def test_samples_are_floats_labelled_in_the_scraped_columns_order():
    sample = {"time_s": 1, **{column: i for i, column in enumerate(SCRAPED.values())}}
    frame = samples_frame(ReplayOutcome(records=[], samples=[sample], duration_s=1.0), "s", "on")
    assert list(frame.columns) == ["scenario", "layout", "time_s", *SCRAPED.values(), "source"]
    values = frame.drop(columns=["scenario", "layout", "source"])
    assert (values.dtypes == "float64").all()
    assert list(values.iloc[0]) == [1.0, *map(float, range(len(SCRAPED)))]
    assert (frame["scenario"].item(), frame["layout"].item(), frame["source"].item()) == ("s", "on", "replay")


def test_the_summary_takes_the_plans_sizes_and_puts_the_extra_keys_before_source():
    records = [_record("a", **DONE), _record("b", sent_s=1.0, error="HTTP 500: boom")]
    sample = {"time_s": 0.0, **dict.fromkeys(SCRAPED.values(), 1.0)}
    outcome = ReplayOutcome(records=records, samples=[sample], duration_s=7.5)
    plan = {"kv_cache_tokens": 1200, "num_blocks": 12}
    frames = replay_frames(outcome, scenario="s", layout="on", plan=plan, extra_summary={"complete": True})
    assert set(frames) == {"requests", "samples", "summary"} and len(frames["requests"]) == 2
    for name in ("requests", "samples"):
        frame = frames[name]
        assert list(frame["scenario"].unique()) == ["s"] and list(frame["layout"].unique()) == ["on"], name
    assert len(frames["samples"]) == 1
    summary = frames["summary"]
    assert len(summary) == 1 and list(summary.columns)[-2:] == ["complete", "source"]
    row = summary.iloc[0]
    assert (row["kv_cache_tokens"], row["num_gpu_blocks"]) == (1200.0, 12.0)
    assert isinstance(row["kv_cache_tokens"], float) and isinstance(row["num_gpu_blocks"], float)
    assert (row["scenario"], row["layout"], row["source"], row["complete"]) == ("s", "on", "replay", True)
    assert row["num_finished"] == 1 and row["duration_s"] == 7.5
    no_plan = replay_frames(outcome, scenario="s", layout="on", plan=None, extra_summary={})["summary"]
    assert math.isnan(no_plan["kv_cache_tokens"].item()) and math.isnan(no_plan["num_gpu_blocks"].item())
    assert list(no_plan.columns)[-1] == "source"


# --------------------------------------------------------------- client
class Scripted:
    """A server whose answers the test states: ``/v1/completions`` plays
    back the ``n``-th script (status, body lines, a pause before each line)
    and keeps each body it received; ``/v1/models`` and ``/metrics`` answer
    what they are given."""

    def __init__(
        self,
        scripts: list[tuple[int, list[bytes]]],
        *,
        pause_s: float = 0.0,
        models: tuple[int, str] = (200, '{"data": [{"id": "scripted"}]}'),
        metrics: tuple[int, str] = (200, GOOD_METRICS),
    ) -> None:
        self.scripts, self.pause_s, self.models, self.metrics = scripts, pause_s, models, metrics
        self.bodies: list[dict[str, Any]] = []

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        status, lines = self.scripts[len(self.bodies) - 1]
        if status != 200:
            return web.Response(status=status, body=b"".join(lines))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for line in lines:
            await asyncio.sleep(self.pause_s)
            await response.write(line)
        return response

    async def get_models(self, request: web.Request) -> web.Response:
        return web.Response(status=self.models[0], text=self.models[1])

    async def get_metrics(self, request: web.Request) -> web.Response:
        return web.Response(status=self.metrics[0], text=self.metrics[1])

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.get_models)
        app.router.add_get("/metrics", self.get_metrics)
        return app


def _spec(request_id: str, arrival_s: float, output_len: int = 2, prompt_len: int = 1) -> WorkloadRequest:
    # One chunk of id 0, one token per chunk: the prompt is [0, 1, ...][:prompt_len].
    return WorkloadRequest(
        request_id=request_id,
        arrival_s=arrival_s,
        prompt_len=prompt_len,
        output_len=output_len,
        prefix_ids=tuple(range(prompt_len)),
        prefix_unit=1,
    )


def _chunk(*, ids: list[int] | None = None, text: str = "", finish: str | None = None, usage=None) -> bytes:
    choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    return f"data: {json.dumps({'choices': [choice], 'usage': usage})}\n\n".encode()


DONE_LINE = b"data: [DONE]\n\n"


def _replay(
    server: Scripted, specs: list[WorkloadRequest], warnings: list[str] | None = None, **config: Any
) -> ReplayOutcome:
    """Run a replay of ``specs`` against ``server`` (bounded: 15 s)."""
    warn = (warnings if warnings is not None else []).append

    async def run(url: str) -> ReplayOutcome:
        settings = {"sample_interval_s": None, "request_timeout_s": 10.0, "drain_timeout_s": 1.0, **config}
        replay = Replay(tuple(specs), ClientConfig(base_url=url, **settings), warn)
        return await asyncio.wait_for(replay.run(asyncio.Event()), 15)

    with app_in_thread(server.app, start_timeout_s=10) as url:
        return asyncio.run(run(url))


def test_each_request_goes_out_as_vllm_bench_serve_sends_it():
    """``vllm bench serve``'s completions body, lengths pinned
    (``max_tokens`` = ``min_tokens``, ``ignore_eos``), greedy, streamed with
    usage and token ids; the model is the one ``/v1/models`` lists first, or
    the one given; prompt ids mapped below the vocabulary."""
    lines = [_chunk(ids=[7], finish="length"), DONE_LINE]
    server = Scripted([(200, lines)] * 2)
    _replay(server, [_spec("r0", 0.0, output_len=3), _spec("r1", 0.0, output_len=5, prompt_len=2)])
    assert sorted(server.bodies, key=lambda b: b["max_tokens"]) == [
        {
            "model": "scripted",
            "prompt": prompt,
            "max_tokens": n,
            "min_tokens": n,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        for prompt, n in (([0], 3), ([0, 1], 5))
    ]
    given = Scripted([(200, lines)], models=(200, "{}"))
    _replay(given, [_spec("r0", 0.0)], model="mine", vocab_size=1000)
    assert given.bodies[0]["model"] == "mine" and given.bodies[0]["prompt"] == [535]


def test_a_completion_is_bounded_by_the_request_timeout_and_its_connect_by_the_connect_timeout(monkeypatch):
    """``ClientConfig``: a completion may take ``request_timeout_s`` in all,
    its connection ``connect_timeout_s`` of that (a server that stops
    accepting is not waited on for the whole request timeout): the timeout
    each completion is posted with, read where aiohttp receives it."""
    posted: list[aiohttp.ClientTimeout] = []
    post = aiohttp.ClientSession.post

    def recording(self, url, **kwargs):
        if str(url).endswith("/v1/completions"):
            posted.append(kwargs["timeout"])
        return post(self, url, **kwargs)

    monkeypatch.setattr(aiohttp.ClientSession, "post", recording)
    lines = [_chunk(ids=[7], finish="length"), DONE_LINE]
    _replay(Scripted([(200, lines)] * 2), [_spec("r0", 0.0), _spec("r1", 0.0)], connect_timeout_s=3.0)
    assert [(t.total, t.connect) for t in posted] == [(10.0, 3.0), (10.0, 3.0)]


@pytest.mark.parametrize(
    ("method", "error"),
    [("post", aiohttp.ClientError), ("post", aiohttp.ClientConnectionError), ("get", aiohttp.ClientError)],
)
def test_an_errors_cause_is_cut_to_120_characters_on_one_line(monkeypatch, method, error):
    """A completion's error (any client error, a lost connection) and a
    failed ``/v1/models`` say the cause's type and its message cut to 117
    characters and "..." on one line, whatever aiohttp put in it (here 300
    characters over two lines)."""
    message = "x" * 150 + "\n" + "y" * 150
    real = getattr(aiohttp.ClientSession, method)

    def failing(self, url, **kwargs):
        if str(url).endswith("/v1/completions" if method == "post" else "/v1/models"):
            raise error(message)
        return real(self, url, **kwargs)

    monkeypatch.setattr(aiohttp.ClientSession, method, failing)
    lines = [_chunk(ids=[7], finish="length"), DONE_LINE]
    if method == "get":
        with pytest.raises(ServerUnreachable) as raised:
            _replay(Scripted([(200, lines)]), [_spec("r0", 0.0)])
        said = str(raised.value)
        cause = said[said.index("(ClientError: ") + len("(ClientError: ") : -1]
    else:
        record = _replay(Scripted([(200, lines)]), [_spec("r0", 0.0)]).records[0]
        cause = record.error.split(f"{error.__name__}: ", 1)[1]
    assert cause == "x" * 117 + "..."


def test_a_stream_is_recorded_token_by_token_and_the_servers_usage_wins():
    """Tokens counted from ``token_ids`` (2, then 1 after a choice that is
    no mapping, then 1), then from ``text`` alone (1) when a chunk has no
    ids; a chunk that is no mapping, choices that are no list, comments and
    other events count nothing; the usage chunk's ``completion_tokens`` (9)
    replaces the count; the finish reason is the last chunk's."""
    lines = [
        b": keep-alive\n\n",
        b"event: ping\n\n",
        _chunk(ids=[5, 6]),
        b"data: [1]\n\n",
        b'data: {"choices": 5}\n\n',
        f"data: {json.dumps({'choices': ['x', {'index': 0, 'token_ids': [9]}]})}\n\n".encode(),
        _chunk(ids=[7]),
        _chunk(text=" y", finish="length"),
        b'data: {"choices": [], "usage": {"completion_tokens": 9}}\n\n',
        b"data:[DONE]\n\n",
    ]
    outcome = _replay(Scripted([(200, lines)]), [_spec("r0", 0.0)])
    record = outcome.records[0]
    assert record.error is None and record.finish_reason == "length" and record.generated_tokens == 9
    without_usage = _replay(Scripted([(200, lines[:-2] + [DONE_LINE])]), [_spec("r0", 0.0)])
    assert without_usage.records[0].generated_tokens == 5 and without_usage.records[0].error is None
    assert outcome.ran_to_end and not outcome.interrupted and not outcome.server_lost


def test_times_are_wall_seconds_since_the_start_times_the_speed():
    """At speed 4 a request arriving at 1.0 goes out 0.25 wall s after the
    start (sent_s 1.0, never before); its two tokens 0.1 wall s apart are
    0.4 scenario s apart. Bounds leave 0.1 wall s for a loaded machine."""
    lines = [_chunk(ids=[1]), _chunk(ids=[2], finish="length"), DONE_LINE]
    outcome = _replay(Scripted([(200, lines)], pause_s=0.1), [_spec("r0", 1.0)], speed=4.0)
    record = outcome.records[0]
    assert (record.request_id, record.arrival_s, record.prompt_tokens, record.output_tokens) == (
        "r0",
        1.0,
        1,
        2,
    )
    assert 1.0 <= record.sent_s < 1.4
    assert record.sent_s + 0.4 <= record.first_token_s < record.sent_s + 0.8
    assert record.first_token_s + 0.4 <= record.last_token_s < record.first_token_s + 0.8
    assert record.last_token_s <= outcome.duration_s < record.last_token_s + 0.8


@pytest.mark.parametrize(
    ("lines", "error"),
    [
        ([_chunk(ids=[1], finish="length")], "stream ended before the last token"),
        ([_chunk(ids=[1]), DONE_LINE], "stream ended before the last token"),
        ([b"data: {not json\n\n"], "malformed stream chunk: {not json"),
        ([b'data: {"error": {"message": "x"}}\n\n'], 'server error in stream: {"message": "x"}'),
        ([b"data: " + b"[" * 100 + b"\n\n"], "malformed stream chunk: " + "[" * 77 + "..."),
        # Two bytes opening with NUL: JSON reads them as UTF-16 (RFC 8259's
        # old detection), fails, and the message shows them as UTF-8 with
        # the invalid byte replaced.
        ([b"data: \x00\xff\n\n"], "malformed stream chunk: \x00\ufffd"),
        # Not UTF-8 at all: the codec's own message.
        (
            [b"data: \xff\n\n"],
            "UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff in position 0: invalid start byte",
        ),
    ],
)
def test_a_stream_that_breaks_is_a_recorded_failure(lines, error):
    record = _replay(Scripted([(200, lines)]), [_spec("r0", 0.0)]).records[0]
    assert record.error == error


def test_an_http_error_is_its_status_and_body_on_one_line_of_at_most_200_characters():
    scripts = [(503, [b"busy\n  now"]), (400, [b"x" * 200]), (400, [b"y" * 201])]
    outcome = _replay(Scripted(scripts), [_spec(f"r{i}", 0.0) for i in range(3)])
    errors = sorted((r.error for r in outcome.records), key=len)
    assert errors == ["HTTP 503: busy now", "HTTP 400: " + "x" * 200, "HTTP 400: " + "y" * 197 + "..."]
    assert all(math.isnan(r.first_token_s) for r in outcome.records) and outcome.ran_to_end


def test_a_request_past_its_timeout_is_a_failure_and_the_run_goes_on():
    lines = [_chunk(ids=[1], finish="length"), DONE_LINE]
    outcome = _replay(Scripted([(200, lines)], pause_s=2.0), [_spec("r0", 0.0)], request_timeout_s=0.25)
    assert outcome.records[0].error == "timed out after 0.25 s" and outcome.ran_to_end


def test_a_connection_cut_mid_stream_is_a_lost_server():
    """The server closes the connection after one chunk: the request failed
    with the cause, and the outcome is not complete."""

    class Cut(Scripted):
        async def completions(self, request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(_chunk(ids=[1]))
            assert request.transport is not None
            request.transport.close()
            return response

    outcome = _replay(Cut([]), [_spec("r0", 0.0)])
    error = outcome.records[0].error
    assert error is not None and error.startswith("connection lost: ClientPayloadError: ")
    # aiohttp's own message, cut to 117 characters and "...".
    cause = error.removeprefix("connection lost: ClientPayloadError: ")
    assert cause.startswith("Response payload is not completed: <TransferEncodingError: 400, message=")
    assert len(cause) == 120 and cause.endswith("...")
    assert outcome.server_lost and not outcome.ran_to_end


@pytest.mark.parametrize(
    ("models", "cause"),
    [
        ((500, "{}"), "/v1/models answered HTTP 500"),
        ((200, '{"data": []}'), "/v1/models: no model listed"),
        ((200, '{"data": [{"name": "x"}]}'), "/v1/models: no model listed"),
        ((200, '{"data": ["x"]}'), "/v1/models: no model listed"),
        ((200, "[1]"), "/v1/models: no model listed"),
        (
            (200, "not json"),
            ": server not reachable (JSONDecodeError: Expecting value: line 1 column 1 (char 0))",
        ),
    ],
)
def test_a_server_without_a_listed_model_is_unreachable_before_anything_is_sent(models, cause):
    server = Scripted([], models=models)
    with pytest.raises(ServerUnreachable) as raised:
        _replay(server, [_spec("r0", 0.0)])
    assert str(raised.value).startswith("http://127.0.0.1:") and str(raised.value).endswith(cause)
    assert server.bodies == []


def test_a_model_list_that_never_comes_is_unreachable_after_the_connect_timeout():
    """``/v1/models`` answering only after 20 s: unreachable after the 0.3 s
    connect timeout, nothing sent (without that bound the replay would
    wait for it)."""

    class Silent(Scripted):
        async def get_models(self, request: web.Request) -> web.Response:
            await asyncio.sleep(20)
            return web.Response(text='{"data": [{"id": "late"}]}')

    server = Silent([])
    started = time.monotonic()
    with pytest.raises(ServerUnreachable) as raised:
        _replay(server, [_spec("r0", 0.0)], connect_timeout_s=0.3)
    assert time.monotonic() - started < 5.0 and server.bodies == []
    assert re.fullmatch(
        r"http://127\.0\.0\.1:\d+: server not reachable \(\w*TimeoutError: .*\)", str(raised.value)
    )


def test_a_refused_connection_is_unreachable_with_its_cause():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there

    async def run() -> None:
        replay = Replay((_spec("r0", 0.0),), ClientConfig(base_url=url, connect_timeout_s=2.0), print)
        await asyncio.wait_for(replay.run(asyncio.Event()), 20)

    with pytest.raises(ServerUnreachable) as raised:
        asyncio.run(run())
    assert str(raised.value).startswith(f"{url}: server not reachable (ClientConnectorError: ")


def test_samples_are_taken_every_interval_from_the_start_and_once_at_the_end():
    """Interval 0.5 scenario s at speed 2 (0.25 wall s), a request whose two
    lines come 0.6 wall s apart (ending at 2.4 scenario s): samples at 0,
    0.5, ..., 2.0, then one as the run ends; each the page's values."""
    lines = [_chunk(ids=[1], finish="length"), DONE_LINE]
    outcome = _replay(
        Scripted([(200, lines)], pause_s=0.6), [_spec("r0", 0.0)], speed=2.0, sample_interval_s=0.5
    )
    times = [s["time_s"] for s in outcome.samples]
    assert len(times) == 6, times
    assert times[:5] == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0], abs=0.15)
    assert 2.4 <= times[5] <= outcome.duration_s
    for sample in outcome.samples:
        assert {k: v for k, v in sample.items() if k != "time_s"} == GOOD_PAGE_VALUES


@pytest.mark.parametrize("interval", [None, 0.0])
def test_no_interval_takes_no_sample(interval):
    lines = [_chunk(ids=[1], finish="length"), DONE_LINE]
    assert _replay(Scripted([(200, lines)]), [_spec("r0", 0.0)], sample_interval_s=interval).samples == []


def test_a_page_that_cannot_be_read_is_nan_samples_and_one_warning():
    lines = [_chunk(ids=[1], finish="length"), DONE_LINE]
    warnings: list[str] = []
    outcome = _replay(
        Scripted([(200, lines)], pause_s=0.3, metrics=(500, "")),
        [_spec("r0", 0.0)],
        warnings,
        speed=10.0,
        sample_interval_s=0.5,
    )
    assert len(outcome.samples) >= 2
    assert all(math.isnan(v) for s in outcome.samples for k, v in s.items() if k != "time_s")
    assert warnings == outcome.warnings == ["/metrics: cannot read (ClientResponseError): NaN samples"]


def test_each_missing_metric_warns_once_naming_its_column():
    """The fault server's page without the preemption and spec-decode
    counters: one warning each, however many scrapes."""
    lines = [_chunk(ids=[1], finish="length"), DONE_LINE]
    warnings: list[str] = []
    outcome = _replay(
        Scripted([(200, lines)], pause_s=0.3, metrics=(200, MISSING_METRICS)),
        [_spec("r0", 0.0)],
        warnings,
        speed=10.0,
        sample_interval_s=0.5,
    )
    assert len(outcome.samples) >= 2
    assert warnings == [
        "/metrics: no vllm:num_preemptions: its column num_preemptions_total is NaN",
        "/metrics: no vllm:spec_decode_num_draft_tokens: its column num_draft_total_tokens is NaN",
        "/metrics: no vllm:spec_decode_num_accepted_tokens: its column num_accepted_total_tokens is NaN",
    ]
    assert outcome.warnings == warnings


def test_a_page_that_never_comes_is_given_up_after_the_connect_timeout():
    """``/metrics`` answering only after 20 s: each scrape gives up after
    the 0.3 s connect timeout (NaN, one warning) and the run ends at once
    (a scrape without that bound would outlive the sampler's 5.3 s wait)."""

    class Slow(Scripted):
        async def get_metrics(self, request: web.Request) -> web.Response:
            await asyncio.sleep(20)
            return web.Response(text=GOOD_METRICS)

    lines = [_chunk(ids=[1], finish="length"), DONE_LINE]
    warnings: list[str] = []
    started = time.monotonic()
    outcome = _replay(
        Slow([(200, lines)], pause_s=0.2),
        [_spec("r0", 0.0)],
        warnings,
        sample_interval_s=10.0,
        connect_timeout_s=0.3,
    )
    assert time.monotonic() - started < 5.0
    assert len(outcome.samples) == 2 and math.isnan(outcome.samples[0]["kv_cache_usage_perc"])
    assert len(warnings) == 1 and re.fullmatch(
        r"/metrics: cannot read \(\w*TimeoutError\): NaN samples", warnings[0]
    )


def test_the_last_scrape_in_flight_when_the_requests_end_is_waited_for():
    """A scrape still in flight when the last request ends is waited for
    (the wait is bounded at the connect timeout plus 5 s, not cut at once):
    the first scrape, at the start, takes 0.4 s and the one request 0.1 s,
    so the run ends with that sample, read from the page, and no other."""

    class Unhurried(Scripted):
        async def get_metrics(self, request: web.Request) -> web.Response:
            await asyncio.sleep(0.4)
            return web.Response(text=GOOD_METRICS)

    lines = [_chunk(ids=[1], finish="length"), DONE_LINE]
    outcome = _replay(
        Unhurried([(200, lines)], pause_s=0.1),
        [_spec("r0", 0.0)],
        sample_interval_s=10.0,
        connect_timeout_s=2.0,
    )
    assert [sample["kv_cache_usage_perc"] for sample in outcome.samples] == [0.25]
    assert outcome.records[0].error is None


def test_a_stop_drains_for_the_drain_timeout_then_cancels():
    """A stop 0.2 s in: the request in flight (its tokens 5 s away) gets the
    0.3 s drain, then is cancelled; the one not yet due is not sent. The
    whole run stays well under the in-flight request's 5 s."""
    lines = [_chunk(ids=[1], finish="length"), DONE_LINE]
    server = Scripted([(200, lines)] * 2, pause_s=5.0)

    async def run(url: str) -> tuple[ReplayOutcome, float]:
        config = ClientConfig(base_url=url, sample_interval_s=None, drain_timeout_s=0.3)
        stop = asyncio.Event()
        replay = Replay((_spec("r0", 0.0), _spec("r1", 60.0)), config, print)
        asyncio.get_running_loop().call_later(0.2, stop.set)
        started = time.monotonic()
        outcome = await asyncio.wait_for(replay.run(stop), 30)
        return outcome, time.monotonic() - started

    with app_in_thread(server.app, start_timeout_s=10) as url:
        outcome, wall_s = asyncio.run(run(url))
    assert 0.5 <= wall_s < 2.0
    assert [r.error for r in outcome.records] == [
        "cancelled: the replay was stopped before the request finished",
        "not sent: the replay was stopped first",
    ]
    assert math.isnan(outcome.records[1].sent_s) and outcome.interrupted and not outcome.ran_to_end


def test_a_stop_before_the_first_arrival_sends_nothing_and_is_an_interrupted_run():
    server = Scripted([])

    async def run(url: str) -> ReplayOutcome:
        stop = asyncio.Event()
        stop.set()
        config = ClientConfig(base_url=url, sample_interval_s=None)
        return await asyncio.wait_for(Replay((_spec("r0", 1.0),), config, print).run(stop), 30)

    with app_in_thread(server.app, start_timeout_s=10) as url:
        outcome = asyncio.run(run(url))
    assert outcome.interrupted is True and not outcome.ran_to_end and server.bodies == []
    assert outcome.records[0].error == "not sent: the replay was stopped first"


def test_a_replay_of_no_requests_is_complete_and_not_interrupted():
    outcome = _replay(Scripted([]), [])
    assert outcome.interrupted is False and outcome.server_lost is False and outcome.records == []


def test_a_replay_is_complete_unless_stopped_or_the_server_was_lost():
    def outcome(**flags: bool) -> bool:
        return ReplayOutcome(records=[], samples=[], duration_s=0.0, **flags).ran_to_end

    assert outcome() and not outcome(interrupted=True) and not outcome(server_lost=True)


# --------------------------------------------------------------- launch
PLAN_ON = {"kv_cache_tokens": 1234567, "side_cache_layout": True}
BOOT_ON = (
    "INFO GPU KV cache size: 1,234,567 tokens\n"
    "INFO Side-cache layout: on (VLLM_E2_SIDE_CACHE_LAYOUT); ring 2 slots ;; eagle drop ; \n"
)


def test_the_boot_log_is_read_for_its_size_layout_and_notes():
    """Thousands separators dropped; the layout's notes split at ``;``,
    stripped, empty ones dropped; matching the plan: no mismatch."""
    report = check_boot_log(BOOT_ON, PLAN_ON)
    assert (report.kv_cache_tokens, report.side_cache_layout) == (1234567, "on")
    assert report.notes == ["ring 2 slots", "eagle drop"] and report.mismatches == []
    assert report.to_dict() == {
        "boot_kv_cache_tokens": 1234567,
        "boot_side_cache_layout": "on",
        "boot_notes": ["ring 2 slots", "eagle drop"],
        "boot_mismatches": [],
    }


def test_a_boot_log_unlike_the_plan_names_each_mismatch():
    plan_off = {"kv_cache_tokens": 1000, "side_cache_layout": False}
    assert check_boot_log(BOOT_ON, plan_off).mismatches == [
        "GPU KV cache size: server 1,234,567 tokens, kvsim's plan 1,000",
        "side-cache layout: server on, kvsim off",
    ]
    off_log = "GPU KV cache size: 1000 tokens\nSide-cache layout: off (VLLM_E2_SIDE_CACHE_LAYOUT)\n"
    report = check_boot_log(off_log, plan_off)
    assert report.mismatches == [] and report.notes == [] and report.side_cache_layout == "off"
    assert check_boot_log("nothing here", PLAN_ON).mismatches == [
        "boot log has no 'GPU KV cache size: N tokens' line",
        "boot log has no 'Side-cache layout: on|off' line",
    ]
    assert BootReport().to_dict()["boot_kv_cache_tokens"] is None


def test_a_custom_command_is_split_as_a_shell_would_with_the_port_filled_in():
    assert custom_command("serve 'a b' --port {port} --x={port}", 8123) == [
        "serve", "a b", "--port", "8123", "--x=8123",
    ]  # fmt: skip


def test_a_free_port_can_be_listened_on():
    port = free_port_launch()
    assert 1024 <= port < 65536
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def _python(tmp_path: Path, code: str, grace_s: float = 0.5, **env: str) -> LaunchedServer:
    """``code`` as a server, its log two folders down (both made)."""
    return LaunchedServer(
        [sys.executable, "-c", code], env, tmp_path / "logs" / "run" / "server.log", grace_s=grace_s
    )


def _stopped(server: LaunchedServer) -> tuple[int | None, float]:
    started = time.monotonic()
    status = server.stop()
    return status, time.monotonic() - started


# Prints (to stderr, then stdout), then waits to be stopped; "ready" is
# printed once the handlers are set.
WAITER = """
import os, signal, sys, time
for name in sys.argv[1:] or os.environ.get("IGNORE", "").split():
    signal.signal(getattr(signal, name), signal.SIG_IGN)
print("stderr too", file=sys.stderr, flush=True)
print("pid", os.getpid(), "pgid", os.getpgid(0), "x", os.environ.get("KVSIM_X"), "ready", flush=True)
time.sleep(60)
"""


def _ready(server: LaunchedServer) -> str:
    deadline = time.monotonic() + 20
    while "ready" not in (text := server.log_text()):
        assert time.monotonic() < deadline and not server.exited(), text
        time.sleep(0.02)
    return text


def test_a_launched_server_runs_in_its_own_group_with_its_env_and_stops_at_sigint(tmp_path, python_ctrl_c):
    """The child inherits this process's SIGINT disposition and mask: Python's
    own here (``python_ctrl_c``), as from a terminal's shell. A 2 s grace
    leaves a loaded machine room to die of the SIGINT."""
    server = _python(tmp_path, WAITER, KVSIM_X="42", grace_s=2.0)
    try:
        text = _ready(server)
        assert f"pid {server.process.pid} pgid {server.process.pid} x 42 ready" in text
        assert text.startswith("stderr too\n")  # vLLM logs to stderr: the same log
        assert not server.exited() and server.command[:2] == [sys.executable, "-c"]
    finally:
        status, wall_s = _stopped(server)
    assert status == -signal.SIGINT and wall_s < 2.0 and server.exited()
    assert server.stop() == -signal.SIGINT  # idempotent
    assert server.log_path == tmp_path / "logs" / "run" / "server.log" and server.log_path.exists()


def test_a_launched_server_reads_nothing_from_the_launchers_stdin(tmp_path):
    """The server's stdin is ``/dev/null`` whatever the launcher's is (a
    server that prompted would otherwise wait on a terminal or steal a
    pipe's input): with this process's stdin a pipe for the launch, the
    child's fd 0 is still ``/dev/null`` (control: a child that inherits
    it reads ``pipe:[...]``)."""
    code = "import os, time; print(os.readlink('/proc/self/fd/0'), 'ready', flush=True); time.sleep(60)"
    saved, (read_end, write_end) = os.dup(0), os.pipe()
    try:
        os.dup2(read_end, 0)
        server = _python(tmp_path, code)
    finally:
        os.dup2(saved, 0)
        for fd in (saved, read_end, write_end):
            os.close(fd)
    try:
        assert _ready(server).splitlines()[-1] == "/dev/null ready"
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("ignored", "status", "grace_periods"),
    [("SIGINT", -signal.SIGTERM, 1), ("SIGINT SIGTERM", -signal.SIGKILL, 2)],
)
def test_a_server_that_ignores_a_signal_gets_the_next_after_the_grace(
    tmp_path, ignored, status, grace_periods
):
    server = _python(tmp_path, WAITER, IGNORE=ignored)
    try:
        _ready(server)
    finally:
        got, wall_s = _stopped(server)
    assert got == status
    assert 0.5 * grace_periods <= wall_s < 0.5 * grace_periods + 0.5


def test_a_server_that_cannot_be_started_is_a_launch_error(tmp_path):
    with pytest.raises(LaunchError) as raised:
        LaunchedServer(["/nonexistent/kvsim-server"], {}, tmp_path / "server.log")
    assert str(raised.value) == "cannot start '/nonexistent/kvsim-server': No such file or directory"


def _healthy(server: LaunchedServer, url: str, deadline_s: float, stop: asyncio.Event | None = None) -> float:
    async def run() -> None:
        await asyncio.wait_for(server.wait_healthy(url, deadline_s, stop or asyncio.Event()), 10)

    started = time.monotonic()
    asyncio.run(run())
    return time.monotonic() - started


def test_health_is_polled_until_it_answers_200(tmp_path):
    """The fault server as a process: healthy once it listens."""
    port = free_port_launch()
    fault = Path(__file__).parent / "helpers" / "fault_server.py"
    server = LaunchedServer(
        [sys.executable, str(fault), "--port", str(port)], {}, tmp_path / "server.log", grace_s=0.5
    )
    try:
        assert _healthy(server, f"http://127.0.0.1:{port}", 20.0) < 20.0
    finally:
        server.stop()


def test_a_server_that_exits_before_health_answers_is_a_launch_error(tmp_path):
    server = _python(tmp_path, "import sys; sys.exit(3)")
    try:
        server.process.wait(20)
        with pytest.raises(LaunchError) as raised:
            _healthy(server, f"http://127.0.0.1:{free_port_launch()}", 20.0)
    finally:
        server.stop()
    assert str(raised.value) == (
        f"server exited with status 3 before /health answered (log: {server.log_path})"
    )


def _health_app(health: Callable[[web.Request], Awaitable[web.Response]]) -> Callable[[], web.Application]:
    """An app factory for ``app_in_thread`` answering ``/health`` with ``health``."""

    def app() -> web.Application:
        application = web.Application()
        application.router.add_get("/health", health)
        return application

    return app


def test_a_server_never_healthy_is_given_up_at_the_deadline(tmp_path):
    """Nothing listens and then /health answers 503: both give up at the
    deadline (0.6 s), polling every 0.25 s."""

    async def unhealthy(request: web.Request) -> web.Response:
        return web.Response(status=503)

    app = _health_app(unhealthy)
    server = _python(tmp_path, WAITER)
    try:
        for url_context in (contextlib.nullcontext(f"http://127.0.0.1:{free_port_launch()}"),
                            app_in_thread(app, start_timeout_s=10)):  # fmt: skip
            with url_context as url, pytest.raises(LaunchError) as raised:
                wall_s = time.monotonic()
                try:
                    _healthy(server, url, 0.6)
                finally:
                    wall_s = time.monotonic() - wall_s
            assert str(raised.value) == f"server not healthy after 0.6 s (log: {server.log_path})"
            assert 0.6 <= wall_s < 1.2  # polled every 0.25 s
    finally:
        server.stop()


def test_a_health_check_that_never_answers_gives_up_after_its_two_second_poll(tmp_path):
    """``/health`` accepting and never answering: each poll is cut at 2 s,
    so a 0.6 s deadline gives up after the first poll (without that cut
    the wait outlives the deadline)."""

    async def hung(request: web.Request) -> web.Response:
        await asyncio.sleep(60)
        return web.Response(status=200)

    app = _health_app(hung)
    server = _python(tmp_path, WAITER)
    try:
        with app_in_thread(app, start_timeout_s=10) as url:
            started = time.monotonic()
            with pytest.raises(LaunchError, match="^server not healthy after 0.6 s"):
                _healthy(server, url, 0.6)
            assert 2.0 <= time.monotonic() - started < 4.0
    finally:
        server.stop()


def test_each_health_poll_is_cut_at_two_seconds(tmp_path, monkeypatch):
    """The session ``wait_healthy`` polls ``/health`` with is cut at 2 s a
    request, read where aiohttp receives it (the test above bounds the
    same cut by the wall clock, loosely)."""
    timeouts: list[aiohttp.ClientTimeout] = []
    session_init = aiohttp.ClientSession.__init__

    def recording(self, *args, **kwargs):
        timeouts.append(kwargs.get("timeout"))
        session_init(self, *args, **kwargs)

    monkeypatch.setattr(aiohttp.ClientSession, "__init__", recording)
    port = free_port_launch()
    fault = Path(__file__).parent / "helpers" / "fault_server.py"
    server = LaunchedServer(
        [sys.executable, str(fault), "--port", str(port)], {}, tmp_path / "server.log", grace_s=0.5
    )
    try:
        _healthy(server, f"http://127.0.0.1:{port}", 20.0)
    finally:
        server.stop()
    assert [(t.total, t.connect) for t in timeouts] == [(2.0, None)]


def test_the_log_is_read_with_bytes_that_are_not_utf8_replaced(tmp_path):
    code = (
        "import sys, time; sys.stdout.buffer.write(b'ok \\xff ready\\n'); sys.stdout.flush(); time.sleep(60)"
    )
    server = _python(tmp_path, code)
    try:
        assert "ok \ufffd ready" in _ready(server)
    finally:
        server.stop()


def test_a_stop_while_waiting_for_health_is_an_interrupt(tmp_path):
    """A stop already set: KeyboardInterrupt at once, as Ctrl-C (caught in
    the coroutine: a KeyboardInterrupt out of ``asyncio.run`` upsets
    CPython 3.11's later parsing in the same process)."""

    async def run(server: LaunchedServer) -> str:
        stop = asyncio.Event()
        stop.set()
        url = f"http://127.0.0.1:{free_port_launch()}"
        try:
            await server.wait_healthy(url, 20.0, stop)  # bounded by its 20 s deadline
        except KeyboardInterrupt:
            return "interrupted"
        return "healthy"

    server = _python(tmp_path, WAITER)
    try:
        assert asyncio.run(run(server)) == "interrupted"
    finally:
        server.stop()


def test_the_serve_command_with_prefix_caching_as_vllms_parser_reads_it(tmp_path):
    """The other branch of ``tests/test_serve.py``'s case (prefix caching
    on, the fork's retention on), the long-prefill threshold and the fork's
    switches, read back by vLLM's own engine-argument parser."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    import sim.vllm_bridge  # noqa: F401  (sets VLLM_TARGET_DEVICE before vLLM's parser runs)

    sc = make_scenario(
        tmp_path,
        workload=NO_WORKLOAD,
        scheduler={"max_num_batched_tokens": 2048, "long_prefill_token_threshold": 512},
        allocator={"enable_prefix_caching": True},
        fork={"mamba_retain_checkpoint": True},
    )
    command = vllm_serve_command(sc, "/models/m", port=9)
    assert command[3:7] == ["--host", "127.0.0.1", "--port", "9"]
    args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(
        ["--model", *command[2:3], *command[7:]]
    )
    assert args.enable_prefix_caching is True and args.long_prefill_token_threshold == 512
    assert args.max_num_batched_tokens == 2048
    assert server_env(sc, "on") == {
        "VLLM_E2_SIDE_CACHE_LAYOUT": "1",
        "VLLM_E2_MAMBA_RETAIN_CHECKPOINT": "1",
        "VLLM_PP_LAYER_PARTITION": ",".join(map(str, sc.deployment.layer_partition)),
    }
