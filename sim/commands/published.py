"""``kvsim published``: the rig's published figures against kvsim, each run
as a scenario (scenarios/rig/published.yaml)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from sim.config import ConfigError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "published",
        help="the rig's published bench figures against kvsim, with the error per figure",
        description="Run each published figure (one cold request on the rig's serving settings) and "
        "print the rig's value, kvsim's, the error, and what the synchronous engine gives.",
    )
    parser.add_argument(
        "--figures", metavar="FILE", help="figures file (default scenarios/rig/published.yaml)"
    )
    parser.add_argument("--only", metavar="ID,...", help="run only these figures")
    parser.add_argument("--plot", metavar="STEM", help="write the overlay figure (STEM.png, STEM.svg)")
    parser.add_argument(
        "--max-error-pct", type=float, metavar="PCT", help="exit 1 if a figure's error exceeds PCT"
    )
    parser.set_defaults(func=cmd_published)


def cmd_published(args: argparse.Namespace) -> int:
    from sim.analysis.plots import write_figure
    from sim.analysis.published import PUBLISHED, load_figures, published_figure, published_table

    figures = load_figures(Path(args.figures) if args.figures else PUBLISHED)
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - {f.id for f in figures})
        if unknown:
            raise ConfigError(f"--only: no figure {', '.join(unknown)}")
        figures = [f for f in figures if f.id in wanted]
    table = published_table(figures)
    shown = table.drop(columns=["card", "note"])
    print(shown.to_string(index=False, float_format=lambda v: f"{v:,.3f}"))
    print("kvsim: prefill and aggregate figures on the rig's engine loop (engine.mode async, steps")
    print("       overlapping across the stages); sync_engine: as kvsim's synchronous engine runs them;")
    print("       spread_pct: half the card's run-to-run range (boots, sends or prompts), where it gives one")
    for figure in figures:
        if figure.flag:
            print(f"flagged {figure.id}: {figure.flag}")
    if args.plot:
        for path in write_figure(published_figure(table), Path(args.plot)):
            print(f"kvsim: wrote {path}")
    if args.max_error_pct is not None and (table["error_pct"].abs() > args.max_error_pct).any():
        return 1
    return 0
