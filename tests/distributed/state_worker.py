"""Optimizer state per rank under FSDP2: every rank's ``slimopt.state_nbytes`` after one step of each method.

    python -m torch.distributed.run --nproc_per_node W tests/distributed/state_worker.py --out DIR

The LLaMA of issue 45 (hidden 96, MLP 256, 2 layers, vocabulary 512; GaLore at rank 8: its 96 x 256 down
projections are projected from the left, its other matrices from the right), every decoder layer and the root
sharded by ``fully_shard``, gradients injected (``common.set_grads``). Rank 0 writes DIR/state_<W>.json: method ->
every rank's state bytes. tests/test_fsdp_state.py compares them with one process's.
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as C  # noqa: E402

import slimopt  # noqa: E402

METHODS = ("galore", "galore8bit", "frugal", "adamw8bit", "muon8bit", "taco", "ternary_adamw")


def make_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=96, intermediate_size=256, num_attention_heads=4,
                      num_hidden_layers=2, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def settings(method: str) -> dict:
    return {"rank": 8} if method.startswith("galore") else {}


def build(model, method: str):
    return slimopt.build(model, method, **settings(method))


def main() -> None:
    from torch.distributed.fsdp import fully_shard
    args, mesh, world, rank = C.start_ranks()
    report = {}
    try:
        for method in METHODS:
            model = make_model()
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = build(model, method)
            C.set_grads(model, 1)
            opt.step()
            opt.settle()  # the factored column sums it left running: done before the next method and the exit
            everyone = [None] * world
            dist.all_gather_object(everyone, slimopt.state_nbytes(opt))
            report[method] = everyone
        C.write_report(args.out, f"state_{world}.json", report, rank)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
