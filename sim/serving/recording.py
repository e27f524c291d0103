"""A replay's frames, with the columns of ``kvsim run``'s where measurable
(``sim.analysis.frames``), ``source`` = replay, and no ``steps`` frame (a
live server does not expose its steps).

requests: ``admitted`` means the request got its first token (a live server
does not say when it admitted one, so ``admitted_s`` and ``queue_s`` are
NaN); ``rejected`` means the request was sent and failed (HTTP error, lost
connection, timeout): the server never finished it. ``num_preemptions`` and
``prefix_hit_tokens`` per request are unknown (NaN); their totals are in the
samples' counters. Replay-only columns: ``sent_s``, ``server_arrival_s``
(when the server took the request in, on its own clock: ``kvsim serve``
reports it, vLLM does not), ``finish_reason``, ``error``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from sim.analysis.frames import add_latencies, label_replay_frame, summarise_replay
from sim.serving.client import ReplayOutcome
from sim.serving.server_metrics import SCRAPED

REQUEST_COLUMNS = (
    "request_id",
    "arrival_s",
    "prompt_tokens",
    "output_tokens",
    "rejected",
    "admitted_s",
    "first_token_s",
    "finished_s",
    "num_preemptions",
    "prefix_hit_tokens",
    "generated_tokens",
    "turn",
)


def requests_frame(outcome: ReplayOutcome, scenario: str, layout: str) -> pd.DataFrame:
    rows = []
    for record in outcome.records:
        ok = record.error is None and record.finish_reason is not None
        rows.append(
            {
                "request_id": record.request_id,
                "arrival_s": record.arrival_s,
                "prompt_tokens": record.prompt_tokens,
                "output_tokens": record.output_tokens,
                "rejected": record.error is not None and not math.isnan(record.sent_s),
                "admitted_s": np.nan,
                "first_token_s": record.first_token_s,
                "finished_s": record.last_token_s if ok else np.nan,
                "num_preemptions": np.nan,
                "prefix_hit_tokens": np.nan,
                "generated_tokens": record.generated_tokens,
                "turn": 0,  # a replay sends a timed trace: open loop
                "sent_s": record.sent_s,
                "server_arrival_s": record.server_arrival_s,
                "finish_reason": record.finish_reason,
                "error": record.error,
            }
        )
    extra_columns = ("sent_s", "server_arrival_s", "finish_reason", "error")
    frame = pd.DataFrame.from_records(rows, columns=[*REQUEST_COLUMNS, *extra_columns])
    frame = frame.astype({"finish_reason": "object", "error": "object", "rejected": bool})
    extras = [frame.pop(column) for column in extra_columns]
    frame["admitted"] = frame["first_token_s"].notna()
    add_latencies(frame)
    for column in extras:
        frame[column.name] = column
    return label_replay_frame(frame, scenario, layout)


def samples_frame(outcome: ReplayOutcome, scenario: str, layout: str) -> pd.DataFrame:
    frame = pd.DataFrame.from_records(outcome.samples, columns=["time_s", *SCRAPED.values()])
    return label_replay_frame(frame.astype(float), scenario, layout)


def replay_frames(
    outcome: ReplayOutcome,
    *,
    scenario: str,
    layout: str,
    plan: dict[str, Any] | None,
    extra_summary: dict[str, Any],
) -> dict[str, pd.DataFrame]:
    """``requests``, ``samples`` and a one-row ``summary`` (``extra_summary``
    keys go before ``source``)."""
    requests = requests_frame(outcome, scenario, layout)
    samples = samples_frame(outcome, scenario, layout)
    summary = summarise_replay(
        requests,
        samples,
        scenario=scenario,
        layout=layout,
        kv_cache_tokens=float(plan["kv_cache_tokens"]) if plan else math.nan,
        num_gpu_blocks=float(plan["num_blocks"]) if plan else math.nan,
        duration_s=outcome.duration_s,
    )
    source = summary.pop("source")
    summary.update(extra_summary)
    summary["source"] = source
    return {"requests": requests, "samples": samples, "summary": pd.DataFrame([summary])}
