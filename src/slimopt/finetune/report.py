"""The files ``slimopt finetune`` writes: results.md (the tables a person reads), results.csv (one row per task and
method, the mean over its seeds), runs.csv (every run, tuning runs included) and config.json.

The main table puts each method's score beside its memory: weights plus optimizer state (GaLore's Table 4), and
the peak of a training iteration measured tensor by tensor beside the planner's figure for it. The control row
(``head``) says whether the budget shows anything about training the body.
"""

from __future__ import annotations

import csv
import json
import os
import platform
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from slimopt import machine
from slimopt.compare.protocol import HEAD, SCORE, control_verdicts

__all__ = ["CSV_COLUMNS", "RUN_COLUMNS", "write_results", "read_results"]

CSV_COLUMNS = ["task", "method", "optimizer", "lora", "role", "status", "metric", "score", "score_std", "score_min",
               "score_max", "seeds", "seeds_ok", "metrics", "eval_loss", "train_loss", "steps", "s_per_step",
               "train_s", "weight_bytes", "state_bytes", "memory_bytes", "peak_bytes", "planned_peak_bytes",
               "trainable_params", "total_params", "lr", "lr_source", "clears_control", "settings"]
RUN_COLUMNS = ["task", "method", "kind", "seed", "status", "metric", "score", "metrics", "eval_loss", "train_loss",
               "steps", "s_per_step", "train_s", "state_bytes", "peak_bytes", "planned_peak_bytes", "lr", "chosen"]
_TEXT = frozenset({"task", "method", "optimizer", "status", "metric", "role", "lr_source", "kind"})
_BOOL = frozenset({"lora", "clears_control", "chosen"})
_INT = frozenset({"seed", "seeds", "seeds_ok", "steps", "weight_bytes", "state_bytes", "memory_bytes", "peak_bytes",
                  "planned_peak_bytes", "trainable_params", "total_params"})


def mib(nbytes: float) -> float:
    """Bytes in MiB."""
    return nbytes / 2**20


def _versions() -> str:
    import torch
    import transformers

    import slimopt

    parts = [f"slimopt {slimopt.__version__}", f"torch {torch.__version__}", f"transformers {transformers.__version__}"]
    try:
        import peft

        parts.append(f"peft {peft.__version__}")
    except ImportError:
        pass
    return ", ".join(parts) + f", Python {platform.python_version()}"


def _label(row: dict[str, Any], rank: int) -> str:
    if row.get("method") == HEAD:
        return "Control: head only (AdamW)"
    if row.get("lora"):
        base = f"LoRA r={rank}"
        return base if row["optimizer"] == "adamw" else f"{base} + {row['optimizer']}"
    if row.get("optimizer") == "adamw":
        return "Full FT (AdamW)"
    settings = row.get("settings") or {}
    label = f"{row['method']} r={settings['rank']}" if settings.get("rank") else row["method"]
    return f"{label}, state_full={settings['state_full']}" if settings.get("state_full") else label


def _ok(r: dict | None) -> bool:
    return bool(r) and r.get("status") == "ok"


def _score_cell(r: dict | None) -> str:
    if not _ok(r):
        return r["status"].split(":")[0] if r else ""
    if r.get("seeds", 1) > 1:
        return f"{100 * r['score']:.1f} [{100 * r['score_min']:.1f}-{100 * r['score_max']:.1f}]"
    return f"{100 * r['score']:.1f}"


def _annotate(rows: list[dict[str, Any]]) -> None:
    verdicts = control_verdicts(rows, SCORE, HEAD, group="task")
    for r in rows:
        r["clears_control"] = verdicts.get((r["task"], r["method"]))


def _control_lines(rows: list[dict[str, Any]]) -> list[str]:
    control = {r["task"]: r for r in rows if r["method"] == HEAD}
    if not control:
        return ["- No control row (--no-control): nothing here shows whether the budget measures how the methods "
                "train the body."]
    lines = [f"- Control (`{HEAD}`): AdamW on the new classification head alone, the pretrained body frozen. A "
             "method whose score is not above it has not shown that it trains the body (column 'above control')."]
    for task, c in control.items():
        adamw = next((r for r in rows if r["task"] == task and r.get("optimizer") == "adamw" and not r.get("lora")
                      and r["method"] != HEAD), None)
        if not (_ok(adamw) and _ok(c)):
            continue
        gap = 100 * (adamw["score"] - c["score"])
        overlap = adamw.get("seeds", 1) > 1 and adamw["score_min"] <= c["score_max"]
        if adamw["clears_control"]:
            lines.append(f"- {task}: full fine-tuning (AdamW) clears the control by {gap:.1f} points "
                         f"({_score_cell(adamw)} against {_score_cell(c)})"
                         + ("; the seeds' ranges overlap, so the gap is inside the noise." if overlap else "."))
        else:
            lines.append(f"- {task}: full fine-tuning (AdamW) does **not** clear the control ({_score_cell(adamw)} "
                         f"against {_score_cell(c)}): at this budget the head alone does as well, and the rows say "
                         "little about training the body; give more steps or examples.")
    return lines


def _markdown(rows: list[dict[str, Any]], cfg: Any, elapsed: float | None) -> str:
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    by = {(r["method"], r["task"]): r for r in rows}
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    budget = f"{cfg.max_steps} steps" if cfg.max_steps else f"{cfg.epochs:g} epoch(s)"
    seeds = (f"seeds {cfg.seed}-{cfg.seed + cfg.seeds - 1} (the head's initialisation and the batch order), scores "
             "the mean [min-max]" if cfg.seeds > 1 else f"seed {cfg.seed}")
    lr_text = (f"each method's lr tuned: x{', x'.join(f'{g:g}' for g in cfg.lr_grid)} of its default on the first "
               f"seed, extended by a factor of 2 past an edge while the best sat on it (at most {cfg.lr_extensions} "
               "times), the lowest validation loss kept (runs.csv)" if cfg.tune_lr else
               "each method at its default lr (slimopt.finetune.run.FINETUNE_LR; --tune-lr tunes them)")
    lines = [
        f"# slimopt finetune: {cfg.model} on {', '.join(tasks)}",
        "",
        f"- Date: {now}. Machine: {machine.describe()}. Versions: {_versions()}.",
        f"- Train examples per task <= {cfg.max_train_samples or 'all'}, validation <= "
        f"{cfg.max_eval_samples or 'all'} (stratified subsample, seed {cfg.seed}), max length {cfg.max_length} "
        f"tokens; batch {cfg.batch_size} x accumulation {cfg.grad_accum}, {budget}, linear schedule with warmup "
        f"{cfg.warmup:g}, clip {cfg.clip:g}, weight decay {cfg.weight_decay:g}, "
        f"{'bf16 autocast' if cfg.bf16 else 'fp32'}; {seeds}; {lr_text}.",
        "- Scores: the task's first metric x 100 on the validation split. Weights + state: bytes of all weights "
        "(frozen included) and the optimizer state (slimopt.state_nbytes after training), as in GaLore's Table 4. "
        "Peak: one training iteration (forward, backward, step) on a training batch, every tensor storage counted "
        "(bench/iteration_peak.py; max_memory_allocated on a GPU), beside the planner's figure for the same model, "
        "method, batch and length (`slimopt memory`); column planned / peak.",
        *_control_lines(rows),
    ]
    if elapsed is not None:
        lines.append(f"- Wall time of the command: {elapsed:.0f} s.")
    header = ("| Method | Weights + state MiB | Peak MiB | Planned peak MiB | " + " | ".join(
        f"{t} ({_task_metric(rows, t)})" for t in tasks) + (" | Avg |" if len(tasks) > 1 else " |")
        + " Above control |")
    lines += ["", header, "|---|---:|---:|---:|" + "---:|" * (len(tasks) + (len(tasks) > 1)) + "---|"]
    for m in methods:
        runs = [by.get((m, t)) for t in tasks]
        ok = [r for r in runs if _ok(r)]
        label = _label(ok[0], cfg.rank) if ok else m
        mem = [f"{mib(max(r[k] for r in ok)):.1f}" if ok else ""
               for k in ("memory_bytes", "peak_bytes", "planned_peak_bytes")]
        cells = [_score_cell(r) for r in runs]
        avg = [f"{100 * sum(r['score'] for r in ok) / len(ok):.1f}" if len(ok) == len(tasks) else ""]
        verdicts = {r.get("clears_control") for r in runs if r}
        above = "" if m == HEAD or verdicts == {None} else "yes" if verdicts == {True} else \
            "no" if verdicts == {False} else "on some tasks"
        lines.append(f"| {label} | " + " | ".join(mem + cells + (avg if len(tasks) > 1 else [])) + f" | {above} |")
    lines += ["", "Per task and method (means over the seeds):", "",
              "| task | method | metrics | val loss | train loss | trainable params | weights MiB | state MiB | "
              "state B/trainable param | planned / peak | s/step | steps | lr | lr from | settings |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        if not _ok(r):
            lines.append(f"| {r['task']} | {r['method']} | {r['status']} |" + " |" * 12)
            continue
        metrics = ", ".join(f"{k} {100 * v:.1f}" for k, v in r["metrics"].items())
        per_param = r["state_bytes"] / r["trainable_params"] if r["trainable_params"] else float("nan")
        settings = ", ".join(f"{k}={v}" for k, v in r["settings"].items()) or "-"
        lines.append(
            f"| {r['task']} | {r['method']} | {metrics} | {r['eval_loss']:.4f} | {r['train_loss']:.3f} | "
            f"{r['trainable_params']:,} | {mib(r['weight_bytes']):.1f} | {mib(r['state_bytes']):.2f} | "
            f"{per_param:.2f} | {r['planned_peak_bytes'] / r['peak_bytes']:.3f} | {r['s_per_step']:.3f} | "
            f"{r['steps']} | {r['lr']:.3g} | {r['lr_source']} | {settings} |")
    lines.append("")
    return "\n".join(lines)


def _task_metric(rows: list[dict[str, Any]], task: str) -> str:
    return next((r["metric"] for r in rows if r["task"] == task and r.get("metric")), "")


def _all_runs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every run behind the rows: each seed's run, and the tuning runs (kind "tune"; the chosen one is also the
    first seed's run)."""
    out = []
    for r in rows:
        seeds = r.get("runs") or []
        for p in r.get("sweep") or []:
            if p.get("chosen"):
                continue  # listed below as the first seed's run
            out.append({"task": r["task"], "method": r["method"], "kind": "tune", "seed": r.get("seed"),
                        "status": p["status"], "eval_loss": p.get("val_loss"), "score": p.get("score"),
                        "lr": p["lr"], "chosen": False})
        for run in seeds:
            out.append({**run, "kind": "seed", "chosen": bool(r.get("sweep")) and run is seeds[0]})
    return out


def write_results(rows: list[dict[str, Any]], cfg: Any, out: Path | str, elapsed: float | None = None) -> None:
    """results.md, results.csv (one row per task and method), runs.csv (every run) and config.json into `out`."""
    from slimopt.atomic import write_atomic
    from slimopt.train.results import write_csv, write_csv_and_markdown

    _annotate(rows)
    out = write_csv_and_markdown(out, CSV_COLUMNS, rows, _markdown(rows, cfg, elapsed))
    write_csv(out / "runs.csv", RUN_COLUMNS, _all_runs(rows))
    write_atomic(out / "config.json", json.dumps(asdict(cfg), indent=2, default=str))


def read_results(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a results.csv or runs.csv with numbers, booleans and the metrics / settings dicts parsed."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for k, v in list(r.items()):
            if k in ("metrics", "settings"):
                r[k] = json.loads(v) if v else {}
            elif k in _BOOL:
                r[k] = {"True": True, "False": False}.get(v)
            elif k in _INT:
                r[k] = int(float(v)) if v not in ("", None) else None
            elif k not in _TEXT:
                r[k] = float(v) if v not in ("", None) else None
    return rows
