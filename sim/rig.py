"""The rig as data: GPUs, quantization schemes and MTP acceptance profiles
by name (``scenarios/rig/*.yaml``). No twin in vLLM. A name that is not in
its file is a ``ConfigError`` naming the key and the names there are."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field

from sim.config import ConfigError, StrictModel, read_yaml, validate
from sim.model_arch import QUANT_GROUPS
from sim.paths import SCENARIOS_DIR

RIG_DIR = SCENARIOS_DIR / "rig"


class GPU(StrictModel):
    description: str = ""
    memory_bytes: int = Field(gt=0)
    memory_bandwidth_bytes_per_s: float = Field(gt=0)
    tensor_flops: float = Field(gt=0)  # dense, FP32 accumulate, at boost clock
    power_cap_clock_fraction: float = Field(gt=0, le=1)
    pcie_bandwidth_bytes_per_s: float = Field(gt=0)

    @property
    def sustained_flops(self) -> float:
        return self.tensor_flops * self.power_cap_clock_fraction


class Quantization(StrictModel):
    description: str = ""
    bits: dict[str, float]
    host: tuple[str, ...] = ()
    kv_cache_bits: float = Field(gt=0)

    def bytes_per_param(self, group: str) -> float:
        return self.bits[group] / 8

    def model_post_init(self, _: Any) -> None:
        missing = [g for g in QUANT_GROUPS if g not in self.bits]
        unknown = [g for g in (*self.bits, *self.host) if g not in QUANT_GROUPS]
        if missing or unknown:
            raise ValueError(
                f"bits: missing {missing}, unknown {unknown} (groups: {', '.join(QUANT_GROUPS)})"
            )


class AcceptanceProfile(StrictModel):
    tokens_per_step: float = Field(ge=1)
    num_speculative_tokens: int = Field(gt=0)

    def acceptance_rates(self) -> tuple[float, ...]:
        """One conditional rate ``r`` for every draft position such that the
        expected tokens per step, ``1 + r + r^2 + ... + r^K``, is the
        measured figure (bisection: the sum rises with ``r``)."""
        k = self.num_speculative_tokens
        if self.tokens_per_step > k + 1:
            raise ConfigError(f"tokens_per_step {self.tokens_per_step} is more than K + 1 = {k + 1}")
        low, high = 0.0, 1.0
        for _ in range(60):
            mid = (low + high) / 2
            low, high = (
                (mid, high) if sum(mid**i for i in range(k + 1)) < self.tokens_per_step else (low, mid)
            )
        return (round((low + high) / 2, 6),) * k


def _entry(file: str, key: str, name: str, cls: type[Any], rig_dir: Path) -> Any:
    path = rig_dir / file
    entries = read_yaml(path)
    if name not in entries:
        raise ConfigError(
            f"{key}: unknown {key.split('.')[-1]} {name!r}; {path.name} has {', '.join(entries)}"
        )
    return validate(cls, entries[name], f"{path}: {name}")


def check_rig_names(config: Any, source: str) -> None:
    """The GPU and quantization a step-time config names exist (one line
    naming the scenario and the key otherwise)."""
    try:
        gpu(config.gpu)
        quantization(config.quantization)
    except ConfigError as error:
        raise ConfigError(f"{source}: {error}") from None


def gpu(name: str, rig_dir: Path = RIG_DIR) -> GPU:
    return _entry("gpus.yaml", "step_time.gpu", name, GPU, rig_dir)


def quantization(name: str, rig_dir: Path = RIG_DIR) -> Quantization:
    return _entry("quantizations.yaml", "step_time.quantization", name, Quantization, rig_dir)


def acceptance_profile(name: str, rig_dir: Path = RIG_DIR) -> AcceptanceProfile:
    return _entry("acceptance.yaml", "mtp.acceptance_profile", name, AcceptanceProfile, rig_dir)
