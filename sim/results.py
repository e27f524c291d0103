"""Result files: frames to parquet (plus JSON for the summary), written
atomically, and read back. Every writer of result files goes through these
functions: the commands, and the analysis runs that persist their own
parts as they go (a sweep's runs, a capacity search, a gate report, the
plots).

A results directory holds ``steps.parquet``, ``requests.parquet``,
``samples.parquet``, ``summary.parquet``, ``summary.json``, the resolved
``scenario.json`` and the figures under ``plots/``; ``manifest.json`` is
written last and lists every file, so a directory with a manifest is whole.

Writing into a directory first removes its manifest (it is incomplete from
then on), the hidden temporary files of writes a kill cut short, and, once
the new files are written, the files the previous manifest listed that this
run did not write again (a one-layout run over a compare drops its gain
figures). Only files a manifest listed are ever removed. The output is
checked (``check_out_dir``) before any simulation starts.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa

from sim.config import ConfigError

FRAMES = ("steps", "requests", "samples", "summary")
MANIFEST = "manifest.json"
# atomic_write's temporary files: ``.<name>.<random>.tmp``.
TEMP_PATTERN = ".*.tmp"


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
    """Strict JSON: NaN and infinities (a frame's "no value") become null."""
    text = json.dumps(json_safe(data), indent=2, default=_json_default, allow_nan=False)
    write_text(path, text + "\n")


def json_safe(data: Any) -> Any:
    """``data`` with every non-finite float as None (JSON has no NaN)."""
    if isinstance(data, dict):
        return {key: json_safe(value) for key, value in data.items()}
    if isinstance(data, list | tuple):
        return [json_safe(value) for value in data]
    value = plain_value(data) if hasattr(data, "item") else data
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def plain_value(value: Any) -> Any:
    """A numpy scalar (what a frame cell holds) as the Python value it carries."""
    return value.item() if hasattr(value, "item") else value


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):
        return plain_value(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def write_frame(path: Path, frame: pd.DataFrame) -> None:
    atomic_write(path, lambda tmp: frame.to_parquet(tmp, index=False))


def check_out_dir(out_dir: Path, flag: str = "--out") -> None:
    """Before any work: ``out_dir`` is, or can be made, a writable directory.
    Creates nothing (a probe file in the nearest existing ancestor is made
    and removed)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"{flag} {out_dir}: exists and is not a directory")
    ancestor = out_dir
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(f"{flag} {out_dir}: {ancestor} is not a directory")
    try:
        handle, probe = tempfile.mkstemp(dir=ancestor, prefix=".kvsim-probe.", suffix=".tmp")
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        raise ConfigError(f"{flag} {out_dir}: cannot write in {ancestor} ({error.strerror})") from None


def remove_partial_writes(directory: Path) -> None:
    """The temporary files of writes that a kill -9 cut short."""
    if directory.is_dir():
        for tmp in directory.glob(TEMP_PATTERN):
            tmp.unlink(missing_ok=True)


def _listed_files(out_dir: Path) -> set[str]:
    """The files the directory's manifest lists, as safe relative paths."""
    try:
        manifest = json.loads((out_dir / MANIFEST).read_text())
        files = manifest.get("files", []) + manifest.get("frames", [])
    except (OSError, ValueError, AttributeError, TypeError):
        return set()
    return {
        name
        for name in files
        if isinstance(name, str) and not Path(name).is_absolute() and ".." not in Path(name).parts
    }


def write_results(
    out_dir: Path,
    frames: dict[str, pd.DataFrame],
    scenario: dict[str, Any],
    *,
    figures: Callable[[Path], list[Path]] | None = None,
    manifest_extra: dict[str, Any] | None = None,
) -> list[Path]:
    """The frames given (a replay has no ``steps``: a live server does not
    expose them), summary and scenario JSON, then ``figures(out_dir)``, then
    the manifest listing them all; ``manifest_extra`` adds keys to it (a
    replay records ``"complete": false`` when it was cut short). A write that
    fails removes what this call wrote and leaves no manifest (a one-line
    ``ConfigError``)."""
    manifest = out_dir / MANIFEST
    previous = _listed_files(out_dir)
    manifest.unlink(missing_ok=True)  # the directory is incomplete until rewritten
    for directory in (out_dir, out_dir / "plots"):
        remove_partial_writes(directory)
    written: list[Path] = []
    names = [name for name in FRAMES if name in frames]
    try:
        for name in names:
            written.append(out_dir / f"{name}.parquet")
            write_frame(written[-1], frames[name])
        written.append(out_dir / "summary.json")
        write_json(written[-1], frames["summary"].to_dict(orient="records"))
        written.append(out_dir / "scenario.json")
        write_json(written[-1], scenario)
        if figures is not None:
            written.extend(figures(out_dir))
    except (OSError, OverflowError, pa.ArrowException) as error:
        for path in written:
            path.unlink(missing_ok=True)
        raise ConfigError(f"{out_dir}: cannot write the results ({_one_line(error)}); nothing kept") from None
    files = sorted(str(path.relative_to(out_dir)) for path in written)
    for stale in sorted(previous - set(files)):
        (out_dir / stale).unlink(missing_ok=True)
    contents = {
        "frames": [f"{n}.parquet" for n in names],
        "files": files,
        "scenario": scenario.get("name"),
        "complete": True,
    }
    write_json(manifest, {**contents, **(manifest_extra or {})})
    return written


def add_to_manifest(out_dir: Path, paths: list[Path]) -> None:
    """List files written later into a complete directory (``kvsim plot``'s
    figures), so the next run into it removes them if it does not rewrite them."""
    manifest_path = out_dir / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        return  # not a complete results directory: nothing to keep honest
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list):
        return
    added = {str(path.relative_to(out_dir)) for path in paths if path.is_relative_to(out_dir)}
    manifest["files"] = sorted(set(manifest["files"]) | added)
    write_json(manifest_path, manifest)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())[:200] or type(error).__name__


def read_frame(path: Path) -> pd.DataFrame:
    """A parquet frame; a missing or corrupt file is a one-line error."""
    try:
        return pd.read_parquet(path)
    except (OSError, ValueError, pa.ArrowException) as error:
        raise ConfigError(f"{path}: not a readable parquet frame ({_one_line(error)})") from None


def read_manifest(out_dir: Path) -> dict[str, Any]:
    """The manifest of a results directory; a one-line error if it is not one."""
    path = out_dir / MANIFEST
    if not path.exists():
        raise ConfigError(f"{out_dir}: not a kvsim results directory (no manifest.json)")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path}: not a readable manifest ({_one_line(error)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return data


def read_results(out_dir: Path) -> dict[str, pd.DataFrame]:
    """The frames the manifest lists (all four for a simulation; no
    ``steps`` for a replay); a one-line error if it is not a results directory."""
    listed = read_manifest(out_dir).get("frames", [f"{n}.parquet" for n in FRAMES])
    names = [name for name in FRAMES if f"{name}.parquet" in listed]
    return {name: read_frame(out_dir / f"{name}.parquet") for name in names}


# The frames a replay writes too (it cannot see engine steps).
MEASURED_FRAMES = ("requests", "samples", "summary")


def read_run(out_dir: Path) -> tuple[dict[str, pd.DataFrame], dict[str, Any]]:
    """The frames a results directory holds (a replay writes no ``steps``)
    and its resolved scenario; a one-line error if it is not one."""
    manifest = read_manifest(out_dir)
    missing = [f"{name}.parquet" for name in MEASURED_FRAMES if not (out_dir / f"{name}.parquet").exists()]
    if missing:
        raise ConfigError(f"{out_dir}: incomplete results directory: no {', '.join(missing)}")
    frames = read_results(out_dir)
    return frames, _scenario_of(out_dir, manifest)


def _scenario_of(out_dir: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """The scenario dict: ``scenario.json``, or the manifest's own copy."""
    if isinstance(manifest.get("scenario"), dict):
        return dict(manifest["scenario"])
    path = out_dir / "scenario.json"
    return dict(json.loads(path.read_text())) if path.exists() else {}
