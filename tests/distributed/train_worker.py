"""`slimopt train --fsdp` under torchrun: a run stopped after a checkpoint and resumed ends bit-identical to one
never stopped. tests/test_fsdp_train.py launches it:

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/train_worker.py --corpus C --cache D \
        --out DIR --method frugal --opt update_gap=2 --opt density=0.5

In one launch: (1) an uninterrupted run into DIR/full; (2) the same run into DIR/broken, stopped by an exception
after step CRASH (checkpoints every SAVE_EVERY steps); (3) --resume of DIR/broken. Losses, evaluations and the
final model of (3) must equal (1) exactly; rank 0 writes DIR/summary.json for the test to compare with one
process.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pretrain_helpers import fast_config  # noqa: E402

from slimopt.options import parse_opt  # noqa: E402
from slimopt.train.logger import read_jsonl  # noqa: E402
from slimopt.train.loop import train  # noqa: E402
from slimopt.train.process_group import init_process_group  # noqa: E402

STEPS, SAVE_EVERY, CRASH = 6, 2, 3


class Stop(Exception):
    pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--cache", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--method", required=True)
    ap.add_argument("--opt", action="append")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)
    init_process_group("gloo", timeout=datetime.timedelta(seconds=180))
    rank = dist.get_rank()
    base = dict(method=args.method, opt=parse_opt(args.opt), max_steps=STEPS, batch_size=8, grad_accum=2,
                eval_every=2, save_every=SAVE_EVERY, fsdp=True, save_model=True, device="cpu")
    cfg = fast_config(args.corpus, args.cache, **base)
    try:
        full = train(cfg.__class__(**{**cfg.__dict__, "out": os.path.join(args.out, "full")}))

        def crash(step, record):
            if step == CRASH:
                raise Stop(f"stopped after step {step}")

        broken = cfg.__class__(**{**cfg.__dict__, "out": os.path.join(args.out, "broken")})
        try:
            train(broken, callback=crash)
            raise AssertionError("the run was not stopped")
        except Stop:
            pass
        resumed = train(cfg.__class__(**{**broken.__dict__, "resume": True}))
        a = read_jsonl(os.path.join(args.out, "full", "metrics.jsonl"))
        b = read_jsonl(os.path.join(args.out, "broken", "metrics.jsonl"))
        if rank == 0:
            pick = lambda log, ev, k: [r[k] for r in log if r["event"] == ev]  # noqa: E731
            if pick(a, "train", "loss") != pick(b, "train", "loss") or pick(a, "eval", "val_loss") != pick(
                    b, "eval", "val_loss"):
                raise AssertionError(f"resumed curves differ: {pick(a, 'train', 'loss')} vs "
                                     f"{pick(b, 'train', 'loss')}")
            from safetensors.torch import load_file
            ma = load_file(os.path.join(args.out, "full", "final", "model.safetensors"))
            mb = load_file(os.path.join(args.out, "broken", "final", "model.safetensors"))
            bad = [k for k in ma if not torch.equal(ma[k], mb[k])]
            if bad:
                raise AssertionError(f"resumed final weights differ: {bad[:5]}")
            with open(os.path.join(args.out, "summary.json"), "w") as f:
                json.dump({"full": {k: v for k, v in full.items() if k != "history"},
                           "resumed": {k: v for k, v in resumed.items() if k != "history"},
                           "losses": pick(a, "train", "loss"), "val": pick(a, "eval", "val_loss")}, f)
            print("resume: ok", flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
