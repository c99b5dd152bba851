"""Evaluation metrics for sequence-classification fine-tuning, in plain numpy.

The GLUE benchmark (Wang et al., arXiv 1804.07461) scores each task with its own metric: Matthews correlation
for CoLA, F1 and accuracy for MRPC and QQP, Pearson and Spearman correlation for STS-B, accuracy elsewhere
(MNLI on its matched and mismatched validation sets separately). GaLore (arXiv 2403.03507) and FRUGAL
(arXiv 2411.07837) report their RoBERTa fine-tuning results with exactly these metrics, so slimopt computes
them the same way, without scipy or scikit-learn:

    >>> compute_metrics("mrpc", predictions=[[0.1, 2.0], [1.5, -1.0], [0.0, 3.0]], labels=[1, 0, 0])
    {'f1': 0.6666666666666666, 'accuracy': 0.6666666666666666}

Details: docs/modules.md, ``slimopt.finetune.metrics``.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

__all__ = [
    "accuracy",
    "f1",
    "macro_f1",
    "matthews",
    "pearson",
    "spearman",
    "METRIC_FUNCTIONS",
    "REGRESSION_METRICS",
    "GLUE_METRICS",
    "TASK_METRICS",
    "compute_metrics",
    "trainer_metrics",
]


def _as_pair(predictions: Any, labels: Any) -> tuple[np.ndarray, np.ndarray]:
    """Check two 1-D arrays of equal, non-zero length."""
    p = np.asarray(predictions)
    y = np.asarray(labels)
    if p.ndim != 1 or y.ndim != 1:
        raise ValueError(
            f"predictions and labels must be 1-D here, got shapes {p.shape} and {y.shape}; "
            "use compute_metrics() to pass logits"
        )
    if p.shape[0] != y.shape[0]:
        raise ValueError(f"predictions ({p.shape[0]}) and labels ({y.shape[0]}) differ in length")
    if p.shape[0] == 0:
        raise ValueError("predictions and labels are empty: nothing to score")
    return p, y


def accuracy(predictions: Sequence[int], labels: Sequence[int]) -> float:
    """Fraction of predictions equal to the labels. predictions, labels: (n,) class ids."""
    p, y = _as_pair(predictions, labels)
    return float(np.mean(p == y))


def f1(predictions: Sequence[int], labels: Sequence[int], positive: int = 1) -> float:
    """Binary F1 of class ``positive`` (GLUE: the paraphrase / duplicate class, 1).

    F1 = 2 TP / (2 TP + FP + FN); 0.0 when there is neither a positive prediction nor a positive label
    (scikit-learn's zero_division=0 convention).
    """
    p, y = _as_pair(predictions, labels)
    tp = int(np.sum((p == positive) & (y == positive)))
    fp = int(np.sum((p == positive) & (y != positive)))
    fn = int(np.sum((p != positive) & (y == positive)))
    denominator = 2 * tp + fp + fn
    return 2.0 * tp / denominator if denominator else 0.0


def macro_f1(predictions: Sequence[int], labels: Sequence[int]) -> float:
    """Unweighted mean of the per-class F1 over every class seen in labels or predictions.

    Useful on unbalanced multi-class tasks (kjv-book), where accuracy hides the small classes.
    """
    p, y = _as_pair(predictions, labels)
    classes = np.union1d(np.unique(p), np.unique(y))
    return float(np.mean([f1(p, y, positive=c) for c in classes.tolist()]))


def matthews(predictions: Sequence[int], labels: Sequence[int]) -> float:
    """Matthews correlation coefficient (GLUE's CoLA metric), multi-class form (Gorodkin 2004).

    MCC = (c s - sum_k p_k t_k) / sqrt((s^2 - sum_k p_k^2)(s^2 - sum_k t_k^2)) with c correct predictions,
    s samples, p_k / t_k the predicted / true counts of class k. Equals the phi coefficient for two classes.
    0.0 when the denominator is zero (constant predictions or labels), as scikit-learn returns.
    """
    p, y = _as_pair(predictions, labels)
    classes, inverse = np.unique(np.concatenate([p, y]), return_inverse=True)
    n = p.shape[0]
    k = classes.shape[0]
    confusion = np.zeros((k, k), dtype=np.float64)  # rows: true class, columns: predicted class
    np.add.at(confusion, (inverse[n:], inverse[:n]), 1.0)
    t = confusion.sum(axis=1)
    q = confusion.sum(axis=0)
    c = np.trace(confusion)
    s = float(n)
    numerator = c * s - float(np.dot(q, t))
    denominator = np.sqrt((s * s - float(np.dot(q, q))) * (s * s - float(np.dot(t, t))))
    return float(numerator / denominator) if denominator > 0 else 0.0


def pearson(predictions: Sequence[float], labels: Sequence[float]) -> float:
    """Pearson correlation (STS-B). NaN when either side is constant, as scipy returns."""
    p, y = _as_pair(predictions, labels)
    p = p.astype(np.float64) - np.mean(p, dtype=np.float64)
    y = y.astype(np.float64) - np.mean(y, dtype=np.float64)
    denominator = np.sqrt(np.dot(p, p) * np.dot(y, y))
    return float(np.dot(p, y) / denominator) if denominator > 0 else float("nan")


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n with tied values sharing the mean of their ranks (scipy's rankdata 'average')."""
    order = np.argsort(x, kind="stable")
    sorted_x = x[order]
    # Start of each run of equal values; a run spanning positions [i, j) gets rank (i + 1 + j) / 2.
    starts = np.flatnonzero(np.concatenate([[True], sorted_x[1:] != sorted_x[:-1]]))
    ends = np.concatenate([starts[1:], [x.shape[0]]])
    run_rank = (starts + 1 + ends) / 2.0
    ranks = np.empty(x.shape[0], dtype=np.float64)
    ranks[order] = np.repeat(run_rank, ends - starts)
    return ranks


def spearman(predictions: Sequence[float], labels: Sequence[float]) -> float:
    """Spearman rank correlation (STS-B): Pearson correlation of the ranks, ties averaged."""
    p, y = _as_pair(predictions, labels)
    return pearson(_average_ranks(p), _average_ranks(y))


METRIC_FUNCTIONS: dict[str, Callable[[Any, Any], float]] = {
    "accuracy": accuracy,
    "f1": f1,
    "macro_f1": macro_f1,
    "matthews": matthews,
    "pearson": pearson,
    "spearman": spearman,
}
"""Every metric by name; the names are the keys of compute_metrics' result."""

REGRESSION_METRICS = frozenset({"pearson", "spearman"})
"""Metrics that score real-valued predictions; the others score class ids."""

GLUE_METRICS: dict[str, tuple[str, ...]] = {
    "cola": ("matthews",),
    "sst2": ("accuracy",),
    "mrpc": ("f1", "accuracy"),
    "qqp": ("f1", "accuracy"),
    "stsb": ("pearson", "spearman"),
    "mnli": ("accuracy",),  # scored on validation_matched and validation_mismatched separately
    "qnli": ("accuracy",),
    "rte": ("accuracy",),
    "wnli": ("accuracy",),
}
"""The GLUE metrics per task (Wang et al., arXiv 1804.07461)."""

TASK_METRICS: dict[str, tuple[str, ...]] = {
    **GLUE_METRICS,
    "bbc": ("accuracy", "macro_f1"),
    "kjv-testament": ("accuracy", "f1"),  # F1 of the smaller class, the New Testament (label 1)
    "kjv-book": ("accuracy", "macro_f1"),
}
"""Metrics of every named task slimopt knows: GLUE plus the offline tasks of slimopt.finetune.data."""


def _metric_names(task: str | Sequence[str]) -> tuple[str, ...]:
    if isinstance(task, str):
        if task not in TASK_METRICS:
            raise ValueError(
                f"unknown task {task!r} for compute_metrics; known tasks: {', '.join(TASK_METRICS)} "
                f"(or pass a list of metric names from {', '.join(METRIC_FUNCTIONS)})"
            )
        return TASK_METRICS[task]
    names = tuple(task)
    if not names:
        raise ValueError("task: the list of metric names is empty")
    unknown = [n for n in names if n not in METRIC_FUNCTIONS]
    if unknown:
        raise ValueError(f"unknown metric(s) {unknown}; allowed: {', '.join(METRIC_FUNCTIONS)}")
    return names


def _class_ids(predictions: np.ndarray) -> np.ndarray:
    """Logits (n, c) with c >= 2 -> argmax; (n,) integer-valued -> as they are."""
    if predictions.ndim == 2 and predictions.shape[1] >= 2:
        return predictions.argmax(axis=-1)
    if predictions.ndim == 1:
        if predictions.dtype.kind == "f" and not np.all(np.mod(predictions, 1) == 0):
            raise ValueError(
                "predictions for a classification metric must be logits of shape (n, num_labels) "
                "or integer class ids of shape (n,); got non-integer values of shape (n,)"
            )
        return predictions.astype(np.int64)
    raise ValueError(
        f"predictions of shape {predictions.shape} cannot be scored by a classification metric: "
        "expected logits (n, num_labels >= 2) or class ids (n,)"
    )


def _scores(predictions: np.ndarray) -> np.ndarray:
    """Regression outputs (n,) or (n, 1) -> (n,)."""
    if predictions.ndim == 2 and predictions.shape[1] == 1:
        return predictions[:, 0]
    if predictions.ndim == 1:
        return predictions
    raise ValueError(
        f"predictions of shape {predictions.shape} cannot be scored by a regression metric: expected (n,) or (n, 1)"
    )


def compute_metrics(task: str | Sequence[str], predictions: Any, labels: Any) -> dict[str, float]:
    """Score predictions with the metrics of ``task``.

    Args:
        task: a task name from ``TASK_METRICS`` (GLUE tasks, "bbc", "kjv-testament", "kjv-book") or a list of
            metric names from ``METRIC_FUNCTIONS``.
        predictions: logits (n, num_labels), class ids (n,), or regression scores (n,) / (n, 1).
            A tuple (as a model returning several outputs gives) is reduced to its first element.
        labels: (n,) class ids or regression targets.

    Returns:
        ``{metric name: value}`` in the task's order, Python floats.
    """
    names = _metric_names(task)
    if isinstance(predictions, tuple):
        predictions = predictions[0]
    p = np.asarray(predictions)
    y = np.asarray(labels)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    result: dict[str, float] = {}
    for name in names:
        if name in REGRESSION_METRICS:
            result[name] = METRIC_FUNCTIONS[name](_scores(p).astype(np.float64), y.astype(np.float64))
        else:
            result[name] = METRIC_FUNCTIONS[name](_class_ids(p), y)
    return result


def trainer_metrics(task: str | Sequence[str]) -> Callable[[Any], dict[str, float]]:
    """A ``compute_metrics`` callable for ``transformers.Trainer``.

    The returned function takes an ``EvalPrediction`` (``.predictions``, ``.label_ids``) or a plain
    ``(predictions, label_ids)`` pair. The task is checked now, not at the first evaluation.
    """
    _metric_names(task)

    def _compute(eval_prediction: Any) -> dict[str, float]:
        if hasattr(eval_prediction, "predictions") and hasattr(eval_prediction, "label_ids"):
            predictions, labels = eval_prediction.predictions, eval_prediction.label_ids
        elif isinstance(eval_prediction, (tuple, list)) and len(eval_prediction) == 2:
            predictions, labels = eval_prediction
        elif isinstance(eval_prediction, Mapping):
            predictions, labels = eval_prediction["predictions"], eval_prediction["label_ids"]
        else:
            raise TypeError(
                "expected an EvalPrediction or a (predictions, label_ids) pair, "
                f"got {type(eval_prediction).__name__}"
            )
        return compute_metrics(task, predictions, labels)

    return _compute
