"""``kvsim serve``'s HTTP layer (``sim/serving/server.py``) by value: the
bounds ``docs/serving.md`` states, the token wait and the disconnect poll
driven by a scripted queue (no clock), and the answers over HTTP on
127.0.0.1 against vLLM 0.33.0's own shapes (its ``create_error_response``,
its model list, its stream ending) and HTTP's status phrases. Client
mistakes are 4xx, never 5xx."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from http import HTTPStatus
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from helpers.scenarios import NO_WORKLOAD, scenario
from helpers.serve import parsed_request, serve_engine
from prometheus_client.exposition import choose_encoder

import sim.serving.openai_requests as openai_requests
import sim.serving.server as server
import sim.vllm_bridge  # noqa: F401  (sets VLLM_TARGET_DEVICE before vLLM's modules load)
from sim.serving.live_engine import LiveEngine, PromptTooLong, TokenDelta
from sim.serving.openai_requests import Answer, ClientMistake
from sim.serving.server import ENGINE_KEY, Bounds, build_app

MIB = 1 << 20
TIMEOUT = object()  # a scripted ``queue.get`` that finds nothing within the poll


def _vllm_error(message: str, kind: str, status: int, param: str | None = None) -> dict[str, Any]:
    """vLLM's error body, built by vLLM's own ``create_error_response``."""
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    return create_error_response(message, kind, HTTPStatus(status), param).model_dump()


# ------------------------------------------------------------- the bounds
def test_the_bounds_are_the_ones_docs_serving_states():
    """docs/serving.md's table: 16 MiB body, 30 s to send it, 1,024
    connections, 30 s idle, 1,024 requests in flight, 600 s token wait."""
    assert openai_requests.MAX_BODY_BYTES == 16 * MIB and openai_requests.BODY_READ_S == 30.0
    assert server.MAX_CONNECTIONS == 1024 and server.IDLE_CONNECTION_S == 30.0
    assert server.MAX_REQUESTS_IN_FLIGHT == 1024 and server.TOKEN_WAIT_S == 600.0
    bounds = Bounds()
    assert (bounds.max_in_flight, bounds.max_connections) == (1024, 1024)
    assert (bounds.in_flight, bounds.num_refused_connections) == (0, 0)


# ------------------------------------------------- the token wait, scripted
class ScriptedQueue:
    """``get`` answers from a script: a delta, or ``TIMEOUT`` (raised as the
    poll's ``TimeoutError``); past the script it fails the test."""

    def __init__(self, script: list[Any]) -> None:
        self.script, self.gets = list(script), 0

    async def get(self) -> TokenDelta:
        self.gets += 1
        assert self.script, "the server waited again past the script"
        item = self.script.pop(0)
        if item is TIMEOUT:
            raise TimeoutError
        return item


class Transport:
    def __init__(self, closing: bool) -> None:
        self.closing = closing

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


def _request(transport: Transport | None) -> tuple[Any, list[tuple[str, str]]]:
    aborts: list[tuple[str, str]] = []
    engine = SimpleNamespace(abort=lambda request_id, cause: aborts.append((request_id, cause)))
    return SimpleNamespace(app={ENGINE_KEY: engine}, transport=transport), aborts


def _answer(kind: str = "completion", stream: bool = False) -> Answer:
    return Answer(parsed_request(kind, stream), "cmpl-7", "flash-next")


def _delta(token_ids: list[int], finished: bool = False) -> TokenDelta:
    return TokenDelta(token_ids=token_ids, finished=finished)


async def _collect(request: Any, answer: Answer, queue: ScriptedQueue) -> list[TokenDelta]:
    return [delta async for delta in server._deltas(request, answer, queue)]  # type: ignore[arg-type]


@pytest.fixture
def poll_one_wait_three(monkeypatch):
    """A poll of 1 s and a token wait of 3 s: the third empty poll aborts."""
    monkeypatch.setattr(server, "DISCONNECT_POLL_S", 1.0)
    monkeypatch.setattr(server, "TOKEN_WAIT_S", 3.0)


def test_the_third_empty_poll_of_a_three_second_wait_aborts_with_503(poll_one_wait_three):
    """Kills: the wait compared with ``>`` (a fourth poll), the polls not
    added up, the abort's cause, the error's status or vLLM shape."""
    request, aborts = _request(Transport(closing=False))
    queue = ScriptedQueue([TIMEOUT, TIMEOUT, TIMEOUT])
    with pytest.raises(ClientMistake) as raised:
        asyncio.run(_collect(request, _answer(), queue))
    assert queue.gets == 3 and aborts == [("cmpl-7", "no tokens for 3 s")]
    assert raised.value.status == 503
    assert raised.value.body == _vllm_error(
        "the engine gave no tokens in time", "ServiceUnavailableError", 503
    )


def test_each_delta_starts_the_token_wait_again(poll_one_wait_three):
    """Two empty polls, a token, two empty polls, the last token: four
    seconds without an abort, since no gap reaches three (the control: the
    first test's three polls in a row abort)."""
    request, aborts = _request(Transport(closing=False))
    first, last = _delta([10, 11]), _delta([12], finished=True)
    answer = _answer()
    queue = ScriptedQueue([TIMEOUT, TIMEOUT, first, TIMEOUT, TIMEOUT, last])
    assert asyncio.run(_collect(request, answer, queue)) == [first, last]
    assert aborts == [] and answer.num_tokens == 3


def test_a_finished_delta_ends_the_stream_without_waiting_again(poll_one_wait_three):
    request, aborts = _request(Transport(closing=False))
    queue = ScriptedQueue([_delta([5], finished=True)])
    assert len(asyncio.run(_collect(request, _answer(), queue))) == 1
    assert queue.gets == 1 and aborts == []


@pytest.mark.parametrize("transport", [None, Transport(closing=True)], ids=["gone", "closing"])
def test_a_client_gone_is_aborted_at_the_first_empty_poll(poll_one_wait_three, transport):
    request, aborts = _request(transport)
    queue = ScriptedQueue([TIMEOUT])
    with pytest.raises(ConnectionResetError):
        asyncio.run(_collect(request, _answer(), queue))
    assert aborts == [("cmpl-7", "client disconnected")]


def test_a_client_gone_is_aborted_at_its_next_delta_without_a_poll(poll_one_wait_three):
    """Tokens that keep coming never let the poll fire: the client is
    checked at each delta too, and the delta is not handed on."""
    request, aborts = _request(Transport(closing=True))
    with pytest.raises(ConnectionResetError):
        asyncio.run(_collect(request, _answer(), ScriptedQueue([_delta([5])])))
    assert aborts == [("cmpl-7", "client disconnected")]


def test_a_whole_answer_whose_client_left_is_499_nginx_client_closed_request(poll_one_wait_three):
    request, aborts = _request(None)
    response = asyncio.run(server._whole(request, _answer(), ScriptedQueue([TIMEOUT])))  # type: ignore[arg-type]
    assert response.status == 499 and aborts == [("cmpl-7", "client disconnected")]


# ------------------------------------------------------------ over HTTP
def _engine(tmp_path, speed: float = 50.0, **log: Any) -> LiveEngine:
    sc = scenario(tmp_path, deployment={"max_num_seqs": 4}, workload=NO_WORKLOAD)
    return LiveEngine(sc, "on", speed=speed, **log)


_served = serve_engine


async def _events(response: aiohttp.ClientResponse) -> AsyncIterator[Any]:
    """The SSE events as vLLM's clients split them: blank-line separated."""
    text = (await response.read()).decode()
    assert text.endswith("\n\n")
    for event in text[:-2].split("\n\n"):
        assert event.startswith("data: "), event
        data = event[len("data: ") :]
        yield data if data == "[DONE]" else json.loads(data)


def test_past_the_in_flight_bound_the_answer_is_429_too_many_requests(tmp_path):
    """A bound of 0: every request is refused, with HTTP's phrase as the
    type (as vLLM's handler types a framework error) and vLLM's body."""

    async def check(client: TestClient) -> tuple[int, Any]:
        response = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
        return response.status, await response.json()

    status, body = _served(_engine(tmp_path), check, Bounds(max_in_flight=0))
    assert status == 429
    assert body == _vllm_error("more than 0 requests in flight; retry later", HTTPStatus(429).phrase, 429)


def test_every_answer_gives_its_place_back(tmp_path):
    """With one place: a finished request, a refused one (404) and a
    streamed one each leave it free for the next."""
    bounds = Bounds(max_in_flight=1)

    async def check(client: TestClient) -> list[tuple[int, int]]:
        seen = []
        for body in (
            {"prompt": [1, 2], "max_tokens": 2},
            {"prompt": [1, 2], "model": "other"},
            {"prompt": [1, 2], "max_tokens": 2, "stream": True},
            {"prompt": [1, 2], "max_tokens": 2},
        ):
            response = await client.post("/v1/completions", json=body)
            await response.read()
            seen.append((response.status, bounds.in_flight))
        return seen

    assert _served(_engine(tmp_path), check, bounds) == [(200, 0), (404, 0), (200, 0), (200, 0)]


def test_the_engines_own_prompt_refusal_is_vllms_400(tmp_path):
    """The engine's check (the parse catches such prompts first, so the
    engine is made to refuse): vLLM's 400 ``BadRequestError`` body."""
    engine = _engine(tmp_path)

    def refuse(prompt_ids: list[int], max_tokens: int) -> Any:
        raise PromptTooLong("no room for an output token")

    engine.add_request = refuse  # type: ignore[method-assign]

    async def check(client: TestClient) -> tuple[int, Any]:
        response = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
        return response.status, await response.json()

    assert _served(engine, check) == (400, _vllm_error("no room for an output token", "BadRequestError", 400))


def test_a_stream_is_server_sent_events_ending_in_done(tmp_path):
    """vLLM's stream: ``text/event-stream``, each event ``data: ...`` and a
    blank line, a usage chunk when asked, ``data: [DONE]`` last; kvsim adds
    ``Cache-Control: no-cache`` (docs/serving.md). Chat's first chunk is the
    role."""

    async def check(client: TestClient) -> list[Any]:
        found = []
        for path, body in (
            ("/v1/completions", {"prompt": [1, 2, 3]}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ):
            payload = {**body, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
            response = await client.post(path, json=payload)
            assert response.status == 200
            assert response.content_type == "text/event-stream"
            assert response.headers["Cache-Control"] == "no-cache"
            found.append([event async for event in _events(response)])
        return found

    completion, chat = _served(_engine(tmp_path), check)
    for events, first_chunk in ((completion, False), (chat, True)):
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 2
        chunks = events[1:-2] if first_chunk else events[:-2]
        assert (
            sum(
                len(c["choices"][0].get("text", c["choices"][0].get("delta", {}).get("content", "")).split())
                for c in chunks
            )
            == 2
        )
    assert chat[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_a_stream_given_no_tokens_in_time_ends_with_the_error_then_done(tmp_path, monkeypatch):
    """Headers already sent, the 503 goes as an event, as vLLM's stream
    generator sends an error: ``data: {error}`` then ``data: [DONE]``, and
    no usage chunk (vLLM's is sent inside the ``try`` the error leaves)."""
    monkeypatch.setattr(server, "TOKEN_WAIT_S", 0.5)
    log: list[str] = []

    async def check(client: TestClient) -> list[Any]:
        payload = {
            "prompt": [1, 2, 3],
            "max_tokens": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        response = await client.post("/v1/completions", json=payload)
        assert response.status == 200
        return [event async for event in _events(response)]

    events = _served(_engine(tmp_path, speed=1e-4, log=log.append), check)
    assert events == [
        _vllm_error("the engine gave no tokens in time", "ServiceUnavailableError", 503),
        "[DONE]",
    ]
    assert log == ["Request cmpl-0 aborted (no tokens for 0.5 s)."]


def test_a_client_that_leaves_a_whole_answer_is_aborted_while_tokens_still_come(tmp_path):
    """A non-streamed request of 200,000 tokens decoding without a pause
    (the disconnect poll never fires): the client leaves after 0.5 s and
    aiohttp cancels the handler, which aborts the request (one log line,
    counted as ``abort``). A server that does not cancel handlers would
    decode on."""
    log: list[str] = []
    engine = _engine(tmp_path, speed=1e4, log=log.append)

    async def body(port: int) -> None:
        async with aiohttp.ClientSession() as session:
            started = time.monotonic()
            await _leave_a_whole_answer_after_half_a_second(session, port, max_tokens=200_000)
            assert engine.num_unfinished == 1 and time.monotonic() - started < 5
        await _until_finished(engine, within_s=10)

    _run_server(engine, body)
    assert log == ["Request cmpl-0 aborted (client disconnected)."]


def test_a_client_that_leaves_while_no_token_comes_is_aborted_by_the_handlers_cancellation(tmp_path):
    """An engine far too slow to give a first token (speed 1e-4) and a
    client that leaves a whole answer after 0.5 s: aiohttp cancels the
    handler (``handler_cancellation``), whose catch aborts the request (one
    log line with its cause) before the disconnect poll could."""
    log: list[str] = []
    engine = _engine(tmp_path, speed=1e-4, log=log.append)

    async def body(port: int) -> None:
        async with aiohttp.ClientSession() as session:
            await _leave_a_whole_answer_after_half_a_second(session, port, max_tokens=2)
        await _until_finished(engine, within_s=5)

    _run_server(engine, body)
    assert log == ["Request cmpl-0 aborted (client disconnected)."]


async def _leave_a_whole_answer_after_half_a_second(
    session: aiohttp.ClientSession, port: int, max_tokens: int
) -> None:
    """A non-streamed completion whose client gives up after 0.5 s."""
    with pytest.raises(TimeoutError):
        async with session.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"prompt": [1, 2, 3], "max_tokens": max_tokens},
            timeout=aiohttp.ClientTimeout(total=0.5),
        ) as response:
            await response.read()


async def _until_finished(engine: LiveEngine, within_s: float) -> None:
    """Until the engine has no unfinished request, bounded by ``within_s``."""
    deadline = time.monotonic() + within_s
    while engine.num_unfinished:
        assert time.monotonic() < deadline, f"the request still runs {within_s:g} s after its client left"
        await asyncio.sleep(0.01)


def test_models_is_vllms_model_list_with_the_scenarios_length(tmp_path):
    from vllm.entrypoints.serve.engine.protocol import ModelList

    engine = _engine(tmp_path)

    async def check(client: TestClient) -> tuple[float, Any, float]:
        before = time.time()
        body = await (await client.get("/v1/models")).json()
        return before, body, time.time()

    before, body, after = _served(engine, check)
    models = ModelList.model_validate(body)
    assert body["object"] == "list" and len(models.data) == 1
    card = body["data"][0]
    assert card["object"] == "model" and card["id"] == card["root"] == "flash-next"
    assert "owned_by" in card  # vLLM's ModelCard field (kvsim's value is its own)
    assert card["max_model_len"] == 262_144  # the scenario's deployment
    assert int(before) <= card["created"] <= after


def test_metrics_and_health(tmp_path):
    """``/metrics`` under the content type vLLM's ``make_asgi_app`` answers a
    scraper that sends no Accept header (prometheus-client's
    ``choose_encoder``); ``/health`` 200 with an empty body, as vLLM's."""

    async def check(client: TestClient) -> tuple[Any, ...]:
        metrics = await client.get("/metrics")
        health = await client.get("/health")
        return metrics.status, metrics.headers["Content-Type"], health.status, await health.read()

    content_type = choose_encoder("")[1]
    assert _served(_engine(tmp_path), check) == (200, content_type, 200, b"")


def test_a_body_between_aiohttps_default_and_16_mib_is_read(tmp_path):
    """aiohttp refuses bodies past 1 MiB unless told; ``build_app`` tells it
    16 MiB. A 2 MiB body (a small request padded with JSON whitespace) is
    answered 200, one past 16 MiB 413 with HTTP's phrase."""

    async def check(client: TestClient) -> list[tuple[int, Any]]:
        answers = []
        for pad in (2 * MIB, 16 * MIB):
            raw = b'{"prompt": [1, 2], "max_tokens": 1}'
            raw += b" " * (pad + 1 - len(raw)) if pad == 16 * MIB else b" " * pad
            response = await client.post("/v1/completions", data=raw)
            answers.append((response.status, await response.json()))
        return answers

    (ok, _), (status, body) = _served(_engine(tmp_path), check)
    assert ok == 200
    assert status == 413
    assert body == _vllm_error(f"the body is larger than {16 * MIB} bytes", HTTPStatus(413).phrase, 413)


def _run_server(
    engine: LiveEngine, body: Callable[[int], Awaitable[Any]], bounds: Bounds | None = None
) -> Any:
    """``start_server`` (the bounds and options ``kvsim serve`` uses) on
    127.0.0.1, ``body`` given its port, the runner cleaned up after."""

    async def main() -> Any:
        runner, port = await server.start_server(build_app(engine, bounds), "127.0.0.1", 0)
        try:
            return await asyncio.wait_for(body(port), 30)
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def test_an_idle_connection_is_closed_after_idle_connection_s(tmp_path, monkeypatch):
    """A connection that sends nothing is closed once the idle bound passes
    (0.3 s here): the client reads EOF. aiohttp's default (75 s) would keep
    it past the 5 s the test waits."""
    monkeypatch.setattr(server, "IDLE_CONNECTION_S", 0.3)

    async def body(port: int) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            return await asyncio.wait_for(reader.read(100), 5)
        finally:
            writer.close()

    assert _run_server(_engine(tmp_path), body) == b""


def test_no_access_log_line_per_request(tmp_path, caplog):
    """One line per abort and nothing per request (docs/serving.md): no
    record on aiohttp's access logger."""
    caplog.set_level(logging.DEBUG)

    async def body(port: int) -> int:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/health") as response:
                return response.status

    assert _run_server(_engine(tmp_path), body) == 200
    assert not [r for r in caplog.records if r.name.startswith("aiohttp.access")]


def test_the_connections_past_the_cap_are_counted(tmp_path):
    """A cap of 2: two idle connections hold it, a third and a fourth are
    closed and counted (``num_refused_connections``: 2); the two are not."""
    bounds = Bounds(max_connections=2)

    async def body(port: int) -> tuple[int, list[bytes]]:
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        await asyncio.sleep(0.2)
        refused = []
        for _ in range(2):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                refused.append(await asyncio.wait_for(reader.read(100), 5))
            except ConnectionResetError:
                refused.append(b"")
            writer.close()
        for _, w in idle:
            w.close()
        return bounds.num_refused_connections, refused

    assert _run_server(_engine(tmp_path), body, bounds) == (2, [b"", b""])


def test_a_whole_answer_holds_every_token_of_every_step(tmp_path):
    """Not streamed, seven tokens come in several steps' deltas: the answer
    holds all seven (its token ids, one text word each), as vLLM's whole
    answer holds the request's output."""

    async def check(client: TestClient) -> Any:
        body = {"prompt": [1, 2, 3], "max_tokens": 7, "return_token_ids": True}
        return await (await client.post("/v1/completions", json=body)).json()

    choice = _served(_engine(tmp_path), check)["choices"][0]
    assert len(choice["token_ids"]) == 7 and len(choice["text"].split()) == 7


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_serve_announces_its_address_and_stops_on_sigterm(tmp_path):
    """``kvsim serve``: one line with the address, on the port it was given
    and on that host only (127.0.0.2, another loopback address, finds
    nothing: no wildcard bind), then serving until SIGTERM; afterwards the
    port is closed and both signals' handlers are the defaults again."""
    lines: list[str] = []
    engine = _engine(tmp_path)
    port = _free_port()

    async def connects(host: str) -> bool:
        try:
            _, writer = await asyncio.open_connection(host, port)
        except OSError:
            return False
        writer.close()
        return True

    async def main() -> tuple[bool, bool]:
        serving = asyncio.create_task(server.serve(build_app(engine), "127.0.0.1", port, lines.append))
        while not lines:
            assert not serving.done(), serving.exception()
            await asyncio.sleep(0.01)
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/health") as response:
                assert response.status == 200
        elsewhere = await connects("127.0.0.2")
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(serving, 10)
        return elsewhere, await connects("127.0.0.1")

    elsewhere, after = asyncio.run(main())
    assert lines == [f"listening on http://127.0.0.1:{port} (Ctrl-C to stop)"]
    assert not elsewhere and not after
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert signal.getsignal(signal.SIGINT) == signal.default_int_handler


def test_a_write_that_finds_the_client_gone_aborts_the_stream(monkeypatch):
    """The stream's own catch: a write raising ``ConnectionResetError`` (the
    client went between the check and the write) aborts the request, and
    the handler returns the response without raising."""
    from aiohttp.test_utils import make_mocked_request

    aborts: list[tuple[str, str]] = []
    app = web.Application()
    app[ENGINE_KEY] = SimpleNamespace(abort=lambda request_id, cause: aborts.append((request_id, cause)))  # type: ignore[assignment]
    request = make_mocked_request("POST", "/v1/completions", app=app, transport=Transport(closing=False))

    async def write(self: Any, data: bytes) -> None:
        raise ConnectionResetError("gone")

    monkeypatch.setattr(web.StreamResponse, "write", write)
    answer = _answer(stream=True)
    response = asyncio.run(server._stream(request, answer, ScriptedQueue([_delta([1], finished=True)])))  # type: ignore[arg-type]
    assert response.status == 200 and aborts == [("cmpl-7", "client disconnected")]


def test_a_stop_gives_requests_still_running_five_seconds(tmp_path, monkeypatch):
    """``docs/serving.md``: at a stop, requests still running get 5 s to end
    before their connections close (aiohttp's own default is 60 s): the
    shutdown aiohttp makes when the runner is cleaned up is asked for 5 s."""
    asked: list[float] = []
    shutdown = web.Server.shutdown

    async def recording(self, timeout: float | None = None) -> None:
        asked.append(timeout)  # type: ignore[arg-type]
        await shutdown(self, timeout)

    monkeypatch.setattr(web.Server, "shutdown", recording)

    async def main() -> None:
        runner, _ = await server.start_server(build_app(_engine(tmp_path)), "127.0.0.1", 0)
        await runner.cleanup()

    asyncio.run(asyncio.wait_for(main(), 30))
    assert asked == [5.0]
