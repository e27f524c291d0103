"""What ``kvsim serve`` reads of a request and how it shapes the answer, as
vLLM 0.33.0's OpenAI server does (``entrypoints/openai/completion`` and
``chat_completion``): the body parsed within bounds, validated by vLLM's own
request models and checks (``sim.vllm_bridge.openai``), errors in vLLM's
body ``{"error": {"message", "type", "param", "code"}}``; the answer's
chunks with vLLM's field names.

Text becomes token ids deterministically, one id per whitespace-separated
word from a hash of the word, so equal texts share prefix-cache blocks.
Chat messages are joined with ChatML, the template of Qwen's models
(``CHAT_TEMPLATE``), into such ids.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

from sim.vllm_bridge.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    ValidationError,
    VLLMClientError,
    VLLMValidationError,
    error_body,
    http_error_body,
    max_tokens_for,
    not_found_body,
    validation_error_body,
)

Kind = Literal["completion", "chat"]

# Text prompts: word ids live below this (a small model vocabulary's size).
TEXT_VOCAB_SIZE = 32_000
# ChatML's markers, with the ids Qwen's tokenizer gives them (above every word id).
IM_START_ID, IM_END_ID = 151_644, 151_645
CHAT_TEMPLATE = (
    "ChatML (Qwen's template): per message <|im_start|> ROLE CONTENT <|im_end|>, "
    "then <|im_start|> assistant; each marker one token (ids 151644, 151645), "
    "the role and the content one token per whitespace-separated word"
)

# What vLLM's create_error_response answers 400 (its own client errors, and
# the plain ValueError / TypeError / OverflowError that some checks raise).
CLIENT_ERRORS = (VLLMClientError, ValueError, TypeError, OverflowError)

# Bounds on a request body (docs/serving.md gives the reasons).
MAX_BODY_BYTES = 16 << 20
BODY_READ_S = 30.0


class ClientMistake(Exception):
    """An answer for a request the server refuses: status and vLLM's body."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(body["error"]["message"])
        self.status, self.body = status, body

    @classmethod
    def of(cls, status: int, message: str, kind: str, param: str | None = None) -> ClientMistake:
        return cls(status, {"error": {"message": message, "type": kind, "param": param, "code": status}})

    def response(self) -> web.Response:
        return web.json_response(self.body, status=self.status)


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


def chat_token_ids(messages: list[Any]) -> list[int]:
    """The messages through ``CHAT_TEMPLATE``, with the generation prompt.

    >>> ids = chat_token_ids([{"role": "user", "content": "hi there"}])
    >>> ids[0] == IM_START_ID and ids[4] == IM_END_ID and len(ids) == 7
    True
    """
    ids: list[int] = []
    for index, message in enumerate(messages):
        role = str(message.get("role", "")) if isinstance(message, dict) else ""
        ids += [IM_START_ID, *tokenize_text(role), *tokenize_text(_message_text(message, index)), IM_END_ID]
    return [*ids, IM_START_ID, *tokenize_text("assistant")]


def _message_text(message: Any, index: int) -> str:
    content = message.get("content") if isinstance(message, dict) else None
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if not (isinstance(part, dict) and part.get("type") == "text"):
            raise VLLMValidationError(
                f"messages[{index}].content: kvsim serve takes text parts only", parameter="messages"
            )
        parts.append(str(part.get("text", "")))
    return " ".join(parts)


# ------------------------------------------------------------------ reading
async def read_json(request: web.Request) -> Any:
    """The body as JSON, within ``MAX_BODY_BYTES`` and ``BODY_READ_S``,
    refused as FastAPI refuses it under vLLM: no body is ``None`` (a missing
    body, refused by ``parse_request``); a body that does not parse is
    a ``json_invalid`` validation error; one that nests past the parser's
    recursion limit, holds an integer past Python's digit limit or is not
    UTF-8 is "There was an error parsing the body" (400)."""
    if (request.content_length or 0) > MAX_BODY_BYTES:
        raise _too_large()
    try:
        async with asyncio.timeout(BODY_READ_S):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _too_large() from None
    except TimeoutError:
        raise ClientMistake.of(
            408, f"the body took longer than {BODY_READ_S:g} s to arrive", "Request Timeout"
        ) from None
    if not raw:  # FastAPI parses no empty body: the body is missing
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError as error:
        raise await _invalid_json(error.pos, error.msg) from None
    except (RecursionError, ValueError):  # too deep, past the digit limit, not UTF-8: FastAPI's answer
        raise ClientMistake(*await http_error_body(400, "There was an error parsing the body")) from None


def _too_large() -> ClientMistake:
    return ClientMistake.of(
        413, f"the body is larger than {MAX_BODY_BYTES} bytes", "Request Entity Too Large"
    )


async def _invalid_json(position: int, cause: str) -> ClientMistake:
    status, body = await validation_error_body(
        [
            {
                "type": "json_invalid",
                "loc": ("body", position),
                "msg": "JSON decode error",
                "input": {},
                "ctx": {"error": cause},
            }
        ]
    )
    return ClientMistake(status, body)


@dataclass(kw_only=True)
class ParsedRequest:
    kind: Kind
    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    return_token_ids: bool


async def parse_request(body: Any, kind: Kind, model_name: str, max_model_len: int) -> ParsedRequest:
    """Validate as vLLM's ``create_completion`` / ``create_chat_completion``
    do: the request model, then the model name, then the prompt's length
    and the sampling parameters."""
    model = CompletionRequest if kind == "completion" else ChatCompletionRequest
    if body is None:  # no body, or JSON null: FastAPI's missing-field error
        missing = {"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}
        raise ClientMistake(*await validation_error_body([missing]))
    try:
        # As FastAPI validates a body parameter (fastapi/_compat/v2.py).
        request = model.model_validate(body, from_attributes=True)
    except ValidationError as error:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in error.errors(include_url=False)]
        raise ClientMistake(*await validation_error_body(errors)) from None
    except CLIENT_ERRORS as error:
        raise ClientMistake(*error_body(error)) from None
    if request.model and request.model != model_name:
        raise ClientMistake(*not_found_body(request.model, model_name))
    try:
        if isinstance(request, CompletionRequest):
            prompt_ids = _prompt_ids(request)
        else:
            prompt_ids = chat_token_ids(request.messages)
        max_tokens = max_tokens_for(request, max_model_len, prompt_ids)
    except CLIENT_ERRORS as error:
        raise ClientMistake(*error_body(error)) from None
    options = request.stream_options
    return ParsedRequest(
        kind=kind,
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        stream=bool(request.stream),
        include_usage=bool(options and options.include_usage),
        return_token_ids=bool(request.return_token_ids),
    )


def _prompt_ids(request: CompletionRequest) -> list[int]:
    prompt = request.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list | str):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return tokenize_text(prompt)
    ids = [t for t in prompt if isinstance(t, int)] if isinstance(prompt, list) else []
    if isinstance(prompt, list) and len(ids) == len(prompt):
        return ids
    raise VLLMValidationError("kvsim serve takes one prompt per request", parameter="prompt")


# ---------------------------------------------------------------- answering
@dataclass
class Answer:
    """One request's answer, built as its tokens arrive (vLLM's fields)."""

    parsed: ParsedRequest
    request_id: str
    model_name: str
    created: int = field(default_factory=lambda: int(time.time()))
    num_tokens: int = 0

    @property
    def object_name(self) -> str:
        if self.parsed.kind == "completion":
            return "text_completion"
        return "chat.completion.chunk" if self.parsed.stream else "chat.completion"

    def choice(self, token_ids: list[int], finished: bool) -> dict[str, Any]:
        text = "".join(f" t{t}" for t in token_ids)
        choice: dict[str, Any] = {"index": 0}
        if self.parsed.kind == "completion":
            choice["text"] = text
        elif self.parsed.stream:
            choice["delta"] = {"content": text}
        else:
            choice["message"] = {"role": "assistant", "content": text, "reasoning": None, "tool_calls": []}
        choice |= {"logprobs": None, "finish_reason": "length" if finished else None, "stop_reason": None}
        if self.parsed.return_token_ids:
            choice["token_ids"] = token_ids
        return choice

    def first_chat_chunk(self) -> dict[str, Any]:
        """vLLM's first chat chunk: the role, no content yet."""
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return self.envelope([choice], None)

    def envelope(self, choices: list[dict[str, Any]], usage: dict[str, int] | None) -> dict[str, Any]:
        return {
            # The engine's ids are vLLM's completion ids (cmpl-N); chat's are chatcmpl-N.
            "id": self.request_id if self.parsed.kind == "completion" else "chat" + self.request_id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model_name,
            "choices": choices,
            "usage": usage,
        }

    def usage(self) -> dict[str, int]:
        prompt = len(self.parsed.prompt_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.num_tokens,
            "total_tokens": prompt + self.num_tokens,
        }
