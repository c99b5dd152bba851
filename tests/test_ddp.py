"""Data-parallel training: `slimopt train` under torchrun with 2 CPU processes (gloo) equals a single-process
run on the same global batch, and the ranks stay identical (same blocks, same subspaces)."""

from __future__ import annotations

import os

import pytest
import torch
from launch import run_python, run_torchrun
from pretrain_helpers import VOCAB, fast_config
from safetensors.torch import load_file

from slimopt.train.logger import read_jsonl
from slimopt.train.loop import train



def _torchrun(args: list[str], out) -> None:
    run_torchrun(2, "-m", "slimopt", "train", *args, "--out", str(out), timeout=600)


@pytest.mark.parametrize("method,opt", [
    ("adamw", []),
    # FRUGAL draws its state-full blocks at random: the ranks must draw the same ones (ranks_agree).
    pytest.param("frugal", ["--update-gap", "2"], marks=pytest.mark.slow),
])
def test_two_processes_equal_one(data, tmp_path, method, opt):
    corpus, cache = data
    steps, batch, accum = 4, 8, 2
    args = ["--model", "tiny", "--data", str(corpus), "--vocab-size", str(VOCAB), "--seq-len", "32",
            "--batch-size", str(batch), "--grad-accum", str(accum), "--max-steps", str(steps), "--eval-every", "2",
            "--eval-tokens", "1024", "--method", method, *opt, "--device", "cpu", "--threads", "1",
            "--cache-dir", str(cache), "--no-progress"]
    ddp_out, single_out = tmp_path / "ddp", tmp_path / "single"
    _torchrun(args, ddp_out)

    # The same global batch in one process: grad-accum 2 of 4-sequence micro-batches, vs 2 ranks x 2 x 2.
    opt_dict = {"update_gap": 2} if opt else {}
    train(fast_config(corpus, cache, method=method, opt=opt_dict, max_steps=steps, batch_size=batch,
                      grad_accum=accum, eval_every=2, out=str(single_out), save_model=True))

    ddp_log, single_log = read_jsonl(ddp_out / "metrics.jsonl"), read_jsonl(single_out / "metrics.jsonl")
    final = ddp_log[-1]
    assert final["event"] == "final" and final["world_size"] == 2 and final["ranks_agree"] is True
    ddp_loss = [r["loss"] for r in ddp_log if r["event"] == "train"]
    one_loss = [r["loss"] for r in single_log if r["event"] == "train"]
    assert len(ddp_loss) == steps
    # Rank slices + all-reduce sum the same per-sequence gradients in another order: equal to float rounding.
    assert ddp_loss == pytest.approx(one_loss, rel=1e-5)
    ddp_val = [r["val_loss"] for r in ddp_log if r["event"] == "eval"]
    one_val = [r["val_loss"] for r in single_log if r["event"] == "eval"]
    assert ddp_val == pytest.approx(one_val, rel=1e-5)

    a = load_file(ddp_out / "final" / "model.safetensors")
    b = load_file(single_out / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        # signSGD (FRUGAL's state-free part) turns a rounding-level gradient difference into a full lr-sized
        # step on entries whose gradient is ~0, hence the looser bound there.
        # Adam divides by sqrt(v): where gradients are tiny the first steps amplify rounding, up to ~1/10 of a step.
        tol = 1e-4 if method == "adamw" else 1e-2
        assert torch.allclose(a[k], b[k], atol=tol, rtol=0), (k, (a[k] - b[k]).abs().max().item())
    far = sum(((a[k] - b[k]).abs() > 1e-4).sum().item() for k in a) / sum(v.numel() for v in a.values())
    assert far < 0.01  # all but a sliver of entries agree to rounding


_GROUP_FREED = """
import glob, os, sys, tempfile
import torch, torch.distributed as dist
from slimopt.train.process_group import init_process_group
store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
init_process_group("gloo", store=store, rank=0, world_size=1)
def run():  # as train does: the DDP model gone when the run returns
    net = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))  # imports torch._dynamo
    net(torch.ones(2, 4)).sum().backward()
run()
dist.destroy_process_group()
print(sorted(open(f).read().strip() for f in glob.glob("/proc/self/task/*/comm")))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="lists threads through /proc")
def test_destroyed_group_leaves_no_gloo_thread():
    # A group still referenced after destroy_process_group keeps gloo's worker threads running into interpreter
    # shutdown, where one can abort the process (slimopt.train.process_group); destroyed, none is left.
    out = run_python("-c", _GROUP_FREED, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    threads = out.stdout.strip().splitlines()[-1]
    assert "gloo" not in threads, threads
