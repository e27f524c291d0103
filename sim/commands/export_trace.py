"""``kvsim export-trace``: a scenario's requests as vLLM's ``timed_trace``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from sim.commands.common import add_scenario_argument
from sim.scenario import add_override_argument


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "export-trace",
        help="write a scenario's requests as vLLM's timed_trace JSON lines (vllm bench serve)",
    )
    add_scenario_argument(parser)
    add_override_argument(parser)
    parser.add_argument(
        "--out", metavar="FILE", help="output file (default results/SCENARIO.timed_trace.jsonl)"
    )
    parser.set_defaults(func=cmd_export_trace)


def cmd_export_trace(args: argparse.Namespace) -> int:
    from sim.analysis.runs import open_loop_workload
    from sim.config import ConfigError
    from sim.results import write_text
    from sim.scenario import load_scenario
    from sim.workloads.interchange import chunk_tokens_of, timed_trace_lines

    scenario = load_scenario(args.scenario, args.set)
    workload = open_loop_workload(scenario, "a timed trace")
    try:
        chunk_tokens = chunk_tokens_of(workload.requests)
    except ValueError as error:
        raise ConfigError(f"{scenario.name}: {error}") from None
    out = Path(args.out) if args.out else Path("results") / f"{scenario.name}.timed_trace.jsonl"
    write_text(out, "\n".join(timed_trace_lines(workload)) + "\n")
    print(f"kvsim: {scenario.name}: {workload.num_requests} requests written to {out}")
    print(
        f"  replay: vllm bench serve --dataset-name timed_trace --dataset-path {out} "
        f"--timed-trace-chunk-hash-size {chunk_tokens} --num-prompts {workload.num_requests}"
    )
    print(f"  simulate: workload: {{trace: {out}, format: timed_trace, hash_chunk_tokens: {chunk_tokens}}}")
    return 0
