"""Residency: how many sessions of L tokens a layout holds at once.

The fork publishes its capacity this way (its README, "The KV budget", and
each bench card's section 3): N sessions of L tokens sent together are
resident when all N run at once with no preemption, and the card names the
N that fits and the N + 1 that does not. kvsim asks the same of vLLM's
allocator under its scheduler: N requests of L - 64 prompt tokens and a
64-token reply (L tokens at the end, so a "full" session of 262,144 tokens
fits ``max_model_len``), all sent at t = 0 with a token budget that
prefills them in one step, on the synchronous loop (the loop does not
decide what fits); resident when the run reaches N running and preempts
nothing.

Blocks in use are counted as the fork's scheduler log counts them
(``vllm/v1/core/sched/e2_alloc_log.py``, its v2 patch 0025): the pool's
``num_gpu_blocks`` less its free blocks, so the null block (never free)
counts, and cached blocks no request holds do not; the peak over the run.
``v2_gate_run`` runs three 262K sessions as the fork's v2 gate ran them
(``V2_GATE``). No twin in vLLM.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from sim.scenario import SideCacheSwitch, load_scenario

SESSION_REPLY_TOKENS = 64
# The model served without --speculative-config (the fork: "same command
# minus --speculative-config"): no MTP layer, no drafts.
NO_MTP_MODEL = "models/flash-next-no-mtp.yaml"


@dataclass(frozen=True)
class SessionShape:
    """How each session is sent: its prompt and reply tokens, and whether
    the token budget prefills every session in one step (else the
    scenario's own budget chunks them, one session after another)."""

    prompt_tokens: int
    reply_tokens: int
    one_step_prefill: bool = True

    @classmethod
    def of_length(cls, session_tokens: int) -> SessionShape:
        """L tokens: L - 64 of prompt and a 64-token reply."""
        return cls(session_tokens - SESSION_REPLY_TOKENS, SESSION_REPLY_TOKENS)

    @property
    def session_tokens(self) -> int:
        return self.prompt_tokens + self.reply_tokens


# The fork's v2 gate, "three 262K sessions resident ... peak 302 / 317
# blocks" (benchmarks/2026-09-17/BENCH-CARD.md, and its fingerprint): the
# computed block (3,200: no --block-size), no prefix-match unit and no
# RecoverSSM (both came with v2.5), the old layout (0088 came with v2.5),
# no Mamba checkpoint retention (0086/0087, v2.5) nor v2.5.1's 0093-0097,
# MTP K=3, --max-num-batched-tokens 1024.
V2_GATE = (
    "deployment.block_size=null",
    "deployment.prefix_match_unit=null",
    "deployment.use_replayssm=false",
    "fork.mamba_retain_checkpoint=false",
    "fork.mamba_hold_partial_tail=false",
    "fork.waiter_pins=false",
    "fork.grace_pins=false",
    "scheduler.max_num_batched_tokens=1024",
)
V2_GATE_LAYOUT: SideCacheSwitch = "off"
V2_GATE_SESSIONS = 3
# A 262K session as the gate could send it: the card's 261K prompt
# (259,587 tokens) and a reply up to --max-model-len 262,144 (2,557
# tokens), prefilled at the gate's own budget of 1,024 tokens a step: the
# sessions prefill one after another, and the first two still decode when
# the third's prefill completes (the card's three-way interval).
V2_GATE_SESSION = SessionShape(prompt_tokens=259_587, reply_tokens=2_557, one_step_prefill=False)


@dataclass(frozen=True)
class ResidencyRun:
    """One run of ``num_sessions`` sessions sent together;
    ``blocks_in_use`` is the run's peak as the fork's log counts it."""

    num_sessions: int
    peak_running: int
    num_preemptions: int
    blocks_in_use: int
    num_gpu_blocks: int

    @property
    def resident(self) -> bool:
        return self.peak_running == self.num_sessions and self.num_preemptions == 0


@dataclass(frozen=True)
class Residency:
    """The most sessions resident at once (``fits``), the run that shows
    it and the run of one more that does not fit (None when
    ``max_num_seqs`` caps the count before the pool does)."""

    layout: SideCacheSwitch
    mtp: bool
    session_tokens: int
    fits: ResidencyRun | None
    one_more: ResidencyRun | None

    @property
    def num_resident(self) -> int:
        return self.fits.num_sessions if self.fits else 0


def session_overrides(
    shape: SessionShape, num_sessions: int, layout: SideCacheSwitch, *, mtp: bool
) -> list[str]:
    """``--set`` lines that turn a scenario into the residency run."""
    synthetic = {
        "trace": "synthetic",
        "num_requests": num_sessions,
        "arrival": {"process": "constant", "rate_per_s": 1.0e6},
        "prompt": {"distribution": "fixed", "tokens": shape.prompt_tokens},
        "output": {"distribution": "fixed", "tokens": shape.reply_tokens},
    }
    workload = json.dumps(synthetic)  # JSON is YAML: one --set value
    overrides = [
        f"workload={workload}",
        "engine.mode=sync",
        f"layouts=[{layout}]",
        "simulation.sample_interval_s=null",
    ]
    if shape.one_step_prefill:
        overrides.append(f"scheduler.max_num_batched_tokens={num_sessions * shape.session_tokens}")
    if not mtp:  # the fork's no-MTP pool is at the computed block (its card, section 3)
        overrides += [f"model={NO_MTP_MODEL}", "deployment.block_size=null"]
    return overrides


def residency_run(
    ref: str,
    overrides: list[str],
    shape: SessionShape,
    num_sessions: int,
    layout: SideCacheSwitch,
    *,
    mtp: bool,
) -> ResidencyRun:
    from sim.analysis.runs import run_scenario  # imports vLLM: only where runs run

    scenario = load_scenario(ref, [*overrides, *session_overrides(shape, num_sessions, layout, mtp=mtp)])
    result = run_scenario(scenario)
    steps, summary = result.steps, result.summary.iloc[0]
    num_blocks = int(summary["num_gpu_blocks"])
    return ResidencyRun(
        num_sessions=num_sessions,
        peak_running=int(steps["num_requests_running"].max()),
        num_preemptions=int(summary["num_preemptions"]),
        blocks_in_use=num_blocks - int(steps["num_free_blocks"].min()),  # the null block included
        num_gpu_blocks=num_blocks,
    )


def v2_gate_run(ref: str, overrides: list[str]) -> ResidencyRun:
    """The fork's v2 gate's capacity row on ``ref``'s model: three 262K
    sessions as ``V2_GATE_SESSION`` sends them, on ``V2_GATE`` and then
    ``overrides``."""
    return residency_run(
        ref, [*V2_GATE, *overrides], V2_GATE_SESSION, V2_GATE_SESSIONS, V2_GATE_LAYOUT, mtp=True
    )


def sessions_resident(
    ref: str, overrides: list[str], session_tokens: int, layout: SideCacheSwitch, *, mtp: bool
) -> Residency:
    """From the most that run together when ``max_num_seqs`` are sent,
    down to the first count resident; with the run of one more."""

    def run(n: int) -> ResidencyRun:
        return residency_run(ref, overrides, SessionShape.of_length(session_tokens), n, layout, mtp=mtp)

    cap = load_scenario(ref, list(overrides)).deployment.max_num_seqs
    first = run(cap)
    runs = {cap: first}
    count = first.peak_running if not first.resident else cap
    while count > 0 and not (runs.get(count) or runs.setdefault(count, run(count))).resident:
        count -= 1
    one_more = None if count >= cap else runs.get(count + 1) or run(count + 1)
    return Residency(layout, mtp, session_tokens, runs.get(count), one_more)


# ------------------------------------------------- the sequence cap
# A queue is growing when, over the run, more than this many requests wait
# on average (time-weighted): the cap admits slower than requests arrive.
GROWING_QUEUE_MEAN_WAITING = 1.0


def holds(summary: dict) -> bool:
    """No preemption and no growing queue (``GROWING_QUEUE_MEAN_WAITING``)."""
    return summary["num_preemptions"] == 0 and summary["mean_waiting"] <= GROWING_QUEUE_MEAN_WAITING


def largest_holding_cap(
    ref: str, overrides: list[str], layout: SideCacheSwitch, hi: int
) -> tuple[int | None, bool]:
    """The largest ``max_num_seqs`` in [1, hi] at which ``ref`` runs under
    ``layout`` without preemption (None when even 1 preempts), and whether
    it holds there (no growing queue too). A larger cap preempts sooner and
    queues less, so if the queue grows at that cap no cap holds."""
    from sim.analysis.runs import run_scenario  # imports vLLM: only where runs run

    summaries: dict[int, dict] = {}

    def summary(cap: int) -> dict:
        if cap not in summaries:
            scenario = load_scenario(
                ref, [*overrides, f"deployment.max_num_seqs={cap}", f"layouts=[{layout}]"]
            )
            summaries[cap] = run_scenario(scenario).summary.iloc[0].to_dict()
        return summaries[cap]

    cap = largest_holding(lambda n: summary(n)["num_preemptions"] == 0, hi)
    return cap, cap is not None and holds(summary(cap))


def largest_holding(holds_at: Callable[[int], bool], hi: int) -> int | None:
    """Bisection for the largest n in [1, hi] with ``holds_at(n)``, which
    is assumed true up to a threshold and false past it (a larger cap
    admits more at once, so past some cap the pool preempts).

    >>> largest_holding(lambda n: n <= 11, 64), largest_holding(lambda n: True, 64)
    (11, 64)
    >>> largest_holding(lambda n: False, 64) is None
    True
    """
    if not holds_at(1):
        return None
    if holds_at(hi):
        return hi
    lo, top = 1, hi  # it holds at lo, not at top
    while top - lo > 1:
        middle = (lo + top) // 2
        lo, top = (middle, top) if holds_at(middle) else (lo, middle)
    return lo
