"""The arrivals a replay actually made, and what a comparison can match.

A trace's stamps are not what the server saw. The client sends each request
a little late (``sent_s``), and a server reads a burst's bodies in its own
order: a 40K-token body is parsed after a short one sent just after it, so
the short one is scheduled first. Simulated at the trace's stamps, such a
burst runs in another order than it ran on the server, and per-request
times differ by whole prefills in both directions, even at the true
coefficients.

What can be known:

- ``kvsim serve`` reports when its engine took each request in
  (``server_arrival_s``, its own clock; ``sim.serving.ARRIVAL_HEADER``).
  Moved onto the client's clock (the smallest transit is taken as 0), those
  are the arrivals to simulate, in the server's order.
- vLLM reports neither (random response ids, a log stamped in whole
  seconds; only its OpenTelemetry traces hold each request's arrival): the
  client's send times are simulated, in the order sent.
- A simulated stand-in (no ``sent_s``) arrived at its stamps.

Even in the server's order, which step a request of a burst joins depends
on milliseconds of the server's event loop (a request read just after the
engine woke waits for the next step: a whole prefill at a burst's start).
So requests that arrive within the reorder window of one another form a
burst, compared by figures neither a reorder nor that jitter moves: its
last first token and its last finish, from its first arrival (a burst's
prefills, and its whole work, take the same time in any order). A request
alone is its own burst: its TTFT and end-to-end latency, matched by id.

No twin in vLLM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from sim.analysis.runs import scenario_workload
from sim.config import ConfigError
from sim.scenario import Scenario
from sim.workloads import Workload

REQUEST_COLUMNS = ("layout", "request_id", "arrival_s", "first_token_s", "finished_s")

# A server may take two requests in either order, or in one step or two,
# when they reach it closer than this (wall seconds): reading and parsing a
# long prompt's JSON body and the event loop's hop take milliseconds.
REORDER_WALL_S = 0.02
# A replay's clock is good to about the reorder window (a request's transit
# and the client's event loop): a latency shorter than this many windows is
# compared on that scale, not relative to itself (a decode-heavy load's
# first tokens come within a few windows, and would weigh as noise).
FLOOR_WINDOWS = 10


# Where a replay's arrivals come from (``replayed_arrival_s``).
SERVER_ARRIVALS = "the server's own arrivals"
SENT_TIMES = "the client's send times (the server reports no order)"
TRACE_STAMPS = "the trace's stamps (a simulation)"


def replayed_arrival_s(requests: pd.DataFrame) -> tuple[pd.Series, str]:
    """When each request the replay sent reached the server, on the client's
    scenario clock (by request id), and where that comes from: the order is
    known unless it is ``SENT_TIMES``."""
    ids = requests["request_id"].astype(str).to_numpy()
    stamps = pd.Series(requests["arrival_s"].to_numpy(float), index=ids)
    if "sent_s" not in requests:
        return stamps, TRACE_STAMPS
    sent = pd.Series(requests["sent_s"].to_numpy(float), index=ids).dropna()
    if "server_arrival_s" not in requests:
        return sent, SENT_TIMES
    server = pd.Series(requests["server_arrival_s"].to_numpy(float), index=ids).reindex(sent.index)
    reported = server.notna()
    if not reported.all():  # a failed request's arrival is unknown: its order too
        return sent, SENT_TIMES
    # The server's clock started elsewhere: the request that reached it
    # fastest defines the offset (its transit counted 0).
    return server - float((server - sent).min()), SERVER_ARRIVALS


def bursts(arrival_s: pd.Series, window_s: float) -> pd.Series:
    """Per request id, the id of the first request of its burst: a request
    that arrives within ``window_s`` of the one before it joins that one's
    burst.

    >>> bursts(pd.Series([0.0, 0.01, 0.5, 0.52, 2.0], index=list("abcde")), 0.05).tolist()
    ['a', 'a', 'c', 'c', 'e']
    """
    ordered = arrival_s.sort_values(kind="stable")
    starts = np.diff(ordered.to_numpy(float), prepend=-math.inf) > window_s
    first = pd.Series(ordered.index, index=ordered.index).where(starts).ffill()
    return first.reindex(arrival_s.index)


def arrivals_and_bursts(requests: pd.DataFrame, window_s: float) -> tuple[pd.Series, pd.Series, str]:
    """One layout's replayed arrivals (``replayed_arrival_s``), each
    request's burst (by id) and where the arrivals come from. A simulated
    stand-in ran at its own stamps, in the simulation's order: every
    request is its own burst."""
    arrival, source = replayed_arrival_s(requests)
    if source == TRACE_STAMPS:
        return arrival, pd.Series(arrival.index, index=arrival.index), source
    return arrival, bursts(arrival, window_s), source


def replayed_workload(workload: Workload, arrival_s: pd.Series) -> Workload:
    """The requests the replay sent, at the arrivals it made. Open loop, as
    the replay sent them (a follow-up turn went at its stamp)."""
    specs = [
        replace(spec, arrival_s=float(arrival_s[spec.request_id]), follows=None, think_s=0.0)
        for spec in workload.requests
        if spec.request_id in arrival_s.index
    ]
    specs.sort(key=lambda spec: (spec.arrival_s, spec.request_id))
    return replace(
        workload,
        requests=tuple(specs),
        source=f"{workload.source}; at the replay's arrivals",
        follow_ups_until_s=None,
    )


def burst_times(requests: pd.DataFrame, burst_of: pd.Series) -> pd.DataFrame:
    """Per (layout, burst) of finished requests: its last first token and
    its last finish, from its first arrival (``ttft_s``, ``e2e_s``). With
    every request its own burst, each request's TTFT and end-to-end latency.
    ``burst_of`` maps (layout, request id) to the burst."""
    finished = requests[requests["finished_s"].notna()]
    key = pd.MultiIndex.from_arrays([finished["layout"], finished["request_id"].astype(str)])
    frame = pd.DataFrame(
        {
            "layout": finished["layout"].to_numpy(),
            "burst": burst_of.reindex(key).to_numpy(),
            "arrival_s": finished["arrival_s"].to_numpy(float),
            "first_token_s": finished["first_token_s"].to_numpy(float),
            "finished_s": finished["finished_s"].to_numpy(float),
        }
    )
    grouped = frame.groupby(["layout", "burst"], sort=False)
    start = grouped["arrival_s"].min()
    return pd.DataFrame(
        {"ttft_s": grouped["first_token_s"].max() - start, "e2e_s": grouped["finished_s"].max() - start}
    )


@dataclass(frozen=True)
class ReplayTarget:
    """What a calibration compares: per layout the workload at the arrivals
    the replay made, each request's burst, and the measured figures."""

    workloads: dict[str, Workload]
    burst_of: pd.Series  # (layout, request id) -> burst (first request's id)
    measured: pd.DataFrame  # burst_times of the replay
    arrivals: dict[str, str]  # per layout: SERVER_ARRIVALS, SENT_TIMES or TRACE_STAMPS
    floor_s: float  # latencies below it compare on its scale (FLOOR_WINDOWS; 0 for a simulation)

    def describe(self) -> str:
        """One line: which arrivals were simulated and what was compared."""
        parts = []
        for layout, arrivals in self.arrivals.items():
            num_requests = int(len(self.burst_of.loc[layout]))
            num_bursts = int(self.burst_of.loc[layout].nunique())
            compared = (
                f"{num_bursts} bursts of {num_requests} requests, compared by last first token and finish"
                if num_bursts < num_requests
                else f"{num_requests} requests matched one by one"
            )
            parts.append(f"{layout}: {arrivals}; {compared}")
        return "; ".join(parts)


def replay_target(scenario: Scenario, requests: pd.DataFrame, reorder_window_s: float) -> ReplayTarget:
    """The replay's figures, and the workloads that simulate what it did
    (``sim.analysis.replayed_arrivals``)."""
    missing = [column for column in REQUEST_COLUMNS if column not in requests]
    if missing:
        raise ConfigError(f"requests: no column {', '.join(missing)}: cannot time the requests")
    base = scenario_workload(scenario)
    workloads, sources, parts, measured = {}, {}, [], []
    for layout, rows in requests.groupby("layout", sort=False):
        arrival, burst, source = arrivals_and_bursts(rows, reorder_window_s)
        workloads[str(layout)], sources[str(layout)] = replayed_workload(base, arrival), source
        parts.append(pd.Series(burst.to_numpy(), index=pd.MultiIndex.from_product([[layout], burst.index])))
        ids = rows["request_id"].astype(str)
        measured.append(rows[ids.isin(arrival.index)].assign(arrival_s=ids.map(arrival)))
    burst_of = pd.concat(parts) if parts else pd.Series(dtype=object)
    times = burst_times(pd.concat(measured), burst_of) if measured else pd.DataFrame()
    timed = any(source != TRACE_STAMPS for source in sources.values())
    return ReplayTarget(
        workloads, burst_of, times, sources, FLOOR_WINDOWS * reorder_window_s if timed else 0.0
    )
