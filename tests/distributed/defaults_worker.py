"""Every named method at its default settings (the fast routes: ``fused=True``) under FSDP2 equals one process.

    python -m torch.distributed.run --nproc_per_node W tests/distributed/defaults_worker.py --out DIR

A small LLaMA whose every row shard holds whole quantization blocks at 1, 2 and 4 ranks (hidden 64, MLP 176,
vocabulary 128: 2,048-element shards of the embedding at 4 ranks, 2,816 of the MLP weights), so the shards store
the blocks one process stores; injected gradients (``common.gradient``), the same in every process. Each method
steps STEPS times sharded and in one process (on every rank: the model is small), with ``update_gap=2`` where it
has a projector or blocks (refreshes and block turns at steps 1 and 3) and GaLore at rank 16 (its default 128 is
the whole side here); the fp32 weights must agree within ``TOLERANCE``, and so must a factored second moment's
column means once the step's running all-reduce is settled. Rank 0 writes DIR/defaults_<W>.json: each method's
largest difference, and every route its parameters took (``SlimOptimizer.explain``).
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as C  # noqa: E402

import slimopt  # noqa: E402
from slimopt.optim.distributed import sharded as S  # noqa: E402

STEPS = 4
TOLERANCE = 1e-6


def settings(method: str) -> dict:
    from slimopt.optim.algorithm.specs import METHODS
    spec = METHODS[method]
    hp = {}
    if any(s.get("projector", "none") != "none" for s in (spec.projectable, spec.rest)):
        hp["update_gap"] = 2
    if method.startswith("galore"):
        hp["rank"] = 16
    return hp


def main() -> None:
    from torch.distributed.fsdp import fully_shard
    args, mesh, world, rank = C.start_ranks()
    report = {}
    try:
        for method in slimopt.methods():
            ref = C.small_llama()
            ref_opt = slimopt.build(ref, method, **settings(method))
            model = C.small_llama()
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = slimopt.build(model, method, **settings(method))
            C.run_steps(ref, ref_opt, 1, STEPS)
            C.run_steps(model, opt, 1, STEPS)
            want, got = C.full_params(ref), C.full_params(model)
            diff = max((got[n] - want[n]).abs().max().item() for n in want)
            routes = sorted({opt.explain(p)[0] for p in model.parameters()})
            # a factored v's column sums are left summing over the ranks after the step (read by the next one):
            # settled, its column means are one process's
            left_running = len(opt._later)
            opt.settle()
            ref_cols = {n: ref_opt.state[p] for n, p in ref.named_parameters()}

            def mine(whole, p):  # this rank's chunk of a factored moment's column means
                chunk = S.chunks_of(S.rows_of(p), whole.numel())
                return whole[chunk.start: chunk.stop]
            col_diff = max([(st[k] - mine(ref_cols[n][k], p)).abs().max().item() if st[k].numel() else 0.0
                            for n, p in model.named_parameters() for st in [opt.state[p]] for k in st
                            if k.endswith("_col")], default=0.0)
            report[method] = {"max_diff": diff, "routes": routes, "left_running": left_running,
                              "col_diff": col_diff}
            if not (diff <= TOLERANCE and col_diff <= TOLERANCE):
                raise AssertionError(f"{method} at {world} ranks: the weights differ from one process by {diff:.3e} "
                                     f"(column means {col_diff:.3e}) "
                                     f"(allowed {TOLERANCE:.0e}; routes {routes})")
        C.write_report(args.out, f"defaults_{world}.json", report, rank)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
