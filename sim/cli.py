"""The ``kvsim`` command line.

Every command validates its input before doing any work and reports bad input
as one line on stderr with exit status 2; nothing is written on failure.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from sim.config import ConfigError, DeploymentConfig, ModelConfig, load_model, validate
from sim.paths import DEFAULT_MODEL
from sim.scenario import Layout, add_override_argument


class CLIError(ValueError):
    """Bad command-line input."""


def _bytes(text: str) -> int:
    """``4.1e9`` or ``4100000000`` -> 4100000000."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r}") from None
    if value != int(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"not a positive whole byte count: {text!r}")
    return int(value)


def _partition(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer counts: {text!r}") from None


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="model description (YAML)")
    parser.add_argument("--ssm-dtype", choices=["fp32", "fp16"], help="SSM state dtype (overrides the model)")
    parser.add_argument(
        "--kv-cache-memory", type=_bytes, metavar="BYTES", help="KV pool bytes per rank (e.g. 4.1e9)"
    )
    parser.add_argument("--max-model-len", type=int, metavar="TOKENS")
    parser.add_argument("--max-num-seqs", type=int, metavar="N")
    parser.add_argument("--tensor-parallel-size", "--tp", type=int, metavar="N")
    parser.add_argument("--pipeline-parallel-size", "--pp", type=int, metavar="N")
    parser.add_argument("--layer-partition", type=_partition, metavar="A,B", help="layers per PP stage")
    parser.add_argument("--kv-cache-layout", choices=["BLNHC", "BLHNC", "LBNHC", "LBHNC"])
    parser.add_argument(
        "--kv-connector", action="store_true", default=None, help="a KV connector is configured"
    )


_DEPLOYMENT_FLAGS = {
    "kv_cache_memory": "kv_cache_memory_bytes",
    "max_model_len": "max_model_len",
    "max_num_seqs": "max_num_seqs",
    "tensor_parallel_size": "tensor_parallel_size",
    "pipeline_parallel_size": "pipeline_parallel_size",
    "layer_partition": "layer_partition",
    "kv_cache_layout": "kv_cache_layout",
    "kv_connector": "kv_connector",
}


def model_and_deployment(args: argparse.Namespace) -> tuple[ModelConfig, DeploymentConfig]:
    model = load_model(args.model)
    if args.ssm_dtype:
        model = model.model_copy(update={"ssm_state_dtype": args.ssm_dtype})
    overrides = {
        key: getattr(args, flag) for flag, key in _DEPLOYMENT_FLAGS.items() if getattr(args, flag) is not None
    }
    if "pipeline_parallel_size" in overrides and "layer_partition" not in overrides:
        raise CLIError("--pipeline-parallel-size needs --layer-partition (layers per stage)")
    deployment = validate(DeploymentConfig, overrides, "command line")
    return model, deployment


def cmd_layout(args: argparse.Namespace) -> int:
    model, deployment = model_and_deployment(args)
    from sim.layout import format_plan, plan_kv_cache
    from sim.vllm_bridge import vllm_info

    wanted = {"both": (False, True), "on": (True,), "off": (False,)}[args.layout]
    plans = {("on" if on else "off"): plan_kv_cache(model, deployment, side_cache_layout=on) for on in wanted}
    if args.json:
        print(json.dumps({name: plan.to_dict() for name, plan in plans.items()}, indent=2))
        return 0
    print(
        f"kvsim layout: {model.name} (SSM state {model.ssm_state_dtype}) on "
        f"TP{deployment.tensor_parallel_size} x PP{deployment.pipeline_parallel_size}, "
        f"{deployment.kv_cache_memory_bytes:,} B per rank,"
        f" max_model_len {deployment.max_model_len:,}, max_num_seqs {deployment.max_num_seqs}"
    )
    print(f"  {vllm_info().describe()}")
    for plan in plans.values():
        print("\n".join(format_plan(plan, deployment)))
    if len(plans) == 2:
        off, on = plans["off"].kv_cache_tokens, plans["on"].kv_cache_tokens
        print(f"gain: {on - off:+,} tokens ({(on - off) / off:+.2%}) at the same pool")
    return 0


def _format_number(value: float) -> str:
    """Counts as integers, rates and seconds with three decimals."""
    if value != value:  # NaN
        return "-"
    if float(value).is_integer():
        return f"{value:,.0f}"
    return f"{value:,.3f}"


def _print_summary(result) -> None:
    table = result.comparison().astype(float)
    print(table.to_string(formatters={column: _format_number for column in table.columns}))


def _run_and_write(args: argparse.Namespace, layouts: tuple[Layout, ...] | None) -> int:
    from sim.scenario import load_scenario, scenario_to_dict

    scenario = load_scenario(args.scenario, args.set)
    out_dir = Path(args.out) if args.out else Path("results") / scenario.name
    from sim.analysis.runs import run_scenario
    from sim.results import write_results

    result = run_scenario(scenario, layouts, progress=sys.stderr.isatty() or args.progress)
    write_results(out_dir, result.frames(), scenario_to_dict(scenario))
    print(
        f"kvsim: {scenario.name}: {len(result.requests) // max(len(result.summary), 1)} requests per layout"
    )
    _print_summary(result)
    from sim.analysis.plots import write_standard_figures

    figures = write_standard_figures(out_dir, result.frames())
    print(f"frames written to {out_dir}/ (steps, requests, samples, summary: parquet)")
    print(
        f"figures written to {out_dir / 'plots'}/ ({len(figures)} files: "
        f"{', '.join(sorted({p.stem for p in figures}))})"
    )
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    return _run_and_write(args, (args.layout,))


def cmd_compare(args: argparse.Namespace) -> int:
    return _run_and_write(args, ("off", "on"))


def cmd_bench(args: argparse.Namespace) -> int:
    from sim.bench import format_bench, run_bench
    from sim.scenario import load_scenario

    load_scenario(args.scenario, args.set)  # bad input fails here, in this process
    layouts = tuple(args.layouts.split(","))
    if not set(layouts) <= {"off", "on"}:
        raise CLIError(f"--layouts {args.layouts!r}: expected a comma-separated subset of off,on")
    print(format_bench(args.scenario, run_bench(args.scenario, args.set, layouts)))
    return 0


def _add_scenario_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "scenario",
        nargs="?",
        default="default",
        help="a scenario file, or the name of one in scenarios/ (default: default)",
    )
    add_override_argument(parser)
    parser.add_argument("--out", metavar="DIR", help="results directory (default results/SCENARIO)")
    parser.add_argument(
        "--progress", action="store_true", help="show a progress bar even when not on a terminal"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvsim", description="Simulate vLLM's KV-cache block allocation under the fork's two layouts."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    layout = sub.add_parser("layout", help="the KV pool each layout gives, as the fork logs it at boot")
    _add_model_flags(layout)
    layout.add_argument("--layout", choices=["both", "on", "off"], default="both")
    layout.add_argument("--json", action="store_true", help="one JSON object with keys off and on")
    layout.set_defaults(func=cmd_layout)

    run = sub.add_parser("run", help="simulate a scenario under one layout")
    _add_scenario_flags(run)
    run.add_argument("--layout", choices=["on", "off"], default="on")
    run.set_defaults(func=cmd_run)

    compare = sub.add_parser("compare", help="simulate a scenario under both layouts and compare")
    _add_scenario_flags(compare)
    compare.set_defaults(func=cmd_compare)

    bench = sub.add_parser("bench", help="simulator speed and memory, per layout (prints figures)")
    bench.add_argument("scenario", nargs="?", default="default")
    add_override_argument(bench)
    bench.add_argument("--layouts", default="off,on")
    bench.set_defaults(func=cmd_bench)

    from sim.analysis import gates, plots, sweep_cli

    plots.register_cli(sub)
    gates.register_cli(sub)
    sweep_cli.register_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (ConfigError, CLIError) as error:
        print(f"kvsim: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvsim: interrupted", file=sys.stderr)
        return 130


def run(argv: Any = None) -> None:
    sys.exit(main(argv))


if __name__ == "__main__":
    run()
