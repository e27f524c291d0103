"""Scenario files: one YAML document that says what to simulate.

Layered and strict: the defaults below (the rig as shipped: the fork's
v2.5.1 serving configuration, ``scripts/serve-v2.5.sh``, on vLLM 0.33.0's
async engine loop), then the scenario file, then ``--set key=value`` overrides (dotted
keys, values read as YAML). An unknown key anywhere is an error naming the
key and the file. No twin in vLLM.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import replace
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from sim.config import (
    MAX_SEED,
    MAX_SIMULATED_S,
    ConfigError,
    DeploymentConfig,
    ModelConfig,
    MTPHashMode,
    StrictModel,
    apply_overrides,
    load_model,
    read_yaml,
    validate,
)
from sim.fork.patches import ForkPatches
from sim.paths import DEFAULT_MODEL, SCENARIOS_DIR
from sim.rig import check_rig_names
from sim.step_time import StepTimeConfig, even_partition
from sim.workloads import WorkloadConfig

# The side-cache layout switch (the fork's VLLM_E2_SIDE_CACHE_LAYOUT): "off"
# plans the pool as upstream vLLM, "on" adds the side-cache layout pass.
# Users still say "layout" (``layouts:``, ``--layout``, the ``layout``
# column), and "layout" means only this switch; not to be confused with the
# planning module (``sim.kv_cache_plan``, printed by ``kvsim pool-plan``) or
# vLLM's memory order (``deployment.kv_cache_layout``, vLLM's name).
SideCacheSwitch = Literal["off", "on"]


class SchedulerSection(StrictModel):
    """vLLM scheduler flags (their engine-argument names)."""

    # The rig's --max-num-batched-tokens (vLLM's own default is 8192).
    max_num_batched_tokens: int = Field(1024, gt=0)
    long_prefill_token_threshold: int = Field(0, ge=0)
    scheduler_reserve_full_isl: bool = True
    defer_block_free: bool = True
    max_concurrent_batches: int = Field(2, ge=1)
    # MTP prefix-cache hashing: the EAGLE block drop (what the fork runs) or
    # vLLM 0.33.0's lookahead hashes (its default with prefix caching).
    mtp_hash_mode: MTPHashMode = "eagle-drop"


# The engine loops kvsim builds (``sim/engine_assembly.py``).
EngineMode = Literal["sync", "async"]


class EngineSection(StrictModel):
    """The engine loop. ``sync``: one step at a time, each output applied
    before the next schedule (vLLM's ``EngineCore.step``, what kvsim's
    scheduler conforms to with ``kvsim conform``). ``async``: the rig's
    loop and the default, vLLM 0.33.0 with async scheduling on Model Runner
    V2 (a batch queue of pp + 1 micro-batches, ``AsyncScheduler``, the
    pipeline clock; ``kvsim conform --engine async``)."""

    mode: EngineMode = "async"

    @property
    def batch_queue(self) -> bool:
        """The engine core is vLLM's batch queue (``step_with_batch_queue``
        over ``AsyncScheduler``, pp + 1 micro-batches on the pipeline clock);
        else one step at a time. The one place ``mode`` is compared: what
        each mode builds is ``sim/engine_assembly.py``'s."""
        return self.mode == "async"


# The rig's default serving: thinking on (serve-v2.5.sh passes
# enable_thinking true as the chat template's default), at the card's 4 K
# depth (the default traffic's median prompt, 8.6 K tokens, is nearer 4 K
# than 32 K; 3.02 against 3.07 tokens per step either way).
RIG_ACCEPTANCE_PROFILE = "thinking-on-4k"


# Drafts per step a scenario may ask for (vLLM accepts any; past a few the
# draft passes cost more than they accept).
MAX_SPECULATIVE_TOKENS = 16


def _profile_rates(name: str, num_speculative_tokens: Any = None) -> tuple[float, ...]:
    """The profile's per-position rates for ``num_speculative_tokens``
    drafts (None: the profile's K). A profile gives one conditional rate,
    P(draft i accepted | the drafts before it accepted), the same at every
    position, so K=2 drafts the profile's first two positions; K=0 keeps
    the rates (nothing reads them)."""
    from sim.rig import acceptance_profile

    rates = acceptance_profile(name).acceptance_rates()
    if not isinstance(num_speculative_tokens, int) or num_speculative_tokens <= 0:
        return rates
    return (rates[0],) * num_speculative_tokens


class MTPSection(StrictModel):
    """Draft acceptance: P(draft i accepted | drafts before it accepted),
    given as rates or as a profile measured on the rig
    (``scenarios/rig/acceptance.yaml``; ``sim.rig``). Default: the profile
    ``RIG_ACCEPTANCE_PROFILE``; rates given alone replace it."""

    acceptance_rates: tuple[float, ...] = Field(
        default_factory=lambda: _profile_rates(RIG_ACCEPTANCE_PROFILE)
    )
    acceptance_profile: str | None = RIG_ACCEPTANCE_PROFILE
    # The drafts per step (vLLM's speculative_config num_speculative_tokens):
    # None keeps the model file's K; 0 serves without MTP (the command
    # without --speculative-config: no drafter, no draft KV).
    num_speculative_tokens: int | None = Field(None, ge=0, le=MAX_SPECULATIVE_TOKENS)

    @model_validator(mode="before")
    @classmethod
    def _rates_of_the_profile(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if "acceptance_profile" not in data:
            # Rates alone are the user's, not the default profile's.
            if "acceptance_rates" in data:
                return {**data, "acceptance_profile": None}
            if data.get("num_speculative_tokens") is None:
                return data
            data = {**data, "acceptance_profile": RIG_ACCEPTANCE_PROFILE}
        if data["acceptance_profile"] is None:
            return data
        rates = _profile_rates(str(data["acceptance_profile"]), data.get("num_speculative_tokens"))
        # A results record (scenario.json) carries both, the rates those of the profile.
        if "acceptance_rates" in data and tuple(data["acceptance_rates"] or ()) != rates:
            raise ValueError("give acceptance_rates or acceptance_profile, not both")
        return {**data, "acceptance_rates": rates}

    @model_validator(mode="after")
    def _rates_are_probabilities(self) -> MTPSection:
        if not self.acceptance_rates or any(not 0 <= r <= 1 for r in self.acceptance_rates):
            raise ValueError("acceptance_rates: each must lie in [0, 1]")
        return self


class AllocatorSection(StrictModel):
    enable_prefix_caching: bool = True


ForkBase = Literal["fork", "upstream"]


class ForkSection(StrictModel):
    """The fork's decision-changing patches (``sim.fork.patches``): ``base``
    ``fork`` (as shipped, the default) or ``upstream`` (vLLM 0.33.0, every
    patch off), then any patch key set on or off. ``fork: upstream`` is
    ``fork: {base: upstream}``."""

    base: ForkBase = "fork"
    # One key per ForkPatches field (a test keeps them equal).
    mamba_retain_checkpoint: bool | None = None
    mamba_hold_partial_tail: bool | None = None
    deferred_free_eviction_order: bool | None = None
    waiter_pins: bool | None = None
    grace_pins: bool | None = None
    threshold_caps_lone_request: bool | None = None
    caches_at_allocation_only: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _base_alone(cls, data: Any) -> Any:
        return {"base": data} if isinstance(data, str) else data

    def patches(self) -> ForkPatches:
        base = ForkPatches() if self.base == "fork" else ForkPatches.upstream()
        chosen = self.model_dump(exclude={"base"}, exclude_none=True)
        return replace(base, **chosen)


# The samples frame holds at most this many rows (~50 MB of gauges; 28 h of
# simulated time at the default 1 s interval).
MAX_SAMPLE_ROWS = 100_000
# A scenario name is the default results directory (results/NAME): one
# plain path component, never a path.
SCENARIO_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,99}")


# The rig's deployment flags where they differ from vLLM's (DeploymentConfig
# keeps vLLM's, which `kvsim pool-plan` reads): --block-size 4096,
# --prefix-match-unit 64, --use-replayssm (RecoverSSM). A scenario's
# deployment section starts from these; `block_size: null`,
# `prefix_match_unit: null`, `use_replayssm: false` give vLLM's.
RIG_DEPLOYMENT: dict[str, Any] = {"block_size": 4096, "prefix_match_unit": 64, "use_replayssm": True}


class SimulationSection(StrictModel):
    # Stop at this simulated time even if requests remain (None: run dry).
    max_time_s: float | None = Field(None, gt=0, le=MAX_SIMULATED_S, allow_inf_nan=False)
    # Run the allocator invariant checker after every step (slow; for CI).
    check_invariants: bool = False
    # Record the gauges every this many simulated seconds (the samples
    # frame: time-uniform curves); None records none.
    sample_interval_s: float | None = Field(1.0, gt=0, allow_inf_nan=False)
    # Skip a decoding request's allocator calls between block boundaries,
    # where they change nothing (sim/sched/fast_path/settled.py); false makes every
    # call, as vLLM's scheduler does. Same frames either way.
    fast_path: bool = True


def check_sample_rows(span_s: float, interval_s: float, what: str) -> None:
    """ValueError when sampling ``span_s`` every ``interval_s`` needs more
    than ``MAX_SAMPLE_ROWS`` rows."""
    rows = span_s / interval_s
    if rows > MAX_SAMPLE_ROWS:
        least = span_s / MAX_SAMPLE_ROWS
        raise ValueError(
            f"sample_interval_s: {interval_s:g} s over {what} {span_s:g} s is {rows:,.0f} sample rows, "
            f"more than {MAX_SAMPLE_ROWS:,}; use sample_interval_s >= {least:.3g} (or null: no samples)"
        )


class Scenario(StrictModel):
    """A resolved scenario: every section validated, paths resolved."""

    name: str
    description: str = ""
    seed: int = Field(0, ge=0, le=MAX_SEED)
    model: str = str(DEFAULT_MODEL)
    layouts: tuple[SideCacheSwitch, ...] = ("off", "on")
    deployment: DeploymentConfig = DeploymentConfig(**RIG_DEPLOYMENT)
    scheduler: SchedulerSection = SchedulerSection()
    engine: EngineSection = EngineSection()
    mtp: MTPSection = MTPSection()
    allocator: AllocatorSection = AllocatorSection()
    fork: ForkSection = ForkSection()
    workload: WorkloadConfig = WorkloadConfig()
    step_time: dict[str, Any] = {}
    simulation: SimulationSection = SimulationSection()
    # Where relative paths in the file resolve (the file's directory).
    base_dir: str = "."

    @field_validator("name")
    @classmethod
    def _name_is_a_path_component(cls, name: str) -> str:
        if not SCENARIO_NAME.fullmatch(name):
            raise ValueError(
                f"{name!r}: a scenario name names its results directory, so it must be one path "
                "component: letters, digits and . _ + - (not first), at most 100 characters"
            )
        return name

    @model_validator(mode="before")
    @classmethod
    def _rig_deployment(cls, data: Any) -> Any:
        """A deployment section given as keys starts from the rig's flags;
        a pipeline degree other than the rig's, without a partition, gets
        vLLM's even split of the model's layers (the rig's 25/23 is its
        VLLM_PP_LAYER_PARTITION)."""
        if not (isinstance(data, dict) and isinstance(data.get("deployment"), dict)):
            return data
        deployment = {**RIG_DEPLOYMENT, **data["deployment"]}
        pp = deployment.get("pipeline_parallel_size")
        if isinstance(pp, int) and pp > 0 and pp != 2 and "layer_partition" not in deployment:
            deployment["layer_partition"] = list(even_partition(_model_layers(data.get("model")), pp))
        return {**data, "deployment": deployment}

    @model_validator(mode="after")
    def _engine_mode_runs_here(self) -> Scenario:
        if not self.engine.batch_queue:
            return self
        if self.deployment.kv_connector:
            raise ValueError(
                "engine.mode: async is not modelled with deployment.kv_connector "
                "(kvsim's AsyncScheduler twin has no connector); use engine.mode: sync"
            )
        depth = self.deployment.pipeline_parallel_size + 1
        if "max_concurrent_batches" in self.scheduler.model_fields_set and (
            self.scheduler.max_concurrent_batches != depth
        ):
            raise ValueError(
                f"scheduler.max_concurrent_batches: {self.scheduler.max_concurrent_batches} with "
                f"engine.mode: async, where vLLM derives pp + 1 = {depth}; leave it out"
            )
        return self

    @property
    def max_concurrent_batches(self) -> int:
        """Steps in flight: vLLM's derivation (``config/vllm.py``) with
        async scheduling on Model Runner V2, pp + 1; else the scheduler
        section's (pp, the synchronous PP value, by default 2)."""
        if self.engine.batch_queue:
            return self.deployment.pipeline_parallel_size + 1
        return self.scheduler.max_concurrent_batches

    def load_model(self) -> ModelConfig:
        """The model file, with ``mtp.num_speculative_tokens`` when the
        scenario sets it (K=0: no MTP layer is built, as vLLM without a
        speculative config). Read once per scenario: kept on it (and on
        its copies) by what it is read from, so a copy that names another
        model file or K reads its own."""
        key = (self.model, self.mtp.num_speculative_tokens)
        models = self._models_read
        if key not in models:
            models[key] = self._read_model()
        return models[key]

    @cached_property
    def _models_read(self) -> dict[tuple[str, int | None], ModelConfig]:
        return {}

    def _read_model(self) -> ModelConfig:
        model = load_model(Path(self.model))
        k = self.mtp.num_speculative_tokens
        if k is None or not model.mtp.num_layers:
            return model
        mtp = model.mtp.model_copy(
            update={"num_speculative_tokens": k, "num_layers": model.mtp.num_layers if k else 0}
        )
        return model.model_copy(update={"mtp": mtp})

    def check_against_model(self, model: ModelConfig, source: str) -> None:
        """The MTP rates must give one rate per draft position of the model."""
        k = model.mtp.num_speculative_tokens
        rates = self.mtp.acceptance_rates
        if k and len(rates) != k:
            raise ConfigError(
                f"{source}: mtp.acceptance_rates: {len(rates)} rates given, model "
                f"{model.name!r} drafts {k} tokens (num_speculative_tokens): give exactly {k}"
            )

    def step_time_config(self, source: str = "scenario") -> StepTimeConfig:
        """The step-time coefficients: the rig's defaults, the deployment's
        parallelism, then the scenario's ``step_time:`` overrides."""
        model = self.load_model()
        values = {
            "tensor_parallel_size": self.deployment.tensor_parallel_size,
            "pipeline_parallel_size": self.deployment.pipeline_parallel_size,
            "layer_partition": self.deployment.layer_partition,
            "num_speculative_tokens": model.mtp.num_speculative_tokens,
            # RecoverSSM replays only under MTP (model_specs.uses_recoverssm).
            "recover_ssm_replay": self.deployment.use_replayssm and model.mtp.num_speculative_tokens > 0,
            # Where align mode cuts prefill chunks (None: the planner's block,
            # set by the engine: engine_assembly.step_time_model).
            "block_size": self.deployment.block_size,
            "max_num_batched_tokens": self.scheduler.max_num_batched_tokens,
            **self.step_time,
        }
        config = validate(StepTimeConfig, values, f"{source}: step_time")
        check_rig_names(config, source)
        check_parallelism(config, source)
        return config


def _model_layers(model: Any) -> int:
    """The decoder layers of the scenario's model file (the default model
    when it names none or cannot be read: validation reports it later)."""
    try:
        return load_model(Path(model) if isinstance(model, str) else DEFAULT_MODEL).num_layers
    except ConfigError:
        return load_model(DEFAULT_MODEL).num_layers


def check_parallelism(config: StepTimeConfig, source: str) -> None:
    """The TP degree divides the heads the model shards (one line naming
    the key otherwise)."""
    from sim.model_arch import check_tensor_parallel, load_architecture

    try:
        check_tensor_parallel(load_architecture(config.architecture_path), config.tensor_parallel_size)
    except ConfigError as error:
        raise ConfigError(f"{source}: deployment.tensor_parallel_size {error}") from None


def resolve_scenario_path(name_or_path: str) -> Path:
    """A path, or the name of a scenario shipped in ``scenarios/``."""
    path = Path(name_or_path)
    if path.exists():
        return path
    # Only a bare name (no directory, no .yaml) can mean a shipped scenario.
    if path.name == name_or_path and path.suffix not in (".yaml", ".yml") and name_or_path not in (".", ".."):
        shipped = SCENARIOS_DIR / f"{name_or_path}.yaml"
        if shipped.exists():
            return shipped
        raise ConfigError(f"{name_or_path}: no such scenario file, nor a shipped scenario of that name")
    raise ConfigError(f"{name_or_path}: no such scenario file")


def load_scenario(name_or_path: str, overrides: list[str] | None = None) -> Scenario:
    path = resolve_scenario_path(name_or_path)
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of scenario keys")
    data = apply_overrides(data, overrides or [])
    data.setdefault("name", path.stem)
    source = str(path) + (" (with --set overrides)" if overrides else "")
    if "base_dir" in data:
        raise ConfigError(f"{source}: unknown key 'base_dir'")
    data["base_dir"] = str(path.parent.resolve())
    if "model" in data and isinstance(data["model"], str):
        data["model"] = str((path.parent / data["model"]).resolve())
    scenario = validate(Scenario, data, source)
    # Fail early, naming the file, on a model or step-time problem.
    scenario.check_against_model(scenario.load_model(), source)
    scenario.step_time_config(source)
    return scenario


def add_override_argument(parser: argparse.ArgumentParser, scope: str = "") -> None:
    """The ``--set KEY=VALUE`` flag every scenario command takes."""
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a scenario key{scope} (dotted, value read as YAML); repeatable",
    )


def scenario_to_dict(scenario: Scenario) -> dict[str, Any]:
    """The resolved scenario as plain data (written next to the results as
    ``scenario.json``): every key, defaults included, so the record says
    what ran whatever later versions default to. ``scenario_from_record``
    loads it back to an equal scenario (docs/results.md). One key is left
    out: under ``engine.mode: async`` the engine derives the batches in
    flight (pp + 1) and refuses a ``scheduler.max_concurrent_batches`` that
    is named, so the record must not name its unused default."""
    data = scenario.model_dump(mode="json")
    if scenario.engine.batch_queue:
        del data["scheduler"]["max_concurrent_batches"]
    return data


def scenario_from_record(data: Any, source: str) -> Scenario:
    """The scenario a results directory recorded (``scenario_to_dict``),
    checked as strictly as a scenario file: a one-line ``ConfigError``
    naming ``source`` and the key."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of scenario keys")
    scenario = validate(Scenario, data, source)
    scenario.check_against_model(scenario.load_model(), source)
    scenario.step_time_config(source)
    return scenario
