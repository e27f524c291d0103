"""``kvsim replay`` (trace replay): the requests ``kvsim run`` simulates, sent to a live
server (``--url``, or one it starts with ``--launch``), into the same frames."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

from sim.commands.common import CLIError, add_scenario_argument
from sim.scenario import add_override_argument


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "replay", help="send a scenario's requests to a live server (vLLM or kvsim serve) into frames"
    )
    add_scenario_argument(parser, default=None)
    add_override_argument(parser)
    parser.add_argument("--layout", choices=["on", "off"], required=True)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    target.add_argument(
        "--launch", action="store_true", help="start the server for this layout, stop it after"
    )
    parser.add_argument(
        "--out", metavar="DIR", help="results directory (default results/SCENARIO-replay-LAYOUT)"
    )
    parser.add_argument("--model", metavar="PATH", help="weights for vllm serve (--launch)")
    parser.add_argument("--server-cmd", metavar="CMD", help="replaces 'vllm serve ...' ({port}: the port)")
    parser.add_argument("--vocab-size", type=int, metavar="N", help="map prompt token ids below N")
    parser.add_argument(
        "--speed",
        type=float,
        default=1.0,
        metavar="X",
        help="scenario seconds per wall second (kvsim serve --speed)",
    )
    parser.add_argument(
        "--boot-timeout", type=float, default=1800.0, metavar="S", help="wall seconds for /health"
    )
    parser.add_argument(
        "--request-timeout", type=float, default=3600.0, metavar="S", help="wall seconds per request"
    )
    parser.add_argument(
        "--drain-timeout", type=float, default=30.0, metavar="S", help="after Ctrl-C, for requests in flight"
    )
    parser.set_defaults(func=cmd_replay)


def _check_args(args: argparse.Namespace) -> None:
    if args.launch and not (args.model or args.server_cmd):
        raise CLIError("--launch needs --model PATH (the weights for vllm serve) or --server-cmd")
    if not args.launch and (args.model or args.server_cmd):
        raise CLIError("--model and --server-cmd go with --launch")
    for flag in ("speed", "boot_timeout", "request_timeout", "drain_timeout"):
        if not getattr(args, flag) > 0:
            raise CLIError(f"--{flag.replace('_', '-')}: expected > 0, got {getattr(args, flag)}")
    if args.vocab_size is not None and args.vocab_size < 2:
        raise CLIError(f"--vocab-size: expected >= 2, got {args.vocab_size}")


def _warn(message: str) -> None:
    print(f"kvsim: warning: {message}", file=sys.stderr, flush=True)


def cmd_replay(args: argparse.Namespace) -> int:
    from sim.analysis.runs import open_loop_workload
    from sim.engine_assembly import plan_for
    from sim.scenario import load_scenario

    _check_args(args)
    scenario = load_scenario(args.scenario, args.set)
    workload = open_loop_workload(scenario, "kvsim replay")
    plan = plan_for(scenario, args.layout)
    out_dir = Path(args.out) if args.out else Path("results") / f"{scenario.name}-replay-{args.layout}"
    return asyncio.run(_replay(args, scenario, workload, plan.to_dict(), out_dir))


async def _replay(
    args: argparse.Namespace, scenario: Any, workload: Any, plan: dict[str, Any], out_dir: Path
) -> int:
    from sim.serving.client import ClientConfig, Replay, ServerUnreachable
    from sim.serving.launch import LaunchedServer, LaunchError

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    server: LaunchedServer | None = None
    try:
        url, server = await _start_server(args, scenario, out_dir, stop) if args.launch else (args.url, None)
        boot = _check_boot(server, plan) if server else None
        config = ClientConfig(
            base_url=url.rstrip("/"),
            speed=args.speed,
            sample_interval_s=scenario.simulation.sample_interval_s,
            vocab_size=args.vocab_size,
            request_timeout_s=args.request_timeout,
            drain_timeout_s=args.drain_timeout,
        )
        print(
            f"kvsim: replaying {workload.num_requests} requests of {scenario.name} [{args.layout}] to {url}"
        )
        outcome = await Replay(workload.requests, config, _warn).run(stop)
        if server is not None and server.exited():
            outcome.server_lost = True
    except ServerUnreachable as error:
        raise CLIError(str(error)) from None
    except LaunchError as error:
        raise CLIError(str(error)) from None
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        if server is not None:
            status = server.stop()
            print(f"kvsim: server stopped (exit status {status}); log: {server.log_path}")
    _write(out_dir, scenario, args, plan, outcome, boot, url)
    return 0 if outcome.ran_to_end else 1


async def _start_server(
    args: argparse.Namespace, scenario: Any, out_dir: Path, stop: asyncio.Event
) -> tuple[str, Any]:
    from sim.serving.launch import LaunchedServer, custom_command, free_port, server_env, vllm_serve_command

    port = free_port()
    command = (
        custom_command(args.server_cmd, port)
        if args.server_cmd
        else vllm_serve_command(scenario, args.model, port)
    )
    server = LaunchedServer(command, server_env(scenario, args.layout), out_dir / f"server-{args.layout}.log")
    url = f"http://127.0.0.1:{port}"
    print(f"kvsim: starting {' '.join(command)}")
    try:
        await server.wait_healthy(url, args.boot_timeout, stop)
    except BaseException:
        server.stop()
        raise
    return url, server


def _check_boot(server: Any, plan: dict[str, Any]) -> Any:
    from sim.serving.launch import check_boot_log

    boot = check_boot_log(server.log_text(), plan)
    for mismatch in boot.mismatches:
        print(
            f"kvsim: POOL PLAN MISMATCH: {mismatch}: the server is not the deployment kvsim modelled",
            file=sys.stderr,
        )
    return boot


def _write(
    out_dir: Path,
    scenario: Any,
    args: argparse.Namespace,
    plan: dict[str, Any],
    outcome: Any,
    boot: Any,
    url: str,
) -> None:
    from sim.results import write_results
    from sim.scenario import scenario_to_dict
    from sim.serving.recording import replay_frames

    check = "unchecked" if boot is None else ("mismatch" if boot.mismatches else "ok")
    frames = replay_frames(
        outcome,
        scenario=scenario.name,
        layout=args.layout,
        plan=plan,
        extra_summary={"pool_plan_check": check, "complete": outcome.ran_to_end},
    )
    extra = {
        "source": "replay",
        "complete": outcome.ran_to_end,
        "interrupted": outcome.interrupted,
        "server_lost": outcome.server_lost,
        "url": url,
        "speed": args.speed,
        "layout": args.layout,
        "pool_plan_check": check,
        **(boot.to_dict() if boot else {}),
        "warnings": outcome.warnings,
    }
    write_results(out_dir, frames, scenario_to_dict(scenario), manifest_extra=extra)
    requests = frames["requests"]
    print(
        f"kvsim: {int(requests['finished'].sum())} of {len(requests)} requests finished, "
        f"{int(requests['rejected'].sum())} failed; frames written to {out_dir}/ (requests, samples, summary)"
        + ("" if outcome.ran_to_end else " -- INCOMPLETE run")
    )
