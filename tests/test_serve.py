"""kvsim serve's HTTP surface, in process on 127.0.0.1: vLLM's endpoint
shapes and /metrics names and types, tokens streamed as the simulator
generates them (several per step with MTP), prefix caching across requests,
and vLLM's error answers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families
from sim_helpers import scenario

import sim.vllm_bridge  # noqa: F401  (sets VLLM_TARGET_DEVICE before vLLM's argument parser runs)
from sim.commands.serve import boot_log_lines
from sim.replay.live_engine import LiveEngine
from sim.replay.server import build_app, tokenize_text

NO_WORKLOAD = {
    "trace": "synthetic",
    "num_requests": 1,
    "arrival": {"process": "constant", "rate_per_s": 1.0},
    "prompt": {"distribution": "fixed", "tokens": 10},
    "output": {"distribution": "fixed", "tokens": 1},
}
SPEED = 50.0


def _serve(
    tmp_path, check: Callable[[TestClient], Awaitable[Any]], speed: float = SPEED, **sections: Any
) -> Any:
    """Run ``check`` against a server on 127.0.0.1, stopped afterwards."""
    sc = scenario(tmp_path, deployment={"max_num_seqs": 4}, workload=NO_WORKLOAD, **sections)

    async def main() -> Any:
        engine = LiveEngine(sc, "on", speed=speed)
        client = TestClient(TestServer(build_app(engine), host="127.0.0.1"))
        await client.start_server()
        try:
            return await asyncio.wait_for(check(client), 60)
        finally:
            await client.close()

    return asyncio.run(main())


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
        ):
            response = await client.post("/v1/completions", json=body)
            answers.append((response.status, (await response.json())["error"]["message"]))
        health = await client.get("/health")
        answers.append((health.status, ""))
        return answers

    answers = _serve(tmp_path, check)
    assert [status for status, _ in answers] == [400, 404, 400, 400, 200]
    assert "maximum context length is 262144 tokens" in answers[0][1]


def test_boot_log_lines_are_what_launch_parses(tmp_path):
    from sim.kv_cache_plan import plan_kv_cache
    from sim.replay.launch import check_boot_log

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

    from sim.replay.launch import server_env, vllm_serve_command

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
