"""Figures of `slimopt compare`: loss curves against tokens, optimizer-state / peak memory per method, and the
learning-rate sweep (validation loss against lr per method).

Drawn with matplotlib's Agg backend (no display needed). Rows are those of `slimopt.compare.run.run_compare`;
a row's `history` holds `train` and `eval` lists of (tokens, loss) pairs.
"""

from __future__ import annotations

import math
from pathlib import Path

from slimopt.figures import pyplot, save_figure

__all__ = ["plot_loss_curves", "plot_memory", "plot_lr_sweep", "ema"]


def ema(values: list[float], beta: float = 0.9) -> list[float]:
    """Bias-corrected exponential moving average, for readable training-loss curves."""
    out, m = [], 0.0
    for i, v in enumerate(values, 1):
        m = beta * m + (1 - beta) * v
        out.append(m / (1 - beta ** i))
    return out


def _finite(pairs):
    return [(t, v) for t, v in pairs if v is not None and math.isfinite(v)]


def plot_loss_curves(rows: list[dict], path: str | Path, title: str = "") -> Path:
    """Two panels: smoothed training loss and validation loss, both against training tokens, every point drawn.

    The y axes are logarithmic and fitted to the points drawn: the first steps' loss (about ln vocab) sits far above
    where the curves end, and a log scale keeps both the start and the small gaps at the end readable."""
    plt = pyplot()
    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(12, 4.6), dpi=100)
    cmap = plt.get_cmap("tab10" if len(rows) <= 10 else "tab20")
    for i, r in enumerate(rows):
        hist = r.get("history") or {}
        color = cmap(i % cmap.N)
        tr = _finite(hist.get("train", []))
        if tr:
            ax_t.plot([t for t, _ in tr], ema([v for _, v in tr]), color=color, lw=1.4, label=r["method"])
        ev = _finite(hist.get("eval", []))
        if ev:
            ax_v.plot([t for t, _ in ev], [v for _, v in ev], color=color, lw=1.4, marker="o", ms=3,
                      label=r["method"])
    for ax, name in ((ax_t, "training loss (EMA 0.9)"), (ax_v, "validation loss")):
        ax.set_xlabel("training tokens")
        log = _fit_y(ax)
        ax.set_ylabel(f"{name}{', log scale' if log else ''}")
        ax.grid(alpha=0.3, which="both" if log else "major")
    handles, labels = ax_v.get_legend_handles_labels()
    if not handles:
        handles, labels = ax_t.get_legend_handles_labels()
    if handles:
        ax_v.legend(handles, labels, fontsize=8, loc="best", ncol=2 if len(labels) > 6 else 1)
    fig.suptitle(title or "loss against tokens", fontsize=11)
    return save_figure(fig, path)


def _fit_y(ax) -> bool:
    """Fit the y axis to every point drawn on `ax`, 3% of the range beyond each end; logarithmic where every
    value is positive (a loss is), with plain numbers as tick labels. Returns whether the axis is logarithmic."""
    from matplotlib.ticker import FixedLocator, MaxNLocator, NullLocator, StrMethodFormatter
    values = [float(v) for line in ax.get_lines() for v in line.get_ydata() if math.isfinite(float(v))]
    if not values:
        return False
    lo, hi = min(values), max(values)
    log = lo > 0
    f, inv = (math.log, math.exp) if log else ((lambda v: v), (lambda v: v))
    pad = 0.03 * (f(hi) - f(lo)) if hi > lo else 0.05 * (abs(f(hi)) or 1.0)
    bottom, top = inv(f(lo) - pad), inv(f(hi) + pad)
    if log:
        ax.set_yscale("log")
        ticks = [t for t in MaxNLocator(nbins=8, steps=[1, 2, 2.5, 5, 10]).tick_values(bottom, top)
                 if bottom <= t <= top]
        ax.yaxis.set_major_locator(FixedLocator(ticks))
        ax.yaxis.set_major_formatter(StrMethodFormatter("{x:g}"))
        ax.yaxis.set_minor_locator(NullLocator())
    ax.set_ylim(bottom, top)
    return log


def plot_memory(rows: list[dict], path: str | Path, title: str = "",
                plan: tuple[str, int, str] | None = None) -> Path:
    """Horizontal bars per method, values printed: the optimizer state measured at the run's size (MiB), and

    - with `plan` = (model label, GPU bytes, GPU label): each method's planned optimizer state and training-step
      peak at that model (GiB, the rows' plan_state_gib / plan_peak_gib), the GPU's memory as a line, the peak
      bar green where it fits and red where it does not; methods the planner does not model are left empty;
    - without: the process's peak RSS growth (MiB), which at a small size is mostly the runtime.
    """
    plt = pyplot()
    ok = [r for r in rows if r.get("state_mib") is not None and not str(r.get("status", "")).startswith("failed")]
    names = [r["method"] for r in ok]
    fig, (ax_s, ax_p) = plt.subplots(1, 2, figsize=(12, 0.45 * max(4, len(ok)) + 1.5), dpi=100, sharey=True)
    y = list(range(len(ok)))
    _bars(ax_s, y, [r["state_mib"] for r in ok], "tab:blue", "optimizer state, measured (MiB)")
    if plan is None:
        kinds = sorted({r.get("peak_mem_kind", "") for r in ok} - {""})
        _bars(ax_p, y, [r.get("peak_mem_mib") for r in ok], "tab:orange",
              "process peak memory growth (MiB; at this size mostly the runtime)"
              + (f"\n{kinds[0]}" if len(kinds) == 1 else ""))
    else:
        model, budget, gpu = plan
        state = [r.get("plan_state_gib") for r in ok]
        peak = [r.get("plan_peak_gib") for r in ok]
        colors = ["tab:green" if r.get("plan_fits") else "tab:red" for r in ok]
        h = 0.38
        _bars(ax_p, [v + h / 2 for v in y], peak, colors, "", height=h,
              extra=[budget / 2**30], fmt=lambda v, r: f"{v:.3g} ({'fits' if r.get('plan_fits') else 'no'})",
              rows=ok)
        _bars(ax_p, [v - h / 2 for v in y], state, "tab:blue", "", height=h, extra=[budget / 2**30])
        top = max([v for v in state + peak if v is not None and math.isfinite(v)] + [budget / 2**30])
        ax_p.set_xlim(0, top * 1.25)  # both bar sets and the GPU line in view
        ax_p.axvline(budget / 2**30, color="black", ls="--", lw=1)
        ax_p.text(budget / 2**30, -0.9, f" {gpu}", fontsize=8, va="bottom")
        ax_p.set_xlabel(f"planned at {model} (GiB): optimizer state (blue),\n"
                        f"step peak (green: fits {gpu}, red: does not)")
        if not any(v is not None for v in peak):
            ax_p.text(0.5, 0.5, "no method here is one the planner models", transform=ax_p.transAxes,
                      ha="center", fontsize=9)
    ax_s.set_yticks(y)
    ax_s.set_yticklabels(names)
    ax_s.invert_yaxis()
    fig.suptitle(title or "memory per method", fontsize=11)
    return save_figure(fig, path)


def _bars(ax, y, vals, color, label, height=0.8, extra=(), fmt=None, rows=None):
    """Horizontal bars of `vals` (None: no bar) with their values printed at the end of each."""
    shown = [(yi, v, i) for i, (yi, v) in enumerate(zip(y, vals)) if v is not None and math.isfinite(v)]
    colors = color if isinstance(color, str) else [color[i] for _, _, i in shown]
    ax.barh([yi for yi, _, _ in shown], [v for _, v, _ in shown], height=height, color=colors)
    top = max([v for _, v, _ in shown] + list(extra) or [1.0])
    for yi, v, i in shown:
        text = fmt(v, rows[i]) if fmt else f"{v:.3g}"
        ax.text(v + 0.01 * top, yi, text, va="center", fontsize=8)
    ax.set_xlim(0, top * 1.25 if top > 0 else 1)
    if label:
        ax.set_xlabel(label)
    ax.grid(axis="x", alpha=0.3)


def plot_lr_sweep(sweeps: dict[str, dict], path: str | Path, title: str = "") -> Path:
    """Validation loss against learning rate (log x axis), one line per method, the chosen lr starred.

    `sweeps` maps a method to {"points": [{"lr", "val_loss", "status", "chosen"}, ...]}; points that failed or
    diverged are drawn as crosses on the top edge, so a grid that ran off the stable range shows as such.
    """
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    cmap = plt.get_cmap("tab10" if len(sweeps) <= 10 else "tab20")
    finite = [p["val_loss"] for e in sweeps.values() for p in e["points"]
              if p.get("status") == "ok" and p.get("val_loss") is not None and math.isfinite(p["val_loss"])]
    top = max(finite) if finite else 1.0
    bottom = min(finite) if finite else 0.0
    pad = 0.05 * (top - bottom) if top > bottom else 0.05
    for i, (method, entry) in enumerate(sweeps.items()):
        color = cmap(i % cmap.N)
        pts = sorted(entry["points"], key=lambda p: p["lr"])
        ok = [p for p in pts if p.get("status") == "ok" and p.get("val_loss") is not None
              and math.isfinite(p["val_loss"])]
        if ok:
            ax.plot([p["lr"] for p in ok], [p["val_loss"] for p in ok], color=color, lw=1.4, marker="o", ms=4,
                    label=method)
        bad = [p for p in pts if p not in ok]
        if bad:
            ax.plot([p["lr"] for p in bad], [top + pad] * len(bad), color=color, ls="none", marker="x", ms=7,
                    label=None if ok else f"{method} (none finished)")
        best = [p for p in ok if p.get("chosen")]
        if best:
            ax.plot([best[0]["lr"]], [best[0]["val_loss"]], color=color, marker="*", ms=15, ls="none",
                    markeredgecolor="black", markeredgewidth=0.6)
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate (log scale)")
    ax.set_ylabel("validation loss")
    ax.set_ylim(bottom - pad, top + 2 * pad)
    ax.grid(alpha=0.3, which="both")
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, labels, fontsize=8, loc="best", ncol=3 if len(labels) > 6 else 1)
    ax.set_title(title or "validation loss against learning rate", fontsize=10)
    return save_figure(fig, path)
