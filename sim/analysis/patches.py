"""What each of the fork's modelled patches buys: one scenario run as the
fork ships it, with each patch off in turn, and as upstream vLLM.

No twin in vLLM or the fork (the fork has no switch for most patches; kvsim
gives each a ``fork:`` key, ``sim.fork.patches``). The rows follow
``ForkPatches``' fields, whatever they are, so a patch added there gets its
row here without a change.
"""

from __future__ import annotations

from collections.abc import Iterator

import pandas as pd

from sim.analysis.runs import run_scenario
from sim.fork.patches import ForkPatches
from sim.scenario import ForkSection, Scenario, SideCacheSwitch

SHIPPED_ROW = "as shipped"
UPSTREAM_ROW = "upstream"
# The summary metrics a row shows (the fork's agent bench figures), with the
# headers of the Markdown table.
PATCH_METRICS: dict[str, str] = {
    "num_admitted": "admitted",
    "num_preemptions": "preemptions",
    "prefix_cache_hit_rate": "prefix hit rate",
    "followup_ttft_p50_s": "follow-up TTFT p50 (s)",
    "followup_prefix_hit_rate": "follow-up reuse",
    "peak_kv_cache_usage_perc": "peak KV usage",
}


def off_row(patch: str) -> str:
    return f"{patch} off"


def patch_variants(scenario: Scenario) -> Iterator[tuple[str, Scenario]]:
    """(row, scenario): the fork as shipped, each patch off alone, upstream.
    The scenario's own ``fork:`` section is replaced, not combined."""
    yield SHIPPED_ROW, scenario.model_copy(update={"fork": ForkSection()})
    for patch in ForkPatches.names():
        yield off_row(patch), scenario.model_copy(update={"fork": ForkSection.model_validate({patch: False})})
    yield UPSTREAM_ROW, scenario.model_copy(update={"fork": ForkSection(base="upstream")})


def patch_table(scenario: Scenario, layout: SideCacheSwitch = "on") -> pd.DataFrame:
    """One row per variant (index ``fork``), the ``PATCH_METRICS`` columns."""
    rows = {}
    for row, variant in patch_variants(scenario):
        summary = run_scenario(variant, (layout,)).summary.iloc[0]
        rows[row] = {metric: summary[metric] for metric in PATCH_METRICS}
    table = pd.DataFrame.from_dict(rows, orient="index")
    table.index.name = "fork"
    return table


def _cell(metric: str, value: float) -> str:
    if value != value:  # NaN: no follow-up turns in this scenario
        return "-"
    if metric in ("num_admitted", "num_preemptions"):
        return f"{value:,.0f}"
    if metric.endswith("_perc") or metric.endswith("_rate"):
        return f"{100 * value:.1f} %"
    return f"{value:.2f}"


def markdown_table(table: pd.DataFrame) -> str:
    """The table as GitHub Markdown (docs/fork-patches.md regenerates from it)."""
    header = ["fork", *PATCH_METRICS.values()]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row, values in table.iterrows():
        cells = [f"`{row}`" if row not in (SHIPPED_ROW, UPSTREAM_ROW) else str(row)]
        cells += [_cell(metric, float(values[metric])) for metric in PATCH_METRICS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
