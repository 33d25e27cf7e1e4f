"""The `rollout-engine` command."""
from __future__ import annotations

import argparse

from rollout_engine import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout-engine", description=__doc__)
    parser.add_argument("--version", action="version", version=f"rollout-engine {__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.run(args)
