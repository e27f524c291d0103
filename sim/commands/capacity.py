"""``kvsim capacity``: what each layout holds at once, session by session
(with and without MTP), and the largest ``--max-num-seqs`` a scenario holds
without preemption or a growing queue."""

from __future__ import annotations

import argparse
from typing import Any

from sim.commands.common import MAIN_SCENARIO, CLIError, add_override_argument
from sim.scenario import SideCacheSwitch

# The fork's published residency lengths (its README, "The KV budget").
DEFAULT_SESSION_TOKENS = (131_072, 262_144)
MAX_CAP = 256
LAYOUTS: tuple[SideCacheSwitch, ...] = ("off", "on")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "capacity",
        help="sessions of L tokens resident at once per layout; the largest max_num_seqs that holds",
    )
    parser.add_argument(
        "scenario",
        nargs="?",
        default=MAIN_SCENARIO,
        help=f"its deployment sets the pool (default: {MAIN_SCENARIO}, the rig as shipped)",
    )
    add_override_argument(parser)
    parser.add_argument(
        "--sessions-of",
        type=token_list,
        default=DEFAULT_SESSION_TOKENS,
        metavar="L,...",
        help="session lengths in tokens (default 131072,262144)",
    )
    parser.add_argument(
        "--max-num-seqs-up-to",
        type=int,
        metavar="N",
        help=f"also the largest max_num_seqs in [1, N] (N <= {MAX_CAP}) the scenario holds (runs it: slow)",
    )
    parser.set_defaults(func=cmd_capacity)


def token_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        values = ()
    if not values or any(value <= 64 for value in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts above 64: {text!r}")
    return values


def cmd_capacity(args: argparse.Namespace) -> int:
    from sim.analysis.residency import largest_holding_cap, sessions_resident, v2_gate_run

    cap_limit = args.max_num_seqs_up_to
    if cap_limit is not None and not 1 <= cap_limit <= MAX_CAP:
        raise CLIError(f"--max-num-seqs-up-to: expected 1 to {MAX_CAP}, got {cap_limit}")
    print(
        f"kvsim capacity: {args.scenario}: sessions of L tokens resident at once (all running, no preemption)"
    )
    print(f"{'L tokens':>9} {'MTP':>4} {'layout':>6}  resident  peak blocks in use (the null block included)")
    for tokens in args.sessions_of:
        for mtp in (True, False):
            for layout in LAYOUTS:
                found = sessions_resident(args.scenario, args.set, tokens, layout, mtp=mtp)
                print(f"{tokens:>9,} {'on' if mtp else 'off':>4} {layout:>6}  {residency_words(found)}")
    print(v2_gate_words(v2_gate_run(args.scenario, args.set)))
    if cap_limit is not None:
        for layout in LAYOUTS:
            cap, holds = largest_holding_cap(args.scenario, args.set, layout, cap_limit)
            print(
                f"largest max_num_seqs to {cap_limit} without preemption [{layout}]: {cap_words(cap, holds)}"
            )
    return 0


def residency_words(found: Any) -> str:
    """``6 (7 do not)  209 of 248`` or ``8 (max_num_seqs)``."""
    beyond = "max_num_seqs" if found.one_more is None else f"{found.num_resident + 1} do not"
    blocks = f"{found.fits.blocks_in_use} of {found.fits.num_gpu_blocks}" if found.fits else "-"
    return f"{found.num_resident:>3} ({beyond}){'':<4}{blocks}"


def v2_gate_words(run: Any) -> str:
    """The fork's v2 gate row, as its card words it."""
    held = "resident" if run.resident else "NOT resident"
    return (
        f"the fork's v2 gate (computed block, old layout, no RecoverSSM, MTP, 1,024-token chunks): "
        f"three 262K sessions {held}, "
        f"peak {run.blocks_in_use} / {run.num_gpu_blocks} blocks (the card: 302 / 317)"
    )


def cap_words(cap: int | None, holds: bool) -> str:
    """``12, and no growing queue`` / ``4, but its queue grows: no cap holds``."""
    if cap is None:
        return "none (one sequence preempts)"
    return f"{cap}, and no growing queue" if holds else f"{cap}, but its queue grows there: no cap holds"
