"""Every named method at its default settings (the fast routes: ``fused=True``) under FSDP2 equals one process.

    python -m torch.distributed.run --nproc_per_node W tests/distributed/defaults_worker.py --out DIR

A small LLaMA whose every row shard holds whole quantization blocks at 1, 2 and 4 ranks (hidden 64, MLP 176,
vocabulary 128: 2,048-element shards of the embedding at 4 ranks, 2,816 of the MLP weights), so the shards store
the blocks one process stores; injected gradients (``common.gradient``), the same in every process. Each method
steps STEPS times sharded and in one process (on every rank: the model is small), with ``update_gap=2`` where it
has a projector or blocks (refreshes and block turns at steps 1 and 3) and GaLore at rank 16 (its default 128 is
the whole side here); the fp32 weights must agree within ``TOLERANCE``. Rank 0 writes DIR/defaults_<W>.json:
each method's largest difference, and every route its parameters took (``SlimOptimizer.explain``).
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as C  # noqa: E402

import slimopt  # noqa: E402

STEPS = 4
TOLERANCE = 1e-6


def make_model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=176, num_attention_heads=4,
                      num_key_value_heads=4, num_hidden_layers=2, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def settings(method: str) -> dict:
    from slimopt.optim.algorithm.specs import METHODS
    spec = METHODS[method]
    hp = {}
    if any(s.get("projector", "none") != "none" for s in (spec.projectable, spec.rest)):
        hp["update_gap"] = 2
    if method.startswith("galore"):
        hp["rank"] = 16
    return hp


def full_params(model) -> dict[str, torch.Tensor]:
    from slimopt.optim.distributed import sharded as S
    return {n: (p.full_tensor() if S.is_sharded(p) else p.detach()).clone() for n, p in model.named_parameters()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    report = {}
    try:
        for method in slimopt.methods():
            ref = make_model()
            ref_opt = slimopt.build(ref, method, **settings(method))
            model = make_model()
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = slimopt.build(model, method, **settings(method))
            C.run_steps(ref, ref_opt, 1, STEPS)
            C.run_steps(model, opt, 1, STEPS)
            want, got = full_params(ref), full_params(model)
            diff = max((got[n] - want[n]).abs().max().item() for n in want)
            routes = sorted({opt.explain(p)[0] for p in model.parameters()})
            report[method] = {"max_diff": diff, "routes": routes}
            if not diff <= TOLERANCE:
                raise AssertionError(f"{method} at {world} ranks: the weights differ from one process by {diff:.3e} "
                                     f"(allowed {TOLERANCE:.0e}; routes {routes})")
        if rank == 0:
            with open(os.path.join(args.out, f"defaults_{world}.json"), "w") as f:
                json.dump(report, f, indent=1)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
