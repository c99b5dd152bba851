"""The pretraining loop: schedule, evaluation against a hand computation, every method lowers the loss, the CLI
end to end, and bad input failing before anything is written."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from pretrain_helpers import VOCAB, fast_config

from slimopt.catalog import known_methods
from slimopt.cli import main
from slimopt.models import llama as models
from slimopt.train.evaluate import evaluate, lm_loss
from slimopt.train.loop import train
from slimopt.train.schedule import WarmupCosine, build_scheduler, resolve_warmup

# ------------------------------------------------------------------------------------------------ schedule

def test_schedule_warmup_then_cosine_to_floor():
    f = WarmupCosine(total_steps=100, warmup_steps=10, min_ratio=0.1)
    assert [f(s) for s in range(10)] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert f(10) == pytest.approx(1.0)
    assert f(99) == pytest.approx(0.1)
    assert f(500) == pytest.approx(0.1)
    mid = 10 + (99 - 10) / 2  # half-way through the decay: the cosine is at 0
    assert WarmupCosine(100, 10, 0.1)(int(mid)) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 44 / 89)))
    decay = [f(s) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))


def test_scheduler_drives_the_optimizer_lr():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.5)
    sched = build_scheduler(opt, total_steps=20, warmup=0.1, min_lr_ratio=0.1)
    seen = []
    for _ in range(20):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    ref = WarmupCosine(20, 2, 0.1)
    assert seen == pytest.approx([0.5 * ref(s) for s in range(20)])
    assert resolve_warmup(0.1, 20) == 2 and resolve_warmup(5, 20) == 5


@pytest.mark.parametrize("kwargs", [dict(total_steps=0, warmup_steps=0), dict(total_steps=10, warmup_steps=11),
                                    dict(total_steps=10, warmup_steps=1, min_ratio=1.5)])
def test_schedule_bad_input(kwargs):
    with pytest.raises(ValueError):
        WarmupCosine(**kwargs)


# ------------------------------------------------------------------------------------------------ evaluation

def test_evaluate_is_the_true_token_mean():
    model = models.build_model("tiny", VOCAB, 16, seed=3)
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, VOCAB, (7, 16), generator=gen)
    res = evaluate(model, blocks, batch_size=3)  # batches of 3, 3, 1: a mean of batch means would be wrong

    # By hand, in float64: every block's next-token log-probabilities, summed, over the number of predictions.
    total, count, batch_means = 0.0, 0, []
    with torch.no_grad():
        for b in range(7):
            logits = model(input_ids=blocks[b:b + 1]).logits[0].double()  # [16, vocab]
            logp = torch.log_softmax(logits, dim=-1)
            nll = -logp[torch.arange(15), blocks[b, 1:]]
            total += nll.sum().item()
            count += 15
        for lo in range(0, 7, 3):
            batch_means.append(lm_loss(model, blocks[lo:lo + 3]).item())
    assert res["val_tokens"] == count == 7 * 15
    assert res["val_loss"] == pytest.approx(total / count, rel=1e-6)
    assert res["val_ppl"] == pytest.approx(math.exp(total / count), rel=1e-6)
    wrong = sum(batch_means) / len(batch_means)
    assert abs(wrong - total / count) > 1e-5  # the distinction matters on this batch
    assert model.training  # evaluate restores the mode it found


# ------------------------------------------------------------------------------------------------ methods

METHODS = ["adamw", "adamw8bit", "adamw4bit", "galore", "frugal", "frugal_rho0", "badam", "signsgd",
           "ternary_adamw", "taco", "lowrank", "lora", "relora",
           "torch-adamw", "torch-adamw-fused", "bnb-adamw8bit", "galore-torch", "apollo"]


@pytest.mark.parametrize("method", METHODS)
def test_a_few_steps_lower_the_loss(data, method):
    if method not in known_methods():
        pytest.skip(f"{method} not available in this installation")
    corpus, cache = data
    opt = {"update_gap": 4} if method in ("galore", "frugal", "badam", "galore-torch", "apollo") else {}
    if method == "relora":
        opt = {"restart_every": 5, "restart_warmup": 1}
    lr = 1e-3 if method == "taco" else None  # its default, 1e-4, is a fine-tuning lr: too slow for 10 steps
    res = train(fast_config(corpus, cache, method=method, max_steps=10, opt=opt, lr=lr))
    first = res["history"]["train"][0][1]
    assert math.log(VOCAB) - 0.3 < first < math.log(VOCAB) + 0.3  # a fresh model is near-uniform
    assert res["val_loss"] < first - 0.1, (method, first, res["val_loss"])
    assert res["steps"] == 10 and res["tokens"] == 10 * 8 * 32
    assert res["state_bytes"] >= 0 and res["trainable_params"] <= res["params"]


@pytest.mark.parametrize("dtype", ["bf16-autocast", "bf16"])
def test_bf16_training_lowers_the_loss(data, dtype):
    corpus, cache = data
    res = train(fast_config(corpus, cache, method="adamw", max_steps=8, dtype=dtype))
    assert res["val_loss"] < res["history"]["train"][0][1] - 0.1


def test_state_bytes_match_the_method(data):
    corpus, cache = data
    adamw = train(fast_config(corpus, cache, method="adamw", max_steps=2))
    # fp32 exp_avg + exp_avg_sq per parameter, plus one step counter per tensor.
    assert adamw["state_bytes_per_param"] == pytest.approx(8.0, abs=0.01)
    rho0 = train(fast_config(corpus, cache, method="frugal_rho0", max_steps=2))
    assert rho0["state_bytes"] < adamw["state_bytes"]


def test_a_loaded_model_is_scored_before_training(data, tmp_path):
    """Continued pretraining is judged before and after: a loaded model's held-out loss at step 0 is in the
    summary (a size built from scratch has none), and training from it goes on from there."""
    corpus, cache = data
    trained = train(fast_config(corpus, cache, method="adamw", max_steps=6, save_model=True,
                                out=str(tmp_path / "first")))
    assert trained["start_val_ppl"] is None
    folder = next(p.parent for p in (tmp_path / "first").rglob("config.json"))
    again = train(fast_config(corpus, cache, method="adamw", max_steps=2, model=str(folder)))
    assert again["start_val_loss"] == pytest.approx(trained["val_loss"], rel=1e-5)  # the same held-out blocks
    assert again["start_val_ppl"] == pytest.approx(math.exp(again["start_val_loss"]))
    assert again["history"]["eval"][0] == (0, pytest.approx(again["start_val_loss"]))


# ------------------------------------------------------------------------------------------------ CLI

def test_cli_train_end_to_end(data, tmp_path, capsys):
    corpus, cache = data
    out = tmp_path / "run"
    rc = main(["train", "--model", "tiny", "--data", str(corpus), "--vocab-size", str(VOCAB), "--seq-len", "32",
               "--batch-size", "8", "--grad-accum", "2", "--max-steps", "6", "--eval-every", "3", "--eval-tokens",
               "1024", "--method", "frugal", "--update-gap", "2", "--density", "0.5", "--threads", "1",
               "--cache-dir", str(cache), "--out", str(out), "--no-progress"])
    assert rc == 0
    assert "frugal: 6 steps" in capsys.readouterr().out
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    events = [r["event"] for r in records]
    assert events[0] == "config" and events[-1] == "final"
    assert records[0]["config"]["opt"] == {"update_gap": 2, "density": 0.5}
    assert [r["step"] for r in records if r["event"] == "train"] == list(range(1, 7))
    assert [r["step"] for r in records if r["event"] == "eval"] == [3, 6]
    final = records[-1]
    assert final["tokens"] == 6 * 8 * 32
    lrs = [r["lr"] for r in records if r["event"] == "train"]
    assert max(lrs) == pytest.approx(1e-3)  # FRUGAL's paper lr, reached after warmup

    # The saved model and tokenizer reload and score the held-out split exactly as the run reported.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slimopt.train import data as data_mod
    reloaded = AutoModelForCausalLM.from_pretrained(out / "final")
    tok = AutoTokenizer.from_pretrained(out / "final")
    packed = data_mod.prepare_data(str(corpus), tok, 32, cache_dir=cache)
    val = torch.from_numpy(packed.val[:1024 // 32].astype("int64"))
    again = evaluate(reloaded, val, batch_size=8)
    assert again["val_loss"] == pytest.approx(final["val_loss"], rel=1e-6)


def test_methods_command_lists_slimopt_methods_and_peers(capsys):
    assert main(["methods"]) == 0
    text = capsys.readouterr().out
    assert "adamw " in text and "torch-adamw" in text and "peer" in text
    # every default lr says where it comes from; ternary_adamw's own is measured against AdamW's
    lines = {line.split()[0]: line for line in text.splitlines()[2:] if line.strip() and not line.startswith(" ")}
    assert "lr from" in text.splitlines()[0]
    assert "0.002" in lines["ternary_adamw"] and "measured ratio 2" in lines["ternary_adamw"]
    assert "GaLore paper" in lines["galore"] and "FRUGAL paper" in lines["frugal"]
    from slimopt.catalog import lr_is_papers
    assert lr_is_papers("galore") and lr_is_papers("adamw8bit") and lr_is_papers("muon")
    assert not lr_is_papers("ternary_adamw") and not lr_is_papers("taco") and not lr_is_papers("frugal_head")


# ------------------------------------------------------------------------------------------------ bad input

def _fails(args, data, tmp_path, capsys, expect: str):
    corpus, cache = data
    out = tmp_path / "never"
    base = ["train", "--data", str(corpus), "--vocab-size", str(VOCAB), "--seq-len", "32", "--batch-size", "8",
            "--max-steps", "2", "--cache-dir", str(cache), "--threads", "1", "--no-progress", "--out", str(out)]
    rc = main(base + args)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert expect in err, err
    assert not out.exists()  # nothing half-written


def test_missing_data_path(data, tmp_path, capsys):
    _fails(["--data", str(tmp_path / "no" / "such.txt")], data, tmp_path, capsys, "does not exist")


def test_unknown_method(data, tmp_path, capsys):
    _fails(["--method", "adamw_typo"], data, tmp_path, capsys, "unknown method 'adamw_typo'")


def test_unknown_model(data, tmp_path, capsys):
    _fails(["--model", "./no/such/model"], data, tmp_path, capsys, "--model")


def test_unknown_model_name(data, tmp_path, capsys):
    _fails(["--model", "huge"], data, tmp_path, capsys, "'huge'")


def test_batch_not_divisible_by_grad_accum(data, tmp_path, capsys):
    _fails(["--batch-size", "10", "--grad-accum", "4"], data, tmp_path, capsys, "--batch-size 10")


def test_seq_len_above_the_model_max(data, tmp_path, capsys):
    cfg = models.llama_config("tiny", vocab_size=VOCAB, seq_len=16)  # max_position_embeddings 16
    folder = tmp_path / "short-model"
    cfg.save_pretrained(folder)
    _fails(["--model", str(folder)], data, tmp_path, capsys, "max_position_embeddings")


def test_batch_larger_than_the_data(data, tmp_path, capsys):
    _fails(["--batch-size", "100000"], data, tmp_path, capsys, "fewer than --batch-size")


def test_bad_hyperparameter(data, tmp_path, capsys):
    _fails(["--method", "galore", "--rank", "0"], data, tmp_path, capsys, "rank")


def test_malformed_opt(data, tmp_path, capsys):
    _fails(["--opt", "rank"], data, tmp_path, capsys, "key=value")


def test_budget_given_twice(data, tmp_path):
    with pytest.raises(SystemExit):
        main(["train", "--max-steps", "2", "--tokens", "1000"])


def test_existing_run_is_not_overwritten(data, tmp_path):
    corpus, cache = data
    out = tmp_path / "run"
    train(fast_config(corpus, cache, max_steps=2, save_every=1, out=str(out)))
    before = (out / "checkpoint.pt").read_bytes()
    with pytest.raises(ValueError, match="--resume"):
        train(fast_config(corpus, cache, max_steps=2, out=str(out)))
    assert (out / "checkpoint.pt").read_bytes() == before
    cfg = fast_config(corpus, cache, max_steps=2, out=str(out), overwrite=True)
    assert train(replace(cfg, save_every=0))["steps"] == 2


# ------------------------------------------------------------------------------------------------ peers

def _one_step(model, opt):
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    lm_loss(model, x).backward()
    opt.step()
    opt.zero_grad()


def test_peer_state_bytes_count_what_is_allocated():
    from slimopt.peers import build_peer, optimizer_state_nbytes
    model = models.build_model("tiny", VOCAB, 16)
    n = sum(p.numel() for p in model.parameters())
    n_tensors = len(list(model.parameters()))

    opt = build_peer(model, "torch-adamw")
    _one_step(model, opt)
    assert optimizer_state_nbytes(opt) == 8 * n + 4 * n_tensors  # two fp32 moments + an fp32 step each

    opt = build_peer(model, "bnb-adamw8bit")
    _one_step(model, opt)
    assert 2.0 < optimizer_state_nbytes(opt) / n < 3.0  # uint8 moments (+ absmax, fp32 for tensors < 4096)

    opt = build_peer(model, "galore-torch", rank=8)
    _one_step(model, opt)
    moments = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
                  if isinstance(v, torch.Tensor))
    mats = [st["projector"].ortho_matrix for st in opt.state.values() if "projector" in st]
    # galore-torch keeps its rank-r basis as a slice of the SVD's full factor, which stays allocated: the count is
    # of the storage held, larger than the r rows in use.
    held = sum(m.untyped_storage().nbytes() for m in mats)
    assert held > sum(m.numel() * 4 for m in mats) > 0
    assert optimizer_state_nbytes(opt) == moments + held


def test_missing_peer_is_a_clear_error(monkeypatch):
    from slimopt import peers
    monkeypatch.setitem(peers.PEERS, "bnb-adamw8bit",
                        replace(peers.PEERS["bnb-adamw8bit"], package="slimopt_absent_package"))
    assert "pip install bitsandbytes" in peers.available_peers()["bnb-adamw8bit"]
    with pytest.raises(ImportError, match="pip install bitsandbytes"):
        peers.build_peer(models.build_model("tiny", VOCAB, 16), "bnb-adamw8bit")
    with pytest.raises(ValueError, match="known peers"):
        peers.build_peer(models.build_model("tiny", VOCAB, 16), "bnb-adamw9bit")
