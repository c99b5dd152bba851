"""Fine-tune sequence classifiers with several methods on several tasks, and tabulate accuracy against memory.

What ``slimopt finetune`` runs. GaLore (arXiv 2403.03507, Table 4) and FRUGAL (arXiv 2411.07837) fine-tune
RoBERTa-base on GLUE and compare with full fine-tuning and LoRA (arXiv 2106.09685) at the same rank, reporting the
memory of weights plus optimizer state next to the scores. ``run_finetune`` does the same for any
``*ForSequenceClassification`` model and any task ``slimopt.finetune.data.load_task`` reads, through
``transformers.Trainer`` (its gradient accumulation, clipping, bf16 autocast and linear schedule with warmup).

Details: docs/modules.md, ``slimopt.finetune.run``.
"""

from __future__ import annotations

import copy
import math
import re
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from slimopt.compare.protocol import DEFAULT_LR_EXTENSIONS, DEFAULT_LR_GRID, HEAD, run_method, seed_list
from slimopt.finetune.report import mib, read_results, write_results
from slimopt.models.classifier import OFFLINE_MODEL, load_classifier, load_tokenizer
from slimopt.train.results import check_out_dir

__all__ = [
    "FinetuneConfig",
    "MethodPlan",
    "FINETUNE_DEFAULTS",
    "FINETUNE_LR",
    "GLUE_FOLDERS",
    "parse_method",
    "method_settings",
    "resolve_task",
    "prepare",
    "finetune_one",
    "run_finetune",
    "write_results",
    "read_results",
]

# Folder names of the original GLUE distribution (glue_data/<folder>), for a --data-dir holding several tasks.
GLUE_FOLDERS = {"cola": "CoLA", "sst2": "SST-2", "mrpc": "MRPC", "qqp": "QQP", "stsb": "STS-B", "mnli": "MNLI",
                "qnli": "QNLI", "rte": "RTE", "wnli": "WNLI"}

FINETUNE_LR: dict[str, float] = {
    # Chosen on BBC News with the offline MiniLM, 20 steps of batch 16 (docs/finetune.md): 3e-4 reached 92% where
    # 1e-4 reached 63% for AdamW, and 3e-3 reached 91% where 1e-3 reached 56% for LoRA. Short budgets want rates
    # at the top of the usual range (BERT-size GLUE fine-tuning: 1e-5 .. 1e-4 over several epochs; LoRA 10x).
    "adamw": 3e-4,
    "galore": 3e-4,
    "frugal": 3e-4,
    "badam": 3e-4,
    "taco": 3e-4,  # TACO's steps are normalised to AdamW's learning-rate scale
    "signsgd": 1e-5,  # every step moves every weight by lr: keep it small
    "lora": 3e-3,  # adapters start from zero (B = 0)
    "head": 3e-3,  # the control: a new linear head on frozen features, like LoRA's adapters a start from scratch
}
"""Default fine-tuning learning rate by method family (the method name up to its first "_" or digit suffix)."""

_GALORE_FT = {"rank": "@rank", "update_gap": 100, "scale": 4.0}
_FRUGAL_FT = {"projector": "svd", "rank": "@rank", "update_gap": 100}

FINETUNE_DEFAULTS: dict[str, dict[str, Any]] = {
    # GaLore at LoRA's rank, refreshed every 100 steps, the projected update scaled by 4 as in GaLore's GLUE
    # runs (on the BBC check above, scale 2 reached 74% and scale 4 89%).
    "galore": _GALORE_FT,
    "galore_rsvd": _GALORE_FT,
    "galore8bit": _GALORE_FT,
    # FRUGAL at the same rank: Adam in the top-r SVD subspace of each matrix, signSGD on the rest, moments reset
    # at each refresh. frugal_rho0 keeps its density 0 (no subspace).
    "frugal": _FRUGAL_FT,
    "frugal8bit": _FRUGAL_FT,
    "frugal_ternary": _FRUGAL_FT,
}
"""Fine-tuning hyperparameters by method name; "@rank" is replaced by ``FinetuneConfig.rank``."""


@dataclass(frozen=True)
class MethodPlan:
    """One entry of ``--methods``: whether the model gets LoRA adapters, and which slimopt method optimizes."""

    name: str  # as the user wrote it
    optimizer: str  # a slimopt method
    lora: bool
    head_only: bool = False  # the control: every weight but the classification head frozen

    @property
    def family(self) -> str:
        return "lora" if self.lora else "head" if self.head_only else _family(self.optimizer)


def _family(method: str) -> str:
    base = re.split(r"_|\d", method, maxsplit=1)[0]
    if base in ("adamw", "ternary"):
        return "adamw"
    return base


def parse_method(name: str) -> MethodPlan:
    """``"galore"`` -> full-model GaLore; ``"lora"`` -> LoRA + AdamW; ``"lora+adamw8bit"`` -> LoRA + 8-bit AdamW;
    ``"head"`` -> the control, AdamW on the classification head alone.

    Raises ValueError for anything else, listing what is allowed.
    """
    from slimopt.optim.recipes import METHODS

    text = name.strip()
    if text == HEAD:
        return MethodPlan(HEAD, "adamw", False, head_only=True)
    lora = text == "lora" or text.startswith("lora+")
    optimizer = "adamw" if text == "lora" else text[len("lora+"):] if lora else text
    if optimizer not in METHODS:
        raise ValueError(
            f"unknown method {name!r}; use a slimopt method ({', '.join(METHODS)}), 'lora', 'lora+METHOD' "
            f"(LoRA adapters optimized by a slimopt method) or '{HEAD}' (the control: the head alone trains)"
        )
    return MethodPlan(text, optimizer, lora)


@dataclass
class FinetuneConfig:
    """Everything one ``slimopt finetune`` command runs. Defaults: the offline MiniLM on BBC News, four methods,
    a few minutes on a 2-core CPU."""

    tasks: list[str] = field(default_factory=lambda: ["bbc"])
    methods: list[str] = field(default_factory=lambda: ["adamw", "galore", "frugal", "lora"])
    model: str = OFFLINE_MODEL
    data_dir: str | None = None
    train_file: str | None = None
    validation_file: str | None = None
    text_columns: tuple[str, ...] | None = None  # for a task of your own (not GLUE, not built in)
    num_labels: int | None = None
    regression: bool = False
    max_length: int = 32  # the quick offline default; GLUE runs use 128 (run_glue) or 512 (GaLore)
    max_train_samples: int | None = 320
    max_eval_samples: int | None = 200
    epochs: float = 1.0
    max_steps: int | None = None  # overrides epochs
    batch_size: int = 16
    eval_batch_size: int = 64
    grad_accum: int = 1
    lr: float | None = None  # one rate for every method; None: FINETUNE_LR
    rank: int = 8  # LoRA rank and the subspace rank of GaLore / FRUGAL
    lora_alpha: float | None = None  # None: 4 x rank
    warmup: float = 0.06  # a fraction of the steps (RoBERTa's GLUE recipe) or a step count
    weight_decay: float = 0.0
    clip: float = 1.0
    bf16: bool = False
    seed: int = 0
    seeds: int = 1  # every run repeated with seeds seed .. seed + seeds - 1
    control: bool = True  # add the control row (HEAD) unless methods lists it
    tune_lr: bool = False  # each method's lr picked from lr_grid x its default by validation loss
    lr_grid: tuple[float, ...] = DEFAULT_LR_GRID
    lr_extensions: int = DEFAULT_LR_EXTENSIONS  # at most this many factor-2 steps past the grid's edge
    method_opts: dict[str, dict[str, Any]] = field(default_factory=dict)  # {method name: {setting: value}}
    weights: str = "dtype"  # dtype | int8: the body's attention and MLP Linear weights in int8 (not the head)
    int8_group: int = 0  # with int8 weights: one scale per this many elements of a row (0: a row)
    int8_embeddings: bool = False  # with int8 weights: the input embedding in int8 too (one scale a row)
    offload: str = "none"  # none | host: master copies and optimizer state on the host, stepped in backward
    master: str = "fp32"  # with offload host: the master copy, fp32 | bf16+int8 | bf16
    out: str = "slimopt-finetune"

    @property
    def placed(self) -> bool:
        """Whether the full fine-tuning methods run with int8 weights or host masters."""
        return self.weights != "dtype" or self.offload != "none"

    @property
    def entries(self) -> list[str]:
        """The methods in table order: the control first (unless listed already or switched off)."""
        return ([HEAD] if self.control and HEAD not in self.methods else []) + list(self.methods)

    def validate(self) -> None:
        if not self.tasks:
            raise ValueError("tasks: give at least one task")
        if not self.methods:
            raise ValueError("methods: give at least one method")
        for name in ("max_length", "batch_size", "eval_batch_size", "grad_accum", "rank", "seeds"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        for name, unset in (("max_train_samples", "0 for all"), ("max_eval_samples", "0 for all"),
                            ("max_steps", "leave it out to train for --epochs"),
                            ("num_labels", "the classes of a task of your own")):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer ({unset}), got {value!r}")
        if not (self.epochs > 0 and math.isfinite(self.epochs)):
            raise ValueError(f"epochs must be a positive number, got {self.epochs!r}")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr!r}")
        if self.lora_alpha is not None and not self.lora_alpha > 0:
            raise ValueError(f"lora_alpha must be positive, got {self.lora_alpha!r}")
        if not (self.warmup >= 0 and (self.warmup < 1 or float(self.warmup).is_integer())):
            raise ValueError(f"warmup must be a fraction in [0, 1) or a whole number of steps, got {self.warmup!r}")
        if self.weight_decay < 0 or self.clip < 0:
            raise ValueError("weight_decay and clip must be >= 0")
        if not self.lr_grid or not all(isinstance(g, (int, float)) and g > 0 and math.isfinite(g)
                                       for g in self.lr_grid):
            raise ValueError(f"lr_grid must hold positive multipliers of each method's lr, got {self.lr_grid!r}")
        if not isinstance(self.lr_extensions, int) or self.lr_extensions < 0:
            raise ValueError(f"lr_extensions must be an integer >= 0, got {self.lr_extensions!r}")
        plans = [parse_method(m) for m in self.entries]
        self._validate_placement(plans)
        names = [p.name for p in plans]
        if len(set(names)) != len(names):
            raise ValueError(f"methods: {names} lists a method twice")
        if len(set(self.tasks)) != len(self.tasks):
            raise ValueError(f"tasks: {self.tasks} lists a task twice")
        unknown = sorted(set(self.method_opts) - set(names))
        if unknown:
            raise ValueError(f"settings given for {unknown}, which are not among the methods {names}")
        check_out_dir(self.out)

    def _validate_placement(self, plans: list[MethodPlan]) -> None:
        from slimopt.factory import HOST_MASTERS

        for name, value, allowed in (("weights", self.weights, ("dtype", "int8")),
                                     ("offload", self.offload, ("none", "host")),
                                     ("master", self.master, HOST_MASTERS)):
            if value not in allowed:
                raise ValueError(f"--{name} must be one of {', '.join(allowed)}, got {value!r}")
        if isinstance(self.int8_group, bool) or not isinstance(self.int8_group, int) or self.int8_group < 0:
            raise ValueError(f"--int8-group must be an integer >= 0 (0: one scale per row), got {self.int8_group!r}")
        if self.int8_group and self.weights != "int8":
            raise ValueError("--int8-group needs --weights int8")
        if self.int8_embeddings and self.weights != "int8":
            raise ValueError("--int8-embeddings needs --weights int8")
        lora = [p.name for p in plans if p.lora]
        if self.placed and lora:
            raise ValueError(f"--weights int8 and --offload host apply to full fine-tuning methods; {lora} train "
                             "LoRA adapters: run them without these options")


def method_settings(plan: MethodPlan, cfg: FinetuneConfig) -> dict[str, Any]:
    """The optimizer settings of one method: fine-tuning defaults, then ``cfg.lr``, then ``cfg.method_opts``."""
    settings: dict[str, Any] = {}
    if not plan.lora:
        defaults = FINETUNE_DEFAULTS.get(plan.optimizer, {})
        settings.update({k: (cfg.rank if v == "@rank" else v) for k, v in defaults.items()})
    settings["lr"] = cfg.lr if cfg.lr is not None and not plan.head_only else \
        FINETUNE_LR.get(plan.family, FINETUNE_LR["adamw"])
    opts = dict(cfg.method_opts.get(plan.name, {}))
    if "rank" in opts and "density" not in opts and settings.get("density") is not None:
        settings.pop("density")
    if "density" in opts and "rank" not in opts:
        settings.pop("rank", None)
    settings.update(opts)
    return settings


# --------------------------------------------------------------------------------------------------------------
# tasks and the model


def resolve_task(task: str, cfg: FinetuneConfig) -> tuple[Any, dict[str, Any]]:
    """(task name or TaskSpec, keyword arguments of ``load_task``) for one ``--tasks`` entry. Raises ValueError
    for an unknown task."""
    from slimopt.finetune.data import BUILTIN_TASKS, GLUE_TASKS, TaskSpec

    files: dict[str, Any] = {}
    if cfg.train_file or cfg.validation_file:
        if len(cfg.tasks) > 1:
            raise ValueError("train_file / validation_file serve one task; for several, give data_dir with a "
                             "folder per task")
        files = {"train_file": cfg.train_file, "validation_file": cfg.validation_file}
    if cfg.data_dir is not None and task not in BUILTIN_TASKS:
        root = Path(cfg.data_dir)
        sub = next((root / n for n in (task, GLUE_FOLDERS.get(task, task)) if (root / n).is_dir()), None)
        files["data_dir"] = str(sub if sub is not None else root)
    if task in GLUE_TASKS or task in BUILTIN_TASKS:
        return task, files
    if not files:
        known = ", ".join([*GLUE_TASKS, *BUILTIN_TASKS])
        raise ValueError(f"unknown task {task!r}; known tasks: {known}; for a task of your own give data_dir (or "
                         "train_file and validation_file) with text_columns and num_labels")
    if cfg.num_labels is None and not cfg.regression:
        raise ValueError(f"task {task!r} is not GLUE or built in: give num_labels (or regression) for its files")
    spec = TaskSpec(task, tuple(cfg.text_columns or ("sentence",)),
                    num_labels=1 if cfg.regression else int(cfg.num_labels), is_regression=cfg.regression)
    return spec, files


@dataclass
class _Prepared:
    name: str
    data: Any  # TaskData
    template: Any  # the model with a freshly initialised head, copied for every method


def prepare(cfg: FinetuneConfig, log: Callable[[str], None] = print) -> tuple[list[MethodPlan], list[_Prepared]]:
    """Check everything that can be checked before training: methods, tasks, model, files, labels. Raises
    ValueError / FileNotFoundError / ConnectionError with a message naming the bad input."""
    import transformers

    from slimopt.finetune.data import load_task

    cfg.validate()
    plans = [parse_method(m) for m in cfg.entries]
    for plan in plans:  # unknown or ill-typed settings fail now, not after the first task trained
        _check_settings(plan, cfg)
    resolved = [(t, *resolve_task(t, cfg)) for t in cfg.tasks]
    tokenizer = load_tokenizer(cfg.model)
    out = []
    for name, task, files in resolved:
        data = load_task(task, tokenizer, max_length=cfg.max_length, max_train_samples=cfg.max_train_samples,
                         max_eval_samples=cfg.max_eval_samples, seed=cfg.seed, **files)
        transformers.set_seed(cfg.seed)  # the same head initialisation for every method
        template = load_classifier(cfg.model, data.num_labels, data.id2label, tokenizer.pad_token_id)
        log(f"task {name}: {len(data.train)} train / {len(data.validation)} validation examples, "
            f"{data.num_labels} labels ({data.source})")
        _check_host(plans, template, cfg)
        out.append(_Prepared(name, data, template))
    return plans, out


def _check_host(plans: list[MethodPlan], template: Any, cfg: FinetuneConfig) -> None:
    """With int8 weights or a host master: stop before anything trains when the host cannot hold a method's master
    and state (``train.host_memory``: one line, needed, available and a setting that fits)."""
    from slimopt.train.host_memory import check_host_memory

    if not cfg.placed:
        return
    for plan in plans:
        if plan.head_only or plan.lora:  # the control runs as it is; LoRA is refused with these options
            continue
        settings = {k: v for k, v in method_settings(plan, cfg).items() if k != "lr"}
        check_host_memory(template, plan.optimizer, settings, weights=cfg.weights, offload=cfg.offload,
                          master=cfg.master, int8_group=cfg.int8_group, int8_embeddings=cfg.int8_embeddings,
                          batch=cfg.batch_size, seq=cfg.max_length,
                          device=next(template.parameters()).device)


def _check_settings(plan: MethodPlan, cfg: FinetuneConfig) -> None:
    """Build the method's optimizer on a two-layer probe: unknown or invalid settings fail before any training."""
    import torch

    from slimopt.optim.optimizer import SlimOptimizer
    from slimopt.optim.recipes import param_groups

    probe = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    try:
        SlimOptimizer(param_groups(probe, plan.optimizer, **method_settings(plan, cfg)))
    except (TypeError, ValueError) as err:
        raise ValueError(f"method {plan.name!r}: {err}") from None


# --------------------------------------------------------------------------------------------------------------
# one run


def _param_bytes(model) -> tuple[int, int, int]:
    """(bytes of every parameter, trainable count, total count); tied parameters once."""
    seen, nbytes, trainable, total = set(), 0, 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        nbytes += p.numel() * p.element_size()
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return nbytes, trainable, total


def _lr_source(plan: MethodPlan, cfg: FinetuneConfig) -> str:
    if "lr" in cfg.method_opts.get(plan.name, {}):
        return "--set"
    if cfg.lr is not None and not plan.head_only:
        return "--lr"
    return "default"


def head_modules(model) -> list[tuple[str, Any]]:
    """The classification head: the model's top-level modules outside its body (``base_model_prefix``), e.g.
    ``score`` (LLaMA), ``classifier`` (BERT, RoBERTa). Raises ValueError when there is none."""
    prefix = getattr(model, "base_model_prefix", "")
    head = [(n, m) for n, m in model.named_children() if n != prefix and next(m.parameters(), None) is not None]
    if not prefix or not head:
        raise ValueError(f"{type(model).__name__} has no classification head outside its body {prefix!r}")
    return head


def _new_head(model, seed: int) -> None:
    """Initialise the classification head anew from `seed`, as the model's own initialisation does."""
    import transformers

    transformers.set_seed(seed)
    for _, module in head_modules(model):
        module.apply(model._init_weights)


def finetune_one(plan: MethodPlan, prepared: _Prepared, cfg: FinetuneConfig, lr: float | None = None,
                 seed: int | None = None) -> dict[str, Any]:
    """Train a copy of the task's model with one method (at `lr`, default the method's; with `seed`, default
    cfg.seed: the head's initialisation and the batch order); evaluate; measure memory and step time."""
    settings = method_settings(plan, cfg)
    if lr is not None:
        settings["lr"] = lr
    seed = cfg.seed if seed is None else seed
    model = _model_for(plan, prepared, cfg, seed)
    run = _train_and_score(model, plan, prepared.data, cfg, settings, seed)
    return _result_row(plan, prepared, cfg, settings, seed, run)


def _model_for(plan: MethodPlan, prepared: _Prepared, cfg: FinetuneConfig, seed: int) -> Any:
    """A copy of the task's model as the method trains it: the head initialised from `seed`, the body frozen for
    the control, LoRA adapters for a LoRA method."""
    import transformers

    transformers.set_seed(seed)
    model = copy.deepcopy(prepared.template)
    if seed != cfg.seed:
        _new_head(model, seed)
    if plan.head_only:
        model.requires_grad_(False)
        for _, module in head_modules(model):
            module.requires_grad_(True)
    if plan.lora:
        from slimopt.baselines import apply_lora

        model = apply_lora(model, rank=cfg.rank, alpha=cfg.lora_alpha or 4.0 * cfg.rank)
    return model


@dataclass
class _Run:
    """What one training run leaves for its result row."""

    model: Any  # trained
    optimizer: Any
    train_loss: float
    steps: int
    step_times: list[float]
    train_s: float
    metrics: dict[str, float]
    eval_loss: float


def _train_and_score(model, plan: MethodPlan, data, cfg: FinetuneConfig, settings: dict[str, Any],
                     seed: int) -> _Run:
    """Train `model` in place with ``transformers.Trainer`` and the method's optimizer, timing each step, then
    score every validation split."""
    import torch
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    from slimopt.finetune.hf import make_optimizer

    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.t)

    with tempfile.TemporaryDirectory(prefix="slimopt-finetune-") as tmp:
        args = TrainingArguments(
            output_dir=tmp, num_train_epochs=cfg.epochs, max_steps=cfg.max_steps or -1,
            per_device_train_batch_size=cfg.batch_size, per_device_eval_batch_size=cfg.eval_batch_size,
            gradient_accumulation_steps=cfg.grad_accum, learning_rate=settings["lr"],
            weight_decay=cfg.weight_decay, warmup_steps=cfg.warmup, lr_scheduler_type="linear",
            max_grad_norm=cfg.clip, bf16=cfg.bf16, seed=seed, data_seed=seed,
            save_strategy="no", eval_strategy="no", report_to="none", logging_strategy="no", disable_tqdm=True,
            use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0,
        )
        opt_settings = {k: v for k, v in settings.items() if k != "lr"}
        if cfg.placed and not plan.head_only:  # the control's frozen body stays as it is: it is the reference
            opt_settings.update(weights=cfg.weights, int8_group=cfg.int8_group,
                                int8_embeddings=cfg.int8_embeddings, offload=cfg.offload, master=cfg.master)
        optimizer = make_optimizer(model, args, plan.optimizer, optim_target_modules=None, optim_args=None,
                                   **opt_settings)
        trainer = Trainer(model=model, args=args, train_dataset=data.train, data_collator=data.data_collator,
                          compute_metrics=data.compute_metrics, optimizers=(optimizer, None),
                          callbacks=[StepTimer()])
        trainer.remove_callback(PrinterCallback)  # the Trainer's own log lines; run_finetune prints a summary
        if hasattr(optimizer, "grad_norm_callback"):  # host masters: their norm, not the model's empty gradients
            trainer.callback_handler.callbacks.insert(0, optimizer.grad_norm_callback())
        started = time.perf_counter()
        train_out = trainer.train()
        train_s = time.perf_counter() - started
        metrics, eval_loss = {}, float("nan")
        for split, ds in data.eval_datasets().items():
            result = trainer.evaluate(eval_dataset=ds, metric_key_prefix="eval")
            prefix = "" if split == data.spec.validation_split else f"{split}/"
            metrics.update({f"{prefix}{m}": float(result[f"eval_{m}"]) for m in data.metric_names})
            if split == data.spec.validation_split:
                eval_loss = float(result["eval_loss"])
    return _Run(model, optimizer, float(train_out.training_loss), int(trainer.state.global_step), times, train_s, metrics,
                eval_loss)


def _result_row(plan: MethodPlan, prepared: _Prepared, cfg: FinetuneConfig, settings: dict[str, Any], seed: int,
                run: _Run) -> dict[str, Any]:
    """One run's row: scores, losses, step time, and memory (weights and state counted, one more iteration's peak
    measured and planned)."""
    import slimopt
    from slimopt.bench.iteration_peak import measure_peak, planned_peak

    data, model, optimizer = prepared.data, run.model, run.optimizer
    weight_bytes, trainable, total = _param_bytes(model)
    state_bytes = slimopt.state_nbytes(optimizer)
    # one more iteration, counted tensor by tensor, on the first training batch (the weights are scored already)
    batch = data.data_collator([data.train[i] for i in range(min(cfg.batch_size, len(data.train)))])
    batch_shape = tuple(batch["input_ids"].shape)
    peak = measure_peak(model, optimizer, batch)
    planned = planned_peak(model, plan.optimizer, settings, *batch_shape)
    loss, eval_loss = run.train_loss, run.eval_loss
    primary = data.metric_names[0]
    return {
        "task": prepared.name,
        "method": plan.name,
        "optimizer": plan.optimizer,
        "lora": plan.lora,
        "role": "control" if plan.head_only else "method",
        "seed": seed,
        "status": "ok" if math.isfinite(loss) and math.isfinite(eval_loss) else "diverged",
        "metric": primary,
        "score": run.metrics[primary],
        "metrics": run.metrics,
        "eval_loss": eval_loss,
        "train_loss": loss,
        "steps": run.steps,
        "s_per_step": statistics.median(run.step_times) if run.step_times else float("nan"),
        "train_s": run.train_s,
        "weight_bytes": weight_bytes,
        "state_bytes": state_bytes,
        "memory_bytes": weight_bytes + state_bytes,
        "peak_bytes": peak,
        "planned_peak_bytes": planned,
        "peak_batch": list(batch_shape),
        "trainable_params": trainable,
        "total_params": total,
        "lr": settings["lr"],
        "settings": {k: v for k, v in settings.items() if k != "lr"},
    }


def run_finetune(cfg: FinetuneConfig, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Check all input, then train every method on every task (the control first; tuning and seeds as cfg says);
    write results after each method. Returns one row per task and method, the mean over its seeds (a method whose
    runs all raised has status "failed: ...")."""
    plans, prepared = prepare(cfg, log)
    out = Path(cfg.out)
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    n = len(plans) * len(prepared)
    seeds = seed_list(cfg.seed, cfg.seeds)
    for task in prepared:
        for plan in plans:
            log(f"[{len(rows) + 1}/{n}] {plan.name} on {task.name} ...")

            def one(lr: float, seed: int, plan=plan, task=task) -> dict[str, Any]:
                return finetune_one(plan, task, cfg, lr=lr, seed=seed)

            settings = method_settings(plan, cfg)
            grid = cfg.lr_grid if cfg.tune_lr else None
            row = run_method(one, task.name, plan.name, settings["lr"], _lr_source(plan, cfg), seeds, grid,
                             cfg.lr_extensions, log)
            rows.append(row)
            if row["status"] == "ok":
                spread = (f" [{100 * row['score_min']:.1f}-{100 * row['score_max']:.1f}] over {row['seeds_ok']} "
                          "seeds" if row["seeds"] > 1 else "")
                log(f"    {row['metric']} {100 * row['score']:.1f}{spread}, loss {row['train_loss']:.3f}, "
                    f"{row['steps']} steps at {row['s_per_step']:.2f} s, lr {row['lr']:.3g}, weights + state "
                    f"{mib(row['memory_bytes']):.1f} MiB, peak {mib(row['peak_bytes']):.1f} MiB (planned "
                    f"{mib(row['planned_peak_bytes']):.1f})")
            else:
                log(f"    {row['status']}")
            write_results(rows, cfg, out, time.perf_counter() - started)
    log(f"wrote {out / 'results.md'} and {out / 'results.csv'}")
    return rows
