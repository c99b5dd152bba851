"""What a newcomer's first `slimopt compare` runs fell into (issue 43): the machine line's threads, the loss curves'
axes, a variant's bad lr, a variant's lr and a short run's update gap, and TACO in a pretraining comparison."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from pretrain_helpers import VOCAB, fast_config

from slimopt.cli import main
from slimopt.compare.config import DEFAULT_SETTING_LR, CompareConfig, default_methods, scaled_schedule_opts
from slimopt.compare.report import read_results
from slimopt.compare.run import run_compare


@pytest.fixture()
def fake_train(monkeypatch):
    """compare's training replaced by a fixed result (in-process runs only): the report without training."""
    from slimopt.compare import runner

    def train(tc):
        loss = 3.0 if tc.method != "taco" else 4.0
        return {"val_loss": loss, "val_ppl": math.exp(loss), "val_tokens": 1024, "state_bytes": 8.0,
                "state_bytes_per_param": 8.0, "peak_mem_bytes": 2**20, "peak_mem_kind": "synthetic",
                "tokens_per_s": 1.0, "wall_time_s": 0.0, "cpu_time_s": 0.0, "lr": tc.lr, "steps": 1, "tokens": 1,
                "trainable_params": 1, "params": 1, "device": "cpu", "history": {"train": [], "eval": []}}

    monkeypatch.setattr(runner, "train", train)


# ------------------------------------------------------------------------------ (6b) the runs' torch threads

def test_the_machine_line_gives_the_threads_the_runs_used(data, tmp_path):
    """The report's machine line said the comparing process's torch threads (one per core), not the runs'."""
    import torch
    corpus, cache = data
    before = torch.get_num_threads()
    torch.set_num_threads(3)  # this process's count, which the runs (--threads 1) do not use
    try:
        cfg = CompareConfig(base=fast_config(corpus, cache, max_steps=2, threads=1), methods=["adamw"],
                            control=False, out=str(tmp_path / "o"), isolate=True, progress=False, plan=None)
        run_compare(cfg, log=lambda *_: None)
    finally:
        torch.set_num_threads(before)
    machine_line = next(line for line in (tmp_path / "o" / "results.md").read_text().splitlines()
                        if "Machine:" in line)
    assert "1 torch thread per run" in machine_line and "3 torch threads" not in machine_line


# ------------------------------------------------------------------------------ (7) loss curves' y axes

def _curve_rows() -> list[dict]:
    """Two methods' histories shaped like a real run's: the training loss starts at ln(vocab) and falls fast."""
    rows = []
    for name, end in (("adamw", 2.8), ("taco", 4.0)):
        train = [(64 * s, end + (math.log(512) - end) * math.exp(-s / 15)) for s in range(1, 201)]
        evals = [(64 * s, end + 0.05 + (5.3 - end) * math.exp(-s / 40)) for s in range(25, 201, 25)]
        rows.append({"method": name, "status": "ok", "history": {"train": train, "eval": evals}})
    return rows


def test_loss_curve_axes_fit_the_data_they_show(tmp_path, monkeypatch):
    """Every drawn point lies inside its panel's y range, and the range does not run far past the data."""
    from slimopt.compare import plots
    kept = {}
    real_save = plots.save_figure

    def keep(fig, path):
        kept["axes"] = [(ax.get_ylim(), ax.get_yscale(), ax.get_ylabel(), [line.get_ydata() for line in ax.get_lines()])
                        for ax in fig.axes]
        return real_save(fig, path)

    monkeypatch.setattr(plots, "save_figure", keep)
    plots.plot_loss_curves(_curve_rows(), tmp_path / "loss_curves.png")
    for (lo, hi), scale, label, lines in kept["axes"]:
        values = [float(v) for ys in lines for v in ys]
        assert values, label
        f = math.log if scale == "log" else (lambda v: v)
        span = f(max(values)) - f(min(values))
        assert lo <= min(values) and max(values) <= hi, (label, (lo, hi), (min(values), max(values)))
        assert f(min(values)) - f(lo) <= 0.1 * span and f(hi) - f(max(values)) <= 0.1 * span, label
        if scale == "log":
            assert "log scale" in label
    # the training panel draws every step: nothing of the curve's start is left out
    train_lines = kept["axes"][0][3]
    assert all(len(ys) == 200 for ys in train_lines)


# ------------------------------------------------------------------------------ (8a) a variant's bad lr

@pytest.mark.parametrize("args,typed", [
    (["--methods", "adamw+lr=-1"], "adamw+lr=-1"),
    (["--methods", "adamw,adamw+eps=0.1+lr=0"], "adamw+eps=0.1+lr=0"),
    (["--methods", "adamw+lr=fast"], "adamw+lr=fast"),
    (["--methods", "adamw", "--set", "adamw.lr=-1"], "--set adamw.lr=-1"),
])
def test_a_bad_lr_is_named_as_the_user_typed_it(data, tmp_path, capsys, args, typed):
    corpus, cache = data
    out = tmp_path / "o"
    assert main(["compare", "--data", str(corpus), "--vocab-size", str(VOCAB), "--cache-dir", str(cache),
                 "--max-steps", "2", "--out", str(out), "--no-progress", *args]) == 2
    err = capsys.readouterr().err
    assert typed in err and "lr" in err and "a positive number" in err, err
    assert "--lr must" not in err  # compare has no --lr: the message names what was typed
    assert not out.exists()


# ------------------------------------------------------------------------------ (9) a variant's lr, the gap

def test_a_variant_runs_at_its_base_methods_lr():
    from slimopt.compare.config import _base_lr, _method_config
    cfg = CompareConfig()  # the default setting: GaLore's tuned 0.04, not the paper's 0.01
    assert _base_lr(cfg, "galore+stagger_refresh=True") == (DEFAULT_SETTING_LR["galore"],
                                                            "galore's: tuned at this setting")
    assert _method_config(cfg, "galore+stagger_refresh=True").lr == DEFAULT_SETTING_LR["galore"]
    assert _base_lr(cfg, "galore+stagger_refresh=True+lr=0.01") == (0.01, "the variant's")  # its own lr wins
    # --set on the base method sets its variants' lr too; --set on the variant wins over it
    both = CompareConfig(methods=["galore", "galore+rank=64"], method_opts={"galore": {"lr": 0.02}})
    assert _base_lr(both, "galore+rank=64") == (0.02, "galore's: --set")
    own = CompareConfig(methods=["galore", "galore+rank=64"],
                        method_opts={"galore": {"lr": 0.02}, "galore+rank=64": {"lr": 0.03}})
    assert _base_lr(own, "galore+rank=64") == (0.03, "--set")
    # elsewhere a variant starts from its base's paper lr, as the base does
    other = CompareConfig(base=replace(cfg.base, vocab_size=2048))
    assert _base_lr(other, "galore+rank=64") == (1e-2, "galore's: paper")


def test_a_tuned_variant_sweeps_around_its_base_methods_lr(data, tmp_path, fake_train):
    corpus, cache = data
    cfg = CompareConfig(base=fast_config(corpus, cache, max_steps=4), methods=["adamw", "adamw+eps=0.1"],
                        control=False, out=str(tmp_path / "o"), isolate=False, progress=False, tune_lr=True,
                        lr_grid=(0.5, 1.0, 2.0), lr_extensions=0, tune_fraction=0.5, plan=None,
                        method_opts={"adamw": {"lr": 2e-3}})
    run_compare(cfg, log=lambda *_: None)
    sweep = read_results(tmp_path / "o" / "lr_sweep.csv")
    assert {p["base_lr"] for p in sweep if p["method"] == "adamw+eps=0.1"} == {2e-3}


def test_a_short_runs_update_gap_has_a_floor():
    # steps // 20 below 10 made GaLore refresh (and FRUGAL reset its moments) every step or two
    assert scaled_schedule_opts("galore", 24) == {"update_gap": 10}
    assert scaled_schedule_opts("galore", 100) == {"update_gap": 10}
    assert scaled_schedule_opts("frugal", 128) == {"update_gap": 10}
    assert scaled_schedule_opts("badam", 60) == {"update_gap": 10}
    assert scaled_schedule_opts("galore", 512) == {"update_gap": 25}  # the default run: unchanged
    assert scaled_schedule_opts("galore", 10_000) == {}


def test_the_table_gives_every_rows_gap_and_lr(data, tmp_path, fake_train):
    """The settings column shows the gap a row ran with, the paper's too when the run is long enough to keep it,
    and the reproduce line says to pass the column's settings."""
    from slimopt.compare.config import _method_config
    from slimopt.compare.runner import _settings
    corpus, cache = data
    long = CompareConfig(base=fast_config(corpus, cache, max_steps=5000))
    assert _settings(_method_config(long, "galore")) == "update_gap=200"
    assert _settings(_method_config(long, "badam")) == "update_gap=100"
    assert _settings(_method_config(long, "adamw")) == ""
    cfg = CompareConfig(base=fast_config(corpus, cache, max_steps=24), methods=["adamw", "galore",
                        "galore+stagger_refresh=True"], out=str(tmp_path / "o"), isolate=False, progress=False,
                        plan=None)
    run_compare(cfg, log=lambda *_: None)
    rows = {r["method"]: r for r in read_results(tmp_path / "o" / "results.csv")}
    assert rows["galore"]["settings"] == "update_gap=10"
    assert rows["galore+stagger_refresh=True"]["settings"] == "stagger_refresh=True update_gap=10"
    assert rows["galore+stagger_refresh=True"]["lr"] == rows["galore"]["lr"] == pytest.approx(1e-2)
    md = (tmp_path / "o" / "results.md").read_text()
    assert "--opt KEY=VALUE for each of column settings" in md
    assert "never below 10 steps" in md


# ------------------------------------------------------------------------------ (10) TACO where it applies

def test_the_default_comparison_runs_taco_only_on_a_pretrained_model():
    from slimopt.compare.config import _entries
    assert "taco" not in default_methods()  # a tiny LLaMA from scratch: pretraining, which TACO does not claim
    assert "taco" not in _entries(CompareConfig())
    assert "taco" in default_methods(pretrained=True)
    smollm2 = CompareConfig(base=replace(CompareConfig().base, model="smollm2-135m"))
    assert "taco" in _entries(smollm2)


def test_taco_from_scratch_says_why_and_where_its_claim_is_measured(data, tmp_path, fake_train):
    corpus, cache = data
    cfg = CompareConfig(base=fast_config(corpus, cache, max_steps=4), methods=["adamw", "taco"],
                        out=str(tmp_path / "o"), isolate=False, progress=False, plan=None)
    run_compare(cfg, log=lambda *_: None)
    rows = {r["method"]: r for r in read_results(tmp_path / "o" / "results.csv")}
    assert "fine-tuning method" in rows["taco"]["notes"] and "fine-tuning" not in rows["adamw"]["notes"]
    md = (tmp_path / "o" / "results.md").read_text()
    note = [line for line in md.splitlines() if line.startswith("- taco:") or "TACO is a fine-tuning" in line]
    assert len(note) == 1
    assert "`slimopt compare --model smollm2-135m" in note[0] and "docs/reproduction.md" in note[0]
