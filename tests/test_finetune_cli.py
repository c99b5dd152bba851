"""`slimopt finetune`: the results table on a tiny budget, the offline MiniLM path, method settings, and bad input
that fails before any training."""

import csv
import json
import math

import pytest
from helpers import run_cli, save_tiny_bert, sentences

from slimopt.finetune.run import FINETUNE_DEFAULTS, FinetuneConfig, method_settings, parse_method, read_results

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A local model folder: a randomly initialised 2-layer BERT with the MiniLM tokenizer (any HF path works)."""
    path = tmp_path_factory.mktemp("tiny-bert")
    save_tiny_bert(path)
    return path


@pytest.fixture(scope="module")
def glue_dir(tmp_path_factory):
    """GLUE's folder layout: SST-2 as csv, MRPC as jsonl (a text pair), both with the hub's column names."""
    root = tmp_path_factory.mktemp("glue")
    (root / "SST-2").mkdir()
    for split, n, seed in (("train", 32, 1), ("dev", 16, 2)):
        with open(root / "SST-2" / f"{split}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["sentence", "label"])
            for s in sentences(n, seed):
                w.writerow([s, int(s.split()[0] in ("good", "great", "fine"))])
    (root / "mrpc").mkdir()
    for split, n, seed in (("train", 32, 3), ("validation", 16, 4)):
        a, b = sentences(n, seed), sentences(n, seed + 10)
        with open(root / "mrpc" / f"{split}.jsonl", "w") as f:
            for i, (x, y) in enumerate(zip(a, b)):
                f.write(json.dumps({"sentence1": x, "sentence2": y if i % 2 else x, "label": 1 - i % 2}) + "\n")
    return root


def _run(args, capsys):
    return run_cli(["finetune", "--threads", "1", *args], capsys)


def test_table_for_methods_by_tasks(tmp_path, tiny_model_dir, glue_dir, capsys):
    out = tmp_path / "out"
    rc, stdout, err = _run(["--model", str(tiny_model_dir), "--tasks", "sst2,mrpc", "--data-dir", str(glue_dir),
                            "--methods", "adamw,galore,lora", "--max-steps", "2", "--batch-size", "8",
                            "--max-length", "16", "--set", "galore.update_gap=1", "--no-control", "--out", str(out)],
                           capsys)
    assert rc == 0, err
    rows = read_results(out / "results.csv")
    assert [(r["task"], r["method"]) for r in rows] == [
        (t, m) for t in ("sst2", "mrpc") for m in ("adamw", "galore", "lora")]
    assert all(r["status"] == "ok" and r["steps"] == 2 for r in rows)
    assert {r["metric"] for r in rows if r["task"] == "mrpc"} == {"f1"}
    assert set(rows[3]["metrics"]) == {"f1", "accuracy"}

    # Memory is measured: fp32 weights are 4 bytes per parameter; full AdamW keeps m and v (8 bytes per
    # trainable parameter) plus two 4-byte counters (step, moment_step) per tensor.
    model_params = sum(p.numel() for p in _tiny_model(tiny_model_dir, 2).parameters())
    full = next(r for r in rows if r["task"] == "sst2" and r["method"] == "adamw")
    n_tensors = len(list(_tiny_model(tiny_model_dir, 2).parameters()))
    assert full["total_params"] == full["trainable_params"] == model_params
    assert full["weight_bytes"] == 4 * model_params
    assert full["state_bytes"] == 8 * model_params + 8 * n_tensors
    assert full["memory_bytes"] == full["weight_bytes"] + full["state_bytes"]
    galore = next(r for r in rows if r["task"] == "sst2" and r["method"] == "galore")
    lora = next(r for r in rows if r["task"] == "sst2" and r["method"] == "lora")
    assert galore["settings"] == {"rank": 8, "update_gap": 1, "scale": 4.0}
    assert galore["state_bytes"] < full["state_bytes"] and galore["weight_bytes"] == full["weight_bytes"]
    # LoRA: every base weight is kept (frozen) plus the adapters; state only for adapters and head.
    assert lora["trainable_params"] < lora["total_params"] and lora["weight_bytes"] > full["weight_bytes"]
    assert lora["state_bytes"] < 9 * lora["trainable_params"] + 1000
    assert lora["lr"] == 3e-3 and full["lr"] == 3e-4

    md = (out / "results.md").read_text()
    assert ("| Method | Weights + state MiB | Peak MiB | Planned peak MiB | sst2 (accuracy) | mrpc (f1) | Avg | "
            "Above control |") in md
    adamw = [r for r in rows if r["method"] == "adamw"]
    mib, peak, planned = (max(r[k] for r in adamw) / 2**20 for k in ("memory_bytes", "peak_bytes",
                                                                      "planned_peak_bytes"))
    scores = [100 * r["score"] for r in adamw]
    line = next(x for x in md.splitlines() if x.startswith("| Full FT (AdamW) |"))
    assert line == (f"| Full FT (AdamW) | {mib:.1f} | {peak:.1f} | {planned:.1f} | {scores[0]:.1f} | "
                    f"{scores[1]:.1f} | {sum(scores) / 2:.1f} |  |")
    # the peak of an iteration holds the weights, the state and the gradients at least
    assert all(r["peak_bytes"] > r["memory_bytes"] + 4 * r["trainable_params"] for r in rows)
    assert any(x.startswith("| galore r=8 |") for x in md.splitlines())
    assert any(x.startswith("| LoRA r=8 |") for x in md.splitlines())
    assert json.loads((out / "config.json").read_text())["methods"] == ["adamw", "galore", "lora"]
    assert "wrote" in stdout


@pytest.mark.parametrize("placement", [["--weights", "int8", "--offload", "host"], ["--offload", "host"],
                                       ["--weights", "int8", "--offload", "host", "--master", "bf16",
                                        "--int8-group", "16"],
                                       ["--weights", "int8", "--offload", "host", "--master", "bf16+int8"]],
                         ids=["int8-host", "host", "int8-bf16-group", "int8-bf16+int8"])
def test_int8_weights_and_host_masters_fine_tune(tmp_path, tiny_model_dir, glue_dir, capsys, placement):
    out = tmp_path / "out"
    rc, _, err = _run(["--model", str(tiny_model_dir), "--tasks", "sst2", "--data-dir", str(glue_dir),
                       "--methods", "adamw,galore", "--max-steps", "2", "--batch-size", "8", "--max-length", "16",
                       "--set", "galore.update_gap=1", "--out", str(out), *placement], capsys)
    assert rc == 0, err
    rows = read_results(out / "results.csv")
    assert [r["method"] for r in rows] == ["head", "adamw", "galore"]
    assert all(r["status"] == "ok" and r["steps"] == 2 and 0.0 <= r["score"] <= 1.0 for r in rows)
    assert all(math.isfinite(r["eval_loss"]) and math.isfinite(r["train_loss"]) for r in rows)
    assert all(r["state_bytes"] > 0 for r in rows)  # the host optimizer's state, counted


def test_a_fine_tuning_the_host_cannot_hold_stops_before_training(tmp_path, tiny_model_dir, glue_dir, capsys,
                                                                  monkeypatch):
    """As `slimopt train` does: one line (needed, available, a setting that fits), nothing trained."""
    from slimopt.train.host_memory import HOST_BYTES_ENV

    monkeypatch.setenv(HOST_BYTES_ENV, "1MiB")
    out = tmp_path / "out"
    rc, stdout, err = _run(["--model", str(tiny_model_dir), "--tasks", "sst2", "--data-dir", str(glue_dir),
                            "--methods", "adamw", "--max-steps", "2", "--batch-size", "8", "--max-length", "16",
                            "--weights", "int8", "--offload", "host", "--out", str(out)], capsys)
    lines = [line for line in err.splitlines() if line.startswith("slimopt finetune:")]
    assert rc == 2 and len(lines) == 1, err
    assert "host memory: this run needs" in lines[0] and f"available (${HOST_BYTES_ENV})" in lines[0], lines[0]
    assert "[1/" not in stdout and not (out / "results.csv").exists()  # not even the control trained


def _tiny_model(path, num_labels):
    from transformers import BertForSequenceClassification

    return BertForSequenceClassification.from_pretrained(str(path), num_labels=num_labels)


def test_offline_minilm_builtin_task(tmp_path, capsys):
    """The default model on a built-in offline task, one step on a handful of examples."""
    out = tmp_path / "out"
    rc, stdout, err = _run(["--tasks", "kjv-testament", "--methods", "frugal", "--max-steps", "1",
                            "--batch-size", "4", "--max-train-samples", "8", "--max-eval-samples", "8",
                            "--max-length", "16", "--out", str(out)], capsys)
    assert rc == 0, err
    control, row = read_results(out / "results.csv")
    assert (control["method"], control["role"], row["role"]) == ("head", "control", "method")
    assert control["trainable_params"] == 384 * 2 + 2  # the new head alone: hidden 384 -> 2 labels
    assert control["state_bytes"] == 8 * control["trainable_params"] + 8 * 2
    assert row["status"] == "ok" and row["total_params"] > 22_000_000  # MiniLM-L6: 22.7M
    assert 0.0 <= row["score"] <= 1.0 and set(row["metrics"]) == {"accuracy", "f1"}
    assert "| frugal r=8 |" in (out / "results.md").read_text()


def test_control_tuned_rates_and_seeds(tmp_path, tiny_model_dir, glue_dir, capsys):
    out = tmp_path / "out"
    rc, stdout, err = _run(["--model", str(tiny_model_dir), "--tasks", "sst2", "--data-dir", str(glue_dir),
                            "--methods", "adamw,lora", "--max-steps", "2", "--batch-size", "8", "--max-length", "16",
                            "--seeds", "2", "--tune-lr", "--lr-grid", "1/2,1", "--lr-extensions", "1",
                            "--out", str(out)], capsys)
    assert rc == 0, err
    rows = read_results(out / "results.csv")
    assert [(r["method"], r["role"]) for r in rows] == [("head", "control"), ("adamw", "method"), ("lora", "method")]
    runs = read_results(out / "runs.csv")
    for r in rows:
        assert (r["seeds"], r["seeds_ok"]) == (2, 2) and r["lr_source"].startswith("tuned: x")
        seeds = [x for x in runs if x["method"] == r["method"] and x["kind"] == "seed"]
        tuned = [x for x in runs if x["method"] == r["method"] and x["kind"] == "tune"]
        assert [x["seed"] for x in seeds] == [0, 1] and all(x["lr"] == r["lr"] for x in seeds)
        assert [x["chosen"] for x in seeds] == [True, False]  # the chosen grid run is seed 0's run
        assert len(tuned) in (1, 2)  # the other grid point, and one extension when the best sat on an edge
        assert r["score_min"] <= r["score"] <= r["score_max"]
        assert r["score"] == pytest.approx(sum(x["score"] for x in seeds) / 2)
        assert r["eval_loss"] <= min(x["eval_loss"] for x in tuned) or r["eval_loss"] == pytest.approx(
            sum(x["eval_loss"] for x in seeds) / 2)
    head, adamw = rows[0], rows[1]
    assert head["trainable_params"] == 32 * 2 + 2 and head["peak_bytes"] < adamw["peak_bytes"]
    assert adamw["clears_control"] == (adamw["score"] > head["score"])
    md = (out / "results.md").read_text()
    assert "| Control: head only (AdamW) |" in md and "seeds 0-1" in md
    assert ("clears the control" in md) or ("does **not** clear the control" in md)


# ---------------------------------------------------------------------------------------------- settings


def test_method_settings():
    cfg = FinetuneConfig(rank=4, method_opts={"galore": {"scale": 2}, "frugal": {"density": 0.5}})
    assert method_settings(parse_method("galore"), cfg) == {"rank": 4, "update_gap": 100, "scale": 2, "lr": 3e-4}
    # density replaces the default rank
    assert method_settings(parse_method("frugal"), cfg) == {"projector": "svd", "update_gap": 100,
                                                            "density": 0.5, "lr": 3e-4}
    assert method_settings(parse_method("frugal_rho0"), cfg) == {"lr": 3e-4}  # stays at density 0
    plan = parse_method("lora+adamw8bit")
    assert (plan.lora, plan.optimizer) == (True, "adamw8bit")
    assert method_settings(plan, cfg) == {"lr": 3e-3}
    assert method_settings(parse_method("lora"), FinetuneConfig(lr=5e-4)) == {"lr": 5e-4}
    assert "galore" in FINETUNE_DEFAULTS


# ---------------------------------------------------------------------------------------------- bad input


# Should a check ever let bad input through, the run it starts stays short.
CHEAP = ["--max-steps", "1", "--max-train-samples", "8", "--max-eval-samples", "8", "--max-length", "8"]


def _write_sst2(root, rows):
    (root / "sst2").mkdir(parents=True)
    for split in ("train", "validation"):
        with open(root / "sst2" / f"{split}.csv", "w", newline="") as f:
            csv.writer(f).writerows(rows)
    return root


@pytest.mark.parametrize("args,message", [
    (["--tasks", "nope"], "unknown task 'nope'"),
    (["--methods", "adamw,galor"], "unknown method 'galor'"),
    (["--methods", "lora+nope"], "unknown method 'lora+nope'"),
    (["--methods", "adamw,adamw"], "lists a method twice"),
    (["--set", "galore.rnak=4", "--methods", "galore"], "unknown hyperparameter"),
    (["--set", "galore.rank=0", "--methods", "galore"], "rank must be a positive integer"),
    (["--set", "taco.lr=1e-3", "--methods", "adamw"], "not among the methods"),
    (["--model", "/no/such/model"], "does not exist"),
    (["--lr-grid", "1,2"], "--lr-grid sets up --tune-lr"),
    (["--tune-lr", "--lr-grid", "1,x"], "'x' is not a number"),
    (["--seeds", "0"], "positive"),
    (["--tasks", "mytask", "--data-dir", "."], "give num_labels"),
    (["--methods", "adamw,lora", "--weights", "int8"], "apply to full fine-tuning methods"),
    (["--int8-group", "32"], "--int8-group needs --weights int8"),
])
def test_bad_arguments_fail_before_training(tmp_path, capsys, args, message):
    out = tmp_path / "out"
    rc, _, err = _run([*args, *CHEAP, "--out", str(out)], capsys)
    assert rc == 2
    assert message in err
    assert not (out / "results.csv").exists()


def test_hub_model_offline_is_a_clear_error(tmp_path, capsys, monkeypatch):
    from slimopt.models.hub import hub_offline

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub_offline.cache_clear()  # decided once per process; decide again under the variable
    try:
        rc, _, err = _run(["--model", "roberta-base", *CHEAP, "--out", str(tmp_path)], capsys)
    finally:
        hub_offline.cache_clear()
    assert rc == 2
    assert "cannot load model 'roberta-base'" in err and "--model minilm" in err


@pytest.mark.parametrize("rows,message", [
    ([["sentence", "target"], ["a b", "1"], ["c d", "0"]], "label"),  # no label column
    ([["sentence", "label"], ["a b", "1"], ["c d", "2"]], "integers in [0, 2)"),  # sst2 has 2 labels
    ([["text", "label"], ["a b", "1"], ["c d", "0"]], "sentence"),  # missing text column
])
def test_bad_data_fails_before_training(tmp_path, tiny_model_dir, capsys, rows, message):
    root = _write_sst2(tmp_path / "data", rows)
    out = tmp_path / "out"
    rc, _, err = _run(["--model", str(tiny_model_dir), "--tasks", "sst2", "--data-dir", str(root), *CHEAP,
                       "--out", str(out)], capsys)
    assert rc == 2
    assert message in err
    assert not (out / "results.csv").exists()
