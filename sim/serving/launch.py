"""Start and stop the server a replay runs against, and check its boot log
against the pool kvsim planned for the same deployment.

``vllm serve`` is built from the scenario (one source of truth for the
simulator and the rig): TP and PP sizes with the layer partition, max_num_seqs,
max_model_len, the KV pool bytes, max_num_batched_tokens, the long-prefill
threshold, prefix caching, MTP with the model's K, the Mamba cache mode, and
the fork's switches in the environment. ``--server-cmd`` replaces the
command (``{port}`` is replaced by the port chosen).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import signal
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import aiohttp

from sim.scenario import Scenario, SideCacheSwitch

# Seconds between a signal and the next, stronger one when stopping a server.
STOP_GRACE_S = 15.0
_KV_TOKENS = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
_SIDE_CACHE = re.compile(r"Side-cache layout: (on|off) \(VLLM_E2_SIDE_CACHE_LAYOUT\)(.*)$", re.MULTILINE)


class LaunchError(Exception):
    """The server could not be started or never became healthy."""


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_env(scenario: Scenario, layout: SideCacheSwitch) -> dict[str, str]:
    """The fork's switches for this layout and the scenario's allocator."""
    return {
        "VLLM_E2_SIDE_CACHE_LAYOUT": "1" if layout == "on" else "0",
        "VLLM_E2_MAMBA_RETAIN_CHECKPOINT": "1" if scenario.fork.patches().mamba_retain_checkpoint else "0",
        "VLLM_PP_LAYER_PARTITION": ",".join(str(n) for n in scenario.deployment.layer_partition),
    }


def vllm_serve_command(scenario: Scenario, model_path: str, port: int) -> list[str]:
    d, s = scenario.deployment, scenario.scheduler
    model = scenario.load_model()
    speculative = {"method": "mtp", "num_speculative_tokens": model.mtp.num_speculative_tokens}
    command = [
        "vllm",
        "serve",
        model_path,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--tensor-parallel-size",
        str(d.tensor_parallel_size),
        "--pipeline-parallel-size",
        str(d.pipeline_parallel_size),
        "--max-num-seqs",
        str(d.max_num_seqs),
        "--max-model-len",
        str(d.max_model_len),
        "--kv-cache-memory-bytes",
        str(d.kv_cache_memory_bytes),
        "--max-num-batched-tokens",
        str(s.max_num_batched_tokens),
        "--long-prefill-token-threshold",
        str(s.long_prefill_token_threshold),
        "--mamba-cache-mode",
        model.mamba_cache_mode,
        "--speculative-config",
        json.dumps(speculative),
    ]
    command.append(
        "--enable-prefix-caching"
        if scenario.allocator.enable_prefix_caching
        else "--no-enable-prefix-caching"
    )
    return command


def custom_command(template: str, port: int) -> list[str]:
    return shlex.split(template.replace("{port}", str(port)))


@dataclass
class BootReport:
    """What the boot log says, next to what kvsim planned."""

    kv_cache_tokens: int | None = None
    side_cache_layout: str | None = None
    notes: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "boot_kv_cache_tokens": self.kv_cache_tokens,
            "boot_side_cache_layout": self.side_cache_layout,
            "boot_notes": self.notes,
            "boot_mismatches": self.mismatches,
        }


def check_boot_log(text: str, plan: dict[str, Any]) -> BootReport:
    """Compare the boot log's KV cache size and side-cache layout with the
    plan (``KVCachePlan.to_dict()``); a missing line is a mismatch too (the
    server is then not known to be the deployment kvsim modelled)."""
    report = BootReport()
    tokens = _KV_TOKENS.search(text)
    if tokens:
        report.kv_cache_tokens = int(tokens.group(1).replace(",", ""))
    side = _SIDE_CACHE.search(text)
    if side:
        report.side_cache_layout = side.group(1)
        report.notes = [n.strip() for n in side.group(2).split(";") if n.strip()]
    expected_layout = "on" if plan["side_cache_layout"] else "off"
    if report.kv_cache_tokens is None:
        report.mismatches.append("boot log has no 'GPU KV cache size: N tokens' line")
    elif report.kv_cache_tokens != plan["kv_cache_tokens"]:
        report.mismatches.append(
            f"GPU KV cache size: server {report.kv_cache_tokens:,} tokens, "
            f"kvsim's plan {plan['kv_cache_tokens']:,}"
        )
    if report.side_cache_layout is None:
        report.mismatches.append("boot log has no 'Side-cache layout: on|off' line")
    elif report.side_cache_layout != expected_layout:
        report.mismatches.append(
            f"side-cache layout: server {report.side_cache_layout}, kvsim {expected_layout}"
        )
    return report


class LaunchedServer:
    """A server process in its own process group, its output in a log file.
    ``stop()`` is idempotent: SIGINT, then SIGTERM, then SIGKILL, each after
    ``grace_s``; it only ever signals the group of the process it started."""

    def __init__(
        self, command: list[str], env: dict[str, str], log_path: Path, grace_s: float = STOP_GRACE_S
    ):
        self.command = command
        self.log_path = log_path
        self.grace_s = grace_s
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log: IO[bytes] = open(log_path, "wb")  # closed in stop()
        try:
            self.process = subprocess.Popen(
                command,
                env={**os.environ, **env},
                stdout=self._log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as error:
            self._log.close()
            raise LaunchError(f"cannot start {command[0]!r}: {error.strerror}") from None

    def exited(self) -> bool:
        return self.process.poll() is not None

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    async def wait_healthy(self, base_url: str, deadline_s: float, stop: asyncio.Event) -> None:
        """Poll ``/health`` until it answers 200, the process exits, a stop
        comes, or ``deadline_s`` (wall seconds) passes."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + deadline_s
        timeout = aiohttp.ClientTimeout(total=2.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while loop.time() < give_up:
                if self.exited():
                    raise LaunchError(
                        f"server exited with status {self.process.returncode} before /health answered "
                        f"(log: {self.log_path})"
                    )
                if stop.is_set():
                    raise KeyboardInterrupt
                try:
                    async with session.get(f"{base_url}/health") as response:
                        if response.status == 200:
                            return
                except (aiohttp.ClientError, TimeoutError):
                    pass
                await asyncio.sleep(0.25)
        raise LaunchError(f"server not healthy after {deadline_s:g} s (log: {self.log_path})")

    def stop(self) -> int | None:
        """Stop the server; its exit status (None if it would not die)."""
        try:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
                if self.exited():
                    break
                try:
                    os.killpg(self.process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.process.wait(self.grace_s)
                except subprocess.TimeoutExpired:
                    continue
            return self.process.poll()
        finally:
            self._log.close()
