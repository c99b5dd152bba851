"""`slimopt compare`'s learning-rate sweeps: short runs of every tuned method at once, extended past an edge.

Every method's grid runs together (as many at a time as the comparison runs), then round by round every method
whose best point sits on the edge of its grid tries a factor of 2 beyond it; the choice is the protocol's
(compare/protocol.py), and lr_sweep.csv / .json / .png are rewritten after each point.

Details: docs/modules.md, ``slimopt.compare``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from slimopt.compare.config import CompareConfig, _base_lr, _grid_for, _method_config, _tune_dir, _tune_steps
from slimopt.compare.protocol import extension_multiplier, mark_choice
from slimopt.compare.report import _write_sweep
from slimopt.compare.runner import _run_one

__all__ = []


def _submit_point(cfg: CompareConfig, method: str, mult: float, pool: ThreadPoolExecutor) -> tuple:
    """Start one short tuning run of `method` at `mult` times its default lr: (multiplier, lr, config, run)."""
    lr = _base_lr(cfg, method)[0] * mult
    tc = replace(_method_config(cfg, method, lr=lr, out=_tune_dir(cfg, method, mult)), max_steps=_tune_steps(cfg),
                 tokens=None, eval_every=0, progress=False)
    return mult, lr, tc, pool.submit(_run_one, cfg, tc, method)


def _sweep_submit(cfg: CompareConfig, method: str, pool: ThreadPoolExecutor) -> list[tuple]:
    """Start the learning-rate grid of one method on short runs: [(multiplier, lr, config, run)]."""
    return [_submit_point(cfg, method, mult, pool) for mult in _grid_for(cfg, method)]


def _sweep(cfg: CompareConfig, method: str, pending: list, sweeps: dict, log) -> None:
    """Collect one method's grid runs in grid order; fills sweeps[method] point by point."""
    base_lr, source = _base_lr(cfg, method)
    sweeps[method] = {"base_lr": base_lr, "base_lr_source": source, "points": [], "chosen": None, "grid": [],
                      "extended": [], "edge": False}
    for item in pending:
        _record_point(cfg, method, item, sweeps, log)


def _record_point(cfg: CompareConfig, method: str, item: tuple, sweeps: dict, log) -> None:
    """Wait for one tuning run and add it to sweeps[method], choosing the best point anew."""
    mult, lr, tc, run = item
    entry = sweeps[method]
    r = run.result()
    entry["grid"].append(float(mult))
    entry["points"].append({"method": method, "multiplier": float(mult), "lr": lr, "base_lr": entry["base_lr"],
                            "steps": _tune_steps(cfg), "seed": tc.seed, "status": r["status"],
                            "val_loss": r.get("val_loss"), "val_ppl": r.get("val_ppl"), "chosen": False})
    got = f"val loss {r['val_loss']:.4f}" if r["status"] == "ok" else r["status"]
    log(f"  tune {method} lr {lr:.3g} (x{mult:g}): {got}")
    entry["chosen"], entry["edge"] = mark_choice(entry["points"])
    _write_sweep(sweeps, cfg)


def _extend_sweeps(cfg: CompareConfig, methods: list[str], sweeps: dict, pool: ThreadPoolExecutor, log) -> None:
    """Round by round, every method whose best point sits on the edge of its grid tries a factor of 2 beyond it
    (all such methods at once), until none does or `cfg.lr_extensions` rounds have run."""
    for _ in range(cfg.lr_extensions):
        due = {m: extension_multiplier(sweeps[m]["points"]) for m in methods}
        due = {m: mult for m, mult in due.items() if mult is not None}
        if not due:
            return
        pending = {}
        for m, mult in due.items():
            log(f"  {m}: best at the edge of x{', x'.join(f'{g:g}' for g in sorted(sweeps[m]['grid']))}; "
                f"trying x{mult:g}")
            sweeps[m]["extended"].append(mult)
            pending[m] = _submit_point(cfg, m, mult, pool)
        for m, item in pending.items():
            _record_point(cfg, m, item, sweeps, log)


def _chosen_lr(cfg: CompareConfig, method: str, sweeps: dict) -> tuple[float, str, float | None]:
    """(lr, where it comes from, its multiplier of the default) for the full runs of `method`."""
    base_lr, source = _base_lr(cfg, method)
    entry = sweeps.get(method)
    if entry is None:
        return base_lr, source, None
    best = entry["chosen"]
    if best is None:
        return base_lr, f"{source} (tuning failed)", None
    return best["lr"], f"tuned (x{best['multiplier']:g} of {source} {base_lr:g})", best["multiplier"]



def _extension_text(entry: dict) -> str:
    """How a sweep's grid was extended and whether its best is still on the edge: '' when neither."""
    parts = []
    if entry.get("extended"):
        n = len(entry["extended"])
        grid = ", x".join(f"{g:g}" for g in entry["extended"])
        parts.append(f"grid extended {n} time{'s' if n > 1 else ''} to x{grid}")
    if entry.get("edge"):
        parts.append("still on the grid's edge")
    return "; " + "; ".join(parts) if parts else ""

