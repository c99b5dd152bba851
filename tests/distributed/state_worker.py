"""Optimizer state per rank under FSDP2: every rank's ``slimopt.state_nbytes`` after one step of each method.

    python -m torch.distributed.run --nproc_per_node W tests/distributed/state_worker.py --out DIR

The LLaMA of issue 45 (hidden 96, MLP 256, 2 layers, vocabulary 512; GaLore at rank 8: its 96 x 256 down
projections are projected from the left, its other matrices from the right), every decoder layer and the root
sharded by ``fully_shard``, gradients injected (``common.set_grads``). Rank 0 writes DIR/state_<W>.json: method ->
every rank's state bytes. tests/test_fsdp_state.py compares them with one process's. It also writes
DIR/taco_whole_<W>.json: how many of TACO's history tensors a checkpoint holding them whole (the form before each
rank kept only its columns) loaded, each equal to the rank's own columns.
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


def sharded_model(mesh):
    from torch.distributed.fsdp import fully_shard
    model = make_model()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def load_whole_taco_history(model, opt, mesh, folder: str) -> int:
    """Save `opt`'s state with TACO's history whole on every rank (a plain tensor, as checkpoints held it before
    the history was split by columns), load it into a fresh model and optimizer, and require every rank's columns
    of it back, bit for bit. Returns the tensors compared."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from slimopt.optim.algorithm import taco
    from slimopt.optim.distributed import distcheckpoint, portable

    with portable.portable_state(opt):
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    from torch.distributed.tensor import DTensor
    for entries in state["optim"]["state"].values():
        for key in taco.KEYS:
            if key in entries:  # gloo gathers no float8: its bytes are gathered
                t = entries[key]
                raw = DTensor.from_local(t.to_local().view(torch.uint8), t.device_mesh, t.placements,
                                         shape=t.shape, stride=t.stride()) if t.element_size() == 1 else t
                entries[key] = raw.full_tensor().view(t.dtype)
    dcp.save(state, checkpoint_id=folder)
    fresh = sharded_model(mesh)
    fresh_opt = build(fresh, "taco")
    distcheckpoint.load(folder, fresh, fresh_opt)
    count = 0
    for p, q in zip(model.parameters(), fresh.parameters()):
        for key in taco.KEYS:
            if key in opt.state[p]:
                a, b = opt.state[p][key], fresh_opt.state[q][key]
                if a.shape != b.shape or not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
                    raise AssertionError(f"{key} of a {tuple(p.shape)} weight differs after loading it whole")
                count += 1
    return count


def main() -> None:
    args, mesh, world, rank = C.start_ranks()
    report = {}
    try:
        for method in METHODS:
            model = sharded_model(mesh)
            opt = build(model, method)
            C.set_grads(model, 1)
            opt.step()
            opt.settle()  # the factored column sums it left running: done before the next method and the exit
            everyone = [None] * world
            dist.all_gather_object(everyone, slimopt.state_nbytes(opt))
            report[method] = everyone
            if method == "taco":
                folder = os.path.join(args.out, "taco_whole")
                C.write_report(args.out, f"taco_whole_{world}.json",
                               {"compared": load_whole_taco_history(model, opt, mesh, folder)}, rank)
        C.write_report(args.out, f"state_{world}.json", report, rank)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
