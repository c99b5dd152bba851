"""Figures of `slimopt memory` and `slimopt bench`, drawn with matplotlib's Agg backend (no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from slimopt.figures import pyplot, save_figure

__all__ = ["memory_chart", "bench_chart"]

# the parts of a planned peak, bottom to top (MemoryPlan.peak_parts), and their colours
_PARTS = (("weights", "#4c72b0"), ("gradients", "#dd8452"), ("optimizer state", "#55a868"),
          ("projections", "#8172b3"), ("activations", "#c44e52"), ("temporaries", "#b3b3b3"))


def memory_chart(plans: Iterable, path: str | Path, budget: int | None = None, title: str = "") -> Path:
    """Stacked bars of each plan's peak (GiB): weights, gradients, optimizer state, projections, activations and
    temporaries; a dashed line at the GPU budget when given."""
    plt = pyplot()
    plans = list(plans)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(plans) + 2.5), 4.8), dpi=110)
    xs = range(len(plans))
    bottom = [0.0] * len(plans)
    for part, color in _PARTS:
        vals = [p.peak_parts.get(part, 0) / 2**30 for p in plans]
        if any(vals):
            ax.bar(xs, vals, bottom=bottom, color=color, label=part, width=0.7)
            bottom = [b + v for b, v in zip(bottom, vals)]
    if budget:
        ax.axhline(budget / 2**30, color="black", ls="--", lw=1.2, label=f"GPU budget {budget / 2**30:.1f} GiB")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([p.method for p in plans], rotation=40, ha="right", fontsize=8)
    ax.set_ylabel("planned peak memory (GiB)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    if title:
        ax.set_title(title, fontsize=10)
    return save_figure(fig, path)


def bench_chart(rows: list[dict], path: str | Path, title: str = "") -> Path:
    """Two panels per measured method: median optimizer-step time (ms) and optimizer-state bytes per parameter.
    Rows that did not run (not installed, failed) are left out."""
    plt = pyplot()
    ok = [r for r in rows if r.get("status") == "ok"]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(max(8.0, 0.5 * len(ok) + 4), 4.6), dpi=110)
    names = [r["method"] for r in ok]
    colors = ["#dd8452" if r.get("kind") == "peer" else "#4c72b0" for r in ok]
    ax_t.bar(range(len(ok)), [r["step_ms"] for r in ok], color=colors)
    ax_m.bar(range(len(ok)), [r["state_bytes_per_param"] for r in ok], color=colors)
    for ax, label in ((ax_t, "median optimizer step (ms)"), (ax_m, "optimizer state (bytes / parameter)")):
        ax.set_xticks(range(len(ok)))
        ax.set_xticklabels(names, rotation=45, ha="right", fontsize=7)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#4c72b0", "#dd8452")]
    ax_t.legend(handles, ["slimopt", "peer"], fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)
