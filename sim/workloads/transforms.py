"""Pure transformations of a workload: each returns a new ``Workload`` and
appends what it did to ``source``.

No twin in vLLM. Request ids survive every transformation, so a request can
always be traced back to its line in the trace file.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from sim.workloads.spec import Workload, WorkloadRequest, ceil_div, sort_requests


def _derive(w: Workload, requests: list[WorkloadRequest], note: str) -> Workload:
    return Workload(name=w.name, source=f"{w.source}; {note}", requests=sort_requests(requests))


def _check_factor(name: str, factor: float) -> None:
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"{name}: expected a finite factor > 0, got {factor}")


def _scale(w: Workload, factor: float, note: str) -> Workload:
    scaled = [replace(r, arrival_s=r.arrival_s * factor) for r in w.requests]
    return _derive(w, scaled, note)


def scale_time(w: Workload, factor: float) -> Workload:
    """Multiply every arrival time by ``factor``: 2 halves the request rate."""
    _check_factor("factor", factor)
    return _scale(w, factor, f"time x{factor:g}")


def scale_rate(w: Workload, factor: float) -> Workload:
    """Multiply the request rate by ``factor``; the same as
    ``scale_time(w, 1 / factor)``, which it is."""
    _check_factor("factor", factor)
    return _scale(w, 1.0 / factor, f"rate x{factor:g}")


def window(w: Workload, start_s: float, end_s: float) -> Workload:
    """Keep arrivals in ``[start_s, end_s)``, re-based so ``start_s`` becomes 0.

    The first kept request may arrive after 0: the window start, not the first
    arrival, is the new origin, so idle time at the start of the window stays.
    ``end_s`` may be ``math.inf``.
    """
    if not (math.isfinite(start_s) and 0 <= start_s < end_s):
        raise ValueError(f"window: expected 0 <= start_s < end_s, got [{start_s}, {end_s})")
    kept = [replace(r, arrival_s=r.arrival_s - start_s) for r in w.requests if start_s <= r.arrival_s < end_s]
    return _derive(w, kept, f"window [{start_s:g}, {end_s:g}) s re-based to 0")


def sample(w: Workload, fraction: float, rng: np.random.Generator) -> Workload:
    """Keep each request independently with probability ``fraction``
    (one uniform draw per request, in workload order)."""
    if not (0 < fraction <= 1):
        raise ValueError(f"fraction: expected 0 < fraction <= 1, got {fraction}")
    keep = rng.random(w.num_requests) < fraction
    kept = [r for r, k in zip(w.requests, keep, strict=True) if k]
    return _derive(w, kept, f"sample {fraction:g}")


def limit(w: Workload, max_requests: int) -> Workload:
    """The first ``max_requests`` requests in arrival order."""
    if max_requests < 1:
        raise ValueError(f"max_requests: expected >= 1, got {max_requests}")
    return _derive(w, list(w.requests[:max_requests]), f"first {max_requests}")


def spread_bursts(w: Workload, quantum_s: float, rng: np.random.Generator) -> Workload:
    """Move every arrival ``t`` to ``t + U[0, quantum_s)``.

    Mooncake stamps arrivals on a ~3 s grid, so a replay sends a burst every
    3 s. Each stamp is read as "arrived during the quantum that starts here";
    singletons are moved too, since their stamp is just as quantised. Arrivals
    may end up to one quantum past a window's end.
    """
    _check_factor("quantum_s", quantum_s)
    offsets_s = rng.uniform(0.0, quantum_s, size=w.num_requests)
    moved = [
        replace(r, arrival_s=r.arrival_s + float(offset))
        for r, offset in zip(w.requests, offsets_s, strict=True)
    ]
    return _derive(w, moved, f"arrivals spread over {quantum_s:g} s quanta")


def _clamp(request: WorkloadRequest, max_prompt_len: int, max_output_len: int) -> WorkloadRequest:
    if request.prompt_len <= max_prompt_len and request.output_len <= max_output_len:
        return request
    prompt_len = min(request.prompt_len, max_prompt_len)
    return replace(
        request,
        prompt_len=prompt_len,
        output_len=min(request.output_len, max_output_len),
        prefix_ids=request.prefix_ids[: ceil_div(prompt_len, request.prefix_unit)],
    )


def clamp_lengths(
    w: Workload, max_prompt_len: int | None = None, max_output_len: int | None = None
) -> Workload:
    """Cut prompts (keeping their leading tokens, so prefix sharing survives)
    and outputs to fit a model's limits; Mooncake prompts reach 126 K tokens."""
    for field, value in (
        ("max_prompt_len", max_prompt_len),
        ("max_output_len", max_output_len),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{field}: expected >= 1, got {value}")
    prompt_cap = max_prompt_len or w.max_prompt_len
    output_cap = max_output_len or w.max_output_len
    clamped = [_clamp(r, prompt_cap, output_cap) for r in w.requests]
    changed = sum(a is not b for a, b in zip(w.requests, clamped, strict=True))
    caps = [
        f"{what} <= {cap}"
        for what, cap in (("prompt", max_prompt_len), ("output", max_output_len))
        if cap is not None
    ]
    return _derive(w, clamped, f"clamped {', '.join(caps)} ({changed} requests cut)")
