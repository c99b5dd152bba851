"""What makes a ``slimopt finetune`` comparison honest: a control, tuned learning rates, seeds.

- The control (``HEAD``): AdamW on the new classification head alone, the pretrained body frozen. A fresh head on
  pretrained features already scores well on topic-like tasks; a method that does not beat it has not shown that it
  trains the body, which is what optimizer state is spent on.
- ``tune_lr``: each method's learning rate is the multiplier of its default (``lr_grid``) whose run ends with the
  lowest validation loss (``compare_analysis.choose_lr``, as ``slimopt compare`` picks), extended by a factor of 2
  past the grid's edge while the best sits on it (``extension_multiplier``). Tuning runs are full runs of the first
  seed, so the chosen one is that seed's run and tuning costs the other grid points only.
- ``seeds``: every run repeated with seeds seed .. seed + N - 1 (the head's initialisation and the batch order; the
  examples drawn stay), reported as mean and range.

Selecting on the validation loss and reporting validation accuracy is the usual GLUE protocol (the papers report the
best dev-set score); the loss, not the reported metric, picks.
"""

from __future__ import annotations

from typing import Any, Callable

from slimopt.train.compare_analysis import choose_lr, extension_multiplier, mean_std

__all__ = ["HEAD", "seed_list", "run_method", "aggregate", "control_verdicts"]

HEAD = "head"
"""The control's name in ``--methods``: only the classification head trains (AdamW)."""

Run = Callable[[float, int], dict]  # (lr, seed) -> one run's row


def seed_list(seed: int, seeds: int) -> list[int]:
    return [seed + k for k in range(seeds)]


def _safe(one: Run, lr: float, seed: int, task: str, method: str) -> dict[str, Any]:
    try:
        return one(lr, seed)
    except (RuntimeError, ValueError) as err:  # one failing run must not lose the others' results
        return {"task": task, "method": method, "status": f"failed: {err}", "lr": lr, "seed": seed}


def run_method(one: Run, task: str, method: str, base_lr: float, lr_source: str, seeds: list[int],
               lr_grid: tuple[float, ...] | None, lr_extensions: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Every run of one method on one task: the learning-rate sweep (`lr_grid` multipliers of `base_lr`, None: no
    tuning) on the first seed, then the other seeds at the chosen lr. Returns ``aggregate`` of the seeds' runs with
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
        best = choose_lr(sweep)
        if best is not None:
            best["chosen"] = True
            lr, first = best["lr"], runs[best["multiplier"]]
            source = f"tuned: x{best['multiplier']:g} of {base_lr:g} ({lr_source})"
        else:
            source = f"{lr_source} (tuning failed)"
    runs_of_seeds = [first] if first is not None else []
    for seed in seeds[len(runs_of_seeds):]:
        runs_of_seeds.append(_safe(one, lr, seed, task, method))
    row = aggregate(runs_of_seeds)
    row.update(lr=lr, lr_source=source, sweep=sweep)
    return row


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from one method's per-seed runs on one task: the first finished run's fields, with score (and each
    metric) the mean over the finished seeds, score_std (sample), score_min, score_max, seeds, seeds_ok, runs."""
    if not runs:
        raise ValueError("aggregate needs at least one run")
    ok = [r for r in runs if r.get("status") == "ok"]
    row = dict(ok[0] if ok else runs[0])
    row.update(seeds=len(runs), seeds_ok=len(ok), runs=list(runs))
    if not ok:
        return row
    scores = [r["score"] for r in ok]
    row["score"], row["score_std"] = mean_std(scores)
    row["score_min"], row["score_max"] = min(scores), max(scores)
    row["metrics"] = {k: sum(r["metrics"][k] for r in ok) / len(ok) for k in ok[0]["metrics"]}
    for k in ("eval_loss", "train_loss", "s_per_step", "train_s"):
        row[k] = sum(r[k] for r in ok) / len(ok)
    return row


def control_verdicts(rows: list[dict[str, Any]]) -> dict[tuple[str, str], bool | None]:
    """(task, method) -> whether the method's mean score is above the control's on that task (None: no control
    ran, or one of the two did not finish)."""
    control = {r["task"]: r for r in rows if r.get("method") == HEAD and r.get("status") == "ok"}
    out: dict[tuple[str, str], bool | None] = {}
    for r in rows:
        if r.get("method") == HEAD:
            continue
        c = control.get(r["task"])
        out[(r["task"], r["method"])] = (None if c is None or r.get("status") != "ok"
                                         else r["score"] > c["score"])
    return out
