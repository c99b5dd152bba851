"""Fine-tuning data: built-in offline tasks, local GLUE-layout files, clear errors, the offline encoder."""

import json
import re

import numpy as np
import pytest
import torch

from slimopt.finetune.data import BUILTIN_TASKS, GLUE_TASKS, TaskSpec, load_task
from slimopt.models.minilm import load_offline_classifier, offline_model_path

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def classifier():
    return load_offline_classifier(num_labels=5)


@pytest.fixture(scope="module")
def tokenizer(classifier):
    return classifier[1]


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------- task specs


def test_glue_task_table():
    assert set(GLUE_TASKS) == {"cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "wnli"}
    assert GLUE_TASKS["cola"].text_columns == ("sentence",)
    assert GLUE_TASKS["qqp"].text_columns == ("question1", "question2")
    assert GLUE_TASKS["mnli"].num_labels == 3
    assert GLUE_TASKS["mnli"].validation_split == "validation_matched"
    assert GLUE_TASKS["mnli"].extra_validation_splits == ("validation_mismatched",)
    assert GLUE_TASKS["stsb"].is_regression and GLUE_TASKS["stsb"].num_labels == 1
    assert GLUE_TASKS["cola"].metrics == ("matthews",)
    assert GLUE_TASKS["mrpc"].metrics == ("f1", "accuracy")
    assert GLUE_TASKS["stsb"].metrics == ("pearson", "spearman")


def test_bad_task_spec():
    with pytest.raises(ValueError, match="one or two columns"):
        TaskSpec("x", ("a", "b", "c"), 2)
    with pytest.raises(ValueError, match="num_labels=1"):
        TaskSpec("x", ("a",), 3, is_regression=True)
    with pytest.raises(ValueError, match="unknown metric"):
        TaskSpec("x", ("a",), 2, metrics=("auc",))
    with pytest.raises(ValueError, match="label_names has 3 names"):
        TaskSpec("x", ("a",), 2, label_names=("p", "q", "r"))


def test_unknown_task_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown task 'sst-2'; known tasks: cola, sst2.*bbc, kjv-testament"):
        load_task("sst-2")


# ---------------------------------------------------------------------------------------------- built-in tasks


def test_bbc_split_is_deterministic_stratified_and_leak_free():
    data = load_task("bbc")  # no tokenizer: raw text, fast
    assert data.source == "builtin" and data.num_labels == 5
    assert (len(data.train), len(data.validation)) == (1781, 444)
    summary = data.summary()["splits"]
    assert summary["validation"]["label_counts"] == {
        "business": 102, "entertainment": 77, "politics": 83, "sports": 102, "tech": 80
    }
    total = {k: summary["train"]["label_counts"][k] + v for k, v in summary["validation"]["label_counts"].items()}
    assert total == {"business": 510, "entertainment": 386, "politics": 417, "sports": 511, "tech": 401}
    # 98 articles appear twice in the corpus: no text is on both sides of the split
    assert not set(data.train["text"]) & set(data.validation["text"])
    # classes are interleaved, not in blocks
    assert len(set(data.train["labels"][:50])) == 5
    again = load_task("bbc")
    assert again.validation["text"] == data.validation["text"]
    assert data.label_names == ("business", "entertainment", "politics", "sports", "tech")
    # the one Windows-1252 article decodes its pound sign
    assert any("£15.8m" in t for t in list(data.train["text"]) + list(data.validation["text"]))


def test_kjv_tasks_share_one_split():
    testament = load_task("kjv-testament")
    book = load_task("kjv-book")
    assert len(testament.train) + len(testament.validation) == 24408
    assert testament.validation["text"] == book.validation["text"]
    assert book.num_labels == 66 and book.label_names[0] == "Genesis" and book.label_names[-1] == "Revelation"
    counts = book.summary()["splits"]
    # every book is on both sides, even the 11-passage ones (2 John, 3 John)
    assert min(counts["validation"]["label_counts"].values()) >= 2
    assert min(counts["train"]["label_counts"].values()) >= 9
    t = testament.summary()["splits"]
    assert t["train"]["label_counts"]["old_testament"] + t["validation"]["label_counts"]["old_testament"] == 18583
    # chapter:verse marks are gone (they would give the book away)
    assert not any(re.search(r"\d+:\d+", s) for s in book.train["text"][:2000])


def test_subsampling_keeps_class_shares_and_follows_the_seed(tokenizer):
    full = load_task("kjv-book")
    full_counts = np.bincount(full.train["labels"], minlength=66)
    data = load_task("kjv-book", tokenizer, max_length=32, max_train_samples=1000, max_eval_samples=300, seed=3)
    assert (len(data.train), len(data.validation)) == (1000, 300)
    counts = np.bincount(data.train["labels"], minlength=66)
    quota = full_counts * 1000 / full_counts.sum()
    assert np.all(np.abs(counts - quota) < 1.0)  # largest-remainder rounding
    assert max(len(ids) for ids in data.train["input_ids"]) <= 32
    same = load_task("kjv-book", tokenizer, max_length=32, max_train_samples=1000, max_eval_samples=300, seed=3)
    other = load_task("kjv-book", tokenizer, max_length=32, max_train_samples=1000, max_eval_samples=300, seed=4)
    assert same.train["input_ids"] == data.train["input_ids"]
    assert other.train["input_ids"] != data.train["input_ids"]


def test_builtin_task_rejects_files(tmp_path):
    with pytest.raises(ValueError, match="built in and reads no files"):
        load_task("bbc", data_dir=tmp_path)


# ---------------------------------------------------------------------------------------------- local files


def test_csv_directory_in_hub_layout(tmp_path, tokenizer):
    _write(tmp_path / "train.csv", 'sentence,label\n"a fine, warm film",1\nawful,0\nsplendid,1\n')
    _write(tmp_path / "validation.csv", "sentence,label\ndull,0\n")
    data = load_task("sst2", tokenizer, data_dir=tmp_path)
    assert data.source == "files"
    assert data.train["labels"] == [1, 0, 1]
    assert set(data.train.column_names) == {"input_ids", "token_type_ids", "attention_mask", "labels"}
    assert tokenizer.decode(data.train[0]["input_ids"], skip_special_tokens=True) == "a fine, warm film"
    padded = load_task("sst2", tokenizer, max_length=16, data_dir=tmp_path, padding=True)
    assert {len(x) for x in padded.train["input_ids"]} == {16}


def test_original_glue_tsv_layouts(tmp_path, tokenizer):
    # MRPC as distributed by GLUE: its own column names, unquoted text with stray quotes
    mrpc = tmp_path / "mrpc"
    mrpc.mkdir()
    header = "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
    _write(mrpc / "train.tsv", header + '1\t1\t2\tHe said "yes".\tHe agreed.\n0\t3\t4\tRain.\tSun.\n')
    _write(mrpc / "dev.tsv", header + "1\t5\t6\tA cat.\tA feline.\n")
    data = load_task("mrpc", tokenizer, data_dir=mrpc)
    assert data.train["labels"] == [1, 0] and len(data.validation) == 1
    assert data.train[0]["token_type_ids"][-1] == 1  # a sentence pair
    # CoLA's header-less tsv
    cola = tmp_path / "cola"
    cola.mkdir()
    _write(cola / "train.tsv", "gj04\t1\t\tThe cat sat.\ngj04\t0\t*\tCat the sat.\n")
    _write(cola / "dev.tsv", "gj04\t1\t\tShe left.\n")
    data = load_task("cola", data_dir=cola)
    assert data.train["sentence"] == ["The cat sat.", "Cat the sat."] and data.train["labels"] == [1, 0]


def test_mnli_jsonl_with_string_labels_and_both_dev_sets(tmp_path):
    rows = [
        {"premise": "A man sleeps.", "hypothesis": "A man rests.", "label": "entailment"},
        {"premise": "A man sleeps.", "hypothesis": "A man runs.", "label": "contradiction"},
        {"premise": "A man sleeps.", "hypothesis": "A man dreams.", "label": "neutral"},
    ]
    for name in ("train", "validation_matched", "validation_mismatched"):
        _write(tmp_path / f"{name}.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n")
    data = load_task("mnli", data_dir=tmp_path)
    assert data.train["labels"] == [0, 2, 1]
    assert set(data.eval_datasets()) == {"validation_matched", "validation_mismatched"}


def test_stsb_regression_labels_are_float32(tmp_path, tokenizer):
    _write(tmp_path / "train.tsv", "sentence1\tsentence2\tlabel\na\tb\t3.8\nc\td\t0.25\n")
    _write(tmp_path / "dev.tsv", "sentence1\tsentence2\tlabel\ne\tf\t5.0\n")
    data = load_task("stsb", tokenizer, data_dir=tmp_path)
    assert data.train.features["labels"].dtype == "float32"
    assert data.train["labels"] == pytest.approx([3.8, 0.25])


def test_own_task_spec_with_explicit_files(tmp_path):
    spec = TaskSpec("reviews", ("review",), 3, label_names=("bad", "ok", "good"))
    train = _write(tmp_path / "tr.jsonl", '{"review": "great", "label": "good"}\n{"review": "meh", "label": 1}\n')
    val = _write(tmp_path / "va.json", json.dumps([{"review": "poor", "label": 0}]))
    data = load_task(spec, train_file=train, validation_file=val)
    assert data.train["labels"] == [2, 1] and data.metric_names == ("accuracy",)
    assert data.id2label == {0: "bad", 1: "ok", 2: "good"}
    with pytest.raises(ValueError, match="TaskSpec of your own: give data_dir"):
        load_task(spec)


def test_missing_columns_are_named_with_the_columns_found(tmp_path):
    _write(tmp_path / "train.csv", "text,label\nhello,1\n")
    _write(tmp_path / "dev.csv", "sentence,label\nhi,0\n")
    with pytest.raises(ValueError, match=r"no text column 'sentence' for task 'sst2'; columns found: \['text', 'label'\]"):
        load_task("sst2", data_dir=tmp_path)
    _write(tmp_path / "train.csv", "sentence,target\nhello,1\n")
    with pytest.raises(ValueError, match=r"no label column 'label'.*columns found: \['sentence', 'target'\]"):
        load_task("sst2", data_dir=tmp_path)


def test_labels_outside_the_range_are_rejected(tmp_path):
    _write(tmp_path / "train.csv", "sentence,label\na,0\nb,2\nc,1\nd,-1\n")
    _write(tmp_path / "dev.csv", "sentence,label\nhi,0\n")
    with pytest.raises(ValueError, match=r"2 label\(s\) in .*train.csv for task 'sst2' are invalid; labels must be "
                                         r"integers in \[0, 2\).*data row 2: '2', data row 4: '-1'"):
        load_task("sst2", data_dir=tmp_path)
    _write(tmp_path / "train.csv", "sentence,label\na,0.5\n")
    with pytest.raises(ValueError, match="data row 1: '0.5'"):
        load_task("sst2", data_dir=tmp_path)
    _write(tmp_path / "train.csv", "sentence,label\na,maybe\n")
    with pytest.raises(ValueError, match="or the names negative, positive"):
        load_task("sst2", data_dir=tmp_path)


def test_missing_files_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="data_dir .* does not exist"):
        load_task("sst2", data_dir=tmp_path / "nope")
    _write(tmp_path / "train.csv", "sentence,label\na,0\n")
    with pytest.raises(FileNotFoundError, match=r"no validation file .*looked for validation\.\* or dev\.\*"):
        load_task("sst2", data_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match=r"validation_file: .*missing.csv' does not exist"):
        load_task("sst2", data_dir=tmp_path, validation_file=tmp_path / "missing.csv")
    _write(tmp_path / "dev.csv", "sentence,label\nb,1\n")
    _write(tmp_path / "dev.tsv", "sentence\tlabel\nb\t1\n")
    with pytest.raises(ValueError, match="several files for split 'validation'"):
        load_task("sst2", data_dir=tmp_path)


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_length must be a positive int"):
        load_task("bbc", max_length=0)
    with pytest.raises(ValueError, match="max_train_samples must be a positive int"):
        load_task("bbc", max_train_samples=0)
    with pytest.raises(ValueError, match="num_labels must be a positive int"):
        load_offline_classifier(0)


def test_glue_from_the_hub_fails_clearly_offline(monkeypatch):
    import datasets
    import huggingface_hub.constants

    # offline mode makes the hub call fail at once instead of retrying for ~25 s
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    try:
        data = load_task("rte")
    except ConnectionError as e:
        message = str(e)
        assert "cannot load GLUE task 'rte'" in message and "data_dir" in message and "bbc" in message
    else:  # GLUE sits in this machine's datasets cache: the real path worked
        assert len(data.train) == 2490


# ---------------------------------------------------------------------------------------------- offline encoder


def test_offline_classifier_loads_the_pretrained_encoder(classifier):
    from safetensors import safe_open

    model, _ = classifier
    with safe_open(str(offline_model_path() / "model.safetensors"), "pt") as f:
        expected = f.get_tensor("encoder.layer.0.attention.self.query.weight")
    assert torch.equal(model.bert.encoder.layer[0].attention.self.query.weight, expected)
    assert model.config.num_labels == 5 and model.classifier.out_features == 5
    assert sum(p.numel() for p in model.bert.parameters()) == 22_713_216


def test_a_batch_flows_through_model_and_metrics(classifier):
    model, tokenizer = classifier
    data = load_task("bbc", tokenizer, max_length=64, max_train_samples=20, max_eval_samples=10)
    assert data.summary()["splits"]["train"]["label_counts"] == {
        "business": 4, "entertainment": 3, "politics": 4, "sports": 5, "tech": 4
    }  # quotas 4.58, 3.47, 3.75, 4.59, 3.61: floors sum to 17, the 3 largest remainders get one more
    loader = torch.utils.data.DataLoader(data.validation, batch_size=10, collate_fn=data.data_collator)
    batch = next(iter(loader))
    assert batch["input_ids"].shape[0] == 10 and batch["input_ids"].shape[1] <= 64
    model.eval()
    with torch.no_grad():
        out = model(**batch)
    assert out.logits.shape == (10, 5) and torch.isfinite(out.loss)
    scores = data.compute_metrics((out.logits.numpy(), batch["labels"].numpy()))
    assert set(scores) == {"accuracy", "macro_f1"} and 0.0 <= scores["accuracy"] <= 1.0
    assert set(BUILTIN_TASKS) == {"bbc", "kjv-testament", "kjv-book"}


def test_glue_hub_path_on_a_local_dataset_dict(monkeypatch):
    """The network is the only part replaced: a DatasetDict shaped like nyu-mll/glue's mnli."""
    import datasets

    def split(n):
        return datasets.Dataset.from_dict(
            {"premise": ["p"] * n, "hypothesis": ["h"] * n, "label": [i % 3 for i in range(n)], "idx": list(range(n))}
        )

    fake = datasets.DatasetDict(
        train=split(9), validation_matched=split(4), validation_mismatched=split(5), test_matched=split(2)
    )
    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append(a) or fake)
    data = load_task("mnli", max_train_samples=6)
    assert calls == [("nyu-mll/glue", "mnli")] and data.source == "hub:nyu-mll/glue"
    assert (len(data.train), len(data.validation), len(data.extra_validation["validation_mismatched"])) == (6, 4, 5)
    assert sorted(data.train["labels"]) == [0, 0, 1, 1, 2, 2]  # stratified: two of each class
