"""`slimopt compare`: train several methods on the same data, seed and token budget, and report what each costs.

The experiment of the GaLore (arXiv 2403.03507, Table 2) and FRUGAL (arXiv 2411.07837, Table 2) papers, at any
scale: every method pretrains the same model from the same initialisation on the same batches for the same number
of tokens with its own paper learning rate, then the held-out perplexity, optimizer-state size, peak memory and
speed go side by side into `results.md` / `results.csv`, with loss curves and a memory chart as PNG.

Details: docs/modules.md, ``slimopt.train.compare``.
"""

from __future__ import annotations

import csv
import math
import multiprocessing
import os
import re
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

from slimopt import machine
from slimopt.options import split_variant
from slimopt.train.compare_analysis import (
    CONTROL,
    MIN_CONTROL_MARGIN,
    aggregate_seeds,
    baseline_full_rank_weights,
    budget_warning,
    choose_lr,
    control_margin,
    control_verdicts,
    extension_multiplier,
    full_rank_weights,
    inside_noise,
    noise_pairs,
    on_grid_edge,
    ranking_text,
)
from slimopt.train.compare_plan import PlanSetting, plan_methods
from slimopt.train.loop import TrainConfig, known_methods, method_kind, resolve_lr, tokenizer_name, train
from slimopt.train.results import check_out_dir, write_csv, write_csv_and_markdown, write_json

__all__ = ["DEFAULT_METHODS", "DEFAULT_LR_GRID", "DEFAULT_TUNE_FRACTION", "CONTROL", "CompareConfig",
           "default_methods", "run_compare", "write_results", "read_results", "CSV_COLUMNS", "SEED_CSV_COLUMNS",
           "SWEEP_COLUMNS", "scaled_schedule_opts", "split_method", "FINE_TUNING_METHODS", "starts_pretrained"]

# In the order the table lists them: full Adam, low-bit Adam, subspace methods, block methods, state-free
# extremes, then the low-rank baselines the GaLore paper shows failing at pretraining.
DEFAULT_METHODS = ("adamw", "adamw8bit", "galore", "frugal", "frugal_rho0", "badam", "ternary_adamw", "taco")

# Methods whose papers claim fine-tuning, not pretraining from scratch, with the one line a report gives when one
# is trained from scratch anyway: why it trails there and the command that measures its claim. The default
# comparison runs them only on a pretrained model (default_methods): its default, a tiny LLaMA from a random
# initialisation, asks which optimizer pretrains the transformer weights best, a question TACO's paper does not
# address; there TACO ended far above the control (51.9 against 29.4), a row a newcomer reads as "TACO is broken",
# while from pretrained SmolLM2 it is 3.4-5.1% behind AdamW in each of three seeds.
FINE_TUNING_METHODS = {
    "taco": "TACO is a fine-tuning method (docs/taco.md), here trained from scratch, which its paper does not claim, "
            "so this row does not test that claim; it is measured from a pretrained model, where TACO ends 3.4-5.1% "
            "behind AdamW in each of three seeds (docs/reproduction.md, SmolLM2): `slimopt compare "
            "--model smollm2-135m --data kjv --methods adamw,taco --seq-len 64 --batch-size 8 --max-steps 24 "
            "--eval-tokens 4096 --seed 0 --seeds 3 --set adamw.lr=1e-4 --set taco.lr=1e-4 --set frozen.lr=8e-4 "
            "--plan-model smollm2-135m`",
}

# The learning rates that `slimopt compare --tune-lr --seeds 3` picked at the default setting (_compare_defaults;
# docs/results/compare-kjv-tuned, 2026-12-03: each inside its grid, extended past an edge where the best sat on it;
# the 2026-12-01 run's rates but BAdam's, 4e-3 at that grid's edge). The default comparison runs each method at its entry
# here, so that its one-seed ranking is the tuned one at a fraction of the cost; any other setting (another model,
# corpus, vocabulary, batch or step count) runs at the methods' defaults, or tuned ones with --tune-lr. The papers'
# rates (1e-3 for Adam-based methods, 1e-2 for GaLore) are for 60M-7B models trained for thousands of steps.
DEFAULT_SETTING_LR = {"adamw": 4e-3, "adamw8bit": 2e-3, "galore": 4e-2, "frugal": 2e-3, "frugal_rho0": 4e-3,
                      "badam": 8e-3, "ternary_adamw": 8e-3, "taco": 6e-4}

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

DEFAULT_LR_GRID = (0.25, 0.5, 1.0, 2.0, 4.0)  # multipliers of each method's default lr that --tune-lr tries
# Multipliers of AdamW's lr the control always tries (unless its lr is --set): with the transformer weights frozen
# the embeddings and head want a far larger lr than AdamW's 1e-3 (tiny LLaMA, KJV, 128 steps: val ppl 227 at 1e-3,
# 101 at 3e-3, 69 at 1e-2, 68 at 3e-2), and a control at a poor lr is a floor too low to show anything.
DEFAULT_CONTROL_LR_GRID = (1.0, 3.0, 10.0, 30.0)
DEFAULT_TUNE_FRACTION = 0.25  # the tuning runs' length, as a fraction of the full run's steps
# While a sweep's best point sits on the edge of what it tried, it tries twice the largest (or half the smallest)
# multiplier, at most this many times a method: a best lr on the grid's edge is an unknown best lr, and a ranking of
# methods tuned to an edge may be the grid's, not the methods'.
DEFAULT_LR_EXTENSIONS = 3
CONTROL_NOTE = "control: AdamW on embeddings, norms and head; attention and MLP weights frozen"


def default_methods(pretrained: bool = False) -> list[str]:
    """DEFAULT_METHODS that exist in this installation; the fine-tuning ones (FINE_TUNING_METHODS) only for a
    model that starts `pretrained`."""
    known = known_methods()
    return [m for m in DEFAULT_METHODS if m in known and (pretrained or m not in FINE_TUNING_METHODS)]


def starts_pretrained(model: str) -> bool:
    """Whether a compared model starts from trained weights (SmolLM2, a folder with weights, a hub name) rather
    than from a random initialisation (a LLaMA size, a folder with a config.json only), as models.build_model
    builds it."""
    from slimopt.models import llama as models
    if model.lower() in models.LLAMA_SIZES:
        return False
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return models._has_weights(path)
    return True


def _compare_defaults() -> TrainConfig:
    # Sized to finish the default method set in about 3-5 minutes on 2 CPU cores (see docs/pretraining.md):
    # 128 steps of 16 x 64 tokens, a 2048-token BPE (the output layer dominates a tiny model's step). One torch
    # thread: the tiny model gains little from a second one, and on a machine busy with other work, OpenMP
    # threads competing for the cores slow every step several-fold (--threads changes it).
    return TrainConfig(model="tiny", data="kjv", vocab_size=512, seq_len=64, batch_size=16, tokens=524_288,
                       eval_tokens=8192, eval_every=None, threads=1, progress=False, save_model=False,
                       tensorboard=False)


# A run shorter than this many refreshes of a method's default gap gets a gap scaled to the run (below).
_MIN_REFRESHES = 20
# The scaled gap is never shorter than this many steps. Adam's first moment averages about 1 / (1 - beta1) = 10
# steps: a shorter gap changes the subspace (GaLore) or the block (FRUGAL, BAdam) before the moments have formed
# in it. GaLore keeps its moments across a refresh and reads the old basis's coordinates in the new one; FRUGAL and
# BAdam reset them, so below 10 steps their Adam is mostly its first, sign-like steps. Measured on SmolLM2-135M,
# KJV, 24 steps (docs/results/compare-smollm2-kjv-galore): GaLore refreshing every step (24 // 20 = 1) 24.66 ppl,
# every 8 steps 22.66, one subspace for the run 22.26; a gap near 10 takes back most of the 2.4 that refreshing
# every step cost. The default comparison (512 steps: 25) is above it.
_MIN_SCALED_GAP = 10


def scaled_schedule_opts(method: str, steps: int) -> dict:
    """Hyperparameters that count steps, scaled down for runs too short for the papers' values.

    GaLore refreshes its subspace, FRUGAL and BAdam switch blocks every `update_gap` steps (200 / 100 in the
    papers, where runs last 10k+ steps); ReLoRA restarts every 5k steps. In a 100-step comparison those events
    would never happen and each method would silently become a different one. Runs with fewer than
    20 gaps' worth of steps get `update_gap = steps // 20`, never below 10 steps (_MIN_SCALED_GAP says why; a run
    shorter than 10 steps keeps one subspace or block); ReLoRA: 4 restarts, re-warmup a tenth of the cycle.
    """
    kind = method_kind(method)
    if kind == "baseline":
        if method != "relora":
            return {}
        every = max(2, steps // 4)
        return {"restart_every": every, "restart_warmup": max(1, every // 10)}
    gap = _default_gap(method)
    if gap is None or steps >= _MIN_REFRESHES * gap:
        return {}
    return {"update_gap": min(gap, max(_MIN_SCALED_GAP, steps // _MIN_REFRESHES))}


def _default_gap(method: str) -> int | None:
    """The steps between a method's subspace refreshes or block switches by default (its paper's), or None."""
    if method_kind(method) == "baseline":
        return None
    if method_kind(method) != "slimopt":
        return 200 if method.startswith(("galore", "apollo")) else None
    return _recipe_gap(method)


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
    (e.g. {"galore": {"rank": 64}, "frugal": {"lr": 3e-3}}: the key "lr" sets that method's learning rate).

    `control` adds the control row (method "frozen") unless `methods` already holds it; its lr is picked from
    `control_lr_grid` (multipliers of AdamW's lr) like a tuned method's, unless method_opts sets it (then it is
    tuned only with `tune_lr`). `tune_lr` picks each method's lr from `lr_grid` (multipliers of its default or
    --set lr) by validation loss on runs of `tune_fraction` of the steps, at the base seed; while the best sits on
    the edge of what was tried, the sweep tries a factor of 2 beyond it, up to `lr_extensions` times. `seeds` repeats every
    full run with seeds base.seed, base.seed + 1, ..., base.seed + seeds - 1. `plan` says where each method's
    memory is planned beside the measured figures (compare_plan.py: LLaMA-7B and a 24 GiB card by default).
    """

    base: TrainConfig = field(default_factory=_compare_defaults)
    methods: list[str] | None = None
    method_opts: dict[str, dict] = field(default_factory=dict)
    out: str = "runs/compare"
    isolate: bool = True
    progress: bool = True
    control: bool = True
    tune_lr: bool = False
    lr_grid: tuple[float, ...] = DEFAULT_LR_GRID
    control_lr_grid: tuple[float, ...] = DEFAULT_CONTROL_LR_GRID
    tune_fraction: float = DEFAULT_TUNE_FRACTION
    lr_extensions: int = DEFAULT_LR_EXTENSIONS
    seeds: int = 1
    plan: PlanSetting | None = field(default_factory=PlanSetting)  # planned memory at scale; None: not planned
    jobs: int | None = None  # runs at a time; None: one per core a run's threads leave free on a CPU, one on a GPU


def _entries(cfg: CompareConfig) -> list[str]:
    """The methods to run, in table order: the control first (unless listed already or switched off)."""
    methods = list(cfg.methods) if cfg.methods else default_methods(starts_pretrained(cfg.base.model))
    if cfg.control and CONTROL not in methods:
        methods.insert(0, CONTROL)
    return methods


def _full_steps(cfg: CompareConfig) -> int:
    from slimopt.train.loop import _total_steps
    return _total_steps(cfg.base)


def _grid_for(cfg: CompareConfig, method: str) -> tuple[float, ...] | None:
    """The lr multipliers a method is swept over before its full runs, or None (it runs at its base lr)."""
    if method == CONTROL:
        if cfg.tune_lr or cfg.method_opts.get(method, {}).get("lr") is None:
            return tuple(cfg.control_lr_grid)
        return None
    return tuple(cfg.lr_grid) if cfg.tune_lr else None


def _tune_steps(cfg: CompareConfig) -> int:
    return max(1, round(_full_steps(cfg) * cfg.tune_fraction))


def _base_lr(cfg: CompareConfig, method: str) -> tuple[float, str]:
    """The lr a method runs at without tuning (and the centre of its tuning grid), and where it comes from: --set,
    the variant's own lr= (``adamw+rule=lion+lr=3e-4``), the tuned rate of the default setting, the paper, the
    method's default (``slimopt methods`` says where that comes from), or (control) AdamW's. A variant without
    an lr of its own takes its base method's, as the base gets it here (its --set, or its tuned rate at the
    default setting): ``galore+stagger_refresh=True`` beside GaLore's tuned 0.04 runs at 0.04, not the paper's
    0.01. With --tune-lr a variant's grid is centred there and its sweep is its own."""
    lr = cfg.method_opts.get(method, {}).get("lr")
    if lr is not None:
        return _lr_value(lr, f"--set {method}.lr={lr}", f"--set {method}.lr=1e-3"), "--set"
    name, variant = split_method(method)
    lr = variant.get("lr")
    if lr is not None:
        typed = next((item for item in method.split("+")[1:] if item.partition("=")[0].strip() == "lr"), f"lr={lr}")
        return _lr_value(lr, f"method variant {method!r}: its key {typed.strip()}",
                         f"{name}+lr=1e-3, or no lr to run at {name}'s"), "the variant's"
    if variant:  # the lr its base method runs at here, so that the row differs from the base's in its settings only
        lr, source = _base_lr(cfg, name)
        return lr, f"{name}'s: {source}"
    if method == CONTROL:
        return resolve_lr("adamw"), "AdamW's"
    if method in DEFAULT_SETTING_LR and at_default_setting(cfg):
        return DEFAULT_SETTING_LR[method], "tuned at this setting"
    from slimopt.catalog import lr_is_papers
    return resolve_lr(name), "paper" if lr_is_papers(name) else "default"


def _lr_value(value, what: str, example: str) -> float:
    """A learning rate the user gave, or a ValueError that names it as typed (`what`) and what is allowed."""
    try:
        lr = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        lr = math.nan
    if not (lr > 0 and math.isfinite(lr)):
        raise ValueError(f"{what} is not a learning rate: lr must be a positive number (e.g. {example})")
    return lr


_SETTING_KEYS = ("model", "data", "tokenizer", "vocab_size", "text_field", "txt_split", "seq_len", "batch_size",
                 "grad_accum", "warmup", "min_lr_ratio", "weight_decay", "clip", "dtype", "eval_tokens")


def at_default_setting(cfg: CompareConfig) -> bool:
    """Whether the comparison trains what the default one does (DEFAULT_SETTING_LR holds for it): the same model,
    data, tokenizer, batch, schedule, precision and step count; seeds, device and threads may differ."""
    from slimopt.train.loop import _total_steps
    d = _compare_defaults()
    return all(getattr(cfg.base, k) == getattr(d, k) for k in _SETTING_KEYS) and _full_steps(cfg) == _total_steps(d)


def split_method(entry: str) -> tuple[str, dict]:
    """A compared entry as (method, settings): a method name, or a variant ``NAME+KEY=VALUE[+KEY=VALUE...]``
    (e.g. ``adamw+param_rounding=kahan``), which runs NAME with those settings under its own row."""
    return split_variant(entry) if "+" in entry else (entry, {})


def _method_config(cfg: CompareConfig, method: str, lr: float | None = None, seed: int | None = None,
                   out: Path | None = None) -> TrainConfig:
    name, variant = split_method(method)
    extra = {**scaled_schedule_opts(name, _full_steps(cfg)), **variant, **cfg.method_opts.get(method, {})}
    extra.pop("lr", None)
    if lr is None:
        lr = _base_lr(cfg, method)[0]
    return replace(cfg.base, method=name, opt={**cfg.base.opt, **extra}, lr=lr,
                   seed=cfg.base.seed if seed is None else seed,
                   out=str(out if out is not None else Path(cfg.out) / "runs" / method), overwrite=True,
                   resume=False, save_every=0, save_model=False, tensorboard=False)


def _run_dir(cfg: CompareConfig, method: str, seed: int) -> Path:
    folder = Path(cfg.out) / "runs" / method
    return folder if cfg.seeds == 1 else folder / f"seed{seed}"


def _tune_dir(cfg: CompareConfig, method: str, multiplier: float) -> Path:
    return Path(cfg.out) / "tune" / method / f"x{multiplier:g}"


def _validate(cfg: CompareConfig, methods: list[str]) -> None:
    from slimopt.peers import available_peers
    from slimopt.train.loop import _check_config
    if not methods:
        raise ValueError("no methods to compare")
    dup = sorted({m for m in methods if methods.count(m) > 1})
    if dup:
        raise ValueError(f"methods listed twice: {', '.join(dup)}")
    if cfg.jobs is not None and (not isinstance(cfg.jobs, int) or isinstance(cfg.jobs, bool) or cfg.jobs < 1):
        raise ValueError(f"--jobs must be an integer >= 1 (runs at a time), got {cfg.jobs!r}")
    if not isinstance(cfg.seeds, int) or isinstance(cfg.seeds, bool) or cfg.seeds < 1:
        raise ValueError(f"--seeds must be an integer >= 1 (the number of seeds each method runs with), "
                         f"got {cfg.seeds!r}")
    for option, grid, used in (("--lr-grid", cfg.lr_grid, cfg.tune_lr),
                               ("--control-lr-grid", cfg.control_lr_grid, _grid_for(cfg, CONTROL) is not None
                                and CONTROL in methods)):
        if not used:
            continue
        grid = list(grid or ())
        if not grid:
            raise ValueError(f"{option} is empty: give multipliers of the default lr, e.g. "
                             + ("1/4,1/2,1,2,4" if option == "--lr-grid" else "1,3,10,30"))
        bad = [g for g in grid if not (isinstance(g, (int, float)) and math.isfinite(g) and g > 0)]
        if bad:
            raise ValueError(f"{option} multipliers must be positive numbers, got {bad}")
        if len(set(grid)) != len(grid):
            raise ValueError(f"{option} lists a multiplier twice: {grid}")
    if not isinstance(cfg.lr_extensions, int) or isinstance(cfg.lr_extensions, bool) or cfg.lr_extensions < 0:
        raise ValueError(f"--lr-extensions must be an integer >= 0 (how many times a sweep whose best lr is on the "
                         f"grid's edge extends it), got {cfg.lr_extensions!r}")
    if any(_grid_for(cfg, m) for m in methods):
        if not (isinstance(cfg.tune_fraction, (int, float)) and 0 < cfg.tune_fraction <= 1):
            raise ValueError(f"--tune-fraction must be in (0, 1] (the tuning runs' share of the steps), "
                             f"got {cfg.tune_fraction!r}")
    peers = available_peers()
    for m in methods:
        name = split_method(m)[0]
        if method_kind(name) == "peer" and peers[name] is not None:
            raise ImportError(f"peer {name!r} cannot run here: {peers[name]}")
    unknown = sorted(set(cfg.method_opts) - set(methods))
    if unknown:
        raise ValueError(f"per-method options given for methods not compared: {', '.join(unknown)}")
    for m in methods:
        _check_config(replace(_method_config(cfg, m), out=None), world_size=1)
    check_out_dir(cfg.out)


def _dry_build(tc: TrainConfig, vocab_size: int) -> list[tuple[str, tuple[int, int], int]]:
    """Build the model on the meta device (no memory, no init cost) and the method's optimizer over it, so a bad
    hyperparameter of the 5th method fails before the 1st one trains. Returns the projectable weights on which
    the method keeps a full-rank subspace (compare_analysis.full_rank_weights)."""
    import warnings

    from slimopt.models import llama as models
    from slimopt.train.loop import make_optimizer
    if tc.model.lower() not in models.LLAMA_SIZES:
        return []  # a checkpoint would have to be read; its method settings are checked when its run starts
    kind = method_kind(tc.method)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # libraries' deprecation notices say nothing about this run
            model = models.build_model(tc.model, vocab_size, tc.seq_len, seed=tc.seed, device="meta")
            if kind == "baseline":
                from slimopt import baselines
                original = model
                model, _ = baselines.prepare(models.build_model(tc.model, vocab_size, tc.seq_len, seed=tc.seed,
                                                                device="meta"), tc.method, seed=tc.seed, **tc.opt)
                optimizer = make_optimizer(model, tc.method, lr=tc.lr, weight_decay=tc.weight_decay)
            else:
                optimizer = make_optimizer(model, tc.method, lr=tc.lr, weight_decay=tc.weight_decay, **tc.opt)
    except ValueError as e:
        raise ValueError(f"method {tc.method!r}: {e}") from e
    except Exception:  # noqa: BLE001 - something meta tensors cannot do; the real run will tell
        return []
    try:
        if kind == "baseline":
            if tc.method == CONTROL:
                return []
            hidden = getattr(original.config, "hidden_size", None)
            rank = tc.opt.get("rank") or (max(1, hidden // 4) if hidden else None)
            return baseline_full_rank_weights(original, int(rank)) if rank else []
        return full_rank_weights(model, optimizer)
    except Exception:  # noqa: BLE001 - an optimizer whose groups say nothing about ranks
        return []


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


_PRELOAD = ["slimopt.hushed", "slimopt", "slimopt.train.loop", "slimopt.models.llama", "slimopt.train.data", "slimopt.peers",
            "transformers.models.llama.modeling_llama"]


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
    best = choose_lr(entry["points"])
    for p in entry["points"]:
        p["chosen"] = p is best
    entry["chosen"] = best
    entry["edge"] = on_grid_edge(entry["points"])
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


def run_compare(cfg: CompareConfig, log=print) -> list[dict]:
    """Train every method (the control first), write the results into `cfg.out`, return one row per method
    (see CSV_COLUMNS; with several seeds the numbers are means and row["runs"] holds the per-seed rows)."""
    methods = _entries(cfg)
    _validate(cfg, methods)  # all checks before the first write or the first step
    planned = _planned(cfg, methods)
    from slimopt.train.loop import _prepare_data
    t0 = time.perf_counter()
    steps = _full_steps(cfg)
    _, packed = _prepare_data(cfg.base, steps)  # once, so every run hits the cache
    full_rank = {m: _dry_build(_method_config(cfg, m), packed.vocab_size) for m in methods}
    b = cfg.base
    seeds = _seed_list(cfg)
    jobs = jobs_for(cfg)
    log(f"slimopt compare: {len(methods)} methods x {steps} steps of {b.batch_size}x{b.seq_len} "
        f"tokens ({steps * b.batch_size * b.seq_len:,} tokens), model {b.model}, "
        f"data {b.data} ({packed.train.shape[0]:,} train blocks), "
        + (f"seed {b.seed}" if len(seeds) == 1 else f"seeds {seeds[0]}-{seeds[-1]}")
        + (f"; control: {CONTROL}" if CONTROL in methods else "; no control row")
        + (f"; {jobs} runs at a time" if jobs > 1 else ""))
    for m in methods:
        if full_rank[m]:
            log(f"warning: {_full_rank_note(full_rank[m], m)}")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    sweeps: dict[str, dict] = {}
    tuned = [m for m in methods if _grid_for(cfg, m)]
    if tuned:
        parts = []
        if CONTROL in tuned:
            parts.append(f"the control at x{', x'.join(f'{g:g}' for g in _grid_for(cfg, CONTROL))} of "
                         f"{_base_lr(cfg, CONTROL)[0]:g}")
        others = [m for m in tuned if m != CONTROL]
        if others:
            parts.append(f"{len(others)} method{'s' if len(others) > 1 else ''} at "
                         f"x{', x'.join(f'{g:g}' for g in cfg.lr_grid)} of each one's default")
        log(f"tuning learning rates on runs of {_tune_steps(cfg)} of {steps} steps, seed {b.seed}: "
            + "; ".join(parts))
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            pending = {m: _sweep_submit(cfg, m, pool) for m in tuned}
            for m in tuned:
                _sweep(cfg, m, pending[m], sweeps, log)
            _extend_sweeps(cfg, tuned, sweeps, pool, log)
        for m in tuned:
            best, entry = sweeps[m]["chosen"], sweeps[m]
            log(f"  {m}: lr {best['lr']:.3g} (x{best['multiplier']:g}{_extension_text(entry)})" if best else
                f"  {m}: no grid point finished; the full runs use lr {entry['base_lr']:.3g}")
    rows: list[dict] = []
    pool = ThreadPoolExecutor(max_workers=jobs)  # each run is a process of its own: the threads only wait
    try:
        _full_runs(cfg, methods, seeds, sweeps, full_rank, planned, pool, jobs, rows, out, t0, log)
    finally:
        pool.shutdown(cancel_futures=True)
    _annotate(rows, cfg)
    write_results(rows, cfg, out, elapsed=time.perf_counter() - t0, sweeps=sweeps)
    for line in _conclusions(rows, cfg):
        log(line)
    log(f"results: {out / 'results.md'} ({time.perf_counter() - t0:.0f} s in all)")
    return rows


def _planned(cfg: CompareConfig, methods: list[str]) -> dict[str, dict | None]:
    """Each entry's planned memory at cfg.plan's size (compare_plan.py), with the settings its runs use."""
    if cfg.plan is None:
        return {m: None for m in methods}
    entries = {}
    for m in methods:
        name, variant = split_method(m)
        entries[m] = (name, {**variant, **cfg.method_opts.get(m, {})})
    return plan_methods(cfg.plan, entries)


def _plan_columns(plan: dict | None) -> dict:
    if plan is None:
        return {"plan_model": None, "plan_state_gib": None, "plan_peak_gib": None, "plan_fits": None}
    return {"plan_model": plan["model"], "plan_state_gib": plan["state_gib"], "plan_peak_gib": plan["peak_gib"],
            "plan_fits": plan["fits"], "plan_command": plan["command"]}


def _full_runs(cfg: CompareConfig, methods: list[str], seeds: list[int], sweeps: dict, full_rank: dict,
               planned: dict, pool: ThreadPoolExecutor, jobs: int, rows: list[dict], out: Path, t0: float,
               log) -> None:
    """Start every method's full runs (all seeds; `jobs` at a time), then gather them in table order into `rows`,
    writing the results after each method so that partial results survive."""
    pending = {}
    for m in methods:
        lr = _chosen_lr(cfg, m, sweeps)[0]
        pending[m] = [pool.submit(_run_one, cfg, replace(_method_config(cfg, m, lr=lr, seed=seed,
                                                                         out=_run_dir(cfg, m, seed)),
                                                         progress=cfg.progress and jobs == 1), m)
                      for seed in seeds]
    for i, m in enumerate(methods, 1):
        lr, source, mult = _chosen_lr(cfg, m, sweeps)
        runs = []
        for seed, future in zip(seeds, pending[m]):
            run = future.result()
            run["role"] = "control" if m == CONTROL else "method"
            runs.append(run)
            tag = f"[{i}/{len(methods)}]" + (f" seed {seed}" if len(seeds) > 1 else "")
            log(f"{tag} {_summary_line(run)}")
        row = aggregate_seeds(runs)
        row.update(role="control" if m == CONTROL else "method", lr=lr, lr_source=source, lr_multiplier=mult,
                   full_rank=full_rank[m], lr_edge=bool(sweeps.get(m, {}).get("edge")),
                   lr_extended=list(sweeps.get(m, {}).get("extended", [])), **_plan_columns(planned[m]))
        rows.append(row)
        _annotate(rows, cfg)
        write_results(rows, cfg, out, elapsed=time.perf_counter() - t0, sweeps=sweeps)  # partial results survive


def _extension_text(entry: dict) -> str:
    """How a sweep's grid was extended and whether its best is still on the edge: '' when neither."""
    parts = []
    if entry.get("extended"):
        n = len(entry["extended"])
        parts.append(f"grid extended {n} time{'s' if n > 1 else ''} to x{', x'.join(f'{g:g}' for g in entry['extended'])}")
    if entry.get("edge"):
        parts.append("still on the grid's edge")
    return "; " + "; ".join(parts) if parts else ""


def _seed_list(cfg: CompareConfig) -> list[int]:
    return [cfg.base.seed + k for k in range(cfg.seeds)]


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
    verdicts = control_verdicts(rows, control)
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


# --------------------------------------------------------------------------------------------- reports

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
    from slimopt.train.compare_plots import plot_loss_curves, plot_memory
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
    from slimopt.train.compare_plots import plot_lr_sweep
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


def _steps(b: TrainConfig) -> int:
    from slimopt.train.loop import _total_steps
    return _total_steps(b)


def _markdown(rows: list[dict], cfg: CompareConfig, elapsed: float | None, sweeps: dict) -> str:
    b = cfg.base
    steps = _steps(b)
    seeds = _seed_list(cfg)
    multi = len(seeds) > 1
    kinds = sorted({r["peak_mem_kind"] for r in rows if r.get("peak_mem_kind")})
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if cfg.tune_lr:
        lr_text = (f"each method's learning rate tuned: {len(cfg.lr_grid)} runs of {_tune_steps(cfg)} steps "
                   f"(x{', x'.join(f'{g:g}' for g in cfg.lr_grid)} of its default; seed {b.seed}), extended by a "
                   f"factor of 2 past the edge while the best sat on it (at most {cfg.lr_extensions} times), the one "
                   f"with the lowest validation loss kept (columns lr, lr from; lr_sweep.csv, lr_sweep.png)")
    elif at_default_setting(cfg):
        lr_text = ("each method at the learning rate that a tuned 3-seed run of this setting picked, or its paper's "
                   "where that run had none (columns lr, lr from; --tune-lr tunes them)")
    else:
        lr_text = ("each method at its paper learning rate (columns lr, lr from; --tune-lr tunes them)")
    if CONTROL in sweeps:
        lr_text += (f"; the control at the best of x{', x'.join(f'{g:g}' for g in sweeps[CONTROL]['grid'])} of "
                    f"{sweeps[CONTROL]['base_lr']:g} on runs of {_tune_steps(cfg)} steps")
    seed_text = (f"seeds {seeds[0]}-{seeds[-1]} (initialisation and batch order), each number the mean over the "
                 f"seeds; spread: min-max and sample standard deviation of the seeds' perplexities"
                 if multi else f"seed {seeds[0]}")
    tokenizer = tokenizer_name(b) or f"byte-level BPE, vocab {b.vocab_size}"
    lines = [
        f"# slimopt compare: {_title(cfg)}",
        "",
        f"- Date: {now}. Machine: {_machine_text(rows, cfg)}.",
        f"- Model {b.model}, data {b.data} (tokenizer: {tokenizer}), "
        f"seq_len {b.seq_len}, batch {b.batch_size} x grad-accum {b.grad_accum}, {steps} steps, dtype {b.dtype}, "
        f"warmup {b.warmup}, cosine to {b.min_lr_ratio} x peak, clip {b.clip}, weight decay {b.weight_decay}; "
        f"{seed_text}; {lr_text}.",
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
    plan_text = _plan_text(rows, cfg)
    if plan_text:
        lines.append(plan_text)
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
    warns = _warnings(rows, cfg)
    if warns:
        lines.append("")
        lines += [f"> **Warning:** {w}\n>" for w in warns]
        lines[-1] = lines[-1][:-2]
    spread_head = " ppl min-max | ppl std |" if multi else ""
    spread_align = "---:|---:|" if multi else ""
    planned = cfg.plan is not None
    plan_head = (f" planned state GiB ({cfg.plan.model}) | planned peak GiB ({cfg.plan.model}) | "
                 f"fits {cfg.plan.gpu_memory} |" if planned else "")
    plan_align = "---:|---:|---|" if planned else ""
    lines += ["", f"| method | kind | val ppl | val loss |{spread_head} state MiB | state B/param | peak MiB | "
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
    control = _control_row(rows)
    ranked = ranking_text(rows, control)
    if ranked:
        lines += ["", f"Ranking by validation perplexity (lower is better{'; mean ± std' if multi else ''}): "
                      f"{ranked}.", "", _noise_text(rows, cfg)]
    lines += [f"\n{_claim_note(m)}" for m in _out_of_claim(rows, cfg)]
    if sweeps:
        lines += ["", *_sweep_table(sweeps, cfg), "", "![lr sweep](lr_sweep.png)"]
    lines += ["", "![loss curves](loss_curves.png)", "", "![memory](memory.png)", "",
              "Reproduce one row: `slimopt train " + _cli_args(b) + " --method METHOD --lr LR` (LR: column lr"
              + (", and --seed for each seed" if multi else "")
              + ("; --opt KEY=VALUE for each of column settings" if any(r.get("settings") for r in rows) else "")
              + (("; a row NAME+KEY=VALUE is --method NAME") if any("+" in r["method"] for r in rows) else "")
              + ").", ""]
    return "\n".join(lines)


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
