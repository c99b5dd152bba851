"""Muon under FSDP2 with each matrix orthogonalized by one owner rank, against one process and the all-gather
scheme.

    python -m torch.distributed.run --nproc_per_node W tests/distributed/owners_worker.py --out DIR

A small LLaMA (hidden 64, MLP 176, 4 heads with 2 key-value heads: matrices of 64 x 64, 32 x 64, 176 x 64 and
64 x 176) with one more weight of 3 x 64 (fewer rows than ranks at W = 4), Muon on every matrix of the blocks and
on the 3 x 64 one, AdamW on the rest. Injected gradients (``common.gradient``), STEPS steps, once with the
iteration in fp32 and once in bf16. Per rank and step it records how many matrices this rank iterated, the
matrix-product FLOPs of ``step()`` (torch.utils.flop_counter), the bytes its collectives sent against
``fsdp_comm.expected_bytes``; the same FLOPs for one process and for the eager step's all-gather scheme
(``fused=False``); and the largest difference of the weights from one process. Rank 0 writes DIR/owners_<W>.json.
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
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as C  # noqa: E402

import slimopt  # noqa: E402
from slimopt.bench.fsdp_comm import CollectiveCounter, expected_bytes  # noqa: E402
from slimopt.optim.algorithm import muon  # noqa: E402
from slimopt.optim.distributed import owners  # noqa: E402
from slimopt.optim.distributed import sharded as S  # noqa: E402

STEPS = 3


def make_model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=176, num_attention_heads=4,
                      num_key_value_heads=2, num_hidden_layers=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    model.model.tiny = nn.Linear(64, 3, bias=False)  # 3 rows: at 4 ranks one rank holds none
    return model


def build(model, ns_dtype: str, fused: bool = True):
    matrices = [p for n, p in model.named_parameters() if p.dim() == 2 and ("layers." in n or "tiny" in n)]
    rest = [p for p in model.parameters() if all(p is not q for q in matrices)]
    return slimopt.SlimOptimizer([dict(params=matrices, rule="muon", momentum=0.95, ns_dtype=ns_dtype),
                                  dict(params=rest)], lr=1e-2, weight_decay=0.1, fused=fused)


def full_params(model) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if S.is_sharded(p) else p.detach()).clone() for n, p in model.named_parameters()}


class Iterated:
    """Counts the matrices ``muon.orthogonalize_many`` iterates on this rank while active."""

    def __init__(self) -> None:
        self.count = 0
        self._orig = muon.orthogonalize_many

    def __enter__(self):
        def counted(us, *args, **kwargs):
            self.count += len(us)
            return self._orig(us, *args, **kwargs)
        muon.orthogonalize_many = counted
        return self

    def __exit__(self, *exc) -> None:
        muon.orthogonalize_many = self._orig


def flops_of_step(model, opt, step: int) -> int:
    from torch.utils.flop_counter import FlopCounterMode
    C.set_grads(model, step)
    with FlopCounterMode(display=False) as fc:
        opt.step()
    opt.zero_grad(set_to_none=True)
    return fc.get_total_flops()


def sharded(mesh, ns_dtype: str, fused: bool = True):
    from torch.distributed.fsdp import fully_shard
    model = make_model()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, build(model, ns_dtype, fused)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    from torch.distributed.device_mesh import init_device_mesh
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    report: dict = {}
    try:
        for ns_dtype in ("fp32", "bf16"):
            ref = make_model()
            ref_opt = build(ref, ns_dtype)
            model, opt = sharded(mesh, ns_dtype)
            gather_model, gather_opt = sharded(mesh, ns_dtype, fused=False)
            jobs = [owners.muon_cost(*p.shape, 5) for p in opt.param_groups[0]["params"]]
            steps = []
            for step in range(1, STEPS + 1):
                one_process = flops_of_step(ref, ref_opt, step)
                gathered = flops_of_step(gather_model, gather_opt, step)
                C.set_grads(model, step)
                want = sum(expected_bytes(opt, world, step, rank))
                from torch.utils.flop_counter import FlopCounterMode
                with Iterated() as iterated, CollectiveCounter() as counter, FlopCounterMode(display=False) as fc:
                    opt.step()
                opt.zero_grad(set_to_none=True)
                mine = {"iterated": iterated.count, "flops": fc.get_total_flops(), "sent": counter.total_bytes(),
                        "expected": want, "calls": counter.calls()}
                everyone = [None] * world
                dist.all_gather_object(everyone, mine)
                steps.append({"ranks": everyone, "one_process_flops": one_process, "all_gather_flops": gathered})
            want_p, got = full_params(ref), full_params(model)
            diff = max((got[n] - want_p[n]).abs().max().item() for n in want_p)
            equal = all(torch.equal(got[n], want_p[n]) for n in want_p)
            report[ns_dtype] = {"steps": steps, "max_diff": diff, "bit_equal": equal,
                                "matrices": len(jobs), "largest_job_flops": 2 * max(jobs),
                                "routes": sorted({opt.explain(p)[0] for p in model.parameters()})}
        if rank == 0:
            with open(os.path.join(args.out, f"owners_{world}.json"), "w") as f:
                json.dump(report, f, indent=1)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
