"""What every figure of slimopt (``compare``, ``memory``, ``bench``) does the same way: matplotlib on its Agg
backend, so figures draw without a display, and saving a finished figure."""

from __future__ import annotations

from pathlib import Path

__all__ = ["pyplot", "save_figure"]


def pyplot():
    """matplotlib.pyplot on the Agg backend (imported on first use: matplotlib is slow to import)."""
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path: str | Path) -> Path:
    """Lay `fig` out tightly, write it to `path` (creating its folder) and close it; return the path."""
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    pyplot().close(fig)
    return path
