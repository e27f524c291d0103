"""Every bounded input key, at its bound and one past it (table-driven).

The bounds are written here by hand from their stated reasons (``docs`` and
the constants' comments: 288 GB per GPU, 10 M tokens of context, a year of
simulated time, 2**63 - 1 for a seed, ...), not read from the code; one test
checks the table covers every bounded field of the config models, so a new
bound without a row fails. "One past" is the next integer for an integer
key and the next float (``math.nextafter``) for a float key.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

import sim.config as config_module
import sim.scenario as scenario_module
import sim.workloads.config as workload_module
from sim.config import ConfigError, ModelConfig, apply_overrides, read_yaml, validate
from sim.paths import SCENARIOS_DIR
from sim.scenario import Scenario, check_sample_rows
from sim.workloads import loaders

YEAR_S = 366 * 86_400.0
TEN_M_TOKENS = 10_000_000
NEXT_UP = math.nextafter
SMALLEST = math.nextafter(0.0, 1.0)
SYNTHETIC = {
    "trace": "synthetic",
    "num_requests": 4,
    "arrival": {"process": "poisson", "rate_per_s": 1.0},
    "prompt": {"distribution": "fixed", "tokens": 10},
    "output": {"distribution": "fixed", "tokens": 10},
}
TIMED = {"trace": "trace.jsonl", "format": "timed_trace"}
SESSIONS = {
    "trace": "sessions",
    "sessions": {
        "num_sessions": 2,
        "first_history": {"distribution": "fixed", "tokens": 100},
        "reply": {"distribution": "fixed", "tokens": 10},
        "tool_result": {"distribution": "fixed", "tokens": 20},
        "max_context_tokens": 1000,
    },
}
MOONCAKE = {"trace": "default"}
PP_AT_BOUND = {"deployment": {"pipeline_parallel_size": 1024, "layer_partition": [1] * 1024}}
PP_PAST = {"deployment": {"pipeline_parallel_size": 1025, "layer_partition": [1] * 1025}}

# (model class, key, value at the bound, value one past it, base settings).
# Lower bounds (gt=0: 1 and 0; ge=0: 0 and -1) and upper bounds alike.
NO_UNIT = {"deployment": {"prefix_match_unit": None}}
NO_BLOCK = {"deployment": {"block_size": None}}
SCENARIO_BOUNDS: list[tuple[type[BaseModel], str, Any, Any, dict]] = [
    (scenario_module.MTPSection, "mtp.num_speculative_tokens", 0, -1, {}),
    (scenario_module.MTPSection, "mtp.num_speculative_tokens", 16, 17, {}),
    (config_module.DeploymentConfig, "deployment.tensor_parallel_size", 1, 0, {}),
    (config_module.DeploymentConfig, "deployment.tensor_parallel_size", 1024, 1025, {}),
    (
        config_module.DeploymentConfig,
        "deployment.pipeline_parallel_size",
        1,
        0,
        {"deployment": {"layer_partition": [48]}},
    ),
    (config_module.DeploymentConfig, "deployment.pipeline_parallel_size", 1024, 1025, {}),
    (config_module.DeploymentConfig, "deployment.kv_cache_memory_bytes", 1, 0, {}),
    (config_module.DeploymentConfig, "deployment.kv_cache_memory_bytes", 10**12, 10**12 + 1, {}),
    (config_module.DeploymentConfig, "deployment.max_model_len", 1, 0, {}),
    (config_module.DeploymentConfig, "deployment.max_model_len", TEN_M_TOKENS, TEN_M_TOKENS + 1, {}),
    (config_module.DeploymentConfig, "deployment.max_num_seqs", 1, 0, {}),
    (config_module.DeploymentConfig, "deployment.decode_context_parallel_size", 1, 0, {}),
    (config_module.DeploymentConfig, "deployment.decode_context_parallel_size", 1024, 1025, {}),
    # The rig's 64-token prefix-match unit divides neither a 1-token block
    # nor a 4,096-token block's bound: each row frees the other key.
    (config_module.DeploymentConfig, "deployment.block_size", 1, 0, NO_UNIT),
    (config_module.DeploymentConfig, "deployment.prefix_match_unit", 1, 0, {}),
    (config_module.DeploymentConfig, "deployment.block_size", TEN_M_TOKENS, TEN_M_TOKENS + 1, {}),
    (
        config_module.DeploymentConfig,
        "deployment.prefix_match_unit",
        TEN_M_TOKENS,
        TEN_M_TOKENS + 1,
        NO_BLOCK,
    ),
    (scenario_module.SchedulerSection, "scheduler.max_num_batched_tokens", 1, 0, {}),
    (scenario_module.SchedulerSection, "scheduler.long_prefill_token_threshold", 0, -1, {}),
    # Explicit only on the synchronous loop (async derives pp + 1).
    (
        scenario_module.SchedulerSection,
        "scheduler.max_concurrent_batches",
        1,
        0,
        {"engine": {"mode": "sync"}},
    ),
    (scenario_module.SimulationSection, "simulation.max_time_s", SMALLEST, 0.0, {}),
    (scenario_module.SimulationSection, "simulation.max_time_s", YEAR_S, NEXT_UP(YEAR_S, math.inf), {}),
    (scenario_module.SimulationSection, "simulation.sample_interval_s", SMALLEST, 0.0, {}),
    (Scenario, "seed", 0, -1, {}),
    (Scenario, "seed", 2**63 - 1, 2**63, {}),
    (workload_module.WorkloadConfig, "workload.shared_prefix_tokens", 0, -1, {"workload": SYNTHETIC}),
    (
        workload_module.WorkloadConfig,
        "workload.shared_prefix_tokens",
        TEN_M_TOKENS,
        TEN_M_TOKENS + 1,
        {"workload": SYNTHETIC},
    ),
    (workload_module.WorkloadConfig, "workload.prefix_unit", 1, 0, {"workload": SYNTHETIC}),
    (workload_module.WorkloadConfig, "workload.prefix_unit", 1024, 1025, {"workload": SYNTHETIC}),
    (workload_module.WorkloadConfig, "workload.num_requests", 1, 0, {"workload": SYNTHETIC}),
    (workload_module.WorkloadConfig, "workload.num_requests", 1_000_000, 1_000_001, {"workload": SYNTHETIC}),
    (workload_module.WorkloadConfig, "workload.max_requests", 1, 0, {"workload": MOONCAKE}),
    (workload_module.WorkloadConfig, "workload.time_scale", SMALLEST, 0.0, {"workload": MOONCAKE}),
    (workload_module.WorkloadConfig, "workload.rate_scale", SMALLEST, 0.0, {"workload": MOONCAKE}),
    (workload_module.WorkloadConfig, "workload.sample_fraction", SMALLEST, 0.0, {"workload": MOONCAKE}),
    (
        workload_module.WorkloadConfig,
        "workload.sample_fraction",
        1.0,
        NEXT_UP(1.0, 2.0),
        {"workload": MOONCAKE},
    ),
    (workload_module.WorkloadConfig, "workload.max_prompt_len", 1, 0, {"workload": MOONCAKE}),
    (workload_module.WorkloadConfig, "workload.max_output_len", 1, 0, {"workload": MOONCAKE}),
    (workload_module.WorkloadConfig, "workload.hash_chunk_tokens", 1, 0, {"workload": TIMED}),
    (workload_module.SessionsConfig, "workload.sessions.num_sessions", 1, 0, {"workload": SESSIONS}),
    (
        workload_module.SessionsConfig,
        "workload.sessions.num_sessions",
        10_000,
        10_001,
        {"workload": SESSIONS},
    ),
    (workload_module.SessionsConfig, "workload.sessions.max_context_tokens", 1, 0, {"workload": SESSIONS}),
    (
        workload_module.SessionsConfig,
        "workload.sessions.max_context_tokens",
        TEN_M_TOKENS,
        TEN_M_TOKENS + 1,
        {"workload": SESSIONS},
    ),
    (workload_module.SessionsConfig, "workload.sessions.max_turns", 1, 0, {"workload": SESSIONS}),
    (workload_module.SessionsConfig, "workload.sessions.max_turns", 100_000, 100_001, {"workload": SESSIONS}),
    (
        workload_module.SessionsConfig,
        "workload.sessions.start_spread_s",
        0.0,
        -SMALLEST,
        {"workload": SESSIONS},
    ),
    (
        workload_module.SessionsConfig,
        "workload.sessions.start_spread_s",
        YEAR_S,
        NEXT_UP(YEAR_S, math.inf),
        {"workload": SESSIONS},
    ),
    (workload_module.SessionsConfig, "workload.sessions.duration_s", SMALLEST, 0.0, {"workload": SESSIONS}),
    (
        workload_module.SessionsConfig,
        "workload.sessions.duration_s",
        YEAR_S,
        NEXT_UP(YEAR_S, math.inf),
        {"workload": SESSIONS},
    ),
    (workload_module.ArrivalConfig, "workload.arrival.rate_per_s", SMALLEST, 0.0, {"workload": SYNTHETIC}),
    (
        workload_module.ArrivalConfig,
        "workload.arrival.cv",
        SMALLEST,
        0.0,
        {"workload": {**SYNTHETIC, "arrival": {"process": "gamma", "rate_per_s": 1.0, "cv": 1.0}}},
    ),
]
# Bounds a validator states rather than a Field: (key, at the bound, one past it).
VALIDATOR_BOUNDS = [
    ("mtp.acceptance_rates", [0.0, 1.0], [1.0, NEXT_UP(1.0, 2.0)]),
    ("mtp.acceptance_rates", [0.0], [NEXT_UP(0.0, -1.0)]),
    ("workload.window_s", [0.0, SMALLEST], [NEXT_UP(0.0, -1.0), 1.0]),
    ("workload.window_s", [5.0, NEXT_UP(5.0, 6.0)], [5.0, 5.0]),
    ("workload.sessions.think_s", [0.0, 0.0], [-SMALLEST, 0.0]),
    ("workload.sessions.think_s", [2.0, 2.0], [NEXT_UP(2.0, 3.0), 2.0]),
    ("workload.sessions.think_s", [0.0, YEAR_S], [0.0, NEXT_UP(YEAR_S, math.inf)]),
    (
        "workload.prompt",
        {"distribution": "fixed", "tokens": TEN_M_TOKENS},
        {"distribution": "fixed", "tokens": TEN_M_TOKENS + 1},
    ),
    ("workload.prompt", {"distribution": "fixed", "tokens": 1}, {"distribution": "fixed", "tokens": 0}),
    (
        "workload.prompt",
        {"distribution": "uniform", "lo": 7, "hi": 7},
        {"distribution": "uniform", "lo": 7, "hi": 6},
    ),
    (
        "workload.prompt",
        {"distribution": "lognormal", "p50": 1.0, "p90": 1.0},
        {"distribution": "lognormal", "p50": NEXT_UP(1.0, 0.0), "p90": 1.0},
    ),
    (
        "workload.prompt",
        {"distribution": "lognormal", "p50": 5.0, "p90": 5.0},
        {"distribution": "lognormal", "p50": 5.0, "p90": NEXT_UP(5.0, 0.0)},
    ),
    (
        "workload.prompt",
        {"distribution": "lognormal", "p50": 5.0, "p90": float(TEN_M_TOKENS)},
        {"distribution": "lognormal", "p50": 5.0, "p90": NEXT_UP(float(TEN_M_TOKENS), math.inf)},
    ),
    (
        "workload.prompt",
        {"distribution": "empirical", "values": [1, TEN_M_TOKENS]},
        {"distribution": "empirical", "values": [1, TEN_M_TOKENS + 1]},
    ),
]


def _merged(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = (
            _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


def _replaced(data: dict, key: str, value: Any) -> dict:
    """``data`` with the value at the dotted ``key`` replaced whole."""
    head, _, rest = key.partition(".")
    if not rest:
        return {**data, head: value}
    return {**data, head: _replaced(data.get(head, {}), rest, value)}


def _scenario(key: str, value: Any, base: dict) -> Scenario:
    data = _replaced(_merged({"name": "bounds"}, base), key, value)
    if key == "deployment.pipeline_parallel_size" and value >= 1024:
        data = _merged(data, {"deployment": {"layer_partition": [1] * value}})
    return validate(Scenario, data, "bounds.yaml")


def _ids(row) -> str:
    return f"{row[1]}={row[2]!r}"


@pytest.mark.parametrize("row", SCENARIO_BOUNDS, ids=_ids)
def test_a_bounded_scenario_key_takes_its_bound_and_refuses_one_past(row):
    _, key, at_bound, past, base = row
    accepted = _scenario(key, at_bound, base)
    node: Any = accepted
    for part in key.split("."):
        node = getattr(node, part)
    assert node == at_bound
    with pytest.raises(ConfigError) as refused:
        _scenario(key, past, base)
    message = str(refused.value)
    assert message.startswith("bounds.yaml: ") and "\n" not in message
    assert key.split(".")[-1] in message  # the line names the key


@pytest.mark.parametrize(("key", "at_bound", "past"), VALIDATOR_BOUNDS, ids=lambda v: str(v)[:40])
def test_a_validated_scenario_key_takes_its_bound_and_refuses_one_past(key, at_bound, past):
    base = {"workload": SYNTHETIC} if key.startswith("workload.") else {}
    base = {"workload": SESSIONS} if key.startswith("workload.sessions.") else base
    _scenario(key, at_bound, base)
    with pytest.raises(ConfigError) as refused:
        _scenario(key, past, base)
    assert str(refused.value).startswith("bounds.yaml: ") and "\n" not in str(refused.value)


# The model file's bounds: every count and size at least 1 (an index at least 0).
MODEL_BOUNDS = [
    (config_module.ModelConfig, "num_layers", 1, 0),
    (config_module.ModelConfig, "kernel_block_alignment", 1, 0),
    (config_module.GDNConfig, "gdn.num_key_heads", 1, 0),
    (config_module.GDNConfig, "gdn.num_value_heads", 1, 0),
    (config_module.GDNConfig, "gdn.key_head_dim", 1, 0),
    (config_module.GDNConfig, "gdn.value_head_dim", 1, 0),
    (config_module.GDNConfig, "gdn.conv_kernel", 1, 0),
    (config_module.PLEConfig, "ple.layer", 0, -1),
    (config_module.PLEConfig, "ple.intermediate_size", 1, 0),
    (config_module.PLEConfig, "ple.conv_kernel", 1, 0),
    (config_module.QSAAttentionConfig, "qsa.attention.num_kv_heads", 1, 0),
    (config_module.QSAAttentionConfig, "qsa.attention.head_size", 1, 0),
    (config_module.CompressedKeysConfig, "qsa.compressed_keys.head_size", 1, 0),
    (config_module.CompressedKeysConfig, "qsa.compressed_keys.tokens_per_state", 1, 0),
    (config_module.RawKeyRingConfig, "qsa.raw_key_ring.capacity_tokens", 1, 0),
    (config_module.RawKeyRingConfig, "qsa.raw_key_ring.head_size", 1, 0),
    (config_module.QSAConfig, "qsa.every", 1, 0),
    (config_module.QSAConfig, "qsa.offset", 0, -1),
    (config_module.MTPConfig, "mtp.num_layers", 0, -1),
    (config_module.MTPConfig, "mtp.num_speculative_tokens", 0, -1),
]


def _model(key: str, value: Any) -> ModelConfig:
    data = read_yaml(SCENARIOS_DIR / "models" / "flash-next.yaml")
    if key == "num_layers":  # one layer: the PLE state sits on layer 0
        data = _replaced(data, "ple.layer", 0)
    return validate(ModelConfig, _replaced(data, key, value), "model.yaml")


@pytest.mark.parametrize("row", MODEL_BOUNDS, ids=_ids)
def test_a_bounded_model_key_takes_its_bound_and_refuses_one_past(row):
    _, key, at_bound, past = row
    _model(key, at_bound)
    with pytest.raises(ConfigError) as refused:
        _model(key, past)
    assert str(refused.value).startswith(f"model.yaml: {key}: ")


def test_the_ple_layer_is_at_most_the_last_layer():
    last = read_yaml(SCENARIOS_DIR / "models" / "flash-next.yaml")["num_layers"] - 1
    assert _model("ple.layer", last).ple.layer == last
    with pytest.raises(ConfigError, match="past the last layer"):
        _model("ple.layer", last + 1)


def _bounded_fields(models: list[type[BaseModel]]) -> set[tuple[str, str]]:
    """(class, field) of every field with a numeric constraint."""
    found = set()
    for model in models:
        for name, info in model.model_fields.items():
            if any(hasattr(m, attr) for m in info.metadata for attr in ("gt", "ge", "lt", "le")):
                found.add((model.__name__, name))
            args = getattr(info.annotation, "__args__", ())  # _Factor | None
            if any(hasattr(m, "gt") for a in args for m in getattr(a, "__metadata__", ())):
                found.add((model.__name__, name))
    return found


def test_the_tables_cover_every_bounded_field_of_the_config_models():
    models = [
        m
        for module in (config_module, scenario_module, workload_module)
        for m in vars(module).values()
        if isinstance(m, type) and issubclass(m, BaseModel) and m.__module__ == module.__name__
    ]
    tabled = {(cls.__name__, key.split(".")[-1]) for cls, key, *_ in (*SCENARIO_BOUNDS, *MODEL_BOUNDS)}
    assert _bounded_fields(models) - tabled == set()


def test_overrides_reach_the_bound_as_the_command_line_gives_it():
    """``--set`` reads the value as YAML: ``1e12`` is the 288 GB bound's float
    form and passes; one byte more does not."""
    data = apply_overrides({"name": "bounds"}, ["deployment.kv_cache_memory_bytes=1000000000000"])
    assert validate(Scenario, data, "s").deployment.kv_cache_memory_bytes == 10**12
    with pytest.raises(ConfigError, match="more than 1e"):
        validate(Scenario, apply_overrides(data, ["deployment.kv_cache_memory_bytes=1000000000001"]), "s")


# -------------------------------------------------------- sample rows
def test_sample_rows_at_the_bound_pass_and_one_more_is_refused():
    check_sample_rows(100_000.0, 1.0, "the trace's")
    with pytest.raises(ValueError, match="100,001 sample rows, more than 100,000"):
        check_sample_rows(100_001.0, 1.0, "the trace's")


# -------------------------------------------------------- trace loaders
def _mooncake(tmp_path: Path, stamps_ms: list[float], tokens: int = 1) -> Path:
    path = tmp_path / "trace.jsonl"
    lines = [
        json.dumps(
            {
                "timestamp": t,
                "input_length": tokens,
                "output_length": 1,
                "hash_ids": list(range(math.ceil(tokens / 512))),
            }
        )
        for t in stamps_ms
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_trace_of_exactly_the_request_bound_loads_and_one_more_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(loaders, "MAX_WORKLOAD_REQUESTS", 3)
    assert len(loaders.load_mooncake(_mooncake(tmp_path, [0, 1, 2])).requests) == 3
    with pytest.raises(ConfigError, match=r"trace.jsonl:4: more than 3 requests"):
        loaders.load_mooncake(_mooncake(tmp_path, [0, 1, 2, 3]))


def test_a_trace_spanning_exactly_a_year_loads_and_one_ms_more_is_refused(tmp_path):
    year_ms = YEAR_S * 1000
    assert loaders.load_mooncake(_mooncake(tmp_path, [0, year_ms])).requests[-1].arrival_s == YEAR_S
    with pytest.raises(ConfigError, match=r"trace.jsonl:2: arrives .* more than"):
        loaders.load_mooncake(_mooncake(tmp_path, [0, year_ms + 1]))


def test_a_first_stamp_of_a_day_is_kept_and_one_ms_more_is_rebased(tmp_path):
    """Past a day (86,400,000 ms) a first timestamp is epoch time, re-based to 0."""
    day_ms = 86_400_000
    assert loaders.load_mooncake(_mooncake(tmp_path, [day_ms])).requests[0].arrival_s == 86_400.0
    assert loaders.load_mooncake(_mooncake(tmp_path, [day_ms + 1])).requests[0].arrival_s == 0.0


@pytest.mark.parametrize(("tokens", "ok"), [(1, True), (TEN_M_TOKENS, True), (TEN_M_TOKENS + 1, False)])
def test_a_request_of_up_to_ten_million_tokens_loads(tmp_path, tokens, ok):
    path = _mooncake(tmp_path, [0], tokens)
    if ok:
        assert loaders.load_mooncake(path).requests[0].prompt_len == tokens
    else:
        with pytest.raises(ConfigError, match=r"trace.jsonl:1: input_length: .* more than 10,000,000"):
            loaders.load_mooncake(path)


def test_a_timestamp_of_zero_loads_and_below_zero_is_refused(tmp_path):
    assert loaders.load_mooncake(_mooncake(tmp_path, [0.0])).requests[0].arrival_s == 0.0
    with pytest.raises(ConfigError, match=r"trace.jsonl:1: timestamp: expected milliseconds >= 0"):
        loaders.load_mooncake(_mooncake(tmp_path, [NEXT_UP(0.0, -1.0)]))


def test_max_requests_of_one_loads_one_and_zero_is_refused(tmp_path):
    path = _mooncake(tmp_path, [0, 1, 2])
    assert len(loaders.load_mooncake(path, max_requests=1).requests) == 1
    with pytest.raises(ValueError, match="max_requests: expected >= 1, got 0"):
        loaders.load_mooncake(path, max_requests=0)


@pytest.mark.parametrize(
    ("digits", "needle"), [(30, "1e\\+30 tokens is more than 10,000,000"), (31, "a 31-digit number")]
)
def test_a_csv_cell_of_thirty_digits_is_read_and_thirty_one_is_not(tmp_path, digits, needle):
    path = tmp_path / "lengths.csv"
    cell = "9" * digits
    path.write_text(f"num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n{cell},1,{cell},1.0\n")
    import numpy as np

    from sim.workloads.distributions import Poisson

    with pytest.raises(ConfigError, match=rf"lengths.csv:2: num_prefill_tokens: {needle}"):
        loaders.load_sharegpt_lengths(path, arrival=Poisson(rate_per_s=1.0), rng=np.random.default_rng(0))
