"""What `slimopt compare` concludes from its runs, as pure functions of the rows (no training here).

- ``aggregate_seeds``: one row per method from its per-seed runs: mean, sample standard deviation, min and max of
  the validation loss and perplexity.
- ``inside_noise`` / ``ranking_text``: which gaps between methods the seeds cannot tell apart (their min-max
  ranges of perplexity overlap).
- ``control_verdicts`` / ``budget_warning``: the control (``CONTROL``: AdamW on embeddings, norms and head with
  every projectable weight frozen) is the floor a method must clear; when AdamW beats it by less than
  ``MIN_CONTROL_MARGIN`` the budget measures token statistics, not optimizers, and the warning says what to change.
- ``choose_lr``: the grid point of a learning-rate sweep with the lowest validation loss.
- ``full_rank_weights``: projectable weights on which a method's "low-rank" projection keeps every direction.
"""

from __future__ import annotations

import math
from typing import Iterable

__all__ = ["CONTROL", "MIN_CONTROL_MARGIN", "mean_std", "aggregate_seeds", "inside_noise", "ranking_text", "noise_pairs",
           "control_margin", "control_verdicts", "budget_warning", "choose_lr", "full_rank_weights",
           "baseline_full_rank_weights"]

CONTROL = "frozen"  # slimopt.baselines: AdamW with every projectable weight frozen
MIN_CONTROL_MARGIN = 0.20  # AdamW's perplexity must be at least 20% below the control's

# Per-run numbers a method's row averages over its seeds (the state size is the same for every seed).
_MEAN_COLUMNS = ("state_mib", "state_bytes_per_param", "peak_mem_mib", "tokens_per_s", "wall_time_s", "cpu_time_s")


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """(mean, sample standard deviation; None for one value)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))  # sample std (n - 1)


def aggregate_seeds(runs: list[dict]) -> dict:
    """One row from the per-seed rows of one method (each with seed, status, val_loss, val_ppl, ...).

    The statistics use the runs whose status is "ok": val_loss / val_ppl are means, *_std sample standard
    deviations (None for one run), val_ppl_min / val_ppl_max the range. Rows that failed or diverged are counted
    in seeds but not in seeds_ok, and named in ``seed_problems``. When no run is ok, the row takes the first run's
    status (failed or diverged) and has no statistics.
    """
    if not runs:
        raise ValueError("aggregate_seeds needs at least one run")
    ok = [r for r in runs if r.get("status") == "ok" and _finite(r.get("val_loss"))]
    first = ok[0] if ok else runs[0]
    row = {k: v for k, v in first.items() if k not in ("seed", "runs")}
    row["seeds"] = len(runs)
    row["seeds_ok"] = len(ok)
    row["seed_list"] = [r.get("seed") for r in runs]
    row["seed_problems"] = [f"seed {r.get('seed')} {_short_status(r.get('status', ''))}" for r in runs
                            if r not in ok]
    row["runs"] = list(runs)
    if not ok:
        row.update(val_loss=float("nan"), val_ppl=float("nan"), val_loss_std=None, val_ppl_std=None,
                   val_ppl_min=None, val_ppl_max=None)
        return row
    row["status"] = "ok"
    losses = [r["val_loss"] for r in ok]
    ppls = [r["val_ppl"] for r in ok]
    row["val_loss"], row["val_loss_std"] = mean_std(losses)
    row["val_ppl"], row["val_ppl_std"] = mean_std(ppls)
    row["val_ppl_min"], row["val_ppl_max"] = min(ppls), max(ppls)
    for k in _MEAN_COLUMNS:
        vals = [r[k] for r in ok if _finite(r.get(k))]
        if vals:
            row[k] = sum(vals) / len(vals)
    return row


def _short_status(status: str) -> str:
    return status.split(":", 1)[0] if status.startswith("failed") else status


def _measured(r: dict) -> bool:
    return r.get("status") == "ok" and _finite(r.get("val_ppl"))


def inside_noise(a: dict, b: dict) -> bool | None:
    """True when the seeds cannot order a and b (their min-max ranges of val ppl overlap), False when they can,
    None when either has fewer than two measured seeds (the spread is unknown)."""
    if a.get("seeds_ok", 1) < 2 or b.get("seeds_ok", 1) < 2:
        return None
    return a["val_ppl_min"] <= b["val_ppl_max"] and b["val_ppl_min"] <= a["val_ppl_max"]


def noise_pairs(rows: list[dict]) -> list[tuple[str, str]]:
    """Every pair of measured methods, in ranking order, whose gap is inside the noise of their seeds."""
    ranked = sorted([r for r in rows if _measured(r)], key=lambda r: r["val_ppl"])
    return [(a["method"], b["method"]) for i, a in enumerate(ranked) for b in ranked[i + 1:]
            if inside_noise(a, b)]


def ranking_text(rows: list[dict], control: dict | None = None) -> str:
    """The measured methods from best to worst: "a (16.7) ~ b (16.9) < c (17.8)". With several seeds each
    number is the mean and "~" joins neighbours whose min-max ranges overlap (their order is noise); methods
    that do not clear the control carry "not below the control"."""
    ranked = sorted([r for r in rows if _measured(r)], key=lambda r: r["val_ppl"])
    parts = []
    for i, r in enumerate(ranked):
        label = f"{r['method']} ({r['val_ppl']:.1f}"
        if r.get("seeds_ok", 1) > 1 and r.get("val_ppl_std") is not None:
            label += f" ± {r['val_ppl_std']:.1f}"
        label += ")"
        if control is not None and r is not control and r["method"] != control.get("method") \
                and _measured(control) and not r["val_ppl"] < control["val_ppl"]:
            label += " [not below the control]"
        if i:
            parts.append(" ~ " if inside_noise(ranked[i - 1], r) else " < ")
        parts.append(label)
    return "".join(parts)


def control_margin(adamw: dict, control: dict) -> float | None:
    """How far below the control AdamW's perplexity is, as a fraction of the control's: (control - adamw) /
    control. None when either is not measured."""
    if not (_measured(adamw) and _measured(control)):
        return None
    return (control["val_ppl"] - adamw["val_ppl"]) / control["val_ppl"]


def control_verdicts(rows: list[dict], control: dict | None) -> dict[str, bool | None]:
    """method -> True when its val ppl (mean over seeds) is below the control's, False when not, None when it
    or the control was not measured. The control itself is left out."""
    out: dict[str, bool | None] = {}
    for r in rows:
        if control is not None and r["method"] == control["method"]:
            continue
        if control is None or not _measured(control) or not _measured(r):
            out[r["method"]] = None
        else:
            out[r["method"]] = r["val_ppl"] < control["val_ppl"]
    return out


def budget_warning(rows: list[dict], control: dict | None, *, steps: int | None = None,
                   vocab_size: int | None = None, model: str | None = None,
                   margin: float = MIN_CONTROL_MARGIN) -> str | None:
    """The warning a comparison must print when its budget cannot rank optimizers, or None.

    Warns when AdamW's val ppl is less than `margin` (20%) below the control's: the run is then too short or the
    model too small for its vocabulary, and the ranking measures how fast each method fits the embeddings and the
    output layer (unigram and bigram statistics), not how it trains the transformer weights. Says what to change.
    Also warns when the control or AdamW is missing or failed, since the check could not be made.
    """
    if control is None:
        return None
    adamw = next((r for r in rows if r["method"] == "adamw"), None)
    if not _measured(control):
        return ("the control run (frozen transformer weights) did not finish, so nothing shows whether this "
                "budget measures the methods' training of the transformer weights")
    if adamw is None:
        return ("adamw is not among the methods, so the budget check (AdamW at least "
                f"{margin:.0%} below the control in perplexity) was not made; add adamw to --methods")
    if not _measured(adamw):
        return "the adamw run did not finish, so the budget check against the control was not made"
    m = control_margin(adamw, control)
    if m >= margin:
        return None
    how = (f"beats the control by only {m:.0%}" if m > 0 else
           f"does not beat the control ({-m:.0%} worse)")
    fixes = [f"more steps (--max-steps {4 * steps})" if steps else "more steps (--max-steps / --tokens)"]
    if vocab_size and vocab_size > 512:
        fixes.append(f"a smaller vocabulary (--vocab-size {max(512, vocab_size // 4)})")
    else:
        fixes.append("a smaller vocabulary (--vocab-size, or a tokenizer with fewer tokens)")
    bigger = {"tiny": "small", "small": "60m", "60m": "130m", "130m": "350m", "350m": "1b", "1b": "7b"}
    nxt = bigger.get((model or "").lower())
    fixes.append(f"a bigger model (--model {nxt})" if nxt else "a bigger model (--model)")
    if "lr_source" in adamw and not str(adamw["lr_source"]).startswith("tuned"):
        fixes.append("and AdamW at its best lr (--tune-lr)")
    return (f"AdamW (val ppl {adamw['val_ppl']:.2f}) {how} in perplexity (control {control['val_ppl']:.2f}: "
            f"AdamW on embeddings, norms and head, every attention and MLP weight frozen); it should be at least "
            f"{margin:.0%} below. At this budget the ranking measures how fast each method fits the embeddings "
            f"and the output layer (token statistics), not how it trains the transformer weights, and it ranks "
            f"the methods wrongly. Change the budget: {', '.join(fixes)}.")


def choose_lr(points: Iterable[dict]) -> dict | None:
    """The sweep point (dict with lr, val_loss, status) with the lowest validation loss among those that
    finished ("ok", finite loss); ties go to the smaller lr. None when none finished."""
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


def full_rank_weights(model, optimizer) -> list[tuple[str, tuple[int, int], int]]:
    """(name, shape, kept rank) of every projectable weight on which `optimizer` projects onto a subspace that
    covers the whole smaller side of the matrix (rank >= min(m, n)): Adam in a rotating full basis, not a
    low-rank method. Reads slimopt's groups (projector svd / randomized_svd / random, with their rank or
    density) and peers' GaLore-style groups (a "rank" key); block and column projectors are not low-rank
    projections and are not reported."""
    from slimopt.optim.algorithm.partition import classify
    from slimopt.optim.algorithm.projectors import ORTHO_PROJECTORS, side_for, subspace_rank

    projectable = {id(p): n for n, (p, kind) in classify(model).items() if kind == "projectable"}
    out = []
    for g in getattr(optimizer, "param_groups", []):
        proj = g.get("projector")
        if proj is None and g.get("rank") is None:
            continue
        if proj is not None and proj not in ORTHO_PROJECTORS:
            continue
        for p in g["params"]:
            name = projectable.get(id(p))
            if name is None or p.dim() != 2:
                continue
            shape = (int(p.shape[0]), int(p.shape[1]))
            if proj is None:  # a peer: galore-torch / APOLLO keep `rank` directions of the smaller side
                r = min(int(g["rank"]), min(shape))
            else:
                side = side_for(p.shape, g.get("proj_side", "std"))
                r = subspace_rank(p.shape, proj, side, g.get("rank"), g.get("density"))
            if r >= min(shape):
                out.append((name, shape, r))
    return out


def baseline_full_rank_weights(model, rank: int) -> list[tuple[str, tuple[int, int], int]]:
    """The same for a low-rank-weight baseline (W = B A, LoRA, ReLoRA) at `rank`, on the model before it is
    transformed: weights whose factors could hold any matrix of their shape."""
    from slimopt.optim.algorithm.partition import classify

    out = []
    for name, (p, kind) in classify(model).items():
        if kind == "projectable" and p.dim() == 2 and rank >= min(p.shape):
            out.append((name, (int(p.shape[0]), int(p.shape[1])), int(rank)))
    return out
