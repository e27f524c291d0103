"""``kvsim replay-pool``: the simulated block tables written into one rank's
real KV pool (torch, CPU or CUDA), every page checked against its owner."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from sim.commands.common import add_scenario_argument, byte_count
from sim.scenario import add_override_argument


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "replay-pool",
        help="replay a simulation's block tables into one rank's real KV pool and verify every page",
    )
    add_scenario_argument(parser, default=None)
    parser.add_argument("--layout", choices=["off", "on"], default="on")
    parser.add_argument(
        "--device", default="cpu", help="where the pool is allocated: cpu, cuda or cuda:N (default cpu)"
    )
    parser.add_argument("--rank", type=int, default=0, help="the rank whose pool is replayed (default 0)")
    parser.add_argument(
        "--pool-bytes",
        type=byte_count,
        metavar="B",
        help="KV pool bytes per rank (default: the scenario's; capped on the cpu)",
    )
    add_override_argument(parser)
    parser.add_argument("--summary-only", action="store_true", help="no per-step lines")
    parser.set_defaults(func=cmd_replay_pool)


def cmd_replay_pool(args: argparse.Namespace) -> int:
    from sim.analysis.runs import scenario_workload
    from sim.pool_replay import PoolCorruption, pool_bytes_for, replay_pool, resolve_device, with_pool_bytes
    from sim.scenario import load_scenario

    device = resolve_device(args.device)
    scenario = load_scenario(args.scenario, args.set)
    pool_bytes, note = pool_bytes_for(device, args.pool_bytes, scenario.deployment.kv_cache_memory_bytes)
    if note:
        print(f"kvsim replay-pool: {note}")
    scenario = with_pool_bytes(scenario, pool_bytes)
    try:
        report = replay_pool(
            scenario, args.layout, scenario_workload(scenario), rank=args.rank, device=device
        )
    except PoolCorruption as corruption:
        print(f"kvsim: replay-pool: CORRUPTION: {corruption}", file=sys.stderr)
        return 1
    print(
        f"kvsim replay-pool: {report.scenario} [{report.layout}] rank {report.rank} on {report.device}: "
        f"{report.num_blocks} blocks x {report.block_stride_bytes:,} B = {report.pool_bytes:,} B"
    )
    if not args.summary_only:
        print(f"{'step':>6} {'time_s':>10} {'bytes_written':>14} {'bytes_verified':>15} {'GB/s':>8}")
        for row in report.step_rows():
            print(
                f"{row['step']:>6} {row['time_s']:>10.3f} {row['bytes_written']:>14,} "
                f"{row['bytes_verified']:>15,} {row['gb_per_s']:>8.3f}"
            )
    counts = report.counts
    print(
        f"verified clean: {len(report.steps)} steps, {counts['num_requests']} requests, "
        f"{counts.get('frees_verified', 0)} frees, {counts.get('prefix_hits_verified', 0)} prefix hits, "
        f"{counts.get('fences_verified', 0)} fences, {counts.get('ring_slots_zeroed', 0)} ring slots zeroed, "
        f"{counts['num_preemptions']} preemptions, up to {counts['max_ring_slots_sharing_a_block']} rings "
        "in one pool block"
    )
    print(
        f"bytes written {report.bytes_written:,}, verified {report.bytes_verified:,}; "
        f"{report.gb_per_s:.3f} GB/s in {report.replay_s:.2f} s of replay, "
        f"{report.steps_per_s:.1f} steps/s over {report.wall_s:.2f} s"
    )
    return 0
