"""``kvsim patches``: what each of the fork's modelled patches buys on a scenario."""

from __future__ import annotations

import argparse
from typing import Any

from sim.commands.common import add_scenario_argument
from sim.scenario import add_override_argument


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "patches",
        help="run a scenario as the fork ships it, with each modelled patch off, and as upstream",
        description="One row per run: the fork as shipped, each patch of sim/fork/patches.py off in "
        "turn, and fork: upstream; per row admitted, preemptions, prefix hit rate, follow-up TTFT "
        "and peak KV usage (docs/fork-patches.md, 'What each patch buys').",
    )
    add_scenario_argument(parser, default=None)
    add_override_argument(parser)
    parser.add_argument("--layout", choices=["on", "off"], default="on", help="side-cache layout (on)")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table (for the docs)")
    parser.set_defaults(func=cmd_patches)


def cmd_patches(args: argparse.Namespace) -> int:
    from sim.analysis.patches import markdown_table, patch_table
    from sim.commands.common import print_table
    from sim.scenario import load_scenario

    scenario = load_scenario(args.scenario, args.set)
    table = patch_table(scenario, args.layout)
    if args.markdown:
        print(markdown_table(table))
    else:
        print(f"kvsim patches: {scenario.name} (layout {args.layout})")
        print_table(table)
    return 0
