"""The "honest comparisons" options that `slimopt compare` and `slimopt finetune` share, defined once.

--no-control, --tune-lr, --lr-grid, --lr-extensions and --seeds set up the protocol of
``slimopt.compare.protocol`` (a control row, tuned learning rates, seeds) in both commands; each command says in
the help what its control is and what its seeds vary.
"""

from __future__ import annotations

import argparse

from slimopt.cli.train import _int
from slimopt.compare.protocol import DEFAULT_LR_EXTENSIONS, DEFAULT_LR_GRID

__all__ = ["parse_lr_grid", "add_honest_args", "tuning_from_args"]


def parse_lr_grid(text: str, option: str = "--lr-grid") -> tuple[float, ...]:
    """'1/4,1/2,1,2,4' -> (0.25, 0.5, 1.0, 2.0, 4.0); a ValueError naming the option for anything else."""
    from fractions import Fraction

    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            out.append(float(Fraction(part)) if "/" in part else float(part))
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"{option}: {part!r} is not a number or fraction (e.g. 1/4,1/2,1,2,4)") from None
    if not out:
        raise ValueError(f"{option} is empty: give multipliers of the default lr, e.g. 1/4,1/2,1,2,4")
    return tuple(out)


def _grid_text(grid: tuple[float, ...]) -> str:
    return ",".join(f"1/{round(1 / g)}" if g < 1 else f"{g:g}" for g in grid)


def add_honest_args(p: argparse.ArgumentParser, *, control: str, tuning_runs: str, tuning_files: str,
                    seeds: str, edge_note: str = ""):
    """The shared options in a group "honest comparisons" of `p`, which is returned for a command's own.

    `control`: what the control row is and why it is there; `tuning_runs`: how long the tuning runs are and when
    they run; `tuning_files`: what lists them; `seeds`: what a seed changes and what the table shows of them;
    `edge_note`: what the report says of a best lr still on the grid's edge."""
    h = p.add_argument_group("honest comparisons")
    h.add_argument("--no-control", action="store_true", help=f"leave out the control row {control}")
    h.add_argument("--tune-lr", action="store_true",
                   help="run each method (the control too) at every multiple in --lr-grid of its default lr "
                        f"{tuning_runs} and keep the lr with the lowest validation loss ({tuning_files})")
    h.add_argument("--lr-grid", default=None, metavar="MULTIPLIERS",
                   help="comma-separated multipliers of each method's default lr for --tune-lr, fractions allowed "
                        f"(default: {_grid_text(DEFAULT_LR_GRID)})")
    h.add_argument("--lr-extensions", type=int, default=None, metavar="N",
                   help="while a method's best lr sits on the edge of what was tried, try twice the largest (or "
                        f"half the smallest) multiplier, at most N times a method{edge_note} (default: "
                        f"{DEFAULT_LR_EXTENSIONS}; 0: the grid as given)")
    h.add_argument("--seeds", type=_int, default=1, metavar="N",
                   help=f"run every method with seeds SEED..SEED+N-1 {seeds} (default: 1)")
    return h


def tuning_from_args(args) -> dict:
    """The shared tuning options given on the command line, as config fields (lr_grid, lr_extensions); a
    ValueError for --lr-grid without --tune-lr."""
    if args.lr_grid is not None and not args.tune_lr:
        raise ValueError("--lr-grid sets up --tune-lr, which was not given")
    out = {}
    if args.lr_grid is not None:
        out["lr_grid"] = parse_lr_grid(args.lr_grid)
    if args.lr_extensions is not None:
        out["lr_extensions"] = args.lr_extensions
    return out
