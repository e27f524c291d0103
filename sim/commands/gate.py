"""``kvsim gate``: regression gates on admitted-request counts and friends."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sim.commands.common import add_progress_flag
from sim.config import ConfigError
from sim.paths import DEFAULT_GATES

if TYPE_CHECKING:  # pandas and the analysis cost a second at start-up: imported where used
    from sim.analysis.gates import GateReport


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "gate",
        help="regression gates: gate scenarios' metrics against recorded baselines",
        description="Run the gate scenarios under both layouts and compare their metrics with the "
        "baselines in the gates file; exit 1 on any regression.",
    )
    parser.add_argument(
        "gates", nargs="?", default=str(DEFAULT_GATES), help="gates file (default scenarios/gates.yaml)"
    )
    parser.add_argument(
        "--update",
        action="store_true",
        help="write the values seen as the new baselines (after an intended change)",
    )
    parser.add_argument("--only", action="append", metavar="NAME", help="run only this gate; repeatable")
    parser.add_argument(
        "--report",
        metavar="DIR",
        default="results/gates",
        help="where gates.json and gates.junit.xml go (default results/gates)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="parallel simulations (default 1: in this process)",
    )
    add_progress_flag(parser)
    parser.set_defaults(func=cmd_gate)


def cmd_gate(args: argparse.Namespace) -> int:
    from sim.analysis.gates import run_gates, write_report
    from sim.results import check_out_dir

    if args.workers < 1:
        raise ConfigError(f"--workers {args.workers}: expected at least 1")
    check_out_dir(Path(args.report), "--report")
    report = run_gates(
        args.gates,
        update=args.update,
        only=args.only,
        workers=args.workers,
        progress=True if args.progress else None,
    )
    print_report(report)
    write_report(report, Path(args.report))
    print(f"kvsim gate: report written to {args.report}/gates.json and gates.junit.xml")
    for message in report.failures["message"]:
        print(f"kvsim gate: FAIL {message}", file=sys.stderr)
    return 0 if report.ok else 1


def print_report(report: GateReport) -> None:
    import pandas as pd

    columns = ["gate", "layout", "metric", "baseline", "now", "change", "verdict"]
    with pd.option_context("display.width", 160, "display.max_rows", None):
        print(report.rows[columns].to_string(index=False, na_rep="-", float_format=lambda v: f"{v:g}"))
    counts = report.rows["verdict"].value_counts()
    print(
        "kvsim gate: "
        + ", ".join(f"{n} {verdict}" for verdict, n in counts.items())
        + f" of {len(report.rows)} checks in {report.gates_path}"
    )
    if report.updated:
        moved = report.rows[report.rows["verdict"] == "updated"]
        print(
            f"kvsim gate: {len(moved)} baselines updated in {report.gates_path}"
            + "".join(f"\n  {r.gate} [{r.layout}] {r.metric}: {r.message}" for r in moved.itertuples())
        )
    for row in report.rows[report.rows["verdict"].isin(["new", "improved"])].itertuples():
        print(f"kvsim gate: note: {row.gate} [{row.layout}] {row.metric}: {row.message}")
