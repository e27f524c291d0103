"""Workloads: what requests arrive when, how long they are, what they share.

No twin in vLLM: this layer feeds the simulator plain ``WorkloadRequest``s. It
imports nothing above plain Python, numpy, pydantic and pyyaml (no vLLM,
simpy, torch, pandas or matplotlib), so the layering test can check it.

Traces: Mooncake JSONL (with 512-token prefix hashes), Azure CSV and ShareGPT
lengths (no prefix information: every chunk gets a fresh content id, so no
two requests share a token); vLLM's ``timed_trace`` JSON lines and a plain
``arrival_s,input_tokens,output_tokens`` CSV, read and written by
``interchange``. Slices ship in ``sim/data`` (see its README). Generated:
synthetic arrivals and closed-loop agent sessions (``sessions``).
"""

from sim.workloads.config import (
    MOONCAKE_QUANTUM_S,
    ArrivalConfig,
    EmpiricalLength,
    FixedLength,
    LengthConfig,
    LogNormalLength,
    SessionsConfig,
    UniformLength,
    WorkloadConfig,
    build_workload,
    resolve_trace,
)
from sim.workloads.distributions import (
    ArrivalProcess,
    Constant,
    Empirical,
    Fixed,
    Gamma,
    LengthDistribution,
    LogNormal,
    Poisson,
    Uniform,
    arrival_times_s,
)
from sim.workloads.interchange import (
    TIMED_TRACE_CHUNK_TOKENS,
    load_timed_csv,
    load_timed_trace,
    timed_trace_lines,
)
from sim.workloads.loaders import (
    MOONCAKE_BLOCK_TOKENS,
    NO_PREFIX_UNIT,
    detect_format,
    load_azure,
    load_mooncake,
    load_sharegpt_lengths,
)
from sim.workloads.sessions import SessionShape, agent_sessions
from sim.workloads.shipped import (
    AZURE_CODE_SLICE,
    AZURE_CONV_SLICE,
    DATA_DIR,
    DEFAULT_TRACE,
    SHAREGPT_LENGTHS,
    SHIPPED_TRACES,
    TraceFormat,
)
from sim.workloads.spec import (
    FRESH_ID_BASE,
    TraceError,
    Workload,
    WorkloadRequest,
    materialise_tokens,
)
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

__all__ = [
    "AZURE_CODE_SLICE",
    "AZURE_CONV_SLICE",
    "DATA_DIR",
    "DEFAULT_TRACE",
    "FRESH_ID_BASE",
    "MOONCAKE_BLOCK_TOKENS",
    "MOONCAKE_QUANTUM_S",
    "NO_PREFIX_UNIT",
    "SHAREGPT_LENGTHS",
    "SHIPPED_TRACES",
    "SYNTHETIC_PREFIX_UNIT",
    "SessionShape",
    "SessionsConfig",
    "TIMED_TRACE_CHUNK_TOKENS",
    "ArrivalConfig",
    "ArrivalProcess",
    "Constant",
    "Empirical",
    "EmpiricalLength",
    "Fixed",
    "FixedLength",
    "Gamma",
    "LengthConfig",
    "LengthDistribution",
    "LogNormal",
    "LogNormalLength",
    "Poisson",
    "WorkloadRequest",
    "TraceError",
    "TraceFormat",
    "Uniform",
    "UniformLength",
    "Workload",
    "WorkloadConfig",
    "agent_sessions",
    "arrival_times_s",
    "build_workload",
    "clamp_lengths",
    "detect_format",
    "limit",
    "load_azure",
    "load_mooncake",
    "load_sharegpt_lengths",
    "load_timed_csv",
    "load_timed_trace",
    "materialise_tokens",
    "resolve_trace",
    "sample",
    "scale_rate",
    "scale_time",
    "spread_bursts",
    "synthetic",
    "timed_trace_lines",
    "window",
]
