"""What `slimopt compare` says about its rows: each row's notes, the report's warnings, the terminal summary.

A method that does not clear the control, a gap inside the noise of the seeds, a projector that is full rank, a
tuned lr on the grid's edge, a fine-tuning method trained from scratch: each is said where a reader meets the row.

Details: docs/modules.md, ``slimopt.compare``.
"""

from __future__ import annotations

from slimopt.compare.analysis import (
    MIN_CONTROL_MARGIN,
    budget_warning,
    control_margin,
    inside_noise,
    noise_pairs,
    ranking_text,
)
from slimopt.compare.config import FINE_TUNING_METHODS, CompareConfig, _full_steps, split_method, starts_pretrained
from slimopt.compare.protocol import CONTROL, LOSS, control_verdicts

__all__ = ["CONTROL_NOTE"]

CONTROL_NOTE = "control: AdamW on embeddings, norms and head; attention and MLP weights frozen"


def _control_row(rows: list[dict]) -> dict | None:
    return next((r for r in rows if r["method"] == CONTROL), None)


def _full_rank_note(weights: list, method: str | None = None) -> str:
    name, (m, n), r = weights[0]
    who = f"{method}: " if method else ""
    return (f"{who}full-rank: rank {r} covers the smaller side of {len(weights)} projectable weight"
            f"{'s' if len(weights) != 1 else ''} (e.g. {name}, {m}x{n}), so it is not low-rank there")


def _out_of_claim(rows: list[dict], cfg: CompareConfig) -> list[str]:
    """The rows of fine-tuning methods (FINE_TUNING_METHODS, variants included) trained here from scratch."""
    if starts_pretrained(cfg.base.model):
        return []
    return [r["method"] for r in rows if split_method(r["method"])[0] in FINE_TUNING_METHODS]


def _annotate(rows: list[dict], cfg: CompareConfig) -> None:
    """Each row's clears_control verdict and notes (control, not clearing it, full rank, seeds, tuning, a
    fine-tuning method trained from scratch)."""
    control = _control_row(rows)
    verdicts = control_verdicts(rows, LOSS, CONTROL)
    out_of_claim = _out_of_claim(rows, cfg)
    for r in rows:
        notes = []
        if r["method"] == CONTROL:
            notes.append(CONTROL_NOTE)
        if r["method"] in out_of_claim:
            notes.append("a fine-tuning method trained from scratch: see the note under the table")
        verdict = verdicts.get(r["method"])
        r["clears_control"] = verdict
        if verdict is False:
            noise = inside_noise(r, control)
            notes.append("does not clear the control" + (" (inside the noise)" if noise else ""))
        elif verdict and inside_noise(r, control):
            notes.append("below the control only inside the noise")
        if r.get("full_rank"):
            notes.append(_full_rank_note(r["full_rank"]))
        if r.get("seed_problems") and r.get("seeds", 1) > 1:
            notes.append(f"{', '.join(r['seed_problems'])}"
                         + (f"; statistics over {r['seeds_ok']} of {r['seeds']} seeds" if r.get("seeds_ok") else ""))
        if r.get("lr_extended"):
            notes.append(f"lr grid extended to x{', x'.join(f'{g:g}' for g in r['lr_extended'])}")
        if r.get("lr_edge"):
            extended = " even after extending the grid" if r.get("lr_extended") else ""
            notes.append(f"tuned lr at the grid's edge (x{r['lr_multiplier']:g}){extended}: the best may lie "
                         "beyond it")
        r["notes"] = "; ".join(notes)


def _warnings(rows: list[dict], cfg: CompareConfig) -> list[str]:
    control = _control_row(rows)
    out = []
    w = budget_warning(rows, control, steps=_full_steps(cfg), vocab_size=None if cfg.base.tokenizer else
                       cfg.base.vocab_size, model=cfg.base.model)
    if w:
        out.append(w)
    behind = [r["method"] for r in rows if r.get("clears_control") is False]
    if behind and control is not None:
        out.append(f"not below the control ({control['val_ppl']:.2f}): {', '.join(behind)}. A model whose "
                   f"attention and MLP weights never move does at least as well, so these rows show nothing "
                   f"about how the method trains them.")
    for r in rows:
        if r.get("full_rank"):
            out.append(_full_rank_note(r["full_rank"], r["method"]) + ": a rotation of full Adam, which says "
                       "nothing about low-rank training; use a rank below the smaller side (--set "
                       f"{r['method']}.rank=...)")
    return out


def _claim_note(entry: str) -> str:
    """The one line under the table on a fine-tuning method trained from scratch."""
    return f"Note on {entry}: {FINE_TUNING_METHODS[split_method(entry)[0]]}."


def _noise_text(rows: list[dict], cfg: CompareConfig) -> str:
    if cfg.seeds == 1:
        return ("One seed: the spread between seeds was not measured, so close gaps may be noise "
                "(--seeds 3 measures it).")
    pairs = noise_pairs(rows)
    if not pairs:
        return f"Every gap is larger than the noise: no two methods' min-max ranges over {cfg.seeds} seeds overlap."
    return (f"Inside the noise (min-max ranges over {cfg.seeds} seeds overlap, so their order is not measured): "
            + ", ".join(f"{a} ~ {b}" for a, b in pairs) + ".")


def _conclusions(rows: list[dict], cfg: CompareConfig) -> list[str]:
    """The terminal summary after the last run: ranking, noise, control, warnings."""
    control = _control_row(rows)
    lines = []
    ranked = ranking_text(rows, control)
    if ranked:
        lines.append(f"ranking (val ppl{', mean ± std' if cfg.seeds > 1 else ''}): {ranked}")
        lines.append(_noise_text(rows, cfg))
    if control is not None and control.get("status") == "ok":
        adamw = next((r for r in rows if r["method"] == "adamw"), None)
        margin = control_margin(adamw, control) if adamw else None
        lines.append(f"control ({CONTROL}): val ppl {control['val_ppl']:.2f}"
                     + ("" if margin is None else
                        f"; AdamW is {margin:.0%} below it (needs >= {MIN_CONTROL_MARGIN:.0%})" if margin >= 0 else
                        f"; AdamW is {-margin:.0%} above it (needs to be >= {MIN_CONTROL_MARGIN:.0%} below)"))
    lines += [f"warning: {w}" for w in _warnings(rows, cfg)]
    lines += [_claim_note(m) for m in _out_of_claim(rows, cfg)]
    return lines

