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
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """Bad configuration input; ``str()`` is one line naming file and key."""


DType = Literal["fp32", "fp16", "bf16", "fp8_e4m3"]


class StrictModel(BaseModel):
    """Frozen; an unknown key is an error."""

    model_config = ConfigDict(extra="forbid", frozen=True)


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


YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def load_yaml_text(text: str) -> Any:
    return yaml.load(text, Loader=YamlLoader)


def read_yaml(path: Path) -> Any:
    """Parse a YAML file; errors name the file (and line, when YAML knows it)."""
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"{path}: cannot read ({error.strerror})") from None
    try:
        data = load_yaml_text(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or "invalid YAML"
        raise ConfigError(f"{path}:{line}: {problem}") from None
    return {} if data is None else data


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
    try:
        value = load_yaml_text(raw)
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


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
