"""The ``kvsim`` command line: builds the parser from ``sim.commands``.

Every command validates its input before doing any work and reports bad input
as one line on stderr with exit status 2; nothing is written on failure.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

from sim.commands import COMMAND_MODULES
from sim.config import ConfigError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvsim", description="Simulate vLLM's KV-cache block allocation under the fork's two layouts."
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(f"sim.commands.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        return int(args.func(args))
    except ConfigError as error:
        print(f"kvsim: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvsim: interrupted", file=sys.stderr)
        return 130


def run(argv: Any = None) -> None:
    sys.exit(main(argv))


if __name__ == "__main__":
    run()
