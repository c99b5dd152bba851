"""`slimopt compare`: train several methods on the same data, seed and token budget, and report what each costs.

The experiment of the GaLore (arXiv 2403.03507, Table 2) and FRUGAL (arXiv 2411.07837, Table 2) papers, at any
scale: every method pretrains the same model from the same initialisation on the same batches for the same number
of tokens with its own paper learning rate, then the held-out perplexity, optimizer-state size, peak memory and
speed go side by side into `results.md` / `results.csv`, with loss curves and a memory chart as PNG.

Each method runs in a fresh process forked from a server that has already imported torch and transformers, so
one method's allocations never inflate the next one's peak memory, a crash in one method does not stop the others,
and the import cost is paid once. `isolate=False` runs them in this process instead (peak memory then only
bounds growth and is marked so).
"""

from __future__ import annotations

import csv
import math
import multiprocessing
import os
import platform
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

from slimopt.train.loop import TrainConfig, known_methods, method_kind, train
from slimopt.train.results import write_csv_and_markdown

__all__ = ["DEFAULT_METHODS", "CompareConfig", "default_methods", "run_compare", "write_results", "read_results",
           "CSV_COLUMNS", "scaled_schedule_opts"]

# In the order the table lists them: full Adam, low-bit Adam, subspace methods, block methods, state-free
# extremes, then the low-rank baselines the GaLore paper shows failing at pretraining.
DEFAULT_METHODS = ("adamw", "adamw8bit", "galore", "frugal", "frugal_rho0", "badam", "ternary_adamw", "taco",
                   "lowrank", "lora", "relora")

CSV_COLUMNS = ("method", "kind", "status", "val_loss", "val_ppl", "state_mib", "state_bytes_per_param",
               "peak_mem_mib", "tokens_per_s", "wall_time_s", "cpu_time_s", "lr", "settings", "steps", "tokens",
               "trainable_params", "params")


def default_methods() -> list[str]:
    """DEFAULT_METHODS that exist in this installation."""
    known = known_methods()
    return [m for m in DEFAULT_METHODS if m in known]


def _compare_defaults() -> TrainConfig:
    # Sized to finish the default method set in about 3-5 minutes on 2 CPU cores (see docs/pretraining.md):
    # 128 steps of 16 x 64 tokens, a 2048-token BPE (the output layer dominates a tiny model's step). One torch
    # thread: the tiny model gains little from a second one, and on a machine busy with other work, OpenMP
    # threads competing for the cores slow every step several-fold (--threads changes it).
    return TrainConfig(model="tiny", data="kjv", vocab_size=2048, seq_len=64, batch_size=16, tokens=131_072,
                       eval_tokens=8192, eval_every=None, threads=1, progress=False, save_model=False,
                       tensorboard=False)


# A run shorter than this many refreshes of a method's default gap gets a gap scaled to the run (below).
_MIN_REFRESHES = 20


def scaled_schedule_opts(method: str, steps: int) -> dict:
    """Hyperparameters that count steps, scaled down for runs too short for the papers' values.

    GaLore refreshes its subspace, FRUGAL and BAdam switch blocks every `update_gap` steps (200 / 100 in the
    papers, where runs last 10k+ steps); ReLoRA restarts every 5k steps. In a 100-step comparison those events
    would never happen and each method would silently become a different one. Runs with fewer than
    20 gaps' worth of steps get `update_gap = steps // 20` (ReLoRA: 4 restarts, re-warmup a tenth of the cycle).
    """
    kind = method_kind(method)
    if kind == "baseline":
        if method != "relora":
            return {}
        every = max(2, steps // 4)
        return {"restart_every": every, "restart_warmup": max(1, every // 10)}
    if kind != "slimopt":
        gap = 200 if method.startswith(("galore", "apollo")) else None
    else:
        gap = _recipe_gap(method)
    if gap is None or steps >= _MIN_REFRESHES * gap:
        return {}
    return {"update_gap": max(1, steps // _MIN_REFRESHES)}


def _recipe_gap(method: str) -> int | None:
    try:
        from slimopt.optim.recipes import METHODS
    except ImportError:
        return None
    spec = METHODS.get(method)
    if spec is None:
        return None
    for settings in (spec.projectable, spec.rest):
        if settings.get("update_gap") and settings.get("projector", "none") != "none":
            return int(settings["update_gap"])
    return None


@dataclass
class CompareConfig:
    """What to compare: `base` holds every shared setting; `methods` the names; `method_opts` per-method extras
    (e.g. {"galore": {"rank": 64}, "frugal": {"lr": 3e-3}}: the key "lr" sets that method's learning rate)."""

    base: TrainConfig = field(default_factory=_compare_defaults)
    methods: list[str] | None = None
    method_opts: dict[str, dict] = field(default_factory=dict)
    out: str = "runs/compare"
    isolate: bool = True
    progress: bool = True


def _method_config(cfg: CompareConfig, method: str) -> TrainConfig:
    from slimopt.train.loop import _total_steps
    extra = {**scaled_schedule_opts(method, _total_steps(cfg.base)), **cfg.method_opts.get(method, {})}
    lr = extra.pop("lr", None)
    return replace(cfg.base, method=method, opt={**cfg.base.opt, **extra}, lr=lr if lr is not None else None,
                   out=str(Path(cfg.out) / "runs" / method), overwrite=True, resume=False, save_every=0,
                   save_model=False, tensorboard=False)


def _validate(cfg: CompareConfig, methods: list[str]) -> None:
    from slimopt.peers import available_peers
    from slimopt.train.loop import _check_config
    if not methods:
        raise ValueError("no methods to compare")
    dup = sorted({m for m in methods if methods.count(m) > 1})
    if dup:
        raise ValueError(f"methods listed twice: {', '.join(dup)}")
    peers = available_peers()
    for m in methods:
        if method_kind(m) == "peer" and peers[m] is not None:
            raise ImportError(f"peer {m!r} cannot run here: {peers[m]}")
    unknown = sorted(set(cfg.method_opts) - set(methods))
    if unknown:
        raise ValueError(f"per-method options given for methods not compared: {', '.join(unknown)}")
    for m in methods:
        _check_config(replace(_method_config(cfg, m), out=None), world_size=1)
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")


def _dry_build(tc: TrainConfig, vocab_size: int) -> None:
    """Build the model on the meta device (no memory, no init cost) and the method's optimizer over it, so a bad
    hyperparameter of the 5th method fails before the 1st one trains."""
    import warnings

    from slimopt.train import models
    from slimopt.train.loop import make_optimizer
    if tc.model.lower() not in models.LLAMA_SIZES:
        return  # a checkpoint would have to be read; its method settings are checked when its run starts
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # libraries' deprecation notices say nothing about this run
            model = models.build_model(tc.model, vocab_size, tc.seq_len, seed=tc.seed, device="meta")
            if method_kind(tc.method) == "baseline":
                from slimopt import baselines
                model, _ = baselines.prepare(model, tc.method, seed=tc.seed, **tc.opt)
                make_optimizer(model, tc.method, lr=tc.lr, weight_decay=tc.weight_decay)
            else:
                make_optimizer(model, tc.method, lr=tc.lr, weight_decay=tc.weight_decay, **tc.opt)
    except ValueError as e:
        raise ValueError(f"method {tc.method!r}: {e}") from e
    except Exception:  # noqa: BLE001 - something meta tensors cannot do; the real run will tell
        return


def _child_train(cfg: TrainConfig) -> dict:
    # Runs in a forked worker: keep the worker's output free of warnings that say nothing about the run.
    import warnings
    for category in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    return train(cfg)


_PRELOAD = ["slimopt", "slimopt.train.loop", "slimopt.train.models", "slimopt.train.data", "slimopt.peers",
            "transformers.models.llama.modeling_llama"]


def _run_isolated(cfg: TrainConfig) -> dict:
    import importlib.util
    ctx = multiprocessing.get_context("forkserver")
    optional = [m for m in ("peft",) if importlib.util.find_spec(m) is not None]
    ctx.set_forkserver_preload(_PRELOAD + optional)
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx, max_tasks_per_child=1) as ex:
        return ex.submit(_child_train, cfg).result()


def run_compare(cfg: CompareConfig, log=print) -> list[dict]:
    """Train every method, write the results into `cfg.out`, return one row per method (see CSV_COLUMNS)."""
    methods = list(cfg.methods) if cfg.methods else default_methods()
    _validate(cfg, methods)  # all checks before the first write or the first step
    from slimopt.train.loop import _prepare_data, _total_steps
    t0 = time.perf_counter()
    _, packed = _prepare_data(cfg.base, _total_steps(cfg.base))  # once, so every run hits the cache
    for m in methods:
        _dry_build(_method_config(cfg, m), packed.vocab_size)
    steps = _total_steps(cfg.base)
    log(f"slimopt compare: {len(methods)} methods x {steps} steps of {cfg.base.batch_size}x{cfg.base.seq_len} "
        f"tokens ({steps * cfg.base.batch_size * cfg.base.seq_len:,} tokens), model {cfg.base.model}, "
        f"data {cfg.base.data} ({packed.train.shape[0]:,} train blocks), seed {cfg.base.seed}")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, m in enumerate(methods, 1):
        tc = replace(_method_config(cfg, m), progress=cfg.progress)
        try:
            res = _run_isolated(tc) if cfg.isolate else train(tc)
            row = _row(res, m)
            row["settings"] = _settings(tc)
        except Exception as e:  # one method failing must not lose the others' results
            tb = traceback.format_exc(limit=3)
            row = {"method": m, "kind": method_kind(m), "status": f"failed: {type(e).__name__}: {e}",
                   "settings": _settings(tc), "history": {"train": [], "eval": []}}
            (out / "runs" / m).mkdir(parents=True, exist_ok=True)
            (out / "runs" / m / "error.txt").write_text(tb)
        if not cfg.isolate and row.get("status") == "ok":
            row["peak_mem_kind"] += " (in-process: later methods reuse freed memory)"
        rows.append(row)
        log(f"[{i}/{len(methods)}] {_summary_line(row)}")
        write_results(rows, cfg, out, elapsed=time.perf_counter() - t0)  # partial results survive a crash
    write_results(rows, cfg, out, elapsed=time.perf_counter() - t0)
    log(f"results: {out / 'results.md'} ({time.perf_counter() - t0:.0f} s in all)")
    return rows


def _settings(tc: TrainConfig) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(tc.opt.items()))


def _row(res: dict, method: str) -> dict:
    ok = math.isfinite(res["val_loss"])
    return {
        "method": method, "kind": method_kind(method), "status": "ok" if ok else "diverged",
        "val_loss": res["val_loss"], "val_ppl": res["val_ppl"], "val_tokens": res["val_tokens"],
        "state_mib": res["state_bytes"] / 2**20, "state_bytes_per_param": res["state_bytes_per_param"],
        "peak_mem_mib": res["peak_mem_bytes"] / 2**20, "peak_mem_kind": res["peak_mem_kind"],
        "tokens_per_s": res["tokens_per_s"], "wall_time_s": res["wall_time_s"], "cpu_time_s": res["cpu_time_s"],
        "lr": res["lr"],
        "steps": res["steps"], "tokens": res["tokens"], "trainable_params": res["trainable_params"],
        "params": res["params"], "device": res["device"], "history": res["history"],
    }


def _summary_line(r: dict) -> str:
    if r["status"].startswith("failed"):
        return f"{r['method']}: {r['status']}"
    return (f"{r['method']}: val ppl {r['val_ppl']:.2f}, state {r['state_mib']:.3f} MiB "
            f"({r['state_bytes_per_param']:.2f} B/param), peak {r['peak_mem_mib']:.0f} MiB, "
            f"{r['tokens_per_s']:,.0f} tok/s, {r['wall_time_s']:.1f} s")


# --------------------------------------------------------------------------------------------- reports

def _fmt(v, spec: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "nan" if isinstance(v, float) else ""
    return format(v, spec)


def _machine() -> str:
    import torch
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    dev = f"{torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "no GPU"
    return (f"{cpu}, {os.cpu_count()} CPU cores, {dev}; Python {platform.python_version()}, torch {torch.__version__}, "
            f"{platform.system()} {platform.release()}")


def write_results(rows: list[dict], cfg: CompareConfig, out: Path, elapsed: float | None = None) -> None:
    """results.csv, results.md, loss_curves.png and memory.png in `out`."""
    out = write_csv_and_markdown(out, CSV_COLUMNS, rows, _markdown(rows, cfg, elapsed))
    from slimopt.train.compare_plots import plot_loss_curves, plot_memory
    plot_loss_curves(rows, out / "loss_curves.png", title=_title(cfg))
    plot_memory(rows, out / "memory.png", title=_title(cfg))


def read_results(path: str | os.PathLike) -> list[dict]:
    """The rows of a results.csv, numbers parsed."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for k, v in r.items():
            if k in ("method", "kind", "status", "settings"):
                continue
            r[k] = float(v) if v not in ("", None) else None
    return rows


def _title(cfg: CompareConfig) -> str:
    b = cfg.base
    steps = _steps(b)
    data = Path(b.data).name if Path(b.data).expanduser().exists() else b.data  # a path: its file or folder name
    return f"{b.model} on {data}, {steps * b.batch_size * b.seq_len:,} tokens, seed {b.seed}"


def _steps(b: TrainConfig) -> int:
    from slimopt.train.loop import _total_steps
    return _total_steps(b)


def _markdown(rows: list[dict], cfg: CompareConfig, elapsed: float | None) -> str:
    b = cfg.base
    steps = _steps(b)
    kinds = sorted({r["peak_mem_kind"] for r in rows if r.get("peak_mem_kind")})
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"# slimopt compare: {_title(cfg)}",
        "",
        f"- Date: {now}. Machine: {_machine()}.",
        f"- Model {b.model}, data {b.data} (tokenizer: {b.tokenizer or f'byte-level BPE, vocab {b.vocab_size}'}), "
        f"seq_len {b.seq_len}, batch {b.batch_size} x grad-accum {b.grad_accum}, {steps} steps, dtype {b.dtype}, "
        f"warmup {b.warmup}, cosine to {b.min_lr_ratio} x peak, clip {b.clip}, weight decay {b.weight_decay}, "
        f"seed {b.seed}; each method at its paper learning rate (column lr).",
        f"- Validation: true mean cross-entropy over {_val_tokens(rows)} held-out tokens (documents never trained "
        f"on); perplexity = exp(loss).",
        f"- Peak memory: {'; '.join(kinds) or 'n/a'}. Optimizer state: bytes of every state tensor as allocated. "
        f"Tokens/s: training steps only; wall s: the whole run (model build, evaluations); CPU s: processor time "
        f"of the run over all its threads, which other work on the machine does not inflate.",
    ]
    if elapsed is not None:
        lines.append(f"- Wall time of the whole comparison: {elapsed:.0f} s.")
    lines.append(f"- Step-counting settings (subspace refresh / block switch / restart intervals) are scaled to the "
                 f"run when it is shorter than {_MIN_REFRESHES} of the papers' intervals: column settings.")
    lines += ["", "| method | kind | val ppl | val loss | state MiB | state B/param | peak MiB | tokens/s | wall s "
              "| CPU s | lr | settings |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r["status"].startswith("failed"):
            lines.append(f"| {r['method']} | {r['kind']} | {r['status']} | | | | | | | | | {r.get('settings', '')} |")
            continue
        ppl = _fmt(r["val_ppl"], ".2f") if r["status"] == "ok" else "diverged"
        lines.append(f"| {r['method']} | {r['kind']} | {ppl} | {_fmt(r['val_loss'], '.4f')} | "
                     f"{_fmt(r['state_mib'], '.3f')} | {_fmt(r['state_bytes_per_param'], '.2f')} | "
                     f"{_fmt(r['peak_mem_mib'], '.0f')} | {_fmt(r['tokens_per_s'], ',.0f')} | "
                     f"{_fmt(r['wall_time_s'], '.1f')} | {_fmt(r['cpu_time_s'], '.1f')} | {_fmt(r['lr'], 'g')} | "
                     f"{r.get('settings', '')} |")
    ok = [r for r in rows if r["status"] == "ok"]
    if ok:
        ranked = sorted(ok, key=lambda r: r["val_ppl"])
        lines += ["", "Ranking by validation perplexity (lower is better): "
                  + " < ".join(f"{r['method']} ({r['val_ppl']:.1f})" for r in ranked) + "."]
    lines += ["", "![loss curves](loss_curves.png)", "", "![memory](memory.png)", "",
              "Reproduce one row: `slimopt train " + _cli_args(b) + " --method METHOD`.", ""]
    return "\n".join(lines)


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
