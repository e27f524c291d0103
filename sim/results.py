"""Result files: frames to parquet (plus JSON for the summary), written
atomically, and read back. Only the CLI layer writes files.

A results directory holds ``steps.parquet``, ``requests.parquet``,
``samples.parquet``, ``summary.parquet``, ``summary.json`` and the resolved ``scenario.json``;
``manifest.json`` is written last, so a directory with a manifest is whole.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

FRAMES = ("steps", "requests", "samples", "summary")


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Write through a temporary file in the same directory, then rename it
    into place: readers see the old file or the whole new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it private; results are not
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text(path: Path, text: str) -> None:
    def write(tmp: Path) -> None:
        tmp.write_text(text)

    atomic_write(path, write)


def write_json(path: Path, data: Any) -> None:
    write_text(path, json.dumps(data, indent=2, default=_json_default) + "\n")


def plain_value(value: Any) -> Any:
    """A numpy scalar (what a frame cell holds) as the Python value it carries."""
    return value.item() if hasattr(value, "item") else value


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):
        return plain_value(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def write_frame(path: Path, frame: pd.DataFrame) -> None:
    atomic_write(path, lambda tmp: frame.to_parquet(tmp, index=False))


def write_results(out_dir: Path, frames: dict[str, pd.DataFrame], scenario: dict[str, Any]) -> None:
    manifest = out_dir / "manifest.json"
    manifest.unlink(missing_ok=True)  # the directory is incomplete until rewritten
    for name in FRAMES:
        write_frame(out_dir / f"{name}.parquet", frames[name])
    write_json(out_dir / "summary.json", frames["summary"].to_dict(orient="records"))
    write_json(out_dir / "scenario.json", scenario)
    write_json(manifest, {"frames": [f"{n}.parquet" for n in FRAMES], "scenario": scenario.get("name")})


def read_results(out_dir: Path) -> dict[str, pd.DataFrame]:
    """The frames of a results directory; a one-line error if it is not one."""
    from sim.config import ConfigError

    if not (out_dir / "manifest.json").exists():
        raise ConfigError(f"{out_dir}: not a kvsim results directory (no manifest.json)")
    return {name: pd.read_parquet(out_dir / f"{name}.parquet") for name in FRAMES}


# The frames a replay writes too (it cannot see engine steps).
MEASURED_FRAMES = ("requests", "samples", "summary")


def read_run(out_dir: Path) -> tuple[dict[str, pd.DataFrame], dict[str, Any]]:
    """The frames a results directory holds (a replay writes no ``steps``)
    and its resolved scenario; a one-line error if it is not one."""
    from sim.config import ConfigError

    manifest_path = out_dir / "manifest.json"
    if not manifest_path.exists():
        raise ConfigError(f"{out_dir}: not a kvsim results directory (no manifest.json)")
    missing = [f"{name}.parquet" for name in MEASURED_FRAMES if not (out_dir / f"{name}.parquet").exists()]
    if missing:
        raise ConfigError(f"{out_dir}: incomplete results directory: no {', '.join(missing)}")
    frames = {name: pd.read_parquet(out_dir / f"{name}.parquet") for name in MEASURED_FRAMES}
    if (out_dir / "steps.parquet").exists():
        frames["steps"] = pd.read_parquet(out_dir / "steps.parquet")
    return frames, _scenario_of(out_dir, json.loads(manifest_path.read_text()))


def _scenario_of(out_dir: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """The scenario dict: ``scenario.json``, or the manifest's own copy."""
    if isinstance(manifest.get("scenario"), dict):
        return dict(manifest["scenario"])
    path = out_dir / "scenario.json"
    return dict(json.loads(path.read_text())) if path.exists() else {}
