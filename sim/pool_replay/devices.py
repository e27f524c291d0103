"""Where the pool lives: the device, and how many bytes it may take."""

from __future__ import annotations

import torch

from sim.config import ConfigError

# The CPU pool may take at most this fraction of the available RAM: the
# simulation, vLLM and the replay's own tensors need the rest.
CPU_POOL_FRACTION = 0.25


def available_ram_bytes() -> int:
    try:
        import psutil  # type: ignore[import-untyped]

        return int(psutil.virtual_memory().available)
    except ImportError:
        import os

        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resolve_device(name: str) -> torch.device:
    """A torch device that exists here, or a ``ConfigError`` saying why not."""
    kind = name.split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise ConfigError(f"--device {name}: not a device the replay can use (cpu, cuda or cuda:N)")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name}: not a torch device name") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", built without CUDA")
            raise ConfigError(f"--device {name}: no CUDA device is visible to torch ({build})")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ConfigError(f"--device {name}: only {count} CUDA device(s) here")
    return device


def device_memory_bytes(device: torch.device) -> tuple[int, str]:
    """Bytes a pool may take on ``device``, and how that bound was found."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free), f"free memory of {device} ({total:,} B in all)"
    available = available_ram_bytes()
    return int(available * CPU_POOL_FRACTION), f"a quarter of the {available:,} B of available RAM"


def pool_bytes_for(device: torch.device, requested: int | None, pinned: int) -> tuple[int, str | None]:
    """The pool bytes to plan for: ``requested`` (an error above the
    device's bound) or, by default, the scenario's pin (capped on the CPU)."""
    bound, why = device_memory_bytes(device)
    if requested is not None:
        if requested > bound:
            raise ConfigError(
                f"--pool-bytes {requested:,}: more than the {bound:,} B the {device} allows ({why})"
            )
        return requested, None
    if pinned <= bound:
        return pinned, None
    if device.type == "cuda":
        raise ConfigError(f"the scenario's pool ({pinned:,} B) exceeds the {bound:,} B free on {device}")
    return bound, f"pool capped at {bound:,} B on the cpu ({why}); the scenario pins {pinned:,} B"
