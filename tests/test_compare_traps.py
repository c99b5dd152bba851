"""What a newcomer's first `slimopt compare` runs fell into (issue 43): the machine line's threads, the loss curves'
axes, a variant's bad lr, a variant's lr and a short run's update gap, and TACO in a pretraining comparison."""

from __future__ import annotations

import math

import pytest
from pretrain_helpers import VOCAB, fast_config, write_corpus

from slimopt.cli import main
from slimopt.train.compare import (
    CompareConfig,
    run_compare,
)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("traps")
    return write_corpus(folder), folder / "cache"


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
    from slimopt.train import compare_plots
    kept = {}
    real_save = compare_plots.save_figure

    def keep(fig, path):
        kept["axes"] = [(ax.get_ylim(), ax.get_yscale(), ax.get_ylabel(), [line.get_ydata() for line in ax.get_lines()])
                        for ax in fig.axes]
        return real_save(fig, path)

    monkeypatch.setattr(compare_plots, "save_figure", keep)
    compare_plots.plot_loss_curves(_curve_rows(), tmp_path / "loss_curves.png")
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
