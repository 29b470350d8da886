"""`python -m dlo_fn <command>`: one module per command under :mod:`dlo_fn.cli`.

Each command module defines ``register(subparsers)`` (adds its parser and sets ``func``) and keeps its heavy
imports inside the function it runs, so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Command modules, in the order `--help` lists them.
COMMANDS = (
    "plan",
    "memory",
    "policy",
    "make_checkpoint",
    "generate",
    "demo",
    "bench",
    "figures",
)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows an option's default only when it says something (not None or False) and the help text does not
    already state it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (default not in (None, False, argparse.SUPPRESS) and "default" not in text
                and action.option_strings and action.nargs != 0):
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dlo_fn",
        description=(
            "Distributed Layerwise Offload (DLO) for diffusion transformers: plan shard layouts and "
            "slot schedules, size host and HBM memory, write checkpoints, generate with offloaded "
            "weights, benchmark, and regenerate the figures."
        ),
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"dlo_fn.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return int(args.func(args) or 0)
