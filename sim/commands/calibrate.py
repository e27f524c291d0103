"""``kvsim calibrate REPLAY_DIR``: fit step-time coefficients to a replay and
write them as a ``step_time:`` block a scenario can use."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from sim.config import ConfigError
from sim.scenario import add_override_argument

if TYPE_CHECKING:  # pandas costs a second at start-up: imported where used
    import pandas as pd

# The coefficients docs/step-time-model.md names for calibration. (Here, not
# in sim.analysis.calibrate, so building the parser imports no engine.)
DEFAULT_FIT = ("step_overhead_s", "memory_efficiency", "compute_efficiency")


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def register(subparsers: Any) -> None:
    calibrate = subparsers.add_parser("calibrate", help="fit the step-time model to a replay")
    calibrate.add_argument(
        "replay_dirs",
        nargs="*",
        metavar="REPLAY_DIR",
        help="results of kvsim replay of one scenario (one per layout, or one with both)",
    )
    calibrate.add_argument(
        "--plan",
        metavar="SCENARIO",
        help="no fit: which coefficients a replay of SCENARIO would identify (before rig time is spent)",
    )
    calibrate.add_argument(
        "--layout", choices=["on", "off"], default="on", help="--plan: the layout to replay (default on)"
    )
    calibrate.add_argument(
        "--speed", type=float, default=1.0, metavar="X", help="--plan: the replay's --speed (default 1)"
    )
    add_override_argument(calibrate, " (--plan)")
    calibrate.add_argument(
        "--fit",
        type=_names,
        default=DEFAULT_FIT,
        metavar="COEF[,COEF]",
        help=f"step_time coefficients to fit (default {','.join(DEFAULT_FIT)})",
    )
    calibrate.add_argument(
        "--out", metavar="FILE", help="the fitted step_time: block (default REPLAY_DIR/step-time.yaml)"
    )
    calibrate.add_argument(
        "--max-simulations", type=int, default=100, metavar="N", help="stop the fit after N (default 100)"
    )
    calibrate.add_argument(
        "--max-seconds", type=float, default=600.0, metavar="S", help="stop the fit after S s (default 600)"
    )
    calibrate.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from sim.analysis.calibrate import calibrate
    from sim.analysis.calibrate_error import check_coefficients, with_step_time
    from sim.commands.validate import read_replays, reorder_window_s
    from sim.results import write_text

    check_coefficients(args.fit)
    if args.plan is not None:
        return _cmd_plan(args)
    if not args.replay_dirs:
        raise ConfigError("calibrate: name a REPLAY_DIR, or --plan SCENARIO")
    if args.max_simulations < 1 or not args.max_seconds > 0:
        raise ConfigError("--max-simulations and --max-seconds: must be positive")
    replay_dirs = [Path(path) for path in args.replay_dirs]
    replay_dir = replay_dirs[0]
    replay, scenario_dict = read_replays(replay_dirs)
    scenario, layouts = _replayed_scenario(replay_dir, replay, scenario_dict)
    print(
        f"kvsim: calibrating {', '.join(args.fit)} to {', '.join(map(str, replay_dirs))} "
        f"({scenario.name}, {', '.join(layouts)})"
    )
    window_s = reorder_window_s(replay_dirs)
    _print_validation("before (the scenario's step_time)", scenario, layouts, replay, window_s)
    result = calibrate(
        scenario,
        replay["requests"],
        args.fit,
        max_simulations=args.max_simulations,
        max_seconds=args.max_seconds,
        reorder_window_s=window_s,
    )
    _print_fit(result)
    if not result.fitted:
        raise ConfigError(f"--fit: {', '.join(args.fit)}: none is identifiable from this replay")
    fitted = with_step_time(scenario, result.fitted)
    _print_validation("after (fitted step_time)", fitted, layouts, replay, window_s)
    out = Path(args.out) if args.out else replay_dir / "step-time.yaml"
    fragment = _fragment(replay_dirs, result)
    write_text(out, fragment)
    print(fragment.rstrip())
    print(f"kvsim: step_time block written to {out}")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    """Which coefficients a replay of the scenario would identify, and what
    to replay for the others; fits nothing, needs no rig."""
    from sim.analysis.calibrate_plan import plan, plan_table
    from sim.scenario import load_scenario

    if args.replay_dirs:
        raise ConfigError("--plan: takes a scenario, not REPLAY_DIR")
    if not args.speed > 0:
        raise ConfigError(f"--speed: expected > 0, got {args.speed}")
    scenario = load_scenario(args.plan, args.set)
    planned, busy = plan(scenario, args.fit, args.layout, args.speed)
    print(
        f"kvsim: a replay of {scenario.name} [{args.layout}] at --speed {args.speed:g}: prefill "
        f"{100 * busy.prefill_share:.0f} % of busy time, decode {100 - 100 * busy.prefill_share:.0f} %, "
        f"{busy.num_steps} steps"
    )
    print(plan_table(planned).to_string())
    for p in planned:
        if not p.identifiable:
            print(f"kvsim: {p.name}: not identifiable from this replay: {p.reason}; replay {p.remedy}")
    return 0


def _replayed_scenario(replay_dir: Path, replay: dict[str, pd.DataFrame], data: dict[str, Any]) -> Any:
    from sim.scenario import SideCacheSwitch, scenario_from_record

    if not data:
        raise ConfigError(f"{replay_dir}: no scenario recorded (scenario.json)")
    scenario = scenario_from_record(data, f"{replay_dir}/scenario.json")
    layouts = tuple(cast(SideCacheSwitch, str(name)) for name in dict.fromkeys(replay["summary"]["layout"]))
    unknown = [name for name in layouts if name not in ("off", "on")]
    if unknown or not layouts:
        raise ConfigError(f"{replay_dir}: summary: layouts {layouts}: expected off and/or on")
    return scenario, layouts


def _print_validation(
    title: str, scenario: Any, layouts: tuple[Any, ...], replay: dict[str, pd.DataFrame], window_s: float
) -> None:
    from sim.analysis.runs import run_scenario
    from sim.commands.validate import print_validation

    print(f"--- {title} ---")
    print_validation(run_scenario(scenario, layouts).frames(), replay, window_s)


def _print_fit(result: Any) -> None:
    """Every coefficient with its 95 % interval and status, then one line
    per coefficient not fitted saying why (drawn from the replay)."""
    import pandas as pd

    rows = [
        {
            "coefficient": name,
            "start": f"{c.start:.6g}",
            "value": f"{c.value:.6g}",
            "interval_95": _interval_text(c),
            "change_perc": f"{100 * (c.value / c.start - 1):+.2f}",
            "sensitivity": f"{c.sensitivity:.3g}",
            "status": c.status,
        }
        for name, c in result.coefficients.items()
    ]
    print(pd.DataFrame(rows).set_index("coefficient").to_string())
    print(
        f"RMS relative error of the compared times: {result.rms_error_start:.4f} -> "
        f"{result.rms_error_fitted:.4f}; the intervals assume a noise of {100 * result.noise:.2g} % "
        f"({result.num_simulations} simulations"
        f"{', stopped by --max-simulations or --max-seconds' if result.budget_spent else ''})"
    )
    print(f"arrivals simulated: {result.arrivals}")
    for name, c in result.coefficients.items():
        if c.status != "fitted":
            print(f"kvsim: {name}: {c.status}: {c.reason}; not written (left at {c.value:.6g})")


def _interval_text(c: Any) -> str:
    """``low .. high (+-p %)``; "unbounded" where the replay does not bound it."""
    import math

    if not math.isfinite(c.half_width):
        return "unbounded"
    low, high = c.interval
    return f"{low:.4g} .. {high:.4g} (+-{100 * math.expm1(c.half_width):.2g} %)"


def _fragment(replay_dirs: list[Path], result: Any) -> str:
    """The ``step_time:`` block of the fitted coefficients only, each with
    its interval; what was not fitted, and why, in comments above it."""
    lines = [
        f"# kvsim calibrate {' '.join(map(str, replay_dirs))}: RMS relative error "
        f"{result.rms_error_start:.4f} -> {result.rms_error_fitted:.4f} "
        f"(noise {100 * result.noise:.2g} %)",
        f"# arrivals simulated: {result.arrivals}",
    ]
    lines += [
        f"# {name}: {c.status} ({c.reason}): not written, {c.value:.6g} in the simulations"
        for name, c in result.coefficients.items()
        if c.status != "fitted"
    ]
    lines.append("step_time:")
    lines += [
        f"  {name}: {c.value!r}  # 95 % interval {_interval_text(c)}"
        for name, c in result.coefficients.items()
        if c.status == "fitted"
    ]
    return "\n".join(lines) + "\n"
