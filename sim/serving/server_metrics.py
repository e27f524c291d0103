"""``/metrics`` both ways: what ``kvsim serve`` exposes (vLLM's names and
types, ``vllm/v1/metrics/loggers.py`` 0.33.0: gauges for the scheduler state
and KV usage, counters for preemptions, prefix-cache queries and hits,
spec-decode drafts and accepted tokens, prompt and generation tokens,
finished requests by reason (``length``, and ``abort`` for a client gone), with
``model_name`` and ``engine`` labels), and what a replay scrapes from any
server (prometheus-client's text parser).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sim.metrics import SAMPLES
from sim.sched.output import SchedulerOutput, StepOutcome

# Scraped metric (name on the wire without ``_total``) -> samples column:
# every samples column the registry gives a vLLM name (the scheduler's
# gauges and the running totals the samples carry), so a replay's samples
# and a simulation's share columns by construction.
SCRAPED: dict[str, str] = {m.vllm_name: m.name for m in SAMPLES if m.vllm_name is not None}
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    """The registry ``kvsim serve`` exposes; one engine (label ``engine="0"``)."""

    def __init__(self, model_name: str, plan: Any) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        values = (model_name, "0")

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, labels, registry=self.registry).labels(*values)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, labels, registry=self.registry).labels(*values)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        # kvsim's own: how far (simulated seconds) the engine fell behind the
        # scaled wall clock at worst; non-zero means --speed is too high.
        self.max_lag = Gauge(
            "kvsim:engine_max_lag_seconds", "Worst lag behind the scaled clock.", registry=self.registry
        )
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        # vLLM's finished-request counter, one series per finish reason,
        # each created at 0 as vLLM creates one for every ``FinishReason``
        # (kvsim's requests only stop by length or are aborted).
        self.request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        for reason in ("stop", "length", "abort", "error", "repetition"):
            self.request_success.labels(*values, reason)
        self._label_values = values
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ["block_size", "num_gpu_blocks", "kv_cache_size_tokens"],
            registry=self.registry,
        )
        info.labels(str(plan.block_size), str(plan.num_blocks), str(plan.kv_cache_tokens)).set(1)

    def set_gauges(self, *, running: int, waiting: int, kv_cache_usage: float, max_lag_s: float) -> None:
        self.max_lag.set(max_lag_s)
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_cache_usage)

    def record_step(self, output: SchedulerOutput, outcome: StepOutcome, prompt_tokens: int) -> None:
        self.preemptions.inc(len(output.preempted_request_ids))
        self.prefix_queries.inc(output.prefix_cache_queries)
        self.prefix_hits.inc(output.prefix_cache_hits)
        if outcome.num_draft_tokens:
            self.drafts.inc(sum(1 for r in output.scheduled if r.num_spec_tokens))
        self.draft_tokens.inc(outcome.num_draft_tokens)
        self.accepted_tokens.inc(outcome.num_accepted_tokens)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(outcome.num_generated_tokens)

    def request_finished(self, reason: str) -> None:
        self.request_success.labels(*self._label_values, reason).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def parse_metrics(text: str, warn: Callable[[str], None]) -> dict[str, float]:
    """The scraped columns from a ``/metrics`` page: each metric summed over
    its label sets (several engines add up), NaN for one the page lacks. A
    page the parser rejects gives all NaN and a warning (once per cause is
    the caller's business)."""
    values = dict.fromkeys(SCRAPED.values(), math.nan)
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as error:  # the parser raises ValueError and others on bad lines
        warn(f"/metrics: unparsable page ({type(error).__name__}: {_one_line(error)})")
        return values
    for family in families:
        # Without a TYPE line a counter's family keeps its ``_total``.
        column = SCRAPED.get(family.name) or SCRAPED.get(family.name.removesuffix("_total"))
        if column is None:
            continue
        samples = [s for s in family.samples if s.name in (family.name, family.name + "_total")]
        if samples:
            # The parser may hand one metric over as several families (a
            # ``# TYPE name counter`` line followed by ``name_total`` samples
            # gives one family per sample): add them up, never keep the last.
            earlier = 0.0 if math.isnan(values[column]) else values[column]
            values[column] = earlier + float(sum(s.value for s in samples))
    return values


def _one_line(error: Exception) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= 120 else text[:117] + "..."
