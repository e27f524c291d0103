"""``kvsim bench``: simulator speed and memory per layout."""

from __future__ import annotations

import argparse
from typing import Any

from sim.commands.common import CLIError, add_scenario_argument
from sim.scenario import add_override_argument


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("bench", help="simulator speed and memory, per layout (prints figures)")
    add_scenario_argument(parser)
    add_override_argument(parser)
    parser.add_argument("--layouts", default="off,on")
    parser.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from sim.bench import format_bench, run_bench
    from sim.scenario import load_scenario

    load_scenario(args.scenario, args.set)  # bad input fails here, in this process
    layouts = tuple(args.layouts.split(","))
    if not set(layouts) <= {"off", "on"}:
        raise CLIError(f"--layouts {args.layouts!r}: expected a comma-separated subset of off,on")
    print(format_bench(args.scenario, run_bench(args.scenario, args.set, layouts)))
    return 0
