"""The files `slimopt compare` writes: results.md, results.csv, results_per_seed.csv, the learning-rate sweep's
lr_sweep.csv / .json / .png, and the loss-curve and memory figures (plots.py); and ``read_results`` to read them.

results.md says how every number was measured above the table, the warnings a reader must see before the numbers,
then the table, the ranking with the noise of the seeds, the sweep and the command that reproduces a row.

Details: docs/modules.md, ``slimopt.compare``.
"""

from __future__ import annotations

import csv
import math
import os
import re
from datetime import datetime, timezone
from pathlib import Path

from slimopt import machine
from slimopt.compare.analysis import MIN_CONTROL_MARGIN, ranking_text
from slimopt.compare.config import (
    _MIN_REFRESHES,
    _MIN_SCALED_GAP,
    CompareConfig,
    _full_steps,
    _seed_list,
    _steps,
    _tune_steps,
    at_default_setting,
)
from slimopt.compare.notes import _claim_note, _control_row, _noise_text, _out_of_claim, _warnings
from slimopt.compare.protocol import CONTROL
from slimopt.compare.runner import jobs_for
from slimopt.train.loop import TrainConfig, tokenizer_name
from slimopt.train.results import write_csv, write_csv_and_markdown, write_json

__all__ = ["CSV_COLUMNS", "SEED_CSV_COLUMNS", "SWEEP_COLUMNS", "write_results", "read_results"]

CSV_COLUMNS = ("method", "kind", "status", "val_loss", "val_ppl", "start_val_ppl", "state_mib",
               "state_bytes_per_param", "peak_mem_mib", "tokens_per_s", "wall_time_s", "cpu_time_s", "lr", "settings",
               "steps", "tokens", "trainable_params", "params", "role", "seeds", "seeds_ok", "val_loss_std",
               "val_ppl_std", "val_ppl_min", "val_ppl_max", "lr_source", "lr_multiplier", "clears_control",
               "plan_model", "plan_state_gib", "plan_peak_gib", "plan_fits", "notes")
# One row per run (method x seed): results_per_seed.csv.
SEED_CSV_COLUMNS = ("method", "role", "seed", "kind", "status", "val_loss", "val_ppl", "start_val_ppl", "state_mib",
                    "state_bytes_per_param", "peak_mem_mib", "tokens_per_s", "wall_time_s", "cpu_time_s", "lr",
                    "settings", "steps", "tokens", "trainable_params", "params")
# One row per learning-rate sweep point: lr_sweep.csv.
SWEEP_COLUMNS = ("method", "multiplier", "lr", "base_lr", "steps", "seed", "status", "val_loss", "val_ppl", "chosen")
_TEXT_COLUMNS = frozenset({"method", "kind", "status", "settings", "role", "lr_source", "plan_model", "notes"})
_BOOL_COLUMNS = frozenset({"clears_control", "chosen", "plan_fits"})


def _fmt(v, spec: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "nan" if isinstance(v, float) else ""
    return format(v, spec)


def write_results(rows: list[dict], cfg: CompareConfig, out: Path, elapsed: float | None = None,
                  sweeps: dict | None = None) -> None:
    """results.csv (one row per method), results_per_seed.csv (one per run), results.md, loss_curves.png and
    memory.png in `out`; with a learning-rate sweep also lr_sweep.csv / .json / .png."""
    out = write_csv_and_markdown(out, CSV_COLUMNS, rows, _markdown(rows, cfg, elapsed, sweeps or {}))
    per_seed = [run for r in rows for run in r.get("runs", [r])]
    write_csv(out / "results_per_seed.csv", SEED_CSV_COLUMNS, per_seed)
    from slimopt.compare.plots import plot_loss_curves, plot_memory
    plot_loss_curves(rows, out / "loss_curves.png", title=_title(cfg, curves=True))
    plan = None if cfg.plan is None else (next((r["plan_model"] for r in rows if r.get("plan_model")),
                                                   cfg.plan.model), cfg.plan.budget, cfg.plan.gpu_memory)
    plot_memory(rows, out / "memory.png", title=_title(cfg), plan=plan)
    if sweeps:
        _write_sweep(sweeps, cfg)


def _write_sweep(sweeps: dict, cfg: CompareConfig) -> None:
    """lr_sweep.csv (one row per grid point), lr_sweep.json (the same with each method's choice) and
    lr_sweep.png (validation loss against lr per method, log x axis) in cfg.out."""
    out = Path(cfg.out)
    points = [p for entry in sweeps.values() for p in entry["points"]]
    write_csv(out / "lr_sweep.csv", SWEEP_COLUMNS, points)
    write_json(out / "lr_sweep.json", {
        "fraction": cfg.tune_fraction, "steps": _tune_steps(cfg),
        "full_steps": _full_steps(cfg), "seed": cfg.base.seed, "selection": "lowest validation loss",
        "extensions": cfg.lr_extensions,
        "methods": {m: {"grid": e["grid"], "extended": e["extended"], "edge": e["edge"],
                        "base_lr": e["base_lr"], "base_lr_source": e["base_lr_source"],
                        "chosen_lr": e["chosen"]["lr"] if e["chosen"] else None,
                        "chosen_multiplier": e["chosen"]["multiplier"] if e["chosen"] else None,
                        "points": e["points"]} for m, e in sweeps.items()}})
    from slimopt.compare.plots import plot_lr_sweep
    plot_lr_sweep(sweeps, out / "lr_sweep.png",
                  title=f"{_title(cfg, seeds=False)}: validation loss after {_tune_steps(cfg)} of "
                        f"{_full_steps(cfg)} steps, seed {cfg.base.seed}")


def read_results(path: str | os.PathLike) -> list[dict]:
    """The rows of a results.csv (or results_per_seed.csv, lr_sweep.csv), numbers and True/False parsed."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for k, v in r.items():
            if k in _TEXT_COLUMNS:
                continue
            if k in _BOOL_COLUMNS:
                r[k] = {"True": True, "False": False}.get(v)
                continue
            r[k] = float(v) if v not in ("", None) else None
    return rows


def _title(cfg: CompareConfig, seeds: bool = True, curves: bool = False) -> str:
    b = cfg.base
    steps = _steps(b)
    data = Path(b.data).name if Path(b.data).expanduser().exists() else b.data  # a path: its file or folder name
    title = f"{b.model} on {data}, {steps * b.batch_size * b.seq_len:,} tokens"
    if not seeds:
        return title
    s = _seed_list(cfg)
    if len(s) == 1:
        return f"{title}, seed {s[0]}"
    return f"{title}, seeds {s[0]}-{s[-1]}" + (f" (curves: seed {s[0]})" if curves else "")



def _markdown(rows: list[dict], cfg: CompareConfig, elapsed: float | None, sweeps: dict) -> str:
    """results.md: how it was measured, the warnings, the table, the ranking, the sweep, the figures."""
    multi = len(_seed_list(cfg)) > 1
    lines = [f"# slimopt compare: {_title(cfg)}", "", *_setting_lines(rows, cfg, sweeps),
             *_measure_lines(rows, cfg, elapsed)]
    warns = _warnings(rows, cfg)
    if warns:
        lines.append("")
        lines += [f"> **Warning:** {w}\n>" for w in warns]
        lines[-1] = lines[-1][:-2]
    lines += ["", *_table_lines(rows, cfg)]
    ranked = ranking_text(rows, _control_row(rows))
    if ranked:
        lines += ["", f"Ranking by validation perplexity (lower is better{'; mean ± std' if multi else ''}): "
                      f"{ranked}.", "", _noise_text(rows, cfg)]
    lines += [f"\n{_claim_note(m)}" for m in _out_of_claim(rows, cfg)]
    if sweeps:
        lines += ["", *_sweep_table(sweeps, cfg), "", "![lr sweep](lr_sweep.png)"]
    b = cfg.base
    lines += ["", "![loss curves](loss_curves.png)", "", "![memory](memory.png)", "",
              "Reproduce one row: `slimopt train " + _cli_args(b) + " --method METHOD --lr LR` (LR: column lr"
              + (", and --seed for each seed" if multi else "")
              + ("; --opt KEY=VALUE for each of column settings" if any(r.get("settings") for r in rows) else "")
              + (("; a row NAME+KEY=VALUE is --method NAME") if any("+" in r["method"] for r in rows) else "")
              + ").", ""]
    return "\n".join(lines)


def _lr_text(cfg: CompareConfig, sweeps: dict) -> str:
    """Where the learning rates come from: tuned, the default setting's tuned ones, or the papers'."""
    if cfg.tune_lr:
        lr_text = (f"each method's learning rate tuned: {len(cfg.lr_grid)} runs of {_tune_steps(cfg)} steps "
                   f"(x{', x'.join(f'{g:g}' for g in cfg.lr_grid)} of its default; seed {cfg.base.seed}), extended "
                   f"by a factor of 2 past the edge while the best sat on it (at most {cfg.lr_extensions} times), "
                   f"the one with the lowest validation loss kept (columns lr, lr from; lr_sweep.csv, lr_sweep.png)")
    elif at_default_setting(cfg):
        lr_text = ("each method at the learning rate that a tuned 3-seed run of this setting picked, or its paper's "
                   "where that run had none (columns lr, lr from; --tune-lr tunes them)")
    else:
        lr_text = ("each method at its paper learning rate (columns lr, lr from; --tune-lr tunes them)")
    if CONTROL in sweeps:
        lr_text += (f"; the control at the best of x{', x'.join(f'{g:g}' for g in sweeps[CONTROL]['grid'])} of "
                    f"{sweeps[CONTROL]['base_lr']:g} on runs of {_tune_steps(cfg)} steps")
    return lr_text


def _setting_lines(rows: list[dict], cfg: CompareConfig, sweeps: dict) -> list[str]:
    """The report's lines on what was trained: date and machine, the setting, validation, the control."""
    b = cfg.base
    seeds = _seed_list(cfg)
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    seed_text = (f"seeds {seeds[0]}-{seeds[-1]} (initialisation and batch order), each number the mean over the "
                 f"seeds; spread: min-max and sample standard deviation of the seeds' perplexities"
                 if len(seeds) > 1 else f"seed {seeds[0]}")
    tokenizer = tokenizer_name(b) or f"byte-level BPE, vocab {b.vocab_size}"
    lines = [
        f"- Date: {now}. Machine: {_machine_text(rows, cfg)}.",
        f"- Model {b.model}, data {b.data} (tokenizer: {tokenizer}), "
        f"seq_len {b.seq_len}, batch {b.batch_size} x grad-accum {b.grad_accum}, {_steps(b)} steps, dtype {b.dtype}, "
        f"warmup {b.warmup}, cosine to {b.min_lr_ratio} x peak, clip {b.clip}, weight decay {b.weight_decay}; "
        f"{seed_text}; {_lr_text(cfg, sweeps)}.",
        f"- Validation: true mean cross-entropy over {_val_tokens(rows)} held-out tokens (documents never trained "
        f"on); perplexity = exp(loss).",
    ]
    start = next((r["start_val_ppl"] for r in rows if r.get("start_val_ppl") is not None), None)
    if start is not None:
        lines.append(f"- Before training: the loaded model's held-out perplexity is {start:.2f} (the same blocks; "
                     f"column val ppl is after).")
    if _control_row(rows) is not None:
        lines.append(f"- Control (`{CONTROL}`): AdamW on the embeddings, norms and output layer only, every "
                     f"projectable weight (the attention and MLP Linear weights the methods act on) frozen at its "
                     f"initialisation. A method whose perplexity is not below it has shown nothing about how it "
                     f"trains those weights (column notes). AdamW should beat it by at least "
                     f"{MIN_CONTROL_MARGIN:.0%}, or the budget measures token statistics rather than optimizers.")
    else:
        lines.append("- No control row (--no-control): nothing here shows whether the budget measures the "
                     "methods' training of the transformer weights.")
    return lines


def _measure_lines(rows: list[dict], cfg: CompareConfig, elapsed: float | None) -> list[str]:
    """The report's lines on how the columns were measured: planned memory, peak, time, scaled settings."""
    lines = []
    plan_text = _plan_text(rows, cfg)
    if plan_text:
        lines.append(plan_text)
    kinds = sorted({r["peak_mem_kind"] for r in rows if r.get("peak_mem_kind")})
    lines.append(f"- Peak memory: {'; '.join(kinds) or 'n/a'}. Optimizer state: bytes of every state tensor as "
                 f"allocated. Tokens/s: training steps only; wall s: the whole run (model build, evaluations); "
                 f"CPU s: processor time of the run over all its threads, which other work on the machine does not "
                 f"inflate.")
    jobs = jobs_for(cfg)
    if elapsed is not None:
        lines.append(f"- Wall time of the whole comparison: {elapsed:.0f} s"
                     + (f", {jobs} runs at a time (each run's tokens/s and wall s include sharing the machine "
                        "with the others; CPU s does not)." if jobs > 1 else "."))
    lines.append(f"- Step-counting settings (subspace refresh / block switch / restart intervals) are scaled to the "
                 f"run when it is shorter than {_MIN_REFRESHES} of the papers' intervals (update gap: steps / "
                 f"{_MIN_REFRESHES}, never below {_MIN_SCALED_GAP} steps): column settings gives each row's, and "
                 f"column lr the learning rate it ran at.")
    return lines


def _table_lines(rows: list[dict], cfg: CompareConfig) -> list[str]:
    """The results table: one line per method, the spread columns with several seeds, the planned ones with a
    plan."""
    multi = cfg.seeds > 1
    spread_head = " ppl min-max | ppl std |" if multi else ""
    spread_align = "---:|---:|" if multi else ""
    planned = cfg.plan is not None
    plan_head = (f" planned state GiB ({cfg.plan.model}) | planned peak GiB ({cfg.plan.model}) | "
                 f"fits {cfg.plan.gpu_memory} |" if planned else "")
    plan_align = "---:|---:|---|" if planned else ""
    lines = [f"| method | kind | val ppl | val loss |{spread_head} state MiB | state B/param | peak MiB | "
             f"tokens/s | wall s | CPU s |{plan_head} lr | lr from | settings | notes |",
             f"|---|---|---:|---:|{spread_align}---:|---:|---:|---:|---:|---:|{plan_align}---:|---|---|---|"]
    for r in rows:
        plan_cells = ""
        if planned:
            fits = {True: "yes", False: "no"}.get(r.get("plan_fits"), "")
            plan_cells = (f" {_fmt(r.get('plan_state_gib'), '.2f')} | {_fmt(r.get('plan_peak_gib'), '.2f')} | "
                          f"{fits} |")
        tail = (f"{plan_cells} {_fmt(r.get('lr'), 'g')} | {r.get('lr_source', '')} | {r.get('settings', '')} | "
                f"{r.get('notes', '')} |")
        blank_spread = " | |" if multi else ""
        if r["status"].startswith("failed"):
            lines.append(f"| {r['method']} | {r['kind']} | {r['status']} | |{blank_spread} | | | | | |{tail}")
            continue
        ppl = _fmt(r["val_ppl"], ".2f") if r["status"] == "ok" else "diverged"
        spread = ""
        if multi:
            rng = (f"{r['val_ppl_min']:.2f}-{r['val_ppl_max']:.2f}" if r.get("val_ppl_min") is not None else "")
            spread = f" {rng} | {_fmt(r.get('val_ppl_std'), '.2f')} |"
        lines.append(f"| {r['method']} | {r['kind']} | {ppl} | {_fmt(r['val_loss'], '.4f')} |{spread} "
                     f"{_fmt(r['state_mib'], '.3f')} | {_fmt(r['state_bytes_per_param'], '.2f')} | "
                     f"{_fmt(r['peak_mem_mib'], '.0f')} | {_fmt(r['tokens_per_s'], ',.0f')} | "
                     f"{_fmt(r['wall_time_s'], '.1f')} | {_fmt(r['cpu_time_s'], '.1f')} |{tail}")
    return lines


def _machine_text(rows: list[dict], cfg: CompareConfig) -> str:
    """machine.describe() with the torch threads of the runs (recorded by each run; before any has run, --threads)
    in place of this process's, which no run uses: each run sets its own count (--threads)."""
    used = sorted({r["torch_threads"] for row in rows for r in row.get("runs", [row]) if r.get("torch_threads")})
    n = "/".join(str(t) for t in used) if used else None if cfg.base.threads is None else str(cfg.base.threads)
    threads = ("torch's default threads per run" if n is None else
               f"{n} torch thread{'' if n == '1' else 's'} per run")
    text, found = re.subn(r"\b\d+ torch threads?\b", threads, machine.describe())
    return text if found else f"{text}; {threads}"


def _plan_text(rows: list[dict], cfg: CompareConfig) -> str:
    """The report's line on the planned columns: where, how, and the call that prints one of them."""
    if cfg.plan is None:
        return ""
    ps = cfg.plan
    example = next((r.get("plan_command") for r in rows if r.get("plan_command")), None)
    model = next((r.get("plan_model") for r in rows if r.get("plan_model")), ps.model)
    return (f"- Planned memory (columns planned ..., memory.png's right panel): what the same method would hold at "
            f"{model}, as `slimopt memory` plans it: {ps.dtype} weights, batch {ps.batch} x {ps.seq} tokens"
            f"{', layer-wise updates' if ps.layerwise else ''}; state = optimizer state with projections, peak = one "
            f"training step's, fits = peak within {ps.gpu_memory} (--plan-model, --plan-gpu-memory)"
            + (f"; e.g. `{example}`" if example else "")
            + ". Baselines the planner does not model have none. The measured state and peak above are at this "
            "run's size, where the peak is mostly the runtime's own memory.")


def _sweep_table(sweeps: dict, cfg: CompareConfig) -> list[str]:
    """Validation loss of every sweep point, the chosen one in bold."""
    grid = sorted({g for e in sweeps.values() for g in e["grid"]})
    lines = [f"Learning-rate sweep ({_tune_steps(cfg)} of {_full_steps(cfg)} steps, seed {cfg.base.seed}): "
             f"validation loss at each multiple of the default lr; the chosen one in bold; a best point on the "
             f"grid's edge tried a factor of 2 beyond it, up to {cfg.lr_extensions} times.", "",
             "| method | default lr | " + " | ".join(f"x{g:g}" for g in grid) + " | chosen lr |",
             "|---|---:|" + "---:|" * len(grid) + "---:|"]
    for m, e in sweeps.items():
        cells = []
        by_mult = {p["multiplier"]: p for p in e["points"]}
        for g in grid:
            p = by_mult.get(float(g))
            if p is None:
                cells.append("")
            elif p["status"] != "ok":
                cells.append(_short(p["status"]))
            else:
                cells.append(f"**{p['val_loss']:.4f}**" if p["chosen"] else f"{p['val_loss']:.4f}")
        chosen = f"{e['chosen']['lr']:.3g}" if e["chosen"] else "none finished"
        if e.get("edge"):
            chosen += " (on the edge)"
        lines.append(f"| {m} | {e['base_lr']:g} | " + " | ".join(cells) + f" | {chosen} |")
    return lines


def _short(status: str) -> str:
    return "failed" if status.startswith("failed") else status


def _val_tokens(rows: list[dict]) -> str:
    n = next((r["val_tokens"] for r in rows if r.get("val_tokens")), None)
    return f"{n:,}" if n else "the"


def _cli_args(b: TrainConfig) -> str:
    parts = [f"--model {b.model}", f"--data {b.data}", f"--seq-len {b.seq_len}", f"--batch-size {b.batch_size}"]
    if b.grad_accum != 1:
        parts.append(f"--grad-accum {b.grad_accum}")
    parts.append(f"--max-steps {_steps(b)}")
    if b.tokenizer:
        parts.append(f"--tokenizer {b.tokenizer}")
    else:
        parts.append(f"--vocab-size {b.vocab_size}")
    parts += [f"--seed {b.seed}", f"--dtype {b.dtype}", f"--eval-tokens {b.eval_tokens}"]
    return " ".join(parts)
