"""``kvsim calibrate REPLAY_DIR``: fit step-time coefficients to a replay and
write them as a ``step_time:`` block a scenario can use."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import yaml

from sim.config import ConfigError

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
        nargs="+",
        metavar="REPLAY_DIR",
        help="results of kvsim replay of one scenario (one per layout, or one with both)",
    )
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
    from sim.analysis.calibrate import calibrate, check_coefficients, with_step_time
    from sim.commands.validate import read_replays
    from sim.results import write_text

    check_coefficients(args.fit)
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
    _print_validation("before (the scenario's step_time)", scenario, layouts, replay)
    result = calibrate(
        scenario,
        replay["requests"],
        args.fit,
        max_simulations=args.max_simulations,
        max_seconds=args.max_seconds,
    )
    _print_fit(result)
    if not result.fitted:
        raise ConfigError(f"--fit: {', '.join(result.unidentifiable)}: unidentifiable from this replay")
    _print_validation("after (fitted step_time)", with_step_time(scenario, result.fitted), layouts, replay)
    block = {"step_time": result.step_time(scenario.step_time)}
    out = Path(args.out) if args.out else replay_dir / "step-time.yaml"
    write_text(out, _fragment(replay_dirs, result, block))
    print(yaml.safe_dump(block, sort_keys=False).rstrip())
    print(f"kvsim: step_time block written to {out}")
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
    title: str, scenario: Any, layouts: tuple[Any, ...], replay: dict[str, pd.DataFrame]
) -> None:
    from sim.analysis.runs import run_scenario
    from sim.commands.validate import print_validation

    print(f"--- {title} ---")
    print_validation(run_scenario(scenario, layouts).frames(), replay)


def _print_fit(result: Any) -> None:
    rows = []
    for name, start in result.start.items():
        fitted = result.fitted.get(name, start)
        status = "unidentifiable" if name in result.unidentifiable else "fitted"
        if name in result.at_bound:
            status = "fitted (at its bound)"
        rows.append(
            {
                "coefficient": name,
                "start": f"{start:.6g}",
                "fitted": f"{fitted:.6g}",
                "change_perc": f"{100 * (fitted / start - 1):+.2f}",
                "sensitivity": f"{result.sensitivity[name]:.3g}",
                "status": status,
            }
        )
    import pandas as pd

    print(pd.DataFrame(rows).set_index("coefficient").to_string())
    print(
        f"RMS relative error of TTFT and e2e per request: {result.rms_error_start:.4f} -> "
        f"{result.rms_error_fitted:.4f} ({result.num_simulations} simulations"
        f"{', stopped by --max-simulations or --max-seconds' if result.budget_spent else ''})"
    )
    for first, second, cosine in result.alike:
        print(
            f"kvsim: {first} and {second} move the request times alike (cosine {cosine:+.3f}): "
            "this replay fixes a combination of them, not each; fit one, or replay a load that separates them"
        )
    for name in result.unidentifiable:
        print(f"kvsim: {name}: unidentifiable: it does not move the simulated request times; not fitted")


def _fragment(replay_dirs: list[Path], result: Any, block: dict[str, Any]) -> str:
    header = (
        f"# kvsim calibrate {' '.join(map(str, replay_dirs))}: "
        "RMS relative error of per-request TTFT and e2e "
        f"{result.rms_error_start:.4f} -> {result.rms_error_fitted:.4f}\n"
    )
    if result.unidentifiable:
        header += f"# unidentifiable (not fitted): {', '.join(result.unidentifiable)}\n"
    return header + yaml.safe_dump(block, sort_keys=False)
