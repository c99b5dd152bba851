"""What keeps `slimopt compare` honest: the control row (only what is not a projectable weight trains), the
learning-rate sweep's choice, the warnings (a method that does not clear the control; AdamW less than 20% below
it), the seed statistics and the noise they imply, and the full-rank mark. Tiny runs (a few steps of the tiny
LLaMA at vocabulary 512), in this process."""

from __future__ import annotations

import math
import statistics
from dataclasses import replace
from pathlib import Path

import matplotlib.image
import pytest
import torch
from pretrain_helpers import VOCAB, fast_config

from slimopt import baselines
from slimopt.cli import main
from slimopt.compare.analysis import (
    MIN_CONTROL_MARGIN,
    aggregate_seeds,
    baseline_full_rank_weights,
    budget_warning,
    full_rank_weights,
    inside_noise,
    noise_pairs,
    ranking_text,
)
from slimopt.compare.config import CompareConfig
from slimopt.compare.protocol import CONTROL, LOSS, choose_lr, control_verdicts, extension_multiplier, on_grid_edge
from slimopt.compare.report import read_results
from slimopt.compare.run import run_compare
from slimopt.factory import make_optimizer
from slimopt.models import llama as models
from slimopt.optim.algorithm.partition import classify
from slimopt.train.loop import train


def _table(md: str) -> dict[str, list[str]]:
    """The results.md table: method -> cells, keyed by the header's column names."""
    lines = md.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("| method | kind |")))
    table = lines[start:lines.index("", start)]
    head = [c.strip() for c in table[0].strip("|").split("|")]
    rows = {}
    for line in table[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == len(head), line
        rows[cells[0]] = dict(zip(head, cells))
    return rows


# ------------------------------------------------------------------------------------------------ the control


def test_control_trains_only_what_is_not_projectable(data, tmp_path):
    corpus, cache = data
    tc = replace(fast_config(corpus, cache, max_steps=4), method="frozen", out=str(tmp_path / "run"),
                 save_model=True, lr=1e-2)
    res = train(tc)
    init = models.build_model("tiny", VOCAB, tc.seq_len, seed=tc.seed)
    kinds = {n: k for n, (_, k) in classify(init).items()}
    assert sorted(set(kinds.values())) == ["embedding", "head", "other", "projectable"]
    trained = models.build_model(str(tmp_path / "run" / "final"), VOCAB, tc.seq_len)
    before, after = dict(init.named_parameters()), dict(trained.named_parameters())
    for name, kind in kinds.items():
        if kind == "projectable":  # every attention and MLP Linear weight exactly as initialised
            assert torch.equal(after[name], before[name]), name
        else:  # embeddings, norms and head moved
            assert not torch.equal(after[name], before[name]), name
    assert res["trainable_params"] == sum(p.numel() for n, p in before.items() if kinds[n] != "projectable")
    assert res["trainable_params"] < res["params"]
    assert res["lr"] == pytest.approx(1e-2)


def test_control_optimizer_holds_exactly_the_non_projectable_parameters():
    model = models.build_model("tiny", VOCAB, 32, seed=0, device="meta")
    kinds = {n: k for n, (_, k) in classify(model).items()}
    model, _ = baselines.prepare(model, "frozen")
    opt = make_optimizer(model, "frozen")
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in in_opt}
    assert names == {n for n, k in kinds.items() if k != "projectable"}
    assert all(not p.requires_grad for n, p in model.named_parameters() if kinds[n] == "projectable")


# ------------------------------------------------------------------------------------------------ warnings


def _row(method, ppl, **kw):
    return {"method": method, "status": "ok", "val_ppl": ppl, "val_loss": math.log(ppl), **kw}


def test_budget_warning_threshold_and_advice():
    control = _row("frozen", 100.0)
    # 19% below the control: a warning that says what to change
    w = budget_warning([control, _row("adamw", 81.0)], control, steps=128, vocab_size=2048, model="tiny")
    assert w is not None and "only 19%" in w and "at least 20%" in w
    assert "--max-steps 512" in w and "--vocab-size 512" in w and "--model small" in w
    assert "--tune-lr" not in w
    w = budget_warning([control, _row("adamw", 81.0, lr_source="paper")], control, steps=128)
    assert "AdamW at its best lr (--tune-lr)" in w
    w = budget_warning([control, _row("adamw", 81.0, lr_source="tuned (x2 of paper 0.001)")], control, steps=128)
    assert "--tune-lr" not in w
    # 21% below: none
    assert budget_warning([control, _row("adamw", 79.0)], control, steps=128) is None
    assert MIN_CONTROL_MARGIN == 0.20
    # AdamW above the control
    w = budget_warning([control, _row("adamw", 130.0)], control, steps=8)
    assert "does not beat the control (30% worse)" in w
    # no AdamW row / a failed control: the check could not be made, and says so
    assert "adamw is not among the methods" in budget_warning([control, _row("galore", 50.0)], control)
    failed = {"method": "frozen", "status": "failed: RuntimeError: x"}
    assert "did not finish" in budget_warning([failed, _row("adamw", 50.0)], failed)
    assert budget_warning([_row("adamw", 50.0)], None) is None  # --no-control


def test_control_verdicts_mark_what_does_not_clear_it():
    control = _row("frozen", 100.0)
    rows = [control, _row("adamw", 99.0), _row("galore", 100.0), _row("taco", 150.0),
            {"method": "lora", "status": "failed: x"}]
    assert control_verdicts(rows, LOSS, CONTROL) == {"adamw": True, "galore": False, "taco": False, "lora": None}
    text = ranking_text(rows, control)
    assert text.startswith("adamw (99.0) < ")
    assert "galore (100.0) [not below the control]" in text and "taco (150.0) [not below the control]" in text
    assert "frozen (100.0)" in text and "frozen (100.0) [" not in text


def test_a_method_below_the_control_is_marked_and_warned(data, tmp_path):
    """AdamW at a learning rate too small to move anything: it does not clear the control (which trains at AdamW's
    default lr), so its row is marked, the ranking says so, and the budget warning names what to change."""
    corpus, cache = data
    logged = []
    cfg = CompareConfig(base=fast_config(corpus, cache, max_steps=6), methods=["adamw"],
                        method_opts={"adamw": {"lr": 1e-7}}, out=str(tmp_path / "o"), isolate=False,
                        progress=False)
    rows = run_compare(cfg, log=logged.append)
    by = {r["method"]: r for r in rows}
    assert by["adamw"]["val_ppl"] > by["frozen"]["val_ppl"]
    assert by["frozen"]["lr_source"].startswith("tuned (x") and by["adamw"]["lr_source"] == "--set"
    csv_rows = {r["method"]: r for r in read_results(tmp_path / "o" / "results.csv")}
    assert csv_rows["adamw"]["clears_control"] is False and csv_rows["frozen"]["clears_control"] is None
    assert "does not clear the control" in csv_rows["adamw"]["notes"]
    md = (tmp_path / "o" / "results.md").read_text()
    assert "does not clear the control" in _table(md)["adamw"]["notes"]
    assert "control" in _table(md)["frozen"]["notes"]
    assert "[not below the control]" in md
    assert "> **Warning:** AdamW" in md and "does not beat the control" in md and "--max-steps 24" in md
    text = "\n".join(logged)
    assert "warning: AdamW" in text and "warning: not below the control" in text and "ranking (val ppl)" in text


def test_no_warning_when_adamw_clears_the_control_widely(data, tmp_path):
    """The control at a learning rate too small to move anything: AdamW clears it by far more than 20%, and no
    budget warning is written."""
    corpus, cache = data
    logged = []
    cfg = CompareConfig(base=fast_config(corpus, cache, max_steps=6), methods=["adamw"],
                        method_opts={"adamw": {"lr": 1e-2}, "frozen": {"lr": 1e-7}}, out=str(tmp_path / "o"),
                        isolate=False, progress=False)
    rows = run_compare(cfg, log=logged.append)
    by = {r["method"]: r for r in rows}
    assert by["adamw"]["val_ppl"] < (1 - MIN_CONTROL_MARGIN) * by["frozen"]["val_ppl"]
    assert by["frozen"]["lr"] == pytest.approx(1e-7) and by["frozen"]["lr_source"] == "--set"
    md = (tmp_path / "o" / "results.md").read_text()
    assert "**Warning:**" not in md and by["adamw"]["clears_control"] is True
    assert not any(line.startswith("warning:") for line in logged)
    assert any(line.startswith("control (frozen): val ppl") and "AdamW is" in line for line in logged)


# ------------------------------------------------------------------------------------------------ seeds


def test_seed_statistics_from_per_seed_rows():
    runs = [_row("adamw", 20.0, seed=0, state_mib=1.0, cpu_time_s=3.0),
            _row("adamw", 22.0, seed=1, state_mib=1.0, cpu_time_s=5.0),
            _row("adamw", 27.0, seed=2, state_mib=1.0, cpu_time_s=4.0),
            {"method": "adamw", "seed": 3, "status": "diverged", "val_loss": float("nan"),
             "val_ppl": float("nan")}]
    r = aggregate_seeds(runs)
    assert r["seeds"] == 4 and r["seeds_ok"] == 3 and r["seed_problems"] == ["seed 3 diverged"]
    assert r["val_ppl"] == pytest.approx(23.0)
    assert r["val_ppl_std"] == pytest.approx(statistics.stdev([20.0, 22.0, 27.0]))
    assert (r["val_ppl_min"], r["val_ppl_max"]) == (20.0, 27.0)
    losses = [math.log(x) for x in (20.0, 22.0, 27.0)]
    assert r["val_loss"] == pytest.approx(statistics.mean(losses))
    assert r["val_loss_std"] == pytest.approx(statistics.stdev(losses))
    assert r["cpu_time_s"] == pytest.approx(4.0) and r["status"] == "ok"
    one = aggregate_seeds([_row("galore", 30.0, seed=0)])
    assert one["val_ppl"] == 30.0 and one["val_ppl_std"] is None and one["seeds_ok"] == 1
    none = aggregate_seeds([{"method": "x", "seed": 0, "status": "failed: ValueError: no"}])
    assert none["status"].startswith("failed") and math.isnan(none["val_ppl"])


def test_gaps_inside_the_noise():
    a = aggregate_seeds([_row("a", 16.6, seed=0), _row("a", 16.9, seed=1)])
    b = aggregate_seeds([_row("b", 16.8, seed=0), _row("b", 17.1, seed=1)])  # overlaps a
    c = aggregate_seeds([_row("c", 17.8, seed=0), _row("c", 18.0, seed=1)])  # apart from both
    assert inside_noise(a, b) and not inside_noise(b, c) and not inside_noise(a, c)
    assert noise_pairs([c, b, a]) == [("a", "b")]
    assert ranking_text([c, b, a]) == "a (16.8 ± 0.2) ~ b (17.0 ± 0.2) < c (17.9 ± 0.1)"
    single = aggregate_seeds([_row("d", 16.7, seed=0)])
    assert inside_noise(a, single) is None  # one seed: the spread is unknown


# ------------------------------------------------------------------------------------------------ lr sweep


def test_choose_lr_picks_the_lowest_validation_loss():
    pts = [{"lr": 1e-3, "val_loss": 5.0, "status": "ok"}, {"lr": 2e-3, "val_loss": 4.5, "status": "ok"},
           {"lr": 4e-3, "val_loss": float("nan"), "status": "diverged"},
           {"lr": 8e-3, "val_loss": 4.0, "status": "failed: RuntimeError: x"},
           {"lr": 5e-4, "val_loss": 4.5, "status": "ok"}]
    assert choose_lr(pts)["lr"] == 5e-4  # the lowest loss; a tie goes to the smaller lr
    assert choose_lr(pts[:2])["lr"] == 2e-3
    assert choose_lr(pts[2:4]) is None


@pytest.fixture(scope="module")
def tuned(data, tmp_path_factory):
    """A tuned, two-seed comparison with GaLore at full rank."""
    corpus, cache = data
    out = tmp_path_factory.mktemp("tuned") / "o"
    logged = []
    cfg = CompareConfig(base=fast_config(corpus, cache, max_steps=6), methods=["adamw", "galore"],
                        method_opts={"galore": {"rank": 128}}, out=str(out), isolate=False, progress=False,
                        tune_lr=True, lr_grid=(0.5, 1.0, 2.0), tune_fraction=0.5, seeds=2, lr_extensions=0)
    rows = run_compare(cfg, log=logged.append)
    return cfg, rows, out, logged


def test_lr_sweep_choice_is_used_and_shown(tuned):
    cfg, rows, out, _ = tuned
    sweep = read_results(out / "lr_sweep.csv")
    assert {r["method"] for r in sweep} == {"frozen", "adamw", "galore"}
    results = {r["method"]: r for r in read_results(out / "results.csv")}
    table = _table((out / "results.md").read_text())
    for m in ("frozen", "adamw", "galore"):
        pts = [p for p in sweep if p["method"] == m]
        grid = [1.0, 3.0, 10.0, 30.0] if m == "frozen" else [0.5, 1.0, 2.0]  # the control has its own grid
        assert [p["multiplier"] for p in pts] == grid and all(p["steps"] == 3 for p in pts)
        assert len({p["val_loss"] for p in pts}) == len(grid)  # the grid points really differ
        best = min(pts, key=lambda p: p["val_loss"])
        assert [p["chosen"] for p in pts] == [p is best for p in pts]
        assert results[m]["lr"] == pytest.approx(best["lr"])
        assert results[m]["lr_multiplier"] == best["multiplier"] and results[m]["lr_source"].startswith("tuned")
        assert table[m]["lr from"].startswith(f"tuned (x{best['multiplier']:g} of")
        assert float(table[m]["lr"]) == pytest.approx(best["lr"], rel=1e-5)
        for seed in (0, 1):  # the full runs ran at the chosen lr
            log = (out / "runs" / m / f"seed{seed}" / "metrics.jsonl").read_text()
            assert f'"peak_lr": {best["lr"]!r}' in log
    assert results["frozen"]["lr"] / 1e-3 == results["frozen"]["lr_multiplier"]  # tuned around AdamW's lr
    md = (out / "results.md").read_text()
    assert "Learning-rate sweep (3 of 6 steps" in md and "![lr sweep](lr_sweep.png)" in md
    img = matplotlib.image.imread(out / "lr_sweep.png")
    assert img.shape[:2] == (500, 800) and (img[..., :3].min(axis=-1) < 0.9).mean() > 0.01
    import json
    doc = json.loads((out / "lr_sweep.json").read_text())
    assert doc["methods"]["adamw"]["grid"] == [0.5, 1.0, 2.0] and doc["steps"] == 3
    assert doc["methods"]["adamw"]["chosen_lr"] == pytest.approx(results["adamw"]["lr"])


def test_seed_rows_and_their_statistics(tuned):
    _, rows, out, logged = tuned
    per_seed = read_results(out / "results_per_seed.csv")
    results = {r["method"]: r for r in read_results(out / "results.csv")}
    for m, r in results.items():
        runs = [x for x in per_seed if x["method"] == m]
        assert [x["seed"] for x in runs] == [0.0, 1.0]
        ppl = [x["val_ppl"] for x in runs]
        assert ppl[0] != ppl[1]  # the seed changes the initialisation and the batches
        assert r["seeds"] == 2 and r["val_ppl"] == pytest.approx(statistics.mean(ppl), rel=1e-12)
        assert r["val_ppl_std"] == pytest.approx(statistics.stdev(ppl), rel=1e-9)
        assert (r["val_ppl_min"], r["val_ppl_max"]) == (min(ppl), max(ppl))
        assert r["val_loss"] == pytest.approx(statistics.mean(x["val_loss"] for x in runs), rel=1e-12)
    md = (out / "results.md").read_text()
    table = _table(md)
    for m, r in results.items():
        assert table[m]["ppl min-max"] == f"{r['val_ppl_min']:.2f}-{r['val_ppl_max']:.2f}"
        assert float(table[m]["ppl std"]) == pytest.approx(r["val_ppl_std"], abs=0.006)
    assert "seeds 0-1" in md and "mean ± std" in md
    assert ("Inside the noise" in md) or ("Every gap is larger than the noise" in md)
    assert any(line.startswith("ranking (val ppl, mean ± std): ") for line in logged)


def test_full_rank_projector_is_warned_and_marked(tuned):
    _, rows, out, logged = tuned
    results = {r["method"]: r for r in read_results(out / "results.csv")}
    assert "full-rank: rank 128" in results["galore"]["notes"] and "not low-rank" in results["galore"]["notes"]
    assert "full-rank" not in results["adamw"]["notes"]
    md = (out / "results.md").read_text()
    assert "full-rank" in _table(md)["galore"]["notes"]
    assert "> **Warning:** galore: full-rank" in md
    assert any(line.startswith("warning: galore: full-rank") for line in logged)


def test_full_rank_detection():
    model = models.build_model("tiny", VOCAB, 32, seed=0, device="meta")  # hidden 128, MLP 352
    found = full_rank_weights(model, make_optimizer(model, "galore", rank=128))
    assert len(found) == 14 and all(r == 128 and min(shape) == 128 for _, shape, r in found)
    assert full_rank_weights(model, make_optimizer(model, "galore", rank=127)) == []
    assert full_rank_weights(model, make_optimizer(model, "galore")) == []  # default rank: hidden / 4 = 32
    # density: a share of the smaller side; density 1 keeps all of it
    assert len(full_rank_weights(model, make_optimizer(model, "galore", density=1.0))) == 14
    # blockwise FRUGAL and BAdam select whole tensors, not a subspace of one: never marked
    assert full_rank_weights(model, make_optimizer(model, "frugal", density=1.0)) == []
    assert full_rank_weights(model, make_optimizer(model, "adamw")) == []
    assert len(baseline_full_rank_weights(model, 128)) == 14 and baseline_full_rank_weights(model, 64) == []
    from slimopt.peers import available_peers
    if available_peers().get("galore-torch") is None:  # installed: its groups carry a plain "rank"
        assert len(full_rank_weights(model, make_optimizer(model, "galore-torch", rank=128))) == 14
        assert full_rank_weights(model, make_optimizer(model, "galore-torch", rank=64)) == []


# ------------------------------------------------------------------------------------------------ the command


def test_cli_options_and_bad_input(data, tmp_path, capsys):
    corpus, cache = data
    out = tmp_path / "cmp"
    common = ["compare", "--data", str(corpus), "--vocab-size", str(VOCAB), "--cache-dir", str(cache),
              "--seq-len", "32", "--batch-size", "8", "--eval-tokens", "1024", "--max-steps", "2", "--out", str(out),
              "--no-progress", "--in-process", "--methods", "adamw"]
    for extra, message in ((["--seeds", "0"], "--seeds must be an integer >= 1"),
                           (["--tune-lr", "--lr-grid", ","], "--lr-grid is empty"),
                           (["--tune-lr", "--lr-grid", "1,abc"], "--lr-grid: 'abc' is not a number"),
                           (["--tune-lr", "--lr-grid", "1,-2"], "--lr-grid multipliers must be positive"),
                           (["--tune-lr", "--lr-grid", "1,1"], "--lr-grid lists a multiplier twice"),
                           (["--tune-fraction", "0"], "--tune-fraction must be in (0, 1]"),
                           (["--lr-grid", "1,2"], "--lr-grid sets up --tune-lr, which was not given"),
                           (["--control-lr-grid", ""], "--control-lr-grid is empty"),
                           (["--no-control", "--control-lr-grid", "1"], "which --no-control leaves out")):
        assert main(common + extra) == 2, extra
        assert message in capsys.readouterr().err, extra
    assert not out.exists()

    assert main(common + ["--tune-lr", "--lr-extensions", "-1"]) == 2
    assert "--lr-extensions must be an integer >= 0" in capsys.readouterr().err
    assert main(common + ["--no-control", "--tune-lr", "--lr-grid", "1/2,1", "--tune-fraction", "0.5",
                          "--lr-extensions", "0"]) == 0
    text = capsys.readouterr().out
    assert "no control row" in text and "tune adamw lr 0.0005 (x0.5)" in text
    rows = read_results(out / "results.csv")
    assert [r["method"] for r in rows] == ["adamw"] and rows[0]["lr_source"].startswith("tuned")
    assert "No control row (--no-control)" in (out / "results.md").read_text()
    sweep = read_results(out / "lr_sweep.csv")
    assert [(p["multiplier"], p["steps"]) for p in sweep] == [(0.5, 1.0), (1.0, 1.0)]


def test_a_failing_sweep_point_keeps_the_others(data, tmp_path):
    corpus, cache = data
    cfg = CompareConfig(base=fast_config(corpus, cache, max_steps=4), methods=["signsgd"], control=False,
                        out=str(tmp_path / "o"), isolate=False, progress=False, tune_lr=True,
                        lr_grid=(1.0, 1e33), tune_fraction=0.5,  # x1e33: the weights overflow to inf
                        lr_extensions=0)
    rows = run_compare(cfg, log=lambda *_: None)
    sweep = read_results(tmp_path / "o" / "lr_sweep.csv")
    assert [p["status"] for p in sweep] == ["ok", "diverged"] and [p["chosen"] for p in sweep] == [True, False]
    assert rows[0]["status"] == "ok" and rows[0]["lr"] == pytest.approx(3e-4)
    assert "diverged" in (tmp_path / "o" / "results.md").read_text()


# ------------------------------------------------------------------------------------- grid extension


def _points(losses: dict[float, float | None]) -> list[dict]:
    return [{"multiplier": m, "lr": m * 1e-3, "val_loss": v, "status": "ok" if v is not None else "diverged"}
            for m, v in losses.items()]


def test_extension_goes_past_the_edge_the_best_sits_on():
    grid = (0.25, 0.5, 1.0, 2.0, 4.0)
    rising = _points({m: 5.0 - m * 0.1 for m in grid})  # best at the largest multiplier
    assert extension_multiplier(rising) == 8.0 and on_grid_edge(rising)
    falling = _points({m: 5.0 + m for m in grid})  # best at the smallest
    assert extension_multiplier(falling) == 0.125 and on_grid_edge(falling)
    inside = _points({0.25: 5.0, 0.5: 4.0, 1.0: 4.5})
    assert extension_multiplier(inside) is None and not on_grid_edge(inside)
    # a diverged point beyond the best is a point tried: the best is inside what was tried
    beyond = _points({1.0: 5.0, 2.0: 4.0, 4.0: None})
    assert extension_multiplier(beyond) is None and not on_grid_edge(beyond)
    assert extension_multiplier(_points({1.0: None, 2.0: None})) == 0.5  # every point diverged: go lower
    crashed = [{"multiplier": 1.0, "lr": 1e-3, "val_loss": None, "status": "failed: RuntimeError: x"}]
    assert extension_multiplier(crashed) is None  # a crash says nothing about the lr
    assert extension_multiplier(_points({1.0: 4.0})) is None  # one point: no direction


@pytest.fixture()
def synthetic_loss(monkeypatch):
    """compare's training replaced by a loss of the learning rate alone, (log2(lr / optimum))^2 + 1, where each
    method's optimum is set by the test: the real sweep, extension, report and files, without training."""
    from slimopt.compare import runner
    optimum: dict[str, float] = {}

    def fake_train(tc):
        loss = math.log2(tc.lr / optimum.get(tc.method, 1e-3)) ** 2 + 1.0
        return {"val_loss": loss, "val_ppl": math.exp(loss), "val_tokens": 1024, "state_bytes": 8.0,
                "state_bytes_per_param": 8.0, "peak_mem_bytes": 2**20, "peak_mem_kind": "synthetic",
                "tokens_per_s": 1.0, "wall_time_s": 0.0, "cpu_time_s": 0.0, "lr": tc.lr, "steps": 1, "tokens": 1,
                "trainable_params": 1, "params": 1, "device": "cpu", "history": {"train": [], "eval": []}}

    monkeypatch.setattr(runner, "train", fake_train)
    return optimum


def test_the_extension_finds_an_optimum_beyond_the_grid(data, tmp_path, synthetic_loss):
    corpus, cache = data
    base_lr = 1e-3  # adamw's paper lr: the grid's x1 (the setting is not the default one)
    synthetic_loss.update(adamw=base_lr * 11, signsgd=3e-4 * 100)  # signsgd (paper lr 3e-4): beyond 3 doublings
    logged = []
    cfg = CompareConfig(base=fast_config(corpus, cache, max_steps=4), methods=["adamw", "signsgd"], control=False,
                        out=str(tmp_path / "o"), isolate=False, progress=False, tune_lr=True,
                        lr_grid=(0.25, 0.5, 1.0, 2.0, 4.0), tune_fraction=0.5)
    rows = {r["method"]: r for r in run_compare(cfg, log=logged.append)}
    import json
    doc = json.loads((tmp_path / "o" / "lr_sweep.json").read_text())["methods"]
    # adamw: x4 on the edge, then x8 and x16; x16 is worse than x8 (the optimum is x11), so it stops there
    assert doc["adamw"]["extended"] == [8.0, 16.0] and not doc["adamw"]["edge"]
    assert doc["adamw"]["chosen_multiplier"] == 8.0 and rows["adamw"]["lr"] == pytest.approx(8 * base_lr)
    assert "grid extended" in rows["adamw"]["notes"] and "edge" not in rows["adamw"]["notes"]
    # signsgd: x100 lies beyond three doublings (x32): marked as still on the edge
    assert doc["signsgd"]["extended"] == [8.0, 16.0, 32.0] and doc["signsgd"]["edge"]
    assert rows["signsgd"]["lr_multiplier"] == 32.0
    assert "even after extending the grid" in rows["signsgd"]["notes"]
    md = (tmp_path / "o" / "results.md").read_text()
    assert "(on the edge)" in md and " x32 |" in md
    assert any("signsgd: best at the edge of x0.25, x0.5, x1, x2, x4, x8, x16; trying x32" in line for line in logged)
    sweep = read_results(tmp_path / "o" / "lr_sweep.csv")
    assert sorted(p["multiplier"] for p in sweep if p["method"] == "signsgd") == [0.25, 0.5, 1, 2, 4, 8, 16, 32]


# ------------------------------------------------------------------------------------ memory at scale


def test_planned_memory_columns_and_chart_equal_slimopt_memory(data, tmp_path, synthetic_loss, monkeypatch):
    """The table's and the chart's planned columns are `slimopt memory`'s figures for the same method, settings
    and model; a baseline the planner does not model gets none; the chart shows the plan, not the RSS panel."""
    import json

    from slimopt.compare import plots
    corpus, cache = data
    drawn = {}
    real_save = plots.save_figure

    def keep(fig, path):
        drawn[Path(path).name] = [[(p.get_y() + p.get_height() / 2, p.get_width()) for p in ax.patches]
                                  for ax in fig.axes], [ax.get_xlabel() for ax in fig.axes]
        return real_save(fig, path)

    monkeypatch.setattr(plots, "save_figure", keep)
    methods = ["adamw", "ternary_adamw", "adamw+codec=int8", "galore", "lora"]
    out = tmp_path / "o"
    assert main(["compare", "--data", str(corpus), "--cache-dir", str(cache), "--vocab-size", str(VOCAB),
                 "--seq-len", "32", "--batch-size", "8", "--max-steps", "2", "--eval-tokens", "512", "--in-process",
                 "--no-control", "--no-progress", "--methods", ",".join(methods), "--set", "galore.rank=64",
                 "--plan-model", "1b", "--plan-gpu-memory", "6GiB", "--out", str(out)]) == 0
    rows = {r["method"]: r for r in read_results(out / "results.csv")}
    table = _table((out / "results.md").read_text())
    for entry, (method, sets) in {"adamw": ("adamw", []), "ternary_adamw": ("ternary_adamw", []),
                                  "adamw+codec=int8": ("adamw", ["--set", "adamw.codec=int8"]),
                                  "galore": ("galore", ["--set", "galore.rank=64"])}.items():
        mem = tmp_path / f"mem-{entry}"
        assert main(["memory", "--model", "1b", "--method", method, "--batch", "1", "--seq", "256", "--layerwise",
                     "--gpu-memory", "6GiB", "--out", str(mem), *sets]) == 0
        plan = json.loads((mem / "memory.json").read_text())["plans"][0]
        state, peak = (plan["state"] + plan["projections"]) / 2**30, plan["peak"] / 2**30
        assert rows[entry]["plan_state_gib"] == pytest.approx(state, rel=1e-9), entry
        assert rows[entry]["plan_peak_gib"] == pytest.approx(peak, rel=1e-9), entry
        assert rows[entry]["plan_fits"] is (plan["peak"] <= 6 * 2**30) and rows[entry]["plan_model"] == "llama-1b"
        assert table[entry]["planned state GiB (1b)"] == f"{state:.2f}"
        assert table[entry]["planned peak GiB (1b)"] == f"{peak:.2f}"
        assert table[entry]["fits 6GiB"] == ("yes" if rows[entry]["plan_fits"] else "no")
    assert {rows[m]["plan_fits"] for m in ("adamw", "ternary_adamw")} == {True, False}  # the budget separates them
    assert rows["lora"]["plan_state_gib"] is None and table["lora"]["planned peak GiB (1b)"] == ""
    # the chart: the right panel draws the planned state and peak of every planned row, in table order
    bars, labels = drawn["memory.png"]
    assert "planned at llama-1b" in labels[1] and "measured" in labels[0]
    widths = sorted(round(w, 9) for _, w in bars[1])
    want = sorted(round(rows[m][k], 9) for m in rows if rows[m]["plan_state_gib"] is not None
                  for k in ("plan_state_gib", "plan_peak_gib"))
    assert widths == want
    assert "`slimopt memory --model 1b --method adamw --dtype bf16 --batch 1 --seq 256 --layerwise --gpu-memory 6GiB`" \
        in (out / "results.md").read_text()


def test_plan_options_bad_input(data, tmp_path, capsys):
    corpus, cache = data
    common = ["compare", "--data", str(corpus), "--cache-dir", str(cache), "--vocab-size", str(VOCAB),
              "--max-steps", "2", "--methods", "adamw", "--no-control", "--out", str(tmp_path / "o")]
    assert main(common + ["--plan-gpu-memory", "24"]) == 2
    assert "--plan-gpu-memory='24' has no unit" in capsys.readouterr().err
    assert main(common + ["--plan-model", "5b"]) == 2
    assert "unknown model '5b'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
