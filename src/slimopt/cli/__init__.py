"""The `slimopt` command (also `python -m slimopt`).

Each subcommand lives in its own module `slimopt.cli.<name>` exposing `add_parser(subparsers)`, which returns
its argparse parser, and `run(args) -> int`. Modules import heavy libraries (torch, transformers) inside `run`, and
a run builds only its own subcommand's parser, so `slimopt --help` and `slimopt methods` stay fast. Errors a user can fix (bad options, missing files, a peer that is not installed) are
printed as one line, with exit status 2, instead of a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["SUBCOMMANDS", "build_parser", "main"]

# Subcommand modules, in the order `slimopt --help` lists them.
SUBCOMMANDS = ["train", "compare", "finetune", "memory", "bench", "methods"]


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or of `only` (what ``main`` builds for a run: another subcommand's parser
    can import heavy libraries for its defaults)."""
    from slimopt import __version__
    parser = argparse.ArgumentParser(
        prog="slimopt",
        description="Train language models with memory-lean optimizers (GaLore, FRUGAL, TACO, low-bit state) "
                    "and compare them.")
    parser.add_argument("--version", action="version", version=f"slimopt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in [only] if only in SUBCOMMANDS else SUBCOMMANDS:
        mod = importlib.import_module(f"slimopt.cli.{name}")
        p = mod.add_parser(sub)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    from slimopt import peer_logs

    peer_logs.hush()
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(only=argv[0] if argv else None)
    args = parser.parse_args(argv)
    args.argv = argv  # what was typed, for messages that repeat a command (train's --resume line)
    if getattr(args, "_run", None) is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args._run(args) or 0)
    except (ValueError, FileNotFoundError, ImportError, ConnectionError) as e:
        print(f"slimopt {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"slimopt {args.command}: interrupted", file=sys.stderr)
        return 130
