"""What ``kvsim serve`` reads of a request and how it shapes the answer
(``sim/serving/openai_requests.py``), by value: malformed bodies answered
as vLLM 0.33.0's own server answers them (FastAPI's body parsing and vLLM's
exception handlers, run in process on the same bytes), the text and chat
prompts' ids by hand from the stated rules (BLAKE2 per word, ChatML with
Qwen's marker ids), and the answer's fields by vLLM's names."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from helpers.scenarios import NO_WORKLOAD, scenario
from helpers.serve import parsed_request, serve_in_process

import sim.serving.openai_requests as openai_requests
import sim.vllm_bridge  # noqa: F401  (sets VLLM_TARGET_DEVICE before vLLM's modules load)
from sim.serving.openai_requests import (
    IM_END_ID,
    IM_START_ID,
    Answer,
    ClientMistake,
    ParsedRequest,
    chat_token_ids,
    parse_request,
    tokenize_text,
)


def _served(tmp_path, check: Callable[[TestClient], Awaitable[Any]]) -> Any:
    sc = scenario(tmp_path, deployment={"max_num_seqs": 4}, workload=NO_WORKLOAD)
    return serve_in_process(sc, check, speed=50.0)


# ------------------------------------------- vLLM's server on the same bytes
def _vllm_front_end() -> Any:
    """vLLM 0.33.0's front end as far as a body goes before its handler
    runs: FastAPI parsing a ``CompletionRequest`` / ``ChatCompletionRequest``
    body, with the exception handlers ``init_exception_handler`` registers
    (the framework's and, for ``VLLMError``, the generic one its dispatcher
    reaches for a validation error; imported one by one, as the register
    module needs uvicorn)."""
    from fastapi import FastAPI, HTTPException
    from fastapi.exceptions import RequestValidationError
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.serve.exception_handling.handlers.exception import exception_handler
    from vllm.entrypoints.serve.exception_handling.handlers.http import http_exception_handler
    from vllm.entrypoints.serve.exception_handling.handlers.validation import validation_exception_handler
    from vllm.exceptions import VLLMError

    app = FastAPI()
    app.state.args = SimpleNamespace(log_error_stack=False)
    app.exception_handler(HTTPException)(http_exception_handler)
    app.exception_handler(RequestValidationError)(validation_exception_handler)
    for kind in (VLLMError, ValueError, TypeError, OverflowError, Exception):
        app.exception_handler(kind)(exception_handler)

    for path, model in (
        ("/v1/completions", CompletionRequest),
        ("/v1/chat/completions", ChatCompletionRequest),
    ):

        async def handler(request: Any) -> dict[str, bool]:
            return {"validated": True}

        handler.__annotations__ = {"request": model, "return": dict}  # the body's model, unquoted
        app.post(path)(handler)
    return app


async def _vllm_answer(app: Any, path: str, body: bytes) -> tuple[int, Any]:
    """One ASGI request to ``app`` (a JSON body): status and JSON answer."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    answer: dict[str, Any] = {"body": b""}

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]
        elif message["type"] == "http.response.body":
            answer["body"] += message.get("body", b"")

    await app(scope, receive, send)
    return int(answer["status"]), json.loads(answer["body"])


# Bodies vLLM's front end refuses before its handler runs (what follows it,
# the model name and the lengths, is pinned against vLLM's own functions in
# tests/test_serve.py).
COMPLETION_BODIES = [
    b'{"prompt": [1,',  # json_invalid at 14
    b'{"prompt" 1}',  # json_invalid at 10, another cause
    b"",  # no body: missing
    b"   ",  # whitespace: json_invalid at 3
    b"\xff\xfe",  # a UTF-16 mark: decodes to nothing
    b"null",  # missing
    b'"x"',  # not an object
    b"[1, 2, 3]",
    b'{"prompt": [1, 2], "max_tokens": "many"}',
    b'{"prompt": [1, 2], "max_tokens": 1.5}',
    b'{"prompt": {"bad": 1}}',  # four errors, one per union member
    b'{"prompt": ""}',  # vLLM's model validator: VLLMValidationError
    b'{"prompt": [-1]}',
    b'{"max_tokens": 3}',
    b'{"prompt": [1], "stream_options": {"include_usage": "maybe"}}',
]
CHAT_BODIES = [
    b"{}",
    b'{"messages": "x"}',
    b'{"messages": [{"content": "hi"}]}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "x"}',
    b'{"messages": [{"role": "user", "content": "hi"}], "stream": [1]}',
]


def test_malformed_bodies_are_answered_as_vllms_front_end_answers_them(tmp_path):
    """Status and body equal, byte for byte of JSON, to vLLM's front end on
    the same bytes; every one a 4xx."""
    app = _vllm_front_end()
    cases = [("/v1/completions", b) for b in COMPLETION_BODIES] + [
        ("/v1/chat/completions", b) for b in CHAT_BODIES
    ]

    async def check(client: TestClient) -> list[str]:
        problems = []
        for path, raw in cases:
            response = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
            ours = (response.status, await response.json())
            theirs = await _vllm_answer(app, path, raw)
            assert 400 <= theirs[0] < 500, (raw, theirs)
            if ours != theirs:
                problems.append(f"{path} {raw!r}: kvsim {ours}, vLLM {theirs}")
        return problems

    assert _served(tmp_path, check) == []


# ------------------------------------------------------------ the prompt ids
def _word_id(word: str) -> int:
    """The stated rule: BLAKE2b, 8-byte digest, big-endian, below 32,000."""
    return int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "big") % 32_000


def test_text_is_one_id_per_whitespace_separated_word_from_its_blake2_hash():
    assert tokenize_text(" the\tcat\n sat  the ") == [_word_id(w) for w in ("the", "cat", "sat", "the")]
    assert tokenize_text("") == [] and all(0 <= i < 32_000 for i in tokenize_text("a b c d e f g"))


def test_chat_is_chatml_with_qwens_marker_ids_and_the_generation_prompt():
    """<|im_start|> = 151644 and <|im_end|> = 151645 in Qwen's tokenizer;
    each message ``<|im_start|> role content <|im_end|>``, then
    ``<|im_start|> assistant``; text parts joined by spaces; a message
    without content has none."""
    assert (IM_START_ID, IM_END_ID) == (151_644, 151_645)
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a b"}, {"type": "text", "text": "c"}]},
        {"role": "assistant", "content": None},
    ]
    w = _word_id
    assert chat_token_ids(messages) == [
        *(151_644, w("system"), w("be"), w("brief"), 151_645),
        *(151_644, w("user"), w("a"), w("b"), w("c"), 151_645),
        *(151_644, w("assistant"), 151_645),
        *(151_644, w("assistant")),
    ]


def _parse(body: dict[str, Any], kind: str = "completion", max_model_len: int = 100) -> ParsedRequest:
    return asyncio.run(parse_request(body, kind, "flash-next", max_model_len))  # type: ignore[arg-type]


def _refusal(body: dict[str, Any], kind: str = "completion") -> tuple[int, dict[str, Any]]:
    with pytest.raises(ClientMistake) as raised:
        _parse(body, kind)
    return raised.value.status, raised.value.body["error"]


def test_a_batch_of_one_prompt_is_that_prompt():
    assert _parse({"prompt": [[7, 8, 9]]}).prompt_ids == [7, 8, 9]
    assert _parse({"prompt": ["the cat"]}).prompt_ids == tokenize_text("the cat")
    assert _parse({"prompt": "the cat"}).prompt_ids == tokenize_text("the cat")


@pytest.mark.parametrize(
    "body",
    [{"prompt": [[1, 2], [3]]}, {"prompt": ["a", "b"]}, {"prompt_embeds": "AAAA"}],
    ids=["two-id-lists", "two-texts", "embeddings"],
)
def test_more_than_one_prompt_or_none_is_vllms_400_naming_the_prompt(body):
    status, error = _refusal(body)
    assert status == 400 and error == {
        "message": "kvsim serve takes one prompt per request (parameter=prompt)",
        "type": "BadRequestError",
        "param": "prompt",
        "code": 400,
    }


def test_a_chat_part_that_is_not_text_is_refused_naming_its_message():
    image = {"type": "image_url", "image_url": {"url": "x"}}
    messages = [{"role": "user", "content": "hi"}, {"role": "user", "content": [image]}]
    status, error = _refusal({"messages": messages}, "chat")
    assert status == 400 and error["param"] == "messages" and error["type"] == "BadRequestError"
    assert error["message"] == "messages[1].content: kvsim serve takes text parts only (parameter=messages)"


def test_what_the_parse_keeps_of_a_request():
    """Streaming, usage and token ids only when asked; the budget clamped to
    the room the prompt leaves (vLLM's ``get_max_tokens``, max_model_len
    100: 97 for a 3-token prompt asking 99)."""
    plain = _parse({"prompt": [1, 2, 3], "max_tokens": 99})
    assert (plain.kind, plain.prompt_ids, plain.max_tokens) == ("completion", [1, 2, 3], 97)
    assert (plain.stream, plain.include_usage, plain.return_token_ids) == (False, False, False)
    asked = _parse(
        {
            "prompt": [1],
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
    )
    assert (asked.stream, asked.include_usage, asked.return_token_ids) == (True, True, True)
    no_usage = _parse({"prompt": [1], "stream": True, "stream_options": {"include_usage": False}})
    assert no_usage.include_usage is False
    chat = _parse({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4}, "chat")
    assert chat.kind == "chat" and chat.max_tokens == 4 and chat.prompt_ids[0] == IM_START_ID


def test_the_served_model_may_be_named_or_left_out_and_any_other_is_404():
    assert _parse({"prompt": [1], "model": "flash-next"}).prompt_ids == [1]
    assert _parse({"prompt": [1], "model": ""}).prompt_ids == [1]
    status, error = _refusal({"prompt": [1], "model": "other"})
    # vLLM's _check_model (entrypoints/serve/engine/serving.py): both names.
    assert status == 404 and error == {
        "message": "The model `other` does not exist. Valid aliases: flash-next.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }


# ---------------------------------------------------------------- the answer
def _answer(kind: str, stream: bool, return_token_ids: bool = False) -> Answer:
    parsed = parsed_request(kind, stream, return_token_ids)
    return Answer(parsed, "cmpl-4", "flash-next", created=1_700_000_000, num_tokens=2)


def test_a_completion_answer_has_vllms_fields():
    """vLLM's ``CompletionResponse`` / ``CompletionStreamResponse`` names:
    id ``cmpl-N``, object ``text_completion``, a choice's text, logprobs,
    finish_reason ("length" on the last) and stop_reason; token_ids only
    when asked; usage prompt + completion = total."""
    from vllm.entrypoints.openai.completion.protocol import CompletionResponse, CompletionStreamResponse

    answer = _answer("completion", stream=False, return_token_ids=True)
    whole = answer.envelope([answer.choice([10, 11], True)], answer.usage())
    assert whole == {
        "id": "cmpl-4",
        "object": "text_completion",
        "created": 1_700_000_000,
        "model": "flash-next",
        "choices": [
            {
                "index": 0,
                "text": " t10 t11",
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": [10, 11],
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
    CompletionResponse.model_validate(whole)
    chunk = _answer("completion", stream=True).envelope(
        [_answer("completion", True).choice([9], False)], None
    )
    assert chunk["choices"] == [
        {"index": 0, "text": " t9", "logprobs": None, "finish_reason": None, "stop_reason": None}
    ]
    assert chunk["object"] == "text_completion" and chunk["usage"] is None
    CompletionStreamResponse.model_validate(chunk)


def test_a_chat_answer_has_vllms_fields():
    """Chat: id ``chatcmpl-N``; whole, ``chat.completion`` with the
    assistant's message; streamed, ``chat.completion.chunk`` with a delta,
    the first chunk the role and empty content."""
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponse,
        ChatCompletionStreamResponse,
    )

    whole = _answer("chat", stream=False)
    body = whole.envelope([whole.choice([10], True)], whole.usage())
    assert body["id"] == "chatcmpl-4" and body["object"] == "chat.completion"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": " t10", "reasoning": None, "tool_calls": []},
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
        }
    ]
    ChatCompletionResponse.model_validate(body)
    stream = _answer("chat", stream=True)
    chunk = stream.envelope([stream.choice([10], False)], None)
    assert chunk["object"] == "chat.completion.chunk" and chunk["id"] == "chatcmpl-4"
    assert chunk["choices"][0]["delta"] == {"content": " t10"} and "message" not in chunk["choices"][0]
    first = stream.first_chat_chunk()
    assert first["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    ]
    assert first["usage"] is None and first["object"] == "chat.completion.chunk"
    for c in (chunk, first):
        ChatCompletionStreamResponse.model_validate(c)


def test_the_answers_creation_time_is_the_wall_clock_in_whole_seconds():
    parsed = _answer("completion", False).parsed
    import time

    before = int(time.time())
    created = Answer(parsed, "cmpl-0", "m").created
    assert isinstance(created, int) and before <= created <= time.time()
    assert Answer(parsed, "cmpl-0", "m").num_tokens == 0


# ------------------------------------------------------------- body bounds
def test_a_body_of_exactly_16_mib_is_read_and_one_byte_more_declared_is_413(tmp_path):
    """docs/serving.md: 16 MiB; the bound is inclusive. A body declared
    larger is refused from its Content-Length, before it is read, with
    HTTP's phrase as the type."""
    limit = 16 << 20

    async def check(client: TestClient) -> list[tuple[int, Any]]:
        raw = b'{"prompt": [1, 2], "max_tokens": 1}'
        exact = await client.post("/v1/completions", data=raw + b" " * (limit - len(raw)))
        answers = [(exact.status, await exact.json())]
        reader, writer = await asyncio.open_connection(client.host, client.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (limit + 1))
        await writer.drain()
        head = await asyncio.wait_for(reader.read(4096), 10)
        writer.close()
        status_line, _, rest = head.partition(b"\r\n")
        answers.append((int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])))
        return answers

    (status, _), (refused, body) = _served(tmp_path, check)
    assert status == 200 and refused == 413
    assert body == {
        "error": {
            "message": f"the body is larger than {limit} bytes",
            "type": "Request Entity Too Large",
            "param": None,
            "code": 413,
        }
    }


def test_a_chunked_body_past_16_mib_is_413(tmp_path):
    """A body sent in chunks declares no length: the bound is the app's
    ``client_max_size`` (16 MiB, docs/serving.md), and its refusal is the
    same 413 as a declared length's."""
    limit = 16 << 20

    async def chunks() -> Any:
        yield b'{"prompt": [1, 2], "max_tokens": 1}'
        for _ in range(16):
            yield b" " * (1 << 20)

    async def check(client: TestClient) -> tuple[int, Any]:
        response = await client.post("/v1/completions", data=chunks())
        return response.status, await response.json()

    assert _served(tmp_path, check) == (
        413,
        {
            "error": {
                "message": f"the body is larger than {limit} bytes",
                "type": "Request Entity Too Large",
                "param": None,
                "code": 413,
            }
        },
    )


def test_a_body_that_does_not_come_in_time_is_408(tmp_path, monkeypatch):
    """The body read is bounded (docs/serving.md: 30 s; 0.3 s here): half a
    body then nothing is 408 with HTTP's phrase as the type."""
    monkeypatch.setattr(openai_requests, "BODY_READ_S", 0.3)

    async def check(client: TestClient) -> tuple[int, Any]:
        reader, writer = await asyncio.open_connection(client.host, client.port)
        writer.write(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"pro')
        await writer.drain()
        head = await asyncio.wait_for(reader.read(4096), 10)
        writer.close()
        status_line, _, rest = head.partition(b"\r\n")
        return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])

    status, body = _served(tmp_path, check)
    assert status == 408
    assert body == {
        "error": {
            "message": "the body took longer than 0.3 s to arrive",
            "type": "Request Timeout",
            "param": None,
            "code": 408,
        }
    }
