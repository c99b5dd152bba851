"""Sequence-classification data for fine-tuning: GLUE, local files, and offline tasks that install with pip.

GaLore (arXiv 2403.03507) and FRUGAL (arXiv 2411.07837) fine-tune RoBERTa-base on GLUE (Wang et al.,
arXiv 1804.07461). ``load_task`` returns the train and validation sets of a task tokenized for a
``*ForSequenceClassification`` model (columns ``input_ids``, ``attention_mask``, ``token_type_ids`` where the
tokenizer makes them, and ``labels``), with everything a training loop needs besides: the number of labels,
the label names, the task's metrics and a padding collator::

    model, tokenizer = slimopt.models.minilm.load_offline_classifier(num_labels=5)
    data = load_task("bbc", tokenizer, max_length=128, max_train_samples=500)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data.train,
                                   eval_dataset=data.validation, data_collator=data.data_collator,
                                   compute_metrics=data.compute_metrics)

Details: docs/modules.md, ``slimopt.finetune.data``.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from slimopt import corpora

from .metrics import METRIC_FUNCTIONS, REGRESSION_METRICS, TASK_METRICS, compute_metrics

__all__ = [
    "TaskSpec",
    "TaskData",
    "GLUE_TASKS",
    "BUILTIN_TASKS",
    "GLUE_DATASET",
    "VALIDATION_FRACTION",
    "load_task",
]

GLUE_DATASET = "nyu-mll/glue"
"""Hub id of GLUE (``load_dataset("glue", task)`` resolves to it)."""

VALIDATION_FRACTION = 0.2
"""Share of each class that the built-in tasks hold out for validation."""

FILE_EXTENSIONS = (".tsv", ".csv", ".jsonl", ".json")


@dataclass(frozen=True)
class TaskSpec:
    """What a sequence-classification task looks like.

    Attributes:
        name: the task's name (used in messages and for the metric lookup when ``metrics`` is empty).
        text_columns: one column (single text) or two (a text pair, e.g. premise and hypothesis).
        num_labels: number of classes; 1 for regression.
        is_regression: real-valued labels (STS-B) scored by Pearson / Spearman.
        validation_split: name of the split the task is validated on ("validation", MNLI "validation_matched").
        extra_validation_splits: further validation splits scored separately (MNLI "validation_mismatched").
        label_names: class names in label order; string labels in files are mapped through them.
        label_column: column holding the label.
        metrics: metric names from ``slimopt.finetune.metrics.METRIC_FUNCTIONS``; empty means the task's
            entry in ``TASK_METRICS`` or else accuracy (Pearson and Spearman for regression).
    """

    name: str
    text_columns: tuple[str, ...]
    num_labels: int
    is_regression: bool = False
    validation_split: str = "validation"
    extra_validation_splits: tuple[str, ...] = ()
    label_names: tuple[str, ...] | None = None
    label_column: str = "label"
    metrics: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.text_columns, str):
            object.__setattr__(self, "text_columns", (self.text_columns,))
        if not 1 <= len(self.text_columns) <= 2:
            raise ValueError(f"text_columns must name one or two columns, got {self.text_columns!r}")
        if self.is_regression and self.num_labels != 1:
            raise ValueError(f"a regression task has num_labels=1, got {self.num_labels}")
        if not self.is_regression and self.num_labels < 2:
            raise ValueError(f"a classification task needs num_labels >= 2, got {self.num_labels}")
        if self.label_names is not None:
            object.__setattr__(self, "label_names", tuple(self.label_names))
            if len(self.label_names) != self.num_labels:
                raise ValueError(
                    f"label_names has {len(self.label_names)} names but num_labels is {self.num_labels}"
                )
        if not self.metrics:
            default = ("pearson", "spearman") if self.is_regression else ("accuracy",)
            object.__setattr__(self, "metrics", TASK_METRICS.get(self.name, default))
        object.__setattr__(self, "metrics", tuple(self.metrics))
        unknown = [m for m in self.metrics if m not in METRIC_FUNCTIONS]
        if unknown:
            raise ValueError(f"unknown metric(s) {unknown}; allowed: {', '.join(METRIC_FUNCTIONS)}")
        regression_metrics = set(self.metrics) & REGRESSION_METRICS
        if (self.is_regression and regression_metrics != set(self.metrics)) or (
            not self.is_regression and regression_metrics
        ):
            kind = "regression" if self.is_regression else "classification"
            raise ValueError(f"metrics {self.metrics} do not suit a {kind} task")


def _glue(name, columns, labels, **kw) -> TaskSpec:
    return TaskSpec(name, columns, num_labels=len(labels) if labels else 1, label_names=labels, **kw)


GLUE_TASKS: dict[str, TaskSpec] = {
    "cola": _glue("cola", ("sentence",), ("unacceptable", "acceptable")),
    "sst2": _glue("sst2", ("sentence",), ("negative", "positive")),
    "mrpc": _glue("mrpc", ("sentence1", "sentence2"), ("not_equivalent", "equivalent")),
    "qqp": _glue("qqp", ("question1", "question2"), ("not_duplicate", "duplicate")),
    "stsb": _glue("stsb", ("sentence1", "sentence2"), None, is_regression=True),
    "mnli": _glue(
        "mnli", ("premise", "hypothesis"), ("entailment", "neutral", "contradiction"),
        validation_split="validation_matched", extra_validation_splits=("validation_mismatched",),
    ),
    "qnli": _glue("qnli", ("question", "sentence"), ("entailment", "not_entailment")),
    "rte": _glue("rte", ("sentence1", "sentence2"), ("entailment", "not_entailment")),
    "wnli": _glue("wnli", ("sentence1", "sentence2"), ("not_entailment", "entailment")),
}
"""The nine GLUE tasks: text columns, label count and names, regression flag, validation split."""

BUILTIN_TASKS: dict[str, TaskSpec] = {
    "bbc": TaskSpec("bbc", ("text",), 5, label_names=corpora.BBC_TOPICS),
    "kjv-testament": TaskSpec("kjv-testament", ("text",), 2, label_names=("old_testament", "new_testament")),
    "kjv-book": TaskSpec("kjv-book", ("text",), 66),  # label names (book titles) come from the database
}
"""Offline tasks built from pip packages (see the module docstring for the split)."""

# Column names of the original GLUE tsv files that differ from the hub's: {task: {file column: hub column}}.
_GLUE_FILE_ALIASES: dict[str, dict[str, str]] = {
    "mrpc": {"#1 String": "sentence1", "#2 String": "sentence2", "Quality": "label"},
    "qqp": {"is_duplicate": "label"},
    "stsb": {"score": "label"},
    "mnli": {"sentence1": "premise", "sentence2": "hypothesis", "gold_label": "label"},
}
# CoLA's original train.tsv / dev.tsv have no header row.
_HEADERLESS_LAYOUTS: dict[str, tuple[str, ...]] = {"cola": ("source", "label", "author_label", "sentence")}


@dataclass
class _RawSplit:
    """Texts and labels of one split before tokenization. texts: one list per text column."""

    texts: list[list[str]]
    labels: np.ndarray  # (n,) int64 class ids or float32 scores
    origin: str  # where it came from, for messages


@dataclass
class TaskData:
    """A task ready for training: tokenized splits plus what the model and the metrics need.

    ``train`` and ``validation`` are ``datasets.Dataset`` objects; ``extra_validation`` holds further
    validation splits (MNLI mismatched). Without a tokenizer the datasets hold the raw text columns instead.
    """

    spec: TaskSpec
    train: Any
    validation: Any
    extra_validation: dict[str, Any] = field(default_factory=dict)
    source: str = ""
    tokenizer: Any = None
    label_names: tuple[str, ...] | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def num_labels(self) -> int:
        return self.spec.num_labels

    @property
    def is_regression(self) -> bool:
        return self.spec.is_regression

    @property
    def metric_names(self) -> tuple[str, ...]:
        return self.spec.metrics

    @property
    def id2label(self) -> dict[int, str] | None:
        """For the model config, so saved models carry readable labels."""
        return None if self.label_names is None else dict(enumerate(self.label_names))

    @property
    def label2id(self) -> dict[str, int] | None:
        return None if self.label_names is None else {n: i for i, n in enumerate(self.label_names)}

    def eval_datasets(self) -> dict[str, Any]:
        """Every validation split by name, for ``Trainer(eval_dataset=...)`` (metrics get the name as prefix)."""
        return {self.spec.validation_split: self.validation, **self.extra_validation}

    @property
    def data_collator(self) -> Any:
        """Pads each batch to its longest sequence (``transformers.DataCollatorWithPadding``)."""
        if self.tokenizer is None:
            raise ValueError("this TaskData was loaded without a tokenizer: there is nothing to pad")
        from transformers import DataCollatorWithPadding

        return DataCollatorWithPadding(self.tokenizer)

    def compute_metrics(self, eval_prediction: Any) -> dict[str, float]:
        """The task's metrics from an ``EvalPrediction`` or a ``(predictions, label_ids)`` pair (Trainer-ready)."""
        if hasattr(eval_prediction, "predictions"):
            return compute_metrics(self.metric_names, eval_prediction.predictions, eval_prediction.label_ids)
        predictions, labels = eval_prediction
        return compute_metrics(self.metric_names, predictions, labels)

    def summary(self) -> dict[str, Any]:
        """Sizes and label counts of every split (by label name where the task has names)."""
        splits = {"train": self.train, **self.eval_datasets()}
        out: dict[str, Any] = {"task": self.name, "source": self.source, "num_labels": self.num_labels, "splits": {}}
        for split_name, ds in splits.items():
            entry: dict[str, Any] = {"size": len(ds)}
            labels = np.asarray(ds["labels"])
            if self.is_regression:
                entry["label_mean"] = float(labels.mean()) if len(labels) else float("nan")
            else:
                counts = np.bincount(labels.astype(np.int64), minlength=self.num_labels)
                names = self.label_names or tuple(str(i) for i in range(self.num_labels))
                entry["label_counts"] = {names[i]: int(c) for i, c in enumerate(counts)}
            out["splits"][split_name] = entry
        return out


# --------------------------------------------------------------------------------------------------------------
# Public entry point


def load_task(
    task: str | TaskSpec,
    tokenizer: Any = None,
    max_length: int = 128,
    data_dir: str | Path | None = None,
    *,
    train_file: str | Path | None = None,
    validation_file: str | Path | None = None,
    max_train_samples: int | None = None,
    max_eval_samples: int | None = None,
    seed: int = 0,
    padding: bool = False,
) -> TaskData:
    """Load a task's train and validation sets, tokenized for sequence classification.

    Args:
        task: a GLUE task name, a built-in task name ("bbc", "kjv-testament", "kjv-book") or a ``TaskSpec``
            for your own files.
        tokenizer: a Hugging Face tokenizer; texts are truncated to ``max_length`` tokens. ``None`` keeps the
            raw text columns (for inspection).
        max_length: the longest tokenized input, in tokens (GaLore's GLUE runs use 512, the default here is the
            Hugging Face run_glue default, 128).
        data_dir: a directory holding ``train.<ext>`` and ``validation.<ext>`` / ``dev.<ext>``
            (ext: tsv, csv, jsonl, json).
        train_file, validation_file: explicit files; they take precedence over ``data_dir``.
        max_train_samples, max_eval_samples: keep at most this many examples per split (stratified for
            classification); every validation split is capped by ``max_eval_samples``.
        seed: seed of the subsampling.
        padding: pad every example to ``max_length`` (fixed shapes); by default batches are padded by
            ``TaskData.data_collator`` to their longest example.

    Raises:
        ValueError: an unknown task, a missing text or label column, labels outside ``[0, num_labels)``,
            bad arguments. FileNotFoundError: a file or directory that does not exist.
            ConnectionError: a GLUE task without local files when the hub cannot be reached.
    """
    spec = _resolve_spec(task)
    if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 1:
        raise ValueError(f"max_length must be a positive int, got {max_length!r}")
    for arg_name, value in (("max_train_samples", max_train_samples), ("max_eval_samples", max_eval_samples)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{arg_name} must be a positive int or None, got {value!r}")

    uses_files = data_dir is not None or train_file is not None or validation_file is not None
    label_names = spec.label_names
    if spec.name in BUILTIN_TASKS and not isinstance(task, TaskSpec):
        if uses_files:
            raise ValueError(
                f"task {spec.name!r} is built in and reads no files; data_dir / train_file / validation_file "
                "apply to GLUE tasks and to a TaskSpec of your own"
            )
        splits, label_names = _load_builtin(spec)
        source = "builtin"
    elif uses_files:
        splits = _load_files(spec, data_dir, train_file, validation_file)
        source = "files"
    elif spec.name in GLUE_TASKS and not isinstance(task, TaskSpec):
        splits = _load_glue_hub(spec)
        source = f"hub:{GLUE_DATASET}"
    else:
        raise ValueError(
            f"task {spec.name!r} is a TaskSpec of your own: give data_dir or train_file and validation_file"
        )

    train_idx = _subsample(splits["train"].labels, max_train_samples, seed, 0, spec.is_regression)
    splits["train"] = _take(splits["train"], train_idx)
    for i, split_name in enumerate(s for s in splits if s != "train"):
        idx = _subsample(splits[split_name].labels, max_eval_samples, seed, i + 1, spec.is_regression)
        splits[split_name] = _take(splits[split_name], idx)

    datasets_ = {name: _to_dataset(raw, spec, tokenizer, max_length, padding) for name, raw in splits.items()}
    extra = {name: datasets_[name] for name in spec.extra_validation_splits if name in datasets_}
    return TaskData(
        spec=spec,
        train=datasets_["train"],
        validation=datasets_[spec.validation_split],
        extra_validation=extra,
        source=source,
        tokenizer=tokenizer,
        label_names=label_names,
    )


def _resolve_spec(task: str | TaskSpec) -> TaskSpec:
    if isinstance(task, TaskSpec):
        return task
    if not isinstance(task, str):
        raise TypeError(f"task must be a task name or a TaskSpec, got {type(task).__name__}")
    if task in GLUE_TASKS:
        return GLUE_TASKS[task]
    if task in BUILTIN_TASKS:
        return BUILTIN_TASKS[task]
    known = ", ".join([*GLUE_TASKS, *BUILTIN_TASKS])
    raise ValueError(f"unknown task {task!r}; known tasks: {known} (or pass a TaskSpec for your own files)")


# --------------------------------------------------------------------------------------------------------------
# Labels and columns


def _parse_labels(values: Sequence[Any], spec: TaskSpec, origin: str) -> np.ndarray:
    """Labels as int64 class ids in [0, num_labels) or float32 scores; a clear error listing bad rows."""
    names = {n.lower(): i for i, n in enumerate(spec.label_names or ())}
    parsed: list[float] = []
    bad: list[tuple[int, Any]] = []
    for row, value in enumerate(values):
        number: float | None = None
        if isinstance(value, (bool, np.bool_)):
            number = None
        elif isinstance(value, (int, float, np.integer, np.floating)):
            number = float(value)
        elif isinstance(value, str) and value.strip():
            text = value.strip()
            if not spec.is_regression and text.lower() in names:
                number = float(names[text.lower()])
            else:
                try:
                    number = float(text)
                except ValueError:
                    number = None
        if number is None or not math.isfinite(number):
            bad.append((row, value))
            parsed.append(0.0)
        elif not spec.is_regression and (number != int(number) or not 0 <= number < spec.num_labels):
            bad.append((row, value))
            parsed.append(0.0)
        else:
            parsed.append(number)
    if bad:
        examples = ", ".join(f"data row {r + 1}: {v!r}" for r, v in bad[:5])
        if spec.is_regression:
            allowed = "finite numbers"
        else:
            allowed = f"integers in [0, {spec.num_labels})"
            if spec.label_names:
                allowed += f" or the names {', '.join(spec.label_names)}"
        raise ValueError(
            f"{len(bad)} label(s) in {origin} for task {spec.name!r} are invalid; labels must be {allowed} "
            f"(column {spec.label_column!r}); first: {examples}"
        )
    if spec.is_regression:
        return np.asarray(parsed, dtype=np.float32)
    return np.asarray(parsed, dtype=np.int64)


def _make_split(spec: TaskSpec, columns: Mapping[str, Sequence[Any]], origin: str) -> _RawSplit:
    """Check the needed columns exist (naming the ones found) and pull texts and labels out."""
    found = list(columns)
    if not found:  # an empty file has no header row, so no columns: say so rather than list none
        raise ValueError(f"{origin} is empty (no header row, no examples)")
    for role, col in [*(("text", c) for c in spec.text_columns), ("label", spec.label_column)]:
        if col not in columns:
            raise ValueError(
                f"{origin} has no {role} column {col!r} for task {spec.name!r}; columns found: {found}"
            )
    texts = [["" if t is None else str(t) for t in columns[c]] for c in spec.text_columns]
    labels = _parse_labels(columns[spec.label_column], spec, origin)
    if labels.shape[0] == 0:
        raise ValueError(f"{origin} holds no examples")
    return _RawSplit(texts=texts, labels=labels, origin=origin)


# --------------------------------------------------------------------------------------------------------------
# Local files


def _read_table(path: Path, spec: TaskSpec) -> dict[str, list[Any]]:
    """Read a csv / tsv / jsonl / json file into {column: values}, with GLUE's original names mapped."""
    suffix = path.suffix.lower()
    if suffix not in FILE_EXTENSIONS:
        raise ValueError(f"{path}: unsupported file type {suffix!r}; use one of {', '.join(FILE_EXTENSIONS)}")
    rows: list[dict[str, Any]]
    if suffix in (".csv", ".tsv"):
        with path.open(newline="", encoding="utf-8") as f:
            if suffix == ".tsv":
                # GLUE's tsv files are unquoted and contain stray quote characters.
                reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
            else:
                reader = csv.reader(f)
            table = list(reader)
        if not table:
            raise ValueError(f"{path} is empty")
        header = table[0]
        layout = _HEADERLESS_LAYOUTS.get(spec.name)
        if layout and len(header) == len(layout) and not set(spec.text_columns) & set(header):
            header, body = list(layout), table
        else:
            body = table[1:]
        body = [r for r in body if r]  # blank lines
        uneven = [i + 1 for i, r in enumerate(body) if len(r) != len(header)]
        if uneven:
            raise ValueError(
                f"{path}: data rows {uneven[:5]} have a different number of fields than the header "
                f"({len(header)}: {header})"
            )
        rows = [dict(zip(header, r)) for r in body]
        columns = {h: [row.get(h) for row in rows] for h in header}
    else:
        text = path.read_text(encoding="utf-8")
        stripped = text.lstrip()
        if suffix == ".json" and stripped.startswith("["):
            rows = json.loads(stripped)
        else:
            rows = []
            for line_no, line in enumerate(text.splitlines(), start=1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}, line {line_no}: not a JSON object ({e.msg})") from None
        if not all(isinstance(r, dict) for r in rows):
            raise ValueError(f"{path}: every record must be a JSON object")
        header = list(dict.fromkeys(k for r in rows for k in r))
        columns = {h: [r.get(h) for r in rows] for h in header}
    for original, hub_name in _GLUE_FILE_ALIASES.get(spec.name, {}).items():
        if hub_name not in columns and original in columns:
            columns[hub_name] = columns[original]
    return columns


def _find_file(directory: Path, split: str) -> Path | None:
    """``<split>.<ext>`` or, for validation splits, GLUE's ``dev...`` name; an error if several match."""
    stems = [split]
    if split.startswith("validation"):
        stems.append("dev" + split[len("validation"):])
    matches = [directory / f"{stem}{ext}" for stem in stems for ext in FILE_EXTENSIONS]
    matches = [m for m in matches if m.is_file()]
    if len(matches) > 1:
        raise ValueError(f"several files for split {split!r} in {directory}: {[m.name for m in matches]}; keep one")
    return matches[0] if matches else None


def _load_files(spec: TaskSpec, data_dir, train_file, validation_file) -> dict[str, _RawSplit]:
    paths: dict[str, Path | None] = {"train": None, spec.validation_split: None}
    paths.update({s: None for s in spec.extra_validation_splits})
    if data_dir is not None:
        directory = Path(data_dir)
        if not directory.is_dir():
            raise FileNotFoundError(f"data_dir {str(directory)!r} does not exist or is not a directory")
        for split in paths:
            paths[split] = _find_file(directory, split)
    if train_file is not None:
        paths["train"] = Path(train_file)
    if validation_file is not None:
        paths[spec.validation_split] = Path(validation_file)
    for split, role in (("train", "train_file"), (spec.validation_split, "validation_file")):
        path = paths[split]
        if path is None:
            looked = f"{split}.* or dev.*" if split != "train" else "train.*"
            where = f" in {str(data_dir)!r} (looked for {looked}, * = tsv, csv, jsonl, json)" if data_dir else ""
            raise FileNotFoundError(f"no {split} file for task {spec.name!r}{where}; give {role}=...")
        if not path.is_file():
            raise FileNotFoundError(f"{role}: {str(path)!r} does not exist")
    splits: dict[str, _RawSplit] = {}
    for split, path in paths.items():
        if path is not None:
            splits[split] = _make_split(spec, _read_table(path, spec), str(path))
    return splits


# --------------------------------------------------------------------------------------------------------------
# GLUE from the hub


def _load_glue_hub(spec: TaskSpec) -> dict[str, _RawSplit]:
    import datasets

    try:
        raw = datasets.load_dataset(GLUE_DATASET, spec.name)
    except OSError as e:  # ConnectionError, missing cache in offline mode
        raise ConnectionError(
            f"cannot load GLUE task {spec.name!r} from the Hugging Face hub ({GLUE_DATASET}): {e}. "
            "Without network access, point data_dir at a directory with train and validation (or dev) files "
            f"in csv / tsv / jsonl (columns {', '.join(spec.text_columns)}, label), or use a built-in "
            f"offline task: {', '.join(BUILTIN_TASKS)}. Set HF_HUB_OFFLINE=1 to use the local datasets cache "
            "and fail fast."
        ) from e
    splits = {}
    for split in ("train", spec.validation_split, *spec.extra_validation_splits):
        ds = raw[split]
        columns = {c: ds[c] for c in ds.column_names if c in (*spec.text_columns, spec.label_column)}
        columns.update({c: [] for c in ds.column_names if c not in columns})  # names only, for messages
        splits[split] = _make_split(spec, columns, f"{GLUE_DATASET}/{spec.name} split {split!r}")
    return splits


# --------------------------------------------------------------------------------------------------------------
# Built-in offline tasks


def _sha1(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()


def _builtin_split(
    ids: Sequence[str], texts: Sequence[str], labels: Sequence[int], fraction: float
) -> tuple[list[int], list[int]]:
    """Deterministic stratified split; identical texts stay on one side. Returns (train, validation) indices."""
    groups: dict[str, list[int]] = {}
    for i, text in enumerate(texts):
        groups.setdefault(text, []).append(i)
    labels_arr = np.asarray(labels)
    target = {int(c): round(fraction * int(n)) for c, n in zip(*np.unique(labels_arr, return_counts=True))}
    taken = {c: 0 for c in target}
    validation: list[int] = []
    for text in sorted(groups, key=_sha1):
        members = groups[text]
        # A group is stratified under its most common label (the smallest on a tie).
        label = int(np.bincount(labels_arr[members]).argmax())
        if taken[label] < target[label]:
            taken[label] += len(members)
            validation.extend(members)
    in_validation = set(validation)
    train = [i for i in range(len(texts)) if i not in in_validation]
    order = lambda idx: sorted(idx, key=lambda i: _sha1(ids[i]))  # noqa: E731 - interleave the classes
    return order(train), order(validation)


def _load_builtin(spec: TaskSpec) -> tuple[dict[str, _RawSplit], tuple[str, ...] | None]:
    if spec.name == "bbc":
        ids, texts, labels = corpora.bbc_by_topic()
        label_names = spec.label_names
        origin = f"{corpora.BBC} BBC News"
        train_idx, val_idx = _builtin_split(ids, texts, labels, VALIDATION_FRACTION)
    else:
        ids, texts, testament, book, book_names = corpora.kjv_passages()
        labels = testament if spec.name == "kjv-testament" else book
        label_names = spec.label_names if spec.name == "kjv-testament" else book_names
        origin = corpora.KJV
        # Both KJV tasks hold out the same passages: the split is stratified by book (so also by testament).
        train_idx, val_idx = _builtin_split(ids, texts, book, VALIDATION_FRACTION)
    labels_arr = np.asarray(labels, dtype=np.int64)

    def split(idx: list[int], name: str) -> _RawSplit:
        return _RawSplit(texts=[[texts[i] for i in idx]], labels=labels_arr[idx], origin=f"{origin} ({name})")

    return {"train": split(train_idx, "train"), spec.validation_split: split(val_idx, "validation")}, label_names


# --------------------------------------------------------------------------------------------------------------
# Subsampling and tokenization


def _subsample(labels: np.ndarray, n: int | None, seed: int, stream: int, regression: bool) -> np.ndarray:
    """Indices (ascending) of at most n examples; class shares kept by largest-remainder rounding."""
    total = labels.shape[0]
    if n is None or n >= total:
        return np.arange(total)
    rng = np.random.default_rng([seed, stream])
    if regression:
        return np.sort(rng.choice(total, size=n, replace=False))
    classes, counts = np.unique(labels, return_counts=True)
    quota = counts * (n / total)
    take = np.floor(quota).astype(np.int64)
    # Hand the remaining slots to the largest fractional parts (stable: lower class ids first on ties).
    for c in np.argsort(-(quota - take), kind="stable")[: n - int(take.sum())]:
        take[c] += 1
    chosen = [rng.choice(np.flatnonzero(labels == c), size=k, replace=False) for c, k in zip(classes, take) if k]
    return np.sort(np.concatenate(chosen))


def _take(raw: _RawSplit, idx: np.ndarray) -> _RawSplit:
    if idx.shape[0] == raw.labels.shape[0]:
        return raw
    return _RawSplit(texts=[[col[i] for i in idx] for col in raw.texts], labels=raw.labels[idx], origin=raw.origin)


def _to_dataset(raw: _RawSplit, spec: TaskSpec, tokenizer: Any, max_length: int, padding: bool) -> Any:
    import datasets

    if tokenizer is None:
        columns: dict[str, Any] = dict(zip(spec.text_columns, raw.texts))
        features = {c: datasets.Value("string") for c in columns}
    else:
        columns = dict(
            tokenizer(
                *raw.texts,
                truncation=True,
                max_length=max_length,
                padding="max_length" if padding else False,
            )
        )
        features = {c: datasets.List(datasets.Value("int32")) for c in columns}
    columns["labels"] = raw.labels.tolist()
    # float32 targets: a regression head's MSE loss fails on float64 labels against float32 logits.
    features["labels"] = datasets.Value("float32" if spec.is_regression else "int64")
    return datasets.Dataset.from_dict(columns, features=datasets.Features(features))
