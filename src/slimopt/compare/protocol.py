"""The comparison protocol that `slimopt compare` and `slimopt finetune` share: a control, seeds, tuned rates.

Each method is measured against a control row, at a learning rate picked from a grid of multipliers of its default
by validation loss, over several seeds; one row per method holds the mean and spread. The two commands differ only
in the number a row is judged by: a pretraining loss (``LOSS``, lower is better) or a fine-tuning score (``SCORE``,
higher is better). docs/design.md, section 7 says why each part is there.

Details: docs/modules.md, ``slimopt.compare.protocol``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

__all__ = ["CONTROL", "HEAD", "DEFAULT_LR_GRID", "DEFAULT_LR_EXTENSIONS", "Metric", "LOSS", "SCORE", "seed_list",
           "mean_std", "finished", "measured", "aggregate", "beats_control", "control_verdicts", "choose_lr",
           "extension_multiplier", "on_grid_edge", "mark_choice", "run_method"]

CONTROL = "frozen"  # `slimopt compare`'s control (slimopt.baselines): AdamW with every projectable weight frozen
HEAD = "head"
"""`slimopt finetune`'s control in ``--methods``: only the classification head trains (AdamW)."""

DEFAULT_LR_GRID = (0.25, 0.5, 1.0, 2.0, 4.0)  # multipliers of each method's default lr that --tune-lr tries
# While a sweep's best point sits on the edge of what it tried, it tries twice the largest (or half the smallest)
# multiplier, at most this many times a method: a best lr on the grid's edge is an unknown best lr, and a ranking of
# methods tuned to an edge may be the grid's, not the methods'.
DEFAULT_LR_EXTENSIONS = 3


@dataclass(frozen=True)
class Metric:
    """The number a row is judged by (`key`), its direction, and what a row of several seeds carries.

    `spread`: other per-run numbers that get a mean and a sample standard deviation; `means`: per-run numbers that
    get a mean; `mean_dicts`: per-run dicts of numbers, averaged key by key. `finite`: the per-run number that must
    be finite for a run to count (a pretraining run whose loss is not finite diverged); None: a finished run
    counts, and an undefined score (a correlation of constant predictions) shows in the mean."""

    key: str
    higher_is_better: bool
    spread: tuple[str, ...] = ()
    means: tuple[str, ...] = ()
    mean_dicts: tuple[str, ...] = ()
    finite: str | None = None


# Pretraining (`slimopt compare`): validation perplexity; the state size is the same for every seed.
LOSS = Metric("val_ppl", higher_is_better=False, spread=("val_loss",), finite="val_loss",
              means=("state_mib", "state_bytes_per_param", "peak_mem_mib", "tokens_per_s", "wall_time_s",
                     "cpu_time_s"))
# Fine-tuning (`slimopt finetune`): the task's first metric on the validation split.
SCORE = Metric("score", higher_is_better=True, means=("eval_loss", "train_loss", "s_per_step", "train_s"),
               mean_dicts=("metrics",))


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def seed_list(seed: int, seeds: int) -> list[int]:
    """The seeds every run is repeated with: seed, seed + 1, ..., seed + seeds - 1."""
    return [seed + k for k in range(seeds)]


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """(mean, sample standard deviation; None for one value)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))  # sample std (n - 1)


def finished(run: dict, metric: Metric) -> bool:
    """Whether one run counts in its row's statistics."""
    return run.get("status") == "ok" and (metric.finite is None or _finite(run.get(metric.finite)))


def measured(row: dict, metric: Metric) -> bool:
    """Whether a row's number can be compared with another's."""
    return row.get("status") == "ok" and (metric.finite is None or _finite(row.get(metric.key)))


def aggregate(runs: list[dict], metric: Metric) -> dict:
    """One row from one method's per-seed runs: the first finished run's fields, with the metric (and `spread`)
    the mean over the finished runs, ``<key>_std`` the sample standard deviation (None for one run), ``<key>_min``
    / ``<key>_max`` the range, `means` and `mean_dicts` averaged; seeds, seeds_ok and runs beside them. When no
    run finished the row is the first run's (its failed or diverged status) without statistics."""
    if not runs:
        raise ValueError("aggregate needs at least one run")
    ok = [r for r in runs if finished(r, metric)]
    row = dict(ok[0] if ok else runs[0])
    row.update(seeds=len(runs), seeds_ok=len(ok), runs=list(runs))
    if not ok:
        return row
    for k in (*metric.spread, metric.key):
        row[k], row[f"{k}_std"] = mean_std([r[k] for r in ok])
    values = [r[metric.key] for r in ok]
    row[f"{metric.key}_min"], row[f"{metric.key}_max"] = min(values), max(values)
    for k in metric.means:
        vals = [r.get(k) for r in ok]
        if metric.finite is not None:
            vals = [v for v in vals if _finite(v)]
        if vals:
            row[k] = sum(vals) / len(vals)
    for k in metric.mean_dicts:
        row[k] = {name: sum(r[k][name] for r in ok) / len(ok) for name in ok[0][k]}
    return row


def beats_control(row: dict, control: dict | None, metric: Metric) -> bool | None:
    """Whether a row's mean is better than the control's (lower loss, higher score); None when there is no
    control or either was not measured."""
    if control is None or not measured(control, metric) or not measured(row, metric):
        return None
    a, c = row[metric.key], control[metric.key]
    return a > c if metric.higher_is_better else a < c


def control_verdicts(rows: list[dict], metric: Metric, control: str, group: str | None = None) -> dict:
    """Each non-control row's ``beats_control`` verdict, keyed by its method, or by (row[group], method) when the
    rows hold several groups (fine-tuning tasks), each with a control of its own. The control rows are left out."""
    controls: dict[Any, dict] = {}
    for r in rows:
        if r["method"] == control:
            controls.setdefault(r.get(group) if group else None, r)
    out: dict = {}
    for r in rows:
        if r["method"] == control:
            continue
        key = r["method"] if group is None else (r[group], r["method"])
        out[key] = beats_control(r, controls.get(r.get(group) if group else None), metric)
    return out


def choose_lr(points: Iterable[dict]) -> dict | None:
    """The sweep point (dict with lr, val_loss, status) with the lowest validation loss among those that
    finished ("ok", finite loss); ties go to the smaller lr. None when none finished. Both commands select on the
    validation loss, whatever they report."""
    ok = [p for p in points if p.get("status") == "ok" and _finite(p.get("val_loss"))]
    if not ok:
        return None
    return min(ok, key=lambda p: (p["val_loss"], p["lr"]))


def extension_multiplier(points: Iterable[dict], factor: float = 2.0) -> float | None:
    """The next multiplier to try when a sweep's best point sits on the edge of what was tried, or None.

    A best point at the largest multiplier tried asks for `factor` times it; at the smallest, for 1/`factor` of
    it (and when every point diverged). A failed or diverged point beyond the best
    is a point tried: the best is then inside the grid and nothing more is asked."""
    points = list(points)
    tried = sorted({float(p["multiplier"]) for p in points})
    if not tried:
        return None
    best = choose_lr(points)
    if best is None:  # every point diverged: the stable range lies below; a run that crashed says nothing of lr
        return tried[0] / factor if any(p.get("status") == "diverged" for p in points) else None
    if len(tried) == 1:
        return None  # one point has no direction to extend in
    mult = float(best["multiplier"])
    if mult == tried[-1]:
        return tried[-1] * factor
    if mult == tried[0]:
        return tried[0] / factor
    return None


def on_grid_edge(points: Iterable[dict]) -> bool:
    """Whether a sweep's chosen point is the smallest or largest multiplier tried (of at least two), so that the
    best learning rate may lie beyond what was tried."""
    points = list(points)
    tried = sorted({float(p["multiplier"]) for p in points})
    best = choose_lr(points)
    return best is not None and len(tried) > 1 and float(best["multiplier"]) in (tried[0], tried[-1])


def mark_choice(points: list[dict]) -> tuple[dict | None, bool]:
    """Mark a sweep's best point ("chosen") and return it with whether it sits on the grid's edge."""
    best = choose_lr(points)
    for p in points:
        p["chosen"] = p is best
    return best, on_grid_edge(points)


Run = Callable[[float, int], dict]  # (lr, seed) -> one run's row


def _safe(one: Run, lr: float, seed: int, task: str, method: str) -> dict[str, Any]:
    try:
        return one(lr, seed)
    except (RuntimeError, ValueError) as err:  # one failing run must not lose the others' results
        return {"task": task, "method": method, "status": f"failed: {err}", "lr": lr, "seed": seed}


def run_method(one: Run, task: str, method: str, base_lr: float, lr_source: str, seeds: list[int],
               lr_grid: tuple[float, ...] | None, lr_extensions: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Every fine-tuning run of one method on one task, one after another: the learning-rate sweep (`lr_grid`
    multipliers of `base_lr`, None: no tuning) on full runs of the first seed, then the other seeds at the chosen
    lr, so that tuning costs the other grid points only. Returns the SCORE ``aggregate`` of the seeds' runs with
    lr, lr_source and sweep (the grid's points, the chosen one marked)."""
    lr, source, first, sweep = base_lr, lr_source, None, []
    if lr_grid:
        runs: dict[float, dict] = {}

        def point(mult: float) -> None:
            r = _safe(one, base_lr * mult, seeds[0], task, method)
            runs[mult] = r
            sweep.append({"multiplier": float(mult), "lr": base_lr * mult, "status": r["status"],
                          "val_loss": r.get("eval_loss"), "score": r.get("score"), "chosen": False})
            got = (f"val loss {r['eval_loss']:.4f}, {r['metric']} {100 * r['score']:.1f}"
                   if r["status"] == "ok" else r["status"])
            log(f"    lr {base_lr * mult:.3g} (x{mult:g}): {got}")

        for mult in lr_grid:
            point(mult)
        for _ in range(lr_extensions):
            mult = extension_multiplier(sweep)
            if mult is None:
                break
            log(f"    best at the edge of the grid: trying x{mult:g}")
            point(mult)
        best, _ = mark_choice(sweep)
        if best is not None:
            lr, first = best["lr"], runs[best["multiplier"]]
            source = f"tuned: x{best['multiplier']:g} of {base_lr:g} ({lr_source})"
        else:
            source = f"{lr_source} (tuning failed)"
    runs_of_seeds = [first] if first is not None else []
    for seed in seeds[len(runs_of_seeds):]:
        runs_of_seeds.append(_safe(one, lr, seed, task, method))
    row = aggregate(runs_of_seeds, SCORE)
    row.update(lr=lr, lr_source=source, sweep=sweep)
    return row
