"""`slimopt train` with int8 weights (--weights int8, --int8-embeddings) and a host master (--offload host) or
none: a run cut short and resumed equals the unbroken one, after a real kill -9 too; the final model is a plain
transformers model."""

from dataclasses import replace

import pytest
import torch
from pretrain_helpers import Crash, crash_at, fast_config, killed_and_resumed, train_losses
from transformers import AutoModelForCausalLM

from slimopt.train.checkpoint import load_checkpoint
from slimopt.train.loop import train


def _same_checkpoints(a, b):
    ca, cb = load_checkpoint(a / "checkpoint.pt"), load_checkpoint(b / "checkpoint.pt")
    assert ca["step"] == cb["step"]
    for k in ca["model"]:
        assert torch.equal(ca["model"][k], cb["model"][k]), k
    masters_a, masters_b = ca["optimizer"]["masters"], cb["optimizer"]["masters"]
    assert masters_a.keys() == masters_b.keys()
    for name, m in masters_a.items():
        pairs = zip(m, masters_b[name]) if isinstance(m, (tuple, list)) else [(m, masters_b[name])]
        assert all(torch.equal(x, y) for x, y in pairs), name
    sa, sb = ca["optimizer"]["optimizer"]["state"], cb["optimizer"]["optimizer"]["state"]
    assert all(torch.equal(v, sb[i][k]) for i in sa for k, v in sa[i].items() if isinstance(v, torch.Tensor))


@pytest.mark.parametrize("offload,method,more", [
    ("host", "adamw8bit", {}), ("host", "galore", {}), ("none", "adamw", {}),
    # a 3-byte master, and the loss a vocabulary slice at a time (the output layer's gradient by rows)
    ("host", "adamw8bit", {"master": "bf16+int8", "vocab_slice": 100}),
    # the input embedding and the output layer in int8 too
    ("host", "ternary_adamw", {"int8_embeddings": True}), ("none", "adamw", {"int8_embeddings": True}),
], ids=["host-adamw8bit", "host-galore", "device-adamw", "host-bf16+int8-sliced", "host-ternary-embeddings",
        "device-adamw-embeddings"])
def test_interrupted_and_resumed_equals_uninterrupted(data, tmp_path, offload, method, more):
    corpus, cache = data
    cfg = fast_config(corpus, cache, method=method, opt={"update_gap": 3} if method == "galore" else {},
                      max_steps=8, save_every=3, weights="int8", offload=offload, grad_accum=2, **more)
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    ref = train(replace(cfg, out=str(whole)))
    with pytest.raises(Crash):
        train(replace(cfg, out=str(broken)), callback=crash_at(5))  # the last checkpoint: step 3
    res = train(replace(cfg, out=str(broken), resume=True))
    _same_checkpoints(whole, broken)
    assert train_losses(whole) == train_losses(broken) and res["val_loss"] == ref["val_loss"]
    assert ref["trainable_params"] == ref["params"]  # the int8 weights' masters count as trainable


@pytest.mark.parametrize("embeddings", [False, True], ids=["body", "and-embeddings"])
def test_the_final_model_loads_as_a_plain_llama_with_the_masters_weights(data, tmp_path, embeddings):
    corpus, cache = data
    out = tmp_path / "run"
    train(fast_config(corpus, cache, max_steps=3, weights="int8", offload="host", save_model=True, out=str(out),
                      resume=True, int8_embeddings=embeddings))
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    checkpoint = load_checkpoint(out / "checkpoint.pt")
    assert ("model.embed_tokens.weight_codes" in checkpoint["model"]) == embeddings
    saved = checkpoint["optimizer"]["masters"]
    for name, master in saved.items():
        assert torch.equal(model.get_parameter(name), master), name


def test_a_loss_in_vocabulary_slices_trains_as_the_whole_one(data):
    corpus, cache = data
    whole = train(fast_config(corpus, cache, max_steps=4))
    sliced = train(fast_config(corpus, cache, max_steps=4, vocab_slice=100))
    assert sliced["val_loss"] == pytest.approx(whole["val_loss"], rel=1e-4)


@pytest.mark.parametrize("change,message", [
    ({"weights": "int4"}, "--weights must be one of"), ({"offload": "disk"}, "--offload must be one of"),
    ({"weights": "int8", "offload": "host", "master": "fp16"}, "--master must be one of"),
    ({"int8_group": 32}, "--int8-group needs --weights int8"), ({"vocab_slice": -1}, "--vocab-slice"),
    ({"weights": "int8", "method": "torch-adamw"}, "slimopt methods"),
    ({"weights": "int8", "fsdp": True}, "one process"),
    ({"int8_embeddings": True}, "--int8-embeddings needs --weights int8"),
    ({"weights": "int8", "int8_embeddings": True, "vocab_slice": 100}, "--int8-embeddings and --vocab-slice"),
])
def test_bad_settings_name_the_option(data, change, message):
    corpus, cache = data
    with pytest.raises(ValueError, match=message):
        train(fast_config(corpus, cache, **change))


@pytest.mark.slow
def test_sigkill_then_resume_gives_the_uninterrupted_run(data, tmp_path):
    corpus, cache = data
    args = ["--model", "tiny", "--data", str(corpus), "--vocab-size", "512", "--seq-len", "32", "--batch-size", "8",
            "--max-steps", "30", "--save-every", "2", "--method", "adamw8bit", "--weights", "int8", "--offload",
            "host", "--threads", "1", "--cache-dir", str(cache), "--no-progress", "--no-save-model",
            "--eval-every", "0", "--eval-tokens", "1024"]
    whole, broken = killed_and_resumed(args, tmp_path)
    _same_checkpoints(whole, broken)
    assert train_losses(whole) == train_losses(broken)
