"""The fork's agent bench in kvsim's frames: the figures its card reports,
per layout and run, their median over seeds, and the card beside them.

The card is ``halt95/qwen38-flash-next-3090s``, ``benchmarks/2026-10-06/
BENCH-CARD.md``, section 5: eight agent conversations from ~76K tokens
growing past 120K, 300 s, temperature 0, one boot of each release. Its
definitions, applied here to kvsim's requests and steps frames:

- requests: the requests started within the run (every one completes);
- follow-ups: turns after a conversation's first (``turn`` >= 1);
- reuse: cached over prompt tokens, summed over the follow-ups;
- a full re-prefill: a follow-up with under 50 % of its prompt cached;
- the KV pool's peak: the card does not say how it was read. kvsim reads
  it as vLLM's own stats log shows it, the step gauge every 10 s (vLLM's
  ``VLLM_LOG_STATS_INTERVAL``, default 10 s): a peak between two log lines
  is not seen, which is why the card's 99.2 % (2 of 247 blocks free) sits
  below the 100 % its two preemptions imply.

No twin in vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from sim.analysis.frames import followup_figures, step_values
from sim.scenario import Scenario, SideCacheSwitch, load_scenario

if TYPE_CHECKING:
    from sim.analysis.runs import RunResult

# The card's "full re-prefill": a follow-up with under this much cached.
FULL_REPREFILL_CACHED_FRACTION = 0.5
# vLLM's stats log interval (vllm/envs.py VLLM_LOG_STATS_INTERVAL default).
LOG_INTERVAL_S = 10.0

# (figure, how the table names it), in the card's order.
BENCH_FIGURES: tuple[tuple[str, str], ...] = (
    ("num_requests", "requests"),
    ("num_followups", "follow-ups"),
    ("followup_prefix_hit_rate", "reuse (%)"),
    ("followup_ttft_p50_s", "follow-up TTFT p50 (s)"),
    ("followup_ttft_p90_s", "follow-up TTFT p90 (s)"),
    ("num_full_reprefills", "full re-prefills"),
    ("logged_peak_kv_cache_usage_perc", "pool peak, logged (%)"),
    ("num_preemptions", "preemptions"),
)
PERCENT_FIGURES = frozenset({"followup_prefix_hit_rate", "logged_peak_kv_cache_usage_perc"})


@dataclass(frozen=True)
class CardColumn:
    """One release's column of the card's section 5 (one boot, one run);
    None where the card states no figure. ``overrides``: the ``--set``
    lines that run kvsim's v2.5.1 agent scenario as that release."""

    release: str
    figures: dict[str, float | None]
    overrides: tuple[str, ...] = ()


CARD_SOURCE = "the fork's benchmarks/2026-10-06/BENCH-CARD.md, section 5"
CARD_V251 = CardColumn(
    "v2.5.1",
    {
        "num_requests": 107,
        "num_followups": 99,
        "followup_prefix_hit_rate": 0.925,
        "followup_ttft_p50_s": 1.61,
        "followup_ttft_p90_s": None,
        "num_full_reprefills": 4,
        "logged_peak_kv_cache_usage_perc": 0.992,
        "num_preemptions": 2,
    },
)
# v2.5.0 is v2.5.1 without 0093-0097 and --prefix-match-unit (a follow-up
# resumes on a 4,096-token block); the card ran it "block 4,096, no
# prefix-match unit". 0094 (a tail on a block boundary keyed) has no key:
# it changes which hash a tail gets, not an allocation kvsim decides on.
CARD_V250 = CardColumn(
    "v2.5.0",
    {
        "num_requests": 88,
        "num_followups": 80,
        "followup_prefix_hit_rate": 0.906,
        "followup_ttft_p50_s": 3.54,
        "followup_ttft_p90_s": None,
        "num_full_reprefills": 0,
        "logged_peak_kv_cache_usage_perc": 0.992,
        "num_preemptions": 0,
    },
    overrides=(
        "deployment.prefix_match_unit=4096",
        "fork.mamba_hold_partial_tail=false",
        "fork.waiter_pins=false",
        "fork.grace_pins=false",
    ),
)


def is_closed_loop(requests: pd.DataFrame) -> bool:
    """Sessions: some request is a follow-up turn, sent when its turn before ends."""
    return bool(len(requests)) and "turn" in requests and bool((requests["turn"] > 0).any())


def admitted_followups(requests: pd.DataFrame) -> pd.DataFrame:
    return requests[(requests["turn"] > 0) & requests["admitted"]]


def uncached_tokens(requests: pd.DataFrame) -> pd.Series:
    """Prompt tokens each admitted follow-up prefilled (found no cache for)."""
    follow_ups = admitted_followups(requests)
    return follow_ups["prompt_tokens"] - follow_ups["prefix_hit_tokens"]


def full_reprefills(requests: pd.DataFrame) -> pd.DataFrame:
    """The admitted follow-ups with under half their prompt cached."""
    follow_ups = admitted_followups(requests)
    cached = follow_ups["prefix_hit_tokens"] < FULL_REPREFILL_CACHED_FRACTION * follow_ups["prompt_tokens"]
    return follow_ups[cached]


def logged_peak(steps: pd.DataFrame, interval_s: float = LOG_INTERVAL_S) -> float:
    """The KV pool's use as logged every ``interval_s`` (the gauge after the
    last step before each log time), at its highest; NaN with no log line.

    >>> steps = pd.DataFrame({"time_s": [1.0, 12.0, 15.0], "kv_cache_usage_perc": [0.5, 1.0, 0.9]})
    >>> logged_peak(steps)  # logs at 10 s (0.5) and 20 s (0.9); 1.0 falls between
    0.9
    """
    ordered = steps.sort_values("time_s", kind="stable")
    times_s = ordered["time_s"].to_numpy(float)
    log_times_s = np.arange(interval_s, times_s[-1] + interval_s, interval_s) if len(times_s) else np.zeros(0)
    values = step_values(times_s, ordered["kv_cache_usage_perc"].to_numpy(float), log_times_s)
    return float(np.nanmax(values)) if len(values) and not np.isnan(values).all() else math.nan


def bench_figures(steps: pd.DataFrame, requests: pd.DataFrame) -> dict[str, float]:
    """One run of one layout, as the card reports it."""
    followups = followup_figures(requests)
    return {
        "num_requests": float(len(requests)),
        "num_followups": float(followups["num_followups"]),
        "followup_prefix_hit_rate": followups["followup_prefix_hit_rate"],
        "followup_ttft_p50_s": followups["followup_ttft_p50_s"],
        "followup_ttft_p90_s": followups["followup_ttft_p90_s"],
        "num_full_reprefills": float(len(full_reprefills(requests))),
        "logged_peak_kv_cache_usage_perc": logged_peak(steps),
        "num_preemptions": float(steps["num_preemptions"].sum()) if len(steps) else 0.0,
    }


def bench_rows(steps: pd.DataFrame, requests: pd.DataFrame, seed: int) -> list[dict[str, float | str]]:
    """One row per layout of one run (both frames hold every layout)."""
    return [
        {"seed": seed, "layout": layout, **bench_figures(steps[steps["layout"] == layout], rows)}
        for layout, rows in requests.groupby("layout", sort=False)
    ]


def over_seeds(rows: pd.DataFrame, column: str) -> pd.DataFrame:
    """Per figure, the median over seeds of ``column``'s runs and its
    spread (lowest, highest); one run gives its own value thrice."""
    runs = rows[rows["column"] == column].drop(columns=["column", "seed", "layout"])
    table = pd.DataFrame({"median": runs.median(), "lo": runs.min(), "hi": runs.max()})
    return table.loc[[name for name, _ in BENCH_FIGURES]]


def format_figure(name: str, value: float | None) -> str:
    """A figure as the table prints it: a percentage, seconds or a count.

    >>> format_figure("followup_prefix_hit_rate", 0.925), format_figure("num_requests", 107.0)
    ('92.5', '107')
    >>> format_figure("followup_ttft_p50_s", 1.614), format_figure("num_preemptions", None)
    ('1.61', '-')
    """
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if name in PERCENT_FIGURES:
        return f"{100 * value:.1f}"
    if name.endswith("_s"):
        return f"{value:.2f}"
    return f"{value:g}" if float(value).is_integer() else f"{value:.1f}"


def spread_cell(name: str, stats: pd.Series) -> str:
    """``median [lo-hi]``; the median alone when every seed agrees."""
    median = format_figure(name, stats["median"])
    lo, hi = format_figure(name, stats["lo"]), format_figure(name, stats["hi"])
    return median if lo == hi else f"{median} [{lo}-{hi}]"


def headline_table(rows: pd.DataFrame, columns: Sequence[tuple[str, CardColumn | None]]) -> pd.DataFrame:
    """The headline: for each (kvsim column, card column) pair, kvsim's
    median [spread] and, where the card has one, the card's figure."""
    table = pd.DataFrame(index=pd.Index([label for _, label in BENCH_FIGURES], name="figure"))
    for column, card in columns:
        stats = over_seeds(rows, column)
        table[column] = [spread_cell(name, stats.loc[name]) for name, _ in BENCH_FIGURES]
        if card is not None:
            table[f"card {card.release}"] = [format_figure(n, card.figures[n]) for n, _ in BENCH_FIGURES]
    return table


def within(value: float, card: float, rel: float) -> bool:
    """``value`` within ``rel`` of the card's figure (relative)."""
    return abs(value - card) <= rel * abs(card)


# ------------------------------------------------------------ runs
# The card each shipped agent scenario is measured against: the kvsim
# column under the side-cache layout as shipped, and the earlier release.
CARDS: dict[str, tuple[CardColumn, CardColumn]] = {"agent-sessions": (CARD_V251, CARD_V250)}


def seed_rows(
    scenario: Scenario, layouts: Sequence[SideCacheSwitch], column: str | None = None
) -> list[dict]:
    """``bench_rows`` of one run of ``scenario`` under ``layouts``; each row's
    ``column`` is its layout unless one is named."""
    from sim.analysis.runs import run_scenario  # imports vLLM: only where runs run

    return run_rows(run_scenario(scenario, layouts), column)


def run_rows(result: RunResult, column: str | None = None) -> list[dict]:
    rows = bench_rows(result.steps, result.requests, result.scenario.seed)
    return [{**row, "column": column or row["layout"]} for row in rows]


@dataclass(frozen=True)
class Headline:
    """The agent bench's figures of a scenario over seeds, and the card's
    columns (None where the scenario has no card)."""

    scenario: Scenario
    seeds: tuple[int, ...]
    rows: pd.DataFrame
    card: CardColumn | None
    earlier: CardColumn | None

    def table(self) -> pd.DataFrame:
        columns = [("off", None), ("on", self.card)]
        if self.earlier is not None:
            columns.append((self.earlier.release, self.earlier))
        return headline_table(self.rows, columns)


def bench_headline(
    ref: str, overrides: Sequence[str], num_seeds: int, *, first: RunResult | None = None
) -> Headline:
    """Both layouts on ``num_seeds`` seeds from the scenario's own, and,
    where the scenario has a card, ``on`` as the earlier release ran it.
    ``first``: the run of the first seed under both layouts, if made."""
    scenario = load_scenario(ref, list(overrides))
    seeds = tuple(scenario.seed + i for i in range(num_seeds))
    card, earlier = CARDS.get(scenario.name, (None, None))
    rows = run_rows(first) if first is not None else []
    for seed in seeds[1 if first is not None else 0 :]:
        rows += seed_rows(load_scenario(ref, [*overrides, f"seed={seed}"]), ("off", "on"))
    if earlier is not None:
        for seed in seeds:
            release = load_scenario(ref, [*overrides, *earlier.overrides, f"seed={seed}"])
            rows += seed_rows(release, ("on",), earlier.release)
    return Headline(scenario, seeds, pd.DataFrame.from_records(rows), card, earlier)


def headline_text(headline: Headline) -> str:
    """What ``kvsim compare`` prints of a closed loop: the table and what it is."""
    seeds = headline.seeds
    span = f"seeds {seeds[0]}-{seeds[-1]}" if len(seeds) > 1 else f"seed {seeds[0]}"
    lines = [
        f"kvsim: {headline.scenario.name}: {headline.scenario.description}",
        headline.table().to_string(index_names=False),
        f"kvsim: median [lowest-highest] over {span}; the frames and figures are seed {seeds[0]}'s",
    ]
    if headline.card is not None:
        lines.append(
            f"card: {CARD_SOURCE}: one run (one boot) of each release"
            + (f"; kvsim's {headline.earlier.release} is `on` as the fork ran it" if headline.earlier else "")
        )
    return "\n".join(lines)
