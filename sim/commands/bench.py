"""``kvsim bench``: simulator speed and memory per layout, saved as JSON."""

from __future__ import annotations

import argparse
import platform
import subprocess
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sim.commands.common import CLIError, add_scenario_argument
from sim.scenario import add_override_argument


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("bench", help="simulator speed and memory, per layout (prints figures)")
    add_scenario_argument(parser)
    add_override_argument(parser)
    parser.add_argument("--layouts", default="off,on")
    parser.add_argument(
        "--against",
        default="",
        metavar="BACKENDS",
        help="also measure, per layout, a comma-separated subset of: step-by-step (kvsim without its "
        "fast path), vllm (vLLM's own Scheduler on the same trace, fenced frees off as vLLM frees), "
        "allocator (kvsim timing the calls it makes of the KV cache manager and the block hasher: "
        "the most real time and the fewest us per step kvsim can reach while it makes them); "
        "prints how many times fewer CPU microseconds per step kvsim takes than each",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        metavar="N",
        help="runs of each measurement, each in a fresh process, in turn with the others; the figures "
        "are the run with the least CPU time (default 3)",
    )
    parser.add_argument(
        "--out",
        metavar="FILE",
        help="where the figures go as JSON, to compare commits (default results/bench/SCENARIO.json)",
    )
    parser.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from sim.bench import BACKENDS, format_bench, run_bench, step_cost_ratios
    from sim.results import write_json
    from sim.scenario import load_scenario

    scenario = load_scenario(args.scenario, args.set)  # bad input fails here, in this process
    layouts = tuple(args.layouts.split(","))
    if not set(layouts) <= {"off", "on"}:
        raise CLIError(f"--layouts {args.layouts!r}: expected a comma-separated subset of off,on")
    against = tuple(name for name in args.against.split(",") if name)
    if not set(against) <= set(BACKENDS) - {"kvsim"}:
        compared = ",".join(BACKENDS[1:])
        raise CLIError(f"--against {args.against!r}: expected a comma-separated subset of {compared}")
    if args.repeat < 1:
        raise CLIError(f"--repeat {args.repeat}: expected at least 1")
    figures = run_bench(args.scenario, args.set, layouts, against, args.repeat)
    print(format_bench(args.scenario, figures))
    out = Path(args.out) if args.out else Path("results") / "bench" / f"{scenario.name}.json"
    record = {
        "scenario": scenario.name,
        "set": args.set,
        "commit": _commit(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"python": platform.python_version(), "processor": platform.machine()},
        "figures": [
            asdict(f)
            | {
                "sim_s_per_wall_s": f.sim_s_per_wall_s,
                "steps_per_s": f.steps_per_s,
                "us_per_step": f.us_per_step,
                "sim_s_per_cpu_s": f.sim_s_per_cpu_s,
                "cpu_us_per_step": f.cpu_us_per_step,
                "allocator_us_per_step": f.allocator_us_per_step,
            }
            for f in figures
        ],
        "cpu_us_per_step_ratios": step_cost_ratios(figures),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, record)
    print(f"kvsim bench: figures written to {out}")
    return 0


def _commit() -> str | None:
    """The checkout's commit, so two saved benches name what they measured."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None
