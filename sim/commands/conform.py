"""``kvsim conform``: kvsim's scheduler step for step against vLLM's own
``Scheduler`` on the same trace; exit 1 on any difference."""

from __future__ import annotations

import argparse
from typing import Any

from sim.commands.common import add_scenario_argument
from sim.config import MTP_HASH_MODES
from sim.scenario import add_override_argument


def register(subparsers: Any) -> None:
    conform = subparsers.add_parser(
        "conform", help="compare kvsim's scheduler with vLLM's own Scheduler, step by step"
    )
    add_scenario_argument(conform, default=None)
    add_override_argument(conform)
    conform.add_argument(
        "--layout", choices=["off", "on"], default="on", help="side-cache layout (default on)"
    )
    conform.add_argument(
        "--mode",
        choices=MTP_HASH_MODES,
        help="MTP block hashing (default: the scenario's scheduler.mtp_hash_mode)",
    )
    conform.add_argument(
        "--engine",
        choices=["sync", "async"],
        help="engine loop: sync (vLLM's Scheduler, one step at a time) or async (vLLM's "
        "EngineCore.step_with_batch_queue over its AsyncScheduler, PP + 1 in flight; "
        "default: the scenario's engine.mode)",
    )
    conform.set_defaults(func=cmd_conform)


def cmd_conform(args: argparse.Namespace) -> int:
    from sim.analysis.runs import scenario_workload
    from sim.conformance.driver import run_conformance
    from sim.scenario import load_scenario

    scenario = load_scenario(args.scenario, args.set)
    workload = scenario_workload(scenario)
    if (args.engine or scenario.engine.mode) == "async":
        return _conform_async(scenario, args, workload.requests)
    result = run_conformance(scenario, args.layout, workload.requests, mode=args.mode, with_fence_effect=True)
    comparison = result.comparison
    mode = args.mode or scenario.scheduler.mtp_hash_mode
    print(f"kvsim conform: {scenario.name}, layout {args.layout}, MTP hashing {mode}, fenced frees off")
    print(f"  kvsim: {_hashing(result.kvsim_hashing)}")
    print(f"  vllm:  {_hashing(result.vllm_hashing)}")
    print(
        f"identical steps: {comparison.num_identical_steps} of {comparison.num_steps} "
        f"({100 * comparison.identical_share:.1f} %)"
        f" (kvsim {len(comparison.left.steps)} steps, vllm {len(comparison.right.steps)})"
    )
    if result.fence is not None:
        _print_fence(result.fence)
    if comparison.conforms:
        print("conforms: every step identical")
        return 0
    _print_first_difference(comparison)
    return 1


def _conform_async(scenario: Any, args: argparse.Namespace, requests: Any) -> int:
    from sim.conformance.async_engine import max_concurrent_batches, run_async_conformance

    comparison = run_async_conformance(scenario, args.layout, requests, mode=args.mode)
    mode = args.mode or scenario.scheduler.mtp_hash_mode
    print(
        f"kvsim conform --engine async: {scenario.name}, layout {args.layout}, MTP hashing {mode}, "
        f"{max_concurrent_batches(scenario)} micro-batches in flight, fenced frees off"
    )
    print(
        f"identical engine steps: {comparison.num_identical_steps} of {comparison.num_steps} "
        f"({100 * comparison.identical_share:.1f} %)"
        f" (kvsim {len(comparison.left.steps)} steps, vllm {len(comparison.right.steps)})"
    )
    if comparison.conforms:
        print("conforms: every engine step identical")
        return 0
    _print_first_difference(comparison)
    return 1


def _hashing(hashing: Any) -> str:
    return (
        f"use_eagle_block_drop={hashing.use_eagle_block_drop} "
        f"num_hash_lookahead_tokens={hashing.num_hash_lookahead_tokens} "
        f"num_prefill_lookahead_tokens={hashing.num_prefill_lookahead_tokens}"
    )


def _print_fence(fence: Any) -> None:
    first = fence.first_difference
    where = f"first at step {first}" if first else "none"
    left, right = fence.left.steps, fence.right.steps
    min_free = (min((s.num_free_blocks for s in steps), default=0) for steps in (left, right))
    print(
        f"fenced frees (kvsim only, the fork's setting): {fence.num_steps - fence.num_identical_steps} "
        f"of {fence.num_steps} steps change ({where}); steps {len(left)} -> {len(right)}; "
        "min free blocks {} -> {}".format(*min_free)
    )


def _print_first_difference(comparison: Any) -> None:
    step = comparison.first_difference
    if step is None:  # same steps, but one backend stalled
        print(f"differs: stalled kvsim={comparison.left.stalled} vllm={comparison.right.stalled}")
        return
    print(f"first difference at step {step}: {', '.join(comparison.differing_fields(step))}")
    for trajectory in (comparison.left, comparison.right):
        state = comparison.state(trajectory, step)
        print(f"  {trajectory.backend}:")
        if state is None:
            print("    (no such step)")
            continue
        for name, value in vars(state).items():
            print(f"    {name}: {_short(value)}")


def _short(value: Any, limit: int = 12) -> str:
    if isinstance(value, tuple) and len(value) > limit:
        return f"{list(value[:limit])} ... ({len(value)} in all)"
    return str(list(value) if isinstance(value, tuple) else value)
