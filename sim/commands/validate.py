"""``kvsim validate SIM_DIR REPLAY_DIR``: the simulation against a replay
of the same scenario, per layout: an error table, ``validate.json`` and
overlay figures."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sim.commands.common import format_number
from sim.config import ConfigError

if TYPE_CHECKING:  # pandas costs a second at start-up: imported where used
    import pandas as pd


def register(subparsers: Any) -> None:
    validate = subparsers.add_parser(
        "validate", help="compare a simulation with a replay of the same scenario"
    )
    validate.add_argument("sim_dir", metavar="SIM_DIR", help="results of kvsim run or compare")
    validate.add_argument(
        "replay_dirs",
        nargs="+",
        metavar="REPLAY_DIR",
        help="results of kvsim replay (one per layout, or one with both)",
    )
    validate.add_argument(
        "--out", metavar="DIR", help="where validate.json and plots/ go (default REPLAY_DIR/validate)"
    )
    validate.set_defaults(func=cmd_validate)


def read_replays(replay_dirs: list[Path]) -> tuple[dict[str, pd.DataFrame], dict[str, Any]]:
    """The frames of one or more replays of one scenario (a replay per
    layout), stacked, and the scenario they replayed."""
    import pandas as pd

    from sim.results import read_run

    runs = [read_run(path) for path in replay_dirs]
    scenario = runs[0][1]
    for path, (_, other) in zip(replay_dirs[1:], runs[1:], strict=True):
        if other != scenario:
            raise ConfigError(f"{path}: a replay of another scenario than {replay_dirs[0]}")
    layouts = [layout for frames, _ in runs for layout in set(frames["summary"]["layout"])]
    if len(layouts) != len(set(layouts)):
        raise ConfigError(f"{', '.join(map(str, replay_dirs))}: a layout is in more than one replay")
    names = ("requests", "samples", "summary")
    stacked = {name: pd.concat([frames[name] for frames, _ in runs], ignore_index=True) for name in names}
    return stacked, scenario


def reorder_window_s(replay_dirs: list[Path]) -> float:
    """Scenario seconds within which the server may have taken two requests
    in either order: ``REORDER_WALL_S`` times the replay's ``--speed``."""
    from sim.analysis.replayed_arrivals import REORDER_WALL_S
    from sim.results import read_manifest

    speeds = []
    for path in replay_dirs:
        speed = read_manifest(path).get("speed", 1.0)  # a stand-in replay ran at 1
        if isinstance(speed, bool) or not isinstance(speed, int | float) or not speed > 0:
            raise ConfigError(f"{path}/manifest.json: speed: expected a number > 0, got {speed!r}")
        speeds.append(float(speed))
    return REORDER_WALL_S * max(speeds)


def read_pair(
    sim_dir: Path, replay_dirs: list[Path]
) -> tuple[dict[str, pd.DataFrame], dict[str, pd.DataFrame]]:
    """Both sides' frames; an error when they share no layout."""
    from sim.analysis.validate import layouts_in_both
    from sim.results import read_run

    sim, _ = read_run(sim_dir)
    replay, _ = read_replays(replay_dirs)
    if not layouts_in_both(sim, replay):
        where = ", ".join(map(str, replay_dirs))
        raise ConfigError(
            f"{sim_dir} ({_layouts(sim)}) and {where} ({_layouts(replay)}): no layout in both runs"
        )
    return sim, replay


def _layouts(frames: dict[str, pd.DataFrame]) -> str:
    return ", ".join(str(name) for name in dict.fromkeys(frames["summary"]["layout"])) or "none"


def print_validation(
    sim: dict[str, pd.DataFrame], replay: dict[str, pd.DataFrame], reorder_window_s: float = 0.0
) -> None:
    """Per layout: each metric simulated, measured, error and error %, then
    the curves' RMSE and MAPE. NaN (not measured) prints as "-"; a metric a
    reorder inside a burst moves, where the replay has bursts, prints its
    values and no error, after a note saying why."""
    from sim.analysis.validate import curve_table, metric_table

    metrics = metric_table(sim, replay, reorder_window_s)
    for layout, rows in metrics.groupby("layout", sort=False):
        print(f"layout {layout}: simulated vs measured")
        _note_bursts(replay, str(layout), reorder_window_s, rows)
        table = rows.set_index("metric")[["sim", "replay", "error", "error_perc"]]
        print(
            table.astype(float).to_string(formatters=dict.fromkeys(table.columns, format_number), na_rep="-")
        )
    curves = curve_table(sim, replay).set_index(["layout", "curve"])[["rmse", "mape_perc", "num_points"]]
    print("curves (common time grid; MAPE over points where the measurement is not 0)")
    print(curves.astype(float).to_string(formatters=dict.fromkeys(curves.columns, _format_curve), na_rep="-"))


def _note_bursts(replay: dict[str, pd.DataFrame], layout: str, window_s: float, rows: pd.DataFrame) -> None:
    from sim.analysis.validate import dense_share, replay_bursts

    share = dense_share(replay_bursts(replay, layout, window_s)[0])
    if share == 0:
        return
    skipped = ", ".join(rows.loc[~rows["comparable"].astype(bool), "metric"])
    print(
        f"kvsim: note: {100 * share:.0f} % of the requests reached the server within {window_s:.3g} s "
        "of another: too dense for per-request comparison (the server may have taken them in another "
        f"order, or step, than the simulation); not compared: {skipped}; compared instead: each "
        "burst's last first token and last finish (burst_last_*), the p99s, counts, throughput, curves"
    )


def _format_curve(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:,.4g}"


def cmd_validate(args: argparse.Namespace) -> int:
    from sim.analysis.validate import layouts_in_both, validation_report
    from sim.analysis.validate_plots import write_overlay_figures
    from sim.results import write_json

    sim_dir, replay_dirs = Path(args.sim_dir), [Path(path) for path in args.replay_dirs]
    sim, replay = read_pair(sim_dir, replay_dirs)
    _note_sources(sim, replay)
    window_s = reorder_window_s(replay_dirs)
    print_validation(sim, replay, window_s)
    out_dir = Path(args.out) if args.out else replay_dirs[0] / "validate"
    report = {
        "sim_dir": str(sim_dir),
        "replay_dirs": [str(path) for path in replay_dirs],
        **validation_report(sim, replay, window_s),
    }
    write_json(out_dir / "validate.json", report)
    layouts = layouts_in_both(sim, replay)
    figures = write_overlay_figures(out_dir / "plots", sim, replay, layouts)
    formats = ", ".join(sorted({path.suffix[1:] for path in figures}))
    print(f"kvsim: validate.json and overlay figures ({', '.join(layouts)}; {formats}) written to {out_dir}/")
    return 0


def _note_sources(sim: dict[str, pd.DataFrame], replay: dict[str, pd.DataFrame]) -> None:
    """A note (not an error: two replays may be compared) when a directory
    holds the other kind of run than its position says."""
    from sim.analysis.validate import SOURCE_REPLAY, SOURCE_SIM, with_source

    for name, frames, expected in (("SIM_DIR", sim, SOURCE_SIM), ("REPLAY_DIR", replay, SOURCE_REPLAY)):
        sources = set(with_source(frames["summary"])["source"])
        if sources != {expected}:
            print(f"kvsim: note: {name} holds source {', '.join(sorted(map(str, sources)))}, not {expected}")
