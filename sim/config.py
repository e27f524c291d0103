"""Strict configuration: the model description and the deployment.

Configuration is layered (defaults, then a file, then ``--set key=value``
overrides) and strict: an unknown key or a bad value is a ``ConfigError``
naming the file and the dotted key. Models are pydantic models, frozen, with
``extra="forbid"`` so a misspelt key can never be silently ignored.

No twin in vLLM: this is kvsim's own description of what the fork's engine
would be started with.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """Bad configuration input; ``str()`` is one line naming file and key."""


# Bounds of physical sense. Each keeps a typo (an extra zero, a value in the
# wrong unit) from turning into a run that exhausts memory or time, and each
# message quotes its bound and reason.
# A KV pool per rank: no GPU has more than 288 GB of memory (AMD MI355X).
MAX_KV_CACHE_MEMORY_BYTES = 10**12
# The figure formats written by default (here, so the plot command's parser
# imports no matplotlib).
FIGURE_FORMATS = ("png", "svg")
# Tokens in one request (prompt, output, max_model_len): the longest context
# window any served model offers is 10 M tokens (Llama 4 Scout).
MAX_REQUEST_TOKENS = 10_000_000
# Ranks per parallel dimension: far past any deployment of one engine.
MAX_PARALLEL_SIZE = 1024
# Seeds: numpy's SeedSequence takes ints >= 0; below 2**63 they stay int64
# in every frame and JSON file.
MAX_SEED = 2**63 - 1
# Simulated time: a year is far past any trace (the longest public serving
# trace, Azure 2024, spans a week).
MAX_SIMULATED_S = 366 * 86_400.0
# Any YAML input (scenario, model, gates): a page of settings, not data.
MAX_YAML_BYTES = 1 << 20


DType = Literal["fp32", "fp16", "bf16", "fp8_e4m3"]
# How MTP drafts shape prefix-cache hashes (vLLM's two modes; see
# ``MTPHashing`` in sim/kv_cache_manager.py). Here so the command line can
# offer them without importing vLLM.
MTPHashMode = Literal["eagle-drop", "lookahead"]
MTP_HASH_MODES: tuple[MTPHashMode, ...] = ("eagle-drop", "lookahead")


class StrictModel(BaseModel):
    """Frozen; an unknown key is an error; NaN and infinities are errors
    (no size, time or rate of kvsim's is infinite or undefined)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class GDNConfig(StrictModel):
    """Gated DeltaNet linear attention (sharded over TP)."""

    num_key_heads: int = Field(gt=0)
    num_value_heads: int = Field(gt=0)
    key_head_dim: int = Field(gt=0)
    value_head_dim: int = Field(gt=0)
    conv_kernel: int = Field(gt=0)
    conv_state_dtype: DType


class PLEConfig(StrictModel):
    """The per-layer-embedding short-conv state (TP-replicated)."""

    layer: int = Field(ge=0)
    intermediate_size: int = Field(gt=0)
    conv_kernel: int = Field(gt=0)
    state_dtype: DType
    tp_replicated: bool


class QSAAttentionConfig(StrictModel):
    num_kv_heads: int = Field(gt=0)
    head_size: int = Field(gt=0)
    kv_cache_dtype: DType


class CompressedKeysConfig(StrictModel):
    head_size: int = Field(gt=0)
    dtype: DType
    tokens_per_state: int = Field(gt=0)


class RawKeyRingConfig(StrictModel):
    capacity_tokens: int = Field(gt=0)
    head_size: int = Field(gt=0)
    dtype: DType


class QSAConfig(StrictModel):
    """QSA attention layers: main KV, compressed keys, raw-key ring."""

    every: int = Field(gt=0)
    offset: int = Field(ge=0)
    attention: QSAAttentionConfig
    compressed_keys: CompressedKeysConfig
    raw_key_ring: RawKeyRingConfig


class MTPConfig(StrictModel):
    """MTP speculative decoding: QSA draft layers after the last layer."""

    num_layers: int = Field(ge=0)
    num_speculative_tokens: int = Field(ge=0)


class ModelConfig(StrictModel):
    """A Flash-Next-shaped hybrid model, in terms a user can edit."""

    name: str
    num_layers: int = Field(gt=0)
    qsa: QSAConfig
    gdn: GDNConfig
    ple: PLEConfig | None
    mtp: MTPConfig
    ssm_state_dtype: Literal["fp32", "fp16"]
    mamba_cache_mode: Literal["align"]
    # The attention backend's smallest kernel block; the hybrid block size is
    # a multiple of it (vLLM's Platform._align_hybrid_block_size).
    kernel_block_alignment: int = Field(gt=0)

    @model_validator(mode="after")
    def _ple_inside_model(self) -> ModelConfig:
        if self.ple is not None and self.ple.layer >= self.num_layers:
            raise ValueError(f"ple.layer {self.ple.layer} is past the last layer ({self.num_layers - 1})")
        return self

    def is_qsa_layer(self, index: int) -> bool:
        return index % self.qsa.every == self.qsa.offset


class DeploymentConfig(StrictModel):
    """How the engine is started: parallelism, memory pin, limits."""

    tensor_parallel_size: int = Field(2, gt=0)
    pipeline_parallel_size: int = Field(2, gt=0)
    # Layers per PP stage; MTP layers go on the last stage.
    layer_partition: tuple[int, ...] = (25, 23)
    kv_cache_memory_bytes: int = Field(4_100_000_000, gt=0)
    max_model_len: int = Field(262_144, gt=0)
    max_num_seqs: int = Field(8, gt=0)
    kv_cache_layout: Literal["BLNHC", "BLHNC", "LBNHC", "LBHNC"] = "BLNHC"
    kv_connector: bool = False
    hisparse: bool = False
    decode_context_parallel_size: int = Field(1, gt=0)
    # vLLM's --block-size: None lets the planner compute the hybrid block
    # (3,200 tokens for Flash-Next at fp32); a forced size is a floor that
    # the planner keeps when the largest Mamba page fits in its attention
    # page (the fork's v2.5.1 serves 4,096).
    block_size: int | None = Field(None, gt=0)
    # vLLM's --prefix-match-unit (stock since 0.30): the token grid prefix
    # hits land on (vLLM's hash_block_size); None = the block size.
    prefix_match_unit: int | None = Field(None, gt=0)
    # vLLM's --use-replayssm: with MTP the fork (patches 0071/0072) runs
    # RecoverSSM for the GDN and PLE states (a replay record in each GDN
    # page, no per-draft state blocks); without MTP it falls back (0085).
    use_replayssm: bool = False

    @model_validator(mode="after")
    def _physical(self) -> DeploymentConfig:
        bounded = (
            ("kv_cache_memory_bytes", MAX_KV_CACHE_MEMORY_BYTES, "no GPU has more than 288 GB"),
            ("max_model_len", MAX_REQUEST_TOKENS, "no model serves a longer context"),
            ("tensor_parallel_size", MAX_PARALLEL_SIZE, "far past any deployment"),
            ("pipeline_parallel_size", MAX_PARALLEL_SIZE, "far past any deployment"),
            ("decode_context_parallel_size", MAX_PARALLEL_SIZE, "far past any deployment"),
            ("block_size", MAX_REQUEST_TOKENS, "no request is longer"),
            ("prefix_match_unit", MAX_REQUEST_TOKENS, "no request is longer"),
        )
        for field, bound, reason in bounded:
            value = getattr(self, field)
            if value is not None:
                check_bound(field, value, bound, reason)
        return self

    @model_validator(mode="after")
    def _unit_divides_block(self) -> DeploymentConfig:
        """Prefix hits land on a grid inside each block (vLLM rejects a unit
        that does not divide every prefix-cacheable group's block size; a
        computed block size is checked when the pool is planned)."""
        unit, block = self.prefix_match_unit, self.block_size
        if unit is not None and block is not None and block % unit:
            raise ValueError(
                f"prefix_match_unit {unit} does not divide block_size {block}: prefix hits land on "
                "a grid of prefix_match_unit tokens inside each block"
            )
        return self

    @model_validator(mode="after")
    def _partition_matches_pp(self) -> DeploymentConfig:
        if len(self.layer_partition) != self.pipeline_parallel_size:
            raise ValueError(
                f"layer_partition has {len(self.layer_partition)} stages, "
                f"pipeline_parallel_size is {self.pipeline_parallel_size}"
            )
        if any(n <= 0 for n in self.layer_partition):
            raise ValueError("layer_partition: every stage needs at least one layer")
        return self


def check_bound(field: str, value: float, bound: float, reason: str) -> None:
    """ValueError (which ``validate`` names with file and key) past ``bound``."""
    if value > bound:
        raise ValueError(f"{field}: {value:g} is more than {bound:g} ({reason})")


def check_partition(model: ModelConfig, deployment: DeploymentConfig) -> None:
    total = sum(deployment.layer_partition)
    if total != model.num_layers:
        raise ConfigError(
            f"deployment.layer_partition {list(deployment.layer_partition)} covers "
            f"{total} layers, model {model.name!r} has {model.num_layers}"
        )


_M = TypeVar("_M", bound=BaseModel)


def _location(loc: tuple[Any, ...]) -> str:
    return ".".join(str(part) for part in loc) or "(top level)"


def describe_validation_error(error: ValidationError, source: str) -> str:
    """One line for the first problem pydantic found, naming file and key."""
    errors = error.errors()
    # An unknown key explains the "missing" ones that follow it, so it wins.
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    where = _location(first["loc"])
    if first["type"] == "extra_forbidden":
        return f"{source}: unknown key '{where}'"
    message = first["msg"].removeprefix("Value error, ")
    return f"{source}: {where}: {message}"


def validate(model_cls: type[_M], data: Any, source: str) -> _M:
    try:
        return model_cls.model_validate(data)
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error, source)) from None


class YamlLoader(yaml.SafeLoader):
    """YAML 1.2 booleans: only true/false. YAML 1.1 also reads on/off/yes/no
    as booleans, which would turn the layout names off and on into False and
    True."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        # An alias (``*name``) shares a node; copying a scenario expands it,
        # so a few lines of aliases could expand to gigabytes ("billion
        # laughs"). Settings files do not need them.
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise yaml.composer.ComposerError(None, None, "aliases (*name) are not supported", mark)
        return super().compose_node(parent, index)


YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
# YAML 1.2 floats: ``4.1e9`` (no dot needed, no sign needed in the exponent)
# is a number, as on the command line; YAML 1.1 reads it as a string.
YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_yaml_text(text: str) -> Any:
    return yaml.load(text, Loader=YamlLoader)


def read_text(
    path: Path,
    *,
    max_bytes: int | None = None,
    error: Callable[[Path, int | None, str], ConfigError] | None = None,
) -> str:
    """The one reader of kvsim's text inputs (YAML, traces, run files).

    A missing or unreadable file, one larger than ``max_bytes`` and bytes
    that are not UTF-8 are each a one-line error naming the file (and the
    line of the first bad byte). ``error(path, line, problem)`` builds it.
    """
    make = error or input_error
    try:
        size = path.stat().st_size
        if max_bytes is not None and size > max_bytes:
            raise make(path, None, f"{size:,} bytes: more than {max_bytes:,}, too large for its kind")
        data = path.read_bytes()
    except OSError as problem:
        raise make(path, None, f"cannot read ({problem.strerror or problem})") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as problem:
        line = data.count(b"\n", 0, problem.start) + 1
        raise make(path, line, f"not UTF-8 text (byte 0x{data[problem.start]:02x})") from None


def input_error(path: Path, line: int | None, problem: str) -> ConfigError:
    where = str(path) if line is None else f"{path}:{line}"
    return ConfigError(f"{where}: {' '.join(problem.split())}")


def read_yaml(path: Path) -> Any:
    """Parse a YAML file; errors name the file (and line, when YAML knows it)."""
    text = read_text(path, max_bytes=MAX_YAML_BYTES)
    try:
        data = load_yaml_text(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}:{describe_yaml_error(error)}") from None
    except RecursionError:  # nesting deeper than any settings file
        raise ConfigError(f"{path}: nested too deeply") from None
    return {} if data is None else data


def describe_yaml_error(error: yaml.YAMLError) -> str:
    """`` line N: problem`` (the line when YAML knows it)."""
    mark = getattr(error, "problem_mark", None)
    line = f" line {mark.line + 1}" if mark is not None else ""
    problem = getattr(error, "problem", None) or "invalid YAML"
    return f"{line}: {' '.join(str(problem).split())}"


def load_model(path: Path) -> ModelConfig:
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of model keys")
    return validate(ModelConfig, data, str(path))


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=value`` -> (["a", "b"], parsed value); the value is read as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text!r}: expected key=value")
    path = key.strip().split(".")
    if not all(path):
        raise ConfigError(f"--set {text!r}: expected a dotted key like deployment.max_num_seqs")
    try:
        value = load_yaml_text(raw)
    except yaml.YAMLError:
        value = raw
    except RecursionError:
        raise ConfigError(f"--set {key.strip()}: value nested too deeply") from None
    return path, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with every ``key=value`` override applied."""
    result = _deep_copy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = result
        for part in path[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[path[-1]] = value
    return result


def _deep_copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {key: _deep_copy(value) for key, value in data.items()}
    if isinstance(data, list):
        return [_deep_copy(value) for value in data]
    return data
