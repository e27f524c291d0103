"""Small scenarios for the simulator tests: written to YAML and loaded
through the same path users take (``load_scenario``)."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import yaml

from sim.analysis.runs import RunResult, run_scenario
from sim.paths import DEFAULT_MODEL, SCENARIOS_DIR
from sim.scenario import Scenario, load_scenario

# 20K-token prompts hold 7 attention blocks (3,200 tokens each) plus the
# Mamba groups' 5 each: ~28 blocks per request in the old layout, ~22 in the
# new, so with 32 sequences the 317-block pool, not the cap, binds.
LONG_PROMPTS = {
    "trace": "synthetic",
    "num_requests": 30,
    "arrival": {"process": "poisson", "rate_per_s": 2.0},
    "prompt": {"distribution": "fixed", "tokens": 20000},
    "output": {"distribution": "fixed", "tokens": 300},
}


# 6K-token prompts with 3K-token outputs arriving fast: requests pile up
# until the pool stops admitting (old ~16 at once, new ~22).
POOL_BINDS = {
    "trace": "synthetic",
    "num_requests": 30,
    "arrival": {"process": "poisson", "rate_per_s": 10.0},
    "prompt": {"distribution": "fixed", "tokens": 6000},
    "output": {"distribution": "fixed", "tokens": 3000},
}


# A step-time model whose step duration is hand-computable (the engine
# timeline's derivation, tests/test_engine_timeline.py): TP = PP = 1 and the
# linear clock, so step_s = 0.2 + num_scheduled_tokens / 1000.
HAND_STEP_TIME = {
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "layer_partition": None,
    "step_overhead_s": 0.2,
    "seconds_per_token": 0.001,
}


class RecordingBar:
    """A stand-in for tqdm that keeps its arguments and updates (a test
    resets ``made`` and monkeypatches the module's ``tqdm`` with it)."""

    made: list[RecordingBar] = []

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs, self.n, self.updates = kwargs, 0.0, []
        RecordingBar.made.append(self)

    def __enter__(self) -> RecordingBar:
        return self

    def __exit__(self, *exc: object) -> bool:
        return False

    def update(self, amount: float) -> None:
        self.updates.append(amount)
        self.n += amount


# kvsim's defaults before the rig became the default (issue 21.1): the
# synchronous loop, an 8,192-token budget, rates 0.8/0.7/0.6 and vLLM's own
# block flags (the planner's computed 3,200-token block, hits on the block,
# no RecoverSSM). The tests' small scenarios were derived on these, so
# ``write_scenario`` pins them under whatever a test gives (``rig=True``:
# the scenario defaults, the rig as shipped). The same settings as
# scenarios/old-defaults.yaml, less its 16 sequences.
PRE_RIG: dict[str, dict[str, Any]] = {
    "deployment": {"block_size": None, "prefix_match_unit": None, "use_replayssm": False},
    "scheduler": {"max_num_batched_tokens": 8192},
    "engine": {"mode": "sync"},
    "mtp": {"acceptance_rates": [0.8, 0.7, 0.6]},
}


def pre_rig(sections: dict[str, Any]) -> dict[str, Any]:
    """``sections`` over ``PRE_RIG``, key by key (MTP rates or a profile
    given replace the pinned rates whole)."""
    merged = dict(sections)
    for key, pinned in PRE_RIG.items():
        given = sections.get(key)
        if given is None:
            merged[key] = pinned
        elif isinstance(given, dict) and key != "mtp":
            merged[key] = {**pinned, **given}
    return merged


def write_scenario(tmp_path: Path, name: str = "test", *, rig: bool = False, **sections: Any) -> Path:
    sections = sections if rig else pre_rig(sections)
    data: dict[str, Any] = {"name": name, "seed": 0, "model": str(DEFAULT_MODEL), **sections}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def scenario(
    tmp_path: Path, name: str = "test", overrides: list[str] | None = None, **sections: Any
) -> Scenario:
    return load_scenario(str(write_scenario(tmp_path, name, **sections)), overrides)


def run(tmp_path: Path, name: str = "test", layouts=None, **sections: Any) -> RunResult:
    return run_scenario(scenario(tmp_path, name, **sections), layouts)


# A server's workload of one tiny request: the tests send their own.
NO_WORKLOAD = {
    "trace": "synthetic",
    "num_requests": 1,
    "arrival": {"process": "constant", "rate_per_s": 1.0},
    "prompt": {"distribution": "fixed", "tokens": 10},
    "output": {"distribution": "fixed", "tokens": 1},
}


@cache
def conformance_shape(shape: str) -> Scenario:
    """A conformance shape (``scenarios/conformance/SHAPE.yaml``)."""
    return load_scenario(str(SCENARIOS_DIR / "conformance" / f"{shape}.yaml"))


@cache
def conformance_requests(shape: str) -> tuple:
    """The shape's trace (sampled once per test process)."""
    from sim.analysis.runs import scenario_workload

    return scenario_workload(conformance_shape(shape)).requests
