"""`slimopt methods`: every name `--method` accepts, with what it is, its default learning rate and where that comes
from, and whether it can run here."""

from __future__ import annotations

import argparse

__all__ = ["add_parser", "run", "format_table"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("methods", help="list the optimizers slimopt train/compare accept",
                              description=__doc__)
    p.add_argument("--kind", choices=("all", "slimopt", "peer", "baseline"), default="all",
                   help="only one kind of method (default: all)")
    return p


def format_table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    """A plain-text table with aligned columns."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(tuple("-" * w for w in widths)), *map(line, rows)])


def run(args) -> int:
    from slimopt.catalog import CATALOG
    from slimopt.peers import available_peers

    peers = available_peers()
    rows = []
    for name, e in CATALOG.items():
        if args.kind not in ("all", e.kind):
            continue
        status = "ok" if e.kind != "peer" or peers.get(name) is None else "not installed"
        rows.append((name, e.kind, f"{e.lr:g}", e.lr_source, status, e.description))
    print(format_table(rows, ("method", "kind", "lr", "lr from", "status", "description")))
    print("lr from: a paper's rate for LLaMA pretraining (its arXiv id), or AdamW's times the ratio of the method's "
          "tuned rate to AdamW's (docs/reproduction.md)")
    missing = {n: why for n, why in peers.items() if why and args.kind in ("all", "peer")}
    for n, why in missing.items():
        print(f"  {n}: {why}")
    return 0
