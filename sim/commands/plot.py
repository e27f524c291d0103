"""``kvsim plot``: the figures of a results or sweep directory."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sim.config import FIGURE_FORMATS, ConfigError

if TYPE_CHECKING:  # pandas and matplotlib cost seconds at start-up: imported where used
    import pandas as pd


def _formats(text: str) -> tuple[str, ...]:
    formats = tuple(part.strip().lower() for part in text.split(",") if part.strip())
    unknown = sorted(set(formats) - {"png", "svg", "pdf"})
    if not formats or unknown:
        raise argparse.ArgumentTypeError(f"expected formats among png,svg,pdf: {text!r}")
    return formats


def sweep_x(sweep: pd.DataFrame, path: Path) -> str:
    """The swept key: the one dotted scenario key that takes several values."""
    dotted = [c for c in sweep.columns if "." in str(c)]
    varying = [c for c in dotted if sweep[c].nunique() > 1] or dotted
    if len(varying) != 1:
        raise ConfigError(f"{path}: cannot tell the swept column among {varying}; pass --x COLUMN")
    return str(varying[0])


def _read(out_dir: Path) -> dict[str, pd.DataFrame]:
    """The frames the manifest lists (a replay lists no steps); one it
    lists that is missing (a directory from an older kvsim) is a one-line
    error too."""
    from sim.analysis.plots import with_panel_columns
    from sim.results import FRAMES, MEASURED_FRAMES, read_manifest, read_results

    listed = read_manifest(out_dir).get("frames", [f"{name}.parquet" for name in FRAMES])
    required = [f"{n}.parquet" for n in FRAMES if n in MEASURED_FRAMES or f"{n}.parquet" in listed]
    missing = [name for name in required if not (out_dir / name).exists()]
    if missing:
        raise ConfigError(f"{out_dir}: incomplete results directory: no {', '.join(missing)}")
    frames = read_results(out_dir)
    if "steps" in frames:
        try:
            with_panel_columns(frames["steps"])
        except ValueError as error:
            raise ConfigError(f"{out_dir / 'steps.parquet'}: {error}") from None
    return frames


def cmd_plot(args: argparse.Namespace) -> int:
    """Standard figures for a results directory, and sweep figures if it
    holds ``sweep.parquet`` (a sweep-only directory needs no manifest)."""
    from sim.analysis.plots import SWEEP_FRAME, write_standard_figures, write_sweep_figures
    from sim.results import add_to_manifest, read_frame, remove_partial_writes

    out_dir = Path(args.results_dir)
    sweep_path = out_dir / SWEEP_FRAME
    written: list[Path] = []
    remove_partial_writes(out_dir / "plots")
    if (out_dir / "manifest.json").exists() or not sweep_path.exists():
        written += write_standard_figures(out_dir, _read(out_dir), args.format)
        add_to_manifest(out_dir, written)
    if sweep_path.exists():
        sweep = read_frame(sweep_path)
        x = args.x or sweep_x(sweep, sweep_path)
        if x not in sweep:
            raise ConfigError(f"{sweep_path}: no column {x!r} (--x)")
        written += write_sweep_figures(out_dir, sweep, x, args.format)
    names = sorted({path.stem for path in written})
    formats = ", ".join(args.format)
    print(f"kvsim: plots written to {out_dir / 'plots'}/ ({', '.join(names)}; {formats})")
    return 0


def register(subparsers: Any) -> None:
    plot = subparsers.add_parser("plot", help="draw the figures of a results directory")
    plot.add_argument(
        "results_dir",
        metavar="RESULTS_DIR",
        help="a directory written by kvsim run, compare, replay or sweep",
    )
    plot.add_argument(
        "--format",
        type=_formats,
        default=FIGURE_FORMATS,
        metavar="FMT[,FMT]",
        help="image formats: png, svg, pdf (default png,svg)",
    )
    plot.add_argument("--x", metavar="COLUMN", help="the swept column of sweep.parquet (default: inferred)")
    plot.set_defaults(func=cmd_plot)
