"""Synthetic workloads: an arrival process plus length distributions.

No twin in vLLM (its benchmark ``RandomDataset`` is the nearest relative: random
lengths with an optional common prefix, but no arrival trace).
"""

from __future__ import annotations

import numpy as np

from sim.workloads.distributions import (
    ArrivalProcess,
    LengthDistribution,
    arrival_times_s,
)
from sim.workloads.spec import (
    FRESH_ID_BASE,
    FreshIds,
    Workload,
    WorkloadRequest,
    ceil_div,
    request_id,
    sort_requests,
)

# vLLM's default block size: any shared prefix that is a multiple of it can be
# expressed, and 16-token ids keep a long prompt's id tuple modest.
SYNTHETIC_PREFIX_UNIT = 16


def shared_ids(shared_prefix_tokens: int, prefix_unit: int) -> tuple[int, ...]:
    """Content ids 0, 1, ... of the common system prompt (below FRESH_ID_BASE)."""
    if shared_prefix_tokens < 0 or shared_prefix_tokens % prefix_unit:
        raise ValueError(
            f"shared_prefix_tokens: expected a multiple of prefix_unit "
            f"({prefix_unit}) >= 0, got {shared_prefix_tokens}"
        )
    num_ids = shared_prefix_tokens // prefix_unit
    if num_ids >= FRESH_ID_BASE:
        raise ValueError(f"shared_prefix_tokens: too long ({shared_prefix_tokens})")
    return tuple(range(num_ids))


def synthetic(
    *,
    num_requests: int,
    arrival: ArrivalProcess,
    prompt: LengthDistribution,
    output: LengthDistribution,
    rng: np.random.Generator,
    shared_prefix_tokens: int = 0,
    name: str = "synthetic",
    prefix_unit: int = SYNTHETIC_PREFIX_UNIT,
) -> Workload:
    """``num_requests`` requests; each prompt is the shared prefix followed by
    ``prompt``-distributed tokens of its own.

    So ``prompt_len = shared_prefix_tokens + own`` (a system prompt in front
    of every user turn), and two requests share exactly
    ``shared_prefix_tokens`` tokens; with 0 they share none (fresh content
    ids). Draw order, fixed for reproducibility: all arrival gaps, then all
    prompt lengths, then all output lengths.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests: expected >= 1, got {num_requests}")
    if prefix_unit < 1:
        raise ValueError(f"prefix_unit: expected >= 1, got {prefix_unit}")
    shared = shared_ids(shared_prefix_tokens, prefix_unit)
    times_s = arrival_times_s(arrival, num_requests, rng)
    own_lens = prompt.sample(num_requests, rng)
    output_lens = output.sample(num_requests, rng)
    fresh = FreshIds()
    requests = [
        WorkloadRequest(
            request_id=request_id(index),
            arrival_s=float(times_s[index]),
            prompt_len=shared_prefix_tokens + int(own_lens[index]),
            output_len=int(output_lens[index]),
            prefix_ids=shared + fresh.take(ceil_div(int(own_lens[index]), prefix_unit)),
            prefix_unit=prefix_unit,
        )
        for index in range(num_requests)
    ]
    return Workload(
        name=name,
        source=f"synthetic: {num_requests} requests, arrivals {arrival!r}, "
        f"prompt {shared_prefix_tokens} shared + {prompt!r}, output {output!r}",
        requests=sort_requests(requests),
    )
