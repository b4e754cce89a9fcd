"""The `tierstore` command line. Each subcommand lives in `tierstore/commands/<name>.py` and
exposes `register(subparsers)`; heavy imports happen inside the command, not here."""

from __future__ import annotations

import argparse
import importlib
import sys

from tierstore.errors import TierstoreError

# One entry per subcommand module under tierstore/commands/, in --help order.
COMMAND_MODULES = ("inspect", "sim", "plan", "pack", "verify", "generate", "replay", "bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tierstore",
        description="Tiered expert memory for Mixture-of-Experts models.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(f"tierstore.commands.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except TierstoreError as exc:
        print(f"tierstore {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
