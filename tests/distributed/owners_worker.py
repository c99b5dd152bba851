"""Whole-matrix work under FSDP2 done once, by owner ranks: Muon's iteration and the svd / randomized_svd
refreshes, against one process and against the eager step's schemes.

    python -m torch.distributed.run --nproc_per_node W tests/distributed/owners_worker.py --out DIR

A small LLaMA (hidden 64, MLP 176, 4 heads with 2 key-value heads: matrices of 64 x 64, 32 x 64, 176 x 64 and
64 x 176) with one more weight of 3 x 64 (fewer rows than ranks at W = 4). Muon on every matrix of the blocks and
on the 3 x 64 one (AdamW on the rest), with the iteration in fp32 and in bf16; GaLore (svd) and GaLore with the
randomized range finder at rank 8, refreshing at steps 1 and 3 (left bases for the wide matrices, right ones for
the tall). Injected gradients (``common.gradient``), STEPS steps. Per rank and step it records how many matrices
this rank iterated or decomposed, the matrix-product FLOPs of ``step()`` (torch.utils.flop_counter), the bytes
its collectives sent against ``fsdp_comm.expected_bytes``; the same counts for one process and for the eager
step (``fused=False``: every rank iterates, the first rank decomposes); and the largest difference of the weights
and the bases from one process. Rank 0 writes DIR/owners_<W>.json.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as C  # noqa: E402

import slimopt  # noqa: E402
from slimopt.bench.fsdp_comm import CollectiveCounter, expected_bytes  # noqa: E402
from slimopt.optim.algorithm import muon  # noqa: E402
from slimopt.optim.algorithm import projectors as P  # noqa: E402
from slimopt.optim.distributed import owners  # noqa: E402
from slimopt.optim.distributed import sharded as S  # noqa: E402
from slimopt.optim.distributed.sharded_bases import rows_of_basis  # noqa: E402

STEPS = 3


def make_model():
    model = C.small_llama(key_value_heads=2)
    model.model.tiny = nn.Linear(64, 3, bias=False)  # 3 rows: at 4 ranks one rank holds none
    return model


def build(model, case: str, fused: bool = True):
    if case.startswith("galore"):
        return slimopt.build(model, case, rank=8, update_gap=2, fused=fused)
    ns_dtype = case.split("_")[1]
    matrices = [p for n, p in model.named_parameters() if p.dim() == 2 and ("layers." in n or "tiny" in n)]
    rest = [p for p in model.parameters() if all(p is not q for q in matrices)]
    return slimopt.SlimOptimizer([dict(params=matrices, rule="muon", momentum=0.95, ns_dtype=ns_dtype),
                                  dict(params=rest)], lr=1e-2, weight_decay=0.1, fused=fused)


CASES = ("muon_fp32", "muon_bf16", "galore", "galore_rsvd")


class Counted:
    """Counts the matrices this rank iterates (``muon.orthogonalize_many``) or decomposes (``projectors.svd_basis``,
    ``projectors.randomized_basis``; the eager Muon step's ``orthogonalize``) while active."""

    def __init__(self) -> None:
        from slimopt.optim.algorithm import projectors
        from slimopt.optim.distributed import muon_sharded
        self.count = 0
        self._patches = [(muon, "orthogonalize_many", lambda us: len(us)), (projectors, "svd_basis", lambda *a: 1),
                         (projectors, "randomized_basis", lambda *a: 1),
                         (muon_sharded, "orthogonalize", lambda *a: 1)]
        self._orig = [getattr(mod, name) for mod, name, _ in self._patches]

    def __enter__(self):
        for (mod, name, how_many), orig in zip(self._patches, self._orig):
            def counted(*args, _orig=orig, _how_many=how_many, **kwargs):
                self.count += _how_many(*args[:1])
                return _orig(*args, **kwargs)
            setattr(mod, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for (mod, name, _), orig in zip(self._patches, self._orig):
            setattr(mod, name, orig)


def counted_step(model, opt, step: int) -> tuple[int, int]:
    """(matrix-product FLOPs, matrices iterated or decomposed) of this rank's ``step()``."""
    from torch.utils.flop_counter import FlopCounterMode
    C.set_grads(model, step)
    with Counted() as counted, FlopCounterMode(display=False) as fc:
        opt.step()
    opt.zero_grad(set_to_none=True)
    return fc.get_total_flops(), counted.count


def sharded(mesh, case: str, fused: bool = True):
    from torch.distributed.fsdp import fully_shard
    model = make_model()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, build(model, case, fused)


def bases_diff(ref_opt, opt) -> float:
    """The largest difference between this rank's bases and its part of one process's."""
    diff = 0.0
    compared = 0
    for ref_p, p in zip(whole_group(ref_opt)["params"], whole_group(opt)["params"]):
        if "proj" not in opt.state[p]:
            continue
        compared += 1
        side = P.side_for(p.shape, whole_group(opt)["proj_side"])
        # this rank's part: a left basis's rows of the parameter, a right one's chunk of its n rows
        want = rows_of_basis(ref_opt.state[ref_p]["proj"], side, S.rows_of(p))
        got = opt.state[p]["proj"]
        diff = max(diff, (got - want).abs().max().item() if got.numel() else 0.0)
    return diff if compared or whole_group(opt)["projector"] not in ("svd", "randomized_svd") else float("nan")


def whole_group(opt) -> dict:
    """The group whose matrices take whole-matrix work (Muon's, or GaLore's projectable one)."""
    return next(g for g in opt.param_groups if g["rule"] == "muon" or g["projector"] != "none")


def main() -> None:
    args, mesh, world, rank = C.start_ranks()
    report: dict = {}
    try:
        from torch.utils.flop_counter import FlopCounterMode
        for case in CASES:
            ref = make_model()
            ref_opt = build(ref, case)
            model, opt = sharded(mesh, case)
            eager_model, eager_opt = sharded(mesh, case, fused=False)
            matrices = [p for p in whole_group(opt)["params"] if p.dim() == 2]
            costs = [owners.muon_cost(*p.shape, 5) for p in matrices]
            steps = []
            for step in range(1, STEPS + 1):
                one_process, one_count = counted_step(ref, ref_opt, step)
                eager_flops, eager_count = counted_step(eager_model, eager_opt, step)
                C.set_grads(model, step)
                want = sum(expected_bytes(opt, world, step, rank))
                with Counted() as counted, CollectiveCounter() as counter, FlopCounterMode(display=False) as fc:
                    opt.step()
                opt.zero_grad(set_to_none=True)
                mine = {"counted": counted.count, "flops": fc.get_total_flops(), "sent": counter.total_bytes(),
                        "expected": want, "calls": counter.calls(), "eager_counted": eager_count,
                        "eager_flops": eager_flops}
                everyone = [None] * world
                dist.all_gather_object(everyone, mine)
                steps.append({"ranks": everyone, "one_process_flops": one_process, "one_process_counted": one_count})
            want_p, got = C.full_params(ref), C.full_params(model)
            diff = max((got[n] - want_p[n]).abs().max().item() for n in want_p)
            equal = all(torch.equal(got[n], want_p[n]) for n in want_p)
            basis_diffs = [None] * world
            dist.all_gather_object(basis_diffs, bases_diff(ref_opt, opt))
            report[case] = {"steps": steps, "max_diff": diff, "bit_equal": equal, "basis_diff": max(basis_diffs),
                            "matrices": len(matrices), "largest_job_flops": 2 * max(costs),
                            "routes": sorted({opt.explain(p)[0] for p in model.parameters()})}
        C.write_report(args.out, f"owners_{world}.json", report, rank)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
