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


# How the sustained clock follows the power cap: dynamic power is C V^2 f
# and, inside the DVFS range, the voltage rises in proportion to the clock,
# so board power goes as f^3 and the clock a cap holds as the cube root of
# the cap's share of the board power (docs/step-time-model.md, "Power cap").
POWER_CLOCK_EXPONENT = 1 / 3


class GPU(StrictModel):
    description: str = ""
    memory_bytes: int = Field(gt=0)
    memory_bandwidth_bytes_per_s: float = Field(gt=0)
    tensor_flops: float = Field(gt=0)  # dense, FP32 accumulate, at boost clock
    board_power_w: float = Field(gt=0)  # the power the boost clock is rated at
    power_cap_range_w: tuple[float, float]  # what nvidia-smi -pl accepts
    power_cap_w: float = Field(gt=0)  # this entry's cap (step_time.power_cap_w overrides)
    pcie_bandwidth_bytes_per_s: float = Field(gt=0)

    def model_post_init(self, _: Any) -> None:
        self.check_power_cap(self.power_cap_w, "power_cap_w")

    def check_power_cap(self, cap_w: float, key: str) -> None:
        low, high = self.power_cap_range_w
        if not low <= cap_w <= high:
            raise ConfigError(f"{key}: {cap_w:g} W is outside the GPU's power-limit range {low:g}-{high:g} W")

    def clock_fraction(self, cap_w: float | None = None) -> float:
        """The sustained clock over the boost clock under ``cap_w`` (None:
        the entry's cap): ``min(1, (cap / board power)^(1/3))``."""
        cap = self.power_cap_w if cap_w is None else cap_w
        return min(1.0, (cap / self.board_power_w) ** POWER_CLOCK_EXPONENT)

    def sustained_flops(self, cap_w: float | None = None) -> float:
        return self.tensor_flops * self.clock_fraction(cap_w)


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
    """The GPU and quantization a step-time config names exist and its
    power cap is one the GPU takes (one line naming the scenario and the
    key otherwise)."""
    try:
        card = gpu(config.gpu)
        quantization(config.quantization)
        if config.power_cap_w is not None:
            card.check_power_cap(config.power_cap_w, "step_time.power_cap_w")
    except ConfigError as error:
        raise ConfigError(f"{source}: {error}") from None


def gpu(name: str, rig_dir: Path = RIG_DIR) -> GPU:
    return _entry("gpus.yaml", "step_time.gpu", name, GPU, rig_dir)


def quantization(name: str, rig_dir: Path = RIG_DIR) -> Quantization:
    return _entry("quantizations.yaml", "step_time.quantization", name, Quantization, rig_dir)


def acceptance_profile(name: str, rig_dir: Path = RIG_DIR) -> AcceptanceProfile:
    return _entry("acceptance.yaml", "mtp.acceptance_profile", name, AcceptanceProfile, rig_dir)
