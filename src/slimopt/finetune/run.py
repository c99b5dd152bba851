"""Fine-tune sequence classifiers with several methods on several tasks, and tabulate accuracy against memory.

What ``slimopt finetune`` runs. GaLore (arXiv 2403.03507, Table 4) and FRUGAL (arXiv 2411.07837) fine-tune
RoBERTa-base on GLUE and compare with full fine-tuning and LoRA (arXiv 2106.09685) at the same rank, reporting the
memory of weights plus optimizer state next to the scores. ``run_finetune`` does the same for any
``*ForSequenceClassification`` model and any task ``slimopt.finetune.data.load_task`` reads, through
``transformers.Trainer`` (its gradient accumulation, clipping, bf16 autocast and linear schedule with warmup).

Methods (``parse_method``):

- a slimopt method (``slimopt.methods()``: adamw, adamw8bit, galore, frugal, taco, ternary_adamw, ...) on every
  parameter; ``adamw`` is full fine-tuning (torch.optim.AdamW's update);
- ``lora``: peft LoRA adapters on attention and MLP (``slimopt.baselines.apply_lora``: alpha = 4 x rank, the
  classifier trains in full) with AdamW;
- ``lora+METHOD``: LoRA with a slimopt method on the adapter parameters (``lora+adamw8bit``: QLoRA-style state).

Fine-tuning settings differ from the pretraining defaults of ``slimopt.optim.recipes`` (GaLore rank 128 and lr
0.01 are for LLaMA pretraining): ``FINETUNE_DEFAULTS`` gives the subspace methods the LoRA rank (8) and
``FINETUNE_LR`` a learning rate per method family; ``FinetuneConfig.lr`` and ``method_opts`` override them.

Memory is measured, not estimated: weights are the bytes of every parameter (frozen ones included), optimizer
state is ``slimopt.state_nbytes`` of the optimizer after training (codes, scales, projection bases, counters).
Gradients and activations are not counted, as in GaLore's Table 4.
"""

from __future__ import annotations

import copy
import csv
import json
import math
import os
import platform
import re
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from slimopt.pretrained import SMOLLM2, load_smollm2, load_smollm2_tokenizer

__all__ = [
    "FinetuneConfig",
    "MethodPlan",
    "FINETUNE_DEFAULTS",
    "FINETUNE_LR",
    "OFFLINE_MODEL",
    "GLUE_FOLDERS",
    "parse_method",
    "method_settings",
    "resolve_task",
    "load_tokenizer",
    "load_classifier",
    "prepare",
    "finetune_one",
    "run_finetune",
    "write_results",
    "read_results",
]

OFFLINE_MODEL = "minilm"
"""``--model`` name of the offline MiniLM-L6 encoder (``slimopt.finetune.data.load_offline_classifier``)."""

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

    @property
    def family(self) -> str:
        return "lora" if self.lora else _family(self.optimizer)


def _family(method: str) -> str:
    base = re.split(r"_|\d", method, maxsplit=1)[0]
    if base in ("adamw", "ternary"):
        return "adamw"
    return base


def parse_method(name: str) -> MethodPlan:
    """``"galore"`` -> full-model GaLore; ``"lora"`` -> LoRA + AdamW; ``"lora+adamw8bit"`` -> LoRA + 8-bit AdamW.

    Raises ValueError for anything else, listing what is allowed.
    """
    from slimopt.optim.recipes import METHODS

    text = name.strip()
    lora = text == "lora" or text.startswith("lora+")
    optimizer = "adamw" if text == "lora" else text[len("lora+"):] if lora else text
    if optimizer not in METHODS:
        raise ValueError(
            f"unknown method {name!r}; use a slimopt method ({', '.join(METHODS)}), 'lora', or 'lora+METHOD' "
            "(LoRA adapters optimized by a slimopt method)"
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
    method_opts: dict[str, dict[str, Any]] = field(default_factory=dict)  # {method name: {setting: value}}
    out: str = "slimopt-finetune"

    def validate(self) -> None:
        if not self.tasks:
            raise ValueError("tasks: give at least one task")
        if not self.methods:
            raise ValueError("methods: give at least one method")
        for name in ("max_length", "batch_size", "eval_batch_size", "grad_accum", "rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("max_train_samples", "max_eval_samples", "max_steps", "num_labels"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
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
        plans = [parse_method(m) for m in self.methods]
        names = [p.name for p in plans]
        if len(set(names)) != len(names):
            raise ValueError(f"methods: {names} lists a method twice")
        if len(set(self.tasks)) != len(self.tasks):
            raise ValueError(f"tasks: {self.tasks} lists a task twice")
        unknown = sorted(set(self.method_opts) - set(names))
        if unknown:
            raise ValueError(f"settings given for {unknown}, which are not among the methods {names}")


def method_settings(plan: MethodPlan, cfg: FinetuneConfig) -> dict[str, Any]:
    """The optimizer settings of one method: fine-tuning defaults, then ``cfg.lr``, then ``cfg.method_opts``."""
    settings: dict[str, Any] = {}
    if not plan.lora:
        defaults = FINETUNE_DEFAULTS.get(plan.optimizer, {})
        settings.update({k: (cfg.rank if v == "@rank" else v) for k, v in defaults.items()})
    settings["lr"] = cfg.lr if cfg.lr is not None else FINETUNE_LR.get(plan.family, FINETUNE_LR["adamw"])
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


def _hub_source(name: str) -> tuple[str, bool, bool]:
    """(what to pass to from_pretrained, local files only, is a local folder) for a model name or path."""
    from slimopt.train.tokenizer import hub_offline

    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ValueError(f"model path {name!r} exists but holds no config.json")
        return str(path), True, True
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise FileNotFoundError(f"model path {name!r} does not exist")
    return name, hub_offline(), False


def _from_pretrained(name: str, load: Callable[[str, bool], Any]) -> Any:
    from slimopt.train.tokenizer import hub_calls_offline

    source, offline, local = _hub_source(name)
    try:
        with hub_calls_offline(offline):
            return load(source, offline)
    except (OSError, ValueError) as err:
        where = ("its folder" if local else
                 "the local Hugging Face cache (the hub is unreachable)" if offline else "the Hugging Face hub")
        raise ValueError(
            f"cannot load model {name!r} from {where}: {err}. Without network access use --model "
            f"{OFFLINE_MODEL} (the offline MiniLM-L6), {SMOLLM2} (the offline SmolLM2 decoder) or a local model folder"
        ) from err


def load_tokenizer(name: str) -> Any:
    """The tokenizer of ``load_classifier(name, ...)``, with a padding token (decoder models lack one)."""
    import transformers

    from slimopt.finetune.data import offline_model_path

    if name == OFFLINE_MODEL:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(offline_model_path()))
    elif name == SMOLLM2:
        tokenizer = load_smollm2_tokenizer()
    else:
        tokenizer = _from_pretrained(
            name, lambda src, offline: transformers.AutoTokenizer.from_pretrained(src, local_files_only=offline))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_classifier(name: str, num_labels: int, id2label: dict[int, str] | None = None,
                    pad_token_id: int | None = None) -> Any:
    """A ``*ForSequenceClassification`` model with a new head of ``num_labels`` outputs: the offline MiniLM for
    ``"minilm"``, SmolLM2-135M for ``"smollm2-135m"`` (``slimopt.pretrained``), else
    ``AutoModelForSequenceClassification`` from a local folder or the Hugging Face hub
    (offline: only its local cache; a checkpoint with another label count loads too)."""
    import transformers

    from slimopt.finetune.data import load_offline_classifier

    if name == OFFLINE_MODEL:
        model = load_offline_classifier(num_labels, id2label=id2label)[0]
    elif name == SMOLLM2:
        model = load_smollm2(num_labels, id2label)
    else:
        kwargs: dict[str, Any] = {"num_labels": num_labels, "ignore_mismatched_sizes": True}
        if id2label is not None:
            kwargs.update(id2label=dict(id2label), label2id={v: k for k, v in id2label.items()})
        model = _from_pretrained(name, lambda src, offline: transformers.AutoModelForSequenceClassification
                                 .from_pretrained(src, local_files_only=offline, **kwargs))
    if getattr(model.config, "pad_token_id", None) is None and pad_token_id is not None:
        model.config.pad_token_id = pad_token_id  # decoder classifiers pool the last token that is not padding
    return model


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
    plans = [parse_method(m) for m in cfg.methods]
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
        out.append(_Prepared(name, data, template))
    return plans, out


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


def finetune_one(plan: MethodPlan, prepared: _Prepared, cfg: FinetuneConfig) -> dict[str, Any]:
    """Train a copy of the task's model with one method; evaluate; measure memory and step time."""
    import torch
    import transformers
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    import slimopt
    from slimopt.finetune.hf import make_optimizer

    data = prepared.data
    settings = method_settings(plan, cfg)
    transformers.set_seed(cfg.seed)
    model = copy.deepcopy(prepared.template)
    if plan.lora:
        from slimopt.baselines import apply_lora

        model = apply_lora(model, rank=cfg.rank, alpha=cfg.lora_alpha or 4.0 * cfg.rank)

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
            max_grad_norm=cfg.clip, bf16=cfg.bf16, seed=cfg.seed, data_seed=cfg.seed,
            save_strategy="no", eval_strategy="no", report_to="none", logging_strategy="no", disable_tqdm=True,
            use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0,
        )
        opt_settings = {k: v for k, v in settings.items() if k != "lr"}
        optimizer = make_optimizer(model, args, plan.optimizer, optim_target_modules=None, optim_args=None,
                                   **opt_settings)
        trainer = Trainer(model=model, args=args, train_dataset=data.train, data_collator=data.data_collator,
                          compute_metrics=data.compute_metrics, optimizers=(optimizer, None),
                          callbacks=[StepTimer()])
        trainer.remove_callback(PrinterCallback)  # the Trainer's own log lines; run_finetune prints a summary
        started = time.perf_counter()
        train_out = trainer.train()
        train_s = time.perf_counter() - started
        metrics = {}
        for split, ds in data.eval_datasets().items():
            result = trainer.evaluate(eval_dataset=ds, metric_key_prefix="eval")
            prefix = "" if split == data.spec.validation_split else f"{split}/"
            metrics.update({f"{prefix}{m}": float(result[f"eval_{m}"]) for m in data.metric_names})

    weight_bytes, trainable, total = _param_bytes(model)
    state_bytes = slimopt.state_nbytes(optimizer)
    loss = float(train_out.training_loss)
    primary = data.metric_names[0]
    return {
        "task": prepared.name,
        "method": plan.name,
        "optimizer": plan.optimizer,
        "lora": plan.lora,
        "status": "ok" if math.isfinite(loss) else "diverged",
        "metric": primary,
        "score": metrics[primary],
        "metrics": metrics,
        "train_loss": loss,
        "steps": int(trainer.state.global_step),
        "s_per_step": statistics.median(times) if times else float("nan"),
        "train_s": train_s,
        "weight_bytes": weight_bytes,
        "state_bytes": state_bytes,
        "memory_bytes": weight_bytes + state_bytes,
        "trainable_params": trainable,
        "total_params": total,
        "lr": settings["lr"],
        "settings": {k: v for k, v in settings.items() if k != "lr"},
    }


def run_finetune(cfg: FinetuneConfig, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Check all input, then train every method on every task; write results after each run. Returns the rows
    (a run that raised has status "failed: ...")."""
    plans, prepared = prepare(cfg, log)
    out = Path(cfg.out)
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    n = len(plans) * len(prepared)
    for task in prepared:
        for plan in plans:
            log(f"[{len(rows) + 1}/{n}] {plan.name} on {task.name} ...")
            try:
                row = finetune_one(plan, task, cfg)
            except (RuntimeError, ValueError) as err:  # one failing method must not lose the others' results
                row = {"task": task.name, "method": plan.name, "status": f"failed: {err}"}
            rows.append(row)
            if row["status"] == "ok":
                log(f"    {row['metric']} {100 * row['score']:.1f}, loss {row['train_loss']:.3f}, "
                    f"{row['steps']} steps at {row['s_per_step']:.2f} s, weights + state "
                    f"{_mib(row['memory_bytes']):.1f} MiB")
            else:
                log(f"    {row['status']}")
            write_results(rows, cfg, out, time.perf_counter() - started)
    log(f"wrote {out / 'results.md'} and {out / 'results.csv'}")
    return rows


# --------------------------------------------------------------------------------------------------------------
# results

CSV_COLUMNS = ["task", "method", "optimizer", "lora", "status", "metric", "score", "metrics", "train_loss", "steps",
               "s_per_step", "train_s", "weight_bytes", "state_bytes", "memory_bytes", "trainable_params",
               "total_params", "lr", "settings"]


def _mib(nbytes: float) -> float:
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


def _machine() -> str:
    import torch

    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {os.cpu_count()} CPU cores, {gpu}, {torch.get_num_threads()} torch threads"


def _label(row: dict[str, Any], cfg: FinetuneConfig) -> str:
    if row.get("lora"):
        base = f"LoRA r={cfg.rank}"
        return base if row["optimizer"] == "adamw" else f"{base} + {row['optimizer']}"
    if row.get("optimizer") == "adamw":
        return "Full FT (AdamW)"
    settings = row.get("settings") or {}
    label = f"{row['method']} r={settings['rank']}" if settings.get("rank") else row["method"]
    return f"{label}, state_full={settings['state_full']}" if settings.get("state_full") else label


def _markdown(rows: list[dict[str, Any]], cfg: FinetuneConfig, elapsed: float | None) -> str:
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    by = {(r["method"], r["task"]): r for r in rows}
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    budget = f"{cfg.max_steps} steps" if cfg.max_steps else f"{cfg.epochs:g} epoch(s)"
    lines = [
        f"# slimopt finetune: {cfg.model} on {', '.join(tasks)}",
        "",
        f"- Date: {now}. Machine: {_machine()}. Versions: {_versions()}.",
        f"- Train examples per task <= {cfg.max_train_samples or 'all'}, validation <= "
        f"{cfg.max_eval_samples or 'all'} (stratified subsample, seed {cfg.seed}), max length {cfg.max_length} "
        f"tokens; batch {cfg.batch_size} x accumulation {cfg.grad_accum}, {budget}, linear schedule with warmup "
        f"{cfg.warmup:g}, clip {cfg.clip:g}, weight decay {cfg.weight_decay:g}, {'bf16 autocast' if cfg.bf16 else 'fp32'}.",
        "- Scores are the task's first metric x 100 on the validation split. Memory: bytes of all weights (frozen "
        "included) + optimizer state (slimopt.state_nbytes after training); gradients and activations not counted.",
    ]
    if elapsed is not None:
        lines.append(f"- Wall time of the command: {elapsed:.0f} s.")
    header = "| Method | Weights + state MiB | " + " | ".join(
        f"{t} ({_task_metric(rows, t)})" for t in tasks) + (" | Avg |" if len(tasks) > 1 else " |")
    lines += ["", header, "|---|---:|" + "---:|" * (len(tasks) + (len(tasks) > 1))]
    for m in methods:
        runs = [by.get((m, t)) for t in tasks]
        ok = [r for r in runs if r and r["status"] == "ok"]
        label = _label(ok[0], cfg) if ok else m
        memory = f"{_mib(max(r['memory_bytes'] for r in ok)):.1f}" if ok else ""
        cells = [f"{100 * r['score']:.1f}" if r and r["status"] == "ok" else (r["status"].split(":")[0] if r else "")
                 for r in runs]
        avg = [f"{100 * sum(r['score'] for r in ok) / len(ok):.1f}" if len(ok) == len(tasks) else ""]
        lines.append(f"| {label} | {memory} | " + " | ".join(cells + (avg if len(tasks) > 1 else [])) + " |")
    lines += ["", "Per run:", "",
              "| task | method | metrics | train loss | trainable params | weights MiB | state MiB | state B/trainable "
              "param | s/step | steps | lr | settings |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r["status"].startswith("failed"):
            lines.append(f"| {r['task']} | {r['method']} | {r['status']} | | | | | | | | | |")
            continue
        metrics = ", ".join(f"{k} {100 * v:.1f}" for k, v in r["metrics"].items())
        per_param = r["state_bytes"] / r["trainable_params"] if r["trainable_params"] else float("nan")
        settings = ", ".join(f"{k}={v}" for k, v in r["settings"].items()) or "-"
        lines.append(
            f"| {r['task']} | {r['method']} | {metrics} | {r['train_loss']:.3f} | {r['trainable_params']:,} | "
            f"{_mib(r['weight_bytes']):.1f} | {_mib(r['state_bytes']):.2f} | {per_param:.2f} | "
            f"{r['s_per_step']:.3f} | {r['steps']} | {r['lr']:g} | {settings} |")
    lines.append("")
    return "\n".join(lines)


def _task_metric(rows: list[dict[str, Any]], task: str) -> str:
    return next((r["metric"] for r in rows if r["task"] == task and r.get("metric")), "")


def write_results(rows: list[dict[str, Any]], cfg: FinetuneConfig, out: Path | str,
                  elapsed: float | None = None) -> None:
    """results.md (the method x task table, then one line per run) and results.csv (one row per run)."""
    from slimopt.train.results import write_csv_and_markdown
    out = write_csv_and_markdown(out, CSV_COLUMNS, rows, _markdown(rows, cfg, elapsed))
    (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2, default=str))


def read_results(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a results.csv with numbers, booleans and the metrics / settings dicts parsed."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for k, v in list(r.items()):
            if k in ("metrics", "settings"):
                r[k] = json.loads(v) if v else {}
            elif k == "lora":
                r[k] = v == "True"
            elif k not in ("task", "method", "optimizer", "status", "metric"):
                r[k] = float(v) if v not in ("", None) else None
    return rows
