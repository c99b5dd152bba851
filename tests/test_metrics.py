"""Metrics against hand-computed values; scipy / scikit-learn serve as an oracle when installed."""

import doctest
import math

import numpy as np
import pytest

from slimopt.finetune import metrics
from slimopt.finetune.metrics import (
    GLUE_METRICS,
    accuracy,
    compute_metrics,
    f1,
    macro_f1,
    matthews,
    pearson,
    spearman,
    trainer_metrics,
)

# A small binary case worked by hand:
#   labels      1 1 1 0 0 0 0 1
#   predictions 1 0 1 0 1 0 0 1
#   TP = 3, FN = 1, FP = 1, TN = 3
P = [1, 0, 1, 0, 1, 0, 0, 1]
Y = [1, 1, 1, 0, 0, 0, 0, 1]


def test_accuracy_by_hand():
    assert accuracy(P, Y) == 6 / 8


def test_binary_f1_by_hand():
    # 2 TP / (2 TP + FP + FN) = 6 / 8
    assert f1(P, Y) == pytest.approx(6 / 8)
    # the other class as positive: TP = 3 (true zeros predicted zero), FP = 1, FN = 1
    assert f1(P, Y, positive=0) == pytest.approx(6 / 8)
    # no positive anywhere: 0, not a division by zero
    assert f1([0, 0], [0, 0]) == 0.0


def test_matthews_by_hand():
    # (TP TN - FP FN) / sqrt((TP+FP)(TP+FN)(TN+FP)(TN+FN)) = (9 - 1) / sqrt(4 * 4 * 4 * 4) = 0.5
    assert matthews(P, Y) == pytest.approx(0.5)
    assert matthews(Y, Y) == pytest.approx(1.0)
    assert matthews([1 - y for y in Y], Y) == pytest.approx(-1.0)
    assert matthews([1] * 8, Y) == 0.0  # constant predictions: defined as 0


def test_matthews_multiclass_by_hand():
    # confusion (rows true, columns predicted) [[2, 1, 0], [0, 2, 0], [1, 0, 1]]: c = 5, s = 7,
    # t = (3, 2, 2), p = (3, 3, 1): (5*7 - (9 + 6 + 2)) / sqrt((49 - 19)(49 - 17)) = 18 / sqrt(960)
    y = [0, 0, 0, 1, 1, 2, 2]
    p = [0, 0, 1, 1, 1, 0, 2]
    assert matthews(p, y) == pytest.approx(18 / math.sqrt(960))


def test_macro_f1_by_hand():
    y = [0, 0, 0, 1, 1, 2, 2]
    p = [0, 0, 1, 1, 1, 0, 2]
    # class 0: TP 2, FP 1, FN 1 -> 4/6; class 1: TP 2, FP 1, FN 0 -> 4/5; class 2: TP 1, FP 0, FN 1 -> 2/3
    assert macro_f1(p, y) == pytest.approx((4 / 6 + 4 / 5 + 2 / 3) / 3)


def test_pearson_by_hand():
    x = [1.0, 2.0, 3.0, 4.0]
    assert pearson(x, [2.0, 4.0, 6.0, 8.0]) == pytest.approx(1.0)
    assert pearson(x, [8.0, 6.0, 4.0, 2.0]) == pytest.approx(-1.0)
    # deviations (-1.5, -.5, .5, 1.5) and (-1, 1, -1, 1): sum of products 2, norms sqrt(5) and 2
    assert pearson(x, [1.0, 3.0, 1.0, 3.0]) == pytest.approx(2 / (math.sqrt(5) * 2))
    assert math.isnan(pearson(x, [1.0, 1.0, 1.0, 1.0]))


def test_spearman_averages_ties():
    # ranks of (10, 20, 20, 30) are (1, 2.5, 2.5, 4); of (1, 3, 2, 4) are (1, 3, 2, 4)
    # deviations (-1.5, 0, 0, 1.5) and (-1.5, .5, -.5, 1.5): products 4.5, norms sqrt(4.5) and sqrt(5)
    assert spearman([10, 20, 20, 30], [1, 3, 2, 4]) == pytest.approx(4.5 / math.sqrt(4.5 * 5))
    # monotone but not linear: Spearman 1, Pearson below 1
    assert spearman([1, 2, 3, 4], [1, 4, 9, 100]) == pytest.approx(1.0)
    assert pearson([1, 2, 3, 4], [1, 4, 9, 100]) < 0.9


def test_compute_metrics_per_glue_task():
    logits = np.array([[2.0, -1.0], [0.1, 0.3], [1.0, 0.0], [-1.0, 1.0]])  # argmax 0, 1, 0, 1
    labels = np.array([0, 1, 1, 1])
    # argmax (0, 1, 0, 1) vs (0, 1, 1, 1): TP 2, FP 0, FN 1, TN 1
    assert compute_metrics("mrpc", logits, labels) == pytest.approx({"f1": 0.8, "accuracy": 0.75})
    assert list(compute_metrics("qqp", logits, labels)) == ["f1", "accuracy"]
    assert compute_metrics("cola", logits, labels) == pytest.approx({"matthews": (2 - 0) / math.sqrt(2 * 3 * 1 * 2)})
    for task in ("sst2", "qnli", "rte", "wnli", "mnli"):
        assert compute_metrics(task, logits, labels) == {"accuracy": 0.75}
    scores = np.array([[0.5], [1.5], [1.0], [4.0]])  # (n, 1) as a regression head returns
    out = compute_metrics("stsb", scores, np.array([0.0, 2.0, 1.0, 5.0]))
    assert set(out) == {"pearson", "spearman"} and out["spearman"] == pytest.approx(1.0)
    assert all(isinstance(v, float) for v in out.values())
    assert set(GLUE_METRICS) == {"cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "wnli"}


def test_compute_metrics_accepts_class_ids_and_metric_lists():
    assert compute_metrics(["accuracy", "matthews"], P, Y) == pytest.approx({"accuracy": 0.75, "matthews": 0.5})
    assert compute_metrics("bbc", [0, 1, 2, 3, 4], [0, 1, 2, 3, 3])["accuracy"] == pytest.approx(0.8)


def test_trainer_adaptor():
    from transformers import EvalPrediction

    fn = trainer_metrics("mrpc")
    logits = np.array([[2.0, -1.0], [0.1, 0.3], [1.0, 0.0], [-1.0, 1.0]])
    labels = np.array([0, 1, 1, 1])
    expected = {"f1": 0.8, "accuracy": 0.75}
    assert fn(EvalPrediction(predictions=logits, label_ids=labels)) == pytest.approx(expected)
    assert fn((logits, labels)) == pytest.approx(expected)
    # a model returning (logits, hidden_states): the first element is scored
    assert fn(EvalPrediction(predictions=(logits, np.zeros((4, 3))), label_ids=labels)) == pytest.approx(expected)


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown task 'sst-2'"):
        compute_metrics("sst-2", P, Y)
    with pytest.raises(ValueError, match="unknown task"):
        trainer_metrics("nope")
    with pytest.raises(ValueError, match="unknown metric"):
        compute_metrics(["acc"], P, Y)
    with pytest.raises(ValueError, match="differ in length"):
        accuracy([1, 0], [1])
    with pytest.raises(ValueError, match="empty"):
        accuracy([], [])
    with pytest.raises(ValueError, match="integer class ids"):
        compute_metrics("sst2", [0.2, 0.7], [0, 1])
    with pytest.raises(ValueError, match="regression metric"):
        compute_metrics("stsb", np.zeros((2, 3)), [0.0, 1.0])


def test_module_docstring_example_runs():
    failures, _ = doctest.testmod(metrics, verbose=False)
    assert failures == 0


def test_against_scipy_and_sklearn_oracles():
    sklearn_metrics = pytest.importorskip("sklearn.metrics")
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(0)
    for _ in range(5):
        y = rng.integers(0, 2, size=200)
        p = np.where(rng.random(200) < 0.7, y, 1 - y)
        assert f1(p, y) == pytest.approx(sklearn_metrics.f1_score(y, p))
        assert matthews(p, y) == pytest.approx(sklearn_metrics.matthews_corrcoef(y, p))
        y3 = rng.integers(0, 4, size=200)
        p3 = np.where(rng.random(200) < 0.5, y3, rng.integers(0, 4, size=200))
        assert matthews(p3, y3) == pytest.approx(sklearn_metrics.matthews_corrcoef(y3, p3))
        assert macro_f1(p3, y3) == pytest.approx(sklearn_metrics.f1_score(y3, p3, average="macro"))
        # scores rounded to create many ties
        a = np.round(rng.normal(size=300), 1)
        b = np.round(a + rng.normal(size=300), 1)
        assert pearson(a, b) == pytest.approx(stats.pearsonr(a, b)[0])
        assert spearman(a, b) == pytest.approx(stats.spearmanr(a, b)[0])
