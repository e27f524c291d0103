"""``kvsim sweep``: the command line of sweeps and capacity searches."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sim.commands.common import add_progress_flag, add_scenario_argument
from sim.config import ConfigError
from sim.scenario import add_override_argument, load_scenario

if TYPE_CHECKING:  # pandas and the analysis cost a second at start-up: imported where used
    import pandas as pd


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "sweep",
        help="run a scenario over a grid of settings, or search its capacity",
        description="Run the cartesian product of --grid axes, one run per point and layout; "
        "results go to OUT/runs/ as each run finishes and to OUT/sweep.parquet at the end.",
    )
    add_scenario_argument(parser, default=None)
    add_override_argument(parser, " for every run")
    parser.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2,...",
        help="sweep a dotted scenario key (or layout) over values; repeatable",
    )
    parser.add_argument("--out", metavar="DIR", help="output directory (default results/sweep-SCENARIO)")
    parser.add_argument(
        "--executor", choices=["local", "ray"], default="local", help="local processes (default) or Ray tasks"
    )
    parser.add_argument("--address", help="Ray cluster address (default: start a local Ray)")
    parser.add_argument("--workers", type=int, metavar="N", help="parallel runs (default: all cores)")
    parser.add_argument("--resume", action="store_true", help="keep OUT's finished runs, run the rest")
    add_progress_flag(parser)
    parser.add_argument(
        "--find-max-rate",
        metavar="LO,HI",
        help="bisect workload.rate_scale in [LO, HI] for the highest rate without preemption",
    )
    parser.add_argument(
        "--rate-precision",
        type=float,
        metavar="REL",
        help="relative precision of --find-max-rate (default 0.05)",
    )
    parser.add_argument(
        "--ttft-p99-max",
        type=float,
        metavar="SECONDS",
        help="with --find-max-rate: sustain means TTFT p99 <= SECONDS instead",
    )
    parser.set_defaults(func=cmd_sweep)


def _check_flags(args: argparse.Namespace) -> None:
    if args.workers is not None and args.workers < 1:
        raise ConfigError(f"--workers {args.workers}: expected at least 1")
    if args.address and args.executor != "ray":
        raise ConfigError("--address: only with --executor ray")
    if args.find_max_rate is None and (args.rate_precision is not None or args.ttft_p99_max is not None):
        raise ConfigError("--rate-precision and --ttft-p99-max: only with --find-max-rate")
    if args.executor == "ray":
        from sim.analysis.executors import import_ray

        import_ray()


def _bounds(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"--find-max-rate {text!r}: expected LO,HI (two rates)") from None
    if not 0 < lo < hi:
        raise ConfigError(f"--find-max-rate {text!r}: expected 0 < LO < HI")
    return lo, hi


def cmd_sweep(args: argparse.Namespace) -> int:
    from sim.analysis.capacity import CapacitySearch, run_capacity_search
    from sim.analysis.executors import LAYOUT_KEY
    from sim.analysis.sweep import parse_grid, plan_runs, run_sweep
    from sim.results import check_out_dir

    _check_flags(args)
    axes = tuple(parse_grid(text) for text in args.grid)
    base = load_scenario(args.scenario, args.set)
    out_dir = Path(args.out) if args.out else Path("results") / f"sweep-{base.name}"
    check_out_dir(out_dir)
    if args.resume:
        note_unfinished(out_dir / "runs")
    how = {
        "resume": args.resume,
        "executor": args.executor,
        "workers": args.workers,
        "address": args.address,
        "progress": True if args.progress else None,
    }
    if args.find_max_rate is not None:
        lo, hi = _bounds(args.find_max_rate)
        search = CapacitySearch(
            args.scenario, tuple(args.set), axes, lo, hi, args.rate_precision or 0.05, args.ttft_p99_max
        )
        search.check()
        print_capacity(run_capacity_search(search, out_dir, **how), args.ttft_p99_max)
        print(f"kvsim sweep: capacity written to {out_dir}/max_rate.parquet")
        return 0
    specs = plan_runs(args.scenario, args.set, axes)
    plan = {
        "scenario": base.name,
        "scenario_file": args.scenario,
        "set": args.set,
        "grid": {axis.key: list(axis.values) for axis in axes},
    }
    frame = run_sweep(specs, out_dir, plan=plan, **how)
    print_sweep(frame, [a.key for a in axes if a.key != LAYOUT_KEY])
    print(f"kvsim sweep: {len(frame)} runs written to {out_dir}/sweep.parquet")
    return 0


def note_unfinished(runs_dir: Path) -> None:
    from sim.analysis.sweep import unfinished_run_files

    unfinished = unfinished_run_files(runs_dir)
    if unfinished:
        print(
            f"kvsim sweep: {len(unfinished)} file(s) in {runs_dir}/ are not finished runs "
            f"(e.g. {unfinished[0].name}: not JSON, or no summary): running them again"
        )


def print_sweep(frame: pd.DataFrame, keys: list[str]) -> None:
    import pandas as pd

    metrics = [
        "num_admitted",
        "peak_concurrency",
        "num_preemptions",
        "ttft_p99_s",
        "output_throughput_tokens_per_s",
    ]
    with pd.option_context("display.width", 160, "display.max_columns", 20):
        print(
            frame[["run_id", *keys, "layout", *metrics]].to_string(
                index=False, float_format=lambda v: f"{v:,.3f}"
            )
        )


def print_capacity(frame: pd.DataFrame, ttft_p99_max_s: float | None) -> None:
    import pandas as pd

    from sim.analysis.sweep import RATE_KEY

    what = "without preemption" if ttft_p99_max_s is None else f"with TTFT p99 <= {ttft_p99_max_s:g} s"
    print(f"highest {RATE_KEY} {what}:")
    with pd.option_context("display.width", 160, "display.max_columns", 20):
        print(frame.to_string(index=False))
    for point, rows in frame.groupby("point"):
        capped = set(rows.loc[rows["capped"], "layout"])
        note = {
            frozenset({"on"}): " (a lower bound: on sustained the upper bound)",
            frozenset({"off"}): " (an upper bound: off sustained the upper bound)",
            frozenset({"off", "on"}): " (meaningless: both sustained the upper bound; raise HI)",
        }.get(frozenset(capped), "")
        print(f"gain (on / off max rate), point {point}: {rows['gain'].iloc[0]:.3f}{note}")
