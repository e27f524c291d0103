"""kvsim serve's HTTP surface, in process on 127.0.0.1: vLLM's endpoint
shapes and /metrics names and types, tokens streamed as the simulator
generates them (several per step with MTP), prefix caching across requests,
and vLLM's error answers."""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient
from helpers.scenarios import NO_WORKLOAD, scenario
from helpers.serve import serve_in_process
from prometheus_client.parser import text_string_to_metric_families

import sim.vllm_bridge  # noqa: F401  (sets VLLM_TARGET_DEVICE before vLLM's argument parser runs)
from sim.commands.serve import boot_log_lines
from sim.sched.engine_core import BatchQueueEngineCore
from sim.serving.live_engine import LiveEngine
from sim.serving.server import tokenize_text

SPEED = 50.0


def _serve(
    tmp_path, check: Callable[[TestClient], Awaitable[Any]], speed: float = SPEED, **sections: Any
) -> Any:
    """Run ``check`` against a server on 127.0.0.1, stopped afterwards."""
    sc = scenario(tmp_path, deployment={"max_num_seqs": 4}, workload=NO_WORKLOAD, **sections)
    return serve_in_process(sc, check, speed)


async def _stream(client: TestClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    response = await client.post("/v1/completions", json=payload)
    assert response.status == 200
    chunks, done = [], False
    async for raw in response.content:
        line = raw.strip()
        if line == b"data: [DONE]":
            done = True
        elif line.startswith(b"data: "):
            chunks.append(json.loads(line[6:]))
    assert done
    return chunks


async def _metrics(client: TestClient) -> dict[str, tuple[str, float]]:
    text = await (await client.get("/metrics")).text()
    found = {}
    for family in text_string_to_metric_families(text):
        samples = [s for s in family.samples if not s.name.endswith("_created")]
        if samples:
            found[family.name] = (family.type, sum(s.value for s in samples))
    return found


def _token_counts(chunks: list[dict[str, Any]]) -> list[int]:
    return [len(c["choices"][0]["token_ids"]) for c in chunks if c["choices"]]


def test_mtp_streams_several_tokens_per_step(tmp_path):
    """All drafts accepted (rates 1): the prefill step samples one token,
    every decode step the bonus token plus K=3 drafts: 9 = 1 + 4 + 4."""

    async def check(client: TestClient) -> list[dict[str, Any]]:
        return await _stream(client, {"prompt": list(range(100)), "max_tokens": 9})

    chunks = _serve(tmp_path, check, mtp={"acceptance_rates": [1.0, 1.0, 1.0]})
    assert _token_counts(chunks) == [1, 4, 4]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]] == [None, None, "length"]
    assert chunks[-1]["usage"] == {"prompt_tokens": 100, "completion_tokens": 9, "total_tokens": 109}
    # CONTROL: no draft accepted, one token per step.
    chunks = _serve(tmp_path, check, mtp={"acceptance_rates": [0.0, 0.0, 0.0]})
    assert _token_counts(chunks) == [1] * 9


@pytest.mark.parametrize("acceptance", [1.0, 0.0])
def test_async_mode_serves_through_the_batch_queue(tmp_path, acceptance):
    """``engine.mode: async``: the same engine loop over the batch queue and
    the pipeline clock. A lone request decodes every other micro-batch, all
    drafts accepted: 1 + 4 + 4 tokens, as in sync mode; none accepted: one
    token a decode (the control: the chunks follow the acceptances)."""

    async def check(client: TestClient) -> list[dict[str, Any]]:
        return await _stream(client, {"prompt": list(range(100)), "max_tokens": 9})

    rates = [acceptance] * 3
    chunks = _serve(tmp_path, check, mtp={"acceptance_rates": rates}, engine={"mode": "async"})
    assert _token_counts(chunks) == ([1, 4, 4] if acceptance else [1] * 9)
    assert chunks[-1]["usage"] == {"prompt_tokens": 100, "completion_tokens": 9, "total_tokens": 109}
    served = scenario(tmp_path, workload=NO_WORKLOAD, engine={"mode": "async"})
    assert isinstance(LiveEngine(served, "on").sim.core, BatchQueueEngineCore)


def test_metrics_have_vllm_names_types_and_counts(tmp_path):
    async def check(client: TestClient) -> tuple[Any, Any]:
        before = await _metrics(client)
        await _stream(client, {"prompt": list(range(100)), "max_tokens": 9})
        return before, await _metrics(client)

    before, after = _serve(tmp_path, check, mtp={"acceptance_rates": [1.0, 1.0, 1.0]})
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert before[name][0] == "gauge"
    for name in (
        "vllm:num_preemptions",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:spec_decode_num_draft_tokens",
        "vllm:spec_decode_num_accepted_tokens",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
    ):
        assert before[name] == ("counter", 0.0), name
    assert after["vllm:prompt_tokens"][1] == 100 and after["vllm:generation_tokens"][1] == 9
    # Two decode steps of 3 drafts each, all accepted.
    assert after["vllm:spec_decode_num_draft_tokens"][1] == 6
    assert after["vllm:spec_decode_num_accepted_tokens"][1] == 6
    assert after["vllm:prefix_cache_queries"][1] == 100 and after["vllm:num_requests_running"][1] == 0


def test_a_repeated_prompt_hits_the_prefix_cache(tmp_path):
    """The second of two equal 8,000-token prompts finds whole 3,200-token
    blocks of the first (how many is the allocator's business, tested in
    test_simulation: with Mamba align mode only blocks whose state was
    checkpointed hit); a different prompt finds none (the control)."""
    prompt = list(range(8000))

    async def check(client: TestClient) -> list[float]:
        hits = []
        for body in (prompt, prompt, [t + 10**6 for t in prompt]):
            await _stream(client, {"prompt": body, "max_tokens": 2})
            hits.append((await _metrics(client))["vllm:prefix_cache_hits"][1])
        return hits

    first, second, third = _serve(tmp_path, check)
    assert first == 0 and second > 0 and second % 3200 == 0 and third == second


def test_text_prompts_non_streaming_and_models(tmp_path):
    async def check(client: TestClient) -> tuple[Any, Any]:
        models = await (await client.get("/v1/models")).json()
        response = await client.post(
            "/v1/completions", json={"prompt": "the cat sat on the mat", "max_tokens": 5}
        )
        return models, await response.json()

    models, body = _serve(tmp_path, check)
    assert models["data"][0]["id"] == "flash-next"
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 5, "total_tokens": 11}
    assert body["choices"][0]["finish_reason"] == "length" and body["object"] == "text_completion"
    assert tokenize_text("the cat the")[0] == tokenize_text("the cat the")[2]


def test_errors_as_vllm_answers_them(tmp_path):
    async def check(client: TestClient) -> list[tuple[int, str]]:
        answers = []
        for body in (
            {"prompt": list(range(300_000)), "max_tokens": 1},  # over max_model_len 262,144
            {"prompt": [1, 2], "model": "other"},
            {"prompt": {"bad": 1}},
            {"prompt": [1, 2], "max_tokens": 0},
            {"prompt": [1, 2, 3], "max_tokens": 100_000_000_000},
            {"prompt": [1, 2], "max_tokens": "many"},
        ):
            response = await client.post("/v1/completions", json=body)
            answers.append((response.status, (await response.json())["error"]["message"]))
        health = await client.get("/health")
        answers.append((health.status, ""))
        return answers

    answers = _serve(tmp_path, check)
    assert [status for status, _ in answers] == [400, 404, 400, 400, 400, 400, 200]
    assert "maximum context length is 262144 tokens" in answers[0][1]
    # vLLM's renderer: both numbers named.
    assert answers[4][1].startswith("max_tokens=100000000000 cannot be greater than max_model_len=262144.")
    assert answers[5][1].startswith("1 validation error:") and "body.max_tokens" in answers[5][1]


def test_boot_log_lines_are_what_launch_parses(tmp_path):
    from sim.kv_cache_plan import plan_kv_cache
    from sim.serving.launch import check_boot_log

    sc = scenario(tmp_path, workload=NO_WORKLOAD)
    on = plan_kv_cache(sc.load_model(), sc.deployment, side_cache_layout=True)
    off = plan_kv_cache(sc.load_model(), sc.deployment, side_cache_layout=False)
    text = "\n".join(boot_log_lines(on, sc.deployment.max_model_len))
    assert check_boot_log(text, on.to_dict()).mismatches == []
    # CONTROL: the other layout's plan does not match this boot log.
    mismatches = check_boot_log(text, off.to_dict()).mismatches
    assert any("GPU KV cache size" in m for m in mismatches) and any(
        "side-cache layout" in m for m in mismatches
    )


def test_launch_command_is_the_scenario_deployment_as_vllm_reads_it(tmp_path):
    """``vllm serve``'s flags, parsed by vLLM's own engine-argument parser,
    give back the scenario's deployment (the independent reader)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from sim.serving.launch import server_env, vllm_serve_command

    sc = scenario(
        tmp_path,
        workload=NO_WORKLOAD,
        deployment={"max_num_seqs": 12, "max_model_len": 65536},
        scheduler={"max_num_batched_tokens": 4096},
        allocator={"enable_prefix_caching": False},
        fork={"mamba_retain_checkpoint": False},
    )
    command = vllm_serve_command(sc, "/models/flash-next", port=8123)
    assert command[:3] == ["vllm", "serve", "/models/flash-next"]
    frontend = command.index("--host"), command.index("--port")
    assert command[frontend[0] + 1] == "127.0.0.1" and command[frontend[1] + 1] == "8123"
    engine_flags = [
        a for i, a in enumerate(command[3:], start=3) if i not in {*frontend, *(f + 1 for f in frontend)}
    ]
    args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(
        ["--model", command[2], *engine_flags]
    )
    d = sc.deployment
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (
        d.tensor_parallel_size,
        d.pipeline_parallel_size,
    )
    assert (args.max_num_seqs, args.max_model_len) == (12, 65536)
    assert args.kv_cache_memory_bytes == d.kv_cache_memory_bytes and args.max_num_batched_tokens == 4096
    assert args.enable_prefix_caching is False and args.mamba_cache_mode == "align"
    assert args.speculative_config == {"method": "mtp", "num_speculative_tokens": 3}
    env = server_env(sc, "off")
    assert env["VLLM_E2_SIDE_CACHE_LAYOUT"] == "0" and env["VLLM_E2_MAMBA_RETAIN_CHECKPOINT"] == "0"
    assert env["VLLM_PP_LAYER_PARTITION"] == "25,23"
    assert server_env(sc, "on")["VLLM_E2_SIDE_CACHE_LAYOUT"] == "1"


def test_an_engine_too_slow_for_its_speed_reports_its_lag(tmp_path):
    """At a million simulated seconds per wall second no step can keep up:
    the lag gauge says so; at speed 1 the engine keeps time (the control)."""

    async def check(client: TestClient) -> float:
        await _stream(client, {"prompt": list(range(1000)), "max_tokens": 6})
        text = await (await client.get("/metrics")).text()
        return next(
            s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "kvsim:engine_max_lag_seconds"
        )

    assert _serve(tmp_path, check, speed=1e6) > 1.0
    assert _serve(tmp_path, check, speed=1.0) < 0.05


def test_chat_completions_as_vllms_bench_client_reads_them(tmp_path):
    """``vllm bench serve --endpoint /v1/chat/completions``'s own request
    function (and its completions one) against the server: every token
    arrives and the usage counts the prompt as the stated template does, by
    hand: ChatML around each message, <|im_start|> role words <|im_end|>,
    then <|im_start|> assistant: (1+1+2+1) + (1+1+3+1) + 2 = 13 tokens."""
    from vllm.benchmarks.lib.endpoint_request_func import (
        RequestFuncInput,
        async_request_openai_chat_completions,
        async_request_openai_completions,
    )

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there world"}]

    async def check(client: TestClient) -> tuple[Any, Any]:
        base = str(client.make_url(""))
        async with aiohttp.ClientSession() as session:
            chat = await async_request_openai_chat_completions(
                RequestFuncInput(
                    prompt="",
                    api_url=f"{base}/v1/chat/completions",
                    prompt_len=0,
                    output_len=7,
                    model="flash-next",
                    chat_messages=messages,
                ),
                session,
            )
            completions = [
                await async_request_openai_completions(
                    RequestFuncInput(
                        prompt="the cat sat",
                        api_url=f"{base}/v1/completions",
                        prompt_len=3,
                        output_len=5,
                        model=model,
                    ),
                    session,
                )
                for model in ("flash-next", "other")
            ]
        return chat, completions

    chat, (completion, unknown) = _serve(tmp_path, check)
    assert chat.success, chat.error
    assert chat.output_tokens == 7 and chat.prompt_len == 13 and len(chat.itl) >= 1
    assert completion.success and completion.output_tokens == 5
    # The model name is checked: an unknown one is vLLM's 404 (the control).
    assert not unknown.success and unknown.error == "Not Found"


def test_chat_chunks_and_answers_are_vllms_response_models(tmp_path):
    """Each streamed chunk parses as vLLM's ``ChatCompletionStreamResponse``
    (the first carries the role, the last the finish reason, then usage),
    the whole answer as ``ChatCompletionResponse``."""
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponse,
        ChatCompletionStreamResponse,
    )

    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 4}

    async def check(client: TestClient) -> tuple[list[Any], Any, Any]:
        payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
        response = await client.post("/v1/chat/completions", json=payload)
        lines = [raw.strip() for raw in (await response.read()).splitlines() if raw.strip()]
        whole = await (await client.post("/v1/chat/completions", json=body)).json()
        image = {
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
        }
        refused = await client.post("/v1/chat/completions", json=image)
        return lines, whole, (refused.status, await refused.json())

    lines, whole, refused = _serve(tmp_path, check)
    assert lines[-1] == b"data: [DONE]"
    chunks = [ChatCompletionStreamResponse.model_validate_json(line[6:]) for line in lines[:-1]]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert [c.choices[0].finish_reason for c in chunks[1:-1]][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert chunks[-1].usage.prompt_tokens == 1 + 1 + 1 + 1 + 2  # <|im_start|> user hi <|im_end|>, then 2
    answer = ChatCompletionResponse.model_validate(whole)
    assert answer.choices[0].message.role == "assistant" and answer.usage.completion_tokens == 4
    assert refused[0] == 400 and "text parts only" in refused[1]["error"]["message"]


@pytest.mark.parametrize(
    ("body", "prompt_len", "expected"),
    [
        ({"max_tokens": 5}, 3, 5),  # fits: as asked
        ({"max_tokens": 99}, 3, 97),  # 3 + 99 > 100: clamped to the room left (get_max_tokens)
        ({}, 3, 16),  # completions' default
        ({"max_tokens": 100}, 3, 97),  # equal to max_model_len: allowed, clamped
        ({"max_tokens": 101}, 3, "max_tokens=101 cannot be greater than max_model_len=100"),
        ({"max_tokens": 5}, 100, "plus the number of requested output tokens (at least 1)"),
        ({"max_tokens": 5}, 101, "your prompt contains at least 101 input tokens"),
        ({"max_tokens": 5}, 150, "your prompt contains 150 input tokens"),
    ],
)
def test_output_budget_as_vllm_derives_it(body, prompt_len, expected):
    """vLLM 0.33.0's rules on max_model_len 100, derived from its source:
    ``TokenizeParams`` refuses ``max_tokens > max_model_len``, its length
    check a prompt past it ("at least" when one over), the input processor
    a prompt that leaves no room; ``get_max_tokens`` clamps the rest."""
    from sim.vllm_bridge.openai import CompletionRequest, VLLMValidationError, max_tokens_for

    request = CompletionRequest.model_validate({"prompt": [1], **body})
    if isinstance(expected, int):
        assert max_tokens_for(request, 100, list(range(prompt_len))) == expected
    else:
        with pytest.raises(VLLMValidationError, match=re.escape(expected)):
            max_tokens_for(request, 100, list(range(prompt_len)))


def test_chat_max_completion_tokens_comes_before_max_tokens():
    from sim.vllm_bridge.openai import ChatCompletionRequest, max_tokens_for

    messages = [{"role": "user", "content": "hi"}]
    both = ChatCompletionRequest.model_validate(
        {"messages": messages, "max_completion_tokens": 4, "max_tokens": 9}
    )
    assert max_tokens_for(both, 100, [1, 2, 3]) == 4
    # Neither: the room the prompt leaves (chat has no default of 16).
    assert max_tokens_for(ChatCompletionRequest.model_validate({"messages": messages}), 100, [1, 2, 3]) == 97


def test_bodies_that_do_not_parse_as_fastapi_answers_under_vllm(tmp_path):
    """FastAPI (vLLM's server) turns a ``JSONDecodeError`` into a
    ``json_invalid`` validation error and any other parse failure (too deep
    for the parser, an integer past Python's digit limit) into a 400
    "There was an error parsing the body"; vLLM's handlers shape both."""

    async def check(client: TestClient) -> list[tuple[int, dict[str, Any]]]:
        answers = []
        for raw in (
            b'{"prompt": [1,',
            b"[" * 100_000 + b"]" * 100_000,
            b'{"prompt": [' + b"9" * 5000 + b"]}",
        ):
            response = await client.post("/v1/completions", data=raw)
            answers.append((response.status, (await response.json())["error"]))
        return answers

    (status, invalid), *others = _serve(tmp_path, check)
    assert status == 400 and invalid["type"] == "Bad Request" and invalid["param"] == "body.14"
    assert invalid["message"].startswith("1 validation error:") and "json_invalid" in invalid["message"]
    for status, error in others:
        assert status == 400
        assert error == {
            "message": "There was an error parsing the body",
            "type": "Bad Request",
            "param": None,
            "code": 400,
        }
