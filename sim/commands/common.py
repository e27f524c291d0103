"""Flags and printing shared by several commands."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from sim.config import ConfigError, DeploymentConfig, ModelConfig, load_model, validate
from sim.paths import DEFAULT_MODEL
from sim.scenario import add_override_argument

if TYPE_CHECKING:  # pandas costs a second at start-up; only printing needs it
    import pandas as pd


class CLIError(ConfigError):
    """Bad command-line input (reported like any bad input: one line, exit 2)."""


def byte_count(text: str) -> int:
    """``4.1e9`` or ``4100000000`` -> 4100000000."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")) or value != int(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"not a positive whole byte count: {text!r}")
    return int(value)


def layer_partition(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer counts: {text!r}") from None


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="model description (YAML)")
    parser.add_argument("--ssm-dtype", choices=["fp32", "fp16"], help="SSM state dtype (overrides the model)")
    parser.add_argument(
        "--kv-cache-memory", type=byte_count, metavar="BYTES", help="KV pool bytes per rank (e.g. 4.1e9)"
    )
    parser.add_argument("--max-model-len", type=int, metavar="TOKENS")
    parser.add_argument("--max-num-seqs", type=int, metavar="N")
    parser.add_argument("--tensor-parallel-size", "--tp", type=int, metavar="N")
    parser.add_argument("--pipeline-parallel-size", "--pp", type=int, metavar="N")
    parser.add_argument("--layer-partition", type=layer_partition, metavar="A,B", help="layers per PP stage")
    parser.add_argument("--kv-cache-layout", choices=["BLNHC", "BLHNC", "LBNHC", "LBHNC"])
    parser.add_argument(
        "--kv-connector", action="store_true", default=None, help="a KV connector is configured"
    )
    parser.add_argument(
        "--block-size", type=int, metavar="TOKENS", help="force the attention block size (vLLM --block-size)"
    )
    parser.add_argument(
        "--prefix-match-unit", type=int, metavar="TOKENS", help="prefix-hit grid inside a block (vLLM's)"
    )
    parser.add_argument(
        "--use-replayssm",
        action="store_true",
        default=None,
        help="RecoverSSM GDN/PLE states with MTP (the fork's v2.5.1 flag)",
    )


# Flag attribute -> DeploymentConfig field.
_DEPLOYMENT_FLAGS = {
    "kv_cache_memory": "kv_cache_memory_bytes",
    "max_model_len": "max_model_len",
    "max_num_seqs": "max_num_seqs",
    "tensor_parallel_size": "tensor_parallel_size",
    "pipeline_parallel_size": "pipeline_parallel_size",
    "layer_partition": "layer_partition",
    "kv_cache_layout": "kv_cache_layout",
    "kv_connector": "kv_connector",
    "block_size": "block_size",
    "prefix_match_unit": "prefix_match_unit",
    "use_replayssm": "use_replayssm",
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


# The main job's scenario (``kvsim run`` and ``compare``): the fork's own agent
# bench, closed loop. Commands that send requests at fixed times (serve,
# replay, export-trace) or time the simulator (bench) default to the chat
# slice, open loop: kvsim's default scenario before the agent bench.
MAIN_SCENARIO = "agent-sessions"
OPEN_LOOP_SCENARIO = "chat-slice"


def add_scenario_argument(
    parser: argparse.ArgumentParser, *, default: str | None = OPEN_LOOP_SCENARIO
) -> None:
    if default is None:
        parser.add_argument("scenario", help="a scenario file, or the name of one in scenarios/")
        return
    parser.add_argument(
        "scenario",
        nargs="?",
        default=default,
        help=f"a scenario file, or the name of one in scenarios/ (default: {default})",
    )


def add_scenario_flags(parser: argparse.ArgumentParser) -> None:
    """The scenario, ``--set``, ``--out`` and ``--progress``: run and compare."""
    add_scenario_argument(parser, default=MAIN_SCENARIO)
    add_override_argument(parser)
    parser.add_argument("--out", metavar="DIR", help="results directory (default results/SCENARIO)")
    add_progress_flag(parser)


def add_progress_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--progress", action="store_true", help="a progress bar even off a terminal")


def format_number(value: float) -> str:
    """Counts as integers, rates and seconds with three decimals."""
    if value != value:  # NaN
        return "-"
    if float(value).is_integer():
        return f"{value:,.0f}"
    return f"{value:,.3f}"


def print_table(table: pd.DataFrame) -> None:
    table = table.astype(float)
    print(table.to_string(formatters={column: format_number for column in table.columns}))
