"""What makes ``slimopt finetune`` honest, without training: the learning-rate sweep and its extension, the chosen
run reused as the first seed's, seeds aggregated, the control's verdicts; and the peak of an iteration counted
tensor by tensor (bench/iteration_peak.py) against torch's MemTracker and the planner."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from slimopt.compare.protocol import HEAD, SCORE, aggregate, control_verdicts, run_method, seed_list


def _runs(loss_of_lr, fail=()):
    """A fake run: validation loss from the lr, a score from the seed; raises for (lr, seed) in `fail`."""
    calls = []

    def one(lr, seed):
        calls.append((lr, seed))
        if (lr, seed) in fail:
            raise RuntimeError("boom")
        score = 0.5 + seed / 10
        return {"task": "t", "method": "m", "status": "ok", "metric": "accuracy", "score": score,
                "metrics": {"accuracy": score}, "eval_loss": loss_of_lr(lr), "train_loss": 1.0, "s_per_step": 1.0,
                "train_s": 2.0, "lr": lr, "seed": seed}

    return one, calls


def _run(one, grid=(0.5, 1.0, 2.0), extensions=3, seeds=(0, 1, 2)):
    return run_method(one, "t", "m", 1e-3, "default", list(seeds), grid, extensions, lambda line: None)


def test_the_best_lr_inside_the_grid_is_kept_and_its_run_is_the_first_seeds():
    one, calls = _runs(lambda lr: math.log(lr / 1e-3) ** 2)  # lowest at 1e-3, the grid's middle
    row = _run(one)
    assert row["lr"] == pytest.approx(1e-3) and row["lr_source"] == "tuned: x1 of 0.001 (default)"
    # three grid runs on seed 0, then seeds 1 and 2 at the chosen lr: the chosen grid run is seed 0's run
    assert calls == [(5e-4, 0), (1e-3, 0), (2e-3, 0), (1e-3, 1), (1e-3, 2)]
    assert [r["seed"] for r in row["runs"]] == [0, 1, 2] and row["runs"][0]["lr"] == pytest.approx(1e-3)
    assert [p["chosen"] for p in row["sweep"]] == [False, True, False]


def test_a_best_lr_on_the_edge_extends_by_factors_of_two_at_most_n_times():
    one, calls = _runs(lambda lr: -lr)  # always better higher
    row = _run(one, extensions=2, seeds=(0,))
    assert [lr for lr, _ in calls] == pytest.approx([5e-4, 1e-3, 2e-3, 4e-3, 8e-3])
    assert row["lr"] == pytest.approx(8e-3) and len(row["runs"]) == 1
    one, calls = _runs(lambda lr: lr)  # always better lower
    row = _run(one, extensions=1, seeds=(0,))
    assert [lr for lr, _ in calls] == pytest.approx([5e-4, 1e-3, 2e-3, 2.5e-4])
    assert row["lr"] == pytest.approx(2.5e-4)


def test_without_a_grid_every_seed_runs_at_the_base_lr():
    one, calls = _runs(lambda lr: 1.0)
    row = _run(one, grid=None)
    assert calls == [(1e-3, 0), (1e-3, 1), (1e-3, 2)]
    assert row["lr_source"] == "default" and row["sweep"] == []


def test_seeds_are_aggregated_and_a_failed_seed_is_counted_not_averaged():
    one, _ = _runs(lambda lr: 1.0, fail={(1e-3, 1)})
    row = _run(one, grid=None)
    assert (row["seeds"], row["seeds_ok"]) == (3, 2)
    assert row["score"] == pytest.approx((0.5 + 0.7) / 2) and row["metrics"]["accuracy"] == pytest.approx(0.6)
    assert (row["score_min"], row["score_max"]) == (0.5, pytest.approx(0.7))
    assert row["score_std"] == pytest.approx(math.sqrt(0.02))
    assert row["runs"][1]["status"] == "failed: boom"
    with pytest.raises(ValueError, match="at least one run"):
        aggregate([], SCORE)


def test_seed_list_and_control_verdicts():
    assert seed_list(3, 2) == [3, 4]
    rows = [{"task": "a", "method": HEAD, "status": "ok", "score": 0.6},
            {"task": "a", "method": "adamw", "status": "ok", "score": 0.9},
            {"task": "a", "method": "taco", "status": "ok", "score": 0.6},
            {"task": "a", "method": "lora", "status": "failed: x"},
            {"task": "b", "method": "adamw", "status": "ok", "score": 0.1}]
    assert control_verdicts(rows, SCORE, HEAD, group="task") == {
        ("a", "adamw"): True, ("a", "taco"): False, ("a", "lora"): None, ("b", "adamw"): None}


# ---------------------------------------------------------------------------------------------- memory


def _classifier():
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=176, pad_token_id=0, num_labels=5)
    batch = {"input_ids": torch.randint(1, 1024, (4, 32)), "attention_mask": torch.ones(4, 32, dtype=torch.long),
             "labels": torch.tensor([0, 1, 2, 3])}
    return LlamaForSequenceClassification(cfg), batch


def _stepped(model, method, batch, **settings):
    from slimopt.factory import make_optimizer

    opt = make_optimizer(model, method, **settings)
    model(**batch).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return opt


@pytest.mark.parametrize("method", ["adamw", "adamw8bit", "galore"])
def test_the_counted_peak_equals_memtrackers_and_the_planners_is_close(method):
    from torch.distributed._tools.mem_tracker import MemTracker

    from slimopt.bench.iteration_peak import measure_peak, planned_peak

    model, batch = _classifier()
    twin, _ = _classifier()  # the same seed: the same weights, batch and state after one step
    settings = {"rank": 8, "update_gap": 100, "scale": 4.0} if method == "galore" else {}
    opt, twin_opt = _stepped(model, method, batch, **settings), _stepped(twin, method, batch, **settings)
    counted = measure_peak(model, opt, batch)
    tracker = MemTracker()
    tracker.track_external(twin, twin_opt)
    with tracker:
        twin(**batch).loss.backward()
        twin_opt.step()
        twin_opt.zero_grad(set_to_none=True)
    tracked = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert counted == pytest.approx(tracked, rel=2e-3)
    # the planner assumes attention without T x T scores; a padding mask sends SDPA down its math path on a CPU,
    # which keeps them (2 layers x 4 x 4 x 32 x 32 fp32 here: a few % of a tiny model, ~1% of SmolLM2's peak)
    assert 0.9 < planned_peak(model, method, settings, 4, 32) / counted <= 1.0


def test_a_frozen_body_plans_only_the_heads_input_and_lora_trains_adapters():
    from slimopt.baselines import apply_lora
    from slimopt.bench.iteration_peak import measure_peak
    from slimopt.bench.planner import plan

    model, batch = _classifier()
    head = copy.deepcopy(model).requires_grad_(False)
    head.score.requires_grad_(True)
    full, frozen = plan(model, "adamw", batch=4, seq=32), plan(head, "adamw", batch=4, seq=32)
    assert frozen.activations == 4 * 32 * 64 * 4 and frozen.activations < full.activations / 40
    assert frozen.state == 2 * 4 * head.score.weight.numel() + 8
    counted = measure_peak(head, _stepped(head, "adamw", batch), batch)
    weights = sum(p.numel() * 4 for p in head.parameters())
    assert weights < counted < weights + full.activations / 2  # nothing of the body's forward is kept
    lora = apply_lora(copy.deepcopy(model), rank=4, alpha=16)
    counted = measure_peak(lora, _stepped(lora, "adamw", batch), batch)
    assert plan(lora, "adamw", batch=4, seq=32).peak == pytest.approx(counted, rel=0.05)
