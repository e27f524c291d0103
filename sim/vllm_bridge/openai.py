"""vLLM 0.33.0's OpenAI-server validation, for ``kvsim serve``: the request
models (``CompletionRequest``, ``ChatCompletionRequest``: types, ranges,
empty prompts), the length checks of the renderer and input processor, the
``max_tokens`` clamp, and the error bodies (``create_error_response`` for
vLLM's exceptions, the validation handler for malformed bodies). kvsim
calls vLLM's own code for each; restated: the input processor's two prompt
length messages (a private method) and ``get_max_tokens``'s clamp (its
module imports ``orjson``, which this environment lacks).
"""

from __future__ import annotations

import json
from http import HTTPStatus
from types import SimpleNamespace
from typing import Any

from fastapi import HTTPException
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
from vllm.entrypoints.serve.exception_handling.handlers.http import http_exception_handler
from vllm.entrypoints.serve.exception_handling.handlers.validation import validation_exception_handler
from vllm.exceptions import VLLMClientError, VLLMNotFoundError, VLLMValidationError

__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "VLLMClientError",
    "VLLMNotFoundError",
    "VLLMValidationError",
    "ValidationError",
    "error_body",
    "http_error_body",
    "max_tokens_for",
    "not_found_body",
    "validation_error_body",
]

# What vLLM's validation handler reads of the request (the server's flags).
_REQUEST = SimpleNamespace(
    app=SimpleNamespace(state=SimpleNamespace(args=SimpleNamespace(log_error_stack=False)))
)


def not_found_body(model: str, served: str) -> tuple[int, dict[str, Any]]:
    """vLLM's answer to a model it does not serve (``_check_model``)."""
    message = f"The model `{model}` does not exist. Valid aliases: {served}."
    response = create_error_response(message, "NotFoundError", HTTPStatus.NOT_FOUND, "model")
    return response.error.code, response.model_dump()


def error_body(error: Exception) -> tuple[int, dict[str, Any]]:
    """vLLM's answer to an exception a handler raised: status and body."""
    response = create_error_response(error)
    return response.error.code, response.model_dump()


async def validation_error_body(errors: list[dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    """vLLM's answer (FastAPI's ``RequestValidationError`` through vLLM's
    handler) to a body that does not parse or validate. ``errors`` as
    pydantic gives them, ``loc`` starting with ``"body"``."""
    response = await validation_exception_handler(_REQUEST, RequestValidationError(errors))  # type: ignore[arg-type]
    return response.status_code, json.loads(bytes(response.body))


async def http_error_body(status: int, detail: str) -> tuple[int, dict[str, Any]]:
    """vLLM's answer to a framework ``HTTPException`` (type: the status's
    phrase), e.g. FastAPI's 400 for a body it cannot parse other than a
    ``JSONDecodeError``."""
    response = await http_exception_handler(_REQUEST, HTTPException(status, detail))  # type: ignore[arg-type]
    return response.status_code, json.loads(bytes(response.body))


def max_tokens_for(
    request: CompletionRequest | ChatCompletionRequest, max_model_len: int, prompt_token_ids: list[int]
) -> int:
    """The request's output budget as vLLM serves it, or the
    ``VLLMValidationError`` vLLM raises: more output tokens asked than
    ``max_model_len`` (the renderer's ``TokenizeParams``), a prompt past it
    or one that leaves no room for an output token (the input processor),
    an empty prompt, sampling parameters ``SamplingParams`` refuses; else
    ``max_tokens`` clamped to the room the prompt leaves
    (``get_max_tokens``). kvsim's own refusal: more than one choice
    (``n``)."""
    params = request.build_tok_params(SimpleNamespace(max_model_len=max_model_len))  # type: ignore[arg-type]
    params.apply_post_tokenization(None, {"prompt_token_ids": prompt_token_ids})
    prompt_len = len(prompt_token_ids)
    if prompt_len == 0:
        raise VLLMValidationError("The decoder prompt cannot be empty")
    if prompt_len >= max_model_len:
        raise VLLMValidationError(
            f"The decoder prompt (length {prompt_len}) plus the number of requested output tokens "
            f"(at least 1) is longer than the maximum model length of {max_model_len}. Make sure that "
            "`max_model_len` is no smaller than the number of text tokens (prompt + requested output tokens)."
        )
    asked = getattr(request, "max_completion_tokens", None)  # chat's, before max_tokens (build_tok_params)
    if asked is None:
        asked = request.max_tokens
    room = max_model_len - prompt_len  # get_max_tokens: the least of the room and the ask
    max_tokens = room if asked is None else min(room, asked)
    # The sampling parameters' own checks (max_tokens >= 1, n, temperature...).
    sampling = request.to_sampling_params(max_tokens, {})
    if sampling.n != 1:
        raise VLLMValidationError(
            f"n={sampling.n}: kvsim serve answers one choice per request", parameter="n"
        )
    return max_tokens
