"""``kvsim serve``'s HTTP surface: vLLM's OpenAI-compatible endpoints
(``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``,
``/metrics``) over a ``LiveEngine`` (aiohttp). Shapes follow vLLM 0.33.0:
SSE chunks ``data: {...}``, a usage chunk with
``stream_options.include_usage``, then ``data: [DONE]``; requests are read
and refused as vLLM refuses them (``openai_requests.py``).

A client that disconnects, or a request whose next tokens do not come
within ``TOKEN_WAIT_S``, is aborted in the engine (``LiveEngine.abort``):
one log line, no traceback. The server's bounds (body size, connections,
requests in flight, idle connections) are in ``docs/serving.md`` with their
reasons.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

from sim.serving import ARRIVAL_HEADER
from sim.serving.live_engine import LiveEngine, PromptTooLong, TokenDelta
from sim.serving.openai_requests import (
    MAX_BODY_BYTES,
    Answer,
    ClientMistake,
    Kind,
    ParsedRequest,
    parse_request,
    read_json,
    tokenize_text,
)
from sim.serving.server_metrics import CONTENT_TYPE

__all__ = ["build_app", "start_server", "serve", "tokenize_text"]

# A request waits at most this long (wall seconds) for its next tokens.
TOKEN_WAIT_S = 600.0
# How often a request waiting for tokens checks that its client is still there.
DISCONNECT_POLL_S = 0.25
# Requests past this many in flight are refused (429) instead of queued.
MAX_REQUESTS_IN_FLIGHT = 1024
# Connections past this many are closed at once.
MAX_CONNECTIONS = 1024
# A connection with no request for this long is closed (aiohttp's keep-alive
# timeout, which also runs from the moment a connection opens).
IDLE_CONNECTION_S = 30.0

ENGINE_KEY = web.AppKey("engine", LiveEngine)


class Bounds:
    """Requests in flight, and the connection cap once ``guard`` has the server."""

    def __init__(
        self, max_in_flight: int = MAX_REQUESTS_IN_FLIGHT, max_connections: int = MAX_CONNECTIONS
    ) -> None:
        self.max_in_flight, self.max_connections = max_in_flight, max_connections
        self.in_flight = 0
        self.num_refused_connections = 0

    def guard(self, server: web.Server) -> None:
        """Close connections past the cap as they open (aiohttp has no cap)."""
        made = server.connection_made

        def connection_made(handler: Any, transport: asyncio.Transport) -> None:
            if len(server.connections) >= self.max_connections:
                self.num_refused_connections += 1
                transport.close()
                return
            made(handler, transport)

        server.connection_made = connection_made  # type: ignore[method-assign]


BOUNDS_KEY = web.AppKey("bounds", Bounds)


def _error(status: int, message: str, kind: str) -> web.Response:
    return ClientMistake.of(status, message, kind).response()


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve_request(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve_request(request, "chat")


async def _serve_request(request: web.Request, kind: Kind) -> web.StreamResponse:
    engine, bounds = request.app[ENGINE_KEY], request.app[BOUNDS_KEY]
    if bounds.in_flight >= bounds.max_in_flight:
        return _error(
            429, f"more than {bounds.max_in_flight} requests in flight; retry later", "Too Many Requests"
        )
    bounds.in_flight += 1
    try:
        parsed = await parse_request(
            await read_json(request), kind, engine.model_name, _max_model_len(engine)
        )
        request_id, queue = engine.add_request(parsed.prompt_ids, parsed.max_tokens)
        answer = Answer(parsed, request_id, engine.model_name)
        headers = {ARRIVAL_HEADER: f"{engine.arrival_s(request_id):.6f}"}
        try:
            return await (_stream if parsed.stream else _whole)(request, answer, queue, headers)
        except asyncio.CancelledError:  # aiohttp cancels the handler of a client gone
            engine.abort(request_id, "client disconnected")
            raise
    except ClientMistake as mistake:
        return mistake.response()
    except PromptTooLong as error:  # the engine's own check (the parse catches it first)
        return _error(400, str(error), "BadRequestError")
    finally:
        bounds.in_flight -= 1


def _max_model_len(engine: LiveEngine) -> int:
    return engine.scheduler.config.max_model_len


async def _deltas(
    request: web.Request, answer: Answer, queue: asyncio.Queue[TokenDelta]
) -> AsyncIterator[TokenDelta]:
    """The request's tokens as the engine makes them; a client gone (its
    connection closing) or no tokens within ``TOKEN_WAIT_S`` aborts it.

    The client is checked at each poll and each delta: aiohttp's handler
    cancellation alone can be lost (Python 3.11's ``wait_for`` returns a
    result that is ready when the cancellation comes), and a whole answer
    writes nothing until its last token."""
    engine = request.app[ENGINE_KEY]
    waited_s = 0.0
    while True:
        try:
            delta = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
        except TimeoutError:
            waited_s += DISCONNECT_POLL_S
            _abort_if_client_gone(request, answer)
            if waited_s >= TOKEN_WAIT_S:
                engine.abort(answer.request_id, f"no tokens for {TOKEN_WAIT_S:g} s")
                raise ClientMistake.of(
                    503, "the engine gave no tokens in time", "ServiceUnavailableError"
                ) from None
            continue
        _abort_if_client_gone(request, answer)
        waited_s = 0.0
        answer.num_tokens += len(delta.token_ids)
        yield delta
        if delta.finished:
            return


def _abort_if_client_gone(request: web.Request, answer: Answer) -> None:
    if request.transport is None or request.transport.is_closing():
        request.app[ENGINE_KEY].abort(answer.request_id, "client disconnected")
        raise ConnectionResetError("client disconnected")


async def _whole(
    request: web.Request,
    answer: Answer,
    queue: asyncio.Queue[TokenDelta],
    headers: dict[str, str] | None = None,
) -> web.Response:
    token_ids: list[int] = []
    try:
        async for delta in _deltas(request, answer, queue):
            token_ids += delta.token_ids
    except ConnectionError:  # aborted; nobody reads this answer
        return web.Response(status=499)
    return web.json_response(
        answer.envelope([answer.choice(token_ids, True)], answer.usage()), headers=headers
    )


async def _stream(
    request: web.Request,
    answer: Answer,
    queue: asyncio.Queue[TokenDelta],
    headers: dict[str, str] | None = None,
) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **(headers or {})}
    )
    await response.prepare(request)

    async def send(data: Any) -> None:
        await response.write(f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode())

    try:
        await _send_events(request, answer, queue, send)
        await response.write_eof()
    except ConnectionError:  # a write found the client gone: abort, quietly
        request.app[ENGINE_KEY].abort(answer.request_id, "client disconnected")
    return response


async def _send_events(
    request: web.Request,
    answer: Answer,
    queue: asyncio.Queue[TokenDelta],
    send: Callable[[Any], Awaitable[None]],
) -> None:
    parsed: ParsedRequest = answer.parsed
    if parsed.kind == "chat":
        await send(answer.first_chat_chunk())
    try:
        async for delta in _deltas(request, answer, queue):
            await send(answer.envelope([answer.choice(delta.token_ids, delta.finished)], None))
        if parsed.include_usage:  # as vLLM's: sent only by a stream the error did not end
            await send(answer.envelope([], answer.usage()))
    except ClientMistake as mistake:  # headers are sent: the error goes as an event
        await send(mistake.body)
    await send("[DONE]")


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    card = {
        "id": engine.model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "kvsim",
        "root": engine.model_name,
        "max_model_len": _max_model_len(engine),
    }
    return web.json_response({"object": "list", "data": [card]})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[ENGINE_KEY].metrics.exposition()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def build_app(engine: LiveEngine, bounds: Bounds | None = None) -> web.Application:
    """The application; the engine loop runs for as long as the app does."""
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[ENGINE_KEY] = engine
    app[BOUNDS_KEY] = bounds or Bounds()

    async def engine_loop(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(engine.run())
        yield
        engine.stop()
        await asyncio.wait_for(task, 5.0)

    app.cleanup_ctx.append(engine_loop)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


async def start_server(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """The app listening on ``host:port`` with the server's bounds; returns
    the runner (``cleanup()`` stops it) and the port bound."""
    runner = web.AppRunner(
        app,
        handler_cancellation=True,  # a client gone cancels its handler: the request is aborted
        keepalive_timeout=IDLE_CONNECTION_S,
        shutdown_timeout=5.0,
        access_log=None,
    )
    await runner.setup()
    assert runner.server is not None
    app[BOUNDS_KEY].guard(runner.server)
    await web.TCPSite(runner, host, port).start()
    return runner, int(runner.addresses[0][1])


async def serve(app: web.Application, host: str, port: int, announce: Callable[[str], None]) -> None:
    """Serve until SIGINT or SIGTERM (``kvsim serve``)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    runner, bound = await start_server(app, host, port)
    try:
        announce(f"listening on http://{host}:{bound} (Ctrl-C to stop)")
        await stop.wait()
    finally:
        await runner.cleanup()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
