"""The ``workload:`` section of a scenario file, and building a workload from it.

No twin in vLLM. Strict like ``sim.config``: unknown keys and keys that the
chosen trace format cannot use are errors, never silently ignored.

``build_workload`` applies, in this order: load -> window -> sample ->
limit (``max_requests``) -> time/rate scaling -> spread bursts -> clamps.
Selection comes before scaling so that ``window_s`` is in the trace's own
time (the times the trace README and the paper quote); spreading comes after
scaling so the spread quantum is the scaled 3 s grid; clamps come last
because they change lengths, not which requests run.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import Field, field_validator, model_validator

from sim.config import MAX_REQUEST_TOKENS, MAX_SIMULATED_S, ConfigError, StrictModel
from sim.workloads import distributions as dist
from sim.workloads.interchange import TIMED_TRACE_CHUNK_TOKENS, load_timed_csv, load_timed_trace
from sim.workloads.loaders import (
    detect_format,
    load_azure,
    load_mooncake,
    load_sharegpt_lengths,
)
from sim.workloads.sessions import SessionShape, agent_sessions
from sim.workloads.shipped import SHIPPED_TRACES, TraceFormat
from sim.workloads.spec import MAX_WORKLOAD_REQUESTS, Workload
from sim.workloads.synthetic import SYNTHETIC_PREFIX_UNIT, synthetic
from sim.workloads.transforms import (
    clamp_lengths,
    limit,
    sample,
    scale_rate,
    scale_time,
    spread_bursts,
    window,
)

# Mooncake arrival stamps sit on a grid of ~3 s (2,997-3,003 ms apart).
MOONCAKE_QUANTUM_S = 3.0
_Factor = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class ArrivalConfig(StrictModel):
    """``process: gamma`` needs ``cv`` (1 is Poisson); the others take none."""

    process: Literal["poisson", "gamma", "constant"] = "poisson"
    rate_per_s: _Factor
    cv: _Factor | None = None

    @model_validator(mode="after")
    def _cv_only_for_gamma(self) -> ArrivalConfig:
        if (self.process == "gamma") != (self.cv is not None):
            raise ValueError("cv: required for process gamma, and only for it")
        return self

    def build(self) -> dist.ArrivalProcess:
        if self.process == "gamma":
            assert self.cv is not None
            return dist.Gamma(rate_per_s=self.rate_per_s, cv=self.cv)
        if self.process == "constant":
            return dist.Constant(rate_per_s=self.rate_per_s)
        return dist.Poisson(rate_per_s=self.rate_per_s)


class _Length(StrictModel):
    """Validated by building the distribution, so the rules live in one place."""

    @model_validator(mode="after")
    def _buildable(self) -> _Length:
        self.build()
        return self

    def build(self) -> dist.LengthDistribution:
        raise NotImplementedError


class FixedLength(_Length):
    distribution: Literal["fixed"]
    tokens: int

    def build(self) -> dist.LengthDistribution:
        return dist.Fixed(tokens=self.tokens)


class UniformLength(_Length):
    distribution: Literal["uniform"]
    lo: int
    hi: int

    def build(self) -> dist.LengthDistribution:
        return dist.Uniform(lo=self.lo, hi=self.hi)


class LogNormalLength(_Length):
    distribution: Literal["lognormal"]
    p50: float
    p90: float

    def build(self) -> dist.LengthDistribution:
        return dist.LogNormal(p50=self.p50, p90=self.p90)


class EmpiricalLength(_Length):
    distribution: Literal["empirical"]
    values: tuple[int, ...]

    def build(self) -> dist.LengthDistribution:
        return dist.Empirical(values=self.values)


LengthConfig = Annotated[
    FixedLength | UniformLength | LogNormalLength | EmpiricalLength,
    Field(discriminator="distribution"),
]
_Seconds = Annotated[float, Field(ge=0, le=MAX_SIMULATED_S, allow_inf_nan=False)]


class SessionsConfig(StrictModel):
    """``trace: sessions``: multi-turn agent sessions, closed loop
    (``sim.workloads.sessions``). Token counts are per session: the first
    history after the shared prefix (``workload.shared_prefix_tokens``),
    each turn's reply (its output) and the tool result sent with the next
    turn; ``think_s`` is ``[lo, hi]``, drawn uniformly per turn. No
    follow-up arrives after ``duration_s`` (None: sessions run to their end)."""

    num_sessions: int = Field(gt=0, le=10_000)
    first_history: LengthConfig
    reply: LengthConfig
    tool_result: LengthConfig
    think_s: tuple[_Seconds, _Seconds] = (0.0, 0.0)
    start_spread_s: _Seconds = 0.0
    max_context_tokens: int = Field(gt=0, le=MAX_REQUEST_TOKENS)
    max_turns: int = Field(1000, gt=0, le=100_000)
    duration_s: float | None = Field(None, gt=0, le=MAX_SIMULATED_S, allow_inf_nan=False)

    @field_validator("think_s")
    @classmethod
    def _think_in_order(cls, think_s: tuple[float, float]) -> tuple[float, float]:
        if think_s[0] > think_s[1]:
            raise ValueError(f"expected [lo, hi] with lo <= hi, got {list(think_s)}")
        return think_s

    def shape(self, shared_prefix_tokens: int, prefix_unit: int) -> SessionShape:
        return SessionShape(
            num_sessions=self.num_sessions,
            shared_prefix_tokens=shared_prefix_tokens,
            first_history=self.first_history.build(),
            reply=self.reply.build(),
            tool_result=self.tool_result.build(),
            think_s=self.think_s,
            start_spread_s=self.start_spread_s,
            max_context_tokens=self.max_context_tokens,
            max_turns=self.max_turns,
            prefix_unit=prefix_unit,
        )


class WorkloadConfig(StrictModel):
    """Which trace (or synthetic recipe) and which transformations.

    ``trace``: ``default`` (the shipped Mooncake slice), another shipped name
    (``mooncake-slice``, ``azure-code-slice``, ``sharegpt-lengths``),
    ``synthetic``, ``sessions`` (agent sessions: the ``sessions`` section),
    or a path relative to the scenario file's directory.
    ``format`` is inferred from the name, the extension or the CSV header;
    vLLM's ``timed_trace`` JSON lines need ``format: timed_trace`` (and
    ``hash_chunk_tokens`` when their chunks are not vLLM's default 16).
    """

    trace: str = "default"
    format: TraceFormat | None = None
    arrival: ArrivalConfig | None = None
    prompt: LengthConfig | None = None
    output: LengthConfig | None = None
    sessions: SessionsConfig | None = None
    shared_prefix_tokens: int = Field(0, ge=0, le=MAX_REQUEST_TOKENS)
    # Token ids (content id x unit) stay below 2**31 (vLLM's int32 buffers).
    prefix_unit: int = Field(SYNTHETIC_PREFIX_UNIT, gt=0, le=1024)
    num_requests: int | None = Field(None, gt=0, le=MAX_WORKLOAD_REQUESTS)
    max_requests: int | None = Field(None, gt=0)
    window_s: tuple[float, float] | None = None
    time_scale: _Factor = 1.0
    rate_scale: _Factor = 1.0
    sample_fraction: float = Field(1.0, gt=0, le=1)
    spread_bursts: bool = False
    max_prompt_len: int | None = Field(None, gt=0)
    max_output_len: int | None = Field(None, gt=0)
    # Tokens per hash id of a timed_trace (vLLM's --timed-trace-chunk-hash-size).
    hash_chunk_tokens: int = Field(TIMED_TRACE_CHUNK_TOKENS, gt=0)

    @field_validator("window_s")
    @classmethod
    def _window_in_order(cls, window_s: tuple[float, float] | None) -> tuple[float, float] | None:
        if window_s is not None:
            start_s, end_s = window_s
            if not (math.isfinite(start_s) and 0 <= start_s < end_s):
                raise ValueError("expected [start, end] with 0 <= start < end")
        return window_s

    @model_validator(mode="after")
    def _consistent(self) -> WorkloadConfig:
        known = self.known_format()
        if known is not None:
            check_keys_for_format(self, known)
        return self

    def known_format(self) -> TraceFormat | None:
        """The format if the config alone settles it, else None (read the file)."""
        if self.format in _GENERATED:
            if self.trace not in (self.format, _default("trace")):
                raise ValueError(f"trace: must be {self.format!r} or left out")
            return self.format
        named = _named_format(self.trace)
        if named is not None and self.format not in (None, named):
            raise ValueError(f"format: {self.format} does not match trace {self.trace!r}")
        return self.format or named


# Formats kvsim generates (no file): ``trace`` is the format's name.
_GENERATED: tuple[TraceFormat, ...] = ("synthetic", "sessions")


def _named_format(trace: str) -> TraceFormat | None:
    if trace in _GENERATED:
        return "synthetic" if trace == "synthetic" else "sessions"
    shipped = SHIPPED_TRACES.get(trace)
    return None if shipped is None else shipped[1]


_SYNTHETIC_ONLY = (
    "prompt",
    "output",
    "num_requests",
    "shared_prefix_tokens",
    "prefix_unit",
)
# What a closed-loop sessions workload cannot use: its arrivals and lengths
# are its own, and selecting or retiming turns would break their chains.
_NOT_FOR_SESSIONS = (
    "arrival",
    "prompt",
    "output",
    "num_requests",
    "max_requests",
    "window_s",
    "time_scale",
    "rate_scale",
    "sample_fraction",
    "max_prompt_len",
    "max_output_len",
)


def _default(key: str) -> object:
    return WorkloadConfig.model_fields[key].default


def _is_set(cfg: WorkloadConfig, key: str) -> bool:
    """A key counts as set when its value differs from the default, however
    it was written: a recorded scenario (``scenario.json``) names every key,
    so validity must depend on the values alone for the record to load back
    (docs/results.md, "The recorded scenario")."""
    return bool(getattr(cfg, key) != _default(key))


def check_keys_for_format(cfg: WorkloadConfig, fmt: TraceFormat) -> None:
    """Every key that is set must mean something for ``fmt``; ValueError names it."""
    required = {
        "synthetic": ("arrival", "prompt", "output", "num_requests"),
        "sharegpt": ("arrival",),
        "sessions": ("sessions",),
    }.get(fmt, ())
    for key in required:
        if getattr(cfg, key) is None:
            raise ValueError(f"{key}: required for {fmt} workloads")
    unusable: tuple[str, ...] = ()
    if fmt in ("mooncake", "azure", "timed_trace", "timed_csv"):
        unusable = (*_SYNTHETIC_ONLY, "arrival")
    elif fmt == "sharegpt":
        unusable = _SYNTHETIC_ONLY
    elif fmt == "sessions":
        unusable = _NOT_FOR_SESSIONS
    for key in unusable:
        if _is_set(cfg, key):
            raise ValueError(f"{key}: not used by {fmt} traces (they have their own)")
    if cfg.sessions is not None and fmt != "sessions":
        raise ValueError("sessions: only for trace: sessions")
    if _is_set(cfg, "hash_chunk_tokens") and fmt != "timed_trace":
        raise ValueError("hash_chunk_tokens: only for timed_trace traces")
    if cfg.spread_bursts and fmt != "mooncake":
        raise ValueError("spread_bursts: only for mooncake traces (3 s quantised stamps)")


def resolve_trace(cfg: WorkloadConfig, base_dir: Path) -> tuple[Path | None, TraceFormat]:
    """(trace file, format); the file is None for generated workloads."""
    try:
        known = cfg.known_format()
    except ValueError as error:
        raise ConfigError(f"workload: {error}") from None
    if known in _GENERATED:
        return None, known
    if cfg.trace in SHIPPED_TRACES:
        return SHIPPED_TRACES[cfg.trace][0], known or "mooncake"
    path = Path(cfg.trace).expanduser()
    path = path if path.is_absolute() else base_dir / path
    if not path.is_file():
        raise ConfigError(f"workload.trace: {path}: no such file")
    return path, known or detect_format(path)


def _load(cfg: WorkloadConfig, path: Path | None, fmt: TraceFormat, rng: np.random.Generator) -> Workload:
    if fmt == "mooncake":
        assert path is not None
        return load_mooncake(path)
    if fmt == "azure":
        assert path is not None
        return load_azure(path)
    if fmt == "timed_trace":
        assert path is not None
        return load_timed_trace(path, chunk_tokens=cfg.hash_chunk_tokens)
    if fmt == "timed_csv":
        assert path is not None
        return load_timed_csv(path)
    if fmt == "sessions":
        assert cfg.sessions is not None
        shape = cfg.sessions.shape(cfg.shared_prefix_tokens, cfg.prefix_unit)
        return agent_sessions(shape, rng, until_s=cfg.sessions.duration_s)
    assert cfg.arrival is not None
    if fmt == "sharegpt":
        assert path is not None
        return load_sharegpt_lengths(path, arrival=cfg.arrival.build(), rng=rng)
    assert cfg.prompt is not None and cfg.output is not None
    assert cfg.num_requests is not None
    return synthetic(
        num_requests=cfg.num_requests,
        arrival=cfg.arrival.build(),
        prompt=cfg.prompt.build(),
        output=cfg.output.build(),
        rng=rng,
        shared_prefix_tokens=cfg.shared_prefix_tokens,
        prefix_unit=cfg.prefix_unit,
    )


def _select(cfg: WorkloadConfig, w: Workload, rng: np.random.Generator) -> Workload:
    if cfg.window_s is not None:
        w = window(w, *cfg.window_s)
    if cfg.sample_fraction < 1:
        w = sample(w, cfg.sample_fraction, rng)
    if cfg.max_requests is not None:
        w = limit(w, cfg.max_requests)
    return w


def _retime(cfg: WorkloadConfig, w: Workload, rng: np.random.Generator) -> Workload:
    if cfg.time_scale != 1:
        w = scale_time(w, cfg.time_scale)
    if cfg.rate_scale != 1:
        w = scale_rate(w, cfg.rate_scale)
    if cfg.spread_bursts:
        quantum_s = MOONCAKE_QUANTUM_S * cfg.time_scale / cfg.rate_scale
        w = spread_bursts(w, quantum_s, rng)
    return w


def _build(cfg: WorkloadConfig, path: Path | None, fmt: TraceFormat, seed: int) -> Workload:
    load_rng, sample_rng, spread_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3)
    )
    w = _retime(cfg, _select(cfg, _load(cfg, path, fmt, load_rng), sample_rng), spread_rng)
    if cfg.max_prompt_len is not None or cfg.max_output_len is not None:
        w = clamp_lengths(w, cfg.max_prompt_len, cfg.max_output_len)
    return w


def build_workload(cfg: WorkloadConfig, *, base_dir: Path, seed: int) -> Workload:
    """The workload a scenario asks for; same ``cfg`` and ``seed`` give an
    equal ``Workload``.

    Each random step draws from its own stream spawned from ``seed``
    (generate, sample, spread), so turning one step on or off never changes
    the draws of another. Errors are one-line ``ConfigError``s (``TraceError``
    for a bad trace file).
    """
    path, fmt = resolve_trace(cfg, base_dir)
    try:
        check_keys_for_format(cfg, fmt)
    except ValueError as error:
        raise ConfigError(f"workload.{error}") from None
    try:
        w = _build(cfg, path, fmt, seed)
    except ConfigError:
        raise
    except (ValueError, OverflowError) as error:  # a transformation's own check (a bound, a time)
        raise ConfigError(f"workload: {error}") from None
    if w.num_requests == 0:
        raise ConfigError(
            f"workload: window_s {cfg.window_s} and sample_fraction "
            f"{cfg.sample_fraction:g} leave no requests of {cfg.trace!r}"
        )
    if w.duration_s > MAX_SIMULATED_S:
        raise ConfigError(
            f"workload: the last request arrives at {w.duration_s:.3g} s, more than "
            f"{MAX_SIMULATED_S:.3g} s (a year, past any trace): check time_scale and rate_scale"
        )
    random = fmt in ("sharegpt", *_GENERATED) or cfg.sample_fraction < 1
    return replace(w, source=f"{w.source}; seed {seed}") if random or cfg.spread_bursts else w
