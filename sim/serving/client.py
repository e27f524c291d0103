"""The replay client: a scenario's requests sent to a live server at their
arrival times (open loop: a slow server does not slow the sender), and the
server's ``/metrics`` scraped at a fixed interval.

No twin in vLLM; the nearest is ``vllm bench serve`` (which pins lengths the
same way: ``max_tokens`` = ``min_tokens`` = output length, ``ignore_eos``).
Every request goes out once: a failure is recorded and never retried (a
retry changes the workload). Every wait has a deadline. Times are scenario
seconds: wall seconds since the start times ``speed`` (1 against a real
server; ``kvsim serve --speed X`` needs the same X here).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from sim.serving import ARRIVAL_HEADER
from sim.serving.server_metrics import SCRAPED, parse_metrics
from sim.workloads import WorkloadRequest

Warn = Callable[[str], None]


class ServerUnreachable(Exception):
    """The server did not answer before the replay started (nothing was sent)."""


@dataclass(frozen=True, kw_only=True)
class ClientConfig:
    base_url: str
    speed: float = 1.0
    sample_interval_s: float | None = 1.0  # scenario seconds
    vocab_size: int | None = None
    model: str | None = None
    request_timeout_s: float = 3600.0  # wall seconds, per request
    connect_timeout_s: float = 10.0
    drain_timeout_s: float = 30.0  # wall seconds for requests in flight after a stop


@dataclass
class RequestRecord:
    """What the client saw of one request (scenario seconds)."""

    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    sent_s: float = math.nan
    server_arrival_s: float = math.nan  # the server's own clock (kvsim serve's ARRIVAL_HEADER)
    first_token_s: float = math.nan
    last_token_s: float = math.nan
    generated_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class ReplayOutcome:
    records: list[RequestRecord]
    samples: list[dict[str, float]]
    duration_s: float
    interrupted: bool = False
    server_lost: bool = False
    warnings: list[str] = field(default_factory=list)

    @property
    def ran_to_end(self) -> bool:
        """Neither stopped (Ctrl-C) nor cut off by the server: the results
        manifest's ``complete``. (``complete`` in code means a step's output
        applied: ``EngineCore.complete``.)"""
        return not (self.interrupted or self.server_lost)


def map_token_ids(token_ids: list[int], vocab_size: int | None) -> list[int]:
    """Token ids below ``vocab_size``: each id maps to the same id every time
    (so prompts that share a prefix still share it), through a 64-bit mix so
    that distinct chunks almost never collide. Ids already below the
    vocabulary size stay as they are only when none is given.

    >>> map_token_ids([5, 70000, 5], 1000)[0] == map_token_ids([5], 1000)[0]
    True
    >>> all(0 <= t < 1000 for t in map_token_ids(list(range(50000)), 1000))
    True
    """
    if vocab_size is None:
        return token_ids
    return [_mix64(t) % vocab_size for t in token_ids]


def _mix64(value: int) -> int:
    """SplitMix64's finaliser: a fixed bijection of 64-bit integers."""
    value = (value + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return value ^ (value >> 31)


# A body goes out in pieces of this size, the event loop turning between
# them: a long prompt's body does not hold up the short ones sent just after
# it (as a real client's large upload does not), so a server reads a burst's
# short requests first, as it does from any client.
BODY_CHUNK_BYTES = 64 * 1024
JSON = {"Content-Type": "application/json"}


async def _chunks(body: bytes) -> AsyncIterator[bytes]:
    for start in range(0, len(body), BODY_CHUNK_BYTES):
        yield body[start : start + BODY_CHUNK_BYTES]
        await asyncio.sleep(0)


def _header_seconds(value: str | None) -> float:
    """A header's seconds; NaN when absent (vLLM) or not a finite number."""
    try:
        seconds = float(value) if value is not None else math.nan
    except ValueError:
        return math.nan
    return seconds if math.isfinite(seconds) else math.nan


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Replay:
    def __init__(self, requests: tuple[WorkloadRequest, ...], config: ClientConfig, warn: Warn) -> None:
        self.requests = requests
        self.config = config
        self._warn = warn
        self._warned: set[str] = set()
        self.warnings: list[str] = []
        self.records = [
            RequestRecord(
                request_id=r.request_id,
                arrival_s=r.arrival_s,
                prompt_tokens=r.prompt_len,
                output_tokens=r.output_len,
            )
            for r in requests
        ]
        self.samples: list[dict[str, float]] = []
        self.server_lost = False
        self.model = config.model
        self._start = 0.0

    # ----------------------------------------------------------------- time
    def now_s(self) -> float:
        return (asyncio.get_running_loop().time() - self._start) * self.config.speed

    async def _sleep_until(self, scenario_s: float, stop: asyncio.Event) -> bool:
        """Wait for a scenario time; False if ``stop`` came first."""
        delay = self._start + scenario_s / self.config.speed - asyncio.get_running_loop().time()
        if delay <= 0:
            return not stop.is_set()
        try:
            await asyncio.wait_for(stop.wait(), delay)
            return False
        except TimeoutError:
            return True

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self.warnings.append(message)
            self._warn(message)

    # ------------------------------------------------------------------ run
    async def run(self, stop: asyncio.Event) -> ReplayOutcome:
        timeout = aiohttp.ClientTimeout(total=None, connect=self.config.connect_timeout_s)
        async with aiohttp.ClientSession(self.config.base_url, timeout=timeout) as session:
            await self._discover_model(session)
            self._start = asyncio.get_running_loop().time()
            done = asyncio.Event()
            sampler = asyncio.create_task(self._sample_loop(session, done))
            try:
                interrupted = await self._send_all(session, stop)
            finally:
                done.set()
                await asyncio.wait_for(sampler, self.config.connect_timeout_s + 5)
        return ReplayOutcome(
            records=self.records,
            samples=self.samples,
            duration_s=self.now_s(),
            interrupted=interrupted,
            server_lost=self.server_lost,
            warnings=self.warnings,
        )

    async def _discover_model(self, session: aiohttp.ClientSession) -> None:
        """The served model's name from ``/v1/models``; also proves the
        server answers before any request goes out."""
        try:
            async with session.get(
                "/v1/models", timeout=aiohttp.ClientTimeout(total=self.config.connect_timeout_s)
            ) as r:
                if r.status != 200:
                    raise ServerUnreachable(f"{self.config.base_url}/v1/models answered HTTP {r.status}")
                body = await r.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as error:
            cause = f"{type(error).__name__}: {_one_line(str(error), 120)}"
            raise ServerUnreachable(f"{self.config.base_url}: server not reachable ({cause})") from None
        if self.model is None:
            data = body.get("data") if isinstance(body, dict) else None
            if not data or not isinstance(data[0], dict) or "id" not in data[0]:
                raise ServerUnreachable(f"{self.config.base_url}/v1/models: no model listed")
            self.model = str(data[0]["id"])

    async def _send_all(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> bool:
        """Send each request at its arrival; True if a stop cut the run short."""
        tasks: list[asyncio.Task[None]] = []
        interrupted = False
        for spec, record in zip(self.requests, self.records, strict=True):
            if not await self._sleep_until(spec.arrival_s, stop):
                interrupted = True
                break
            tasks.append(asyncio.create_task(self._send(session, spec, record)))
        if tasks:
            interrupted = await self._wait_in_flight(tasks, stop) or interrupted
        for record in self.records[len(tasks) :]:
            record.error = "not sent: the replay was stopped first"
        return interrupted

    async def _wait_in_flight(self, tasks: list[asyncio.Task[None]], stop: asyncio.Event) -> bool:
        """Each request runs to its own deadline; after a stop, the requests
        still in flight get ``drain_timeout_s`` and are then cancelled.
        True if a stop came."""
        stop_waiter = asyncio.create_task(stop.wait())
        pending: set[asyncio.Future[Any]] = set(tasks)
        try:
            while pending and not stop.is_set():
                _, pending = await asyncio.wait(pending | {stop_waiter}, return_when=asyncio.FIRST_COMPLETED)
                pending.discard(stop_waiter)
            if pending:
                _, pending = await asyncio.wait(pending, timeout=self.config.drain_timeout_s)
                for task in pending:
                    task.cancel()
                if pending:
                    await asyncio.wait(pending, timeout=5.0)
        finally:
            stop_waiter.cancel()
        return stop.is_set()

    def _payload(self, spec: WorkloadRequest) -> dict[str, Any]:
        return {
            "model": self.model,
            "prompt": map_token_ids(spec.prompt_token_ids(), self.config.vocab_size),
            "max_tokens": spec.output_len,
            "min_tokens": spec.output_len,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }

    async def _send(
        self, session: aiohttp.ClientSession, spec: WorkloadRequest, record: RequestRecord
    ) -> None:
        record.sent_s = self.now_s()
        timeout = aiohttp.ClientTimeout(
            total=self.config.request_timeout_s, connect=self.config.connect_timeout_s
        )
        try:
            data = _chunks(json.dumps(self._payload(spec)).encode())
            async with session.post("/v1/completions", data=data, headers=JSON, timeout=timeout) as response:
                if response.status != 200:
                    body = await response.text()
                    record.error = f"HTTP {response.status}: {_one_line(body)}"
                    return
                record.server_arrival_s = _header_seconds(response.headers.get(ARRIVAL_HEADER))
                await self._read_stream(response, record)
        except asyncio.CancelledError:
            record.error = "cancelled: the replay was stopped before the request finished"
            raise
        except TimeoutError:
            record.error = f"timed out after {self.config.request_timeout_s:g} s"
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as error:
            self.server_lost = True
            record.error = f"connection lost: {type(error).__name__}: {_one_line(str(error), 120)}"
        except (aiohttp.ClientError, UnicodeDecodeError) as error:
            record.error = f"{type(error).__name__}: {_one_line(str(error), 120)}"

    async def _read_stream(self, response: aiohttp.ClientResponse, record: RequestRecord) -> None:
        usage_tokens: int | None = None
        done = False
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            try:
                chunk = json.loads(data)
            except json.JSONDecodeError:
                record.error = f"malformed stream chunk: {_one_line(data.decode(errors='replace'), 80)}"
                return
            if isinstance(chunk, dict) and chunk.get("error"):
                record.error = f"server error in stream: {_one_line(json.dumps(chunk['error']))}"
                return
            self._take_chunk(chunk, record)
            usage = chunk.get("usage") if isinstance(chunk, dict) else None
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                usage_tokens = usage["completion_tokens"]
        if usage_tokens is not None:
            record.generated_tokens = usage_tokens  # the server's own count wins
        if not done or record.finish_reason is None:
            record.error = "stream ended before the last token"

    def _take_chunk(self, chunk: Any, record: RequestRecord) -> None:
        choices = chunk.get("choices") if isinstance(chunk, dict) else None
        for choice in choices if isinstance(choices, list) else []:
            if not isinstance(choice, dict):
                continue
            ids = choice.get("token_ids")
            count = len(ids) if isinstance(ids, list) else (1 if choice.get("text") else 0)
            if count:
                now = self.now_s()
                if math.isnan(record.first_token_s):
                    record.first_token_s = now
                record.last_token_s = now
                record.generated_tokens += count
            if choice.get("finish_reason"):
                record.finish_reason = str(choice["finish_reason"])

    # -------------------------------------------------------------- metrics
    async def _sample_loop(self, session: aiohttp.ClientSession, done: asyncio.Event) -> None:
        interval_s = self.config.sample_interval_s
        if not interval_s:
            return
        tick = 0
        while True:
            self.samples.append({"time_s": self.now_s(), **await self._scrape(session)})
            tick += 1
            if done.is_set():
                return
            delay = self._start + tick * interval_s / self.config.speed - asyncio.get_running_loop().time()
            try:
                await asyncio.wait_for(done.wait(), max(delay, 0.0))
            except TimeoutError:
                pass

    async def _scrape(self, session: aiohttp.ClientSession) -> dict[str, float]:
        timeout = aiohttp.ClientTimeout(total=self.config.connect_timeout_s)
        try:
            async with session.get("/metrics", timeout=timeout) as response:
                if response.status != 200:
                    raise aiohttp.ClientResponseError(
                        response.request_info, (), status=response.status, message=f"HTTP {response.status}"
                    )
                text = await response.text()
        except (aiohttp.ClientError, TimeoutError) as error:
            self.warn_once("scrape", f"/metrics: cannot read ({type(error).__name__}): NaN samples")
            return dict.fromkeys(SCRAPED.values(), math.nan)
        values = parse_metrics(text, lambda message: self.warn_once("parse", message))
        for metric, column in SCRAPED.items():
            if math.isnan(values[column]):
                self.warn_once(metric, f"/metrics: no {metric}: its column {column} is NaN")
        return values
