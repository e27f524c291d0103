"""The fork's scheduler-side code, built from the user's copy at run time
(``kvsim conform --fork PATH``): a virtual environment with vLLM 0.30.0 from
the package index and the fork's sections of its combined diff applied.

PATH is a fork checkout (its newest ``release/v*/v*-combined.diff`` is
used) or a combined diff itself. Only the scheduler-side sections are
applied: ``vllm/v1/core/**``, ``vllm/v1/engine/core.py``,
``vllm/v1/kv_cache_interface.py`` and ``vllm/envs.py`` (the patched files
read the fork's switches through it). Each file's git blob id is checked
against the section's ``index`` line before (vLLM 0.30.0's file) and after
(the fork's). The environment is built in a temporary folder beside its
cache entry and renamed into place only once every check passed, so a
failed or interrupted build is never taken as good. Torch and vLLM's other
imports come from kvsim's own environment (a ``.pth`` line after the new
environment's own packages).

The project holds no fork code: the diff is read from PATH each time.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sim.config import ConfigError

BASE_VLLM = "0.30.0"
SCHEDULER_SIDE = ("vllm/v1/core/", "vllm/v1/engine/core.py", "vllm/v1/kv_cache_interface.py", "vllm/envs.py")
# A fresh venv and one wheel install; pip's own retries are kept short so a
# missing index fails in seconds, not minutes.
PIP_TIMEOUT_S = 900
MARKER = "kvsim-fork.json"
_SECTION = re.compile(r"^diff --git a/(\S+) b/(\S+)\n", re.MULTILINE)
_INDEX = re.compile(r"^index ([0-9a-f]+)\.\.([0-9a-f]+)", re.MULTILINE)
_NULL_BLOB = re.compile(r"^0+$")


class ForkBuildError(ConfigError):
    """The fork's scheduler-side environment cannot be built (one line)."""


@dataclass(frozen=True, kw_only=True)
class Section:
    """One file's section of the combined diff."""

    path: str
    old_blob: str
    new_blob: str
    text: str

    @property
    def is_new_file(self) -> bool:
        return bool(_NULL_BLOB.match(self.old_blob))


def combined_diff(path: Path) -> Path:
    """The combined diff PATH names: the file itself, or a checkout's newest."""
    if path.is_file():
        return path
    if path.is_dir():
        found = sorted(path.glob("release/v*/v*-combined.diff"), key=_version_key)
        if found:
            return found[-1]
    raise ForkBuildError(
        f"--fork {path}: neither a fork checkout (release/v*/v*-combined.diff) nor a combined diff"
    )


def _version_key(diff: Path) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", diff.name.split("-combined")[0]))


def scheduler_sections(diff: Path) -> list[Section]:
    """The scheduler-side sections of a combined diff, in file order."""
    try:
        text = diff.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ForkBuildError(f"--fork {diff}: cannot read it ({type(error).__name__})") from None
    starts = [m.start() for m in _SECTION.finditer(text)] + [len(text)]
    sections = [_section(text[a:b]) for a, b in zip(starts, starts[1:], strict=False)]
    wanted = [s for s in sections if s is not None and s.path.startswith(SCHEDULER_SIDE)]
    if not wanted:
        raise ForkBuildError(f"--fork {diff}: no section of the fork's scheduler files (vllm/v1/core/...)")
    return wanted


def _section(text: str) -> Section | None:
    header = _SECTION.match(text)
    index = _INDEX.search(text, 0, text.find("\n@@") if "\n@@" in text else len(text))
    if header is None or index is None:
        return None
    return Section(path=header.group(2), old_blob=index.group(1), new_blob=index.group(2), text=text)


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _blob_matches(file: Path, blob: str) -> bool:
    if _NULL_BLOB.match(blob):
        return not file.exists()
    return file.is_file() and git_blob_id(file.read_bytes()).startswith(blob)


def cache_root() -> Path:
    """Outside the repository: ``$KVSIM_FORK_CACHE`` or ``~/.cache/kvsim/fork``."""
    configured = os.environ.get("KVSIM_FORK_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "kvsim" / "fork"


def sections_key(sections: list[Section]) -> str:
    digest = hashlib.sha256(BASE_VLLM.encode())
    for section in sections:
        digest.update(section.text.encode())
    return digest.hexdigest()[:16]


Installer = Callable[[Path], None]


def fork_python(path: Path, *, root: Path | None = None, install: Installer | None = None) -> Path:
    """The fork environment's interpreter for PATH, built once and cached."""
    sections = scheduler_sections(combined_diff(path))
    root = root or cache_root()
    target = root / sections_key(sections)
    if (target / MARKER).is_file():
        return target / "venv" / "bin" / "python"
    root.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f"{target.name}.building-", dir=root))
    try:
        build_fork_venv(sections, building, install or install_base_vllm)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(building, target)  # the marker is in place: good only now
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return target / "venv" / "bin" / "python"


def build_fork_venv(sections: list[Section], folder: Path, install: Installer) -> None:
    venv = folder / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], "creating the fork's environment")
    site = Path(_site_packages(venv))
    install(venv)
    for section in sections:
        if not _blob_matches(site / section.path, section.old_blob):
            raise ForkBuildError(
                f"{section.path}: the diff's blob {section.old_blob} is not vLLM {BASE_VLLM}'s file "
                "(a diff against another base)"
            )
    patch = folder / "scheduler-side.diff"
    patch.write_text("".join(section.text for section in sections), encoding="utf-8")
    _run(["git", "apply", "--whitespace=nowarn", str(patch)], "applying the fork's sections", cwd=site)
    for section in sections:
        if not _blob_matches(site / section.path, section.new_blob):
            raise ForkBuildError(f"{section.path}: after applying, not the diff's blob {section.new_blob}")
    # Torch and vLLM's other imports from kvsim's environment, after the fork's.
    (site / "zz_kvsim_site.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    record = {"vllm": BASE_VLLM, "files": {s.path: [s.old_blob, s.new_blob] for s in sections}}
    (folder / MARKER).write_text(json.dumps(record, indent=1))


def install_base_vllm(venv: Path) -> None:
    """vLLM 0.30.0 from the package index, without its dependencies."""
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    _run(
        [*pip, "--no-deps", "--retries", "0", "--timeout", "10", f"vllm=={BASE_VLLM}"],
        f"installing vLLM {BASE_VLLM} from the package index (is an index reachable?)",
    )


def _site_packages(venv: Path) -> str:
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout.strip()


def _run(command: list[str], what: str, cwd: Path | None = None) -> None:
    try:
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ForkBuildError(f"{what} failed ({type(error).__name__})") from None
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        raise ForkBuildError(f"{what} failed: {lines[-1][:200] if lines else f'exit {done.returncode}'}")
