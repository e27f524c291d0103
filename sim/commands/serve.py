"""``kvsim serve``: an OpenAI-compatible HTTP server whose engine is the
simulator in (scaled) real time, on 127.0.0.1."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from sim.commands.common import add_scenario_argument
from sim.scenario import add_override_argument


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve /v1/completions, /v1/chat/completions and /metrics from the simulator in real time "
        "(127.0.0.1)",
    )
    add_scenario_argument(parser)
    add_override_argument(parser)
    parser.add_argument("--layout", choices=["on", "off"], default="on")
    parser.add_argument("--host", choices=["127.0.0.1"], default="127.0.0.1", help="loopback only")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--speed", type=float, default=1.0, metavar="X", help="simulated seconds per wall second (default 1)"
    )
    parser.set_defaults(func=cmd_serve)


def boot_log_lines(plan: Any, max_model_len: int) -> list[str]:
    """The lines vLLM and the fork log at boot, as ``kvsim replay --launch``
    parses them (vllm/v1/core/kv_cache_utils.py: update_kv_cache_capacity;
    the fork's _apply_side_cache_layout)."""
    notes = "".join(f"; {note}" for note in plan.notes)
    return [
        f"INFO kvsim serve: GPU KV cache size: {plan.kv_cache_tokens:,} tokens, Maximum concurrency for "
        f"{max_model_len:,} tokens per request: {plan.max_concurrency:.2f}x",
        f"INFO kvsim serve: Side-cache layout: {'on' if plan.applied else 'off'} "
        f"(VLLM_E2_SIDE_CACHE_LAYOUT){notes}",
    ]


def cmd_serve(args: argparse.Namespace) -> int:
    from sim.commands.common import CLIError
    from sim.scenario import load_scenario
    from sim.serving.live_engine import LiveEngine
    from sim.serving.server import build_app, serve

    if not args.speed > 0:
        raise CLIError(f"--speed: expected > 0, got {args.speed}")
    if not 0 <= args.port < 65536:
        raise CLIError(f"--port: expected 0..65535, got {args.port}")
    scenario = load_scenario(args.scenario, args.set)
    engine = LiveEngine(scenario, args.layout, speed=args.speed)
    for line in boot_log_lines(engine.sim.plan, scenario.deployment.max_model_len):
        print(line, flush=True)
    print(
        f"INFO kvsim serve: {scenario.name} [{args.layout}] model {engine.model_name} "
        f"at speed {args.speed:g}x on http://{args.host}:{args.port}",
        flush=True,
    )
    asyncio.run(
        serve(
            build_app(engine),
            args.host,
            args.port,
            lambda text: print(f"INFO kvsim serve: {text}", flush=True),
        )
    )
    lag = (
        f"; the engine fell {engine.max_lag_s:.3f} simulated s behind at worst"
        if engine.max_lag_s > 0.01
        else ""
    )
    print(f"INFO kvsim serve: stopped{lag}", file=sys.stderr, flush=True)
    return 0
