"""``kvsim conform``: kvsim's scheduler step for step against vLLM's own
``Scheduler`` on the same trace; exit 1 on any difference."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any

from sim.commands.common import add_scenario_argument
from sim.config import MTP_HASH_MODES, ConfigError
from sim.paths import PROJECT_ROOT
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
        "--mtp-hash-mode",
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
    conform.add_argument(
        "--fork",
        type=Path,
        metavar="PATH",
        help="compare kvsim's fork mode with the fork's own Scheduler instead of vLLM's: PATH is a "
        "fork checkout or its combined diff (vLLM 0.30.0 plus its scheduler-side sections, built "
        "once in a cached environment outside the repository; see docs/conformance.md)",
    )
    conform.add_argument(
        "--record",
        type=Path,
        metavar="FILE",
        help="with --fork: write the fork's steps as golden frames (FILE, gzip'd JSON lines)",
    )
    conform.set_defaults(func=cmd_conform)


def cmd_conform(args: argparse.Namespace) -> int:
    from sim.analysis.runs import scenario_workload
    from sim.conformance.driver import run_conformance
    from sim.scenario import EngineSection, load_scenario

    scenario = load_scenario(args.scenario, args.set)
    fork, record = getattr(args, "fork", None), getattr(args, "record", None)
    if record is not None and fork is None:
        raise ConfigError("--record: needs --fork (golden frames are the fork's own steps)")
    if fork is not None:
        return _conform_fork(scenario, args)
    workload = scenario_workload(scenario)
    engine = scenario.engine if args.engine is None else EngineSection(mode=args.engine)
    if engine.batch_queue:
        return _conform_async(scenario, args, workload.requests)
    result = run_conformance(
        scenario, args.layout, workload.requests, mtp_hash_mode=args.mtp_hash_mode, with_fence_effect=True
    )
    comparison = result.comparison
    mtp_hash_mode = args.mtp_hash_mode or scenario.scheduler.mtp_hash_mode
    print(
        f"kvsim conform: {scenario.name}, layout {args.layout}, MTP hashing {mtp_hash_mode}, fenced frees off"
    )
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

    comparison = run_async_conformance(scenario, args.layout, requests, mtp_hash_mode=args.mtp_hash_mode)
    mtp_hash_mode = args.mtp_hash_mode or scenario.scheduler.mtp_hash_mode
    print(
        f"kvsim conform --engine async: {scenario.name}, layout {args.layout}, MTP hashing {mtp_hash_mode}, "
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


# ----------------------------------------------------------------- --fork
def _conform_fork(scenario: Any, args: argparse.Namespace) -> int:
    from sim.analysis.runs import scenario_workload
    from sim.conformance.driver import compare
    from sim.conformance.fork_conformance import fork_trajectory, kvsim_trajectory
    from sim.conformance.fork_venv import combined_diff, fork_python, scheduler_sections

    _refuse_unsupported(scenario, args)
    diff = combined_diff(args.fork)
    sections = scheduler_sections(diff)
    python = fork_python(args.fork)
    workload = scenario_workload(scenario)
    requests, until_s = workload.requests, workload.follow_ups_until_s
    engine = args.engine or "sync"
    fork, built = fork_trajectory(scenario, args.layout, requests, python, until_s, engine)
    kvsim = kvsim_trajectory(scenario, args.layout, requests, None, until_s, engine)
    comparison = compare(kvsim, fork)
    how = (
        "synchronous engine (both schedulers stepped one call at a time)"
        if engine == "sync"
        else f"async engine (the fork's batch queue of {built['max_concurrent_batches']} over its "
        f"{built['scheduler']}, one record per engine call)"
    )
    print(f"kvsim conform --fork: {scenario.name}, layout {args.layout}, {how}")
    print(f"  fork: vLLM 0.30.0 + {len(sections)} scheduler-side files of {diff} (blob ids checked)")
    print(
        f"  fork's pool: {built['num_blocks']} blocks of {built['block_size']} tokens, hash unit "
        f"{built['hash_block_size']}, fenced frees {_on(built['defer_block_free'])}, "
        f"grace pins {_on(built['enable_grace_pins'])}, waiter pins "
        f"{_on(built['max_pinned_waiters'] > 0)}"
    )
    if args.record is not None:
        from sim.conformance.golden import write_golden

        write_golden(args.record, _golden_header(args, scenario, sections), fork)
        print(f"  golden frames of the fork's {len(fork.steps)} steps written to {args.record}")
    print(
        f"identical steps: {comparison.num_identical_steps} of {comparison.num_steps} "
        f"({100 * comparison.identical_share:.1f} %) (kvsim {len(comparison.left.steps)} steps, "
        f"fork {len(comparison.right.steps)})"
    )
    if comparison.conforms:
        print("conforms: every step identical")
        return 0
    _print_difference(comparison)
    return 1


def _refuse_unsupported(scenario: Any, args: argparse.Namespace) -> None:
    from sim.conformance.fork_backend import fork_pin_switches

    fork_pin_switches(scenario)  # a fork switch the fork's side cannot run: one line
    if args.mtp_hash_mode == "lookahead":
        raise ConfigError(
            "--fork --mtp-hash-mode lookahead: the fork hashes with the EAGLE drop only "
            "(its hasher has no lookahead)"
        )


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def _golden_header(args: argparse.Namespace, scenario: Any, sections: list[Any]) -> dict[str, Any]:
    """The recording's provenance and the resolved scenario it ran (every
    key, so a later edit of the scenario file or its defaults changes no
    replay; paths inside the project kept relative to it)."""
    from sim.scenario import scenario_to_dict

    overrides = list(args.set or ())
    scenario_file = _project_relative(Path(args.scenario).resolve())
    command = ["kvsim", "conform", scenario_file, "--fork", "FORK", "--layout", args.layout]
    command += ["--engine", args.engine] if args.engine else []
    command += [item for override in overrides for item in ("--set", override)]
    record = scenario_to_dict(scenario)
    record["model"], record["base_dir"] = (
        _project_relative(Path(record["model"])),
        _project_relative(Path(record["base_dir"])),
    )
    return {
        "scenario_file": scenario_file,
        "overrides": overrides,
        "scenario": record,
        "layout": args.layout,
        "engine": args.engine or "sync",
        "fork_files": {s.path: [s.old_blob, s.new_blob] for s in sections},
        "command": " ".join(shlex.quote(part) for part in [*command, "--record", str(args.record)]),
    }


def _project_relative(path: Path) -> str:
    try:
        return str(path.relative_to(PROJECT_ROOT))
    except ValueError:
        return str(path)


def _print_difference(comparison: Any) -> None:
    """The first differing step's columns, both sides' state there and the
    step before it (identical on both sides), then where the differing fork
    state is twinned (``sim/fork/``)."""
    from sim.conformance.backends import fork_state_twins

    step = comparison.first_difference
    if step is not None and step > 1:
        before = comparison.state(comparison.left, step - 1)
        print(f"step {step - 1} (identical on both sides):")
        for name, value in vars(before).items():
            print(f"    {name}: {_short(value)}")
    _print_first_difference(comparison)
    if step is not None and "fork_state" in comparison.differing_fields(step):
        kvsim, fork = (comparison.state(t, step) for t in (comparison.left, comparison.right))
        for line in fork_state_twins(kvsim.fork_state, fork.fork_state):
            print(f"  fork state {line}")
