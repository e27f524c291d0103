"""``kvsim run`` (one layout) and ``kvsim compare`` (both layouts)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sim.commands.common import add_scenario_flags, print_table
from sim.scenario import SideCacheSwitch

if TYPE_CHECKING:  # the engine costs seconds at start-up
    from sim.analysis.runs import RunResult
    from sim.scenario import Scenario

# A sessions run also prints what the fork's agent bench reports: follow-up
# TTFT, cache reuse over follow-ups, and the KV pool's peak.
SESSION_FIGURES = (
    "num_followups",
    "followup_ttft_p50_s",
    "followup_ttft_p90_s",
    "followup_reused_tokens",
    "followup_prefix_hit_rate",
    "peak_kv_cache_usage_perc",
)
# The agent bench's headline: a median over this many seeds (from the
# scenario's own); each seed is both layouts and, with a card, its earlier
# release: about 5 s of CPU per run.
DEFAULT_SEEDS = 5
MAX_SEEDS = 100


def register(subparsers: Any) -> None:
    run = subparsers.add_parser("run", help="simulate a scenario under one layout")
    add_scenario_flags(run)
    run.add_argument("--layout", choices=["on", "off"], default="on")
    run.set_defaults(func=lambda args: run_and_write(args, (args.layout,)))

    compare = subparsers.add_parser("compare", help="simulate a scenario under both layouts and compare")
    add_scenario_flags(compare)
    compare.add_argument(
        "--seeds",
        type=seed_count,
        default=DEFAULT_SEEDS,
        metavar="N",
        help=f"closed-loop scenarios: the headline's median over N seeds (default {DEFAULT_SEEDS})",
    )
    compare.set_defaults(func=lambda args: run_and_write(args, ("off", "on")))


def seed_count(text: str) -> int:
    try:
        count = int(text)
    except ValueError:
        count = 0
    if not 1 <= count <= MAX_SEEDS:
        raise argparse.ArgumentTypeError(f"expected a whole number of seeds from 1 to {MAX_SEEDS}: {text!r}")
    return count


def run_and_write(args: argparse.Namespace, layouts: tuple[SideCacheSwitch, ...]) -> int:
    from sim.analysis.agent_bench import is_closed_loop
    from sim.analysis.plots import write_standard_figures
    from sim.analysis.runs import run_scenario
    from sim.results import check_out_dir, write_results
    from sim.scenario import load_scenario, scenario_to_dict

    scenario = load_scenario(args.scenario, args.set)
    out_dir = Path(args.out) if args.out else Path("results") / scenario.name
    check_out_dir(out_dir)  # before the simulation, not after it
    result = run_scenario(scenario, layouts, progress=sys.stderr.isatty() or args.progress)
    frames = result.frames()
    written = write_results(
        out_dir, frames, scenario_to_dict(scenario), figures=lambda d: write_standard_figures(d, frames)
    )
    figures = [path for path in written if path.parent.name == "plots"]
    if len(layouts) == 2 and is_closed_loop(result.requests):
        print_headline(args, scenario, result)
    else:
        print_comparison(scenario, result)
    print(f"frames written to {out_dir}/ (steps, requests, samples, summary: parquet)")
    print(
        f"figures written to {out_dir / 'plots'}/ ({len(figures)} files: "
        f"{', '.join(sorted({p.stem for p in figures}))})"
    )
    return 0


def print_comparison(scenario: Scenario, result: RunResult) -> None:
    """Open loop (or one layout): the summary side by side with the gain."""
    print(
        f"kvsim: {scenario.name}: {len(result.requests) // max(len(result.summary), 1)} requests per layout"
    )
    print_table(result.comparison())
    if (result.summary["num_followups"] > 0).any():
        print("agent sessions: follow-up turns (turn >= 1), reuse and the KV peak")
        print_table(result.summary.set_index("layout")[list(SESSION_FIGURES)].T)


def print_headline(args: argparse.Namespace, scenario: Scenario, result: RunResult) -> None:
    """Closed loop under both layouts: the agent bench's figures, median
    [lowest-highest] over seeds, with the card's beside them where the
    scenario has one (this run is the first seed's)."""
    from sim.analysis.agent_bench import bench_headline, headline_text

    print(headline_text(bench_headline(args.scenario, args.set, args.seeds, first=result)))
