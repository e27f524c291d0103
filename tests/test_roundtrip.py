"""The recorded scenario round-trips: what a results directory records
(``scenario.json``, every key with defaults included) loads back, through
the same strict checks as a scenario file, to a scenario equal to the one
that ran; and recording that again gives the same file.

Covers every scenario shipped under ``scenarios/`` (gates and conformance
included, and each gate as ``gates.yaml`` sets it up), every workload kind
(each trace format and synthetic), and generated scenarios (Hypothesis).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.scenarios import write_scenario
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.analysis.gates import gate_scenario, load_gates
from sim.config import ConfigError, validate
from sim.paths import SCENARIOS_DIR
from sim.scenario import Scenario, load_scenario, scenario_from_record, scenario_to_dict
from sim.workloads.config import WorkloadConfig

SHIPPED = sorted(
    path
    for path in SCENARIOS_DIR.rglob("*.yaml")
    if path.parent.name not in ("models", "rig") and path.name != "gates.yaml"
)
GATES_FILE = SCENARIOS_DIR / "gates.yaml"

# One workload per kind, each format-specific key away from its default
# where the kind uses it (a record must keep it).
AZURE_CSV = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
TIMED_TRACE = '{"timestamp": 0.5, "input_length": 40, "output_length": 3, "hash_ids": [1, 2]}\n'
TIMED_CSV = "arrival_s,input_tokens,output_tokens\n0,10,5\n1.5,20,4\n"
KINDS: dict[str, dict[str, Any]] = {
    "mooncake": {"trace": "default", "window_s": [0, 60], "sample_fraction": 0.5, "spread_bursts": True},
    "mooncake-by-format": {"trace": "default", "format": "mooncake", "max_requests": 9},
    "azure": {"trace": "azure-code-slice", "rate_scale": 2.0, "max_prompt_len": 4000},
    "azure-file": {"trace": "trace.csv", "time_scale": 0.5},
    "sharegpt": {"trace": "sharegpt-lengths", "arrival": {"process": "gamma", "rate_per_s": 2.0, "cv": 3}},
    "timed_trace": {"trace": "trace.jsonl", "format": "timed_trace", "hash_chunk_tokens": 32},
    "timed_csv": {"trace": "arrivals.csv", "max_output_len": 4},
    "synthetic": {
        "trace": "synthetic",
        "num_requests": 5,
        "arrival": {"process": "constant", "rate_per_s": 1.0},
        "prompt": {"distribution": "fixed", "tokens": 256},
        "output": {"distribution": "uniform", "lo": 1, "hi": 9},
        "shared_prefix_tokens": 64,
        "prefix_unit": 32,
    },
    "sessions": {
        "trace": "sessions",
        "shared_prefix_tokens": 128,
        "prefix_unit": 64,
        "sessions": {
            "num_sessions": 2,
            "first_history": {"distribution": "uniform", "lo": 100, "hi": 200},
            "reply": {"distribution": "fixed", "tokens": 10},
            "tool_result": {"distribution": "lognormal", "p50": 30, "p90": 60},
            "think_s": [0.5, 1.5],
            "start_spread_s": 2.0,
            "max_context_tokens": 600,
            "max_turns": 5,
            "duration_s": 30.0,
        },
    },
    "synthetic-by-format": {
        "format": "synthetic",
        "num_requests": 5,
        "arrival": {"process": "poisson", "rate_per_s": 1.0},
        "prompt": {"distribution": "empirical", "values": [10, 20]},
        "output": {"distribution": "lognormal", "p50": 10, "p90": 30},
    },
}


def record_and_reload(scenario: Scenario) -> Scenario:
    """What a results directory holds, as JSON text, loaded back."""
    text = json.dumps(scenario_to_dict(scenario), allow_nan=False)
    return scenario_from_record(json.loads(text), "scenario.json")


def assert_round_trips(scenario: Scenario) -> None:
    again = record_and_reload(scenario)
    assert again == scenario
    assert scenario_to_dict(again) == scenario_to_dict(scenario)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(SCENARIOS_DIR)))
def test_every_shipped_scenario_round_trips(path):
    assert_round_trips(load_scenario(str(path)))


def test_the_shipped_list_covers_gates_and_conformance():
    """Control: the parametrisation above is not vacuous."""
    folders = {path.parent.name for path in SHIPPED}
    assert {"scenarios", "gates", "conformance"} <= folders and len(SHIPPED) >= 14


def test_every_gate_round_trips_as_gates_yaml_sets_it_up():
    gates = load_gates(GATES_FILE).gates
    assert gates
    for name, gate in gates.items():
        assert_round_trips(gate_scenario(GATES_FILE, name, gate))


def _trace_files(directory: Path) -> None:
    (directory / "trace.csv").write_text(AZURE_CSV)
    (directory / "trace.jsonl").write_text(TIMED_TRACE)
    (directory / "arrivals.csv").write_text(TIMED_CSV)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_workload_kind_round_trips_and_builds_the_same_requests(tmp_path, kind):
    from sim.analysis.runs import scenario_workload

    _trace_files(tmp_path)
    scenario = load_scenario(str(write_scenario(tmp_path, kind, workload=KINDS[kind])))
    again = record_and_reload(scenario)
    assert again == scenario
    assert scenario_workload(again) == scenario_workload(scenario)


def test_the_record_of_a_trace_scenario_names_the_synthetic_defaults():
    """The bug this guards: the record names ``prefix_unit`` (a synthetic
    key) at its default for a Mooncake trace; the loader must take it."""
    recorded = scenario_to_dict(load_scenario("chat-slice"))
    assert recorded["workload"]["prefix_unit"] == 16 and recorded["workload"]["hash_chunk_tokens"] == 16
    assert record_and_reload(load_scenario("chat-slice")).workload.prefix_unit == 16


@pytest.mark.parametrize(
    "workload, message",
    [
        ({"trace": "default", "prefix_unit": 32}, "prefix_unit: not used by mooncake traces"),
        ({"trace": "default", "num_requests": 5}, "num_requests: not used by mooncake traces"),
        ({"trace": "azure-code-slice", "shared_prefix_tokens": 16}, "shared_prefix_tokens: not used by"),
        ({"trace": "default", "hash_chunk_tokens": 32}, "hash_chunk_tokens: only for timed_trace"),
        ({"format": "synthetic", "trace": "azure-code-slice"}, "trace: must be 'synthetic' or left out"),
    ],
)  # fmt: skip
def test_a_value_the_format_cannot_use_is_still_refused(workload, message):
    """Control: defaults are harmless on load, other values are not; the
    loader stays strict about what would be silently ignored."""
    with pytest.raises(ConfigError, match=message):
        validate(WorkloadConfig, workload, "scenario.yaml")


def test_a_record_changed_by_hand_is_refused_naming_the_key(tmp_path):
    data = scenario_to_dict(load_scenario("chat-slice"))
    data["workload"]["prefix_unit"] = 64
    with pytest.raises(ConfigError, match=r"^r/scenario.json: workload: prefix_unit: not used by mooncake"):
        scenario_from_record(data, "r/scenario.json")
    data = scenario_to_dict(load_scenario("chat-slice"))
    # The default's rates come from the rig's profile: rates by hand drop it.
    data["mtp"].update(acceptance_rates=[0.5], acceptance_profile=None)
    with pytest.raises(ConfigError, match="r/scenario.json: mtp.acceptance_rates: 1 rates given"):
        scenario_from_record(data, "r/scenario.json")
    with pytest.raises(ConfigError, match="expected a mapping"):
        scenario_from_record([], "r/scenario.json")


# ------------------------------------------------------------ generated
_positive = st.floats(min_value=0.05, max_value=20.0, allow_nan=False)
_windows = st.tuples(st.floats(0, 300), st.floats(1, 300)).map(lambda w: [w[0], w[0] + w[1]])
_TRACE_KEYS = {
    "window_s": _windows,
    "time_scale": _positive,
    "rate_scale": _positive,
    "sample_fraction": st.floats(min_value=0.01, max_value=1.0),
    "max_requests": st.integers(1, 10_000),
    "max_prompt_len": st.integers(1, 300_000),
    "max_output_len": st.integers(1, 10_000),
}
_SYNTHETIC_KEYS = {
    "shared_prefix_tokens": st.sampled_from([0, 512, 1024]),
    "prefix_unit": st.sampled_from([8, 16, 64]),
    "max_prompt_len": st.integers(1, 300_000),
    "time_scale": _positive,
}


def _fixed(tokens: int) -> dict[str, Any]:
    return {"distribution": "fixed", "tokens": tokens}


def _uniform(lo: int, width: int) -> dict[str, Any]:
    return {"distribution": "uniform", "lo": lo, "hi": lo + width}


def _lognormal(p50: float, spread: float) -> dict[str, Any]:
    return {"distribution": "lognormal", "p50": p50, "p90": p50 * spread}


_LENGTHS = st.one_of(
    st.builds(_fixed, st.integers(1, 50_000)),
    st.builds(_uniform, st.integers(1, 9), st.integers(0, 99)),
    st.builds(_lognormal, st.floats(10, 1e4), st.floats(1.1, 5)),
)


def _subset(options: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({}, optional=options)


def _synthetic(num: int, arrival: dict, prompt: dict, output: dict, extra: dict) -> dict[str, Any]:
    return {
        "trace": "synthetic",
        "num_requests": num,
        "arrival": arrival,
        "prompt": prompt,
        "output": output,
        **extra,
    }


def _trace(name: str, spread: bool, extra: dict) -> dict[str, Any]:
    return {"trace": name, **extra, **({"spread_bursts": True} if spread else {})}


_ARRIVALS = st.one_of(
    st.fixed_dictionaries({"process": st.just("poisson"), "rate_per_s": _positive}),
    st.fixed_dictionaries({"process": st.just("gamma"), "rate_per_s": _positive, "cv": _positive}),
)
_WORKLOADS = st.one_of(
    st.builds(_synthetic, st.integers(1, 1000), _ARRIVALS, _LENGTHS, _LENGTHS, _subset(_SYNTHETIC_KEYS)),
    st.builds(_trace, st.just("default"), st.booleans(), _subset(_TRACE_KEYS)),  # spread: Mooncake only
    st.builds(_trace, st.just("azure-code-slice"), st.just(False), _subset(_TRACE_KEYS)),
)
_SCENARIO_KEYS = {
    "seed": st.integers(0, 2**63 - 1),
    "layouts": st.sampled_from([["off"], ["on"], ["on", "off"]]),
    "deployment": _subset({
        "max_num_seqs": st.integers(1, 64),
        "kv_cache_memory_bytes": st.integers(10**9, 10**10),
    }),
    "scheduler": _subset({
        "max_num_batched_tokens": st.integers(1, 65536),
        "long_prefill_token_threshold": st.integers(0, 4096),
        "defer_block_free": st.booleans(),
        "mtp_hash_mode": st.sampled_from(["eagle-drop", "lookahead"]),
    }),
    "mtp": _subset({"acceptance_rates": st.lists(st.floats(0, 1), min_size=3, max_size=3)}),
    "allocator": _subset({"enable_prefix_caching": st.booleans()}),
    "fork": _subset({
        "base": st.sampled_from(["fork", "upstream"]),
        "mamba_retain_checkpoint": st.booleans(),
        "mamba_hold_partial_tail": st.booleans(),
        "deferred_free_eviction_order": st.booleans(),
    }),
    "step_time": _subset({"step_overhead_s": st.floats(1e-4, 0.1), "memory_efficiency": st.floats(0.05, 1)}),
    "simulation": _subset({
        "max_time_s": st.one_of(st.none(), _positive),
        "sample_interval_s": st.one_of(st.none(), st.floats(0.1, 10)),
        "fast_path": st.booleans(),
    }),
}  # fmt: skip
SCENARIOS = st.builds(
    lambda workload, sections: {**sections, "workload": workload}, _WORKLOADS, _subset(_SCENARIO_KEYS)
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=SCENARIOS)
def test_generated_scenarios_round_trip(tmp_path, data):
    """Every generated scenario is valid (the strategies keep to the
    bounds), so each example loads, records and reloads equal."""
    assert_round_trips(load_scenario(str(write_scenario(tmp_path, "generated", **data))))


def test_a_record_without_base_dir_loads_as_a_scenario_file(tmp_path):
    """A record is also a scenario file a user can copy and edit: written as
    YAML without ``base_dir`` (the file's folder gives it), it loads equal."""
    scenario = load_scenario("chat-slice")
    data = scenario_to_dict(scenario)
    del data["base_dir"]
    copy = tmp_path / "copy.yaml"
    copy.write_text(yaml.safe_dump(data))
    assert load_scenario(str(copy)).model_copy(update={"base_dir": scenario.base_dir}) == scenario
