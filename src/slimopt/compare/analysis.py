"""What `slimopt compare` concludes from its runs, as pure functions of the rows (no training here).

One row per method from its seeds (``aggregate_seeds``), which gaps the seeds cannot tell apart (``inside_noise``,
``ranking_text``), whether the budget can rank optimizers at all (``budget_warning``: AdamW must beat the control by
``MIN_CONTROL_MARGIN``), and which "low-rank" projections keep every direction (``full_rank_weights``). The protocol
shared with `slimopt finetune` (seeds, the control verdict, the learning-rate choice) is ``compare/protocol.py``.

Details: docs/modules.md, ``slimopt.compare``.
"""

from __future__ import annotations

from slimopt.compare.protocol import LOSS, aggregate, finished, measured

__all__ = ["MIN_CONTROL_MARGIN", "aggregate_seeds", "inside_noise", "ranking_text", "noise_pairs", "control_margin",
           "budget_warning", "full_rank_weights", "baseline_full_rank_weights"]

MIN_CONTROL_MARGIN = 0.20  # AdamW's perplexity must be at least 20% below the control's


def aggregate_seeds(runs: list[dict]) -> dict:
    """One row from the per-seed rows of one method (each with seed, status, val_loss, val_ppl, ...): the LOSS
    ``aggregate`` (compare/protocol.py) of the runs that finished (status "ok", finite loss), with seed_list and
    ``seed_problems`` naming the runs that failed or diverged. When no run is ok, the row takes the first run's
    status (failed or diverged) and NaN in place of its statistics.
    """
    if not runs:
        raise ValueError("aggregate_seeds needs at least one run")
    row = aggregate(runs, LOSS)
    row.pop("seed", None)
    row["seed_list"] = [r.get("seed") for r in runs]
    row["seed_problems"] = [f"seed {r.get('seed')} {_short_status(r.get('status', ''))}" for r in runs
                            if not finished(r, LOSS)]
    if not row["seeds_ok"]:
        row.update(val_loss=float("nan"), val_ppl=float("nan"), val_loss_std=None, val_ppl_std=None,
                   val_ppl_min=None, val_ppl_max=None)
    return row


def _short_status(status: str) -> str:
    return status.split(":", 1)[0] if status.startswith("failed") else status


def _measured(r: dict) -> bool:
    return measured(r, LOSS)


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
