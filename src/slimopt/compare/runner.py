"""How `slimopt compare` runs one training: in a fresh process each, a few at a time, a failure kept as a row.

Each run is a process forked from a server that has already imported torch and transformers, so one method's
allocations never inflate the next one's peak memory, a crash in one method does not stop the others, and the
import cost is paid once.

Details: docs/modules.md, ``slimopt.compare``.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from slimopt.catalog import method_kind
from slimopt.compare.config import CompareConfig, _default_gap, split_method
from slimopt.train.loop import TrainConfig, train

__all__ = ["jobs_for"]


def _child_train(cfg: TrainConfig) -> dict:
    # Runs in a forked worker: keep the worker's output free of warnings that say nothing about the run.
    import warnings
    for category in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    return _with_threads(train(cfg))


def _with_threads(res: dict) -> dict:
    """The result with the torch threads its run used (read in the process that ran it, after it set them)."""
    import torch
    return {**res, "torch_threads": torch.get_num_threads()}


_PRELOAD = ["slimopt.hushed", "slimopt", "slimopt.train.loop", "slimopt.models.llama", "slimopt.train.data",
            "slimopt.peers", "transformers.models.llama.modeling_llama"]


def _run_isolated(cfg: TrainConfig) -> dict:
    import importlib.util
    ctx = multiprocessing.get_context("forkserver")
    optional = [m for m in ("peft",) if importlib.util.find_spec(m) is not None]
    ctx.set_forkserver_preload(_PRELOAD + optional)
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx, max_tasks_per_child=1) as ex:
        return ex.submit(_child_train, cfg).result()


def _run_one(cfg: CompareConfig, tc: TrainConfig, entry: str) -> dict:
    """One training run of the compared `entry` as a row; a failure becomes the row's status (with error.txt in
    its folder)."""
    try:
        res = _run_isolated(tc) if cfg.isolate else _with_threads(train(tc))
        row = _row(res, entry)
    except Exception as e:  # one run failing must not lose the others' results
        tb = traceback.format_exc(limit=3)
        row = {"method": entry, "kind": method_kind(tc.method), "status": f"failed: {type(e).__name__}: {e}",
               "lr": tc.lr, "history": {"train": [], "eval": []}}
        Path(tc.out).mkdir(parents=True, exist_ok=True)
        (Path(tc.out) / "error.txt").write_text(tb)
    row["settings"] = _settings(tc)
    row["seed"] = tc.seed
    if not cfg.isolate and row.get("status") == "ok":
        row["peak_mem_kind"] += " (in-process: later methods reuse freed memory)"
    return row


def jobs_for(cfg: CompareConfig) -> int:
    """How many runs go at a time: cfg.jobs, or one per core that a run's threads leave free (CPU; one on a GPU,
    and one in-process)."""
    if not cfg.isolate:
        return 1
    if cfg.jobs is not None:
        return cfg.jobs
    device = str(cfg.base.device or "auto")
    if device == "auto":
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not device.startswith("cpu"):
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // (cfg.base.threads or cores))



def _settings(tc: TrainConfig) -> str:
    """The run's method settings, with the update gap it ran at when that is the method's default."""
    opt = dict(tc.opt)
    gap = _default_gap(tc.method)
    if gap is not None and "update_gap" not in opt:
        opt["update_gap"] = gap
    return " ".join(f"{k}={v}" for k, v in sorted(opt.items()))


def _row(res: dict, method: str) -> dict:
    ok = math.isfinite(res["val_loss"])
    return {
        "method": method, "kind": method_kind(split_method(method)[0]), "status": "ok" if ok else "diverged",
        "val_loss": res["val_loss"], "val_ppl": res["val_ppl"], "val_tokens": res["val_tokens"],
        "start_val_ppl": res.get("start_val_ppl"), "state_mib": res["state_bytes"] / 2**20,
        "state_bytes_per_param": res["state_bytes_per_param"],
        "peak_mem_mib": res["peak_mem_bytes"] / 2**20, "peak_mem_kind": res["peak_mem_kind"],
        "tokens_per_s": res["tokens_per_s"], "wall_time_s": res["wall_time_s"], "cpu_time_s": res["cpu_time_s"],
        "lr": res["lr"],
        "steps": res["steps"], "tokens": res["tokens"], "trainable_params": res["trainable_params"],
        "params": res["params"], "device": res["device"], "history": res["history"],
        "torch_threads": res.get("torch_threads"),
    }


def _summary_line(r: dict) -> str:
    if r["status"].startswith("failed"):
        return f"{r['method']}: {r['status']}"
    return (f"{r['method']}: val ppl {r['val_ppl']:.2f}, state {r['state_mib']:.3f} MiB "
            f"({r['state_bytes_per_param']:.2f} B/param), peak {r['peak_mem_mib']:.0f} MiB, "
            f"{r['tokens_per_s']:,.0f} tok/s, {r['wall_time_s']:.1f} s")


