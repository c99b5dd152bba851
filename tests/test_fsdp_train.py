"""`slimopt train --fsdp` under torchrun with 2 CPU processes (gloo): a run stopped after a checkpoint and resumed
ends bit-identical to one never stopped (tests/distributed/train_worker.py), and the run equals a single-process
run without FSDP on the same global batch, to float rounding."""

from __future__ import annotations

import json

import pytest
import torch
from launch import run_torchrun, run_worker
from pretrain_helpers import fast_config, write_corpus
from safetensors.torch import load_file

from slimopt.train.logger import read_jsonl
from slimopt.train.loop import train




@pytest.mark.slow
def test_fsdp_training_resumes_exactly_and_equals_one_process(tmp_path):
    corpus, cache = write_corpus(tmp_path), tmp_path / "cache"
    method, opt = "frugal", {"update_gap": 2, "density": 0.5}  # blocks switch between the checkpoint and resume
    text = run_worker(2, "train_worker.py", tmp_path / "fsdp", "--corpus", str(corpus), "--cache", str(cache),
                      "--method", method, *[a for k, v in opt.items() for a in ("--opt", f"{k}={v}")])
    assert "resume: ok" in text, text[-3000:]
    summary = json.loads((tmp_path / "fsdp" / "summary.json").read_text())
    assert summary["full"]["world_size"] == 2 and summary["full"]["steps"] == 6
    assert summary["full"]["state_bytes"] > 0

    single = tmp_path / "single"
    train(fast_config(corpus, cache, method=method, opt=opt, max_steps=6, batch_size=8, grad_accum=2,
                      eval_every=2, out=str(single), save_model=True))
    log = read_jsonl(single / "metrics.jsonl")
    assert summary["losses"] == pytest.approx([r["loss"] for r in log if r["event"] == "train"], rel=1e-5)
    assert summary["val"] == pytest.approx([r["val_loss"] for r in log if r["event"] == "eval"], rel=1e-5)
    a = load_file(tmp_path / "fsdp" / "full" / "final" / "model.safetensors")
    b = load_file(single / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:  # signSGD turns rounding-level gradient differences into lr-sized steps on ~0 entries
        assert torch.allclose(a[k], b[k], atol=1e-2, rtol=0), (k, (a[k] - b[k]).abs().max().item())
    # the state is sharded: the single-process run holds what the two ranks hold together, up to replicated steps
    assert summary["full"]["state_bytes"] == pytest.approx(json.loads(
        [line for line in (single / "metrics.jsonl").read_text().splitlines() if '"final"' in line][-1]
    )["state_bytes"], rel=0.01)


@pytest.mark.slow
def test_fsdp_training_under_torchrun_at_one_rank_starts_and_resumes(tmp_path):
    # one rank under torchrun is how a multi-GPU command is tried on one GPU; it must join torchrun's rendezvous
    # (the agent's store), not start a group of its own on a port nobody serves (a 30-minute hang before)
    corpus, out = write_corpus(tmp_path, chapters=40), tmp_path / "one"
    args = ["-m", "slimopt", "train", "--fsdp", "--model", "tiny", "--data", str(corpus), "--vocab-size", "512",
            "--seq-len", "32", "--batch-size", "8", "--eval-tokens", "512", "--save-every", "2", "--threads", "1",
            "--no-progress", "--no-save-model", "--cache-dir", str(tmp_path / "cache"), "--out", str(out)]
    run_torchrun(1, *args, "--max-steps", "2", timeout=180)
    assert (out / "checkpoint.dcp").is_dir()
    run_torchrun(1, *args, "--max-steps", "2", "--resume", timeout=180)
    steps = [r["step"] for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "train"]
    assert steps and max(steps) == 2
