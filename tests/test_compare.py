"""`slimopt compare` on a very small budget: the table's rows and numbers, the CSV, and the two figures' content;
bad input fails before anything is written."""

from __future__ import annotations

import math
from dataclasses import replace

import matplotlib.image
import numpy as np
import pytest
from pretrain_helpers import VOCAB, fast_config

from slimopt.cli import main
from slimopt.compare.config import CompareConfig, default_methods, scaled_schedule_opts
from slimopt.compare.report import CSV_COLUMNS, read_results
from slimopt.compare.run import run_compare
from slimopt.train.logger import read_jsonl


def _non_white_fraction(png) -> float:
    img = matplotlib.image.imread(png)  # [H, W, 4] floats in [0, 1]
    return float((img[..., :3].min(axis=-1) < 0.9).mean())


@pytest.fixture(scope="module")
def compared(data, tmp_path_factory):
    corpus, cache = data
    out = tmp_path_factory.mktemp("compare-out") / "results"
    base = fast_config(corpus, cache, max_steps=6, eval_every=3)
    cfg = CompareConfig(base=base, methods=["adamw", "galore", "frugal_rho0", "lowrank"],
                        method_opts={"galore": {"rank": 16}}, out=str(out), isolate=True, progress=False)
    rows = run_compare(cfg, log=lambda *_: None)
    return cfg, rows, out


def test_table_rows_and_numbers(compared):
    cfg, rows, out = compared
    csv_rows = read_results(out / "results.csv")
    # the control first, then the methods in the order given
    assert [r["method"] for r in csv_rows] == ["frozen", "adamw", "galore", "frugal_rho0", "lowrank"]
    assert [r["role"] for r in csv_rows] == ["control"] + ["method"] * 4
    assert list(csv_rows[0]) == list(CSV_COLUMNS)
    tokens = 6 * cfg.base.batch_size * cfg.base.seq_len
    for r in csv_rows:
        assert r["status"] == "ok", r
        assert 1 < r["val_ppl"] < VOCAB * 2 and math.isfinite(r["val_loss"])
        assert r["val_ppl"] == pytest.approx(math.exp(r["val_loss"]), rel=1e-9)
        assert r["tokens"] == tokens and r["steps"] == 6
        assert r["tokens_per_s"] > 0 and r["wall_time_s"] > 0 and r["peak_mem_mib"] >= 0
        assert r["state_mib"] * 2**20 == pytest.approx(r["state_bytes_per_param"] * r["trainable_params"], rel=1e-9)
    by = {r["method"]: r for r in csv_rows}
    assert by["adamw"]["state_bytes_per_param"] == pytest.approx(8.0, abs=0.01)
    assert by["galore"]["state_mib"] < by["adamw"]["state_mib"]
    assert by["frugal_rho0"]["state_mib"] < by["galore"]["state_mib"]
    assert by["lowrank"]["trainable_params"] < by["adamw"]["trainable_params"]
    assert by["frozen"]["trainable_params"] < by["adamw"]["trainable_params"]
    assert by["adamw"]["lr"] == pytest.approx(1e-3) and by["galore"]["lr"] == pytest.approx(1e-2)
    # the control at the best of its own short sweep around AdamW's lr
    sweep = read_results(out / "lr_sweep.csv")
    assert [(p["method"], p["multiplier"], p["steps"]) for p in sweep] == [("frozen", m, 2) for m in (1, 3, 10, 30)]
    best = min(sweep, key=lambda p: p["val_loss"])
    assert by["frozen"]["lr"] == pytest.approx(best["lr"]) and best["chosen"]
    assert by["frozen"]["lr_source"] == f"tuned (x{best['multiplier']:g} of AdamW's 0.001)"
    assert by["adamw"]["lr_source"] == "paper" and by["adamw"]["seeds"] == 1
    assert "rank=16" in by["galore"]["settings"]

    md = (out / "results.md").read_text()
    lines = md.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("| method | kind |")))
    table = [line for line in lines[start:lines.index("", start)] if not line.startswith("|---")]
    assert len(table) == 1 + 5  # header + the control + one row per method
    for r in csv_rows:
        row = next(line for line in table if line.startswith(f"| {r['method']} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[2]) == pytest.approx(r["val_ppl"], abs=0.006)
        assert float(cells[4]) == pytest.approx(r["state_mib"], abs=0.0006)
    assert "Ranking by validation perplexity" in md and "peak RSS" in md


def test_curves_match_the_logs(compared):
    _, rows, out = compared
    for r in rows:
        log = read_jsonl(out / "runs" / r["method"] / "metrics.jsonl")
        evals = [(x["tokens"], x["val_loss"]) for x in log if x["event"] == "eval"]
        assert [tuple(p) for p in r["history"]["eval"]] == evals and len(evals) == 2
        assert len(r["history"]["train"]) == 6


def test_figures_have_content(compared):
    _, _, out = compared
    curves = matplotlib.image.imread(out / "loss_curves.png")
    assert curves.shape[:2] == (460, 1200)
    assert _non_white_fraction(out / "loss_curves.png") > 0.02  # axes, 4 curves, legend
    mem = matplotlib.image.imread(out / "memory.png")
    assert mem.shape[1] == 1200 and mem.shape[0] >= 300
    # The bars: a good share of the area is the state's blue and the planned peaks' green (fits) or red (not).
    rgb = mem[..., :3]
    blue = ((rgb[..., 2] > 0.6) & (rgb[..., 0] < 0.3)).mean()
    green = ((rgb[..., 1] > 0.5) & (rgb[..., 0] < 0.3) & (rgb[..., 2] < 0.3)).mean()
    red = ((rgb[..., 0] > 0.7) & (rgb[..., 1] < 0.3) & (rgb[..., 2] < 0.3)).mean()
    assert blue > 0.02 and green + red > 0.01


def test_a_diverging_method_is_reported_and_the_others_kept(data, tmp_path):
    corpus, cache = data
    base = fast_config(corpus, cache, max_steps=3)
    cfg = CompareConfig(base=base, methods=["signsgd", "adamw"], out=str(tmp_path / "o"), isolate=False,
                        progress=False, method_opts={"signsgd": {"lr": 1e30}})  # weights overflow to inf
    rows = run_compare(cfg, log=lambda *_: None)
    assert [(r["method"], r["status"]) for r in rows] == [("frozen", "ok"), ("signsgd", "diverged"), ("adamw", "ok")]
    csv_rows = read_results(tmp_path / "o" / "results.csv")
    assert math.isnan(csv_rows[1]["val_ppl"]) and math.isfinite(csv_rows[2]["val_ppl"])
    assert "| signsgd | slimopt | diverged |" in (tmp_path / "o" / "results.md").read_text()
    assert (tmp_path / "o" / "loss_curves.png").stat().st_size > 10_000


def test_default_methods_and_scaled_intervals():
    methods = default_methods()
    assert methods[0] == "adamw" and "galore" in methods and "frugal" in methods
    assert scaled_schedule_opts("galore", 100) == {"update_gap": 10}  # steps // 20, never below 10
    assert scaled_schedule_opts("galore", 10_000) == {}
    assert scaled_schedule_opts("adamw", 100) == {}
    if "relora" in methods:
        assert scaled_schedule_opts("relora", 100) == {"restart_every": 25, "restart_warmup": 2}


def test_cli_bad_input_writes_nothing(data, tmp_path, capsys):
    corpus, cache = data
    out = tmp_path / "cmp"
    common = ["compare", "--data", str(corpus), "--vocab-size", str(VOCAB), "--cache-dir", str(cache),
              "--max-steps", "2", "--out", str(out), "--no-progress"]
    assert main(common + ["--methods", "adamw,nosuch"]) == 2
    assert "unknown method 'nosuch'" in capsys.readouterr().err
    assert main(common + ["--methods", "adamw,galore", "--set", "galore.rank=0"]) == 2
    assert "galore" in capsys.readouterr().err
    assert main(common + ["--methods", "adamw", "--set", "frugal.lr=1e-3"]) == 2
    assert "not compared" in capsys.readouterr().err
    assert main(common + ["--methods", "adamw", "--set", "adamw.rank=4"]) == 2  # a setting adamw never reads
    assert "rank=4 has no effect with method 'adamw'" in capsys.readouterr().err
    assert main(common + ["--data", str(tmp_path / "missing.jsonl")]) == 2
    assert not out.exists()


def test_in_process_mode_says_memory_is_not_per_method(data, tmp_path):
    corpus, cache = data
    cfg = CompareConfig(base=replace(fast_config(corpus, cache, max_steps=2)), methods=["adamw"],
                        out=str(tmp_path / "o"), isolate=False, progress=False, control=False)
    rows = run_compare(cfg, log=lambda *_: None)
    assert [r["method"] for r in rows] == ["adamw"]  # control=False: no control row
    assert rows[0]["status"] == "ok" and "in-process" in rows[0]["peak_mem_kind"]
    assert "in-process" in (tmp_path / "o" / "results.md").read_text()
    assert np.isfinite(rows[0]["val_ppl"])


def test_runs_at_a_time_and_variants(data, tmp_path):
    # two runs at a time give the numbers one at a time gives; a variant NAME+KEY=VALUE runs NAME with that setting
    # in a row of its own
    corpus, cache = data
    results = {}
    for jobs in (1, 2):
        cfg = CompareConfig(base=fast_config(corpus, cache, max_steps=3, threads=1),
                            methods=["adamw", "adamw+eps=0.1"], out=str(tmp_path / f"j{jobs}"), isolate=True,
                            progress=False, control=False, jobs=jobs)
        rows = run_compare(cfg, log=lambda *_: None)
        assert [r["method"] for r in rows] == ["adamw", "adamw+eps=0.1"]
        assert all(r["status"] == "ok" for r in rows)
        results[jobs] = [r["val_loss"] for r in rows]
        assert ("2 runs at a time" in (tmp_path / f"j{jobs}" / "results.md").read_text()) == (jobs == 2)
    assert results[1] == results[2]
    assert results[1][0] != results[1][1]  # eps 0.1 changes Adam's steps
    with pytest.raises(ValueError, match="--jobs must be an integer >= 1"):
        run_compare(CompareConfig(base=fast_config(corpus, cache, max_steps=3), methods=["adamw"],
                                  out=str(tmp_path / "bad"), jobs=0), log=lambda *_: None)


def test_default_runs_at_a_time():
    import os

    import torch

    from slimopt.compare.runner import jobs_for
    cores = len(os.sched_getaffinity(0))
    base = CompareConfig().base
    assert base.device in (None, "auto") and base.threads == 1
    expected = 1 if torch.cuda.is_available() else cores  # "auto" is the GPU when there is one
    assert jobs_for(CompareConfig()) == expected
    assert jobs_for(CompareConfig(base=replace(base, device="cpu", threads=cores))) == 1
    assert jobs_for(CompareConfig(base=replace(base, device="cpu"), isolate=False)) == 1
    assert jobs_for(CompareConfig(base=replace(base, device="cpu"), jobs=3)) == 3


def test_the_default_setting_runs_at_its_tuned_learning_rates():
    from slimopt.compare.config import DEFAULT_SETTING_LR, _base_lr, _method_config, at_default_setting
    cfg = CompareConfig()
    assert at_default_setting(cfg)
    assert set(default_methods()) <= set(DEFAULT_SETTING_LR)
    assert _base_lr(cfg, "galore") == (DEFAULT_SETTING_LR["galore"], "tuned at this setting")
    assert _base_lr(cfg, "adamw+eps=0.1") == (DEFAULT_SETTING_LR["adamw"], "adamw's: tuned at this setting")
    assert _base_lr(cfg, "adamw+rule=lion+lr=2.5e-4") == (2.5e-4, "the variant's")  # and may say which
    assert _method_config(CompareConfig(), "adamw+rule=lion+lr=2.5e-4").lr == 2.5e-4
    assert _base_lr(CompareConfig(method_opts={"adamw": {"lr": 1e-3}}), "adamw") == (1e-3, "--set")
    for change in ({"vocab_size": 2048}, {"max_steps": 128, "tokens": None}, {"model": "small"},
                   {"dtype": "bf16"}):
        other = CompareConfig(base=replace(cfg.base, **change))
        assert not at_default_setting(other)
        assert _base_lr(other, "galore") == (1e-2, "paper")
    assert at_default_setting(CompareConfig(base=replace(cfg.base, seed=3, threads=2), seeds=3))


def test_the_report_says_where_the_learning_rates_come_from():
    from slimopt.compare.report import _markdown
    cfg = CompareConfig()
    default = _markdown([], cfg, None, {})
    assert "a tuned 3-seed run of this setting picked" in default and "paper learning rate" not in default
    other = _markdown([], CompareConfig(base=replace(cfg.base, vocab_size=2048)), None, {})
    assert "each method at its paper learning rate" in other
    assert "(tokenizer: byte-level BPE, vocab 2048)" in other
    # a pretrained model reads its own tokenizer, whatever --vocab-size says
    pretrained = _markdown([], CompareConfig(base=replace(cfg.base, model="smollm2-135m")), None, {})
    assert "(tokenizer: smollm2-135m)" in pretrained
