"""The metric registry: every column of kvsim's frames, once.

One entry per column of each frame (``steps``, ``samples``, ``requests``,
``summary``), in column order, with its unit, its kind, and where vLLM has
the same quantity its Prometheus name. Everything that lists metrics reads
it: the engine's step record and the samples (``STEP_RECORD``,
``SAMPLE_RECORD``), the running totals (``CUMULATIVE``), ``summarise`` (the
summary's columns and order), the gates (``DIRECTIONS``: which way is
better) and the layout comparison (``GAIN_METRICS``). Adding a metric is
one line here plus the code that computes it; a test checks that every
frame column is registered and every registered column is produced.

The model is Vidur's ``metrics/constants.py`` (one enumeration of names),
with vLLM's names and kinds (``vllm/v1/metrics/loggers.py``) attached so a
frame scraped from a live server's ``/metrics`` can be laid beside a
simulated one (``by_vllm_name``). No twin in vLLM.

Kinds:

* ``id``: says which row this is (scenario, layout, step, time, request);
* ``gauge``: a level at an instant (vLLM's gauges);
* ``counter``: what one step added to a monotone count (vLLM's counters
  count the same events; the steps frame adds its running total under
  ``total``);
* ``total``: the running total of a counter;
* ``value``: any other per-row quantity (a latency, a per-run figure).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

Frame = Literal["steps", "samples", "requests", "summary"]
Kind = Literal["id", "gauge", "counter", "total", "value"]
Direction = Literal["higher", "lower", "either"]
VllmKind = Literal["gauge", "counter", "histogram"]


@dataclass(frozen=True, kw_only=True)
class Metric:
    name: str
    unit: str
    kind: Kind
    description: str
    # Running-total column of a per-step counter (steps frame only).
    total: str | None = None
    # Which way is better (summary metrics only); "either": any change is suspect.
    direction: Direction | None = None
    # In the on-vs-off comparison table (``frames.comparison_table``).
    compared: bool = False
    # vLLM's Prometheus metric for the same quantity, and its type there.
    vllm_name: str | None = None
    vllm_kind: VllmKind | None = None

    @property
    def gated(self) -> bool:
        """A gate may pin it: every summary metric with a direction."""
        return self.direction is not None

    @property
    def prometheus_series(self) -> str | None:
        """The sample name a ``/metrics`` scrape shows: Prometheus adds
        ``_total`` to a counter's name (histograms add ``_bucket`` etc.)."""
        if self.vllm_name is None:
            return None
        return self.vllm_name + "_total" if self.vllm_kind == "counter" else self.vllm_name


def _m(name: str, unit: str, kind: Kind, description: str, **extra: object) -> Metric:
    return Metric(name=name, unit=unit, kind=kind, description=description, **extra)  # type: ignore[arg-type]


# A table each: one metric per entry, kept compact on purpose.
# fmt: off
_SCENARIO = _m("scenario", "name", "id", "the scenario's name")
_LAYOUT = _m("layout", "off|on", "id", "the side-cache layout switch: off (upstream) or on")
_TIME = _m("time_s", "s", "id", "simulated time at the record")
_SOURCE = _m("source", "sim|replay", "id", "where the row comes from: the simulator or a replay on a server")

# The scheduler's gauges (``sim.sched.stats.SchedulerGauges``), one builder
# for the step record and the samples.
_RUNNING = _m(
    "num_requests_running", "requests", "gauge", "requests in the running queue",
    vllm_name="vllm:num_requests_running", vllm_kind="gauge",
)
_WAITING = _m(
    "num_requests_waiting", "requests", "gauge", "requests in the waiting queue (preempted included)",
    vllm_name="vllm:num_requests_waiting", vllm_kind="gauge",
)
_FREE = _m("num_free_blocks", "blocks", "gauge", "pool blocks in the free queue (cached ones included)")
_DEFERRED = _m("num_deferred_blocks", "blocks", "gauge", "blocks popped for a fenced free, not yet back")
_USAGE = _m(
    "kv_cache_usage_perc", "fraction", "gauge", "1 - free / usable pool blocks (a fraction, as vLLM's)",
    vllm_name="vllm:kv_cache_usage_perc", vllm_kind="gauge",
)
_RETAINED = _m("num_retained_checkpoints", "blocks", "gauge", "Mamba checkpoints held outside the tables")

STEPS: tuple[Metric, ...] = (
    _SCENARIO,
    _LAYOUT,
    _m("step", "step", "id", "the scheduler's step index (1 = first; async: one micro-batch)"),
    _TIME,
    _m("step_time_s", "s", "value", "the step's duration (async: a micro-batch, schedule to output)"),
    _RUNNING,
    _WAITING,
    _m("num_scheduled_requests", "requests", "value", "requests scheduled in the step"),
    _m("num_scheduled_tokens", "tokens", "value", "tokens scheduled in the step (drafts included)"),
    _m("num_prefill_tokens", "tokens", "value", "scheduled prompt tokens"),
    _m("num_decode_tokens", "tokens", "value", "scheduled tokens past the prompt"),
    _m("num_admitted", "requests", "counter", "new requests admitted", total="num_admitted_total"),
    _m("num_resumed", "requests", "counter", "preempted requests resumed"),
    _m(
        "num_preemptions", "requests", "counter", "requests preempted (recompute)",
        total="num_preemptions_total", vllm_name="vllm:num_preemptions", vllm_kind="counter",
    ),
    _m(
        "num_finished", "requests", "counter", "requests finished",
        total="num_finished_total", vllm_name="vllm:request_success", vllm_kind="counter",
    ),
    _m(
        "num_generation_tokens", "tokens", "counter", "output tokens appended",
        total="num_generation_total_tokens", vllm_name="vllm:generation_tokens", vllm_kind="counter",
    ),
    _m(
        "num_draft_tokens", "tokens", "counter", "MTP draft tokens verified",
        vllm_name="vllm:spec_decode_num_draft_tokens", vllm_kind="counter",
    ),
    _m(
        "num_accepted_tokens", "tokens", "counter", "MTP draft tokens accepted",
        vllm_name="vllm:spec_decode_num_accepted_tokens", vllm_kind="counter",
    ),
    _FREE,
    _DEFERRED,
    _USAGE,
    _m(
        "prefix_cache_queries_tokens", "tokens", "counter", "prompt tokens looked up in the prefix cache",
        total="prefix_cache_queries_total_tokens", vllm_name="vllm:prefix_cache_queries", vllm_kind="counter",
    ),
    _m(
        "prefix_cache_hits_tokens", "tokens", "counter", "prompt tokens found in the prefix cache",
        total="prefix_cache_hits_total_tokens", vllm_name="vllm:prefix_cache_hits", vllm_kind="counter",
    ),
    _m(
        "prefix_cache_evicted_blocks", "blocks", "counter", "cached blocks evicted (BlockRemoved)",
        total="prefix_cache_evicted_total_blocks",
    ),
    _RETAINED,
)

# Running totals the samples carry, named as the steps frame's, with the
# vLLM counter a replay scrapes for each (so the two share columns).
_SAMPLED_TOTALS: tuple[Metric, ...] = (
    _m("num_preemptions_total", "requests", "total", "preemptions so far",
       vllm_name="vllm:num_preemptions", vllm_kind="counter"),
    _m("prefix_cache_queries_total_tokens", "tokens", "total", "prefix-cache lookups so far",
       vllm_name="vllm:prefix_cache_queries", vllm_kind="counter"),
    _m("prefix_cache_hits_total_tokens", "tokens", "total", "prefix-cache hits so far",
       vllm_name="vllm:prefix_cache_hits", vllm_kind="counter"),
    _m("num_draft_total_tokens", "tokens", "total", "MTP drafts verified so far",
       vllm_name="vllm:spec_decode_num_draft_tokens", vllm_kind="counter"),
    _m("num_accepted_total_tokens", "tokens", "total", "MTP drafts accepted so far",
       vllm_name="vllm:spec_decode_num_accepted_tokens", vllm_kind="counter"),
    _m("num_prompt_total_tokens", "tokens", "total", "prompt tokens of requests past their first token",
       vllm_name="vllm:prompt_tokens", vllm_kind="counter"),
    _m("num_generation_total_tokens", "tokens", "total", "output tokens so far",
       vllm_name="vllm:generation_tokens", vllm_kind="counter"),
)

SAMPLES: tuple[Metric, ...] = (
    _SCENARIO, _LAYOUT, _TIME, _RUNNING, _WAITING, _FREE, _DEFERRED, _USAGE, *_SAMPLED_TOTALS,
)

REQUESTS: tuple[Metric, ...] = (
    _SCENARIO,
    _LAYOUT,
    _m("request_id", "id", "id", "the workload's request id"),
    _m("arrival_s", "s", "value", "arrival time"),
    _m(
        "prompt_tokens", "tokens", "value", "prompt length",
        vllm_name="vllm:request_prompt_tokens", vllm_kind="histogram",
    ),
    _m("output_tokens", "tokens", "value", "output length the workload asks for"),
    _m("rejected", "bool", "value", "refused at arrival (prompt >= max_model_len)"),
    _m("admitted_s", "s", "value", "first admitted (NaN: never)"),
    _m("first_token_s", "s", "value", "first output token (NaN: none)"),
    _m("finished_s", "s", "value", "finished (NaN: not finished)"),
    _m(
        "num_preemptions", "count", "value", "times preempted",
        vllm_name="vllm:request_num_preemptions", vllm_kind="histogram",
    ),
    _m("prefix_hit_tokens", "tokens", "value", "prefix-cache hit at first admission"),
    _m(
        "generated_tokens", "tokens", "value", "output tokens generated",
        vllm_name="vllm:request_generation_tokens", vllm_kind="histogram",
    ),
    _m("turn", "turns", "value", "turns of its session before it (0: a first turn or open-loop request)"),
    _m("admitted", "bool", "value", "ever admitted"),
    _m("finished", "bool", "value", "finished within the run"),
    _m(
        "ttft_s", "s", "value", "time to first token",
        vllm_name="vllm:time_to_first_token_seconds", vllm_kind="histogram",
    ),
    _m(
        "queue_s", "s", "value", "arrival to first admission",
        vllm_name="vllm:request_queue_time_seconds", vllm_kind="histogram",
    ),
    _m(
        "e2e_s", "s", "value", "arrival to finish",
        vllm_name="vllm:e2e_request_latency_seconds", vllm_kind="histogram",
    ),
)

SUMMARY: tuple[Metric, ...] = (
    _SCENARIO,
    _LAYOUT,
    _m("kv_cache_tokens", "tokens", "value", "tokens the KV pool holds", direction="higher", compared=True),
    _m("num_gpu_blocks", "blocks", "value", "pool blocks", direction="higher"),
    _m("num_requests", "requests", "value", "arrivals", direction="either"),
    _m("num_rejected", "requests", "value", "refused at arrival", direction="lower"),
    _m("num_admitted", "requests", "value", "ever admitted", direction="higher", compared=True),
    _m("num_finished", "requests", "value", "finished", direction="higher", compared=True),
    _m("num_running_at_end", "requests", "value", "running when the run ended", direction="either"),
    _m("num_waiting_at_end", "requests", "value", "waiting when the run ended", direction="lower"),
    _m("peak_concurrency", "requests", "value", "most requests running at once",
       direction="higher", compared=True),
    _m(
        "mean_concurrency", "requests", "value", "time-weighted mean of running requests",
        direction="higher", compared=True,
    ),
    _m("mean_waiting", "requests", "value", "time-weighted mean of waiting requests", direction="lower"),
    _m("num_preemptions", "requests", "value", "preemptions", direction="lower", compared=True),
    _m("prefix_cache_queries_tokens", "tokens", "value", "prefix-cache lookups", direction="either"),
    _m("prefix_cache_hits_tokens", "tokens", "value", "prefix-cache hits", direction="higher"),
    _m("prefix_cache_hit_rate", "fraction", "value", "hits / queries", direction="higher", compared=True),
    _m(
        "prefix_cache_evicted_blocks", "blocks", "value", "cached blocks evicted",
        direction="lower", compared=True,
    ),
    _m("num_steps", "steps", "value", "engine steps", direction="either"),
    _m("stalled", "bool", "value", "requests remained that could never be scheduled"),
    _m("samples_truncated", "bool", "value", "the samples stopped at their row bound before the run ended"),
    _m("duration_s", "s", "value", "simulated time at the end", direction="either"),
    _m(
        "output_throughput_tokens_per_s", "tokens/s", "value", "generated tokens / duration",
        direction="higher", compared=True,
    ),
    _m("ttft_p50_s", "s", "value", "median TTFT of finished requests", direction="lower", compared=True),
    _m("ttft_p90_s", "s", "value", "90th percentile TTFT", direction="lower"),
    _m("ttft_p99_s", "s", "value", "99th percentile TTFT", direction="lower", compared=True),
    _m("e2e_mean_s", "s", "value", "mean end-to-end latency of finished requests", direction="lower"),
    _m("peak_kv_cache_usage_perc", "fraction", "value", "most KV pool used after a step", direction="either"),
    # Agent sessions (closed loop): the figures the fork's agent bench reports.
    _m("num_followups", "requests", "value", "follow-up turns that arrived (turn >= 1)", direction="higher"),
    _m("followup_ttft_p50_s", "s", "value", "median TTFT of finished follow-up turns", direction="lower"),
    _m("followup_ttft_p90_s", "s", "value", "90th percentile TTFT of finished follow-ups", direction="lower"),
    _m(
        "followup_reused_tokens", "tokens", "value", "prefix-cache hits of admitted follow-ups at admission",
        direction="either",
    ),
    _m(
        "followup_prefix_hit_rate", "fraction", "value",
        "reused / prompt tokens, summed over admitted follow-ups (the bench's reuse)", direction="higher",
    ),
)


# fmt: on


def _totals(steps: Iterable[Metric], order: Sequence[str]) -> tuple[Metric, ...]:
    """The running-total columns of the counters that name one, in ``order``."""
    counters = {m.total: m for m in steps if m.total is not None}
    assert set(order) == set(counters), "every counter's total is placed, once"
    return tuple(
        _m(name, counters[name].unit, "total", f"running total of {counters[name].name}") for name in order
    )


# The steps frame: the step record's columns, then the running totals (in
# the order the frame has always had them).
STEP_TOTALS: tuple[Metric, ...] = _totals(
    STEPS,
    (
        "num_admitted_total",
        "num_preemptions_total",
        "num_finished_total",
        "prefix_cache_queries_total_tokens",
        "prefix_cache_hits_total_tokens",
        "prefix_cache_evicted_total_blocks",
        "num_generation_total_tokens",
    ),
)
# Every frame ends with its source (sim or replay).
FRAMES: dict[Frame, tuple[Metric, ...]] = {
    "steps": STEPS + STEP_TOTALS + (_SOURCE,),
    "samples": SAMPLES + (_SOURCE,),
    "requests": REQUESTS + (_SOURCE,),
    "summary": SUMMARY + (_SOURCE,),
}

# What the engine records per step and per sample (no scenario/layout: the
# frame adds them), in column order.
STEP_RECORD: tuple[str, ...] = tuple(m.name for m in STEPS if m.name not in ("scenario", "layout"))
SAMPLE_RECORD: tuple[str, ...] = tuple(m.name for m in SAMPLES if m.name not in ("scenario", "layout"))
# The totals the engine adds to each sample.
SAMPLED_TOTALS: tuple[str, ...] = tuple(m.name for m in _SAMPLED_TOTALS)
# Per-step counter -> its running-total column.
CUMULATIVE: dict[str, str] = {
    counter.name: total.name for total in STEP_TOTALS for counter in STEPS if counter.total == total.name
}
# Summary metric -> which way is better (the metrics a gate may pin).
DIRECTIONS: dict[str, Direction] = {m.name: m.direction for m in SUMMARY if m.direction is not None}
# Summary metrics in the on-vs-off comparison table, in table order.
GAIN_METRICS: tuple[str, ...] = tuple(m.name for m in SUMMARY if m.compared)


def columns(frame: Frame) -> tuple[str, ...]:
    return tuple(m.name for m in FRAMES[frame])


def metric(frame: Frame, name: str) -> Metric:
    """The registered column ``name`` of ``frame``; KeyError names what is known."""
    for m in FRAMES[frame]:
        if m.name == name:
            return m
    raise KeyError(f"{name!r} is not a registered {frame} column (known: {', '.join(columns(frame))})")


def by_vllm_name(name: str) -> list[tuple[Frame, Metric]]:
    """Every frame column that carries vLLM's metric ``name``; a scraped
    series name (``..._total`` of a counter) is accepted too."""
    return [
        (frame, m)
        for frame, metrics in FRAMES.items()
        for m in metrics
        if m.vllm_name is not None and name in (m.vllm_name, m.prometheus_series)
    ]


# Columns only a replay's frames have (what a live server shows and a
# simulation has no counterpart of).
# fmt: off
REPLAY_ONLY: dict[Frame, tuple[Metric, ...]] = {
    "requests": (
        _m("sent_s", "s", "value", "when the replay sent the request"),
        _m("server_arrival_s", "s", "value", "when the server took it in, its own clock (kvsim serve only)"),
        _m("finish_reason", "text", "value", "the server's finish reason (length: the output was pinned)"),
        _m("error", "text", "value", "why the request failed (HTTP status, lost connection, timeout)"),
    ),
    "summary": (
        _m("pool_plan_check", "ok|mismatch|unchecked", "value", "the server's boot log against kvsim's plan"),
        _m("complete", "bool", "value", "every request was sent and ended (not interrupted)"),
    ),
}
# fmt: on


def unregistered(frame: Frame, names: Iterable[str], *, source: str = "sim") -> list[str]:
    """The column names in ``names`` that ``frame``'s registry lacks (a
    replay's frames may also hold ``REPLAY_ONLY``'s columns)."""
    known = set(columns(frame))
    if source == "replay":
        known |= {m.name for m in REPLAY_ONLY.get(frame, ())}
    return [name for name in names if name not in known]
