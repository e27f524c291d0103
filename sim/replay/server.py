"""``kvsim serve``'s HTTP surface: vLLM's OpenAI-compatible endpoints over a
``LiveEngine`` (aiohttp). Shapes follow vLLM 0.33.0's
``entrypoints/openai/completion`` protocol: SSE chunks ``data: {...}`` with
``choices[0].text`` / ``token_ids`` (``return_token_ids``), a usage chunk
with ``stream_options.include_usage``, then ``data: [DONE]``; errors are
``{"error": {"message", "type", "code"}}``.

Text prompts are tokenised deterministically (one id per whitespace-separated
word, from a hash of the word), so equal texts share prefix-cache blocks.
Deliberate difference: a client that disconnects does not abort its request
(the simulated scheduler has no abort); the request runs to its end unseen.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from sim.replay.live_engine import LiveEngine, PromptTooLong, TokenDelta
from sim.replay.metrics import CONTENT_TYPE

# vLLM's default max_tokens for /v1/completions.
DEFAULT_MAX_TOKENS = 16
# Text prompts: word ids live below this (a small model vocabulary's size).
TEXT_VOCAB_SIZE = 32_000
# A request waits at most this long (wall seconds) for its next tokens.
TOKEN_WAIT_S = 600.0

# A max_model_len prompt as JSON token ids (aiohttp's default is 1 MiB).
MAX_BODY_BYTES = 64 << 20

ENGINE_KEY = web.AppKey("engine", LiveEngine)


def tokenize_text(text: str) -> list[int]:
    """One id per word, from the word's BLAKE2 hash (stable across runs).

    >>> ids = tokenize_text("the cat the")
    >>> len(ids), ids[0] == ids[2], ids[0] == ids[1]
    (3, True, False)
    """
    return [
        int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "big") % TEXT_VOCAB_SIZE
        for word in text.split()
    ]


class BadRequest(ValueError):
    pass


def _error(status: int, message: str) -> web.Response:
    kind = "BadRequestError" if status == 400 else "NotFoundError" if status == 404 else "InternalServerError"
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status)


def _prompt_ids(body: dict[str, Any]) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list | str):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = tokenize_text(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    else:
        raise BadRequest("prompt: expected one string or one list of token ids")
    if not ids:
        raise BadRequest("prompt: empty")
    if min(ids) < 0:
        raise BadRequest("prompt: token ids must be >= 0")
    return ids


def _max_tokens(body: dict[str, Any]) -> int:
    value = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    if value is None:
        value = DEFAULT_MAX_TOKENS
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise BadRequest(f"max_tokens: expected a positive integer, got {value!r}")
    min_tokens = body.get("min_tokens", 0)
    if not isinstance(min_tokens, int) or min_tokens < 0 or min_tokens > value:
        raise BadRequest(f"min_tokens: expected 0..max_tokens, got {min_tokens!r}")
    return value


class Completion:
    """One request's answer, built as its tokens arrive."""

    def __init__(self, engine: LiveEngine, body: dict[str, Any]) -> None:
        self.engine = engine
        self.prompt_ids = _prompt_ids(body)
        self.max_tokens = _max_tokens(body)
        model = body.get("model")
        if model not in (None, engine.model_name):
            raise LookupError(f"The model `{model}` does not exist.")
        self.return_token_ids = bool(body.get("return_token_ids"))
        options = body.get("stream_options") or {}
        self.include_usage = bool(options.get("include_usage")) if isinstance(options, dict) else False
        self.created = int(time.time())
        self.request_id = ""
        self.num_tokens = 0

    def start(self) -> asyncio.Queue[TokenDelta]:
        self.request_id, queue = self.engine.add_request(self.prompt_ids, self.max_tokens)
        return queue

    async def deltas(self, queue: asyncio.Queue[TokenDelta]) -> AsyncIterator[TokenDelta]:
        while True:
            delta = await asyncio.wait_for(queue.get(), TOKEN_WAIT_S)
            self.num_tokens += len(delta.token_ids)
            yield delta
            if delta.finished:
                return

    def choice(self, token_ids: list[int], finished: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": 0,
            "text": "".join(f" t{t}" for t in token_ids),
            "logprobs": None,
            "finish_reason": "length" if finished else None,
            "stop_reason": None,
        }
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        return choice

    def envelope(self, choices: list[dict[str, Any]], usage: dict[str, int] | None) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.engine.model_name,
            "choices": choices,
            "usage": usage,
        }

    def usage(self) -> dict[str, int]:
        prompt = len(self.prompt_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.num_tokens,
            "total_tokens": prompt + self.num_tokens,
        }


async def completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    try:
        body = await request.json()
        if not isinstance(body, dict):
            raise BadRequest("expected a JSON object")
        completion = Completion(engine, body)
        queue = completion.start()
    except (BadRequest, PromptTooLong, json.JSONDecodeError) as error:
        return _error(400, str(error))
    except LookupError as error:
        return _error(404, str(error))
    if body.get("stream"):
        return await _stream(request, completion, queue)
    token_ids: list[int] = []
    async for delta in completion.deltas(queue):
        token_ids += delta.token_ids
    return web.json_response(completion.envelope([completion.choice(token_ids, True)], completion.usage()))


async def _stream(
    request: web.Request, completion: Completion, queue: asyncio.Queue[TokenDelta]
) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)

    async def send(data: Any) -> None:
        await response.write(f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode())

    async for delta in completion.deltas(queue):
        await send(completion.envelope([completion.choice(delta.token_ids, delta.finished)], None))
    if completion.include_usage:
        await send(completion.envelope([], completion.usage()))
    await send("[DONE]")
    await response.write_eof()
    return response


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
        "max_model_len": engine.scheduler.config.max_model_len,
    }
    return web.json_response({"object": "list", "data": [card]})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[ENGINE_KEY].metrics.exposition()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def build_app(engine: LiveEngine) -> web.Application:
    """The application; the engine loop runs for as long as the app does."""
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[ENGINE_KEY] = engine

    async def engine_loop(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(engine.run())
        yield
        engine.stop()
        await asyncio.wait_for(task, 5.0)

    app.cleanup_ctx.append(engine_loop)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app
