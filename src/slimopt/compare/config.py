"""What `slimopt compare` runs: the methods, their learning rates and settings, and the comparison's setting.

The default method list and the rates a tuned run picked at the default setting, ``CompareConfig`` (every shared
setting in one TrainConfig, per-method extras beside it), and each compared entry's TrainConfig: its lr (--set, a
variant's own, the tuned default, the paper's) and its step-counting settings scaled to a short run.

Details: docs/modules.md, ``slimopt.compare``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from slimopt.catalog import known_methods, method_kind, resolve_lr
from slimopt.compare.plan import PLACEMENT, PlanSetting
from slimopt.compare.protocol import CONTROL, DEFAULT_LR_EXTENSIONS, DEFAULT_LR_GRID, seed_list
from slimopt.options import split_variant
from slimopt.train.loop import TrainConfig

PLACEMENT_KEYS = tuple(PLACEMENT)  # TrainConfig fields a variant sets: where the run's weights live

__all__ = ["DEFAULT_METHODS", "FINE_TUNING_METHODS", "DEFAULT_SETTING_LR", "DEFAULT_CONTROL_LR_GRID",
           "DEFAULT_TUNE_FRACTION", "CompareConfig", "default_methods", "starts_pretrained", "scaled_schedule_opts",
           "at_default_setting", "split_method"]

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
# docs/results/compare-kjv-tuned, 2026-12-03: each inside its grid, extended past an edge where the best sat on
# it; the 2026-12-01 run's rates but BAdam's, 4e-3 at that grid's edge). The default comparison runs each method at
# its entry here, so that its one-seed ranking is the tuned one at a fraction of the cost; any other setting
# (another model, corpus, vocabulary, batch or step count) runs at the methods' defaults, or tuned ones with
# --tune-lr. The papers' rates (1e-3 for Adam-based methods, 1e-2 for GaLore) are for 60M-7B models trained for
# thousands of steps.
DEFAULT_SETTING_LR = {"adamw": 4e-3, "adamw8bit": 2e-3, "galore": 4e-2, "frugal": 2e-3, "frugal_rho0": 4e-3,
                      "badam": 8e-3, "ternary_adamw": 8e-3, "taco": 6e-4}


# Multipliers of AdamW's lr the control always tries (unless its lr is --set): with the transformer weights frozen
# the embeddings and head want a far larger lr than AdamW's 1e-3 (tiny LLaMA, KJV, 128 steps: val ppl 227 at 1e-3,
# 101 at 3e-3, 69 at 1e-2, 68 at 3e-2), and a control at a poor lr is a floor too low to show anything.
DEFAULT_CONTROL_LR_GRID = (1.0, 3.0, 10.0, 30.0)
DEFAULT_TUNE_FRACTION = 0.25  # the tuning runs' length, as a fraction of the full run's steps


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
    the edge of what was tried, the sweep tries a factor of 2 beyond it, up to `lr_extensions` times. `seeds` repeats
    every full run with seeds base.seed, base.seed + 1, ..., base.seed + seeds - 1. `plan` says where each method's
    memory is planned beside the measured figures (plan.py: LLaMA-7B and a 24 GiB card by default).
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



def _steps(b: TrainConfig) -> int:
    """The optimizer steps of a run: its max_steps, or its token budget in steps."""
    from slimopt.train.loop import _total_steps
    return _total_steps(b)


def _full_steps(cfg: CompareConfig) -> int:
    return _steps(cfg.base)


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
    d = _compare_defaults()
    return all(getattr(cfg.base, k) == getattr(d, k) for k in _SETTING_KEYS) and _full_steps(cfg) == _steps(d)


def split_method(entry: str) -> tuple[str, dict]:
    """A compared entry as (method, settings): a method name, or a variant ``NAME+KEY=VALUE[+KEY=VALUE...]``
    (e.g. ``adamw+param_rounding=kahan``), which runs NAME with those settings under its own row. The keys of
    ``PLACEMENT_KEYS`` (``adamw+weights=int8+offload=host``) set where the run's weights live."""
    return split_variant(entry) if "+" in entry else (entry, {})


def _method_config(cfg: CompareConfig, method: str, lr: float | None = None, seed: int | None = None,
                   out: Path | None = None) -> TrainConfig:
    name, variant = split_method(method)
    extra = {**scaled_schedule_opts(name, _full_steps(cfg)), **variant, **cfg.method_opts.get(method, {})}
    extra.pop("lr", None)
    # where the weights live is the run's setting, not the optimizer's: adamw+weights=int8+offload=host
    placement = {k: extra.pop(k) for k in PLACEMENT_KEYS if k in extra}
    if lr is None:
        lr = _base_lr(cfg, method)[0]
    return replace(cfg.base, method=name, opt={**cfg.base.opt, **extra}, lr=lr, **placement,
                   seed=cfg.base.seed if seed is None else seed,
                   out=str(out if out is not None else Path(cfg.out) / "runs" / method), overwrite=True,
                   resume=False, save_every=0, save_model=False, tensorboard=False)


def _run_dir(cfg: CompareConfig, method: str, seed: int) -> Path:
    folder = Path(cfg.out) / "runs" / method
    return folder if cfg.seeds == 1 else folder / f"seed{seed}"


def _tune_dir(cfg: CompareConfig, method: str, multiplier: float) -> Path:
    return Path(cfg.out) / "tune" / method / f"x{multiplier:g}"



def _seed_list(cfg: CompareConfig) -> list[int]:
    return seed_list(cfg.base.seed, cfg.seeds)
