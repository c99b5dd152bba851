"""Optimizer state per rank under FSDP2 against one process's state divided by the ranks, per method.

FSDP2 exists so that a rank holds 1/W of the model's state; state that spans a weight's rows (a left projection's
subspace moments, a factored second moment's column statistics, TACO's per-column state) can break that. This
script starts `--world` ranks (gloo on CPU), each holding a LLaMA sharded by ``fully_shard`` (every decoder layer
and the root), takes one backward of a fixed batch and one optimizer step per method, and counts
``slimopt.state_nbytes`` on every rank; the same model and step in one process gives the reference. It prints, per
method, every rank's bytes, one process's bytes and the busiest rank's ratio to one process's bytes / W (1.00:
sharded exactly; W: replicated).

    python benchmarks/fsdp_state.py --world 2,4 --out benchmarks/results/fsdp_state_cpu.json

Models (``--models``): ``tiny96``, a LLaMA of hidden size 96, MLP 256, 2 layers, vocabulary 512, GaLore rank 8
(its down projections, 96 x 256, are projected from the left); ``small``, the bench's small LLaMA (hidden 256, MLP
688, 4 layers, vocabulary 8192; GaLore at its default rank).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from datetime import datetime, timezone

import torch
import torch.distributed as dist
from ranks import spawn_ranks

METHODS = ("galore", "galore8bit", "frugal", "adamw8bit", "muon8bit", "taco", "ternary_adamw")
MODELS = ("tiny96", "small")


def _model(name: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    from slimopt.models.llama import build_model
    if name == "tiny96":
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=512, hidden_size=96, intermediate_size=256, num_attention_heads=4,
                          num_hidden_layers=2, tie_word_embeddings=False)
        return LlamaForCausalLM(cfg)
    return build_model(name, 8192, 64, seed=0)


def _settings(model: str, method: str) -> dict:
    return {"rank": 8} if model == "tiny96" and method.startswith("galore") else {}


def _backward(model) -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (2, 32), generator=gen)
    model(input_ids=ids, labels=ids).loss.backward()


def _state_bytes(model_name: str, methods: list[str], sharded: bool) -> dict[str, int]:
    from torch.distributed.fsdp import fully_shard

    import slimopt
    out = {}
    for method in methods:
        model = _model(model_name)
        if sharded:
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
        _backward(model)
        opt = slimopt.build(model, method, **_settings(model_name, method))
        opt.step()
        out[method] = slimopt.state_nbytes(opt)
    return out


def _rank(rank: int, world: int, port: int, models: list[str], methods: list[str], queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from slimopt.train.process_group import init_process_group
    init_process_group("gloo", rank=rank, world_size=world)
    mine = {m: _state_bytes(m, methods, True) for m in models}
    queue.put((rank, mine))
    dist.destroy_process_group()


def per_rank(world: int, models: list[str], methods: list[str]) -> dict[int, dict]:
    """rank -> model -> method -> state bytes on that rank, from `world` spawned gloo ranks."""
    return spawn_ranks(_rank, world, models, methods)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", default="2,4", help="comma-separated rank counts (default 2,4)")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--out", default=None, help="a JSON file for the results")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    models = [m for m in args.models.split(",") if m]
    methods = [m for m in args.methods.split(",") if m]
    worlds = [int(w) for w in args.world.split(",")]
    one = {m: _state_bytes(m, methods, False) for m in models}
    result = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "versions": {"torch": torch.__version__}, "one_process": one, "runs": {}}
    print("| model | method | one process | " + " | ".join(f"W={w}: bytes per rank, busiest / (one / W)"
                                                           for w in worlds) + " |")
    print("|---|---|---:|" + "---:|" * len(worlds))
    runs = {w: per_rank(w, models, methods) for w in worlds}
    for model in models:
        for method in methods:
            cells = []
            for w in worlds:
                ranks = [runs[w][r][model][method] for r in range(w)]
                ratio = max(ranks) / (one[model][method] / w)
                result["runs"].setdefault(str(w), {}).setdefault(model, {})[method] = {"ranks": ranks,
                                                                                         "busiest_ratio": ratio}
                cells.append(f"{', '.join(f'{b:,}' for b in ranks)}; {ratio:.2f}")
            print(f"| {model} | {method} | {one[model][method]:,} | " + " | ".join(cells) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
